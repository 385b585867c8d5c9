"""Which implementation of the ops a module runs.

  torch   fused PyTorch (SDPA, cuBLAS/MKL GEMMs): every device; the CPU default.
  triton  our Triton kernels on CUDA tensors. The same registered ops run their plain-PyTorch
          CPU twins on CPU tensors, so a "triton" model still works on the CPU.
  cuda    the compiled extension (csrc/) for the ops it has (embedding_sum, add_layernorm: CUDA
          kernels on GPU, C++ on CPU), the Triton ops for the others. Needs the extension
          built (bert_fast.extension).
  auto    (the default) decided per call from the inputs' device, so a model moved between
          devices keeps working. CUDA inputs (where Triton is installed): cuda where the
          extension is built with CUDA kernels for that GPU, else triton; triton inside our
          CUDA-graph captures (capture_encoder, cuda_graphs=True). The rest: torch. Never
          builds the extension.

Chosen per module (``backend=`` argument), else by the ``BERT_FAST_BACKEND`` environment
variable, else ``auto``. Asking for a backend this build does not have is an error that says
so, never a silent fallback.
"""

import contextlib
import os

from torch.nn.modules import module as _nn_module

from . import extension
from .ops._autograd import compile_time_constant
from .ops._triton import HAS_TRITON

BACKENDS = ("auto", "torch", "triton", "cuda")
# nn.Module's registries of global hooks (register_module_forward_hook & co.), read as
# nn.Module.__call__ reads them; getattr: not every PyTorch has every one. A fast path that
# computes modules instead of calling them (modules.py, hf.py), or a CUDA graph's replay,
# does not run them.
_GLOBAL_HOOKS = tuple(getattr(_nn_module, name, {}) for name in (
    "_global_forward_pre_hooks", "_global_forward_hooks", "_global_backward_pre_hooks", "_global_backward_hooks"))
# Whether "auto" runs CUDA inputs on our kernels (False: the torch path).
AUTO_USES_TRITON_ON_CUDA = True
# Whether it prefers the extension's kernels for the ops it has, where it is built for the GPU.
# Measured on an H200 (benchmarks/results/nvidia-h200-2026-11-26T0520-*, bf16 BERT-base): eager
# forwards as fast or 1.06-1.25x faster than with triton alone, a training step 1.13x; the
# host time of a 12-layer forward at negligible arithmetic 2747 vs 3208 us (the C++ ops'
# launch path is cheaper than Triton's launcher).
AUTO_USES_EXTENSION_ON_CUDA = True
# Whether "auto" runs Triton's kernels instead inside our CUDA-graph captures (capturing_graph):
# a replay has no host cost to save, and at a few hundred rows the extension's forward kernels
# are slower on the GPU. H200, bf16 BERT-base B1 L128 (benchmarks/results/
# nvidia-h200-2026-11-26T0725-profile.log, T0738-*): add_layernorm 4.39 vs 2.23 us a call,
# embedding_sum 5.35 vs 2.77; graph replay 0.457-0.460 vs 0.403-0.404 ms; at B128 L128 and B16
# L512 the two replays are within 1%.
AUTO_CAPTURES_TRITON = True
# > 0 while capturing_graph() is entered. A module global, not a thread-local: torch.compile
# guards on a global's value, and a capture elsewhere only changes which of two exact
# backends another thread's "auto" runs meanwhile.
_graph_captures = 0


@contextlib.contextmanager
def capturing_graph():
    """Where our graph captures warm up and record: "auto" runs triton on CUDA inputs there
    (AUTO_CAPTURES_TRITON)."""
    global _graph_captures
    _graph_captures += 1
    try:
        yield
    finally:
        _graph_captures -= 1


def resolve_backend(backend=None):
    """The validated backend name a module keeps: "auto", "torch", "triton" or "cuda"."""
    name = backend if backend is not None else os.environ.get("BERT_FAST_BACKEND", "auto")
    name = str(name).lower()
    if name not in BACKENDS:
        source = "" if backend is not None else " (from the BERT_FAST_BACKEND environment variable)"
        raise ValueError(f"unknown backend {name!r}{source}; available: {', '.join(BACKENDS)}")
    if name == "triton" and not HAS_TRITON:
        raise ValueError("backend 'triton' needs the triton package (pip install triton; Linux only); "
                         "use backend='torch'")
    if name == "cuda" and not extension.load():
        raise ValueError(f"backend 'cuda' needs bert_fast's compiled extension: {extension.load_error()}. "
                         "Build it with `pip install --no-build-isolation -e .` in the source checkout or "
                         "bert_fast.build_extension(), or use backend='triton' or 'torch'")
    return name


def available_backends():
    """The backends this install can run (BACKENDS that resolve_backend accepts here)."""
    usable = []
    for name in BACKENDS:
        try:
            resolve_backend(name)
        except ValueError:
            continue
        usable.append(name)
    return usable


def graph_backend_for(backend, device):
    """backend_for as our graph captures see it (capturing_graph): part of a graph's key."""
    global _graph_captures
    _graph_captures += 1
    try:
        return backend_for(backend, device)
    finally:
        _graph_captures -= 1


def backend_of(backend, tensor):
    """backend_for(backend, tensor.device), without making the device object unless it is
    needed (a module's forward asks on every call)."""
    return backend if backend != "auto" else backend_for(backend, tensor.device)


def backend_for(backend, device):
    """The ops' backend ("torch", "triton" or "cuda") for a resolved module backend and a device."""
    if backend != "auto":
        return backend
    if device.type != "cuda" or not (AUTO_USES_TRITON_ON_CUDA and HAS_TRITON):
        return "torch"
    if _graph_captures and AUTO_CAPTURES_TRITON:
        return "triton"
    return _auto_on_gpu(device.index)


@compile_time_constant
def _auto_on_gpu(index):
    """"auto"'s backend on GPU ``index`` (None: the current one), Triton being installed. A
    constant for torch.compile: the first call may import the extension."""
    if AUTO_USES_EXTENSION_ON_CUDA and extension.kernel_image_problem(index) is None:
        return "cuda"
    return "triton"
