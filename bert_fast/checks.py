"""Input validation for the fast modules: bad input gets a ValueError/TypeError that says
what was wrong and what is allowed, never a crash or a silent wrong answer.

The rule:

* Checks that need no host synchronisation ALWAYS run, eager or under torch.compile, whatever
  ``check_inputs`` says: argument types, ranks, shapes, dtypes and devices of the inputs
  (``check_encoder_shapes``), and the modules' constructor arguments (``check_size``,
  ``check_dropout``). They are plain attribute comparisons on the host (no tensor op, no
  sync); under torch.compile they are evaluated while tracing and become guards.
* Checks of values (token ids in [0, vocab_size), segment ids in {0, 1}, no NaN in float
  ``valid_lens``) read the data, which costs one host synchronisation per forward. They are
  what ``check_inputs=False`` turns off (``check_encoder_values``). With ``check_inputs=True``
  they run in eager mode and under torch.compile (also ``fullgraph=True``) and torch.jit.trace:
  there they run inside the compiled or traced graph as one opaque op
  (``bert_fast::check_encoder_values``) ordered before the embedding lookup, so an
  out-of-range id is a Python ValueError (a RuntimeError carrying its message from a
  TorchScript graph).

With ``check_inputs=False`` shapes, dtypes and devices are still checked; an out-of-range id is
never wrapped or read outside its table (ops.embedding_sum: an IndexError on the CPU, guarded
loads in the GPU kernels and in the torch backend's compiled lookups, PyTorch's device-side
assert on the torch backend on CUDA in eager).

Allowed id dtypes: torch.int64 (long) and torch.int32, the index dtypes
torch.nn.functional.embedding accepts. ``valid_lens``: None, or an integer or floating tensor
of shape (batch,) or (batch, seq_len) (1-D only with skip_padding).
"""

import inspect
import numbers
from typing import Optional

import torch

from .ops._autograd import use_registered_op
from .ops._triton import as_dtype, cpu_kernel

ID_DTYPES = (torch.int64, torch.int32)
_ID_DTYPE_NAMES = "torch.int64 (torch.long) or torch.int32 (the index dtypes F.embedding accepts)"


# ----------------------------------------------------------------------- constructor arguments

def check_size(name, value):
    """``value`` must be a positive int (bool is not one); returns it."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be a positive int, got {value!r} ({type(value).__name__})")
    if value <= 0:
        raise ValueError(f"{name} must be a positive int, got {value}")
    return int(value)


def check_flag(name, value):
    """``value`` must be True or False (numpy's and one-element tensors' too, 0 and 1): "yes" or
    None is a mistake, not a truth value. Returns it as a bool."""
    try:
        ok = not isinstance(value, str) and value in (True, False)
    except (RuntimeError, ValueError):      # a tensor of several elements
        ok = False
    if not ok:
        raise TypeError(f"{name} must be True or False, got {value!r} ({type(value).__name__})")
    return bool(value)


def check_dropout(value, name="dropout"):
    """``value`` must be a real number in [0, 1); returns it as a float. 1 is refused on every
    backend: the fused kernels scale kept values by 1/(1-p)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a float in [0, 1), got {value!r} ({type(value).__name__})")
    if not 0 <= value < 1:
        raise ValueError(f"{name} must be in [0, 1), got {value}"
                         + (" (p=1 would drop everything; the fused kernels scale by 1/(1-p))"
                            if value == 1 else ""))
    return float(value)


# ----------------------------------------------------------------------- always-on input checks

def check_encoder_shapes(tokens, segments, valid_lens, *, max_len, device, skip_padding=False):
    """Types, ranks, shapes, dtypes and devices of the encoder's inputs: no tensor op, no sync.
    Runs on every forward, whatever ``check_inputs`` says."""
    if type(tokens) is not torch.Tensor and not isinstance(tokens, torch.Tensor):
        raise TypeError(f"tokens must be a torch.Tensor, got {type(tokens).__name__}")
    if type(segments) is not torch.Tensor and not isinstance(segments, torch.Tensor):
        raise TypeError(f"segments must be a torch.Tensor, got {type(segments).__name__}")
    if tokens.dtype not in ID_DTYPES:
        raise TypeError(f"tokens must have dtype {_ID_DTYPE_NAMES}, got {tokens.dtype}")
    if segments.dtype not in ID_DTYPES:
        raise TypeError(f"segments must have dtype {_ID_DTYPE_NAMES}, got {segments.dtype}")
    shape = tokens.shape
    if len(shape) != 2:
        raise ValueError(f"tokens must have shape (batch, seq_len), got {tuple(shape)}")
    if segments.shape != shape:
        raise ValueError(f"segments must have the shape of tokens {tuple(shape)}, "
                         f"got {tuple(segments.shape)}")
    batch, seqlen = shape
    if seqlen > max_len:
        raise ValueError(f"sequence length {seqlen} exceeds max_len {max_len} "
                         f"(the size of the position table)")
    if batch == 0 or seqlen == 0:
        raise ValueError(f"tokens must be non-empty, got shape {tuple(shape)}")
    if tokens.device != device:
        raise ValueError(f"tokens is on {tokens.device} but the model's parameters are on {device}; "
                         f"move them to the same device")
    if segments.device != device:
        raise ValueError(f"segments is on {segments.device} but the model's parameters are on {device}; "
                         f"move them to the same device")
    if valid_lens is not None:
        check_valid_lens(valid_lens, batch, seqlen, skip_padding=skip_padding)
        if valid_lens.device != device:
            raise ValueError(f"valid_lens is on {valid_lens.device} but the model's parameters are on "
                             f"{device}; move them to the same device")


def check_valid_lens(valid_lens, batch, seqlen, *, skip_padding=False):
    """valid_lens' type, dtype and shape for (batch, seqlen) inputs (no sync)."""
    if not isinstance(valid_lens, torch.Tensor):
        raise TypeError(f"valid_lens must be a torch.Tensor or None, got {type(valid_lens).__name__}")
    dtype = valid_lens.dtype
    if dtype is torch.bool or dtype.is_complex:
        raise TypeError(f"valid_lens must have a real (integer or floating) dtype, got {dtype}")
    vshape = valid_lens.shape
    if vshape != (batch,) and vshape != (batch, seqlen):
        raise ValueError(f"valid_lens must have shape (batch,) = ({batch},) or (batch, seq_len) = "
                         f"({batch}, {seqlen}), got {tuple(vshape)}")
    if skip_padding and len(vshape) != 1:
        raise ValueError("skip_padding=True needs 1-D valid_lens of shape (batch,): with per-query "
                         "(2-D) lengths the padded positions are not defined; use skip_padding=False")


# ----------------------------------------------------------------------- value checks (check_inputs)

def _check_values(tokens, segments, valid_lens, vocab_size):
    if cpu_kernel(tokens) and segments.is_cpu and (valid_lens is None or valid_lens.is_cpu):
        # Values on the host: reads cost no sync, so a reduction per tensor and .item(), a third
        # of the host time of the single read below (the stack and the cat are what it costs).
        # (Not where CPU tensors stand for CUDA ones, kernels_on_cpu: they take the GPU's read.)
        token_min, token_max = torch.aminmax(tokens)
        segment_min, segment_max = torch.aminmax(segments)
        has_nan = valid_lens is not None and valid_lens.is_floating_point() and bool(valid_lens.isnan().any())
        raise_for_values(token_min.item(), token_max.item(), segment_min.item(), segment_max.item(), has_nan,
                         vocab_size)
        return
    # One host sync for all range checks together, from one reduction over both id tensors.
    # int64: a narrower common dtype could wrap an out-of-range id into range.
    ids = torch.stack((as_dtype(tokens.reshape(-1), torch.int64), as_dtype(segments.reshape(-1), torch.int64)))
    stats = list(torch.aminmax(ids, dim=1))              # (tokens, segments) minima, maxima
    if valid_lens is not None and valid_lens.is_floating_point():
        stats.append(valid_lens.isnan().any().reshape(1).to(ids.dtype))
    (token_min, segment_min, token_max, segment_max, *has_nan) = torch.cat(stats).tolist()
    raise_for_values(token_min, token_max, segment_min, segment_max, bool(has_nan and has_nan[0]), vocab_size)


def raise_for_values(token_min, token_max, segment_min, segment_max, has_nan, vocab_size):
    """The value checks' errors, from the ids' ranges and whether valid_lens holds a NaN (read by
    _check_values, or by cuda_graphs=True's staging kernel)."""
    if token_min < 0 or token_max >= vocab_size:
        raise ValueError(f"token ids must be in [0, {vocab_size}), got values in [{token_min}, {token_max}]")
    if segment_min < 0 or segment_max > 1:
        raise ValueError(f"segment ids must be 0 or 1, got values in [{segment_min}, {segment_max}]")
    if has_nan:
        raise ValueError("valid_lens contains NaN")


# The op reads values on the host (a sync): it cannot be captured in a CUDA graph. Tagged so,
# where this PyTorch has the tag, Inductor's cudagraphs (mode="reduce-overhead") keep it out of
# the captured part instead of failing at capture (not yet run on a GPU).
_CUDAGRAPH_UNSAFE = getattr(torch.Tag, "cudagraph_unsafe", None)
_OP_OPTIONS = ({"tags": (_CUDAGRAPH_UNSAFE,)}
               if _CUDAGRAPH_UNSAFE is not None and "tags" in inspect.signature(torch.library.custom_op).parameters
               else {})


@torch.library.custom_op("bert_fast::check_encoder_values", mutates_args=(), **_OP_OPTIONS)
def _check_values_op(tokens: torch.Tensor, segments: torch.Tensor, valid_lens: Optional[torch.Tensor],
                     vocab_size: int, max_len: int = -1) -> torch.Tensor:
    """The value checks as one op torch.compile keeps opaque (it runs them, in Python, when the
    compiled graph runs); returns a zero of tokens' dtype that the caller adds to the tokens,
    so that the check is ordered before (and is not dropped from) the embedding lookup. Also
    the sequence length against max_len, a shape check the trace turned into a guard, which a
    jit.trace and AOTInductor's programs (by default) do not check when they run. (max_len -1:
    not checked, what programs saved before the op took it load as.)"""
    if 0 <= max_len < tokens.shape[-1]:
        raise ValueError(f"sequence length {tokens.shape[-1]} exceeds max_len {max_len} "
                         f"(the size of the position table)")
    _check_values(tokens, segments, valid_lens, vocab_size)
    return tokens.new_zeros(())


@_check_values_op.register_fake
def _(tokens, segments, valid_lens, vocab_size, max_len=-1):
    return tokens.new_empty(())


def check_encoder_values(tokens, segments, valid_lens, *, vocab_size, max_len):
    """Token ids in [0, vocab_size), segment ids in {0, 1}, no NaN in float valid_lens: one
    host sync. Returns ``tokens``; under torch.compile, tokens made to depend on the check
    (``tokens + 0`` from the check's op): use the returned tensor."""
    if valid_lens is not None and valid_lens.requires_grad:
        valid_lens = valid_lens.detach()
    if use_registered_op():      # torch.compile or jit.trace: the check stays in the graph
        return tokens + _check_values_op(tokens, segments, valid_lens, vocab_size, max_len)
    if _capturing_cuda_graph(tokens):
        # The read would end the capture with CUDA's "operation not permitted when stream is
        # capturing"; a check at capture time would not run at the replays anyway.
        raise RuntimeError(
            "check_inputs=True reads the input values on the host (one sync per call), which a CUDA "
            "graph capture (torch.cuda.graph, torch.cuda.make_graphed_callables) cannot contain. "
            "Capture with the check off (module.check_inputs = False) and check each call's inputs "
            "before it replays with module.validate_inputs(tokens, segments, valid_lens)")
    if any(t is not None and torch._C._functorch.is_batchedtensor(t) for t in (tokens, segments, valid_lens)):
        # (PyTorch's own error, from the read, speaks of .item() and not of check_inputs.)
        raise ValueError("check_inputs=True reads the input values on the host, which torch.func.vmap "
                         "does not allow: set check_inputs=False under vmap (and backend='torch': the "
                         "Triton and extension ops have no vmap rule)")
    _check_values(tokens, segments, valid_lens, vocab_size)
    return tokens


def check_pred_positions(pred_positions, batch, device):
    """The MLM head's (batch, num_predictions) positions into the encoder's output: type, rank,
    batch, dtype and device (no sync; always checked)."""
    if not isinstance(pred_positions, torch.Tensor):
        raise TypeError(f"pred_positions must be a tensor, got {type(pred_positions).__name__}")
    if pred_positions.dim() != 2 or pred_positions.shape[0] != batch:    # (expand_as would broadcast)
        raise ValueError(f"pred_positions must have shape (batch, num_predictions) with batch {batch}, "
                         f"got {tuple(pred_positions.shape)}")
    if pred_positions.dtype not in ID_DTYPES:
        # A bool tensor would index as a mask, a float one not at all.
        raise TypeError(f"pred_positions must be {_ID_DTYPE_NAMES}, got {pred_positions.dtype}")
    if pred_positions.device != device:
        raise ValueError(f"pred_positions must be on the encoder output's device ({device}), "
                         f"got {pred_positions.device}")


def check_pred_position_values(pred_positions, seqlen):
    """Positions in [-seq_len, seq_len) (negative ones count from the end, as the reference's
    indexing does): one host sync, in eager mode only (where an out-of-range position would be
    a device-side assert on CUDA). Nothing under torch.compile, a CUDA graph capture or vmap:
    there the head indexes as the reference does."""
    if (pred_positions.numel() == 0 or use_registered_op() or _capturing_cuda_graph(pred_positions)
            or torch._C._functorch.is_batchedtensor(pred_positions)):
        return
    low, high = torch.aminmax(pred_positions)
    low, high = (low.item(), high.item()) if pred_positions.is_cpu else torch.stack((low, high)).tolist()
    if low < -seqlen or high >= seqlen:
        raise ValueError(f"pred_positions must be in [-{seqlen}, {seqlen}) for sequences of length {seqlen} "
                         f"(negative ones count from the end), got values in [{low}, {high}]")


def _capturing_cuda_graph(t):
    return t.is_cuda and torch.cuda.is_current_stream_capturing()


def check_encoder_inputs(tokens, segments, valid_lens, *, vocab_size, max_len, device,
                         skip_padding=False):
    """Every check: check_encoder_shapes, then check_encoder_values (one host sync).
    Returns tokens as check_encoder_values does."""
    check_encoder_shapes(tokens, segments, valid_lens, max_len=max_len, device=device,
                         skip_padding=skip_padding)
    return check_encoder_values(tokens, segments, valid_lens, vocab_size=vocab_size, max_len=max_len)
