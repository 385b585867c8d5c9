"""Which launch shape makes Triton's bias_act backward fastest on this GPU:

  python scripts/bias_act_bwd_tiles.py [--rows 4096 8192] [--cols 3072] [--tiles 8,256,8,4 ...]

On an H100 (2026-11-26, benchmarks/results/nvidia-h100-80gb-hbm3-2026-11-26T1517-*) the
backward took 117 µs a call in a B32 L128 training step (17% of its kernels) and 229 µs at
8192x3072 against 36 for the forward on the same tiles. Its loop now accumulates a register tile
and sums it once, and on an H200 (2026-11-26T23, benchmarks/results/) (16, 128) tiles on 4 warps
were the fastest of 7 shapes in all four cases: the backward's own tiles since
(bias_act._bias_act_bwd_blocks). Each candidate here is BLOCK_M, BLOCK_N, num_warps and programs
per SM (the programs along the rows are that many per SM over the column programs), the current
shape first.

GPU time per call of the whole backward (the kernel, then column_sums over its partial rows)
from CUDA-graph replays, bf16, ReLU and GELU; GB/s on the bytes it must move (grad_out and the
saved tensor read, d_h written); the largest difference from the current shape's gradients
(d_h is the same; d_bias's sums change order with the tile). A GPU tool for
scripts/gpu_session.sh's `bias-act-tiles` step; it changes nothing. Without CUDA (Triton's
interpreter) it runs one small case per candidate: a smoke test, not a measurement.
"""

import argparse
import importlib

import torch

from scripts.layernorm_bwd_tiles import print_row

bias_act_op = importlib.import_module("bert_fast.ops.bias_act")   # the module, not the function

CANDIDATES = ["16,128,4,4", "8,256,8,4", "8,256,4,4", "16,256,8,4", "32,64,4,4", "16,128,4,8", "16,128,4,2"]


class launch_shape:
    """Within: bias_act's backward launched with these tiles, warps and programs per SM."""

    def __init__(self, text):
        self.block_m, self.block_n, self.num_warps, self.per_sm = (int(part) for part in text.split(","))

    def __enter__(self):
        self.saved = bias_act_op._bias_act_bwd_blocks, bias_act_op.reduction_programs
        bias_act_op._bias_act_bwd_blocks = lambda n_cols: (self.block_m, self.block_n, self.num_warps)

        def programs(device, num_row_blocks, programs_beside=1):
            sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1
            return max(1, min(num_row_blocks, self.per_sm * sms // programs_beside))
        bias_act_op.reduction_programs = programs

    def __exit__(self, *exc):
        bias_act_op._bias_act_bwd_blocks, bias_act_op.reduction_programs = self.saved


def backward_call(rows, cols, activation, device, dtype=torch.bfloat16):
    """A closure running the Triton backward on fixed inputs, and the bytes it must move."""
    h = torch.randn(rows, cols, device=device).to(dtype)
    bias = torch.randn(cols, device=device).to(dtype)
    grad = torch.randn(rows, cols, device=device).to(dtype)
    # ReLU's backward reads the forward's output, the GELUs' their input h.
    saved = bias_act_op._bias_act_fwd_triton(h, bias, activation) if activation == "relu" else h

    def call():
        return bias_act_op._bias_act_bwd_triton(grad, saved, bias, activation)

    return call, 3 * rows * cols * h.element_size()


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=None, help="default 4096 8192 (CPU: 40)")
    parser.add_argument("--cols", type=int, default=3072)
    parser.add_argument("--activations", nargs="+", default=["relu", "gelu"])
    parser.add_argument("--tiles", nargs="+", default=CANDIDATES, help="BLOCK_M,BLOCK_N,num_warps,programs_per_SM")
    options = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    row_counts = options.rows or ([4096, 8192] if device.type == "cuda" else [40])
    name = torch.cuda.get_device_name() if device.type == "cuda" else "CPU (Triton interpreter: a smoke test)"
    block_m, block_n, num_warps = bias_act_op._bias_act_bwd_blocks(options.cols)
    print(f"{name}, torch {torch.__version__}; Triton bias_act backward, N {options.cols}, bf16; current "
          f"shape: ({block_m}, {block_n}) tiles, {num_warps} warps, 4 programs per SM")
    for activation in options.activations:
        for rows in row_counts:
            print(f"\n## {rows}x{options.cols}, {activation}\n"
                  "| BLOCK_M, BLOCK_N, warps, programs/SM | µs / call | GB/s | max diff vs current |\n"
                  "|---|---|---|---|")
            call, nbytes = backward_call(rows, options.cols, activation, device)
            with torch.inference_mode():
                expected = call()
                for text in options.tiles:
                    print_row(text, launch_shape(text), call, expected, nbytes, device)


if __name__ == "__main__":
    main()
