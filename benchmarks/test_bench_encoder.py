"""One forward of each method per shape, timed by pytest-benchmark and checked against the
fp32 eager reference; its extra_info holds the forward's model TFLOP/s and their share of an
fp32 matmul's rate on the device (the fraction of the hardware's peak).

    pytest benchmarks/                          # time and check
    pytest benchmarks/ --benchmark-json PATH    # ... and record
    pytest benchmarks/ --benchmark-disable      # check only (one call per test)
"""

import pytest
import torch

from bert_fast.bench_common import METHOD_NAMES, PEER_NAMES, first_call, max_error, synchronize
from bert_fast.bench_suite import encoder_flops

# The floor of the project's tolerance rule for fp32 (STYLE.md, Tests).
FP32_TOLERANCE = 1e-4


BACKEND_METHODS = [f"{name}[{backend}]" for backend in ("torch", "triton", "cuda")
                   for name in ("fast", "fast_skip_padding")]


@pytest.mark.parametrize("method_name", [*METHOD_NAMES, *PEER_NAMES, *BACKEND_METHODS])
def test_encoder_forward(benchmark, bench_case, method_name, fp32_matmul_peak):
    if method_name not in bench_case.models.methods:
        pytest.skip(f"{method_name}: not run here (backend unavailable, or the one \"auto\" picks)")
    method = bench_case.models.methods[method_name]
    inputs, device = bench_case.inputs, bench_case.device
    benchmark.group = bench_case.shape.id
    with torch.inference_mode():
        # Outside the timing: the call that compiles (torch.compile) or fills caches.
        _, first_seconds, skip_reason = first_call(method, inputs, device)
        if skip_reason is not None:
            pytest.skip(f"{method_name} failed on its first call: {skip_reason}")

        def forward():
            output = method.forward(*inputs)
            synchronize(device)
            return output

        output = benchmark.pedantic(forward, rounds=10, warmup_rounds=1)
    error = max_error(output, bench_case.reference_output,
                      inputs.valid_lens if method.valid_positions_only else None)
    benchmark.extra_info.update(
        device=str(device), dtype="float32", preset=bench_case.shape.preset,
        batch=bench_case.shape.batch, seq=bench_case.shape.seq,
        valid_tokens=int(inputs.valid_lens.sum()), first_call_s=first_seconds, max_abs_err=error,
        error_positions="valid" if method.valid_positions_only else "all")
    if benchmark.stats is not None:         # (None under --benchmark-disable: nothing timed)
        shape = bench_case.shape
        tflops = encoder_flops(bench_case.models.config, shape.batch, shape.seq) / benchmark.stats.stats.median / 1e12
        benchmark.extra_info.update(model_tflops=tflops, matmul_peak=fp32_matmul_peak,
                                    pct_of_matmul_peak=100 * tflops / fp32_matmul_peak["tflops"])
    assert error <= FP32_TOLERANCE, f"{method_name}: max abs error {error:.3e} > {FP32_TOLERANCE:.0e}"
