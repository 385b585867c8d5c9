#!/usr/bin/env bash
# CI: the test suite against one torch + triton pair, installed as a user would (the README's
# scripts/install.sh) into a fresh virtual environment, in a scratch copy of the checkout (its
# in-place extension build must not replace the checkout's, built against another torch):
#   scripts/ci_torch_pair.sh 2.11.0 3.6.0      # the GPU machine's pair
# PyPI's Linux torch wheels are CUDA builds (with ~4 GB of CUDA packages): where this machine's
# CUDA toolkit matches their CUDA version, the install also compiles and links the extension's
# CUDA ops against that torch (they cannot run without a GPU; the build is the check).
# Extra pip requirements for the pair's venv: PAIR_EXTRA_REQUIREMENTS (space-separated).
set -euo pipefail
torch_version=$1
triton_version=$2
repo=$(cd "$(dirname "$0")/.." && pwd)
started=$SECONDS
log() { echo "ci_torch_pair[$torch_version]: $*"; }

copy=$(mktemp -d "${TMPDIR:-/tmp}/bert_fast-torch$torch_version.XXXXXX")
trap 'rm -rf "$copy"' EXIT
"$repo/scripts/copy_checkout.sh" "$copy"
cd "$copy"

python3 -m venv .venv
PY=$copy/.venv/bin/python
# The pair's wheels (a CUDA build of torch with its CUDA packages) take ~5 GB here and as much in
# pip's cache: say how much room there is, and keep pip's notes on this machine's missing local
# index folders (one per package) out of the log, so that an error stays readable. A failed
# install (a full disk, a dropped download) is retried once without pip's cache.
log "free space: $(df -h --output=avail "$copy" | tail -n 1 | tr -d ' ') in $copy, $(df -h --output=avail "$HOME" | tail -n 1 | tr -d ' ') in $HOME"
install_pair() {
    # shellcheck disable=SC2086
    "$PY" -m pip install -q "$@" "torch==$torch_version" "triton==$triton_version" ${PAIR_EXTRA_REQUIREMENTS:-} \
        2> >(grep -v "is ignored: it is neither a file nor a directory" >&2)
}
if ! install_pair; then
    log "the install failed; free space now: $(df -h --output=avail "$copy" | tail -n 1 | tr -d ' '); retrying without pip's cache"
    "$PY" -m pip cache purge >/dev/null 2>&1 || true
    install_pair --no-cache-dir
fi

# torch finds the CUDA toolkit through nvcc on PATH, whose parent may not be the toolkit's root
# (here /usr/local/bin/nvcc, a link into /usr/local/cuda): name the root when torch would miss it.
if [ -z "${CUDA_HOME:-}" ] && [ -f /usr/local/cuda/include/cuda_runtime.h ]; then
    export CUDA_HOME=/usr/local/cuda
fi
torch_cuda=$("$PY" -c "import torch; print(torch.version.cuda or '')")
nvcc_cuda=$( { "${CUDA_HOME:-/usr/local/cuda}/bin/nvcc" --version 2>/dev/null || true; } | sed -n 's/.*release \([0-9.]*\),.*/\1/p')
if [ -n "$torch_cuda" ] && [ "${torch_cuda%%.*}" != "${nvcc_cuda%%.*}" ]; then
    log "torch's CUDA $torch_cuda, toolkit's '${nvcc_cuda:-none}': building the C++ ops only"
    export BERT_FAST_SKIP_CUDA_BUILD=1
fi

PYTHON=$PY bash scripts/install.sh
"$PY" - "$torch_version" "$triton_version" <<'PYCHECK'
import sys, torch, triton
want_torch, want_triton = sys.argv[1:]
have = (torch.__version__.split("+")[0], triton.__version__)
if have != (want_torch, want_triton):
    sys.exit(f"the venv has torch {have[0]} + triton {have[1]}, not {want_torch} + {want_triton}")
PYCHECK
log "installed in $((SECONDS - started)) s"

status=0
"$PY" -m pytest -q -p no:cacheprovider || status=$?
log "$([ $status = 0 ] && echo passed || echo FAILED) in $((SECONDS - started)) s"
exit $status
