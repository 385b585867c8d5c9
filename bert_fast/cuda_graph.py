"""CUDA-graph capture of an encoder's inference forward, for small-batch latency.

At small batch (the B = 1, L = 128 latency goal) an eager forward can spend more time
launching its kernels from Python than running them. A CUDA graph records the launches once
and replays them all with one call. ``capture_encoder`` takes the steps a capture needs
(warmup, static input buffers, the input check kept out of the graph) and returns a callable::

    from bert_fast.cuda_graph import capture_encoder

    encoder = FastBERTEncoder(...).cuda().eval()
    tokens, segments = ...                      # (B, L) int64 on the GPU, padded to L
    valid_lens = ...                            # (B,) real lengths, or None, or (B, L)
    graphed = capture_encoder(encoder, tokens, segments, valid_lens)
    out = graphed(tokens2, segments2, valid_lens2)     # same shapes, dtypes and device

Constraints (they all come from the graph replaying fixed work on fixed memory):

* Static shapes. A graph replays one shape: every call must pass tensors of the captured
  shapes, dtypes and device, and valid_lens must be None exactly when it was None at
  capture. Pad each batch to the captured B and L (extra rows: any valid ids, then drop
  their output rows) and pass the real lengths in ``valid_lens``; the exact path masks
  padded keys as usual. For several sizes capture one graph per shape (e.g. per L bucket).
* ``skip_padding`` cannot be captured with ``valid_lens``: it counts each sequence's valid
  tokens on the host, and the sizes of everything after that depend on the data. Capture
  with ``skip_padding=False``.
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

import contextlib

import torch
from torch import nn

from .reference import BERTModel

__all__ = ["capture_encoder", "GraphedEncoder", "graphed_forward"]

_INPUT_NAMES = ("tokens", "segments", "valid_lens")

# One capture stream per device, reused by every capture, so that graphs sharing a memory
# pool were captured on the same stream (torch.cuda.graph asks for that), and a capture on
# cuda:1 never runs on a stream of cuda:0. Created on first use, never at import.
_capture_streams = {}


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
def _module_checks_off(encoder):
    """Turn the module's own input check off (its host sync cannot be captured), restoring
    the attribute afterwards, also when warmup or capture fails. A module without the
    attribute is left without it."""
    if not hasattr(encoder, "check_inputs"):
        yield
        return
    saved = encoder.check_inputs
    encoder.check_inputs = False
    try:
        yield
    finally:
        encoder.check_inputs = saved


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
        stream = _capture_stream(device)
        graph = torch.cuda.CUDAGraph()
        with _module_checks_off(encoder), torch.inference_mode():
            stream.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(stream):
                for _ in range(warmup_iters):
                    encoder(*static_inputs)
            torch.cuda.current_stream(device).wait_stream(stream)
            with torch.cuda.graph(graph, pool=pool, stream=stream):
                static_output = encoder(*static_inputs)
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


def graphed_forward(encoder, tokens, segments, valid_lens=None):
    """FastBERTEncoder's forward with ``cuda_graphs=True``: not written yet, runs eagerly."""
    return encoder._forward(tokens, segments, valid_lens)
