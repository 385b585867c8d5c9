"""Which launch shape makes Triton's add_layernorm backward fastest on this GPU:

  python scripts/layernorm_bwd_tiles.py [--rows 128 4096 8192] [--hidden 768] [--tiles 2,8,4 1,4,8 ...]

On an H100 (2026-11-26) the backward took 68.8 µs a call in a B32 L128 training step and
128.8 µs at 8192x768 against the extension's 23.9 and 27.1: a fifth of the bandwidth. Its
launch shape was then the forward's, chosen without a GPU: at H = 768 a program held 2 rows of
a 1024-wide tile on 8 warps (80-108 registers, so 2 or 3 programs resident per SM), 4 programs per SM
striding over the rows. This script's first run (the record
benchmarks/results/nvidia-h100-80gb-hbm3-2026-11-26T1517-layernorm-tiles.log) found the same
tile on 4 warps 4-5x faster (11.3 µs at 4096 rows, 25.0 at 8192; 96 registers, every program
resident), now the backward's shape (add_layernorm._layernorm_bwd_blocks). Each candidate
here is ROWS_PER_PROGRAM, num_warps and programs per SM, the current shape first.

GPU time per call of the whole backward (the kernel, then column_sums over its partial rows) from
CUDA-graph replays (kernel_bench's timing), bf16, with and without dropout; GB/s on the bytes
it must move (grad, x, residual read, d_residual written; d_x too with dropout); the largest
difference from the current shape's gradients. A GPU tool for scripts/gpu_session.sh's
`layernorm-tiles` step; it changes nothing. Without CUDA (Triton's interpreter) it runs one
small case per candidate, timed on the host: a smoke test of the script, not a measurement.
"""

import argparse
import importlib
import statistics
import time

import torch

from bert_fast.kernel_bench import _graph_ms
from bert_fast.ops import _triton

add_layernorm_op = importlib.import_module("bert_fast.ops.add_layernorm")   # the module, not the function

CANDIDATES = ["2,4,4", "2,8,4", "1,4,4", "1,2,4", "2,4,8", "2,4,2", "1,4,8"]


def parse_tiles(text):
    rows_per_program, num_warps, programs_per_sm = (int(part) for part in text.split(","))
    return rows_per_program, num_warps, programs_per_sm


class launch_shape:
    """Within: add_layernorm's backward launched with these rows per program, warps and
    programs per SM (None: as the module chooses)."""

    def __init__(self, tiles):
        self.tiles = tiles

    def __enter__(self):
        self.saved = add_layernorm_op._layernorm_bwd_blocks, add_layernorm_op.reduction_programs
        if self.tiles is not None:
            rows_per_program, num_warps, programs_per_sm = self.tiles

            def blocks(hidden):
                return _triton.next_power_of_2(hidden), rows_per_program, num_warps

            def programs(device, num_row_blocks, programs_beside=1):
                per_sm = programs_per_sm if device.type == "cuda" else 1
                sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4
                return max(1, min(num_row_blocks, per_sm * sms))

            add_layernorm_op._layernorm_bwd_blocks, add_layernorm_op.reduction_programs = blocks, programs

    def __exit__(self, *exc):
        add_layernorm_op._layernorm_bwd_blocks, add_layernorm_op.reduction_programs = self.saved


def backward_call(rows, hidden, dropout_p, device, dtype=torch.bfloat16):
    """A closure running the Triton backward on fixed inputs (forward statistics from the
    Triton forward), and the bytes it must move."""
    make = lambda: torch.randn(rows, hidden, device=device).to(dtype)
    x, residual, grad = make(), make(), make()
    weight = (1 + 0.1 * torch.randn(hidden, device=device)).to(dtype)
    bias = torch.randn(hidden, device=device).to(dtype)
    seed = torch.tensor([1234], dtype=torch.int64, device=device)
    _, mean, rstd = add_layernorm_op._add_layernorm_fwd_triton(x, residual, weight, bias, 1e-12, seed, dropout_p)

    def call():
        return add_layernorm_op._add_layernorm_bwd_triton(grad, x, residual, weight, mean, rstd, seed, dropout_p,
                                                          True)

    tensors = 5 if dropout_p > 0 else 4
    return call, tensors * rows * hidden * x.element_size()


def gpu_us(call, device):
    if device.type == "cuda":
        return statistics.median(_graph_ms(call, 20, 10)) * 1e3
    start = time.perf_counter()             # the interpreter: one call, host time
    call()
    return (time.perf_counter() - start) * 1e6


def print_row(text, shape, call, expected, nbytes, device):
    """One table row: ``call`` within the launch ``shape`` (a context manager), its gradients
    (the Nones left out) against ``expected``, GB/s on ``nbytes``."""
    try:
        with shape:
            got = [t for t in call() if t is not None]
            diff = max((a.float() - b.float()).abs().max().item() for a, b in zip(got, expected))
            us = gpu_us(call, device)
    except Exception as error:       # a shape that does not compile or fit: say so
        print(f"| {text} | failed: {type(error).__name__}: {str(error)[:120]} | | |")
        return
    print(f"| {text} | {us:.1f} | {nbytes / us / 1e3:.0f} | {diff:.2g} |")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=None, help="default 128 4096 8192 (CPU: 20)")
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--dropout", type=float, nargs="+", default=[0.0, 0.1])
    parser.add_argument("--tiles", nargs="+", default=CANDIDATES, help="ROWS_PER_PROGRAM,num_warps,programs_per_SM")
    options = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    row_counts = options.rows or ([128, 4096, 8192] if device.type == "cuda" else [20])
    current = add_layernorm_op._layernorm_bwd_blocks(options.hidden)
    name = torch.cuda.get_device_name() if device.type == "cuda" else "CPU (Triton interpreter: a smoke test)"
    print(f"{name}, torch {torch.__version__}; Triton add_layernorm backward, H {options.hidden}, bf16; "
          f"current shape: {current[1]} rows a program, {current[2]} warps, 4 programs per SM")
    for dropout_p in options.dropout:
        for rows in row_counts:
            print(f"\n## {rows}x{options.hidden}, dropout {dropout_p}\n"
                  "| rows, warps, programs/SM | µs / call | GB/s | max diff vs current |\n|---|---|---|---|")
            call, nbytes = backward_call(rows, options.hidden, dropout_p, device)
            with torch.inference_mode():
                expected = [t for t in call() if t is not None]
                for text in options.tiles:
                    print_row(text, launch_shape(parse_tiles(text)), call, expected, nbytes, device)


if __name__ == "__main__":
    main()
