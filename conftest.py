"""Loaded by pytest before anything under tests/ or benchmarks/ imports bert_fast.

Without CUDA, Triton kernels can only run in Triton's interpreter, and it must be switched on
before the kernels are defined (when bert_fast's op modules are first imported).
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
