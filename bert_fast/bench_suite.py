"""The GPU benchmark matrix (issue 5): ``python -m bert_fast.bench --suite gpu``.

For every preset (default: base, large) and dtype (default: bfloat16, float16), five shapes:

  dense    B128 L128, every sequence full length
  long     B16 L512, lengths uniform in [0.2 L, L] (60% of L on average)
  mixed    B32 L128, lengths uniform in [L/2, L]
  latency  B1 L128, full length (one request)
  train    one training step (forward, backward, AdamW) of BERTModel with the MLM and NSP heads,
           B32 L128, lengths uniform in [L/2, L], 15% of the valid positions predicted

and every method on the same weights and dtype, in the same run:

  eager                     bert_fast.reference, cast to the dtype (the baseline)
  compile                   torch.compile(reference), default mode
  compile_max_autotune      torch.compile(reference, mode="max-autotune") (--no-autotune: left out)
  torch_transformer         nn.TransformerEncoder fast path, nested tensors (bert_fast.peers)
  hf_sdpa                   HF BertModel, attn_implementation="sdpa" (bert_fast.peers)
  hf_optimize               the same HF BertModel after bert_fast.optimize() (bert_fast.hf)
  hf_optimize_cuda_graphs   CUDA only: that HF BertModel after optimize(..., cuda_graphs=True)
  fast, fast_skip_padding   FastBERTEncoder exact and skip_padding, "[backend]" for each backend
                            other than auto's choice
  fast_cuda_graphs, fast_skip_padding_cuda_graphs
                            CUDA only: FastBERTEncoder(cuda_graphs=True), backend auto: the first
                            call of each shape captures a graph, later calls replay it
  fast_compile_reduce_overhead
                            latency shape, CUDA only: torch.compile(fast, mode="reduce-overhead"),
                            i.e. the forward replayed as a CUDA graph
  fast_cuda_graph           latency shape, CUDA only: fast with check_inputs=False, captured by
                            bert_fast.cuda_graph.capture_encoder (no compile)
  train shape: eager, compile (of model + loss), graphed (CUDA only: the reference's encoder
  under torch.cuda.make_graphed_callables, heads, loss and AdamW eager), hf_sdpa (below), optimize /
  optimize_skip_padding (the model after bert_fast.optimize(..., backend=...)), optimize_compile
  (optimize(), backend auto, then model + loss compiled), optimize_compile_reduce_overhead (CUDA
  only: the same with mode="reduce-overhead", forward and backward replayed as CUDA graphs, AdamW
  eager), optimize_graphed (CUDA only: optimize(),
  backend auto, check_inputs off, the encoder graphed as the reference's), hf_optimize; hf_sdpa
  and hf_optimize: the model with a Hugging Face BertModel of the same weights as its encoder
  (sdpa), before and after bert_fast.optimize(), the book's heads and loss (training an HF model
  is what most users of optimize() do); each with its own AdamW on its own weights.

A method that cannot run (not built, peer missing, compile error, out of memory) becomes a row
"skipped: <reason>"; the run goes on. Every row carries median and p90 latency, tokens/s,
speedups vs eager and vs the best peer (the fastest method that is not bert_fast's), model
TFLOP/s (FLOP_FORMULA) and its share of the matmul peak measured in the same run, the error
against the fp32 eager reference, and peak memory (CUDA).

Records: each run writes benchmarks/results/<device>-<date>T<time>-matrix.json under the
working directory (or --json PATH; --no-record: none), rewritten after every shape so that a
run cut short keeps what it measured, and prints where. ``--table-from`` prints a
record as markdown tables (the README's performance table); ``--plot PATH --plot-from JSON``
draws it (both read records in bert_fast/bench_common.py, which has what this module shares
with the main job).

A full matrix compiles ~40 models (max-autotune takes minutes each): on a machine with a
time limit per command, run it in parts (--preset base --dtype bfloat16 --shapes dense long)
and pass all the records to --table-from. ``--device cpu --preset demo --quick`` is the smoke
test (tests/test_bench_suite.py).
"""

import argparse
import copy
import datetime
import gc
import sys
import time
from contextlib import nullcontext
from dataclasses import asdict, dataclass, replace
from typing import Callable, NamedTuple, Optional

import numpy as np
import torch

from . import peers
from .backend import BACKENDS, backend_for, resolve_backend
from .bench_common import (BASELINE, DTYPES, PEER_NAMES, PRESETS, SUITE_RECORD_KIND, Method, Progress,
                           add_record_options, build_models, build_peer, check_plot_path, device_option, encoder_config,
                           environment_info, failure_reason, fast_encoder_sharing,
                           first_call, group_markdown, make_inputs, max_error, plot_suite,
                           record_path_for, synchronize, time_interleaved, write_json)
from .convert import optimize
from .cuda_graph import capture_encoder
from .reference import BERTModel, pretraining_loss


@dataclass(frozen=True)
class Shape:
    name: str
    batch: int
    seq: int
    min_len_frac: float        # lengths uniform in [ceil(min_len_frac * seq), seq]
    training: bool = False


SHAPES = {
    "dense": Shape("dense", 128, 128, 1.0),
    "long": Shape("long", 16, 512, 0.2),
    "mixed": Shape("mixed", 32, 128, 0.5),
    "latency": Shape("latency", 1, 128, 1.0),
    "train": Shape("train", 32, 128, 0.5, training=True),
}
# Timed rounds per shape on a GPU: a call takes ~0.2-20 ms, so these cost seconds, not minutes
# (compilation dominates). The latency shape needs many rounds for a stable p90.
ROUNDS = {"dense": 20, "long": 20, "mixed": 20, "latency": 100, "train": 10}
WARMUP = 3                     # untimed rounds: CUDA graphs are recorded on the 2nd-3rd call
QUICK = dict(max_batch=2, max_seq=32, rounds=2, warmup=1)
MLM_FRACTION = 0.15            # BERT masks 15% of the tokens
# BERT's AdamW settings; eps 1e-6 (not 1e-8) also survives fp16 arithmetic in the foreach path.
ADAMW = dict(lr=1e-4, weight_decay=0.01, eps=1e-6)

FLOP_FORMULA = (
    "model FLOPs on the padded shape (N = B*L tokens, H hidden, F FFN, per layer): "
    "2*N*H*3H (QKV) + 4*B*L^2*H (QK^T and PV) + 2*N*H*H (W_o) + 4*N*H*F (FFN); "
    "embeddings, LayerNorm, softmax and the NSP head are not counted. Training: the MLM head on "
    "its B*P prediction slots (2*B*P*H*H + 2*B*P*H*V) is added and the forward counted 3x "
    "(the backward as 2x). skip_padding is credited with the padded FLOPs too (it is the model's "
    "work, as in MFU).")
TIMING = ("each round calls every method once (rotating order) under torch.inference_mode "
          "(training: grad mode, model.train()); one call = host timer around the call with "
          "torch.cuda.synchronize before and after")
ERROR_NOTE = ("inference: max |output - fp32 eager| over valid positions; training: |loss - fp32 "
              "eager loss| after one step, both in eval mode (dropout off) so they are comparable; "
              "the timed steps then run in train mode (dropout 0.1)")
PRECISION_NOTE = ("weights, activations, gradients and AdamW state all in the dtype (no autocast, "
                  "no fp32 master weights): a throughput benchmark, not a training recipe")


@dataclass
class SuiteMethod(Method):
    may_fail: bool = True      # in the suite nothing ends the run: a failure is a skipped row
    unavailable: Optional[str] = None   # why it is not run here (a skipped row)


def unavailable(name, reason, ours=False):
    return SuiteMethod(name, None, ours=ours, unavailable=reason)


class Workload(NamedTuple):
    """What one shape times, and how its methods are checked."""
    shape: Shape
    methods: list              # SuiteMethod, in row order
    inputs: tuple
    check: Callable            # (method, first output) -> error against the fp32 reference
    prepare_timing: Callable   # (methods) -> None, before the timed rounds
    grad_context: Callable     # () -> context manager of the calls
    flops: float               # model FLOPs of one call (FLOP_FORMULA)


# --------------------------------------------------------------------------- shapes and FLOPs

def quick_shape(shape):
    """The smoke-test version of a shape: same kind, tiny batch and length."""
    return replace(shape, batch=min(shape.batch, QUICK["max_batch"]), seq=min(shape.seq, QUICK["max_seq"]))


def num_prediction_slots(seq):
    return max(1, round(MLM_FRACTION * seq))


def encoder_flops(config, batch, seq):
    hidden, ffn, layers = config["num_hiddens"], config["ffn_num_hiddens"], config["num_layers"]
    tokens = batch * seq
    per_layer = (2 * tokens * hidden * 3 * hidden + 4 * batch * seq * seq * hidden
                 + 2 * tokens * hidden * hidden + 4 * tokens * hidden * ffn)
    return layers * per_layer


def train_step_flops(config, batch, seq):
    hidden, vocab = config["num_hiddens"], config["vocab_size"]
    slots = batch * num_prediction_slots(seq)
    mlm_head = 2 * slots * hidden * hidden + 2 * slots * hidden * vocab
    return 3 * (encoder_flops(config, batch, seq) + mlm_head)


# --------------------------------------------------------------------------- backends

def default_backends(device):
    """"auto", and every other backend this install can run (not again the one auto picks)."""
    others = [b for b in ("torch", "triton", "cuda") if b != backend_for("auto", device)]
    return ["auto", *(b for b in others if backend_unusable(b) is None)]


def backend_unusable(backend):
    """Why a backend cannot be built here, or None."""
    try:
        resolve_backend(backend)
    except ValueError as error:
        return str(error)
    return None


def backend_suffix(backend):
    return "" if backend == "auto" else f"[{backend}]"


INFERENCE_BASELINES = ("eager", "compile", "compile_max_autotune", "torch_transformer", "hf_sdpa")
HF_OPTIMIZE = "hf_optimize"       # ours: the hf_sdpa peer after optimize()
HF_GRAPHS = "hf_optimize_cuda_graphs"    # and after optimize(..., cuda_graphs=True)
AUTO_GRAPHS = ("fast_cuda_graphs", "fast_skip_padding_cuda_graphs")
LATENCY_ONLY = ("fast_compile_reduce_overhead", "fast_cuda_graph")
TRAIN_GRAPHED = ("graphed", "optimize_graphed")     # the reference's encoder graphed, and ours
TRAIN_REDUCE_OVERHEAD = "optimize_compile_reduce_overhead"
TRAIN_HF = ("hf_sdpa", HF_OPTIMIZE)       # the model's encoder an HF BertModel, and after optimize()


def method_names(shape, backends):
    """A shape's row names, in the order its workload lists them when every backend can run."""
    suffixes = [backend_suffix(backend) for backend in backends]
    if shape.training:
        return ["eager", "compile", TRAIN_GRAPHED[0], TRAIN_HF[0], *(name + suffix for suffix in suffixes
                                                                     for name in ("optimize", "optimize_skip_padding")),
                "optimize_compile", TRAIN_REDUCE_OVERHEAD, TRAIN_GRAPHED[1], TRAIN_HF[1]]
    names = [*INFERENCE_BASELINES, HF_OPTIMIZE, HF_GRAPHS, *(name + suffix for suffix in suffixes
                                     for name in ("fast", "fast_skip_padding")), *AUTO_GRAPHS]
    return names + list(LATENCY_ONLY if shape.name == "latency" else ())


# --------------------------------------------------------------------------- inference methods

def compile_methods(module, options, ours=False, prefix="compile"):
    """torch.compile of a module, default and max-autotune; skipped rows when not asked."""
    names = (prefix, f"{prefix}_max_autotune")
    if not options.compile:
        why = "not asked (--no-compile; --quick leaves compile out unless --compile)"
        return [unavailable(name, why, ours) for name in names]
    # dynamic=False: one static-shape graph per shape, as a serving deployment would compile.
    methods = [SuiteMethod(names[0], torch.compile(module, dynamic=False), ours=ours)]
    if options.autotune:
        methods.append(SuiteMethod(names[1], torch.compile(module, mode="max-autotune", dynamic=False),
                                   ours=ours))
    else:
        methods.append(unavailable(names[1], "left out (--no-autotune)", ours))
    return methods


def peer_methods(encoder, dtype, device):
    """nn.TransformerEncoder and HF BertModel (sdpa) with the encoder's weights (bert_fast.peers),
    and (ours) that HF model after optimize()."""
    def hf_optimized(**options):
        peer = peers.hf_bert_peer(encoder, attn_implementation="sdpa")
        return None if peer is None else optimize(peer, **options)

    if device.type == "cuda":
        hf_graphed = _peer_method(HF_GRAPHS, lambda: hf_optimized(cuda_graphs=True), dtype, device,
                                  missing=peers.hf_unavailable_reason, ours=True)
    else:
        hf_graphed = unavailable(HF_GRAPHS, "CUDA only (cuda_graphs=True replays CUDA graphs)", ours=True)
    return [
        *(_pytorch_peer(name, encoder, dtype, device) for name in PEER_NAMES),
        _peer_method(HF_OPTIMIZE, hf_optimized, dtype, device, missing=peers.hf_unavailable_reason, ours=True),
        hf_graphed,
    ]


def _pytorch_peer(name, encoder, dtype, device):
    module, why = build_peer(name, encoder)
    if module is None:
        return unavailable(name, why)
    return SuiteMethod(name, module.to(device=device, dtype=dtype), valid_positions_only=True)


def _peer_method(name, build, dtype, device, missing=None, ours=False):
    try:
        module = build()
    except Exception as error:
        return unavailable(name, f"could not be built: {failure_reason(error)}", ours)
    if module is None:
        return unavailable(name, missing() if missing else "not available", ours)
    # Peers keep their own padded positions (zeros or garbage): compare valid positions only.
    return SuiteMethod(name, module.to(device=device, dtype=dtype).eval(), valid_positions_only=True, ours=ours)


def fast_methods(models, backends, unusable_backends):
    """FastBERTEncoder exact and skip_padding per backend (build_models made the usable ones)."""
    methods = [SuiteMethod(m.name, m.forward, valid_positions_only=m.valid_positions_only, ours=True)
               for name, m in models.methods.items() if name != BASELINE]
    for backend, why in unusable_backends.items():
        for name in ("fast", "fast_skip_padding"):
            methods.append(unavailable(name + backend_suffix(backend), why, ours=True))
    return methods


def auto_graph_methods(eager, config, device):
    """FastBERTEncoder(cuda_graphs=True), exact and skip_padding, backend auto, as constructed by
    users otherwise (check_inputs on): captured on the first call, replayed after it."""
    if device.type != "cuda":
        why = "CUDA only (cuda_graphs=True replays CUDA graphs; elsewhere it is the eager fast row)"
        return [unavailable(name, why, ours=True) for name in AUTO_GRAPHS]
    return [SuiteMethod(name, fast_encoder_sharing(eager, config, backend="auto", skip_padding=skip_padding,
                                                   cuda_graphs=True), valid_positions_only=skip_padding, ours=True)
            for name, skip_padding in zip(AUTO_GRAPHS, (False, True))]


def reduce_overhead_method(eager, config, device, options):
    """FastBERTEncoder compiled with mode="reduce-overhead" (CUDA graphs), for the latency goal."""
    name = "fast_compile_reduce_overhead"
    if device.type != "cuda":
        return unavailable(name, "CUDA only (reduce-overhead replays CUDA graphs)", ours=True)
    if not options.compile:
        return unavailable(name, "not asked (--no-compile)", ours=True)
    # check_inputs=False: the input check's host sync would split the graph.
    fast = fast_encoder_sharing(eager, config, backend="auto", check_inputs=False)
    return SuiteMethod(name, torch.compile(fast, mode="reduce-overhead", dynamic=False), ours=True)


class _CapturedOnFirstCall:
    """An encoder's forward through bert_fast.cuda_graph.capture_encoder: captured on the first
    call (with that call's inputs, which is when the suite compiles every method), replayed
    on every call after it."""

    def __init__(self, encoder):
        self.encoder = encoder
        self.graphed = None

    def __call__(self, *inputs):
        if self.graphed is None:
            # clone_output=False: each call's output is read before the next one.
            self.graphed = capture_encoder(self.encoder, *inputs, clone_output=False)
        return self.graphed(*inputs)


def cuda_graph_capture_method(eager, config, device):
    """FastBERTEncoder replayed by capture_encoder (the latency goal), without the input check."""
    name = "fast_cuda_graph"
    if device.type != "cuda":
        return unavailable(name, "CUDA only (capture_encoder replays a CUDA graph)", ours=True)
    fast = fast_encoder_sharing(eager, config, backend="auto", check_inputs=False)
    return SuiteMethod(name, _CapturedOnFirstCall(fast), ours=True)


def inference_workload(shape, preset, dtype, device, options):
    usable = [b for b in options.backends if backend_unusable(b) is None]
    unusable_backends = {b: backend_unusable(b) for b in options.backends if b not in usable}
    models = build_models(preset, dtype, device, seed=options.seed, include_compile=False,
                          backends=usable)
    eager = models.methods[BASELINE].forward
    methods = [SuiteMethod(BASELINE, eager),
               *compile_methods(eager, options),
               *peer_methods(eager, dtype, device),
               *fast_methods(models, usable, unusable_backends),
               *auto_graph_methods(eager, models.config, device)]
    if shape.name == "latency":
        methods += [reduce_overhead_method(eager, models.config, device, options),
                    cuda_graph_capture_method(eager, models.config, device)]
    inputs = make_inputs(shape.batch, shape.seq, shape.min_len_frac, models.config["vocab_size"],
                         options.seed, device)
    with torch.inference_mode():
        reference_output = models.reference(*inputs).float()
    del models

    def check(method, output):
        # Every method on valid positions: peers and skip_padding define padded rows differently.
        return max_error(output, reference_output, inputs.valid_lens)

    return Workload(shape, methods, tuple(inputs), check, prepare_timing=lambda methods: None,
                    grad_context=torch.inference_mode,
                    flops=encoder_flops(encoder_config(preset), shape.batch, shape.seq))


# --------------------------------------------------------------------------- training methods

def bert_model_config(preset):
    hidden = PRESETS[preset]["num_hiddens"]
    return dict(encoder_config(preset), hid_in_features=hidden, mlm_in_features=hidden,
                nsp_in_features=hidden)


class TrainBatch(NamedTuple):
    """pretraining_loss's arguments after the model."""
    tokens: torch.Tensor
    segments: torch.Tensor
    valid_lens: torch.Tensor
    pred_positions: torch.Tensor
    mlm_weights: torch.Tensor
    mlm_labels: torch.Tensor
    nsp_labels: torch.Tensor


def make_train_batch(shape, vocab_size, seed, device):
    """Random pretraining batch: MLM_FRACTION of each sequence's valid positions are predicted.

    Prediction slots are padded to P = MLM_FRACTION * L per sequence, with weight 0 on the
    unused ones, as in the book's data pipeline. Drawn on the CPU: the same on every device.
    """
    tokens, segments, valid_lens = make_inputs(shape.batch, shape.seq, shape.min_len_frac,
                                               vocab_size, seed, "cpu")
    generator = torch.Generator().manual_seed(seed + 1)
    slots = num_prediction_slots(shape.seq)
    pred_positions = torch.zeros(shape.batch, slots, dtype=torch.long)
    mlm_weights = torch.zeros(shape.batch, slots)
    for row, length in enumerate(valid_lens.tolist()):
        count = min(slots, num_prediction_slots(length))
        pred_positions[row, :count] = torch.randperm(length, generator=generator)[:count]
        mlm_weights[row, :count] = 1.0
    mlm_labels = torch.randint(0, vocab_size, (shape.batch, slots), generator=generator)
    nsp_labels = torch.randint(0, 2, (shape.batch,), generator=generator)
    batch = TrainBatch(tokens, segments, valid_lens, pred_positions, mlm_weights, mlm_labels, nsp_labels)
    return TrainBatch(*(t.to(device) for t in batch))


class TrainStep:
    """One pretraining step of a model with its own AdamW: returns the loss before the update.

    ``graph_encoder``: the encoder's forward and backward replayed from CUDA graphs
    (torch.cuda.make_graphed_callables, the README's recipe: check_inputs off, static shapes),
    the heads, the loss and AdamW eager. Graphs hold one training state: a call in the other
    state (the suite checks in eval mode, times in train mode) captures again."""

    def __init__(self, model, device, compile_mode=None, graph_encoder=False):
        self.model = model
        self.graph_encoder = graph_encoder
        self.graphed_training = None          # the training state the encoder's graphs hold
        # fused AdamW (one kernel for all parameters) on CUDA, for every method alike.
        self.optimizer = torch.optim.AdamW(model.parameters(), **ADAMW,
                                           fused=True if device.type == "cuda" else None)

        def loss(*batch):
            return pretraining_loss(model, *batch)[0]

        # Model and loss in one graph, so compile can fuse the heads' epilogues into the loss.
        self.loss = loss if compile_mode is None else torch.compile(loss, mode=compile_mode,
                                                                     dynamic=False)

    def __call__(self, *batch):
        if self.graph_encoder and self.graphed_training is not self.model.training:
            self._capture_encoder(batch)
        self.optimizer.zero_grad(set_to_none=True)
        loss = self.loss(*batch)
        loss.backward()
        self.optimizer.step()
        return loss.detach()

    def _capture_encoder(self, batch):
        encoder = self.model.encoder
        vars(encoder).pop("forward", None)         # the previous capture's forward: the class's again
        if hasattr(encoder, "check_inputs"):
            encoder.check_inputs = False           # a host read cannot be captured
        # allow_unused_input: no gradient reaches pos_embedding (REFERENCE.md's quirk).
        torch.cuda.make_graphed_callables(encoder, tuple(batch[:3]), allow_unused_input=True)
        self.graphed_training = self.model.training


def train_methods(base_model, dtype, device, options):
    """eager, compile and bert_fast.optimize per backend, each on its own copy of the weights."""
    def copy_of_model():
        return copy.deepcopy(base_model).to(device=device, dtype=dtype).eval()

    def graphed(name, build, ours):
        if device.type != "cuda":
            return unavailable(name, "CUDA only (torch.cuda.make_graphed_callables replays CUDA graphs)", ours=ours)
        return SuiteMethod(name, TrainStep(build(), device, graph_encoder=True), ours=ours)

    methods = [SuiteMethod(BASELINE, TrainStep(copy_of_model(), device))]
    if options.compile:
        methods.append(SuiteMethod("compile", TrainStep(copy_of_model(), device, compile_mode="default")))
    else:
        methods.append(unavailable("compile", "not asked (--no-compile; --quick leaves compile out "
                                              "unless --compile)"))
    methods.append(graphed(TRAIN_GRAPHED[0], copy_of_model, ours=False))
    methods.append(_hf_train_method(TRAIN_HF[0], copy_of_model, device, ours=False))
    for backend in options.backends:
        for name, skip_padding in (("optimize", False), ("optimize_skip_padding", True)):
            name += backend_suffix(backend)
            why = backend_unusable(backend)
            if why is not None:
                methods.append(unavailable(name, why, ours=True))
                continue
            try:
                model = optimize(copy_of_model(), backend=backend, skip_padding=skip_padding)
            except Exception as error:
                methods.append(unavailable(name, f"optimize failed: {failure_reason(error)}", ours=True))
                continue
            methods.append(SuiteMethod(name, TrainStep(model, device), ours=True))
    # The step compiled with our registered ops inside (backend auto), model and loss in one
    # graph; with reduce-overhead its forward and backward graphs replay as CUDA graphs.
    for name, mode in (("optimize_compile", "default"), (TRAIN_REDUCE_OVERHEAD, "reduce-overhead")):
        if not options.compile:
            methods.append(unavailable(name, "not asked (--no-compile; --quick leaves compile out unless "
                                             "--compile)", ours=True))
        elif mode == "reduce-overhead" and device.type != "cuda":
            methods.append(unavailable(name, "CUDA only (reduce-overhead replays CUDA graphs)", ours=True))
        else:
            methods.append(SuiteMethod(name, TrainStep(optimize(copy_of_model()), device, compile_mode=mode),
                                       ours=True))
    methods.append(graphed(TRAIN_GRAPHED[1], lambda: optimize(copy_of_model()), ours=True))
    methods.append(_hf_train_method(TRAIN_HF[1], copy_of_model, device, ours=True))
    return methods


def _hf_train_method(name, copy_of_model, device, ours):
    """The train step with the model's encoder swapped for a Hugging Face BertModel of its weights
    (bert_fast.peers.hf_bert_peer, sdpa), after optimize() where ``ours``: the same heads, loss,
    batch and AdamW as the other rows."""
    why = peers.hf_unavailable_reason()
    if why is not None:
        return unavailable(name, why, ours=ours)
    model = copy_of_model()
    model.encoder = peers.hf_bert_peer(model.encoder, attn_implementation="sdpa")
    if ours:
        try:
            model = optimize(model)
        except Exception as error:
            return unavailable(name, f"optimize failed: {failure_reason(error)}", ours=True)
    return SuiteMethod(name, TrainStep(model, device), ours=ours)


def loss_after_one_step(step, batch):
    """The loss of the weights after one step from the start (eval mode: no dropout)."""
    step(*batch)
    return step(*batch)


def train_workload(shape, preset, dtype, device, options):
    config = bert_model_config(preset)
    torch.manual_seed(options.seed)
    base_model = BERTModel(**config)      # initialised on the CPU: the same weights on every device
    batch = make_train_batch(shape, config["vocab_size"], options.seed, device)
    reference = TrainStep(copy.deepcopy(base_model).to(device).eval(), device)
    reference_loss = loss_after_one_step(reference, batch).item()
    del reference
    methods = train_methods(base_model, dtype, device, options)

    def check(method, first_loss):
        # first_call made step 1; this call's loss is that of the weights after it.
        return abs(method.forward(*batch).float().item() - reference_loss)

    def prepare_timing(methods):
        for method in methods:
            method.forward.model.train()    # the timed steps run with dropout, as pretraining does

    return Workload(shape, methods, tuple(batch), check, prepare_timing, grad_context=nullcontext,
                    flops=train_step_flops(config, shape.batch, shape.seq))


# --------------------------------------------------------------------------- measuring

class Guarded:
    """A method's forward that keeps its first failure instead of raising it, so that one method
    running out of memory (or recompiling into an error) in the timed rounds ends neither the
    run nor the other methods' timing. Later calls do nothing; the row becomes a skipped one."""

    def __init__(self, forward):
        self.forward = forward
        self.failure = None

    def __call__(self, *inputs):
        if self.failure is not None:
            return None
        try:
            return self.forward(*inputs)
        except Exception as error:
            self.failure = f"failed while timing: {failure_reason(error)}"
            release_memory()
            return None


def release_memory():
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def measure_matmul_peak(dtype_name, device, n, rounds=20, warmup=3):
    """TFLOP/s of one n x n x n matmul in the dtype: the peak the model TFLOP/s are set against.

    ``tflops`` is of the fastest call: a peak is what the hardware can do, and on a shared
    machine a median of a few short calls can catch a slow moment (a CPU VM's median once read
    0.149 TFLOP/s where the same matmul gave 0.22-0.25 minutes later, and the eager encoder ran
    at "116% of peak"). ``median_tflops`` is kept beside it; older records (no ``fastest_ms``)
    took the median of 10 calls.
    """
    dtype = DTYPES[dtype_name]
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    matmul = Method("matmul", lambda: torch.mm(a, b))
    with torch.inference_mode():
        seconds = time_interleaved([matmul], (), device, rounds=rounds, untimed_rounds=warmup)["matmul"]
    median, fastest = float(np.median(seconds)), min(seconds)
    flop = 2 * n ** 3
    return dict(dtype=dtype_name, n=n, calls=rounds, median_ms=1e3 * median, fastest_ms=1e3 * fastest,
                tflops=flop / fastest / 1e12, median_tflops=flop / median / 1e12)


def peak_memory_mib(forward, inputs, device):
    """(peak allocated during one call, peak minus what was allocated before it) in MiB.

    The second figure is what the call itself needs: activations, workspaces, gradients.
    """
    if device.type != "cuda":
        return None, None
    synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    forward(*inputs)
    synchronize(device)
    peak = torch.cuda.max_memory_allocated(device)
    return peak / 2 ** 20, (peak - before) / 2 ** 20


class Measured(NamedTuple):
    skipped: Optional[str]
    first_call_ms: float = None
    error: float = None
    seconds: list = None
    memory: tuple = (None, None)


def check_first_calls(workload, device, progress):
    """First call of each method (compiles; not timed) and its error → {name: Measured}."""
    results = {}
    for method in workload.methods:
        if method.unavailable is not None:
            results[method.name] = Measured(method.unavailable)
            continue
        progress.update(f"{workload.shape.name}: {method.name}: first call")
        try:
            output, seconds, why = first_call(method, workload.inputs, device)
            error = workload.check(method, output) if why is None else None
        except Exception as failure:      # the check's own call (training) may fail too
            output, seconds, why, error = None, 0.0, failure_reason(failure), None
        del output
        if why is not None:
            progress.note(f"{workload.shape.name}: {method.name} skipped: {why}")
            release_memory()
            results[method.name] = Measured(why)
            continue
        results[method.name] = Measured(None, 1e3 * seconds, error)
    return results


def time_methods(workload, results, device, rounds, warmup, progress):
    """Interleaved timed rounds of the methods whose first call worked; updates ``results``."""
    runnable = [m for m in workload.methods if results[m.name].skipped is None]
    workload.prepare_timing(runnable)
    guarded = {m.name: Guarded(m.forward) for m in runnable}

    def on_call(name, round_index, total):
        what = "warmup" if round_index < 0 else f"round {round_index + 1}/{total}"
        progress.update(f"{workload.shape.name}: {name}: {what}")

    seconds = time_interleaved([Method(name, g) for name, g in guarded.items()], workload.inputs,
                               device, rounds=rounds, untimed_rounds=warmup, on_call=on_call)
    for name, guard in guarded.items():
        memory = (None, None)
        if guard.failure is None:
            memory = peak_memory_mib(guard, workload.inputs, device)
        if guard.failure is not None:
            progress.note(f"{workload.shape.name}: {name} skipped: {guard.failure}")
            results[name] = Measured(guard.failure, results[name].first_call_ms)
            continue
        results[name] = results[name]._replace(seconds=seconds[name], memory=memory)


def measure(workload, device, rounds, warmup, progress):
    with workload.grad_context():
        results = check_first_calls(workload, device, progress)
        time_methods(workload, results, device, rounds, warmup, progress)
    return results


# --------------------------------------------------------------------------- rows

def make_rows(workload, results, *, preset, dtype_name, matmul_peak_tflops):
    shape, inputs = workload.shape, workload.inputs
    valid_tokens = int(inputs[2].sum())
    padded_tokens = shape.batch * shape.seq
    rows = []
    for method in workload.methods:
        measured = results[method.name]
        row = dict(preset=preset, dtype=dtype_name, shape=shape.name, method=method.name,
                   ours=method.ours, training=shape.training, batch=shape.batch, seq=shape.seq,
                   valid_tokens=valid_tokens, padded_tokens=padded_tokens,
                   skipped=measured.skipped, first_call_ms=measured.first_call_ms)
        if measured.skipped is None:
            median, p90 = (float(x) for x in np.percentile(measured.seconds, [50, 90]))
            tflops = workload.flops / median / 1e12
            row.update(
                latencies_ms=[1e3 * s for s in measured.seconds], median_ms=1e3 * median,
                p90_ms=1e3 * p90, valid_tokens_per_s=valid_tokens / median,
                padded_tokens_per_s=padded_tokens / median, model_tflops=tflops,
                pct_of_matmul_peak=100 * tflops / matmul_peak_tflops,
                error=measured.error,
                error_metric="loss_after_one_step" if shape.training else "max_abs_valid",
                peak_memory_mib=measured.memory[0], call_memory_mib=measured.memory[1])
        rows.append(row)
    add_speedups(rows)
    return rows


def add_speedups(rows):
    """speedup_vs_eager, and vs the best peer (the fastest timed method that is not ours)."""
    timed = [row for row in rows if row["skipped"] is None]
    eager = next((row for row in timed if row["method"] == BASELINE), None)
    peers = [row for row in timed if not row["ours"]]
    best_peer = min(peers, key=lambda row: row["median_ms"]) if peers else None
    for row in timed:
        row["speedup_vs_eager"] = eager["median_ms"] / row["median_ms"] if eager else None
        row["best_peer"] = best_peer["method"] if best_peer else None
        row["speedup_vs_best_peer"] = best_peer["median_ms"] / row["median_ms"] if best_peer else None


# --------------------------------------------------------------------------- records

def make_suite_record(rows, matmul_peaks, options, shapes, device, argv, complete=True):
    """``complete``: False for the record rewritten after each group while the run goes on (a
    run stopped by a time limit leaves it so: its tables say the run did not finish)."""
    return dict(
        kind=SUITE_RECORD_KIND,
        complete=complete,
        environment=environment_info(device),
        command=list(argv),
        date=datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        config=dict(presets=options.preset, dtypes=options.dtype, shapes=[asdict(s) for s in shapes],
                    backends=options.backends, compile=options.compile, autotune=options.autotune,
                    quick=options.quick, seed=options.seed, warmup_rounds=options.warmup,
                    rounds={s.name: rounds_for(s, options) for s in shapes},
                    mlm_fraction=MLM_FRACTION, adamw=ADAMW, precision=PRECISION_NOTE,
                    timing=TIMING, flop_formula=FLOP_FORMULA, error=ERROR_NOTE),
        matmul_peaks=matmul_peaks,
        rows=rows)


# --------------------------------------------------------------------------- CLI

def rounds_for(shape, options):
    return options.rounds if options.rounds is not None else ROUNDS[shape.name]


def _shape_words(shape):
    what = "one training step, " if shape.training else ""
    return f"{shape.name} ({what}B{shape.batch} L{shape.seq})"


def build_parser():
    parser = argparse.ArgumentParser(
        prog="python -m bert_fast.bench",
        description="The benchmark matrix of issue 5: presets x dtypes x shapes, every peer and "
                    "every bert_fast method on the same weights, one record per run.")
    parser.add_argument("--suite", choices=["gpu"], required=True,
                        help="gpu: this benchmark (python -m bert_fast.bench --help: the main job)")
    parser.add_argument("--preset", nargs="+", choices=PRESETS, default=["base", "large"],
                        help="model sizes (default: base large)")
    parser.add_argument("--dtype", nargs="+", choices=DTYPES, default=["bfloat16", "float16"],
                        help="dtypes of weights and activations (default: bfloat16 float16)")
    parser.add_argument("--shapes", nargs="+", choices=SHAPES, default=list(SHAPES),
                        help=f"{', '.join(map(_shape_words, SHAPES.values()))} (default: all)")
    parser.add_argument("--backends", nargs="+", choices=BACKENDS,
                        help="FastBERTEncoder backends (default: auto and every other one that can run)")
    parser.add_argument("--device", help="e.g. cpu, cuda, cuda:1 (default: cuda if available, else cpu)")
    parser.add_argument("--rounds", type=int, metavar="N",
                        help="timed rounds of every shape (default: "
                             f"{', '.join(f'{name} {rounds}' for name, rounds in ROUNDS.items())}; "
                             f"with --quick {QUICK['rounds']})")
    parser.add_argument("--warmup", type=int, metavar="N",
                        help=f"untimed rounds after the first call (default: {WARMUP}; with --quick "
                             f"{QUICK['warmup']})")
    parser.add_argument("--seed", type=int, default=0, help="seed of weights and inputs (default: 0)")
    parser.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                        help="the torch.compile methods (default: on, off with --quick)")
    parser.add_argument("--no-autotune", dest="autotune", action="store_false",
                        help="leave out compile mode='max-autotune' (default: timed; minutes to "
                             "compile per shape)")
    parser.add_argument("--quick", action="store_true",
                        help=f"smoke test: B <= {QUICK['max_batch']}, L <= {QUICK['max_seq']}, "
                             f"{QUICK['rounds']} rounds, no compile unless --compile")
    parser.add_argument("--matmul-n", type=int, metavar="N", help="size of the peak matmul (default: 8192 on CUDA; "
                                                     "on CPU 1024, fp16 256)")
    add_record_options(parser, "matrix", contents="rewritten after every shape")
    parser.add_argument("--plot", metavar="PATH", help="also draw the record into this PNG")
    return parser


def parse_args(argv):
    parser = build_parser()
    options = parser.parse_args(argv)
    if options.plot:
        check_plot_path(parser, options.plot)
    options.compile = (not options.quick) if options.compile is None else options.compile
    options.warmup = options.warmup if options.warmup is not None else (
        QUICK["warmup"] if options.quick else WARMUP)
    if options.quick and options.rounds is None:
        options.rounds = QUICK["rounds"]
    if (options.rounds is not None and options.rounds < 1) or options.warmup < 1:
        parser.error("--rounds and --warmup must be >= 1")
    if options.matmul_n is not None and options.matmul_n < 64:
        parser.error("--matmul-n must be >= 64 (the peak is timed on an N x N x N matmul)")
    device = options.device = device_option(parser, options.device)
    options.backends = options.backends or default_backends(device)
    shapes = [quick_shape(SHAPES[name]) if options.quick else SHAPES[name] for name in options.shapes]
    for preset in options.preset:
        too_long = [s.name for s in shapes if s.seq > PRESETS[preset]["max_len"]]
        if too_long:
            parser.error(f"shapes {too_long} are longer than preset {preset}'s max_len")
    return options, shapes


def matmul_size(options, dtype_name):
    if options.matmul_n is not None:
        return options.matmul_n
    return default_matmul_size(options.device, dtype_name)


def default_matmul_size(device, dtype_name):
    """N of the N x N x N matmul whose rate is a run's peak, per device and dtype."""
    if device.type == "cuda":
        return 8192
    # CPUs have no fast fp16 GEMM (1024³ takes seconds): a smaller one measures the same rate.
    return 256 if dtype_name == "float16" else 1024


def build_workload(shape, preset, dtype, device, options):
    if options.compile:
        torch._dynamo.reset()   # a fresh cache per shape: no recompile limit, no stale CUDA graphs
    builder = train_workload if shape.training else inference_workload
    return builder(shape, preset, dtype, device, options)


def run_suite(options, shapes, progress, on_group=None):
    """All groups (preset, dtype, shape) → (rows, matmul peaks); on_group(rows so far) after each."""
    device = options.device
    peaks = {name: measure_matmul_peak(name, device, matmul_size(options, name)) for name in options.dtype}
    rows = []
    for preset in options.preset:
        for dtype_name in options.dtype:
            for shape in shapes:
                progress.note(f"== {preset} {dtype_name} {shape.name}: B{shape.batch} L{shape.seq}")
                workload = build_workload(shape, preset, DTYPES[dtype_name], device, options)
                results = measure(workload, device, rounds_for(shape, options), options.warmup, progress)
                group = make_rows(workload, results, preset=preset, dtype_name=dtype_name,
                                  matmul_peak_tflops=peaks[dtype_name]["tflops"])
                rows += group
                del workload, results
                release_memory()
                if on_group is not None:
                    on_group(rows, list(peaks.values()), group)
    return rows, list(peaks.values())


def main(argv, record_argv=None):
    """Run the suite; ``argv`` as on the command line (with --suite gpu)."""
    start = time.perf_counter()
    options, shapes = parse_args(argv)
    device = options.device
    path = None if options.no_record else record_path_for(options.json, device, "matrix")
    command = list(sys.orig_argv) if record_argv is None else list(record_argv)
    env = environment_info(device)
    print(f"suite gpu on {env['device_name']} ({device}); presets {options.preset}, dtypes "
          f"{options.dtype}, shapes {[s.name for s in shapes]}, backends {options.backends}, "
          f"compile {options.compile}, autotune {options.autotune and options.compile}; "
          f"record {path or 'none (--no-record)'}", flush=True)
    if device.type == "cpu":
        print("note: the GPU suite on a CPU is a smoke run (--preset demo --quick takes minutes; the default "
              "matrix, hours); its '% peak' sets each row against one N x N x N matmul in that dtype, which "
              "a CPU without fast bf16/fp16 GEMMs runs far below the model's own GEMMs (shares over 100%): "
              "not a measure of the hardware", flush=True)
    progress = Progress()

    def on_group(rows, peaks, group):
        # Rewritten after every group: a run stopped by a time limit keeps what it measured.
        if path is not None:
            write_json(make_suite_record(rows, peaks, options, shapes, device, command, complete=False), path)
        progress.close()
        print(group_markdown(group) + "\n", flush=True)

    rows, peaks = run_suite(options, shapes, progress, on_group)
    progress.close()
    record = make_suite_record(rows, peaks, options, shapes, device, command)
    if path is not None:
        write_json(record, path)
        print(f"wrote {path}")
    if options.plot:
        plot_suite([record], options.plot)
        print(f"wrote {options.plot}")
    print(f"total wall time {time.perf_counter() - start:.1f} s")
    return record
