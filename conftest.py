"""Loaded by pytest before anything under tests/ or benchmarks/ imports bert_fast.

Without CUDA, Triton kernels can only run in Triton's interpreter, and it must be switched on
before the kernels are defined (when bert_fast's op modules are first imported).
"""

import atexit
import os
import shutil
import tempfile

# PyTorch's CPU ops get the cores the rest of the run leaves them. Under pytest-xdist every
# worker would otherwise run one thread per core: on the GPU machine (16 cores, 8 workers) that
# is 128 threads, and test_ext_cuda.py's embedding backward cases, whose CPU references work on
# (1000, H) tables, took 3-4 s each there (H200, 2026-11-26) against ~0.1 s on a 2-core machine,
# likely that oversubscription (not re-timed yet). Without xdist, the background commands that
# tests/conftest.py starts when collection ends (compiles for sm_90, nvcc, the sanitizer's
# workload, a few Inductor compiles and subprocess runs; ~730 s of CPU, 2026-11-28) keep one
# core busy for most of the run: the tests get the others. On the 2-core CI machine that is
# one thread, which also runs these small shapes faster than two: test_encoder_layer.py took
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
