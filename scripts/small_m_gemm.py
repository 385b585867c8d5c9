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

It did not (H100, 2026-11-26: QKV 4.26 us compiled vs 3.95, FFN 2 6.79 vs 6.77). Why the GEMMs
are slow at 128 rows is parallelism: FFN 2 (K 3072, N 768) makes 12 output tiles of 128 x 64
(24 of 64 x 64) for 132 SMs, each walking all of K. ``--split-k`` asks whether splitting K
pays: each GEMM as S partial GEMMs over K / S (one cuBLAS strided-batched call, fp32 partials
where torch.bmm takes ``out_dtype``) against the plain GEMM, alone and with the partials summed
by torch. The sum is a separate pass here; in the layer it would be read by the kernel that
already follows the GEMM (add_layernorm after the output projection and FFN 2, bias_act after
FFN 1), so the partials column is the GEMM's share of what a split-K layer would cost.
``--no-autotune`` leaves out the max-autotune column (its compiles take ~30 s).
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
    parser.add_argument("--split-k", action="store_true", help="also time each GEMM split over K (see above)")
    parser.add_argument("--no-autotune", action="store_true", help="leave out the max-autotune comparison")
    options = parser.parse_args()
    device, dtype = torch.device("cuda"), torch.bfloat16
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; bf16 GEMMs of a BERT-base layer")
    for rows in options.rows:
        if options.split_k:
            split_k_table(rows, device, dtype)
        if not options.no_autotune:
            autotune_table(rows, device, dtype)


SPLITS = (2, 4, 8)


def operands(rows, k, n, device, dtype):
    """x (rows, K), a weight (N, K) scaled to keep outputs ~1, a bias (N,)."""
    return (torch.randn(rows, k, device=device, dtype=dtype),
            torch.randn(n, k, device=device, dtype=dtype) / k**0.5, torch.randn(n, device=device, dtype=dtype))


def split_k_partials(x, weight, splits):
    """(splits, M, N) partial products of x (M, K) @ weight (N, K).T over K / splits each: one
    strided-batched GEMM on views (no copy), fp32 out where torch.bmm takes out_dtype."""
    rows, k = x.shape
    chunk = k // splits
    a = x.view(rows, splits, chunk).permute(1, 0, 2)           # (S, M, K/S), lda K
    b = weight.view(-1, splits, chunk).permute(1, 2, 0)        # (S, K/S, N), column-major
    if x.is_cuda and x.dtype in (torch.float16, torch.bfloat16):
        try:
            return torch.bmm(a, b, out_dtype=torch.float32)
        except (TypeError, RuntimeError):     # a torch whose bmm has no out_dtype: x's dtype
            pass
    return torch.bmm(a, b)


def split_k_table(rows, device, dtype):
    print(f"\n## {rows} rows, split over K\n| GEMM | addmm us | mm us | "
          + " | ".join(f"S={s} partials us | S={s} + sum us" for s in SPLITS)
          + " | max diff of the summed split |\n|---|---|---|" + "---|---|" * len(SPLITS) + "---|")
    for name, k, n, activation in GEMMS:
        x, weight, bias = operands(rows, k, n, device, dtype)
        plain = x.float() @ weight.float().t()
        cells, worst = [], 0.0
        try:
            for fn in (lambda: gemm(x, weight, bias, activation), lambda: torch.mm(x, weight.t())):
                cells.append(statistics.median(_graph_ms(fn, 20, 10)) * 1e3)
            for splits in SPLITS:
                partials = lambda: split_k_partials(x, weight, splits)
                summed = lambda: split_k_partials(x, weight, splits).sum(0)
                worst = max(worst, (summed().float() - plain).abs().max().item())
                cells += [statistics.median(_graph_ms(fn, 20, 10)) * 1e3 for fn in (partials, summed)]
        except Exception as error:        # report it, and go on with the next GEMM
            print(f"| {name} | failed: {type(error).__name__}: {str(error)[:150]} |")
            continue
        print(f"| {name} ({rows}x{k} @ {k}x{n}) | " + " | ".join(f"{t:.2f}" for t in cells) + f" | {worst:.2g} |")


def autotune_table(rows, device, dtype):
    print(f"\n## {rows} rows\n| GEMM | cuBLAS us | max-autotune us | cuBLAS weight TB/s | max-autotune weight TB/s | "
          "max diff |\n|---|---|---|---|---|---|")
    for name, k, n, activation in GEMMS:
        x, weight, bias = operands(rows, k, n, device, dtype)
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
