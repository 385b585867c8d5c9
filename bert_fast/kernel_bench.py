"""Per-kernel GPU numbers: ``python -m bert_fast.kernel_bench [--json PATH]`` (CUDA only).

Times each op's forward and forward+backward with ``triton.testing.do_bench`` (median, and
20th/80th percentiles), for our Triton backend next to the PyTorch path on the same inputs,
and reports what fraction of the machine they reach:
  attention      TFLOP/s (dense-equivalent 4 B h L^2 d forward, 2.5x that backward, the
                 FlashAttention convention), next to SDPA with a boolean key mask and SDPA
                 without a mask (its flash kernel) on the same shapes;
  memory-bound   GB/s from the bytes the op must move, next to the device-to-device copy
                 bandwidth measured in the same run; add_layernorm and embedding_sum also on
                 the compiled extension's CUDA kernels (backend "cuda") when it is built.
Shapes follow the work item: attention at head dim 64, L 128 and 512, B 16, lengths averaging
60% of L; add_layernorm, bias_act and embedding_sum at BERT-base and -large sizes.
"""

import argparse
import datetime
import json
import sys

import torch
from torch.nn import functional as F

from . import extension, ops


def _bench(fn):
    from triton.testing import do_bench
    median, low, high = do_bench(fn, quantiles=[0.5, 0.2, 0.8])
    return dict(ms=median, ms_p20=low, ms_p80=high)


def _fwd_bwd(forward, inputs):
    """A callable running forward and backward (a fixed output gradient) on fresh graphs."""
    out = forward()
    grad = torch.randn_like(out)

    def step():
        for t in inputs:
            t.grad = None
        forward().backward(grad)
    return step


def copy_bandwidth(device):
    x = torch.empty(256 * 2**20, dtype=torch.uint8, device=device)
    y = torch.empty_like(x)
    timing = _bench(lambda: y.copy_(x))
    return 2 * x.numel() / (timing["ms"] * 1e-3) / 1e9


def attention_rows(device, dtype, batch=16, head_dim=64, num_heads=12, seqlens=(128, 512), mean_frac=0.6):
    rows = []
    hidden = head_dim * num_heads
    for seqlen in seqlens:
        generator = torch.Generator().manual_seed(0)
        # Lengths uniform in [0.2 L, L]: average 0.6 L.
        valid_lens = torch.randint(int(0.2 * seqlen), seqlen + 1, (batch,), generator=generator).to(device)
        qkv = torch.randn(batch, seqlen, 3 * hidden, device=device, dtype=dtype, requires_grad=True)
        dense_flops = 4 * batch * num_heads * seqlen**2 * head_dim
        mask = (torch.arange(seqlen, device=device)[None, :] < valid_lens[:, None])[:, None, None, :]

        def heads(x):
            return x.unflatten(-1, (num_heads, head_dim)).transpose(1, 2)

        def sdpa(attn_mask):
            def run():
                q, k, v = (heads(t) for t in qkv.chunk(3, dim=-1))
                return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask)
            return run

        methods = {
            "triton": lambda: ops.packed_self_attention(qkv, num_heads, valid_lens, backend="triton"),
            "torch (ours: SDPA + exact -1e6 rule)": lambda: ops.packed_self_attention(qkv, num_heads, valid_lens),
            "sdpa bool mask": sdpa(mask),
            "sdpa no mask (flash)": sdpa(None),
        }
        for name, forward in methods.items():
            for direction, fn, flops in (("fwd", forward, dense_flops),
                                         ("fwd+bwd", _fwd_bwd(forward, [qkv]), 3.5 * dense_flops)):
                timing = _bench(fn)
                rows.append(dict(op="attention", method=name, direction=direction, batch=batch,
                                 seqlen=seqlen, head_dim=head_dim, num_heads=num_heads,
                                 mean_valid_frac=float(valid_lens.float().mean() / seqlen),
                                 tflops=flops / (timing["ms"] * 1e-3) / 1e12, **timing))
    return rows


def memory_bound_rows(device, dtype, copy_gbps, tokens=16 * 512):
    rows = []
    e = torch.finfo(dtype).bits // 8
    # The compiled extension's CUDA ops too, where they are built (backend "cuda").
    with_ext = extension.load() and extension.has_cuda_kernels()
    backends = ("triton", "torch") + (("cuda",) if with_ext else ())
    for hidden, ffn in ((768, 3072), (1024, 4096)):
        x = torch.randn(tokens, hidden, device=device, dtype=dtype, requires_grad=True)
        residual = torch.randn_like(x, requires_grad=True)
        weight = torch.ones(hidden, device=device, dtype=dtype, requires_grad=True)
        bias = torch.zeros(hidden, device=device, dtype=dtype, requires_grad=True)
        h = torch.randn(tokens, ffn, device=device, dtype=dtype, requires_grad=True)
        ffn_bias = torch.zeros(ffn, device=device, dtype=dtype, requires_grad=True)
        token_w = torch.randn(30522, hidden, device=device, dtype=dtype, requires_grad=True)
        segment_w = torch.randn(2, hidden, device=device, dtype=dtype, requires_grad=True)
        pos_w = torch.randn(1, 512, hidden, device=device, dtype=dtype)
        ids = torch.randint(0, 30522, (tokens // 512, 512), device=device)
        segs = torch.randint(0, 2, (tokens // 512, 512), device=device)
        cases = {
            # op: (forward per backend, leaves, bytes it must move fwd, fwd+bwd)
            "add_layernorm": (
                {b: (lambda b=b: ops.add_layernorm(x, residual, weight, bias, backend=b)) for b in backends},
                [x, residual, weight, bias], 3 * tokens * hidden * e, 7 * tokens * hidden * e),
            "bias_act relu": (
                {"triton": lambda: ops.bias_act(h, ffn_bias, "relu"), "torch": lambda: F.relu(h + ffn_bias)},
                [h, ffn_bias], 2 * tokens * ffn * e, 5 * tokens * ffn * e),
            "embedding_sum": (
                {b: (lambda b=b: ops.embedding_sum(ids, segs, token_w, segment_w, pos_w, backend=b))
                 for b in backends},
                [token_w, segment_w], 2 * tokens * hidden * e, 4 * tokens * hidden * e),
        }
        for op, (forwards, leaves, bytes_fwd, bytes_both) in cases.items():
            for backend, forward in forwards.items():
                for direction, fn, nbytes in (("fwd", forward, bytes_fwd),
                                              ("fwd+bwd", _fwd_bwd(forward, leaves), bytes_both)):
                    timing = _bench(fn)
                    gbps = nbytes / (timing["ms"] * 1e-3) / 1e9
                    rows.append(dict(op=op, method=backend, direction=direction, tokens=tokens,
                                     hidden=ffn if op.startswith("bias_act") else hidden, gbps=gbps,
                                     frac_of_copy=gbps / copy_gbps, **timing))
    return rows


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m bert_fast.kernel_bench", description=__doc__.split("\n")[0])
    parser.add_argument("--dtype", choices=("bfloat16", "float16"), default="bfloat16")
    parser.add_argument("--json", metavar="PATH")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("kernel_bench needs a CUDA GPU (Triton kernels only run on the CPU in the "
                 "interpreter, which says nothing about speed)")
    import triton
    device, dtype = torch.device("cuda"), getattr(torch, args.dtype)
    copy_gbps = copy_bandwidth(device)
    rows = attention_rows(device, dtype) + memory_bound_rows(device, dtype, copy_gbps)
    print(f"{torch.cuda.get_device_name(device)}; torch {torch.__version__}, triton {triton.__version__}, "
          f"{args.dtype}; device copy bandwidth {copy_gbps:.0f} GB/s")
    for row in rows:
        figure = f"{row['tflops']:7.1f} TFLOP/s" if "tflops" in row else \
            f"{row['gbps']:7.0f} GB/s ({100 * row['frac_of_copy']:.0f}% of copy)"
        shape = (f"B{row['batch']} L{row['seqlen']} hd{row['head_dim']}" if row["op"] == "attention"
                 else f"{row['tokens']}x{row['hidden']}")
        print(f"{row['op']:<14} {row['direction']:<8} {shape:<16} {row['method']:<38} {row['ms']:8.3f} ms  {figure}")
    if args.json:
        record = dict(device=torch.cuda.get_device_name(device), torch=torch.__version__,
                      triton=triton.__version__, cuda=torch.version.cuda, dtype=args.dtype,
                      command=list(sys.orig_argv), copy_gbps=copy_gbps,
                      date=datetime.datetime.now().astimezone().isoformat(timespec="seconds"), rows=rows)
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(record, f, indent=2)
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
