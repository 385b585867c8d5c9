"""Every Triton kernel the ops launch, in every specialisation kernel_resources compiles, launched
for real once: the workload for compute-sanitizer (scripts/gpu_session.sh's `sanitize` step).

  compute-sanitizer --tool memcheck python scripts/sanitize_kernels.py [--dtype bf16 ...]

bert_fast.kernel_resources.run_workload on CUDA tensors, per dtype and head configuration (BERT's
12 x 64 and one head dim per other tile class, 96 and 192 the odd ones; L 24, under one tile):
the triton backend's training forward+backward with dropout and its inference, each valid_lens
form, padded and skip_padding, each activation, the embedding and graph-staging kernels. The
sanitizer's reports are the result; this prints what it launched. The test files under the
sanitizer took ~0.7 s a test on the H100 (~390 tests for the Triton kernels): this covers the
same kernels in a few hundred launches. Without CUDA it runs on CPU tensors through Triton's
interpreter (TRITON_INTERPRET=1), a smoke test of the workload (tests/test_fake_gpu_compile.py).
"""

import argparse
import collections
import contextlib
import sys
import time

import torch

from bert_fast import kernel_resources
from bert_fast.ops import _triton


@contextlib.contextmanager
def counting_launches():
    """Within: every launch through the op files' launchers is counted; yields the Counter
    (kernel name -> launches)."""
    counts = collections.Counter()
    modules = kernel_resources._op_modules()

    def counted(kernel, like):
        counts[kernel.__name__] += 1
        return _triton.launch(kernel, like)

    for module in modules:
        module.launch = counted
    try:
        yield counts
    finally:
        for module in modules:
            module.launch = _triton.launch


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", action="append", choices=sorted(kernel_resources.DTYPES),
                        help="repeatable (default: all)")
    parser.add_argument("--heads", action="append", metavar="HEADSxDIM",
                        help="a head configuration, e.g. 12x64; repeatable (default: kernel_resources' four)")
    parser.add_argument("--seqlen", type=int, default=24,
                        help="sequence length (default 24: under one tile of 32, the masked tails)")
    args = parser.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    heads = [tuple(map(int, text.split("x"))) for text in args.heads] if args.heads else kernel_resources.HEAD_CONFIGS
    on_cpu = _triton.kernels_on_cpu() if device == "cpu" else contextlib.nullcontext()
    with on_cpu, counting_launches() as counts:
        for dtype in args.dtype or kernel_resources.DTYPES:
            for num_heads, head_dim in heads:
                start = time.perf_counter()
                kernel_resources.run_workload(kernel_resources.DTYPES[dtype], num_heads, head_dim, seqlen=args.seqlen,
                                               device=device)
                if device == "cuda":
                    torch.cuda.synchronize()
                print(f"{dtype} {num_heads}x{head_dim} on {device}: {time.perf_counter() - start:.1f} s", flush=True)
    print(f"{sum(counts.values())} launches of {len(counts)} kernels:",
          ", ".join(f"{name} {n}" for name, n in sorted(counts.items())))
    missing = kernel_resources.defined_kernels() - set(counts)
    if missing:
        print("defined but never launched:", ", ".join(sorted(missing)), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
