"""The forward kernels of add_layernorm and embedding_sum at a batch-1 forward's rows, each
backend a few times, for a kernel profiler to look at (scripts/gpu_session.sh `ncu-small`):

  ncu -k 'regex:add_layernorm_fwd|embedding_sum_fwd' python scripts/small_row_kernels.py

On an H200 the extension's two kernels took ~1.5 us more than Triton's at 128 x 768 bf16
(benchmarks/results/nvidia-h200-2026-11-26T0738-kernels.log), whatever their grid. GPU only.
"""

import argparse

import torch

from bert_fast import extension, ops

CALLS = 3


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=128)
    parser.add_argument("--hidden", type=int, default=768)
    options = parser.parse_args()
    device, dtype, rows, hidden = torch.device("cuda"), torch.bfloat16, options.rows, options.hidden
    backends = ["triton"] + (["cuda"] if extension.load() and extension.has_cuda_kernels() else [])
    x, residual = (torch.randn(rows, hidden, device=device, dtype=dtype) for _ in range(2))
    weight, bias = torch.ones(hidden, device=device, dtype=dtype), torch.zeros(hidden, device=device, dtype=dtype)
    token_w = torch.randn(30522, hidden, device=device, dtype=dtype)
    segment_w, pos_w = (torch.randn(2, hidden, device=device, dtype=dtype),
                        torch.randn(1, 512, hidden, device=device, dtype=dtype))
    ids = torch.randint(0, 30522, (1, rows), device=device)
    segments = torch.randint(0, 2, (1, rows), device=device)
    with torch.inference_mode():
        for backend in backends:
            for _ in range(CALLS):
                ops.add_layernorm(x, residual, weight, bias, backend=backend)
                ops.embedding_sum(ids, segments, token_w, segment_w, pos_w, backend=backend)
    torch.cuda.synchronize()
    print(f"ran add_layernorm and embedding_sum forwards, {rows} x {hidden} bf16, {CALLS} calls each on "
          f"{', '.join(backends)}")


if __name__ == "__main__":
    main()
