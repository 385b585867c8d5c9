#!/usr/bin/env bash
# Copy the checkout's source files (tracked, and new ones git does not ignore) into DEST, so
# that nothing built here (build/, bert_fast/_C*.so, venvs) comes along:
#   scripts/copy_checkout.sh DEST [PATH ...]     # PATHs: only those parts (default: everything)
# The CI scripts build and test in such copies, where an in-place build of the extension
# cannot replace the checkout's.
set -euo pipefail
dest=$1
shift
cd "$(dirname "$0")/.."
git ls-files -z --cached --others --exclude-standard -- "$@" |
    while IFS= read -r -d '' file; do
        if [ -f "$file" ]; then cp --parents -- "$file" "$dest"; fi   # skip files deleted here
    done
