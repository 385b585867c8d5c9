"""CUDA graphs for the encoder's inference forward: automatic (``cuda_graphs=True``) or manual.

At small batch and short sequences an eager forward spends more time launching its kernels
from Python than running them. A CUDA graph records the launches once and replays them all
with one call. The motivating measurement (H100, torch 2.11, BERT-base bf16,
../shared/gpu-runs/h100-2026-11-23/SUMMARY.md sections 2 and 4): at B1 L128 the eager fast
path took 12.60 ms and the eager reference 7.94 ms, while the same fast kernels replayed from a
graph took 0.556 ms (triton backend; 0.608 cuda, 0.783 torch); at B32 L128 with mixed lengths
8.60 ms (reference) against 1.86 ms; at B128 L128 12.12 against 6.57 ms. Those graphs were made
with ``capture_encoder`` (below) after ``pack_qkv_()`` with ``check_inputs=False``; the
automatic path replays the same kind of graph but adds host work per call (next paragraphs).
Its logic is tested on the CPU with the capture step stubbed (tests/test_cuda_graph.py); its
GPU tests passed on an H200 on 2026-11-26 (README), before the staging kernel (below) replaced
the per-call copies and checks: that kernel has run in Triton's interpreter and compiled for
sm_90, not yet on a GPU.

Automatic: ``FastBERTEncoder(..., cuda_graphs=True)`` (or ``bert_fast.optimize(model,
cuda_graphs=True)``, which also graphs Hugging Face BertModels the same way: bert_fast.hf's
_GraphedCalls, with the attention mask where the encoder has valid_lens)::

    encoder = FastBERTEncoder(..., cuda_graphs=True).cuda().eval()
    with torch.inference_mode():                 # or torch.no_grad(), or frozen parameters
        out = encoder(tokens, segments, valid_lens)  # any B, L: the first call of a shape
                                                      # bucket captures, later calls replay

When it replays (``graphed_forward``): CUDA inputs, the encoder and every submodule in eval
mode, and autograd not recording, i.e. ``torch.is_grad_enabled()`` is False (``no_grad``,
``inference_mode``) or no parameter requires grad (gradients cannot flow through a replay).
Otherwise the call runs the eager forward, with one CudaGraphFallbackWarning per encoder and
reason ("device", "training", "autograd", "hooks": grad mode on and forward hooks on
submodules, present at capture or global, which a replay would not run (one may add a tensor
that requires grad), "parameters": tensor subclasses such as FSDP's DTensors, "capture": a
capture that failed, after which its bucket stays eager). While torch.compile or torch.jit
traces, under a dispatch mode (FakeTensorMode, a FLOP counter; not the host benchmark's op
counter, which sets ``bert_fast_sees_replays``), and inside someone else's capture, the eager
forward runs silently (the caller records it).

Buckets. B and L are rounded up (``bucket_batch``, ``bucket_seqlen``): L to a multiple of 16
up to 128, then 4 buckets per octave (160, 192, 224, 256, 320, 384, 448, 512, 640, ...), never
beyond the position table (``pos_embedding.shape[1]``); B to 1, 2, 4, 8, then 4 per octave
(10, 12, 14, 16, 20, 24, 28, 32, 40, ...). Padding wastes under 25% of a dimension past the
small sizes, where the shapes are host-bound and extra rows cost little GPU time. A few dozen
buckets per dimension cover every shape up to L 512 and B 256, but a graph is per (B_b, L_b)
pair (and N_b under skip_padding): a workload whose shapes span more pairs than
``max_cuda_graphs`` keeps evicting and capturing (one CudaGraphFallbackWarning says so once the
evictions reach the limit); pad to few shapes or raise the limit. The extra rows and columns
are masked and sliced off:
None valid_lens become full-length 1-D lengths, 1-D and 2-D valid_lens are clamped to the real
L (key j is visible iff float32(j) < valid_len, so padded keys stay invisible; NaN stays NaN;
fp16/bf16 lengths are held in float32, exactly, as the attention compares them), extra batch
rows get length 0, extra query rows of 2-D lengths 0, extra tokens and segments id 0; the
output's [:B, :L] is returned as a fresh tensor (the graph's own output is overwritten by the
next replay). One exception: in exact mode a row that sees no key (valid_len <= 0 or NaN)
attends uniformly to all L keys, so padding L would change it. A call with valid_lens whose L
is not a bucket length therefore reads on the host whether every row sees a key (the call's
one host read, below) and runs at its exact L when one does not; pad batches to bucket lengths
to skip that read.

Staging. A call's inputs reach the static buffers of its (B_b, L_b) (shared by the graphs of
that shape) through one kernel on CUDA (bert_fast/ops/graph_inputs.py; PyTorch copies where
Triton is missing), which also reduces what the host may need to know: the id ranges and NaN
lengths (the input check), the valid-token count (skip_padding), whether some row sees no key.
The host reads those in one sync, and only when it needs one of them: with check_inputs on
(FastBERTEncoder's default), with skip_padding and valid_lens, or in exact mode with valid_lens
at an L between buckets. A bad value raises the eager check's ValueError. When the id ranges
are all the call reads (check_inputs on, exact mode, valid_lens None or L a bucket length),
the read waits until the replay is launched: the kernel writes the ids clamped into the
tables, so the replay reads no table out of range (the torch backend's lookup would assert on the
device), the stats go to a pinned host buffer behind an event, and the host waits for that
copy alone (not for the replay) before it checks; a bad call's replay output is not returned.
Where skip_padding's count or the keyless rows pick the graph, the read (and the check) comes
before the replay.

skip_padding. One host read per call of the number N of valid tokens (``float32(j) <
valid_len``), rounded up by ``bucket_tokens`` (multiples of 16 up to 128, then 4 per octave,
at most B_b * L_b), part of the key; the graph captures ``_forward(..., num_tokens=N_b)``,
which sizes everything after the unpadding by N_b, so padded tokens stay out of the GEMMs and
only the N_b - N < N/4 + 16 filler rows are extra. None valid_lens run the skip_padding path
with every token valid (N = B * L, no read).

Results equal the eager call's at every position the eager call defines (skip_padding: zeros
at padded positions, as eager) up to rounding: masked keys weigh exactly 0 as in eager, but the
padded call runs other GEMM sizes (cuBLAS may pick another algorithm or split), the kernels'
blocks cover other ranges, and None valid_lens become full lengths (a masked attention call;
on the torch backend SDPA may pick another kernel), and backend "auto" captures Triton's
kernels where its eager calls may run the extension's (backend.AUTO_CAPTURES_TRITON). Bit for
bit only where the padded call is the eager call: a named backend, B and L bucket sizes,
valid_lens given, and under skip_padding N a bucket size.
The tests allow the fp32 floor 1e-4 of ../shared/STYLE.md, and for bf16 the rule there (error
against the fp32 encoder at most twice the eager bf16 call's, plus 5e-2).

Keys. A graph is looked up by everything the captured work depends on: the bucketed shapes
(B_b, L_b, N_b), the valid_lens buffer's shape and dtype (None shares 1-D int64's graphs), the
tokens' and segments' dtypes, the device, the encoder's dtype, resolved backend and
skip_padding, autocast for the device (enabled, dtype), and the global settings the kernels
read (float32 matmul precision, reduced-precision reductions, SDPA backends). Warmup and
capture run with autocast's cast cache off (as make_graphed_callables requires). Parameters: a
graph reads parameter memory, so in-place updates (``load_state_dict``, optimizer steps,
``p.mul_()``) are seen by later replays, while parameters replaced by other tensors (``.to()``,
``.cuda()``, ``load_state_dict(assign=True)``, ``module.weight = nn.Parameter(...)``,
``p.data = ...``, ``pack_qkv_()`` moving them, a submodule replaced, a block appended) must invalidate
the graphs. Each call compares the module tree with a snapshot taken at capture: child counts,
tensors by ``data_ptr`` and training flags always (``p.data = ...``, ``.to()``,
``ModuleList.pop``/``insert`` fire no hook), children, parameters and buffers by identity only
when some module of the process has registered a parameter, buffer or submodule since the last
check (torch's global registration hooks count them: assignment, ``register_*``,
``add_module``, ``load_state_dict(assign=True)``). A 12-layer encoder (195 parameters, 196
modules) took ~24 us a check that way on the CI machine's CPU, against ~41 us comparing
everything every call (2026-11-26, interleaved); the addresses read through the parameter and
buffer dicts (for writes into them, which fire no hook) made it ~30 us against ~26 (2026-11-27,
timeit, H 64). The check runs after the replay is launched, while the GPU runs it (the first
call, and a call that captures, check first): the snapshot keeps the storages of the tensors it
saw alive, so a replay of a changed tree reads valid (stale) memory; the call then waits for
that replay, discards its output and runs again, checking first (and keeps checking first while
a submodule stays in training mode). (So memory replaced since the last call is released at the
next call, or by ``clear_cuda_graphs``; a call on CPU inputs, e.g. after ``.cpu()``, drops the
snapshot.) Any difference drops every graph of the encoder. Not followed: attributes changed by
hand on submodules (eps, num_heads, a GELU's approximate, hooks added after capture), a Parameter
given another layout at the same address (``p.data = p.data.t()``), and writes into a
module's ``_modules`` dict that keep its length: call ``clear_cuda_graphs(encoder)`` after
those. (A tensor written into ``_parameters``/``_buffers``, as torch.func.functional_call and
accelerate do, is seen: the address check reads through those dicts.) Hooks on the encoder run
at every call; hooks on its submodules (blocks, layers, Linears) run in the warmups and the
capture only: a replay runs no Python.

Memory and cost. The first call of a bucket runs 3 eager warmup forwards on a side stream
(Triton autotuning for new shapes happens there), then captures (``torch.cuda.graph`` first
synchronises and empties PyTorch's cache), then replays: about four eager forwards' time,
more when kernels autotune (not measured on a GPU yet). A bucket holds its static inputs and output
(B_b * L_b * (2 id + H) elements); the graphs of one encoder share one memory pool, so their
activations overlap (the pool grows to the largest forward's activations, not their sum): the
graphs replay one at a time, on the caller's current stream (a call from another stream than
the previous one first waits for that stream). At most ``encoder.max_cuda_graphs`` graphs are
kept (default DEFAULT_MAX_GRAPHS = 8; set the attribute to change it), least recently used
evicted first; ``clear_cuda_graphs(encoder_or_model)`` drops them all (and forgets failed
captures and given warnings); ``torch.cuda.empty_cache()`` then returns the memory to the
driver. ``cuda_graph_stats(encoder)`` shows the buckets held and counts captures, replays,
evictions, invalidations and eager calls.

Per call, a replay costs on the host: the input check of shapes and dtypes (no tensor op),
the staging launch and its host read when needed (above), the replay, then the snapshot check
and the deferred read of the id ranges, and the output copy: on a GPU 3 launches (4 with the
deferred read's copy), and one sync where a value is read. On the CPU VM, replay stubbed
(``scripts/graph_call_host.py``: 12 layers H 64, B1 L16, GPU path, 2026-11-26, three runs
each): 48-49 us of 90-91 a call come before the launch, against 76-80 of 83-87 when the tree
check and the read came first; 111-117 of 176-184 against 147-159 of 161-174 right after an
eager reference forward (cold caches). The whole call is 3-13 us longer (the pending read's
objects, the check after the launch); on a GPU the work after the launch overlaps the replay.
Not yet measured on a GPU. Measured with
``python -m bert_fast.bench --suite host --modes "cuda_graphs forward"`` on the CI machine's
CPU, the replay stubbed (12 layers, H 64, B1 L8, 1-D valid_lens, the row "fast[triton] GPU
path": the staging kernel compiled for sm_90, its launch counted instead of made), 2026-11-26:
per call 4 ATen ops and one Triton launch with check_inputs, exact or skip_padding (2 ops
without it), where copying and checking the inputs with PyTorch ops took 15 ATen ops, each a
launch on a GPU (20 and two syncs with skip_padding; 8 without the check). Host time there, 3
alternating runs of each on a noisy VM: 0.031-0.033x the reference's eager forward against
0.038-0.042x before (exact), 0.035-0.038x against 0.043-0.054x (skip_padding).

One caller at a time per encoder: calls share the encoder's static buffers and its graphs'
pool, so a lock per encoder serialises them (threads calling one encoder wait for each other:
give each thread its own encoder for concurrency). One capture at a time in the process (a
lock): captures share each device's capture stream. Graphs are captured in "thread_local"
error mode, so other threads' CUDA work does not break a capture.

Manual: ``capture_encoder`` takes the steps a capture needs (warmup, static input buffers, the
input check kept out of the graph) for one fixed shape and returns a callable::

    from bert_fast.cuda_graph import capture_encoder

    encoder = FastBERTEncoder(...).cuda().eval()
    tokens, segments = ...                      # (B, L) int64 on the GPU, padded to L
    valid_lens = ...                            # (B,) real lengths, or None, or (B, L)
    graphed = capture_encoder(encoder, tokens, segments, valid_lens)
    out = graphed(tokens2, segments2, valid_lens2)     # same shapes, dtypes and device

Constraints of capture_encoder (they all come from the graph replaying fixed work on fixed memory):

* Static shapes. A graph replays one shape: every call must pass tensors of the captured
  shapes, dtypes and device, and valid_lens must be None exactly when it was None at
  capture. Pad each batch to the captured B and L (extra rows: any valid ids, then drop
  their output rows) and pass the real lengths in ``valid_lens``; the exact path masks
  padded keys as usual. For several sizes capture one graph per shape (e.g. per L bucket).
* ``skip_padding`` cannot be captured with ``valid_lens`` by capture_encoder: the forward
  counts each sequence's valid tokens on the host, and the sizes of everything after that
  depend on the data. Capture with ``skip_padding=False``, or use ``cuda_graphs=True``,
  which bounds the count by a bucket.
* Memory. The graph keeps a private memory pool holding one forward's activations and its
  output, for as long as the returned object lives (``del`` it to give the memory back).
  Graphs for several shapes can share a pool (``pool=torch.cuda.graph_pool_handle()``, or
  ``pool=first.graph.pool()``) when they are replayed one at a time on one stream.
* Frozen configuration. The graph replays what the module did at capture: its backend,
  options and eval mode. Parameters changed in place (``load_state_dict``, optimizer steps,
  ``p.mul_()``) are seen by later replays, because the graph reads their memory; parameters
  replaced by new tensors (``module.weight = nn.Parameter(...)``, ``.to(dtype)``,
  ``load_state_dict(assign=True)``) are not: capture again after those.
* Input checks. With ``encoder.check_inputs`` True (FastBERTEncoder's default) each call runs
  ``encoder.validate_inputs`` eagerly before replaying: bad token ids get a
  ValueError instead of an out-of-bounds read inside the graph, at the cost of one host
  synchronisation per call. Set ``encoder.check_inputs = False`` to remove it once your loop
  guarantees valid inputs.
* One capture at a time, and no CUDA work from other threads while it runs (torch.cuda.graph's
  "global" capture mode fails the capture otherwise). A GraphedEncoder serves one caller at
  a time: every call shares its static buffers.

Only modules with the encoder's forward signature ``forward(tokens, segments, valid_lens)``
returning one tensor are supported: FastBERTEncoder and the reference
``bert_fast.reference.BERTEncoder`` (which has no input check). For a BERTModel, capture
``model.encoder`` and run the small heads eagerly. Graphs for training (forward and backward)
are ``torch.cuda.make_graphed_callables``' job.
"""

import collections
import contextlib
import gc
import sys
import threading
import warnings
import weakref

import torch
from torch import nn

from .backend import _GLOBAL_HOOKS, capturing_graph, graph_backend_for
from .checks import check_encoder_shapes, raise_for_values
from .ops import graph_inputs
from .reference import BERTModel

__all__ = ["capture_encoder", "GraphedEncoder", "graphed_forward", "clear_cuda_graphs", "cuda_graph_stats",
           "bucket_batch", "bucket_seqlen", "bucket_tokens", "CudaGraphFallbackWarning", "DEFAULT_MAX_GRAPHS"]

_INPUT_NAMES = ("tokens", "segments", "valid_lens")

# Graphs an encoder keeps unless its ``max_cuda_graphs`` attribute says otherwise.
DEFAULT_MAX_GRAPHS = 8
# Eager calls on the capture stream before each automatic capture (capture_encoder's default).
WARMUP_ITERS = 3

# One capture stream per device, reused by every capture, so that graphs sharing a memory
# pool were captured on the same stream (torch.cuda.graph asks for that), and a capture on
# cuda:1 never runs on a stream of cuda:0. Created on first use, never at import.
_capture_streams = {}


# One capture at a time in the process (taken around _warmup_and_capture): captures share each
# device's capture stream, and work another thread queued there (its warmup) would be recorded
# into the graph being captured. Reentrant: a warmup may capture a nested module's graph.
_capture_lock = threading.RLock()


def _capture_stream(device):
    if device not in _capture_streams:
        _capture_streams[device] = torch.cuda.Stream(device=device)
    return _capture_streams[device]


def _describe(t):
    return f"shape {tuple(t.shape)}, dtype {t.dtype}, device {t.device}"


def _validate_if_asked(encoder, inputs):
    """The encoder's own input check, eagerly, when it has one and it is on (read on every
    call, so flipping ``encoder.check_inputs`` takes effect). The reference has none."""
    if getattr(encoder, "check_inputs", False):
        encoder.validate_inputs(*inputs)


@contextlib.contextmanager
def _attributes_set(module, **values):
    """Set the module's attributes that it has to ``values`` (e.g. its input check off: its
    host sync cannot be captured), restoring them afterwards, also when warmup or capture
    fails. Attributes the module does not have are left absent."""
    saved = {name: getattr(module, name) for name in values if hasattr(module, name)}
    for name in saved:
        setattr(module, name, values[name])
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(module, name, value)


def _module_checks_off(encoder):
    """The module's own input check off (see _attributes_set)."""
    return _attributes_set(encoder, check_inputs=False)


@contextlib.contextmanager
def gc_disabled():
    """Python's cyclic GC off during a capture: it can finalise a Triton CompiledKernel, whose
    destructor unloads a CUDA module, which invalidates the capture (triton-lang/triton#10712,
    which made triton's own do_bench_cudagraph do the same). Also used by kernel_bench."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def end_failed_capture(device, pool):
    """Leave the allocator and the device usable after a capture into ``pool`` failed.

    Up to at least torch 2.11, CUDAGraph.capture_end raises on an invalidated capture before it
    tells the caching allocator (pytorch/pytorch#180395); the allocator then believes a capture
    is still under way and the next empty_cache(), which every torch.cuda.graph entry calls,
    fails an internal assert, so no later capture could succeed. Where capture_end did tell it,
    this call raises "not currently recording" and is ignored. Also used by kernel_bench.
    The synchronize reports, and so clears, a non-sticky capture error. The failed capture's
    pool itself may still be refused afterwards (torch 2.11, H200, 2026-11-26: "beginAllocateToPool:
    already recording to mempool_id"): capture into a new pool after a failure."""
    end = getattr(torch._C, "_cuda_endAllocateToPool", None)
    if end is not None:
        try:
            end(device.index if device.index is not None else torch.cuda.current_device(), pool)
        except Exception:
            pass
    try:
        torch.cuda.synchronize(device)
    except Exception:
        pass


def _warmup_and_capture(run, device, pool, warmup_iters, capture_error_mode="global"):
    """``warmup_iters`` eager calls of ``run()`` on the device's capture stream, then one captured
    into a new CUDAGraph in ``pool``: returns (graph, run's output in the pool).

    The caller's stream waits for the warmup, and the capture stream for the caller's earlier
    work (the static inputs are written there). Whatever warmup or capture raises is raised
    again, after a failed capture has been ended for the allocator (end_failed_capture). Our
    own stream context encloses torch.cuda.graph's: when capture_end raises, graph's __exit__
    never restores the caller's stream, this context still does.

    Autocast's cast cache is off meanwhile (as make_graphed_callables asks): a cast cached in
    the warmup would be read by the graph from memory freed when the autocast region ends, and
    one cached in the capture would live in the pool, where later captures reuse memory.
    """
    with _autocast_cache_off(), torch.cuda.device(device), capturing_graph():
        stream = _capture_stream(device)
        current = torch.cuda.current_stream(device)
        stream.wait_stream(current)
        try:
            with torch.cuda.stream(stream):
                for _ in range(warmup_iters):
                    run()
                graph = torch.cuda.CUDAGraph()
                try:
                    with gc_disabled(), torch.cuda.graph(graph, pool=pool, stream=stream,
                                                          capture_error_mode=capture_error_mode):
                        output = run()
                except BaseException:
                    end_failed_capture(device, pool)
                    raise
        finally:
            current.wait_stream(stream)
    return graph, output


@contextlib.contextmanager
def _autocast_cache_off():
    enabled = torch.is_autocast_cache_enabled()
    torch.set_autocast_cache_enabled(False)
    try:
        yield
    finally:
        torch.set_autocast_cache_enabled(enabled)


def _require_one_cuda_device(encoder, inputs):
    """The one CUDA device that the encoder's parameters and buffers and the inputs are on."""
    found = {}
    module_devices = sorted({str(t.device) for t in (*encoder.parameters(), *encoder.buffers())})
    if module_devices:
        found["parameters"] = module_devices
    for name, t in zip(_INPUT_NAMES, inputs):
        if t is not None:
            found[name] = [str(t.device)]
    devices = {d for ds in found.values() for d in ds}
    if len(devices) != 1 or torch.device(next(iter(devices))).type != "cuda":
        where = ", ".join(f"{name} on {' and '.join(ds)}" for name, ds in found.items())
        raise ValueError(f"capture_encoder needs the encoder's parameters and the example inputs as "
                         f"CUDA tensors on one device; found {where}. Move the encoder and the inputs "
                         f"with .to('cuda') first (CUDA graphs exist only on CUDA devices)")
    return torch.device(next(iter(devices)))


def capture_encoder(encoder, tokens, segments, valid_lens=None, *, warmup_iters=3,
                    clone_output=True, pool=None):
    """Capture ``encoder(tokens, segments, valid_lens)`` in a CUDA graph for inference.

    Args:
      encoder: a FastBERTEncoder or reference BERTEncoder in eval mode, on one CUDA device.
      tokens, segments: (B, L) integer example inputs on that device. Their shapes and dtypes
        (and valid_lens') are the only ones the returned callable accepts; their values are
        used for warmup and capture, so they must be valid inputs.
      valid_lens: None, (B,) or (B, L), integer or float, as the encoder takes it. Whether it
        is None is part of the captured graph.
      warmup_iters: eager calls (>= 1) on a side stream before capture. The first call
        autotunes the Triton kernels and initialises cuBLAS, which syncs and allocates and
        must not be captured; the default 3 follows PyTorch's CUDA-graph examples.
      clone_output: True (default) returns a fresh copy of the output on each call. False
        returns the graph's static output tensor itself, which the next call overwrites:
        saves a copy when you consume the output before the next call. That tensor was made
        under inference mode: read it, don't modify it in place.
      pool: a memory pool to share with other graphs (``torch.cuda.graph_pool_handle()`` or
        ``other.graph.pool()``); None gives this graph a private pool.

    Returns a GraphedEncoder: ``graphed(tokens, segments, valid_lens)`` checks its arguments
    against the captured ones, runs the encoder's input check eagerly when
    ``encoder.check_inputs`` is True, copies the inputs into the graph's static buffers and
    replays. See the module docstring for what a graph can and cannot follow.

    Warmup and capture run under ``torch.inference_mode``: the captured region is inference
    by construction (no autograd graph, no saved tensors, nothing recorded for a backward
    that a replay could never run). The copies before a replay and the output clone run
    under no_grad in the caller's inference mode, so outside inference mode the cloned
    output is an ordinary tensor. Replays run on the caller's current stream.
    """
    if not isinstance(encoder, nn.Module):
        raise TypeError(f"encoder must be an nn.Module with forward(tokens, segments, valid_lens), "
                        f"got {type(encoder).__name__}")
    if isinstance(encoder, BERTModel):
        raise TypeError(f"capture_encoder takes the encoder, not a whole {type(encoder).__name__} "
                        f"(its forward has other arguments and returns a tuple): capture model.encoder "
                        f"and run the heads eagerly")
    if isinstance(warmup_iters, bool) or not isinstance(warmup_iters, int) or warmup_iters < 1:
        raise ValueError(f"warmup_iters must be an int >= 1 (the first call autotunes kernels and "
                         f"initialises libraries, which must not be captured), got {warmup_iters!r}")
    if encoder.training:
        raise ValueError("capture_encoder captures inference, but the encoder is in training mode: "
                         "call encoder.eval() first. Graphs for training (forward and backward) are "
                         "torch.cuda.make_graphed_callables' job")
    if getattr(encoder, "skip_padding", False) and valid_lens is not None:
        raise ValueError("the encoder has skip_padding=True and valid_lens was given: skip_padding reads "
                         "the per-sequence lengths on the host (a sync, and sizes that depend on the data), "
                         "which a CUDA graph cannot capture. Capture with skip_padding=False (set "
                         "encoder.skip_padding = False): the padded (B, L) shape is static and valid_lens "
                         "masks the padding as usual")
    inputs = (tokens, segments, valid_lens)
    for name, t in zip(_INPUT_NAMES, inputs):
        if not (isinstance(t, torch.Tensor) or (name == "valid_lens" and t is None)):
            allowed = "a torch.Tensor or None" if name == "valid_lens" else "a torch.Tensor"
            raise TypeError(f"{name} must be {allowed}, got {type(t).__name__}")
    device = _require_one_cuda_device(encoder, inputs)
    _validate_if_asked(encoder, inputs)

    with torch.cuda.device(device):
        # Ordinary tensors even when the caller is in inference mode: every call copies into
        # them, and an in-place copy into an inference tensor fails outside inference mode.
        with torch.inference_mode(False):
            static_inputs = tuple(None if t is None else t.detach().clone(memory_format=torch.contiguous_format)
                                  for t in inputs)
    # cuda_graphs off too: an encoder made with cuda_graphs=True must run its eager forward here,
    # not capture graphs of its own during the warmup.
    with _attributes_set(encoder, check_inputs=False, cuda_graphs=False), torch.inference_mode(), _capture_lock:
        graph, static_output = _warmup_and_capture(
            lambda: encoder(*static_inputs), device,
            pool if pool is not None else torch.cuda.graph_pool_handle(), warmup_iters)
    if not isinstance(static_output, torch.Tensor):
        raise TypeError(f"capture_encoder needs a module whose forward returns one tensor; "
                        f"{type(encoder).__name__} returned {type(static_output).__name__}")
    return GraphedEncoder(encoder, graph, static_inputs, static_output, device, clone_output)


class GraphedEncoder:
    """A captured encoder forward; made by :func:`capture_encoder`.

    Attributes: ``graph`` (the torch.cuda.CUDAGraph), ``encoder`` (kept so its parameters,
    which the graph reads, stay alive), ``static_inputs`` (tokens, segments, valid_lens
    buffers the graph reads; valid_lens None if captured without), ``static_output`` (the
    buffer it writes), ``device``, ``clone_output``.
    """

    def __init__(self, encoder, graph, static_inputs, static_output, device, clone_output):
        self.encoder = encoder
        self.graph = graph
        self.static_inputs = static_inputs
        self.static_output = static_output
        self.device = device
        self.clone_output = bool(clone_output)

    def __call__(self, tokens, segments, valid_lens=None):
        inputs = (tokens, segments, valid_lens)
        for name, given, static in zip(_INPUT_NAMES, inputs, self.static_inputs):
            _check_matches_captured(name, given, static)
        _validate_if_asked(self.encoder, inputs)
        # no_grad: a float valid_lens that requires grad must not attach the buffer to autograd.
        with torch.cuda.device(self.device), torch.no_grad():
            for given, static in zip(inputs, self.static_inputs):
                if static is not None:
                    static.copy_(given)
            self.graph.replay()
            return self.static_output.clone() if self.clone_output else self.static_output

    def __repr__(self):
        shapes = ", ".join(f"{name}={'None' if t is None else tuple(t.shape)}"
                           for name, t in zip(_INPUT_NAMES, self.static_inputs))
        return (f"GraphedEncoder({type(self.encoder).__name__}, {shapes}, device={self.device}, "
                f"clone_output={self.clone_output})")


def _check_matches_captured(name, given, static):
    """ValueError unless ``given`` has the shape, dtype and device the graph was captured with."""
    if static is None:
        if given is not None:
            desc = _describe(given) if isinstance(given, torch.Tensor) else type(given).__name__
            raise ValueError(f"{name}: the graph was captured with {name}=None, got {desc}; capture "
                             f"another graph with {name} to use it")
        return
    if given is None:
        raise ValueError(f"{name}: the graph was captured with {name} of {_describe(static)}, got None; "
                         f"pass {name} (e.g. the padded length L for every row), or capture another "
                         f"graph with {name}=None")
    if not isinstance(given, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(given).__name__}")
    fixes = []
    if given.shape != static.shape:
        fixes.append("pad to the captured shape (real lengths go in valid_lens)")
    if given.dtype != static.dtype:
        fixes.append(f"convert to {static.dtype}")
    if given.device != static.device:
        fixes.append(f"move to {static.device}")
    if fixes:
        raise ValueError(f"{name}: expected {_describe(static)} (the captured example), got "
                         f"{_describe(given)}. A CUDA graph replays fixed shapes, dtypes and devices: "
                         f"{', '.join(fixes)}, or capture another graph")



# ---------------------------------------------------------------------------------------------
# Automatic graphs: FastBERTEncoder(cuda_graphs=True), and HF models through bert_fast.hf
# ---------------------------------------------------------------------------------------------

class CudaGraphFallbackWarning(UserWarning):
    """A cuda_graphs=True encoder ran its eager forward instead of a CUDA graph, or keeps
    dropping graphs to stay within max_cuda_graphs (given once per encoder and reason)."""


def _next_power_of_two(n):
    return 1 << (n - 1).bit_length()


def _round_up(n, step):
    return -(-n // step) * step


def _four_per_octave(n, min_step):
    """``n`` (>= 1) rounded up to a multiple of max(min_step, next_power_of_two(n) / 8): steps of
    ``min_step`` up to 8 * min_step, then 4 buckets per power of two (less than 25% added)."""
    return _round_up(n, max(min_step, _next_power_of_two(n) // 8))


def bucket_batch(batch):
    """The graph batch for ``batch`` rows: 1, 2, 4, 8, then 10, 12, 14, 16, 20, 24, 28, 32, 40, ..."""
    return _next_power_of_two(batch) if batch <= 8 else _four_per_octave(batch, 1)


def bucket_seqlen(seqlen, max_len):
    """The graph length for ``seqlen``: multiples of 16 up to 128, then 160, 192, 224, 256, 320,
    ..., at most ``max_len`` (the position table), never below ``seqlen``."""
    return max(seqlen, min(_four_per_octave(seqlen, 16), max_len))


def bucket_tokens(num_tokens, limit):
    """The static token count (skip_padding) for ``num_tokens`` valid tokens: multiples of 16 up
    to 128 (16 for none), then 4 per octave, at most ``limit`` (B_b * L_b, every slot)."""
    return min(_four_per_octave(max(num_tokens, 1), 16), limit)


class _CudaGraphSteps:
    """What graphed_forward does with the device: which devices have graphs, memory pools,
    capture, stream order. One object so that tests replace it with a stub that "captures" on
    the CPU (tests/test_cuda_graph.py) and run all the rest of the machinery there."""

    def supports(self, device):
        return device.type == "cuda"

    def capturing(self, device):
        """Whether a capture is under way on the current stream (someone else's)."""
        return torch.cuda.is_current_stream_capturing()

    def new_pool(self, device):
        return torch.cuda.graph_pool_handle()

    def capture(self, run, device, pool):
        """(graph, output): graph.replay() reruns what run() did, writing the output in place."""
        return _warmup_and_capture(run, device, pool, WARMUP_ITERS, capture_error_mode="thread_local")

    def order_after(self, previous, device):
        """The caller's current stream, made to wait for ``previous`` (the stream of the last
        replay) when it is another one: graphs sharing a pool and buffers must not overlap."""
        stream = torch.cuda.current_stream(device)
        if previous is not None and previous != stream:
            stream.wait_stream(previous)
        return stream

    def read_later(self, stats, state):
        """A transfer of ``stats`` (a small int64 tensor) to the host that does not wait now: its
        ``read()`` waits for the transfer alone (on CUDA, not for the work queued after it)."""
        if stats.device.type != "cuda":
            return _ReadNow(stats)
        pinned = state.pinned_reads.get(stats.device)
        if pinned is None:          # per device: an event records on one device only
            with torch.inference_mode(False):       # an ordinary tensor: every call copies into it
                host = torch.empty(stats.shape, dtype=stats.dtype, pin_memory=True)
            pinned = state.pinned_reads[stats.device] = (host, torch.cuda.Event())
        return _PinnedRead(stats, *pinned)

    def wait(self, device):
        """Until the work queued on the caller's stream (a replay) has run."""
        if device.type == "cuda":
            torch.cuda.current_stream(device).synchronize()


class _ReadNow:
    def __init__(self, stats):
        self.stats = stats

    def read(self):
        return self.stats.tolist()


class _PinnedRead:
    """stats copied into a pinned host buffer on the current stream, an event after the copy."""

    def __init__(self, stats, host, event):
        host.copy_(stats, non_blocking=True)
        event.record(torch.cuda.current_stream(stats.device))
        self.host, self.event = host, event

    def read(self):
        self.event.synchronize()
        return self.host.tolist()


_steps = _CudaGraphSteps()


# How many parameters, buffers and submodules any module of this process has registered (an
# attribute assignment, register_*, add_module, ModuleList.append, load_state_dict(assign=True)
# all go through torch's global registration hooks). While it stands still, no module tree
# changed by those paths, so a snapshot's check skips comparing every child and tensor by
# identity; the changes that fire no hook it still reads: a container's length (pop, insert,
# del), a tensor's address (.to(), p.data = ...), training flags.
_registrations = 0
_registration_hooks = []


def _count_registration(module, name, value):
    global _registrations
    _registrations += 1          # returns None: the value registered is unchanged


def _watch_registrations():
    if not _registration_hooks:
        from torch.nn.modules import module as module_api
        _registration_hooks.extend(register(_count_registration) for register in (
            module_api.register_module_module_registration_hook,
            module_api.register_module_parameter_registration_hook,
            module_api.register_module_buffer_registration_hook))


class _ModuleSnapshot:
    """The encoder's module tree as a capture saw it: children, parameters and buffers by
    identity, tensors by address, and child counts (a block appended to ``blks``). The graphs
    read the tensors' memory, so they are valid while ``check()`` finds all of it unchanged."""

    def __init__(self, encoder):
        _watch_registrations()
        self.registrations = _registrations
        self.counts, self.children, self.tensors = [], [], []
        for module in encoder.modules():
            table = module._modules
            if table:
                self.counts.append((table, len(table)))
                self.children.extend((table, name, child) for name, child in table.items())
            for table in (module._parameters, module._buffers):
                for name, t in table.items():
                    if t is not None and type(t) not in (torch.Tensor, nn.Parameter):
                        raise TypeError(f"{type(t).__name__} {name!r}")
                    self.tensors.append((table, name, t))
        held = [(table, name, t) for table, name, t in self.tensors if t is not None]
        # Addresses read through the tables (C-level maps: ~one dict lookup a tensor more than
        # reading the held tensors): a write into a module's _parameters/_buffers dict
        # (torch.func.functional_call, accelerate's set_module_tensor_to_device) fires no
        # registration hook, and the tensor it replaced keeps its address.
        self.tables, self.names = [table for table, _, _ in held], [name for _, name, _ in held]
        self.addresses = [t.data_ptr() for _, _, t in held]
        # Their storages, kept alive while the snapshot is: a replay launched before check() may
        # read a tensor's old memory (``p.data = ...`` releases it, and empty_cache() could hand
        # it back to the driver before the replay runs).
        self.storages = [t.untyped_storage() for _, _, t in held]
        self.params = tuple(encoder.parameters())
        self.submodules = tuple(child for _, _, child in self.children)
        # Hooks on submodules, which a replay does not run: under grad mode one may feed the
        # forward a tensor that requires grad (prompt tuning), which only an eager call records.
        self.hooked = any(m._forward_hooks or m._forward_pre_hooks for m in self.submodules)

    def check(self):
        """None if unchanged, "training" if a submodule is in training mode, else "changed"."""
        for table, count in self.counts:
            if len(table) != count:
                return "changed"
        if _registrations != self.registrations:
            for table, name, child in self.children:
                if table.get(name) is not child:
                    return "changed"
            for table, name, t in self.tensors:
                if table.get(name) is not t:
                    return "changed"
            self.registrations = _registrations    # this tree is as captured: the short path again
        for child in self.submodules:
            if child.training:
                return "training"
        try:
            if list(map(_data_ptr, map(dict.__getitem__, self.tables, self.names))) != self.addresses:
                return "changed"
        except (KeyError, TypeError):      # a tensor deleted from its table, or set to None
            return "changed"
        return None


_data_ptr = torch.Tensor.data_ptr


class _Bucket(collections.namedtuple("_Bucket", "batch seqlen num_tokens lengths_shape lengths_dtype")):
    """The padded shapes a graph runs: B_b, L_b, N_b (skip_padding, else None), and the shape
    and dtype of its lengths buffer (an encoder's valid_lens, an HF model's attention mask)."""


def _tensors(output):
    """The tensors of a forward's output (one tensor, or a tuple that may hold None)."""
    items = output if isinstance(output, tuple) else (output,)
    return [t for t in items if t is not None]


class _InputSlot:
    """The static inputs of one padded shape: ``buffers`` (ids, segments, lengths; see _Calls),
    read by every graph of that shape (skip_padding's token buckets share them), and ``stats``,
    where the staging kernel writes what the host may read (ops.graph_inputs.STATS).
    ``filled``: the (B, L) the buffers hold (the rest is zeros; "all" after the kernel, which
    writes every element); ``defaults``: the indices of the inputs last given as None whose
    default the buffers hold for that B and L, so the next such call writes nothing there."""

    def __init__(self, buffers, stats):
        self.buffers, self.stats = buffers, stats
        self.filled, self.defaults = None, set()

    def _default(self, index, region, value):
        if index not in self.defaults:
            region.fill_(value)
            self.defaults.add(index)

    def fill(self, inputs, full_lengths, clamp):
        """Copy the inputs into the buffers' top-left corner with PyTorch ops: None segments are
        zeros, None lengths ``full_lengths`` (every token valid); ``clamp`` caps the lengths at L."""
        ids, segments, lengths = inputs
        batch, seqlen = ids.shape
        if self.filled != (batch, seqlen):
            if self.filled is not None:    # a smaller call must not leave ids or lengths behind
                for buffer in self.buffers:
                    buffer.zero_()
            self.filled, self.defaults = (batch, seqlen), set()
        id_buffer, segment_buffer, length_buffer = self.buffers
        id_buffer[:batch, :seqlen].copy_(ids)
        if segments is None:
            self._default(1, segment_buffer[:batch, :seqlen], 0)
        else:
            segment_buffer[:batch, :seqlen].copy_(segments)
            self.defaults.discard(1)
        region = length_buffer[:batch] if length_buffer.dim() == 1 else length_buffer[:batch, :seqlen]
        if lengths is None:
            self._default(2, region, full_lengths)
            return
        region.copy_(lengths)
        self.defaults.discard(2)
        if clamp:                          # padded keys invisible: float32(j) < L <= j
            region.clamp_(max=seqlen)

    def stage(self, inputs, full_lengths, clamp, values=False, tokens=False, keyless=False, id_limits=None):
        """fill(), by one kernel launch where graph_inputs.uses_kernel. Returns the STATS tensor
        (on the inputs' device), of which the parts asked for (graph_inputs.input_stats' flags)
        are valid (the kernel computes them all, always), or None if none is asked for.
        ``id_limits``: the buffers get the ids clamped into the tables (graph_inputs.guard_ids)."""
        ids, segments, lengths = inputs
        if graph_inputs.uses_kernel(ids):
            self.filled = "all"
            try:
                return graph_inputs.stage_inputs(inputs, self.buffers, self.stats, full_length=full_lengths,
                                                 clamp=clamp, id_limits=id_limits)
            except Exception as error:      # e.g. Triton cannot compile for this GPU: PyTorch ops instead
                graph_inputs.kernel_failed(ids.device, error)
        self.fill(inputs, full_lengths, clamp)
        stats = None
        if values or tokens or keyless:
            stats = graph_inputs.input_stats(self.buffers, *ids.shape, has_segments=segments is not None,
                                             has_lengths=lengths is not None, values=values, tokens=tokens,
                                             keyless=keyless)
        if id_limits is not None:
            graph_inputs.guard_ids(self.buffers, *ids.shape, id_limits)
        return stats


class _BucketGraph:
    """One captured bucket: the graph, the output it writes, and the _InputSlot it reads."""

    def __init__(self, slot):
        self.slot = slot
        self.graph = self.output = None


class _EncoderGraphs:
    """An encoder's graphs (LRU order), their input slots, failed keys, warnings given, parameter
    snapshot, pool, last replay stream and counters. Kept beside the encoder (a weak-keyed
    table), not on it, so that deepcopy, pickling and state_dict never meet a CUDAGraph; it
    references no module."""

    def __init__(self):
        self.graphs = collections.OrderedDict()
        self.slots = {}
        self.failed = set()
        self.warned = set()
        self.snapshot = None
        self.check_first = True       # check the module tree before the replay (else after it)
        self.pool = None
        self.stream = None
        self.pinned_reads = {}        # device -> _steps.read_later's pinned buffer and event
        self.stats = collections.Counter()
        # One call at a time: calls share the static buffers and the pool (a second thread waits).
        self.lock = threading.RLock()

    def slot(self, bucket, ids_dtype, segments_dtype, device):
        """The _InputSlot of a bucket's padded shape, made on first use (zeros)."""
        key = (bucket.batch, bucket.seqlen, bucket.lengths_shape, bucket.lengths_dtype, ids_dtype, segments_dtype,
               device)
        slot = self.slots.get(key)
        if slot is None:
            shape = (bucket.batch, bucket.seqlen)
            # Ordinary tensors even in inference mode: every call copies into them (see capture_encoder).
            with torch.inference_mode(False):
                slot = self.slots[key] = _InputSlot(
                    (torch.zeros(shape, dtype=ids_dtype, device=device),
                     torch.zeros(shape, dtype=segments_dtype, device=device),
                     torch.zeros(bucket.lengths_shape, dtype=bucket.lengths_dtype, device=device)),
                    torch.zeros(len(graph_inputs.STATS), dtype=torch.int64, device=device))
        return slot

    def retire(self, tensors):
        """Let the allocator reuse dropped buffers only once the last replay's stream is done
        with them: they belong to the stream of the capture, and replays may have run on
        another one since (a no-op when it is the same stream)."""
        if self.stream is not None:
            with torch.inference_mode():     # the output is an inference tensor; record_stream's schema mutates
                for t in tensors:
                    t.record_stream(self.stream)

    def prune_slots(self):
        """Drop the slots that no graph reads (an evicted bucket's, a failed capture's)."""
        used = {id(entry.slot) for entry in self.graphs.values()}
        for key in [key for key, slot in self.slots.items() if id(slot) not in used]:
            slot = self.slots.pop(key)
            self.retire((*slot.buffers, slot.stats))

    def evict_least_recent(self):
        _, entry = self.graphs.popitem(last=False)
        self.retire(_tensors(entry.output))
        self.stats["evictions"] += 1

    def drop_graphs(self):
        for entry in self.graphs.values():
            self.retire(_tensors(entry.output))
        self.graphs.clear()
        self.prune_slots()
        self.pool = self.stream = None


_states = weakref.WeakKeyDictionary()
_states_lock = threading.Lock()


def _state_of(encoder):
    state = _states.get(encoder)
    if state is None:
        with _states_lock:
            state = _states.setdefault(encoder, _EncoderGraphs())
    return state


_FALLBACK_MESSAGES = {
    "device": "its inputs are on {device}; CUDA graphs need CUDA tensors",
    "training": "it (or a submodule) is in training mode; CUDA graphs serve inference only (call .eval())",
    "autograd": ("autograd is recording (grad mode is on and parameters require grad) and a replay "
                 "cannot give gradients; call it under torch.inference_mode() or torch.no_grad(), or "
                 "freeze the parameters, to replay graphs"),
    "hooks": ("grad mode is on and a submodule has forward hooks, which a replay does not run (one may feed "
              "in a tensor that requires grad); call it under torch.inference_mode() or torch.no_grad() to "
              "replay graphs"),
    "parameters": "its parameters or buffers include a tensor subclass ({detail}), whose memory a graph cannot follow",
    "capture": ("capturing the CUDA graph of bucket {detail} failed ({error}); that bucket runs eagerly "
                "from now on (bert_fast.cuda_graph.clear_cuda_graphs(encoder) to try again)"),
}


def _caller_stacklevel():
    """warnings.warn's stacklevel, for the function calling this one, that points at the first
    frame outside bert_fast and torch (the user's call of the encoder or the model)."""
    frame, level = sys._getframe(1), 1
    while frame is not None and frame.f_globals.get("__name__", "").partition(".")[0] in ("bert_fast", "torch"):
        frame, level = frame.f_back, level + 1
    return level


def _fall_back(encoder, state, reason, **details):
    """Count an eager call for ``reason``; warn the first time for this encoder."""
    state.stats[f"eager_{reason}"] += 1
    _warn_once(encoder, state, reason, "runs its eager forward: " + _FALLBACK_MESSAGES[reason].format(**details))


def _warn_once(encoder, state, reason, message):
    if reason not in state.warned:
        state.warned.add(reason)
        warnings.warn(f"{type(encoder).__name__}(cuda_graphs=True) {message}", CudaGraphFallbackWarning,
                      stacklevel=_caller_stacklevel())


def _eager(calls, state, reason, inputs, **details):
    _fall_back(calls.module, state, reason, **details)
    return calls.eager(inputs)


def _eager_checked(calls, inputs):
    """The eager forward of inputs validated already (no second input check)."""
    with calls.checks_off():
        return calls.eager(inputs)


def _is_ids(t):
    return isinstance(t, torch.Tensor) and t.dim() == 2 and not t.is_floating_point() and not t.is_complex() \
        and t.dtype != torch.bool


def _matmul_precision():
    """The fp32 matmul precision: the legacy getter's, or where it raises (torch 2.11 and 2.13,
    once the new API set a backend's precision: "mix of the legacy and new APIs") the new API's
    switches (``torch.backends.fp32_precision``, ``torch.backends.cuda.matmul.fp32_precision``)."""
    try:
        return torch.get_float32_matmul_precision()
    except RuntimeError:
        return torch.backends.fp32_precision, torch.backends.cuda.matmul.fp32_precision


def _global_settings():
    """The global switches the kernels read while launching (matmul precision and reductions,
    SDPA backends): part of every key."""
    cuda = torch.backends.cuda
    return (_matmul_precision(), cuda.matmul.allow_fp16_reduced_precision_reduction,
            cuda.matmul.allow_bf16_reduced_precision_reduction,
            getattr(cuda.matmul, "allow_fp16_accumulation", None), cuda.flash_sdp_enabled(),
            cuda.mem_efficient_sdp_enabled(), cuda.math_sdp_enabled(), cuda.cudnn_sdp_enabled())


def _autocast_settings(device):
    """Autocast for the inputs' device, which the forward follows (a graph replays the casts it
    captured), and whether it is on for any device (the fused ops' autocast branches read
    that): part of every key."""
    return (torch.is_autocast_enabled(device.type), torch.get_autocast_dtype(device.type),
            torch._C._is_any_autocast_enabled())


def _lengths_dtype(valid_lens):
    """The valid_lens buffer's dtype: None -> int64 (full lengths); fp16/bf16 -> float32, which
    holds them exactly and is what the attention compares them in (clamping to L in fp16/bf16
    could round L); the rest as given."""
    if valid_lens is None:
        return torch.int64
    if valid_lens.dtype in (torch.float16, torch.bfloat16):
        return torch.float32
    return valid_lens.dtype


def _needs_clamp(dtype, seqlen, padded_seqlen):
    """Lengths above L would make padded keys (and, skip_padding, tokens) visible; an integer
    dtype whose maximum is <= L holds none."""
    if padded_seqlen == seqlen:
        return False
    return dtype.is_floating_point or torch.iinfo(dtype).max > seqlen


class _Calls:
    """What graphed() needs to know of a module: its inputs are (ids, segments, lengths) with
    ids (B, L) and the others None or tensors; the methods below say which calls it can graph,
    how they are bucketed and padded, what the eager forward is, and what the output is.
    _EncoderCalls (FastBERTEncoder) and bert_fast.hf's (an HF BertModel) implement it."""

    lengths_name = "lengths"

    def __init__(self, module):
        self.module = module

    def eager(self, inputs, **static):
        """The eager forward; ``static`` (num_tokens=N_b) is what a capture passes."""
        raise NotImplementedError

    def checks_off(self):
        """A context without the module's own input check (its host sync cannot be captured)."""
        return contextlib.nullcontext()

    def understood(self, inputs):
        """Whether the inputs have the forms graphed() pads (else the eager forward runs)."""
        raise NotImplementedError

    def graphable(self, inputs):
        """False for calls the eager forward must answer (e.g. it raises what is wrong)."""
        return True

    def validate(self, inputs):
        """The module's checks that read no values (shapes, dtypes), before a replay."""

    def plan(self, inputs):
        """The call's _Bucket (at most one host read; stage() may still change it)."""
        raise NotImplementedError

    def reads(self, bucket, inputs):
        """Which staged stats (graph_inputs.STATS) the call must read on the host, as
        (values, tokens, keyless): the input check's id ranges and NaN count; the valid-token
        count, which picks skip_padding's token bucket; whether some row sees no key, which in
        exact mode keeps a padded L exact (such a row attends to all L keys)."""
        return False, False, False

    def check_values(self, stats, inputs):
        """Raise for bad input values, given the staged stats (read when reads() asked for values)."""

    def id_limits(self):
        """The rows of the token and segment tables (where reads() asks for values)."""
        raise NotImplementedError

    def stage(self, slot_for, bucket, inputs, state):
        """Write the inputs into the static buffers of ``slot_for(bucket)`` (an _InputSlot), one
        launch on CUDA, and read what reads() asks for in one host read: raises for bad values,
        sets skip_padding's token bucket, or restages at the exact L. Returns (bucket, slot,
        pending). When only the values are asked for, the read waits: the buffers get in-range
        ids (clamped), so the graph may replay first, and ``pending`` is the stats'
        transfer (``_steps.read_later``) that check_pending() reads and checks after the launch;
        else None."""
        values, tokens, keyless = self.reads(bucket, inputs)
        slot = slot_for(bucket)
        if values and not (tokens or keyless):
            stats = slot.stage(inputs, *self.fill_args(bucket, inputs), values=True, id_limits=self.id_limits())
            return bucket, slot, _steps.read_later(stats, state)
        stats = slot.stage(inputs, *self.fill_args(bucket, inputs), values=values, tokens=tokens, keyless=keyless)
        if not (values or tokens or keyless):
            return bucket, slot, None
        stats = dict(zip(graph_inputs.STATS, stats.tolist()))        # the one host read
        if values:
            self.check_values(stats, inputs)
        if tokens:
            bucket = bucket._replace(num_tokens=bucket_tokens(stats["valid_tokens"], bucket.batch * bucket.seqlen))
        elif keyless and stats["keyless"]:
            seqlen = inputs[0].shape[1]
            lengths_shape = bucket.lengths_shape if len(bucket.lengths_shape) == 1 else (bucket.batch, seqlen)
            bucket = bucket._replace(seqlen=seqlen, lengths_shape=lengths_shape)
            slot = slot_for(bucket)
            slot.stage(inputs, *self.fill_args(bucket, inputs))
        return bucket, slot, None

    def check_pending(self, pending, inputs):
        """Read the stats that stage() left pending (None: nothing) and raise for bad values."""
        if pending is not None:
            self.check_values(dict(zip(graph_inputs.STATS, pending.read())), inputs)

    def settings(self, device):
        """What the captured work depends on beyond the shapes, global switches and ids' dtypes."""
        raise NotImplementedError

    def fill_args(self, bucket, inputs):
        """(what None lengths become, whether to clamp given lengths at L): _BucketGraph.fill's."""
        raise NotImplementedError

    def result(self, output, batch, seqlen):
        """The call's output from the graph's (padded, overwritten by the next replay)."""
        raise NotImplementedError


def _sliced(t, batch, seqlen=None):
    """A fresh copy of the call's rows (and positions) of a static output."""
    t = t[:batch] if seqlen is None else t[:batch, :seqlen]
    return t.clone(memory_format=torch.contiguous_format)


class _EncoderCalls(_Calls):
    """FastBERTEncoder: inputs (tokens, segments, valid_lens), the forward ``_forward``."""

    lengths_name = "valid_lens"

    def eager(self, inputs, **static):
        return self.module._forward(*inputs, **static)

    def checks_off(self):
        return _module_checks_off(self.module)

    def understood(self, inputs):
        tokens, segments, valid_lens = inputs
        if not (_is_ids(tokens) and _is_ids(segments) and segments.shape == tokens.shape
                and segments.device == tokens.device and tokens.numel() > 0):
            return False
        if valid_lens is None:
            return True
        return (isinstance(valid_lens, torch.Tensor) and valid_lens.device == tokens.device
                and valid_lens.dtype != torch.bool and not valid_lens.is_complex()
                and valid_lens.shape in (tokens.shape[:1], tokens.shape))

    def graphable(self, inputs):
        tokens, _, valid_lens = inputs
        encoder = self.module
        return not ((encoder.skip_padding and valid_lens is not None and valid_lens.dim() != 1)
                    or tokens.shape[1] > encoder.pos_embedding.shape[1]
                    or encoder.pos_embedding.device != tokens.device)

    def validate(self, inputs):
        tokens, segments, valid_lens = inputs
        positions = self.module.pos_embedding
        check_encoder_shapes(tokens, segments, valid_lens, max_len=positions.shape[1], device=positions.device,
                             skip_padding=self.module.skip_padding)

    def plan(self, inputs):
        tokens, _, valid_lens = inputs
        encoder = self.module
        batch, seqlen = tokens.shape
        padded_batch = bucket_batch(batch)
        padded_seqlen = bucket_seqlen(seqlen, encoder.pos_embedding.shape[1])
        num_tokens = None           # skip_padding with valid_lens: counted by stage()
        if encoder.skip_padding and valid_lens is None:
            num_tokens = bucket_tokens(batch * seqlen, padded_batch * padded_seqlen)
        dtype = _lengths_dtype(valid_lens)
        shape = (padded_batch,) if valid_lens is None or valid_lens.dim() == 1 else (padded_batch, padded_seqlen)
        return _Bucket(padded_batch, padded_seqlen, num_tokens, shape, dtype)

    def reads(self, bucket, inputs):
        tokens, _, valid_lens = inputs
        encoder = self.module
        return (bool(encoder.check_inputs), encoder.skip_padding and valid_lens is not None,
                not encoder.skip_padding and valid_lens is not None and bucket.seqlen > tokens.shape[1])

    def check_values(self, stats, inputs):
        raise_for_values(stats["token_min"], stats["token_max"], stats["segment_min"], stats["segment_max"],
                         stats["nan_lengths"] > 0, self.module.token_embedding.num_embeddings)

    def id_limits(self):
        return self.module.token_embedding.num_embeddings, self.module.segment_embedding.num_embeddings

    def settings(self, device):
        encoder = self.module
        return (encoder.pos_embedding.dtype, graph_backend_for(encoder.backend, device), bool(encoder.skip_padding))

    def fill_args(self, bucket, inputs):
        tokens, _, valid_lens = inputs
        seqlen = tokens.shape[1]
        return seqlen, valid_lens is not None and _needs_clamp(bucket.lengths_dtype, seqlen, bucket.seqlen)

    def result(self, output, batch, seqlen):
        return _sliced(output, batch, seqlen)


def _describe_bucket(bucket, lengths_name):
    tokens = "" if bucket.num_tokens is None else f", num_tokens {bucket.num_tokens}"
    return (f"(batch {bucket.batch}, seq_len {bucket.seqlen}{tokens}, {lengths_name} "
            f"{tuple(bucket.lengths_shape)} {bucket.lengths_dtype})")


def _max_graphs(encoder):
    limit = getattr(encoder, "max_cuda_graphs", DEFAULT_MAX_GRAPHS)
    if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
        raise ValueError(f"max_cuda_graphs must be an int >= 1 (graphs kept per encoder), got {limit!r}; "
                         f"set cuda_graphs = False to run without graphs")
    return limit


def _make_room(calls, state):
    """Evict the least recently used graphs down to max_cuda_graphs - 1, before a capture."""
    limit = _max_graphs(calls.module)
    while len(state.graphs) >= limit:
        state.evict_least_recent()
        if state.stats["evictions"] >= limit:
            _warn_once(calls.module, state, "evictions", (
                f"has dropped {state.stats['evictions']} graphs to keep max_cuda_graphs={limit}: its calls' "
                f"shapes span more buckets than it keeps, so calls keep capturing (each capture costs about "
                f"four eager forwards). Raise the module's max_cuda_graphs (graphs share one memory pool; "
                f"each keeps its output and input buffers), pad inputs to fewer shapes, or turn cuda_graphs off"))


def _capture(calls, state, key, slot, num_tokens):
    """Capture ``key``'s graph on ``slot``'s buffers and keep it; returns the entry. Raises what
    warmup or capture raised; nothing is kept then."""
    entry = _BucketGraph(slot)
    static = slot.buffers
    extra = {} if num_tokens is None else {"num_tokens": num_tokens}

    def run():
        with calls.checks_off():      # its host sync cannot be captured
            return calls.eager(static, **extra)

    device = static[0].device
    if state.pool is None:
        state.pool = _steps.new_pool(device)
    state.stats["captures"] += 1
    try:
        with _capture_lock, torch.inference_mode():
            entry.graph, entry.output = _steps.capture(run, device, state.pool)
    except BaseException:
        # Later captures into a failed capture's pool can fail too (see end_failed_capture):
        # later buckets take a new pool; the graphs already held keep theirs.
        state.pool = None
        raise
    state.graphs[key] = entry
    return entry


def _modes_see_replays():
    """Every active dispatch mode only watches the real ops (``bert_fast_sees_replays = True``:
    the host benchmark's op counter), so the call may replay: what it counts is the replay's."""
    return all(getattr(mode, "bert_fast_sees_replays", False)
               for mode in torch.utils._python_dispatch._get_current_dispatch_mode_stack())


def graphed(calls, inputs):
    """The forward of ``calls.module`` with cuda_graphs on: replay the CUDA graph of the call's
    shape bucket, capturing it on the bucket's first call; the eager forward where graphs do
    not apply. ``calls``: a _Calls for the module. See the module docstring.

    What can wait is done after the replay is launched, while the GPU runs it: the module-tree
    check (unless ``state.check_first``: no snapshot yet, or the last check found a problem) and
    the read of the id ranges. A replay they find wrong is not returned: a changed tree (its
    replaced tensors are kept alive by the snapshot until the replay has run) makes the call
    again, checking first; bad ids (staged clamped) raise."""
    if (torch.compiler.is_compiling() or torch.jit.is_tracing()
            or (torch._C._len_torch_dispatch_stack() and not _modes_see_replays())
            or not calls.understood(inputs)):
        # (Under a dispatch mode (FakeTensorMode, a FLOP counter) the mode must see the ops; a
        # replay would also cache its fake tensors as the static buffers.)
        return calls.eager(inputs)
    if not calls.graphable(inputs):
        return calls.eager(inputs)      # it raises what is wrong (e.g. inputs on another device)
    state = _state_of(calls.module)
    with state.lock:
        return _graphed(calls, state, inputs)


def _graphed(calls, state, inputs):
    module = calls.module
    ids, segments, _ = inputs
    device = ids.device
    if not _steps.supports(device):
        state.snapshot = None           # nor keep its tensors alive (a model moved to the CPU frees them)
        return _eager(calls, state, "device", inputs, device=device)
    if _steps.capturing(device):
        return calls.eager(inputs)        # the outer capture records the eager forward
    if module.training:
        return _eager(calls, state, "training", inputs)
    snapshot = state.snapshot
    checked = snapshot is None or state.check_first
    if checked:
        problem = snapshot.check() if snapshot is not None else "changed"
        if problem == "changed":
            if state.graphs:
                state.stats["invalidations"] += 1
            state.drop_graphs()
            try:
                snapshot = state.snapshot = _ModuleSnapshot(module)
            except TypeError as error:
                state.snapshot = None
                return _eager(calls, state, "parameters", inputs, detail=error)
            problem = snapshot.check()
        # A submodule left in training mode (e.g. dropout on for MC dropout) keeps the check
        # first, so its calls do not launch a replay only to discard it.
        state.check_first = problem is not None
        if problem == "training":
            return _eager(calls, state, "training", inputs)
    if torch.is_grad_enabled():
        if any(p.requires_grad for p in snapshot.params):
            return _eager(calls, state, "autograd", inputs)
        if snapshot.hooked or _GLOBAL_HOOKS[0] or _GLOBAL_HOOKS[1]:     # (forward pre- and forward hooks)
            return _eager(calls, state, "hooks", inputs)

    calls.validate(inputs)
    segments_dtype = (ids if segments is None else segments).dtype
    settings = calls.settings(device) + _global_settings() + _autocast_settings(device)
    with torch.no_grad():      # a float valid_lens that requires grad must not reach the buffers' autograd
        # The buffers are written on the caller's stream, after the last replay's reads of them.
        state.stream = _steps.order_after(state.stream, device)
        bucket, slot, pending = calls.stage(lambda b: state.slot(b, ids.dtype, segments_dtype, device),
                                            calls.plan(inputs), inputs, state)
        key = (bucket, ids.dtype, segments_dtype, device, settings)
        entry = state.graphs.get(key)
        if entry is None:
            # Capture (or run eagerly) on a checked tree and checked values.
            if not checked and snapshot.check() is not None:
                state.check_first = True
                return _graphed(calls, state, inputs)
            calls.check_pending(pending, inputs)
            if key in state.failed:
                state.stats["eager_capture"] += 1
                state.prune_slots()
                return _eager_checked(calls, inputs)
            _make_room(calls, state)
            try:
                entry = _capture(calls, state, key, slot, bucket.num_tokens)
                error = None
            except Exception as caught:
                error = caught
            state.prune_slots()
            if error is not None:
                # Eager first: if it fails too, the inputs were the problem and the bucket stays
                # graphable (its exception propagates); else the capture was, and the bucket is
                # not captured again.
                out = _eager_checked(calls, inputs)
                state.failed.add(key)
                line = (f"{type(error).__name__}: {error}".strip().splitlines() or [type(error).__name__])[0]
                _fall_back(module, state, "capture", detail=_describe_bucket(bucket, calls.lengths_name),
                           error=line[:300])
                return out
        else:
            state.graphs.move_to_end(key)
        entry.graph.replay()
        if not checked and snapshot.check() is not None:
            _steps.wait(device)          # the replay read the tensors the check found replaced
            state.check_first = True
            return _graphed(calls, state, inputs)
        calls.check_pending(pending, inputs)
        state.stats["replays"] += 1
        return calls.result(entry.output, *ids.shape)


def graphed_forward(encoder, tokens, segments, valid_lens=None):
    """FastBERTEncoder's forward with ``cuda_graphs=True``: graphed() for the encoder (the eager
    ``encoder._forward`` where graphs do not apply). See the module docstring."""
    return graphed(_EncoderCalls(encoder), (tokens, segments, valid_lens))


def clear_cuda_graphs(module):
    """Drop the CUDA graphs of ``module`` and of every encoder inside it (a FastBERTModel, any
    model that holds encoders), with their failed captures, given warnings and counters; the next
    calls capture again. Returns the number of graphs dropped. Their memory goes back to
    PyTorch's caching allocator (``torch.cuda.empty_cache()`` hands it to the driver)."""
    if not isinstance(module, nn.Module):
        raise TypeError(f"clear_cuda_graphs expects an nn.Module, got {type(module).__name__}")
    dropped = 0
    for submodule in module.modules():
        state = _states.pop(submodule, None)
        if state is not None:
            with state.lock:        # not while another thread's call uses them
                dropped += len(state.graphs)
                state.drop_graphs()
    return dropped


def cuda_graph_stats(encoder):
    """What ``encoder``'s automatic graphs did: ``buckets`` (one dict per graph held, least
    recently used first: batch, seq_len, num_tokens, valid_lens shape and dtype, tokens dtype,
    device), ``failed`` (buckets whose capture failed), and counters: captures, replays,
    evictions, invalidations, and eager_<reason> for each fallback reason."""
    state = _states.get(encoder)
    if state is None:
        return {"buckets": [], "failed": []}

    def describe(key):
        bucket, tokens_dtype, _, device, _ = key
        return dict(batch=bucket.batch, seq_len=bucket.seqlen, num_tokens=bucket.num_tokens,
                    valid_lens_shape=tuple(bucket.lengths_shape), valid_lens_dtype=bucket.lengths_dtype,
                    tokens_dtype=tokens_dtype, device=device)

    return {"buckets": [describe(key) for key in state.graphs], "failed": [describe(key) for key in state.failed],
            **state.stats}
