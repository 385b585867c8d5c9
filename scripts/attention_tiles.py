"""Which tiles make the attention kernels fastest on this GPU, per suite shape:

  python scripts/attention_tiles.py [--shapes latency dense long] [--tiles 128,64,8,3 64,128,4,2 ...]
  python scripts/attention_tiles.py --backward [--shapes train long]

The forward tiles (BLOCK_M, BLOCK_N, warps, stages) of bert_fast/ops/attention.py were chosen
without a GPU (no spills, shared memory within sm_86's). For head dim 64 in bf16, the BERT-base
case, this times the forward kernel with each candidate on the suite's inputs (make_inputs:
random lengths as the suite draws them): padded with a key mask (the exact path), and for the
long shape also varlen (skip_padding's path). GPU time per call from CUDA-graph replays
(kernel_bench's timing), TFLOP/s on the work the kernel does (every key of the padded L, or
the sum of squared lengths), and the largest difference from the current tiles' output. A
GPU-only tool for scripts/gpu_session.sh's `attention-tiles` step; it changes nothing.

--backward times the backward instead (padded, key mask; the dK/dV kernel and the dQ kernel
of one call): on an H100 (2026-11-26, a B32 L128 training step's profile,
benchmarks/results/nvidia-h100-80gb-hbm3-2026-11-26T1517-profile-train.log) the two took 50.3 and
48.7 µs a layer, where cuDNN's flash backward (the torch backend's SDPA) took 34.4 for both.
The dK/dV tiles were (32, 128) on 8 warps, 172 registers a thread (ptxas, sm_90), so one
program resident per SM: at B32 L128 its 384 programs ran in three waves of 132; the candidates
take 128-210 (2-4 resident where under ~130 at 8 warps or ~170 at 4). On an H200 (2026-11-26)
dK/dV (16, 64, 4, 2) and dQ (64, 64, 4, 2) were the fastest at both shapes; on an H100
(2026-11-27) dK/dV on 3 stages beat them in all four cases (with and without dropout), the tiles
since. With dropout dQ (64, 32, 4, 2) was 5-11 µs faster, without it 3-11 µs slower: not taken.
At shapes of at most 128 keys a third table times the backward in one launch (the dK/dV kernel
also making dQ, attention.ONE_KERNEL_BACKWARD_MAX_SEQLEN) on candidate tiles against the two.
First the dK/dV kernel's candidates with the dQ kernel's tiles as they are, then the dQ
kernel's; TFLOP/s on the backward's 2.5x the forward's work. The candidates compile for sm_90
without spills (kernel_resources, triton 3.9).
"""

import argparse
import statistics

import torch

from bert_fast.bench_common import make_inputs
from bert_fast.bench_suite import SHAPES
from bert_fast.kernel_bench import _graph_ms
from bert_fast.ops import attention

HEADS, HEAD_DIM, DTYPE = 12, 64, torch.bfloat16
KEY = (HEAD_DIM, 2)          # attention._GPU_TILES' key for head dim 64, 2-byte elements
CANDIDATES = ["128,64,8,3", "128,128,8,2", "128,64,4,3", "64,64,4,3", "64,128,4,2", "64,32,4,3", "128,32,8,3",
              # Fewer queries a program, for the latency shape: at B1 L128 the current (64, 64) make
              # 24 programs for 132 SMs, and the forward took 10.4 µs a layer on an H100 (2026-11-26),
              # ~125 of the 434 µs of a graph replay. These compile for sm_90 without spills
              # (ptxas: 64-138 registers a thread, 37-45 KB of shared memory; triton 3.9).
              "32,64,4,3", "16,64,4,3", "32,128,4,2", "16,128,4,2"]
# The backward's: the current tiles first. dK/dV: BLOCK_M queries a step over BLOCK_N keys a
# program; dQ: BLOCK_M queries a program, BLOCK_N keys a step.
DKDV_CANDIDATES = ["16,64,4,3", "32,128,8,2", "16,32,4,2", "32,64,4,2", "16,64,4,2", "16,128,4,2", "16,64,2,2"]
DQ_CANDIDATES = ["64,64,4,2", "128,32,8,2", "64,64,4,3", "64,32,4,2", "32,64,4,2", "64,128,4,2", "128,64,8,2"]
# The backward in one launch (attention.ONE_KERNEL_BACKWARD_MAX_SEQLEN, off by default), for
# shapes of at most 128 keys: BLOCK_N holds them all. ptxas (sm_90, bf16, d 64, 8 warps) gives
# (16, 128) 154-185 registers a thread, (32, 128) 170-255: one program an SM either way.
ONE_KERNEL_CANDIDATES = ["16,128,8,2", "32,128,8,2", "16,128,4,2", "16,128,8,3", "32,128,8,1"]


def parse_tiles(text):
    block_m, block_n, warps, stages = (int(part) for part in text.split(","))
    return attention._Tiles(block_m, block_n, warps, stages)


def dropout_args(dropout_p, device):
    """(dropout_p, seed) for the ops: a fixed seed, so every candidate draws the same mask."""
    return dropout_p, (torch.tensor([1234], dtype=torch.int64, device=device) if dropout_p else None)


def cases(shape, device, dropout_p=0.0):
    """(name, forward, tflop) of the shape: the padded call, and varlen for shapes with padding."""
    tokens, _, valid_lens = make_inputs(shape.batch, shape.seq, shape.min_len_frac, 30522, 0, device)
    batch, seqlen = tokens.shape
    qkv = torch.randn(batch, seqlen, 3 * HEADS * HEAD_DIM, device=device, dtype=DTYPE)
    padded_tflop = 4 * batch * HEADS * seqlen**2 * HEAD_DIM / 1e12
    dropout = dropout_args(dropout_p, device)
    found = [("padded, key mask", lambda: attention._attention_fwd_triton(qkv, valid_lens, HEADS, *dropout)[0],
              padded_tflop)]
    lengths = valid_lens.tolist()
    if min(lengths) < seqlen:
        keep = torch.arange(seqlen, device=device)[None, :] < valid_lens[:, None]
        packed = qkv[keep].contiguous()
        cu_seqlens = torch.zeros(batch + 1, dtype=torch.int32, device=device)
        cu_seqlens[1:] = torch.cumsum(valid_lens, 0)
        varlen_tflop = sum(4 * HEADS * n**2 * HEAD_DIM for n in lengths) / 1e12
        found.append(("varlen", lambda: attention._varlen_attention_fwd_triton(
            packed, cu_seqlens, HEADS, seqlen, *dropout, filler=False)[0], varlen_tflop))
    return found


def print_row(text, tiles, call, expected, tflop):
    """One table row: ``call`` with the head dim's tiles set to ``tiles`` (then restored)."""
    current = attention._GPU_TILES[KEY]
    attention._GPU_TILES[KEY] = tiles
    try:
        diff = (call().float() - expected.float()).abs().max().item()
        ms = statistics.median(_graph_ms(call, 20, 10))
    except Exception as error:       # a tile that does not compile or fit: say so
        print(f"| {text} | failed: {type(error).__name__}: {str(error)[:120]} | | |")
        return
    finally:
        attention._GPU_TILES[KEY] = current
    print(f"| {text} | {ms * 1e3:.1f} | {tflop / (ms / 1e3):.0f} | {diff:.2g} |")


def print_one_kernel_row(text, tiles, call, expected, tflop):
    """One table row: ``call`` with the one-kernel backward on these tiles (then off again)."""
    saved = attention.ONE_KERNEL_BACKWARD_MAX_SEQLEN, attention._one_kernel_tiles
    attention.ONE_KERNEL_BACKWARD_MAX_SEQLEN = 128
    attention._one_kernel_tiles = lambda *args, **kwargs: tiles
    try:
        diff = (call().float() - expected.float()).abs().max().item()
        ms = statistics.median(_graph_ms(call, 20, 10))
    except Exception as error:
        print(f"| one kernel {text} | failed: {type(error).__name__}: {str(error)[:120]} | | |")
        return
    finally:
        attention.ONE_KERNEL_BACKWARD_MAX_SEQLEN, attention._one_kernel_tiles = saved
    print(f"| one kernel {text} | {ms * 1e3:.1f} | {tflop / (ms / 1e3):.0f} | {diff:.2g} |")


def backward_case(shape, device, dropout_p=0.0):
    """The padded backward of the shape (key mask): a closure and its TFLOP."""
    tokens, _, valid_lens = make_inputs(shape.batch, shape.seq, shape.min_len_frac, 30522, 0, device)
    batch, seqlen = tokens.shape
    qkv = torch.randn(batch, seqlen, 3 * HEADS * HEAD_DIM, device=device, dtype=DTYPE)
    dropout = dropout_args(dropout_p, device)
    out, lse = attention._attention_fwd_triton(qkv, valid_lens, HEADS, *dropout)
    grad = torch.randn_like(out)
    tflop = 2.5 * 4 * batch * HEADS * seqlen**2 * HEAD_DIM / 1e12
    return (lambda: attention._attention_bwd_triton(grad, qkv, out, lse, valid_lens, HEADS, *dropout)), tflop


def time_backward(options, device):
    current = attention._GPU_TILES[KEY]
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; attention backward, {HEADS} heads x "
          f"{HEAD_DIM}, bf16, dropout {options.dropout}; current tiles dK/dV {','.join(map(str, current[1]))}, "
          f"dQ {','.join(map(str, current[2]))}")
    for shape_name in options.shapes:
        shape = SHAPES[shape_name]
        backward, tflop = backward_case(shape, device, options.dropout)
        with torch.inference_mode():
            expected = backward()
            for index, kernel, candidates in ((1, "dK/dV", DKDV_CANDIDATES), (2, "dQ", DQ_CANDIDATES)):
                print(f"\n## {shape_name} B{shape.batch} L{shape.seq}, padded, key mask: the {kernel} kernel's tiles\n"
                      "| tiles | µs / call (both kernels) | TFLOP/s | max diff vs current |\n|---|---|---|---|")
                for text in candidates:
                    tiles = list(current)
                    tiles[index] = parse_tiles(text)
                    print_row(text, tuple(tiles), backward, expected, tflop)
            if shape.seq <= 128:
                print(f"\n## {shape_name} B{shape.batch} L{shape.seq}, padded, key mask: one kernel (dQ in the "
                      "dK/dV kernel) against the two\n"
                      "| tiles | µs / call | TFLOP/s | max diff vs current |\n|---|---|---|---|")
                print_row("two kernels (current)", current, backward, expected, tflop)
                for text in ONE_KERNEL_CANDIDATES:
                    print_one_kernel_row(text, parse_tiles(text), backward, expected, tflop)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="+", choices=SHAPES, default=None,
                        help="default latency dense long; with --backward, train long")
    parser.add_argument("--tiles", nargs="+", default=CANDIDATES, help="BLOCK_M,BLOCK_N,warps,stages")
    parser.add_argument("--backward", action="store_true", help="the backward's two kernels instead")
    parser.add_argument("--dropout", type=float, default=0.0, help="dropout on the weights (training's 0.1)")
    options = parser.parse_args()
    device = torch.device("cuda")
    if options.backward:
        options.shapes = options.shapes or ["train", "long"]
        time_backward(options, device)
        return
    options.shapes = options.shapes or ["latency", "dense", "long"]
    current = attention._GPU_TILES[KEY]
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; attention forward, {HEADS} heads x "
          f"{HEAD_DIM}, bf16, dropout {options.dropout}; current tiles {','.join(map(str, current[0]))}")
    for shape_name in options.shapes:
        shape = SHAPES[shape_name]
        for name, forward, tflop in cases(shape, device, options.dropout):
            print(f"\n## {shape_name} B{shape.batch} L{shape.seq}, {name}\n"
                  "| tiles | µs / call | TFLOP/s | max diff vs current |\n|---|---|---|---|")
            with torch.inference_mode():
                expected = forward()
                for text in options.tiles:
                    print_row(text, (parse_tiles(text),) + current[1:], forward, expected, tflop)


if __name__ == "__main__":
    main()
