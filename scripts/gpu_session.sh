#!/usr/bin/env bash
# The checks only a GPU can make, in steps that each fit in one command of the device tool
# (10 minutes; a session now has 15 minutes of device time in all, the machine's start
# included). From the repository root on the GPU machine, e.g. with the device tool:
#
#   bash scripts/gpu_session.sh build tests        # the extension in place, every test
#   bash scripts/gpu_session.sh sanitize kernels   # compute-sanitizer, per-kernel times
#   bash scripts/gpu_session.sh build profile      # the kernels of one forward, graph replay time
#   bash scripts/gpu_session.sh build profile-blas # the dense shape's replay under PyTorch's GEMM path
#                                                  # choices (cuBLASLt's memsets, 2026-11-27)
#   bash scripts/gpu_session.sh build profile-train kernels-small   # a training step's kernels;
#                                                  # the memory-bound ops' kernels at 128-8192 rows
#   bash scripts/gpu_session.sh profile-train-step # a whole pretraining step: wall vs kernels,
#                                                  # the MLM head's and AdamW's shares
#   bash scripts/gpu_session.sh backward-host-cost # a backward's host cost: autograd's device thread?
#   PACK=1 bash scripts/gpu_session.sh build attention-tiles layernorm-tiles bias-act-tiles ncu-small small-m-gemm
#                                                  # experiments: attention tiles, Triton LayerNorm and
#                                                  # bias_act backward shapes, few-row kernels, small-M GEMMs
#   bash scripts/gpu_session.sh suite-base suite-train host   # the matrix (BERT-base bf16), a
#                                                  # training step, host time per forward
#   bash scripts/gpu_session.sh suite-base-fp16 suite-large host-skip-padding
#
# Seen on an H200 on 2026-11-26 (16 cores): start ~30 s; build 45 s; suite-base with
# SUITE_ARGS=--no-autotune 87-105 s; suite-train 170+ s cold (compiling the step with Inductor
# and Triton), 29 s on a warm machine (caches kept between calls); host 46-51 s; tests-gpu 97 s
# with 8 workers before test_ext_cuda.py joined it, then cut at 200 s inside that file (whose
# embedding cases recompiled the Triton kernels per row count: trimmed since, not re-timed).
# Later that day: profile under a minute (3 shapes x auto, triton); tests-gpu cut at 150 s
# (538 passed, in test_ext_cuda.py). On an H100 that day: build 50 s, suite-base 109 s, profile
# 15 s, attention-tiles 10 s, small-m-gemm 36 s, tests-gpu 83-89 s (8 workers, to the end),
# kernels-small 20 s, profile-train 16 s, ncu-small 11 s. On an H100 later that day (16 cores): tests-gpu
# 98 s (840 tests), suite-base 108 s, layernorm-tiles 9 s, profile-graph-call 11 s, profile-train
# 23 s, profile-train-step 18 s, kernels-small 21 s; suite-train cut at 230 s cold, still
# compiling (SUITE_ARGS=--no-compile leaves the compiled rows out, the graphed ones in);
# sanitize's first two steps ~45 s each, the third stopped at a failure after 48 s. On an H200
# late that day: build 50 s, tests-gpu 132 s (963 tests, 8 workers, to the end),
# profile-graph-call 24 s, suite-base 129 s, profile-train 24 s, kernels-small 18 s,
# attention-bwd-tiles 13 s, layernorm-tiles 9 s, bias-act-tiles 8 s: 420 s in one call; then
# sanitize with 8 workers ran nothing in 166 s (serial since). On an H100 on 2026-11-27: build
# 71 s, tests-gpu 133 s (976 tests, to the end), profile-train 26 s, attention-dropout-tiles 19 s,
# layernorm-fwd-tiles 12 s, suite-base cut at 145 s with the compiled reference (3 of 4 shapes),
# 61 s with --no-compile; suite-train with SUITE_ARGS="--no-compile --preset base" 19-44 s.
# On an H100 on 2026-11-28 (start ~35 s): build 57 s, tests-gpu 152 s (1033 tests), the six tile
# steps 8-26 s each, profile-train 24 s, profile-train-step 24 s, profile-blas 65 s (4 processes),
# suite-train with SUITE_ARGS="--no-compile --preset base" 28 s, sanitize-memcheck 105 s (the
# extension's 73 s to its end, the Triton half's bf16 12x64 32 s). `tests` (the whole suite, 8
# workers) was cut at 150 s after 1728 of its ~2640 tests: give it ~300 s, in a call of its own
# after build. racecheck of the Triton half has not run to its end. On an H200 on 2026-11-28 (start
# ~35 s): build 37 s, `tests` with 12 workers 216 s to the end (2390 tests), column-sums-tiles 6 s,
# profile-train 16 s, suite-train (--no-compile --preset base) 16 s, sanitize-racecheck 126 s for
# the extension's half and 66 s for the Triton half's bf16 12x64 (its hazards all in cuBLAS).
# On an H200 on 2026-11-29 (a host ~2x slower than the CPU VM's): build 67 s, `tests` (12
# workers) cut at 240 s after 1357 tests, loss-curves 75 s, backward-host-cost 15 s,
# profile-train-step 29 s, split-k-gemm 6 s, host-hf 70 s, suite-train (--no-compile --preset
# base --backends auto torch triton) 40 s, attention-tiles 18 s: give `tests` ~420 s of its own.
# A machine held idle for 30 s is given back and the next call starts a bare one (build again).
#
# STEP_TIMEOUT=S interrupts each step after S seconds (SIGINT: pytest prints what ran, and the
# suite's record keeps every shape it finished); SUITE_ARGS are added to every suite step.
#
# Logs and records go to $OUT (the device tool brings that folder back, 8 files a call: each
# step writes a log and at most one record or report), else benchmarks/results. PACK=1 puts
# them all in one file instead, $OUT/<gpu>-<date>-logs.tgz, rewritten after every step: for
# calls of more steps than 8 files hold.
# A step that fails is reported and the next one runs; the exit status is the number of failures.
set -uo pipefail
cd "$(dirname "$0")/.."

# The device machine's image has python3 (a venv's) but no `python` on PATH: use the venv's
# own `python`, else a wrapper (a symlink would lose the venv).
if ! command -v python >/dev/null 2>&1; then
    export PATH="$(dirname "$(command -v python3)"):$PATH"
    if ! command -v python >/dev/null 2>&1; then
        shim=$(mktemp -d)
        printf '#!/bin/sh\nexec "%s" "$@"\n' "$(command -v python3)" > "$shim/python"
        chmod +x "$shim/python"
        export PATH="$shim:$PATH"
    fi
fi

host=$(python -c "import torch, re; print(re.sub(r'[^a-z0-9]+', '-', torch.cuda.get_device_name().lower()).strip('-'))" 2>/dev/null || echo gpu)
stamp="$host-$(date +%F)"
results=${OUT:-benchmarks/results}
pack=
if [ -n "${PACK:-}" ] && [ -n "${OUT:-}" ]; then   # every log and record in one $OUT file
    pack="$OUT/$stamp-logs.tgz"
    results=$(mktemp -d)
fi
mkdir -p "$results"
export PYTHONUNBUFFERED=1
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-$PWD/.triton-cache}   # one cache for every step and worker
failures=0

run() {     # run NAME COMMAND...: the command's output to the terminal and to $results/NAME.log
    echo "== $1: ${*:2}"
    local start=$SECONDS
    timeout -s INT -k 20 "${STEP_TIMEOUT:-0}" "${@:2}" 2>&1 | tee "$results/$stamp-$1.log"
    local status=${PIPESTATUS[0]}
    echo "== $1: exit $status after $((SECONDS - start)) s" | tee -a "$results/$stamp-$1.log"
    [ "$status" -eq 0 ] || failures=$((failures + 1))
    if [ -n "$pack" ]; then tar czf "$pack" -C "$results" .; fi   # after every step: a cut call keeps what ran
}

suite() {   # suite NAME ARGS...: one part of the matrix, its own record
    # shellcheck disable=SC2086  # SUITE_ARGS is a list of options
    run "$1" python -m bert_fast.bench --suite gpu --json "$results/$stamp-$1.json" "${@:2}" ${SUITE_ARGS:-}
}

for step in "$@"; do
    case $step in
    install)
        # --no-deps: the device machine has no registry access (torch, triton, ninja are there).
        run install env MAX_JOBS=$(nproc) pip install --no-build-isolation --no-deps -e .
        run info python -m bert_fast.info --require-extension ;;
    build)
        # The extension in place, for Hopper only (half the compile of the default "8.0;9.0").
        run build env BERT_FAST_CUDA_ARCHS="${BERT_FAST_CUDA_ARCHS:-9.0}" MAX_JOBS=$(nproc) \
            python setup.py build_ext --inplace
        run info python -m bert_fast.info --require-extension
        # setup.py builds the CPU ops only where it cannot build the CUDA ones (its reason is in
        # build.log): on the GPU machine that is a failure, not a fallback.
        run cuda-ops python -c "import sys; from bert_fast import extension; sys.exit(0 if extension.load() and
            extension.has_cuda_kernels() else 'the extension has no CUDA kernels: see build.log')" ;;
    tests-gpu)
        # The GPU-only tests, the graph and launch files, and the extension's GPU tests (with
        # the HF ones on backend cuda, and test_checks' probe of the extension's kernel image:
        # what choosing cuda for auto needs), and the extension's CPU and link tests: whether
        # this machine's compiler linked it with the shared libstdc++ (its error messages): the
        # part of the suite a short lease can run (83 s with 8 workers on the H100, 2026-11-26).
        # add_layernorm's and bias_act's test files whole: their backward kernels changed after
        # that run (launch shape; the bias gradient's reduction). 960 passed, 3 failed on an H200
        # (2026-11-26, 126 s with 8 workers): two bitwise comparisons of an inference variant
        # (relaxed since to ptxas's FMA contraction) and the joint column sums' (specialisation:
        # fixed since). The attention dropout tests since the masks take four keys a Philox call;
        # the one-kernel attention backward's (off by default, 2026-11-27) on the GPU's tiles.
        parallel=()
        python -c "import xdist" 2>/dev/null && parallel=(-n "${GPU_TEST_WORKERS:-8}")
        run tests-gpu python -m pytest -q -rfE -p no:cacheprovider "${parallel[@]}" --durations=15 \
            --junitxml "$results/$stamp-tests-gpu.xml" tests/test_cuda_graph.py tests/test_graph_inputs.py tests/test_launch.py tests/test_checks.py \
            tests/test_attention_triton.py::test_gpu_real_sizes_vs_torch_path \
            tests/test_attention_triton.py::test_gpu_varlen_vs_torch_path \
            tests/test_attention_triton.py::test_gpu_dropout_keep_rate_and_compile \
            tests/test_attention_triton.py::test_dropout_mask_of_kernels_and_cpu_twin_are_the_same_bits \
            tests/test_attention_triton.py::test_dropout_forward_and_backward_use_one_mask \
            tests/test_attention_triton.py::test_varlen_dropout_matches_padded_dropout \
            tests/test_attention_triton.py::test_forward_without_lse_gives_the_same_output \
            tests/test_attention_triton.py::test_one_kernel_backward_matches_the_two_kernels \
            tests/test_attention_triton.py::test_gpu_one_kernel_backward_at_bert_length \
            tests/test_add_layernorm_triton.py tests/test_bias_act_triton.py \
            tests/test_column_sums.py tests/test_encoder_layer.py::test_fused_layer_matches_the_torch_backend \
            tests/test_encoder_layer.py::test_cuda_backend_add_norm_backwards \
            tests/test_encoder_layer.py::test_gpu_fused_layer_matches_the_per_op_path \
            tests/test_loss_curve.py::test_gpu_bert_base_under_autocast_tracks_the_fp32_curve_as_the_reference_does \
            tests/test_encoder_layer.py::test_gpu_fused_layer_on_packed_tokens_matches_the_per_op_path \
            tests/test_embedding_triton.py::test_gpu_deterministic_backward_is_bitwise_repeatable \
            tests/test_embedding_triton.py::test_gpu_public_function_and_compile_match_torch_backend \
            tests/test_compile.py::test_gpu_compiled_modes_match_eager \
            tests/test_hf.py::test_gpu_forward_and_gradients_match_hf \
            tests/test_hf.py::test_gpu_cuda_graphs_match_eager tests/test_ext_cuda.py tests/test_ext_cpu.py tests/test_ext_link.py ;;
    tests)
        # Every test, the GPU-only ones included, in parallel where pytest-xdist is installed
        # (GPU_TEST_WORKERS, default 12: 216 s to the end on an H200, 2026-11-28; the 2026-11-23
        # H100 run's 15 workers mostly waited on Triton compiles and crashed workers, both fixed
        # since). Calls that can crash run in a child process (tests/isolated.py), so a crash
        # fails one test, not a worker. One Triton cache for all workers and the later steps. The
        # junit XML keeps every test's time.
        parallel=()
        python -c "import xdist" 2>/dev/null && parallel=(-n "${GPU_TEST_WORKERS:-12}")
        run tests python -m pytest -q -p no:cacheprovider "${parallel[@]}" --durations=30 \
            --junitxml "$results/$stamp-tests.xml" tests ;;
    sanitize|sanitize-memcheck|sanitize-racecheck)
        # Memory errors and shared-memory races in every kernel: the CUDA extension on shapes
        # that cover each kernel variant (warp and block per row, vector and scalar paths,
        # dropout), and every Triton kernel in every specialisation kernel_resources compiles,
        # each launched for real (scripts/sanitize_kernels.py: dtypes x head dims, padded and
        # varlen attention, dropout, forward and backward, embeddings, graph staging; it exits
        # 1 if a kernel of the op files was never launched). PyTorch's caching allocator hands
        # out slices of larger blocks, so an overrun inside a block is invisible to memcheck:
        # caching is off here. One pytest process ran ~1.5 tests a second under memcheck on the
        # H100 (2026-11-26), too slow for the Triton kernels' ~390 tests, and 8 xdist workers
        # (child processes, which --target-processes all instruments too) ran no test in 160 s
        # on an H200 (each starting CUDA under the tool): workers only where SANITIZE_WORKERS
        # asks for them. On an H100 (2026-11-27) the Triton half under memcheck took 35 s for
        # its first configuration (fp16 12x64, compiling) and 20 s for the next: ~4-5 minutes for
        # its 12 (SANITIZE_ARGS, e.g. "--dtype bf16 --heads 12x64", picks fewer). `sanitize` runs
        # both tools; sanitize-memcheck and sanitize-racecheck one each, for one call apiece.
        parallel=()
        [ -n "${SANITIZE_WORKERS:-}" ] && parallel=(-n "$SANITIZE_WORKERS")
        tools=(memcheck racecheck)
        [ "$step" = sanitize ] || tools=("${step#sanitize-}")
        for tool in "${tools[@]}"; do
            # racecheck's hazards are judged after the run, below: it reported 60 (384-480 each)
            # in the Triton half's workload, every one in cuBLAS's nvjet GEMM kernels that PyTorch's
            # matmuls launch, none in ours (H200, 2026-11-28, bf16 12x64). Leaving those kernels
            # out with --kernel-name-exclude crashed the tool instead ("failed to handle a
            # hardware exception", then an illegal address in the next allocation), that day.
            errors=(--error-exitcode 99)
            [ "$tool" = racecheck ] && errors=()
            run "sanitize-ext-$tool" env PYTORCH_NO_CUDA_MEMORY_CACHING=1 \
                compute-sanitizer --tool "$tool" "${errors[@]}" --target-processes all \
                python -m pytest -q -x -p no:cacheprovider "${parallel[@]}" tests/test_ext_cuda.py \
                -k "768 or 4096 or misaligned or dropout or empty"
            # shellcheck disable=SC2086  # SANITIZE_ARGS is a list of options
            run "sanitize-triton-$tool" env PYTORCH_NO_CUDA_MEMORY_CACHING=1 PYTHONPATH=. \
                compute-sanitizer --tool "$tool" "${errors[@]}" python scripts/sanitize_kernels.py ${SANITIZE_ARGS:-}
            if [ "$tool" = racecheck ]; then    # a hazard in a kernel not cuBLAS's fails the step
                run racecheck-ours bash -c "! grep -h 'Race reported' '$results/$stamp'-sanitize-*-racecheck.log \
                    | grep -Ev 'nvjet|xmma|cutlass|gemm'"
            fi
        done ;;
    kernels)
        run kernels python -m bert_fast.kernel_bench --json "$results/$stamp-kernels.json" ;;
    profile)
        # The kernels of one forward (torch profiler) and its CUDA-graph replay time, per shape:
        # where the GPU time goes, the auto backend beside triton.
        run profile env PYTHONPATH=. python scripts/profile_kernels.py --backends auto triton ;;
    profile-blas)
        # The dense shape's graph replay (B128 L128: 5.63 ms, 2.9 M tokens/s on the H100 of
        # 2026-11-26, goal 3.0 M) held 48 "Memset (Device)" nodes (4 a layer, 0.9 µs each plus the
        # graph's gap after each; 2 a layer at B16 L512, none at B1 L128) beside cuBLASLt's
        # cooperative bias-epilogue GEMMs (nvjet ..._coopA/coopB_bias): whether PyTorch's GEMM
        # path choices remove them, and what that does to the replay. One process each (PyTorch
        # reads these once): the default; addmm without cuBLASLt (bias copied in, then a GEMM);
        # cuBLASLt for every GEMM; a 1 MiB cuBLASLt workspace.
        for blas in default DISABLE_ADDMM_CUDA_LT=1 TORCH_BLAS_PREFER_CUBLASLT=1 CUBLASLT_WORKSPACE_SIZE=1024; do
            name=${blas%%=*}; name=$(echo "${name}" | tr 'A-Z_' 'a-z-')
            envs=(PYTHONPATH=.); [ "$blas" = default ] || envs+=("$blas")
            run "profile-blas-$name" env "${envs[@]}" python scripts/profile_kernels.py --shapes dense long \
                --backends auto --top 8
        done ;;
    profile-graph-call)
        # Where a cuda_graphs=True call's host time goes beside its replay (B1 L128: 0.777 ms a
        # call against a 0.434 ms replay on the H100), check_inputs on and off, capture_encoder.
        run profile-graph-call env PYTHONPATH=. python scripts/profile_graph_call.py ;;
    profile-train)
        # The kernels of a training step's forward+backward (B32 L128, dropout 0.1), per backend;
        # auto also with the extension's add-norm backward in Triton's place (the default since
        # the H200's profile of 2026-11-26).
        run profile-train env PYTHONPATH=. python scripts/profile_kernels.py --train --backends auto \
            auto:extension-addnorm-bwd triton torch ;;
    profile-train-step)
        # A whole pretraining step (MLM + NSP heads, fused AdamW), reference and optimize(): wall
        # time against kernel time, and the vocabulary-sized ops' and the optimizer's shares.
        run profile-train-step env PYTHONPATH=. python scripts/profile_train_step.py ;;
    backward-host-cost)
        # Why a backward costs the host relatively more on CUDA than on the CPU: small ops
        # timed in the main thread and inside a backward (autograd's device thread, then with
        # the engine's threads off), and the host benchmark's encoder with the threads on and off.
        run backward-host-cost env PYTHONPATH=. python scripts/backward_host_cost.py ;;
    kernels-small)
        # The memory-bound ops at a batch-1 forward's 128 rows up to 8192, each row with its
        # kernels (profiler): where the extension's forward kernels lose ~1.5 us to Triton's at
        # few rows, and where Triton's add_layernorm backward spends its time at 8192 rows.
        run kernels-small python -m bert_fast.kernel_bench --ops add_layernorm embedding_sum bias_act \
            --tokens 128 1024 8192 --kernels --json "$results/$stamp-kernels-small.json" ;;
    attention-tiles)
        # The attention forward's tiles for head dim 64 bf16, candidates against the current ones,
        # at the suite's latency, dense and long shapes (padded and varlen): GPU us and TFLOP/s.
        # The candidates compile for sm_90 without spills (kernel_resources, triton 3.9).
        run attention-tiles env PYTHONPATH=. python scripts/attention_tiles.py ;;
    attention-bwd-tiles)
        # The attention backward's two kernels (dK/dV, dQ) under candidate tiles, at the suite's
        # train and long shapes (padded, key mask): ours took 99 µs a layer in the H100's
        # training step against cuDNN's 34. The candidates compile for sm_90 without spills.
        run attention-bwd-tiles env PYTHONPATH=. python scripts/attention_tiles.py --backward ;;
    attention-dropout-tiles)
        # The same with dropout 0.1 on the weights (a training step's), since the kernels draw
        # four keys' masks from one Philox call (2026-11-26, not yet timed; the H200's
        # profile-train before it: 48.5 and 47.5 µs a launch for dK/dV and dQ at B32 L128 with
        # dropout, ~27 without).
        run attention-dropout-tiles env PYTHONPATH=. python scripts/attention_tiles.py --backward --dropout 0.1 ;;
    layernorm-tiles)
        # Triton's add_layernorm backward (its shape chosen from this step's first run on the
        # H100, 2026-11-26: 4-5x faster than the old one) under candidate launch shapes, at 128, 4096 and 8192 rows of 768, with and without
        # dropout. The candidates compile for sm_90 without spills (kernel_resources, triton 3.9).
        run layernorm-tiles env PYTHONPATH=. python scripts/layernorm_bwd_tiles.py ;;
    layernorm-fwd-tiles)
        # Triton's add_layernorm forward under 7 launch shapes (rows a program, warps), at 128,
        # 4096 and 16384 rows of 768 (B128 L128's, beyond L2), inference and with dropout: its
        # shape is still the one the backward left for 4-5x its speed. New, not yet run; the
        # candidates compile for sm_90 without spills (32-80 registers, triton 3.9).
        run layernorm-fwd-tiles env PYTHONPATH=. python scripts/layernorm_bwd_tiles.py --forward ;;
    bias-act-tiles)
        # Triton's bias_act backward (117 µs a call in the H100's training step, a fifth of its
        # forward's bandwidth; its reduction changed since) under candidate launch shapes, at
        # 4096 and 8192 rows of 3072, ReLU and GELU. The candidates compile for sm_90 without spills.
        run bias-act-tiles env PYTHONPATH=. python scripts/bias_act_bwd_tiles.py ;;
    loss-curves)
        # tests/test_loss_curve.py's GPU curves over 200 steps, twice: where each leaves its plateau
        # (the test compares the first 100 steps; the exit step varied by 60 on an H200, 2026-11-28).
        run loss-curves env PYTHONPATH=. python scripts/loss_curves.py --steps 200 --runs 2 ;;
    column-sums-tiles)
        # The joint column sums of a training layer's backward (29.7 us a launch in the H100's
        # profile-train of 2026-11-27, where ~10 MB read takes ~4 us) and one buffer's, under
        # candidate blocks, specialised or not, beside PyTorch's sum(0).
        run column-sums-tiles env PYTHONPATH=. python scripts/column_sums_tiles.py ;;
    small-m-gemm)
        # A BERT-base layer's GEMMs at 128 rows: cuBLAS against Inductor's max-autotune choice
        # (Triton templates): whether a Triton GEMM could cut the B1 L128 graph's GEMM time.
        run small-m-gemm env PYTHONPATH=. python scripts/small_m_gemm.py --rows 128 ;;
    split-k-gemm)
        # The same GEMMs split over K into 2, 4, 8 partial GEMMs (cuBLAS strided-batched, fp32
        # partials): whether more output tiles than 128 rows give would pay at B1 L128 (FFN 2's
        # 6.8 us on the H100: 12-24 output tiles for 132 SMs). Seconds: no compiles.
        run split-k-gemm env PYTHONPATH=. python scripts/small_m_gemm.py --rows 128 512 --split-k --no-autotune ;;
    ncu-small)
        # Nsight Compute on those forward kernels at 128 rows (Triton's and the extension's):
        # speed of light, launch, warp stalls. Needs ncu on PATH (CUDA's bin) and counter access.
        ncu=$(command -v ncu || ls /usr/local/cuda/bin/ncu /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
        run ncu-small "${ncu:-ncu}" --target-processes all -k 'regex:add_layernorm_fwd|embedding_sum_fwd' \
            --section SpeedOfLight --section LaunchStats --section WarpStateStats \
            env PYTHONPATH=. python scripts/small_row_kernels.py ;;
    host)
        # Host time of a forward and forward+backward at negligible arithmetic, kernel launches per layer.
        run host python -m bert_fast.bench --suite host --json "$results/$stamp-host.json" ;;
    host-amp)
        # The same under autocast bf16, as the training step runs (fp32 weights: the casts of weights
        # and gradients are launches of their own), forward+backward only.
        run host-amp python -m bert_fast.bench --suite host --autocast bfloat16 --modes forward+backward \
            --json "$results/$stamp-host-amp.json" ;;
    host-hf)
        # The same for a Hugging Face BertModel of that size against copies after optimize().
        run host-hf python -m bert_fast.bench --suite host --model hf --json "$results/$stamp-host-hf.json" ;;
    host-skip-padding)
        # The same with skip_padding (its own step: the device tool brings back 8 files a call).
        run host-skip-padding python -m bert_fast.bench --suite host --skip-padding \
            --json "$results/$stamp-host-skip-padding.json" ;;
    suite-base) suite suite-base --preset base --dtype bfloat16 --shapes dense long mixed latency ;;
    suite-base-fp16) suite suite-base-fp16 --preset base --dtype float16 --shapes dense long mixed latency ;;
    suite-large) suite suite-large --preset large --dtype bfloat16 --shapes dense long mixed latency --no-autotune ;;
    suite-train) suite suite-train --preset base large --dtype bfloat16 --shapes train ;;
    matrix)
        # The same matrix under pytest-benchmark (BERT-base bf16, no max-autotune).
        run matrix python -m pytest -q -p no:cacheprovider benchmarks/test_gpu_matrix.py \
            --matrix-preset base --matrix-dtype bfloat16 -k "not max_autotune" \
            --matrix-record "$results/$stamp-matrix.json" --benchmark-json "$results/$stamp-matrix-benchmark.json" ;;
    *)
        echo "unknown step '$step' (install build tests-gpu tests sanitize sanitize-memcheck sanitize-racecheck" \
             "kernels profile profile-blas profile-graph-call profile-train profile-train-step backward-host-cost" \
             "kernels-small attention-tiles attention-bwd-tiles attention-dropout-tiles layernorm-tiles layernorm-fwd-tiles" \
             "bias-act-tiles column-sums-tiles loss-curves small-m-gemm split-k-gemm ncu-small host host-amp host-hf host-skip-padding suite-base" \
             "suite-base-fp16 suite-large suite-train matrix)" >&2
        failures=$((failures + 1)) ;;
    esac
done
echo "== $failures step(s) failed; logs and records in ${pack:-$results}"
exit "$failures"
