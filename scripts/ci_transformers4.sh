#!/usr/bin/env bash
# CI: the Hugging Face tests against transformers 4 (its last release, 4.57, the oldest that
# bert_fast.hf swaps: many fine-tuning set-ups still pin 4.x), in the active environment (CI's
# venv after the README's install, which has transformers 5). transformers 4.57 and what it
# needs that 5 does not (huggingface-hub < 1, tokenizers <= 0.23.0, requests) go into a folder
# of their own put first on PYTHONPATH, so the venv's own packages stay as they are:
#   scripts/ci_transformers4.sh
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
started=$SECONDS
overlay=$(mktemp -d "${TMPDIR:-/tmp}/bert_fast-transformers4.XXXXXX")
trap 'rm -rf "$overlay"' EXIT
quiet_pip() {   # pip's notes on this machine's missing local index folders kept out of the log
    python -m pip install -q --target "$overlay" "$@" 2> >(grep -v "is ignored: it is neither a file nor a directory" >&2)
}
quiet_pip --no-deps "transformers==4.57.6" "huggingface-hub==0.36.0" "tokenizers==0.22.1"
quiet_pip requests
cd "$repo"
export PYTHONPATH="$overlay${PYTHONPATH:+:$PYTHONPATH}"
python -c "import transformers, huggingface_hub, tokenizers
assert transformers.__version__ == '4.57.6', transformers.__version__
print('ci_transformers4: transformers', transformers.__version__, 'huggingface_hub', huggingface_hub.__version__,
      'tokenizers', tokenizers.__version__)"
python -m pytest -q -p no:cacheprovider tests/test_hf.py tests/test_distributed.py -k "hf or HF"
echo "ci_transformers4: done in $((SECONDS - started)) s"
