#!/usr/bin/env bash
# CI check for issue 11: a toolchain that links libstdc++ statically into the extension put a
# second C++ runtime in the process beside torch's, and TORCH_CHECK messages thrown from the
# extension came out truncated ('tokens id ') or crashed. This builds the extension the way such
# toolchains do (C++ CPU ops only, quick) in a scratch copy of the repository: LDFLAGS asks for
# -static-libstdc++, and the first library directory holds only libstdc++.a, as the H100
# machine's g++ 13.3 did on 2026-11-26 (where `-Wl,-Bdynamic -lstdc++` still linked the static
# copy). Then it runs the extension's CPU tests (their error messages) and the link test
# (tests/test_ext_link.py: libstdc++.so.6 needed, no __cxa_throw of its own) against that build.
# Exits non-zero if the build or any test fails. Uses the current environment's Python (PYTHON).
set -euo pipefail
PYTHON=${PYTHON:-python}
repo=$(cd "$(dirname "$0")/.." && pwd)
started=$SECONDS

copy=$(mktemp -d "${TMPDIR:-/tmp}/bert_fast-hostile-toolchain.XXXXXX")
trap 'rm -rf "$copy"' EXIT

# Source files only (nothing built in the checkout leaks in), of what the build and these tests need.
"$repo/scripts/copy_checkout.sh" "$copy" bert_fast csrc tests setup.py conftest.py pytest.ini README.md pyproject.toml

cd "$copy"
static_only=$copy/static-libstdcxx
mkdir "$static_only"
ln -s "$(${CXX:-g++} -print-file-name=libstdc++.a)" "$static_only/libstdc++.a"
hostile="-L$static_only -static-libstdc++"
echo "ci_hostile_toolchain: building the extension in $copy with LDFLAGS=$hostile"
if ! LDFLAGS="${LDFLAGS:+$LDFLAGS }$hostile" BERT_FAST_SKIP_CUDA_BUILD=1 \
        "$PYTHON" setup.py build_ext --inplace >build.log 2>&1; then
    cat build.log
    echo "ci_hostile_toolchain: FAILED: the build failed" >&2
    exit 1
fi
echo "ci_hostile_toolchain: link line:"
grep -E '^\S*(g\+\+|c\+\+|clang\+\+)\S* .* -shared ' build.log || echo "(none found in the build log)"

# Imported the way pytest imports it (this directory first on sys.path; pytest.ini's pythonpath).
extension=$("$PYTHON" -c "import bert_fast._C as c; print(c.__file__)")
echo "ci_hostile_toolchain: bert_fast._C is loaded from $extension"
case "$extension" in
    "$copy"/bert_fast/*) ;;
    *) echo "ci_hostile_toolchain: FAILED: that is not the build in $copy" >&2; exit 1 ;;
esac

status=0
BERT_FAST_EXPECTED_EXTENSION="$extension" "$PYTHON" -m pytest -q -p no:cacheprovider \
    tests/test_ext_cpu.py tests/test_ext_link.py || status=$?
echo "ci_hostile_toolchain: $([ $status = 0 ] && echo passed || echo FAILED) in $((SECONDS - started)) s"
exit $status
