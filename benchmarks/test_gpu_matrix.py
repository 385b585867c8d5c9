"""The GPU benchmark matrix of issue 5 under pytest-benchmark: the workloads, methods, inputs
and checks of ``python -m bert_fast.bench --suite gpu`` (bert_fast.bench_suite), one test per
(preset, dtype, shape, method), timed by pytest-benchmark (one group per preset, dtype and
shape). Needs CUDA: without it this file is one skipped test. Options: conftest.py, or
``pytest --help`` under "bert_fast GPU matrix".

    pytest benchmarks/test_gpu_matrix.py                        # everything (an hour or more)
    pytest benchmarks/test_gpu_matrix.py -k "base and bfloat16 and not max_autotune"
    pytest benchmarks/test_gpu_matrix.py --matrix-preset base --matrix-shapes dense long \\
        --matrix-record benchmarks/results/NAME.json            # ... and a suite record
    pytest benchmarks/test_gpu_matrix.py --benchmark-disable    # the accuracy checks only
    pytest benchmarks/test_gpu_matrix.py --matrix-device cpu --matrix-preset demo \\
        --matrix-dtype float32 --matrix-quick                   # the CPU smoke run

Unlike the CLI, which interleaves the methods of a shape round by round, each test times its
method alone (pytest-benchmark rounds, after the suite's untimed warmup rounds). The terminal
summary prints the CLI's tables, with the speedups vs eager and vs the best peer.

Checks: bert_fast's methods must meet STYLE.md's tolerance rule against the fp32 eager
reference: error <= 2 x the eager same-dtype error + the dtype's floor. Peers and
torch.compile are measured and their error recorded, never failed: a peer that cannot run
(not installed, out of memory) is a skipped test, one of ours that cannot run a failure.
"""

import pytest

from bert_fast import bench_suite
from bert_fast.bench_common import DTYPES, failure_reason, synchronize
from tests.helpers import FLOOR


def test_matrix(benchmark, matrix, matrix_case):
    preset, dtype_name, shape, name = matrix_case
    workload = matrix.workload(preset, dtype_name, shape)
    method = next((m for m in workload.methods if m.name == name), None)
    if method is None:
        pytest.skip(f"{name}: not in this run's matrix (its backend is not among {matrix.options.backends})")

    def add_row(measured):
        single = workload._replace(methods=[method])
        rows = bench_suite.make_rows(single, {name: measured}, preset=preset, dtype_name=dtype_name,
                                     matmul_peak_tflops=matrix.matmul_peak(dtype_name))
        return next(row for row in matrix.add_rows(rows) if row["method"] == name)

    def skip_or_fail(why):
        add_row(bench_suite.Measured(why))
        if method.ours:
            pytest.fail(f"{name} (bert_fast's) cannot run: {why}")
        pytest.skip(f"{name}: {why}")

    if method.unavailable is not None:
        add_row(bench_suite.Measured(method.unavailable))
        pytest.skip(f"{name}: {method.unavailable}")
    error, first_call_ms, why = matrix.first_call(method)
    if why is not None:
        skip_or_fail(why)

    benchmark.group = f"{preset}-{dtype_name}-{shape.name}"
    device = matrix.device

    def call():
        method.forward(*workload.inputs)
        synchronize(device)

    with workload.grad_context():
        workload.prepare_timing([method])
        try:
            benchmark.pedantic(call, rounds=bench_suite.rounds_for(shape, matrix.options),
                               warmup_rounds=matrix.options.warmup)
            memory = bench_suite.peak_memory_mib(method.forward, workload.inputs, device)
        except Exception as failure:        # out of memory, a recompilation that fails ...
            bench_suite.release_memory()
            skip_or_fail(f"failed while timing: {failure_reason(failure)}")
    if benchmark.stats is None:
        row = add_row(bench_suite.Measured("not timed (--benchmark-disable)", first_call_ms, error))
    else:
        row = add_row(bench_suite.Measured(None, first_call_ms, error, list(benchmark.stats.stats.data), memory))
        benchmark.extra_info.update({key: row[key] for key in (
            "preset", "dtype", "shape", "batch", "seq", "valid_tokens", "padded_tokens", "first_call_ms",
            "valid_tokens_per_s", "model_tflops", "pct_of_matmul_peak", "speedup_vs_eager",
            "best_peer", "speedup_vs_best_peer", "error", "error_metric", "peak_memory_mib")})

    if method.ours:
        eager_error, _, _ = matrix.first_call(next(m for m in workload.methods if m.name == "eager"))
        assert eager_error is not None, "eager could not run, so the tolerance rule has no baseline"
        bound = 2 * eager_error + FLOOR[DTYPES[dtype_name]]
        assert error <= bound, f"{name}: error {error:.3e} > {bound:.3e} (2 x eager's {eager_error:.3e} + floor)"
