"""Loaded by pytest before anything under tests/ or benchmarks/ imports bert_fast.

Without CUDA, Triton kernels can only run in Triton's interpreter, and it must be switched on
before the kernels are defined (when bert_fast's op modules are first imported).
"""

import atexit
import os
import shutil
import tempfile

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Inductor's on-disk caches key a graph by its ops, not by the Python that implements a
# triton_op (traced into on the CPU): a cache left by an earlier checkout would hand this one
# that checkout's compiled code. One fresh cache per session (child processes inherit it).
if "TORCHINDUCTOR_CACHE_DIR" not in os.environ:
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="bert_fast-inductor-")
    atexit.register(shutil.rmtree, os.environ["TORCHINDUCTOR_CACHE_DIR"], ignore_errors=True)


def pytest_sessionstart(session):
    # CI sets BERT_FAST_NO_JIT=1 to test the extension its install built: without one, the
    # cuda backend's tests would skip (and the extension's own tests compile one) and pass.
    if os.environ.get("BERT_FAST_NO_JIT", "0") == "1":
        from bert_fast import info
        problem = info.installed_extension_problem()
        if problem:
            pytest.exit(f"BERT_FAST_NO_JIT=1: {problem}", returncode=1)
