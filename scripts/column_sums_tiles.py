"""Why Triton's column sums took 29.7 µs a launch in a training step, and which shape is faster:

  python scripts/column_sums_tiles.py [--tokens 4096] [--tiles 128,16,4,0 ...]

On an H100 (2026-11-27, benchmarks/results/nvidia-h100-80gb-hbm3-2026-11-27T0157-profile-train.log)
`_column_sums_kernel` took 29.7 µs a launch (12 a step, 5.4% of the kernels of a B32 L128 step):
the joint sums of a layer's two add-norm backwards' partial rows, (4 x SMs, 3, 768) fp32 each,
and bias_act's, (programs, 3072): ~10 MB, which the H100 reads in ~4 µs. The single sums of one
such buffer took 1.5-4 µs on the same GPU (kernels-small, 2026-11-26), before the kernel's sizes
stopped being specialised (2026-11-26, for equal bits between the joint and the single sums):
whether that or the joint launch's shape costs the time is what this measures. On an H100
(2026-11-28, `...T0225-column-sums-tiles.log`) the joint call took 11.9 µs unspecialised and 4.9
specialised (16-byte loads): since then the kernel picks 16-byte loads per buffer at run time
(widths that are multiples of 4), unspecialised; not yet timed on a GPU.

Each candidate is BLOCK_R, BLOCK_C, num_warps and whether the sizes are specialised (1: Triton's
divisibility-by-16 specialisation; 0: as the op launches it), the current shape first; a last row
times PyTorch's `sum(0)` of each buffer. GPU time per call from CUDA-graph replays, GB/s on the
bytes read, and the largest difference from the current shape's sums. A GPU tool for
scripts/gpu_session.sh's `column-sums-tiles` step; it changes nothing. Without CUDA (Triton's
interpreter) it runs one small case per candidate: a smoke test, not a measurement.
"""

import argparse
import importlib

import torch

from scripts.layernorm_bwd_tiles import print_row

column_sums_op = importlib.import_module("bert_fast.ops.column_sums")
add_layernorm_op = importlib.import_module("bert_fast.ops.add_layernorm")
bias_act_op = importlib.import_module("bert_fast.ops.bias_act")

CANDIDATES = ["128,16,4,0", "128,16,4,1", "32,64,4,0", "32,64,4,1", "64,32,4,0", "16,128,4,0", "64,64,8,0"]


class launch_shape:
    """Within: column sums launched with these blocks and warps, specialised or not."""

    _specialised = None     # the kernel compiled with Triton's usual integer specialisation

    def __init__(self, text):
        block_r, block_c, num_warps, self.specialise = (int(part) for part in text.split(","))
        self.blocks = dict(BLOCK_R=block_r, BLOCK_C=block_c, num_warps=num_warps)

    def __enter__(self):
        self.saved = column_sums_op._COLUMN_SUMS_BLOCKS, column_sums_op._column_sums_kernel
        column_sums_op._COLUMN_SUMS_BLOCKS = self.blocks
        if self.specialise:
            if launch_shape._specialised is None:
                launch_shape._specialised = column_sums_op.triton.jit(self.saved[1].fn)
            column_sums_op._column_sums_kernel = launch_shape._specialised

    def __exit__(self, *exc):
        column_sums_op._COLUMN_SUMS_BLOCKS, column_sums_op._column_sums_kernel = self.saved


class torch_sums:
    """A stand-in 'shape' for the row that times PyTorch's sum(0) of each buffer."""

    def __enter__(self):
        self.saved = column_sums_op._launch
        column_sums_op._launch = lambda out, partials: out.view(-1).copy_(
            torch.cat([p.sum(0).flatten() for p in partials]))

    def __exit__(self, *exc):
        column_sums_op._launch = self.saved


def layer_buffers(tokens, hidden, ffn, device):
    """The partial rows a fused encoder layer's backward sums at ``tokens`` rows: its two
    add-norms' (programs, 3, hidden) and bias_act's (programs, ffn), programs as the kernels
    launch them on this device."""
    cdiv = column_sums_op.cdiv
    _, rows_per_program, _ = add_layernorm_op._layernorm_bwd_blocks(hidden)
    block_m, block_n, _ = bias_act_op._bias_act_bwd_blocks(ffn)
    col_programs = cdiv(ffn, block_n)
    norm_programs = add_layernorm_op.reduction_programs(device, cdiv(tokens, rows_per_program))
    ffn_programs = bias_act_op.reduction_programs(device, cdiv(tokens, block_m), col_programs)
    make = lambda *shape: torch.randn(shape, device=device)
    return [make(norm_programs, 3, hidden), make(norm_programs, 3, hidden), make(ffn_programs, ffn)]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=None, help="default 4096 (CPU: 40)")
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--ffn", type=int, default=3072)
    parser.add_argument("--tiles", nargs="+", default=CANDIDATES, help="BLOCK_R,BLOCK_C,num_warps,specialised")
    options = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    token_counts = options.tokens or ([4096] if device.type == "cuda" else [40])
    name = torch.cuda.get_device_name() if device.type == "cuda" else "CPU (Triton interpreter: a smoke test)"
    current = column_sums_op._COLUMN_SUMS_BLOCKS
    print(f"{name}, torch {torch.__version__}; Triton column sums, fp32 partials to bf16; current shape: "
          f"({current['BLOCK_R']}, {current['BLOCK_C']}) blocks, {current['num_warps']} warps, not specialised")
    for tokens in token_counts:
        buffers = layer_buffers(tokens, options.hidden, options.ffn, device)
        cases = (("joint: a layer's three buffers", buffers, column_sums_op.joint_column_sums),
                 ("single: one add-norm's buffer", buffers[:1], lambda parts, dtype: column_sums_op.column_sums(parts[0], dtype)))
        for title, parts, sums in cases:
            shapes = " + ".join(str(tuple(p.shape)) for p in parts)
            print(f"\n## {tokens} tokens, {title}: {shapes}\n"
                  "| BLOCK_R, BLOCK_C, warps, specialised | µs / call | GB/s | max diff vs current |\n"
                  "|---|---|---|---|")
            call = lambda: (sums(parts, torch.bfloat16),)
            nbytes = sum(p.numel() * p.element_size() for p in parts)
            expected = call()
            for text in options.tiles:
                print_row(text, launch_shape(text), call, expected, nbytes, device)
            print_row("torch sum(0)", torch_sums(), call, expected, nbytes, device)


if __name__ == "__main__":
    main()
