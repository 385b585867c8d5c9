"""Loaded by pytest before anything under tests/ or benchmarks/ imports bert_fast.

Without CUDA, Triton kernels can only run in Triton's interpreter, and it must be switched on
before the kernels are defined (when bert_fast's op modules are first imported).
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_sessionstart(session):
    # CI sets BERT_FAST_NO_JIT=1 to test the extension its install built: without one, the
    # cuda backend's tests would skip (and the extension's own tests compile one) and pass.
    if os.environ.get("BERT_FAST_NO_JIT", "0") == "1":
        from bert_fast import info
        problem = info.installed_extension_problem()
        if problem:
            pytest.exit(f"BERT_FAST_NO_JIT=1: {problem}", returncode=1)
