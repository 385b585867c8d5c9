"""Triton, where it is installed (Linux), and what the op files need around it.

On a machine without Triton the op files still import: ``triton``/``tl`` are stand-ins that
accept the decorators and annotations at definition time, and every launcher first calls
``require_triton()``, which raises a clear error. The torch paths never need Triton.

On a CPU-only machine, kernels run under Triton's interpreter when ``TRITON_INTERPRET=1`` is
set before this module is first imported (the test suite does that); launchers accept CPU
tensors only in that mode.
"""

import os

import torch

try:
    import triton
    import triton.language as tl
    HAS_TRITON = True
except ImportError:   # pragma: no cover - exercised only where Triton is absent
    HAS_TRITON = False

    class _Absent:
        """Accepts any attribute, call or decoration; kernels defined with it never run."""

        def __getattr__(self, name):
            return self

        def __call__(self, *args, **kwargs):
            return args[0] if len(args) == 1 and callable(args[0]) and not kwargs else self

    triton = tl = _Absent()


def interpreting():
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def require_triton(*tensors):
    """Raise unless Triton can run a kernel on these tensors (CUDA, or CPU when interpreting)."""
    if not HAS_TRITON:
        raise RuntimeError("the triton backend needs the triton package (pip install triton; Linux only); "
                           "use backend='torch' instead")
    for t in tensors:
        if t is None:
            continue
        if t.device.type == "cuda" or (t.device.type == "cpu" and interpreting()):
            continue
        raise ValueError(f"Triton kernels run on CUDA tensors (or CPU tensors under TRITON_INTERPRET=1), "
                         f"got a tensor on {t.device}")


def launch(kernel):
    """``kernel[grid](...)`` in a form torch.compile can trace (torch.library.wrap_triton)."""
    return torch.library.wrap_triton(kernel)
