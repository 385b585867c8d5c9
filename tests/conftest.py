import os

import pytest
import torch


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture(params=["torch", "kernel"])
def staging(request, monkeypatch):
    """How cuda_graphs=True's calls reach the graphs' static buffers: PyTorch ops (the CPU's way),
    or the staging kernel (CUDA's way; here in Triton's interpreter, the model's own ops on the
    CPU). For the graph tests with the capture stubbed (test_cuda_graph.py, test_hf.py)."""
    if request.param == "kernel":
        from bert_fast.ops import graph_inputs
        from bert_fast.ops._triton import HAS_TRITON, interpreting
        if not (HAS_TRITON and interpreting()):
            pytest.skip("the staging kernel on CPU tensors needs triton and TRITON_INTERPRET=1")
        monkeypatch.setattr(graph_inputs, "uses_kernel", lambda ids: True)

        def raise_it(device, error):         # no quiet fallback to PyTorch ops here: the kernel is under test
            raise error
        monkeypatch.setattr(graph_inputs, "kernel_failed", raise_it)
    return request.param


def pytest_configure(config):
    config.addinivalue_line("markers", "reads_background: the test reads what a BackgroundProcess "
                                       "(tests/isolated.py) made; such tests run last")


def pytest_collection_modifyitems(config, items):
    # The tests that wait on a background compile run after the others, so that the compile has
    # the whole suite's time to run on the second core (an early test would wait minutes for it).
    items.sort(key=lambda item: item.get_closest_marker("reads_background") is not None)


def pytest_collection_finish(session):
    # The test modules' long child processes (BackgroundProcess: the sm_90 compiles of
    # test_fake_gpu_compile.py, the nvcc compiles of test_csrc_compile.py, the sanitizer's
    # workload, ...) start now, from each module's start_background(items), so they run beside
    # the rest of the suite. Not in a pytest-xdist worker: every worker collects every test, and
    # each would start them all; there the test that reads one starts it.
    if os.environ.get("PYTEST_XDIST_WORKER"):
        return
    modules = {getattr(item, "module", None) for item in session.items}
    for module in sorted(filter(None, modules), key=lambda m: m.__name__):
        if hasattr(module, "start_background"):
            module.start_background(session.items)
