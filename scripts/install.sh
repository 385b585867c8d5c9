#!/usr/bin/env bash
# Install bert_fast for development into the current Python environment, with whatever pip it
# has: PyTorch first (kept if already installed; the CPU build on a machine without an NVIDIA
# GPU, so pip does not pull several GB of CUDA packages), then this package with its test, plot
# and peers (transformers, a benchmark peer) extras, compiling its extension (C++ CPU ops; CUDA
# ops too where CUDA is present; see setup.py). Fails unless the extension was built and loads
# (BERT_FAST_SKIP_EXTENSION=1: install without it, on purpose).
set -euo pipefail
cd "$(dirname "$0")/.."
# A venv's python; else the system's, which stock Ubuntu names python3 only.
PYTHON=${PYTHON:-$(command -v python || command -v python3 || echo python)}

# torch >= 2.11 (setup.py's requirement): installed if missing, upgraded if older, so the
# extension is compiled against the torch that stays (pip would otherwise build it against the
# old one and then replace that).
if ! "$PYTHON" -c "import sys, torch; sys.exit(tuple(int(p) for p in torch.__version__.split('.')[:2]) < (2, 11))" \
        2>/dev/null; then
    if command -v nvidia-smi >/dev/null 2>&1; then
        "$PYTHON" -m pip install -U "torch>=2.11"
    elif compgen -G "/opt/wheels/torch-*+cpu-*.whl" >/dev/null; then
        # A CPU wheel kept on this machine (our development machines and CI have one).
        "$PYTHON" -m pip install "$(ls /opt/wheels/torch-*+cpu-*.whl | sort -V | tail -n 1)"
    else
        "$PYTHON" -m pip install -U "torch>=2.11" --index-url https://download.pytorch.org/whl/cpu
    fi
fi
# The extension builds against the PyTorch installed above, so without build isolation (see
# pyproject.toml): the build backend (setuptools >= 64, for editable installs with any pip) and
# ninja (parallel C++/CUDA compiles) must be here first. ">=": an installed setuptools that is
# new enough is kept (torch pins an upper bound on it).
"$PYTHON" -m pip install "setuptools>=64" wheel ninja
"$PYTHON" -m pip install --no-build-isolation -e ".[test,plot,peers]"
if [ "${BERT_FAST_SKIP_EXTENSION:-0}" = "1" ]; then
    "$PYTHON" -m bert_fast.info
else
    "$PYTHON" -m bert_fast.info --require-extension
fi
