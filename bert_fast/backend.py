"""Which implementation of the ops a module runs.

  torch   fused PyTorch (SDPA, cuBLAS/MKL GEMMs): every device; the CPU default.
  triton  our Triton kernels on CUDA tensors. The same registered ops run their plain-PyTorch
          CPU twins on CPU tensors, so a "triton" model still works on the CPU.
  auto    (the default) triton for CUDA inputs when Triton is installed, else torch; decided
          per call from the inputs' device, so a model moved between devices keeps working.

Chosen per module (``backend=`` argument), else by the ``BERT_FAST_BACKEND`` environment
variable, else ``auto``. Asking for a backend this build does not have is an error that says
so, never a silent fallback.
"""

import os

from .ops._triton import HAS_TRITON

BACKENDS = ("auto", "torch", "triton")
PLANNED_BACKENDS = ("cuda",)


def resolve_backend(backend=None):
    """The validated backend name a module keeps: "auto", "torch" or "triton"."""
    name = backend if backend is not None else os.environ.get("BERT_FAST_BACKEND", "auto")
    name = str(name).lower()
    if name in PLANNED_BACKENDS:
        raise ValueError(f"backend {name!r} is not implemented in this version of bert_fast; "
                         f"available: {', '.join(BACKENDS)}")
    if name not in BACKENDS:
        raise ValueError(f"unknown backend {name!r}; available: {', '.join(BACKENDS)}")
    if name == "triton" and not HAS_TRITON:
        raise ValueError("backend 'triton' needs the triton package (pip install triton; Linux only); "
                         "use backend='torch'")
    return name


def backend_for(backend, device):
    """The ops' backend ("torch" or "triton") for a resolved module backend and a device."""
    if backend == "auto":
        return "triton" if device.type == "cuda" and HAS_TRITON else "torch"
    return backend
