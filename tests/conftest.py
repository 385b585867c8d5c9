import sys

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


def pytest_collection_finish(session):
    # The sm_90 compiles of test_fake_gpu_compile.py take minutes of one core each: start them
    # now, in child processes, so they run beside the rest of the suite.
    module = sys.modules.get("tests.test_fake_gpu_compile")
    if module is not None:
        module.start_children(session.items)
