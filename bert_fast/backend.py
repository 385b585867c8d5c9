"""Which implementation of the ops a module runs: ``torch`` (fused PyTorch, runs everywhere).

Chosen per module (``backend=`` argument), else by the ``BERT_FAST_BACKEND`` environment
variable, else ``torch``. The Triton and CUDA backends are separate work items; asking for
one that this build does not have is an error that says so, never a silent fallback.
"""

import os

BACKENDS = ("torch",)
PLANNED_BACKENDS = ("triton", "cuda")


def resolve_backend(backend=None):
    name = backend if backend is not None else os.environ.get("BERT_FAST_BACKEND", "torch")
    name = str(name).lower()
    if name in BACKENDS:
        return name
    if name in PLANNED_BACKENDS:
        raise ValueError(f"backend {name!r} is not implemented in this version of bert_fast; "
                         f"available: {', '.join(BACKENDS)}")
    raise ValueError(f"unknown backend {name!r}; available: {', '.join(BACKENDS)}")
