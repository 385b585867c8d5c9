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

import contextlib
import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from bert_fast import host_bench, kernel_resources
from bert_fast.backend import available_backends
from bert_fast.ops._triton import HAS_TRITON, launch
from tests.helpers import needs_kernels
from tests.isolated import BackgroundProcess

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


def test_eager_launch_is_tritons_launch_without_the_higher_order_op():
    from bert_fast.ops._triton import _EagerLauncher
    kernel = _jit_kernel()
    launcher = launch(kernel, torch.zeros(4))
    assert isinstance(launcher, _EagerLauncher) and launcher.kernel is kernel
    with torch.inference_mode():
        assert launch(kernel, torch.zeros(4)) is launcher      # one per kernel
    try:
        from triton.runtime.interpreter import InterpretedFunction
    except ImportError:
        return
    interpreted = InterpretedFunction(kernel.fn)
    assert launch(interpreted, torch.zeros(4)) is interpreted


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


def _run_child(args, timeout, **env_changes):
    """Run Python with ``args`` from the repository root without TRITON_INTERPRET (so kernels
    compile for a GPU target); the JSON of its last output line. ``env_changes``: variables to
    set, or with None to remove."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    for name, value in env_changes.items():
        env.pop(name, None)
        if value is not None:
            env[name] = value
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = os.pathsep.join([root] + [p for p in [env.get("PYTHONPATH")] if p])
    child = subprocess.run([sys.executable, *args], env=env, cwd=root, capture_output=True, text=True,
                           timeout=timeout)
    assert child.returncode == 0, child.stderr[-3000:]
    return json.loads(child.stdout.strip().splitlines()[-1])


_CHILD = textwrap.dedent("""
    import json, warnings, torch
    from torch._higher_order_ops.triton_kernel_wrap import kernel_side_table
    from triton.runtime.jit import JITFunction
    from bert_fast import FastBERTEncoder, host_bench
    from bert_fast.ops import _triton, attention
    from tests.helpers import encoder_config, random_inputs
    assert isinstance(attention._attention_fwd_kernel, JITFunction), "TRITON_INTERPRET is set"
    encoder = FastBERTEncoder(**encoder_config(num_heads=2, head_dim=16, num_layers=2, ffn=48,
                                               vocab_size=50), backend="triton")
    tokens, segments = random_inputs(2, 11, 50)
    valid_lens = torch.tensor([4.0, 11.0])
    counts = {}
    with host_bench.gpu_launch_path(host_bench.GPU_PATH_ARCH), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")         # Triton's launcher runs too, and compiles for sm_90
        for mode in ("inference", "training"):
            encoder.train(mode == "training")
            entries, launches = len(kernel_side_table.constant_args), host_bench._LaunchCounter.launches
            with torch.inference_mode(mode == "inference"):
                out = encoder(tokens, segments, valid_lens)
                if mode == "training":
                    out.sum().backward()
            counts[mode] = dict(launches=host_bench._LaunchCounter.launches - launches,
                                side_table_entries=len(kernel_side_table.constant_args) - entries)
    kept = [compiled for launcher in _triton._EAGER_LAUNCHERS.values() if isinstance(launcher, _triton._EagerLauncher)
            for layout in launcher.layouts.values() if layout is not None for compiled, _ in layout.entries.values()]
    print(json.dumps(dict(counts=counts, kernels=len(kept),
                          fp_fusion=sorted({compiled.metadata.enable_fp_fusion for compiled in kept}),
                          warnings=[str(w.message) for w in caught if "FP_FUSION" in str(w.message)])))
""")


# TRITON_DEFAULT_FP_FUSION: unset, Triton 3.9 warns at the first compile that left
# enable_fp_fusion to its default; "0" is Triton 3.10's default.
@pytest.mark.parametrize("default_fp_fusion", [None, "0"])
def test_gpu_eager_path_launches_without_the_higher_order_op(default_fp_fusion):
    """The GPU eager path launches through Triton's launcher, not wrap_triton's op, and compiles
    every kernel with the options it was measured with (_triton.PINNED_OPTIONS), whatever
    Triton's default, without Triton's warning about that default."""
    seen = _run_child(["-c", _CHILD], timeout=300, TRITON_DEFAULT_FP_FUSION=default_fp_fusion,
                      TRITON_FORCE_DISABLE_FP_FUSION=None)
    counts = seen["counts"]
    # Inference: the embedding sum, then per layer the attention and two add-layernorms (ReLU runs
    # in the GEMM's epilogue). Training adds the backward kernels.
    assert counts["inference"]["launches"] == 1 + 2 * 3, counts
    assert counts["training"]["launches"] > counts["inference"]["launches"], counts
    for mode, mode_counts in counts.items():
        assert mode_counts["side_table_entries"] == 0, (
            f"{mode}: {mode_counts['side_table_entries']} launches went through wrap_triton's higher-order op")
    assert seen["kernels"] >= 5 and seen["fp_fusion"] == [True], seen
    assert seen["warnings"] == [], seen["warnings"]


# Every eager launch of the GPU path is checked against Triton's own launcher: the launch that
# _EagerLauncher makes (from its cache, or through Triton on a kind of call's first launch) and
# then Triton's launcher on the same arguments (and _triton.PINNED_OPTIONS) must reach the
# driver with the same CompiledKernel, grid and arguments. The driver's launches are recorded,
# never made (host_bench.gpu_launch_path).
_CACHE_CHILD = textwrap.dedent("""
    import functools, json, os, torch
    import triton, triton.language as tl
    from triton.compiler.compiler import CompiledKernel
    from bert_fast import FastBERTEncoder, host_bench
    from bert_fast.ops import _triton
    from tests.helpers import encoder_config, random_inputs

    records = []
    def record(kernel, *launch):       # what the C launcher gets: grid, stream, ..., the arguments
        records.append((kernel, launch[:4], launch[9:]))

    def init_handles(kernel):
        if kernel._run is None:
            kernel._run = functools.partial(record, kernel)

    def same(ours, theirs):
        (k1, g1, a1), (k2, g2, a2) = ours, theirs
        return (k1 is k2 and g1 == g2 and len(a1) == len(a2)
                and all(x is y or (type(x) is type(y) and not isinstance(x, torch.Tensor) and x == y)
                        for x, y in zip(a1, a2)))

    tally = dict(launches=0, first=0)
    eager_launch, first_launch = _triton._EagerLauncher.launch, _triton._EagerLauncher.first_launch

    def checked(self, grid, *args, **kwargs):
        start = len(records)
        eager_launch(self, grid, *args, **kwargs)
        self.kernel[grid](*args, **_triton.with_pinned_options(kwargs))
        assert len(records) == start + 2, records[start:]
        assert same(records[start], records[start + 1]), (self.kernel.fn.__name__, records[start:], kwargs)
        tally["launches"] += 1

    def counted_first(self, *args):
        tally["first"] += 1
        return first_launch(self, *args)

    @triton.jit
    def probe(x, y, n, scale, flag, BLOCK: tl.constexpr, HAS_Y: tl.constexpr = False):
        i = tl.arange(0, BLOCK)
        v = tl.load(x + i, mask=i < n) * scale
        if HAS_Y:
            v += tl.load(y + i, mask=i < n)
        tl.store(x + i, v + flag, mask=i < n)

    def probe_calls():
        buf, half = torch.zeros(80), torch.zeros(80, dtype=torch.float16)
        base = dict(x=buf, y=None, n=16, scale=1.0, flag=True, BLOCK=16)
        variants = [{}, dict(x=buf[1:]), dict(x=buf[4:], y=buf, HAS_Y=True), dict(x=half, y=half[1:], HAS_Y=True),
                    dict(x=half[8:], y=half, HAS_Y=True), dict(n=1), dict(n=17), dict(n=2**31 + 16),
                    dict(scale=1), dict(scale=0.5), dict(flag=1), dict(flag=0), dict(flag=False),
                    dict(BLOCK=32), dict(BLOCK=32, num_warps=2), dict(x=buf[4:], y=buf, HAS_Y=1),
                    dict(n=1, scale=1, flag=1)]
        for order in (variants, variants[::-1]):
            for variant in order:
                call = dict(base, **variant)
                args = [call.pop(name) for name in ("x", "y", "n", "scale", "flag")]
                for _ in range(2):
                    _triton.launch(probe, args[0])[(1,)](*args, **call)

    with host_bench.gpu_launch_path(host_bench.GPU_PATH_ARCH):
        CompiledKernel._init_handles = init_handles        # gpu_launch_path puts Triton's back
        _triton._EagerLauncher.launch, _triton._EagerLauncher.first_launch = checked, counted_first
        probe_calls()
        _triton.eager_launcher(probe).MAX_KEYS = 3           # again, the cache starting afresh now and then
        probe_calls()
        _triton.eager_launcher(probe).direct = False         # the CompiledKernel's own launcher (newer Tritons)
        probe_calls()
        # A grid given as a function goes to Triton's launcher, with the pinned options: fusion on
        # where Triton's default is off.
        os.environ["TRITON_DEFAULT_FP_FUSION"] = "0"
        start = len(records)
        _triton.launch(probe, torch.zeros(80))[lambda meta: (1,)](torch.zeros(80), None, 3, 1.0, True, BLOCK=64)
        assert len(records) == start + 1 and records[-1][0].metadata.enable_fp_fusion, records[start:]
        del os.environ["TRITON_DEFAULT_FP_FUSION"]
        for seqlen, valid_lens in ((11, torch.tensor([4.0, 11.0])), (11, None), (16, torch.tensor([3, 16])),
                                   (16, torch.tensor([[2.0] * 16, [16.0] * 16]))):
            encoder = FastBERTEncoder(**encoder_config(num_heads=2, head_dim=16, num_layers=2, ffn=48,
                                                       vocab_size=50, max_len=16), backend="triton")
            tokens, segments = random_inputs(2, seqlen, 50)
            for _ in range(2):
                with torch.inference_mode():
                    encoder.eval()(tokens, segments, valid_lens)
                encoder.train()(tokens, segments, valid_lens).sum().backward()
    print(json.dumps(tally))
""")


def test_eager_launches_are_the_ones_tritons_launcher_makes(tmp_path):
    """_EagerLauncher's cache picks the CompiledKernel Triton's launcher picks, and passes the same
    grid and arguments, for every launch of the encoder's GPU path (inference and training, 1-D,
    2-D and no valid_lens, two lengths) and of a probe kernel whose calls vary what Triton
    specialises on: alignment, dtype, ints 1 / multiples of 16 / beyond int32, int against float
    against bool, None against a tensor, constexprs and launch options."""
    script = tmp_path / "check_launches.py"      # a file: @triton.jit reads the kernel's source
    script.write_text(_CACHE_CHILD)
    tally = _run_child([str(script)], timeout=600)
    assert tally["first"] < tally["launches"] / 2, tally       # most launches came from the cache


@pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU path row is for machines without a GPU")
@pytest.mark.parametrize("skip_padding", [False, True])
def test_host_benchmark_times_the_gpu_path(capsys, skip_padding, monkeypatch):
    built, build = [], host_bench.build_models

    def build_models(*args, **kwargs):
        built.append(build(*args, **kwargs))
        return built[-1]
    monkeypatch.setattr(host_bench, "build_models", build_models)
    record = host_bench.main(["--suite", "host", "--layers", "2", "--rounds", "1", "--calls", "2",
                              "--warmup", "0", "--backends", "torch", "--no-record"]
                             + (["--skip-padding"] if skip_padding else []), record_argv=["test"])
    assert record["config"]["skip_padding"] == skip_padding
    assert [model.skip_padding for name, model in built[0].items() if name != "reference"] == [skip_padding] * 2
    rows = {(row["mode"], row["method"]): row for row in record["rows"]}
    for mode in host_bench.MODES:
        gpu_path = rows[(mode, host_bench.GPU_PATH)]
        assert gpu_path["median_us"] > 0 and gpu_path["aten_ops_per_layer"] > 0
        if mode == host_bench.GRAPHED:      # the staging kernel, the replay stubbed: one launch a call
            assert gpu_path["launches_per_layer"] * 2 == 1, gpu_path
        else:
            assert gpu_path["launches_per_layer"] >= 1.5, gpu_path   # attention + 2 add-layernorms, embedding
        assert rows[(mode, "fast[torch]")]["launches_per_layer"] is None      # no launches on the CPU
    assert not any(model.cuda_graphs for name, model in built[0].items() if name != "reference")
    out = capsys.readouterr().out
    assert host_bench.GPU_PATH in out and ("check_inputs True, skip_padding;" in out) == skip_padding


@pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU path row is for machines without a GPU")
def test_host_benchmark_under_autocast(capsys):
    """--autocast: every row's calls under torch.autocast, so the casts of the fp32 weights and
    of their gradients are in the host work (and the ATen calls counted); said in the record."""
    ops = {}
    for amp in (None, "bfloat16"):
        record = host_bench.main(["--suite", "host", "--layers", "2", "--rounds", "1", "--calls", "1",
                                  "--warmup", "0", "--backends", "torch", "--modes", "forward+backward",
                                  "--no-record"] + (["--autocast", amp] if amp else []), record_argv=["test"])
        assert record["config"]["autocast"] == amp
        ops[amp] = {row["method"]: row["aten_ops_per_layer"] for row in record["rows"]}
        assert ("under autocast bfloat16;" in capsys.readouterr().out) == (amp is not None)
    for method in ("reference", "fast[torch]", host_bench.GPU_PATH):
        assert ops["bfloat16"][method] > ops[None][method], (method, ops)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU path row is for machines without a GPU")
def test_host_benchmark_of_a_hugging_face_model(capsys, monkeypatch):
    """--model hf: transformers' BertModel against copies of it after optimize(), every mode;
    the GPU path row launches the fused layers' kernels (not HF's forward, which launches none)."""
    pytest.importorskip("transformers")
    from bert_fast.hf import FastBertModel
    built, build = [], host_bench.build_hf_models

    def build_hf_models(*args, **kwargs):
        built.append(build(*args, **kwargs))
        return built[-1]
    monkeypatch.setattr(host_bench, "build_hf_models", build_hf_models)
    record = host_bench.main(["--suite", "host", "--model", "hf", "--layers", "2", "--rounds", "1", "--calls", "2",
                              "--warmup", "0", "--backends", "torch", "--no-record"], record_argv=["test"])
    assert record["config"]["model"] == "hf" and record["config"]["hf_attention"]
    models = built[0]
    assert not isinstance(models["reference"].model, FastBertModel)
    assert all(isinstance(models[name].model, FastBertModel) for name in ("fast[torch]", host_bench.GPU_PATH))
    rows = {(row["mode"], row["method"]): row for row in record["rows"]}
    for mode in host_bench.MODES:
        assert rows[(mode, "reference")]["median_us"] > 0
        gpu_path = rows[(mode, host_bench.GPU_PATH)]
        assert gpu_path["launches_per_layer"] >= (0.5 if mode == host_bench.GRAPHED else 1.5), (mode, gpu_path)
    # The graphed rows replay (stubbed): a fraction of an eager forward's ATen calls.
    graphed, eager = (rows[(mode, host_bench.GPU_PATH)]["aten_ops_per_layer"] for mode in (host_bench.GRAPHED, "forward"))
    assert graphed < eager / 4, (graphed, eager)
    assert not any(model.model.bert_fast_cuda_graphs for name, model in models.items() if name != "reference")
    assert "Hugging Face BertModel (the reference: its own forward" in capsys.readouterr().out


def test_host_benchmark_of_hf_gradient_checkpointing(capsys):
    """--checkpointing: HF's gradient checkpointing on every model; the fused layers' forward
    runs again in the backward (the GPU path row launches its kernels again)."""
    pytest.importorskip("transformers")
    launches = {}
    for setting in ("off", "non-reentrant"):
        record = host_bench.main(["--suite", "host", "--model", "hf", "--layers", "2", "--rounds", "1", "--calls", "1",
                                  "--warmup", "0", "--backends", "torch", "--modes", "forward+backward",
                                  "--checkpointing", setting, "--no-record"], record_argv=["test"])
        assert record["config"]["checkpointing"] == setting
        (row,) = (row for row in record["rows"] if row["method"] == host_bench.GPU_PATH)
        launches[setting] = row["launches_per_layer"]
    assert launches["non-reentrant"] > launches["off"], launches
    assert "HF's gradient checkpointing (non-reentrant) on every model" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        host_bench.main(["--suite", "host", "--checkpointing", "reentrant", "--no-record"])
    assert "--checkpointing is HF's gradient checkpointing: it needs --model hf" in capsys.readouterr().err


def test_gpu_launch_path_flushes_denormals_while_it_lasts():
    # The GPU path row's GEMMs read kernel outputs that were never written; where old bits read
    # as denormals, x86 arithmetic on them is many times slower, which its host time is not.
    if not torch.set_flush_denormal(False):
        pytest.skip("this CPU cannot flush denormals")
    denormal = torch.tensor([1e-40])
    assert (denormal * 1.0).item() != 0.0
    with host_bench.gpu_launch_path():
        assert (denormal * 1.0).item() == 0.0
    assert (denormal * 1.0).item() != 0.0


def test_host_benchmark_model_hf_refuses_no_check_inputs(capsys):
    pytest.importorskip("transformers")
    with pytest.raises(SystemExit):
        host_bench.main(["--suite", "host", "--model", "hf", "--no-check-inputs", "--no-record"])
    assert "--no-check-inputs is FastBERTEncoder's option" in capsys.readouterr().err


def test_host_cdiv_and_next_power_of_2_are_tritons():
    import triton
    from bert_fast.ops._triton import cdiv, next_power_of_2
    for n in range(0, 5000):
        assert next_power_of_2(n) == triton.next_power_of_2(n), n
        for d in (1, 3, 16, 64, 128):
            assert cdiv(n, d) == triton.cdiv(n, d), (n, d)


class _TritonsLauncher:
    """Every launch of ``kernel`` through Triton's launcher, with the eager launches' options."""

    def __init__(self, kernel):
        self.kernel = kernel

    def __getitem__(self, grid):
        from bert_fast.ops._triton import pinned
        return pinned(self.kernel[grid])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_kept_kernel_launches_match_tritons_launcher(dtype, monkeypatch):
    """On a GPU: the encoder's outputs and gradients with every launch through Triton's launcher
    and with the eager launchers' kept kernels (streams, function handles, arguments) are the
    same, inference and training, 1-D and 2-D valid_lens; the backward within atomics' reordering
    (embedding gradients), the rest exact."""
    from bert_fast import FastBERTEncoder
    from bert_fast.ops import _triton
    from tests.helpers import encoder_config, random_inputs
    torch.manual_seed(0)
    encoder = FastBERTEncoder(**encoder_config(num_heads=4, head_dim=32, num_layers=2, vocab_size=100),
                              backend="triton").to("cuda", dtype)
    tokens, segments = (t.cuda() for t in random_inputs(3, 37, 100))

    def run(valid_lens):
        with torch.inference_mode():
            inference = encoder.eval()(tokens, segments, valid_lens)
        encoder.zero_grad(set_to_none=True)
        out = encoder.train()(tokens, segments, valid_lens)
        out.float().square().sum().backward()
        return [inference, out.detach()] + [p.grad for p in encoder.parameters()]

    for valid_lens in (torch.tensor([5.0, 37.0, 20.0], device="cuda"),
                       torch.randint(1, 38, (3, 37), device="cuda")):
        kept = [run(valid_lens) for _ in range(2)][-1]          # the second call: kept kernels
        with monkeypatch.context() as patch:
            patch.setattr(_triton, "eager_launcher", _TritonsLauncher)
            tritons = run(valid_lens)
        for index, (a, b) in enumerate(zip(kept, tritons)):
            if a is None or b is None:      # pos_embedding: read through .data, as the book does
                assert a is None and b is None, index
                continue
            assert a.shape == b.shape, index
            if index < 2:
                assert torch.equal(a, b), f"output {index} differs"
            else:
                torch.testing.assert_close(a, b, rtol=1e-2 if dtype == torch.bfloat16 else 1e-5, atol=1e-5)


_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# ~25 s of one core: run beside the rest of the suite (started by conftest.py when collection
# ends, with this process's environment: the interpreter here, the GPU on a GPU machine).
SANITIZER_WORKLOAD = BackgroundProcess([sys.executable, "-m", "scripts.sanitize_kernels", "--dtype", "fp32",
                                        "--heads", "2x32", "--seqlen", "12"], cwd=_ROOT)


def start_background(items):
    """From conftest.py when collection ends: start what the selected tests will read."""
    skipped = needs_kernels.mark.args[0]
    if not skipped and any(getattr(item, "originalname", None) == "test_sanitizer_workload_launches_every_kernel"
                           for item in items):
        SANITIZER_WORKLOAD.start()


@pytest.mark.reads_background
@needs_kernels
def test_sanitizer_workload_launches_every_kernel():
    """scripts/sanitize_kernels.py, what `gpu_session.sh sanitize` runs under compute-sanitizer:
    kernel_resources' workload launched for real (here through the interpreter, on a GPU on CUDA
    tensors) reaches every Triton kernel in the op files, else it exits 1 naming the others.
    L 12 (tiles of 16, the tail masked): 27 s of the CI machine, against 44 at the GPU's 24
    (tiles of 32); at L 8 the embedding backward's carry kernel is never launched."""
    out = SANITIZER_WORKLOAD.stdout()         # fails with its output unless it exited 0
    assert f"of {len(kernel_resources.defined_kernels())} kernels" in out, out


@needs_kernels
@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU the two-GPU test below runs it for real")
def test_launches_on_a_tensor_of_another_device_make_that_device_current(monkeypatch):
    """Triton launches on the current CUDA device; a model on "cuda:1" called without
    torch.cuda.set_device(1) must still have its kernels launched on cuda:1 (launch() wraps the
    launcher in torch.cuda.device, as PyTorch's and the extension's ops guard their device).
    Here, on the CPU kernels, every tensor is made to look as if it were on device 1 while 0 is
    current: every launch of a forward and backward (triton and cuda backends) must switch, and
    give the results of the unswitched run."""
    from bert_fast.ops import _triton
    from tests.helpers import encoder_config, encoder_pair, interpreted_kernels, random_inputs

    asked, switched = [], []

    @contextlib.contextmanager
    def device(index):
        assert not switched or switched[-1] != "in", "no nested switch"
        switched.append("in")
        yield
        switched[-1] = index

    def run(fast, tokens, segments):
        with interpreted_kernels():
            out = fast(tokens, segments, torch.tensor([3.0, 7.0]))
            out.square().sum().backward()
        return out.detach(), [p.grad for p in fast.parameters() if p.grad is not None]

    for backend in [b for b in ("triton", "cuda") if b in available_backends()]:
        _, fast = encoder_pair(encoder_config(num_heads=2, head_dim=16, num_layers=1, ffn=48), backend=backend)
        fast.train()
        tokens, segments = random_inputs(2, 7, 50)
        out, grads = run(fast, tokens, segments)
        fast.zero_grad()
        asked.clear(), switched.clear()
        with monkeypatch.context() as patch:
            patch.setattr(_triton, "_other_cuda_device", lambda like: asked.append(like) or 1)
            patch.setattr(torch.cuda, "device", device)
            switched_out, switched_grads = run(fast, tokens, segments)
        assert len(asked) >= 4, f"{backend}: {len(asked)} launches"   # forward + backward kernels
        assert switched == [1] * len(asked), f"{backend}: every launch switches to device 1, once"
        torch.testing.assert_close(switched_out, out, rtol=0, atol=0)
        assert len(switched_grads) == len(grads) > 0
        for g, expected in zip(switched_grads, grads):
            torch.testing.assert_close(g, expected, rtol=0, atol=0)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
@pytest.mark.parametrize("backend", ["triton", "cuda"])
def test_gpu_model_on_the_second_device_with_the_first_current(backend):
    """A model moved to cuda:1 while cuda:0 is current (no torch.cuda.set_device): values and
    gradients equal the same model's on cuda:0."""
    from tests.helpers import encoder_config, encoder_pair, random_inputs
    if backend not in available_backends():
        pytest.skip(f"backend {backend} unavailable")
    _, fast = encoder_pair(encoder_config(num_heads=2, head_dim=32, num_layers=2), backend=backend)
    fast.train()
    tokens, segments = random_inputs(2, 37, 50)
    results = []
    for device in ("cuda:0", "cuda:1"):
        torch.cuda.set_device(0)
        model = fast.to(device)
        model.zero_grad()
        out = model(tokens.to(device), segments.to(device), torch.tensor([5.0, 37.0], device=device))
        out.square().sum().backward()
        torch.cuda.synchronize(device)
        results.append([out.detach().cpu()] + [p.grad.cpu() for p in model.parameters()])
    for a, b in zip(*results):
        torch.testing.assert_close(b, a)
