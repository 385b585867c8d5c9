"""Which launch shape makes Triton's add_layernorm backward (or forward) fastest on this GPU:

  python scripts/layernorm_bwd_tiles.py [--rows 128 4096 8192] [--hidden 768] [--tiles 2,8,4 1,4,8 ...]
  python scripts/layernorm_bwd_tiles.py --forward [--rows 128 4096 16384] [--tiles 2,8 4,4 ...]

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

--forward times the forward's shapes instead (ROWS_PER_PROGRAM and num_warps; one program a
row block, no reduction over programs), inference (no statistics) and with dropout: at H = 768 it
holds 2 rows of a 1024-wide tile on 8 warps, the layout the backward left for 4-5x its speed.
In BERT-base's B128 L128 forward on an H200 (2026-11-26T0725-profile.log) it took 24.4 µs a call
at 16384 rows, ~3.1 TB/s on the 75 MB it moves; the default rows include 16384, whose inputs
do not fit in L2 (kernel_bench's 8192 rows do).
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
# The forward's: rows per program, warps; the current shape first. 4 rows on 4 warps and 1 row on
# 1 warp put each row on one warp (its sums need no shared memory), at 32 values a thread.
FORWARD_CANDIDATES = ["2,8", "2,4", "1,4", "1,2", "4,4", "4,8", "1,1"]


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


class forward_shape:
    """Within: add_layernorm's forward launched with these rows per program and warps (the
    backward's shape, derived from the forward's, is not timed here)."""

    def __init__(self, tiles):
        self.rows_per_program, self.num_warps = tiles

    def __enter__(self):
        self.saved = add_layernorm_op._layernorm_blocks
        add_layernorm_op._layernorm_blocks = lambda hidden: (_triton.next_power_of_2(hidden), self.rows_per_program,
                                                             self.num_warps)

    def __exit__(self, *exc):
        add_layernorm_op._layernorm_blocks = self.saved


def forward_call(rows, hidden, dropout_p, device, dtype=torch.bfloat16):
    """A closure running the Triton forward on fixed inputs (without statistics when there is
    no dropout, as inference runs it), and the bytes it must move."""
    make = lambda: torch.randn(rows, hidden, device=device).to(dtype)
    x, residual = make(), make()
    weight = (1 + 0.1 * torch.randn(hidden, device=device)).to(dtype)
    bias = torch.randn(hidden, device=device).to(dtype)
    seed = torch.tensor([1234], dtype=torch.int64, device=device) if dropout_p else None

    def call():
        return add_layernorm_op._add_layernorm_fwd_triton(x, residual, weight, bias, 1e-12, seed, dropout_p,
                                                          stats=dropout_p > 0)

    return call, 3 * rows * hidden * x.element_size()


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
    parser.add_argument("--tiles", nargs="+", default=None,
                        help="ROWS_PER_PROGRAM,num_warps,programs_per_SM (--forward: ROWS_PER_PROGRAM,num_warps)")
    parser.add_argument("--forward", action="store_true", help="time the forward's shapes instead")
    options = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    default_rows = [128, 4096, 16384] if options.forward else [128, 4096, 8192]
    row_counts = options.rows or (default_rows if device.type == "cuda" else [20])
    name = torch.cuda.get_device_name() if device.type == "cuda" else "CPU (Triton interpreter: a smoke test)"
    if options.forward:
        _, rows_per_program, num_warps = add_layernorm_op._layernorm_blocks(options.hidden)
        what, programs = "forward", ""
        tiles, make_call = options.tiles or FORWARD_CANDIDATES, forward_call
        shape = lambda text: forward_shape(tuple(int(part) for part in text.split(",")))
    else:
        _, rows_per_program, num_warps = add_layernorm_op._layernorm_bwd_blocks(options.hidden)
        what, programs = "backward", ", 4 programs per SM"
        tiles, make_call = options.tiles or CANDIDATES, backward_call
        shape = lambda text: launch_shape(parse_tiles(text))
    print(f"{name}, torch {torch.__version__}; Triton add_layernorm {what}, H {options.hidden}, bf16; "
          f"current shape: {rows_per_program} rows a program, {num_warps} warps{programs}")
    for dropout_p in options.dropout:
        for rows in row_counts:
            print(f"\n## {rows}x{options.hidden}, dropout {dropout_p}\n"
                  f"| rows, warps{', programs/SM' if programs else ''} | µs / call | GB/s | max diff vs current |\n"
                  "|---|---|---|---|")
            call, nbytes = make_call(rows, options.hidden, dropout_p, device)
            with torch.inference_mode():
                expected = [t for t in call() if t is not None]
                for text in tiles:
                    print_row(text, shape(text), call, expected, nbytes, device)


if __name__ == "__main__":
    main()
