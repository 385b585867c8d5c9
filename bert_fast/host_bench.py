"""Host cost of an encoder forward: ``python -m bert_fast.bench --suite host``.

At a shape with negligible arithmetic (by default 12 layers, H 64, 4 heads, FFN 256, B 1,
L 8) a forward takes as long as its host work: Python, the dispatcher, allocations, and the
kernel launches. On a GPU that host work is what a BERT forward waits on at small and medium
batches (../shared/gpu-runs/h100-2026-11-23: the fused path's kernels took 2-4x less GPU time
than the reference's, yet its eager forward was slower). The same Python and dispatcher work
runs on CPU tensors, so this benchmark measures it on any machine:

  forward            eval mode, under torch.inference_mode, as a server calls it
  forward+backward   train mode (dropout --dropout, default 0: no dropout work), output.sum()
                     backward, gradients set to None (untimed) before each call
  cuda_graphs forward
                     forward, with the fast rows made cuda_graphs=True (bert_fast.cuda_graph):
                     on a GPU each call replays its graph; on the CPU, which has no graphs, the
                     replay is stubbed (_ReplayStubbed: nothing runs), so the row is the call's
                     host work around the replay (checks, staging the inputs, the output copy).
                     The reference row stays eager: the baseline

for the reference (the book's BERTEncoder, the baseline) and FastBERTEncoder on every backend
this install can run, on the same weights and inputs, in interleaved rounds (each round calls
every method, in rotating order). ``--model hf``: the same for a Hugging Face ``BertModel`` of
that size (transformers' default attention, GELU, the attention mask from the same lengths):
the reference is that model's own forward, the fast rows are copies of it after
``bert_fast.optimize(model, backend=...)``. Each row also counts the ATen operator calls per layer (a
TorchDispatchMode sees every call that reaches a kernel), and on CUDA the kernel launches per
layer (the profiler's device events).

``--autocast bfloat16`` runs every call under ``torch.autocast`` (fp32 Parameters), as
mixed-precision training and the suite's training step do: the casts of weights and gradients
(launches of their own on a GPU) are then part of each row's host work.

What a CPU measurement does and does not show: the modules' Python, the autograd machinery,
the dispatcher and the allocations are the same on CPU and GPU tensors; the kernels are not.
On CPU tensors the "triton" backend runs its ops' CPU kernels (plain PyTorch: SDPA, one
native_layer_norm, addmm with the ReLU epilogue); the "cuda" backend runs the extension's C++
ops. The row "fast[triton] GPU path" (CPU only, where Triton is installed) runs what a CUDA
tensor runs instead: the triton backend's launchers, tile choices and Functions, on CPU
tensors, and the launch itself (the eager launchers' kept CompiledKernels, and Triton's own
launcher, with its argument binding, specialisation and kernel cache, for each kind of call's
first launch) on kernels compiled for sm_90 at the first call; only the driver's launch is
replaced by a counter (gpu_launch_path: the kernels are counted, never run, so its outputs are not
computed). Under TRITON_INTERPRET=1 the launch is the counter instead. Its "launches /
layer" are those counted Triton launches. The driver's launch and the GEMMs' cuBLAS calls show
only on a GPU: on a GPU run this benchmark again, which counts every launch with the profiler.

Each run prints its tables and writes a record to --json PATH, by default
benchmarks/results/<device>-<date>T<time>-host.json under the working directory (--no-record:
none), and prints where.
"""

import argparse
import contextlib
import copy
import datetime
import importlib.util
import statistics
import sys
import time
import warnings

import numpy as np
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from .bench_common import (HOST_RECORD_KIND, Progress, add_record_options, device_option, environment_info,
                           host_record_markdown, make_inputs, record_path_for, synchronize, write_json,
                           _rotated)
from . import cuda_graph
from .backend import available_backends, resolve_backend
from .modules import FastBERTEncoder
from .ops import _triton
from .peers import valid_position_mask
from .reference import BERTEncoder

SHAPE = dict(num_layers=12, num_hiddens=64, num_heads=4, ffn_num_hiddens=256, batch=1, seq=8)
VOCAB_SIZE = 1000      # small tables: the reference's dense embedding gradient stays negligible
GRAPHED = "cuda_graphs forward"
MODES = ("forward", "forward+backward", GRAPHED)
BASELINE = "reference"
GPU_PATH = "fast[triton] GPU path"


def encoder_config(num_layers, num_hiddens, num_heads, ffn_num_hiddens, seq, dropout):
    return dict(vocab_size=VOCAB_SIZE, num_hiddens=num_hiddens, norm_shape=[num_hiddens],
                ffn_num_input=num_hiddens, ffn_num_hiddens=ffn_num_hiddens, num_heads=num_heads,
                num_layers=num_layers, dropout=dropout, max_len=max(seq, 8), key_size=num_hiddens,
                query_size=num_hiddens, value_size=num_hiddens)


def build_models(config, backends, device, check_inputs=True, seed=0, gpu_path=False, skip_padding=False):
    """{name: module}: the reference and a FastBERTEncoder per backend (``skip_padding`` as
    given), on the reference's weights; with ``gpu_path`` one more triton one, for the GPU_PATH
    row (see gpu_launch_path)."""
    torch.manual_seed(seed)
    reference = BERTEncoder(**config).to(device)
    models = {BASELINE: reference}
    names = [(f"fast[{backend}]", backend) for backend in backends] + ([(GPU_PATH, "triton")] if gpu_path else [])
    for name, backend in names:
        models[name] = FastBERTEncoder(**config, backend=backend, check_inputs=check_inputs,
                                       skip_padding=skip_padding).to(device)
        models[name].load_state_dict(reference.state_dict())
    return models


class _HFCall(torch.nn.Module):
    """A Hugging Face BertModel called as the rows call an encoder: (ids, segments, attention
    mask) -> last_hidden_state."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, tokens, segments, attention_mask):
        return self.model(input_ids=tokens, token_type_ids=segments, attention_mask=attention_mask).last_hidden_state


def checkpoint_layers(model, use_reentrant, **settings):
    """HF's gradient checkpointing on every layer of ``model``, with torch.utils.checkpoint's
    ``use_reentrant`` and any other ``settings`` (activation_checkpointing_enable, or
    gradient_checkpointing_enable where transformers has no other name for it)."""
    settings["use_reentrant"] = use_reentrant
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)       # (the older name's deprecation)
        if hasattr(model, "activation_checkpointing_enable"):
            model.activation_checkpointing_enable(activation_checkpointing_kwargs=settings)
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=settings)


def hf_config(config):
    """transformers' BertConfig of an encoder_config's size (its dropout on every dropout)."""
    from transformers import BertConfig
    return BertConfig(vocab_size=config["vocab_size"], hidden_size=config["num_hiddens"],
                      num_hidden_layers=config["num_layers"], num_attention_heads=config["num_heads"],
                      intermediate_size=config["ffn_num_hiddens"], max_position_embeddings=config["max_len"],
                      hidden_dropout_prob=config["dropout"], attention_probs_dropout_prob=config["dropout"])


def build_hf_models(config, backends, device, seed=0, gpu_path=False, skip_padding=False):
    """{name: module}: a transformers BertModel (the reference) and a copy of it per backend after
    bert_fast.optimize (``skip_padding`` as given), each behind _HFCall."""
    from transformers import BertModel
    from .convert import optimize
    torch.manual_seed(seed)
    reference = BertModel(hf_config(config)).to(device)
    models = {BASELINE: _HFCall(reference)}
    names = [(f"fast[{backend}]", backend) for backend in backends] + ([(GPU_PATH, "triton")] if gpu_path else [])
    for name, backend in names:
        models[name] = _HFCall(optimize(copy.deepcopy(reference), backend=backend, skip_padding=skip_padding))
    return models


def _graphs_flag(model):
    """(object, attribute) of a fast row's cuda_graphs switch, or None for the reference."""
    if isinstance(model, FastBERTEncoder):
        return model, "cuda_graphs"
    if isinstance(model, _HFCall) and hasattr(model.model, "bert_fast_cuda_graphs"):
        return model.model, "bert_fast_cuda_graphs"
    return None


class _LaunchCounter:
    """Counts the Triton launches of gpu_launch_path; launches nothing."""
    launches = 0

    @staticmethod
    def run(*args, **kwargs):
        _LaunchCounter.launches += 1


def gpu_path_available(device):
    """Whether the GPU_PATH row can run: CPU tensors, Triton installed, and no CUDA device. Where
    there is one, its own path is what to time (--device cuda); and a kernel that process has
    loaded on the GPU keeps its real launcher, which gpu_launch_path then calls on CPU pointers."""
    return device.type == "cpu" and _triton.HAS_TRITON and not torch.cuda.is_available()


# The GPU the GPU_PATH row compiles its kernels for (H100), when Triton's launcher is included.
GPU_PATH_ARCH = 90


@contextlib.contextmanager
def gpu_launch_path(arch=None):
    """Within: CPU tensors take the triton backend's GPU eager path (the launchers, their
    Functions, tile choices and launch arguments, as for CUDA tensors), and every Triton kernel
    launch is counted in ``_LaunchCounter.launches`` instead of run. The kernels' outputs are
    left unwritten: for measuring host work, never for values.

    ``arch`` (e.g. 90): the launch runs too (bert_fast.ops._triton._EagerLauncher and, for each
    kind of call's first launch, Triton's ``JITFunction.run``: argument binding, specialisation,
    the kernel cache), on kernels compiled for ``sm_<arch>`` at their first call (a driver that
    names that target, as bert_fast.kernel_resources does); only the driver's launch itself
    (``CompiledKernel``'s C launcher) is the counter. Needs a process without
    TRITON_INTERPRET=1. None: Triton's launcher (``JITFunction.run``, or the interpreter's, and
    the eager launchers' cache in front of it, bert_fast.ops._triton._EagerLauncher) is the counter.

    Within, the CPU flushes denormal floats to zero (``torch.set_flush_denormal``; off again
    after): the GEMMs and other PyTorch ops between the launches read the kernels' unwritten
    outputs, memory whose old bits (integer ids among them) often read as denormals, on which
    x86 arithmetic runs up to ~100x slower. Without it the row's host time held some of that
    arithmetic (2026-11-29, this benchmark's default shape): a forward+backward with ``arch``
    90 took 14.7 ms with the flush against 16.6 without (medians of 8 alternating rounds in
    one process); a training forward with ``arch`` None 5.4-5.6 ms against 13.7-14.5 (three
    runs each). The values are never read.
    """
    from triton.runtime.jit import JITFunction
    with contextlib.ExitStack() as stack:
        if torch.set_flush_denormal(True):          # False where the CPU has no such mode
            stack.callback(torch.set_flush_denormal, False)
        if arch is None:
            launchers = [(JITFunction, "run"), (_triton._EagerLauncher, "launch")]
            try:
                from triton.runtime.interpreter import InterpretedFunction
                launchers.append((InterpretedFunction, "run"))
            except ImportError:       # pragma: no cover - a Triton without an interpreter
                pass
            for cls, name in launchers:
                stack.callback(setattr, cls, name, vars(cls)[name])
                setattr(cls, name, _LaunchCounter.run)
            stack.enter_context(_triton.launchers_take_cpu_tensors())
        else:
            from triton.compiler.compiler import CompiledKernel
            from .kernel_resources import targeting

            def init_handles(kernel):       # what loads the module onto a device: the counter instead
                if kernel._run is None:
                    kernel._run = _LaunchCounter.run
            stack.enter_context(targeting(arch))
            stack.callback(setattr, CompiledKernel, "_init_handles", vars(CompiledKernel)["_init_handles"])
            CompiledKernel._init_handles = init_handles
        yield


class _OpCounter(TorchDispatchMode):
    """Counts the ATen operator calls that reach a kernel (below autograd). Automatic CUDA graphs
    replay under it (other dispatch modes make them run eagerly): it counts a replay's ops."""

    bert_fast_sees_replays = True

    def __init__(self):
        super().__init__()
        self.calls = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.calls += 1
        return func(*args, **(kwargs or {}))


def _call(model, mode, inputs):
    if mode != "forward+backward":
        with torch.inference_mode():
            return model(*inputs)
    model(*inputs).sum().backward()


def _prepare(models, mode):
    for model in models.values():
        model.train(mode == "forward+backward")
        model.zero_grad(set_to_none=True)


class _NoReplay:
    def replay(self):
        pass


class _ReplayStubbed(cuda_graph._CudaGraphSteps):
    """The automatic graphs' device steps where there are none (the CPU): a "capture" runs the
    forward once (its output stands for the graph's) and a "replay" runs nothing."""

    def supports(self, device):
        return True

    def capturing(self, device):
        return False

    def new_pool(self, device):
        return None

    def order_after(self, previous, device):
        return None

    def capture(self, run, device, pool):
        return _NoReplay(), run()


@contextlib.contextmanager
def _graphs_on(models, device):
    """Within: the fast rows with cuda_graphs=True, their replays stubbed off CUDA (_ReplayStubbed);
    afterwards cuda_graphs off again and their graphs dropped."""
    fast = [flag for flag in map(_graphs_flag, models.values()) if flag is not None]
    previous = cuda_graph._steps
    if device.type != "cuda":
        cuda_graph._steps = _ReplayStubbed()
    for model, switch in fast:
        setattr(model, switch, True)
    try:
        yield
    finally:
        for model, switch in fast:
            setattr(model, switch, False)
            cuda_graph.clear_cuda_graphs(model)
        cuda_graph._steps = previous


def gpu_path_arch():
    """The arch the GPU_PATH row compiles for (the launch included), or None under Triton's
    interpreter, whose kernels cannot be compiled (the launch is the counter: gpu_launch_path)."""
    return None if _triton.interpreting() else GPU_PATH_ARCH


@contextlib.contextmanager
def _context(name, amp=None):
    """What a row's calls run in: gpu_launch_path for GPU_PATH, and torch.autocast where ``amp``
    names one ((device type, dtype), --autocast)."""
    with gpu_launch_path(gpu_path_arch()) if name == GPU_PATH else contextlib.nullcontext():
        with torch.autocast(*amp) if amp is not None else contextlib.nullcontext():
            yield


def count_ops(model, mode, inputs):
    """ATen operator calls of one call (after warmup)."""
    counter = _OpCounter()
    with counter:
        _call(model, mode, inputs)
    model.zero_grad(set_to_none=True)
    return counter.calls


def count_launches(model, mode, inputs, device, name=None):
    """CUDA kernel launches (kernels, memcpys, memsets) of one call, from the profiler; for the
    GPU_PATH row the Triton launches counted; else None off CUDA."""
    if name == GPU_PATH:
        before = _LaunchCounter.launches
        _call(model, mode, inputs)
        model.zero_grad(set_to_none=True)
        return _LaunchCounter.launches - before
    if device.type != "cuda":
        return None
    from torch.profiler import ProfilerActivity, profile

    synchronize(device)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        _call(model, mode, inputs)
        synchronize(device)
    model.zero_grad(set_to_none=True)
    return sum(1 for event in prof.events() if event.device_type == torch.autograd.DeviceType.CUDA)


def forward_backward_seconds(model, inputs, device, calls):
    """Host seconds of ``calls`` forward+backward calls (output.sum().backward()), each timed
    alone: gradients set to None before it (untimed), synchronize after it."""
    samples = []
    for _ in range(calls):
        model.zero_grad(set_to_none=True)
        synchronize(device)
        start = time.perf_counter()
        model(*inputs).sum().backward()
        synchronize(device)
        samples.append(time.perf_counter() - start)
    return samples


def time_mode(models, mode, inputs, device, rounds, calls, warmup, progress=None, amp=None):
    """Host microseconds per call of each model: {name: [per-round medians]}.

    forward: ``calls`` back-to-back calls per round, one synchronize at the end (so on a GPU this
    is the host's rate; at this shape the GPU keeps up). forward+backward: each call timed on its
    own, gradients set to None before it (untimed), synchronize after it.
    """
    per_round = {name: [] for name in models}
    for round_index in range(-warmup, rounds):
        for name in _rotated(list(models), round_index):
            model = models[name]
            if progress is not None:
                what = "warmup" if round_index < 0 else f"round {round_index + 1}/{rounds}"
                progress.update(f"{mode}: {name}: {what}")
            with _context(name, amp):
                if mode != "forward+backward":
                    synchronize(device)
                    start = time.perf_counter()
                    with torch.inference_mode():
                        for _ in range(calls):
                            model(*inputs)
                    synchronize(device)
                    seconds = (time.perf_counter() - start) / calls
                else:
                    seconds = statistics.median(forward_backward_seconds(model, inputs, device, calls))
            if round_index >= 0:
                per_round[name].append(1e6 * seconds)
    return per_round


def make_rows(mode, per_round, ops, launches, num_layers):
    baseline = statistics.median(per_round[BASELINE])
    torch_name = "fast[torch]"
    torch_median = statistics.median(per_round[torch_name]) if torch_name in per_round else None
    rows = []
    for name, samples in per_round.items():
        median = statistics.median(samples)
        p10, p90 = (float(x) for x in np.percentile(samples, [10, 90]))
        rows.append(dict(
            mode=mode, method=name, median_us=median, p10_us=p10, p90_us=p90, round_us=samples,
            vs_reference=median / baseline,
            vs_torch_backend=median / torch_median if torch_median else None,
            aten_ops_per_layer=ops[name] / num_layers,
            launches_per_layer=None if launches[name] is None else launches[name] / num_layers))
    return rows


def run(options, progress):
    device = options.device
    config = encoder_config(options.layers, options.hidden, options.heads, options.ffn, options.seq,
                            options.dropout)
    inputs = tuple(make_inputs(options.batch, options.seq, 0.5, VOCAB_SIZE, options.seed, device))
    if options.model == "hf":
        models = build_hf_models(config, options.backends, device, gpu_path=options.gpu_path,
                                 skip_padding=options.skip_padding)
        options.hf_attention = models[BASELINE].model.config._attn_implementation
        if options.checkpointing != "off":
            for model in models.values():
                checkpoint_layers(model.model, options.checkpointing == "reentrant")
        tokens, segments, valid_lens = inputs
        # The mask made once, outside the timed calls (peers.HFBertPeer makes it per call).
        inputs = (tokens, segments, valid_position_mask(valid_lens, tokens).long())
    else:
        models = build_models(config, options.backends, device, check_inputs=options.check_inputs,
                              gpu_path=options.gpu_path, skip_padding=options.skip_padding)
    amp = None if options.autocast is None else (device.type, getattr(torch, options.autocast))
    rows = []
    for mode in options.modes:
        _prepare(models, mode)
        ops, launches = {}, {}
        with _graphs_on(models, device) if mode == GRAPHED else contextlib.nullcontext():
            for name, model in models.items():
                with _context(name, amp):
                    for _ in range(2):         # first calls: lazy initialisation, Triton compiles, captures
                        _call(model, mode, inputs)
                    ops[name] = count_ops(model, mode, inputs)
                    launches[name] = count_launches(model, mode, inputs, device, name)
            per_round = time_mode(models, mode, inputs, device, options.rounds, options.calls, options.warmup,
                                  progress, amp)
        rows += make_rows(mode, per_round, ops, launches, options.layers)
        _prepare(models, "forward")
    return rows


def make_record(rows, options, argv):
    return dict(
        kind=HOST_RECORD_KIND,
        environment=environment_info(options.device),
        command=list(argv),
        date=datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        config=dict(model=options.model, hf_attention=getattr(options, "hf_attention", None),
                    num_layers=options.layers, num_hiddens=options.hidden, num_heads=options.heads,
                    ffn_num_hiddens=options.ffn, vocab_size=VOCAB_SIZE, batch=options.batch,
                    seq=options.seq, dropout=options.dropout, check_inputs=options.check_inputs,
                    skip_padding=options.skip_padding, checkpointing=options.checkpointing,
                    autocast=options.autocast, rounds=options.rounds, calls_per_round=options.calls,
                    warmup_rounds=options.warmup, seed=options.seed, timing=TIMING),
        rows=rows)


TIMING = ("host microseconds per call, median over interleaved rounds (rotating order). forward: "
          "eval, torch.inference_mode, N back-to-back calls per round, one synchronize after them; "
          "forward+backward: train mode, output.sum().backward(), each call timed alone (grads set to "
          "None before it, untimed; synchronize after it), the round's median; cuda_graphs forward: as "
          "forward, the fast rows with cuda_graphs=True, each call replaying its graph (on the CPU the "
          "replay stubbed: the call's host work around it; the reference eager; on a GPU, whether "
          "the profiler's launches include the replayed graph's kernels is not checked yet). ATen ops: operator "
          "calls that reach a kernel (TorchDispatchMode), per layer = per call / layers; launches: "
          "CUDA kernels, memcpys and memsets of one call (torch.profiler), per layer likewise; in the "
          f"row {GPU_PATH!r} (CPU tensors through the GPU's eager path, Triton's launcher included on "
          "kernels compiled for sm_90, except under TRITON_INTERPRET=1), the Triton launches counted in "
          "place of the driver's (its GEMMs and other ATen calls are in the ATen ops)")


def build_parser():
    parser = argparse.ArgumentParser(
        prog="python -m bert_fast.bench",
        description="Host time (Python, dispatcher, launches) of an encoder forward and forward+backward "
                    "at a shape with negligible arithmetic: the reference against FastBERTEncoder on every "
                    "backend. Runs on CPU and GPU.")
    parser.add_argument("--suite", choices=["host"], required=True,
                        help="host: this benchmark (python -m bert_fast.bench --help: the main job)")
    parser.add_argument("--device", help="e.g. cpu, cuda, cuda:1 (default: cuda if available, else cpu)")
    parser.add_argument("--model", choices=["book", "hf"], default="book",
                        help="book: the book's BERTEncoder against FastBERTEncoder; hf: transformers' BertModel "
                             "against copies of it after bert_fast.optimize (needs transformers) "
                             "(default: %(default)s)")
    parser.add_argument("--backends", nargs="+", choices=["torch", "triton", "cuda"],
                        help="FastBERTEncoder backends (default: every one this install can run)")
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES),
                        help="forward: eval, under torch.inference_mode; forward+backward: train "
                             "mode, output.sum() backward; 'cuda_graphs forward': forward with the fast rows "
                             "made cuda_graphs=True (on the CPU the replay stubbed) (default: all three)")
    parser.add_argument("--layers", type=int, default=SHAPE["num_layers"],
                        help="encoder layers (default: %(default)s)")
    parser.add_argument("--hidden", type=int, default=SHAPE["num_hiddens"],
                        help="hidden size H (default: %(default)s)")
    parser.add_argument("--heads", type=int, default=SHAPE["num_heads"],
                        help="attention heads, dividing H (default: %(default)s)")
    parser.add_argument("--ffn", type=int, default=SHAPE["ffn_num_hiddens"],
                        help="FFN hidden size (default: %(default)s)")
    parser.add_argument("--batch", type=int, default=SHAPE["batch"],
                        help="batch size B (default: %(default)s)")
    parser.add_argument("--seq", type=int, default=SHAPE["seq"],
                        help="padded length L; valid lengths uniform in [L/2, L] (default: %(default)s)")
    parser.add_argument("--dropout", type=float, default=0.0,
                        help="the models' dropout (train mode, forward+backward); default 0: the host path "
                             "without dropout work")
    parser.add_argument("--gpu-path", action=argparse.BooleanOptionalAction, default=None,
                        help=f"the row '{GPU_PATH}': the triton backend's GPU eager path on CPU tensors, "
                             "Triton's kernel launches counted instead of run (default: on where the device "
                             "is the CPU, Triton is installed and there is no CUDA GPU)")
    parser.add_argument("--skip-padding", action="store_true",
                        help="FastBERTEncoder's skip_padding for every fast row (the reference computes "
                             "every token; default: off)")
    parser.add_argument("--check-inputs", action=argparse.BooleanOptionalAction, default=True,
                        help="FastBERTEncoder's check_inputs (default: on, as constructed by users)")
    parser.add_argument("--checkpointing", choices=["off", "non-reentrant", "reentrant"], default="off",
                        help="--model hf: HF's gradient checkpointing on every model (forward+backward), "
                             "use_reentrant as named (default: %(default)s)")
    parser.add_argument("--autocast", choices=["bfloat16", "float16"],
                        help="every call under torch.autocast(device, this dtype), as mixed-precision "
                             "training runs (the Parameters stay fp32: the casts of weights and gradients "
                             "are part of the host work; default: off)")
    parser.add_argument("--rounds", type=int, metavar="N", default=15,
                        help="timed rounds, each calling every method (default: %(default)s)")
    parser.add_argument("--calls", type=int, metavar="N", default=20,
                        help="calls per method and round (default: %(default)s)")
    parser.add_argument("--warmup", type=int, metavar="N", default=2, help="untimed rounds (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=0, help="seed of weights and inputs (default: 0)")
    add_record_options(parser, "host")
    return parser


def parse_args(argv):
    parser = build_parser()
    options = parser.parse_args(argv)
    if (min(options.rounds, options.calls, options.layers, options.batch, options.seq, options.hidden,
            options.heads, options.ffn) < 1 or options.warmup < 0):
        parser.error("--rounds, --calls, --layers, --hidden, --heads, --ffn, --batch and --seq must be >= 1, "
                     "--warmup >= 0")
    if not 0 <= options.dropout < 1:
        parser.error(f"--dropout must be in [0, 1), got {options.dropout}")
    if options.model == "hf":
        if importlib.util.find_spec("transformers") is None:
            parser.error("--model hf needs transformers (pip install transformers)")
        if not options.check_inputs:
            parser.error("--no-check-inputs is FastBERTEncoder's option, which --model hf does not build")
    elif options.checkpointing != "off":
        parser.error("--checkpointing is HF's gradient checkpointing: it needs --model hf")
    if options.hidden % options.heads:
        parser.error(f"--hidden ({options.hidden}) must be divisible by --heads ({options.heads})")
    options.device = device_option(parser, options.device)
    options.backends = options.backends or [b for b in available_backends() if b != "auto"]
    if options.gpu_path is None:
        options.gpu_path = gpu_path_available(options.device)
    elif options.gpu_path and not gpu_path_available(options.device):
        parser.error("--gpu-path needs --device cpu, Triton installed and a machine without a CUDA GPU "
                     "(where there is one, time its real path: --device cuda)")
    for backend in options.backends:
        try:
            resolve_backend(backend)
        except ValueError as error:
            parser.error(str(error))
    return options


def main(argv, record_argv=None):
    start = time.perf_counter()
    options = parse_args(argv)
    path = None if options.no_record else record_path_for(options.json, options.device, "host")
    env = environment_info(options.device)
    print(f"suite host on {env['device_name']} ({options.device}, {torch.get_num_threads()} threads): "
          f"{options.layers} layers, H {options.hidden}, {options.heads} heads, FFN {options.ffn}, "
          f"B {options.batch}, L {options.seq}; backends {options.backends}", flush=True)
    progress = Progress()
    rows = run(options, progress)
    progress.close()
    record = make_record(rows, options, sys.orig_argv if record_argv is None else record_argv)
    print(host_record_markdown(record))
    if path is not None:
        write_json(record, path)
        print(f"wrote {path}")
    print(f"total wall time {time.perf_counter() - start:.1f} s")
    return record
