"""How the eager path launches a Triton kernel: Triton's launcher alone, never wrap_triton's
higher-order op (bert_fast.ops._triton.launch).

torch.library.wrap_triton is on by default outside a triton_op's own eager dispatch, so a
launcher called from the eager thin path would send every launch through the
``triton_kernel_wrapper_mutation`` higher-order op: ~120 us of host time a launch on this
machine's CPU against ~2 us, and one entry more in torch's global
``kernel_side_table.constant_args`` each time, never removed. The suite's kernels run in Triton's
interpreter, whose kernels wrap_triton leaves alone, so the GPU's case is checked in a child
process without TRITON_INTERPRET, through Triton's own launcher on kernels compiled for
sm_90, with the driver's launches counted instead of made (host_bench.gpu_launch_path).
"""

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from bert_fast import host_bench
from bert_fast.ops._triton import HAS_TRITON, launch

pytestmark = pytest.mark.skipif(not HAS_TRITON, reason="needs triton")


def _jit_kernel():
    """A compiled-mode Triton kernel (a JITFunction, whatever TRITON_INTERPRET says)."""
    import triton.language as tl
    from triton.runtime.jit import JITFunction

    def kernel(x_ptr, BLOCK: tl.constexpr):
        pass
    return JITFunction(kernel)


def _wrapped(launchable):
    from torch._higher_order_ops.triton_kernel_wrap import TraceableTritonKernelWrapper
    return isinstance(launchable, TraceableTritonKernelWrapper)


def test_eager_launch_is_the_kernel_itself():
    kernel = _jit_kernel()
    assert launch(kernel, torch.zeros(4)) is kernel
    with torch.inference_mode():
        assert launch(kernel, torch.zeros(4)) is kernel


def test_traced_launch_goes_into_the_graph():
    """Fake tensors (torch.compile's and export's tracing, fake kernels), functional tensors
    (triton_op's decomposition for Inductor) and make_fx's proxy mode get wrap_triton's op."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.proxy_tensor import make_fx
    kernel = _jit_kernel()
    with FakeTensorMode():
        assert _wrapped(launch(kernel, torch.zeros(4)))
    seen = []

    def traced(x):
        seen.append(_wrapped(launch(kernel, x)))
        return x + 1
    make_fx(traced)(torch.zeros(4))                        # real tensors, proxy mode
    make_fx(traced, tracing_mode="fake")(torch.zeros(4))
    assert seen == [True, True]


_CHILD = textwrap.dedent("""
    import json, torch
    from torch._higher_order_ops.triton_kernel_wrap import kernel_side_table
    from triton.runtime.jit import JITFunction
    from bert_fast import FastBERTEncoder, host_bench
    from bert_fast.ops import attention
    from tests.helpers import encoder_config, random_inputs
    assert isinstance(attention._attention_fwd_kernel, JITFunction), "TRITON_INTERPRET is set"
    encoder = FastBERTEncoder(**encoder_config(num_heads=2, head_dim=16, num_layers=2, ffn=48,
                                               vocab_size=50), backend="triton")
    tokens, segments = random_inputs(2, 11, 50)
    valid_lens = torch.tensor([4.0, 11.0])
    counts = {}
    with host_bench.gpu_launch_path(host_bench.GPU_PATH_ARCH):     # Triton's own launcher runs too
        for mode in ("inference", "training"):
            encoder.train(mode == "training")
            entries, launches = len(kernel_side_table.constant_args), host_bench._LaunchCounter.launches
            with torch.inference_mode(mode == "inference"):
                out = encoder(tokens, segments, valid_lens)
                if mode == "training":
                    out.sum().backward()
            counts[mode] = dict(launches=host_bench._LaunchCounter.launches - launches,
                                side_table_entries=len(kernel_side_table.constant_args) - entries)
    print(json.dumps(counts))
""")


def test_gpu_eager_path_launches_without_the_higher_order_op():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = os.pathsep.join([root] + [p for p in [env.get("PYTHONPATH")] if p])
    child = subprocess.run([sys.executable, "-c", _CHILD], env=env, cwd=root, capture_output=True, text=True,
                           timeout=300)
    assert child.returncode == 0, child.stderr[-3000:]
    counts = json.loads(child.stdout.strip().splitlines()[-1])
    # Inference: the embedding sum, then per layer the attention and two add-layernorms (ReLU runs
    # in the GEMM's epilogue). Training adds the backward kernels.
    assert counts["inference"]["launches"] == 1 + 2 * 3, counts
    assert counts["training"]["launches"] > counts["inference"]["launches"], counts
    for mode, seen in counts.items():
        assert seen["side_table_entries"] == 0, (
            f"{mode}: {seen['side_table_entries']} launches went through wrap_triton's higher-order op")


def test_host_benchmark_times_the_gpu_path(capsys):
    record = host_bench.main(["--suite", "host", "--layers", "2", "--rounds", "1", "--calls", "2",
                              "--warmup", "0", "--backends", "torch", "--no-record"], record_argv=["test"])
    rows = {(row["mode"], row["method"]): row for row in record["rows"]}
    for mode in host_bench.MODES:
        gpu_path = rows[(mode, host_bench.GPU_PATH)]
        assert gpu_path["median_us"] > 0 and gpu_path["aten_ops_per_layer"] > 0
        assert gpu_path["launches_per_layer"] >= 1.5, gpu_path   # attention + 2 add-layernorms, embedding
        assert rows[(mode, "fast[torch]")]["launches_per_layer"] is None      # no launches on the CPU
    assert host_bench.GPU_PATH in capsys.readouterr().out


def test_host_cdiv_and_next_power_of_2_are_tritons():
    import triton
    from bert_fast.ops._triton import cdiv, next_power_of_2
    for n in range(0, 5000):
        assert next_power_of_2(n) == triton.next_power_of_2(n), n
        for d in (1, 3, 16, 64, 128):
            assert cdiv(n, d) == triton.cdiv(n, d), (n, d)
