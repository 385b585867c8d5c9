"""Can a Triton GEMM beat cuBLAS on a BERT-base layer's GEMMs at a batch-1 forward's 128 rows?

  python scripts/small_m_gemm.py [--rows 128 1024]

On an H200 the B1 L128 forward's CUDA graph is its kernels' time, and 70% of that is five
cuBLAS GEMMs at 4.4-5.5 us each, streaming the weights at ~0.6 TB/s of the ~4.8 available
(benchmarks/results/nvidia-h200-2026-11-26T0725-profile.log). The 0.30 ms goal for that shape
needs them faster. This times, per GEMM of the layer (bf16, bias in the epilogue; FFN 1 with
ReLU as the fused layer runs it): PyTorch's call (cuBLAS/cuBLASLt) and the same function
compiled by Inductor with max-autotune (its Triton GEMM templates and cuBLAS, the faster
chosen per shape), both as GPU time per call from CUDA-graph replays (kernel_bench's timing),
with the weight bytes / time. If the compiled one wins at 128 rows, a Triton GEMM of ours
would too. A GPU-only tool for scripts/gpu_session.sh's `small-m-gemm` step.
"""

import argparse
import statistics

import torch

from bert_fast.kernel_bench import _graph_ms

HIDDEN, FFN = 768, 3072
# (name, K, N, activation): the fused layer's GEMMs (bert_fast/ops/encoder_layer.py).
GEMMS = [("QKV projection", HIDDEN, 3 * HIDDEN, None), ("output projection", HIDDEN, HIDDEN, None),
         ("FFN 1 + ReLU", HIDDEN, FFN, "relu"), ("FFN 2", FFN, HIDDEN, None)]


def gemm(x, weight, bias, activation):
    if activation == "relu":
        return torch._addmm_activation(bias, x, weight.t())
    return torch.addmm(bias, x, weight.t())


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", nargs="+", type=int, default=[128])
    options = parser.parse_args()
    device, dtype = torch.device("cuda"), torch.bfloat16
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; bf16 GEMMs of a BERT-base layer")
    for rows in options.rows:
        print(f"\n## {rows} rows\n| GEMM | cuBLAS us | max-autotune us | cuBLAS weight TB/s | max-autotune weight TB/s | "
              "max diff |\n|---|---|---|---|---|---|")
        for name, k, n, activation in GEMMS:
            x = torch.randn(rows, k, device=device, dtype=dtype)
            weight = torch.randn(n, k, device=device, dtype=dtype) / k**0.5
            bias = torch.randn(n, device=device, dtype=dtype)
            weight_tb = n * k * 2 / 1e12
            eager = lambda: gemm(x, weight, bias, activation)
            torch._dynamo.reset()
            compiled_fn = torch.compile(gemm, mode="max-autotune-no-cudagraphs", dynamic=False)
            compiled = lambda: compiled_fn(x, weight, bias, activation)
            try:
                diff = (compiled().float() - eager().float()).abs().max().item()
                times = [statistics.median(_graph_ms(fn, 20, 10)) * 1e3 for fn in (eager, compiled)]
            except Exception as error:        # report it, and go on with the next GEMM
                print(f"| {name} | failed: {type(error).__name__}: {str(error)[:150]} | | | | |")
                continue
            print(f"| {name} ({rows}x{k} @ {k}x{n}) | {times[0]:.2f} | {times[1]:.2f} | "
                  f"{weight_tb / (times[0] / 1e6):.2f} | {weight_tb / (times[1] / 1e6):.2f} | {diff:.2g} |")


if __name__ == "__main__":
    main()
