import os
import sys

# PyTorch's CPU ops get the cores the rest of the run leaves them. Under pytest-xdist every
# worker would otherwise run one thread per core: on the GPU machine (16 cores, 8 workers) that
# is 128 threads, and test_ext_cuda.py's embedding backward cases, whose CPU references work on
# (1000, H) tables, took 3-4 s each there (H200, 2026-11-26) against ~0.1 s on a 2-core machine,
# likely that oversubscription (not re-timed yet). Without xdist, the compiles of
# test_fake_gpu_compile.py and test_csrc_compile.py keep one core busy for most of the run
# (conftest's pytest_collection_finish): the tests get the others. On the 2-core CI machine that
# is one thread, which also runs these small shapes faster than two: test_encoder_layer.py took
# 76 s with one thread beside a busy core, 86 s with two, 82 s with two and the core free
# (2026-11-28). OMP_NUM_THREADS carries the choice to the tests' child processes; a value the
# user set is kept.
_workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
_cores = os.cpu_count() or 1
_threads = max(1, _cores // _workers) if _workers > 1 else max(1, _cores - 1)
os.environ.setdefault("OMP_NUM_THREADS", str(_threads))

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


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
    # The sm_90 compiles of test_fake_gpu_compile.py and the nvcc compiles of test_csrc_compile.py
    # take minutes of one core each: start them now, in child processes, so they run beside the
    # rest of the suite. Not in a pytest-xdist worker: every worker collects every test, and
    # each would start them all; there the test that reads one starts it.
    if os.environ.get("PYTEST_XDIST_WORKER"):
        return
    module = sys.modules.get("tests.test_fake_gpu_compile")
    if module is not None:
        module.start_children(session.items)
    module = sys.modules.get("tests.test_csrc_compile")
    if module is not None:
        module.start_compiles(session.items)
