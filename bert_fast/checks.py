"""Input validation for the fast modules: bad input gets a ValueError/TypeError that says
what was wrong and what is allowed, never a wrong answer or a device-side crash.

Shape, dtype and device checks are free. Range checks (token ids, segment ids, NaN lengths)
read values, which costs one host synchronisation; they are skipped while torch.compile
traces, and the whole check can be turned off with ``check_inputs=False`` on the module.
"""

import torch

from .ops._triton import as_dtype


def _is_integer(t):
    return not t.is_floating_point() and not t.is_complex() and t.dtype != torch.bool


def check_encoder_inputs(tokens, segments, valid_lens, *, vocab_size, max_len, device,
                         skip_padding=False):
    for name, t in (("tokens", tokens), ("segments", segments)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if not _is_integer(t):
            raise TypeError(f"{name} must have an integer dtype (e.g. torch.long), got {t.dtype}")
    if tokens.dim() != 2:
        raise ValueError(f"tokens must have shape (batch, seq_len), got {tuple(tokens.shape)}")
    if segments.shape != tokens.shape:
        raise ValueError(f"segments must have the shape of tokens {tuple(tokens.shape)}, "
                         f"got {tuple(segments.shape)}")
    batch, seqlen = tokens.shape
    if seqlen > max_len:
        raise ValueError(f"sequence length {seqlen} exceeds max_len {max_len} "
                         f"(the size of the position table)")
    if batch == 0 or seqlen == 0:
        raise ValueError(f"tokens must be non-empty, got shape {tuple(tokens.shape)}")
    tensors = {"tokens": tokens, "segments": segments}
    if valid_lens is not None:
        if not isinstance(valid_lens, torch.Tensor):
            raise TypeError(f"valid_lens must be a torch.Tensor or None, got {type(valid_lens).__name__}")
        if valid_lens.dtype == torch.bool or valid_lens.is_complex():
            raise TypeError(f"valid_lens must have a real (integer or floating) dtype, got {valid_lens.dtype}")
        if valid_lens.shape not in ((batch,), (batch, seqlen)):
            raise ValueError(f"valid_lens must have shape (batch,) = ({batch},) or (batch, seq_len) = "
                             f"({batch}, {seqlen}), got {tuple(valid_lens.shape)}")
        if skip_padding and valid_lens.dim() != 1:
            raise ValueError("skip_padding=True needs 1-D valid_lens of shape (batch,): with per-query "
                             "(2-D) lengths the padded positions are not defined; use skip_padding=False")
        tensors["valid_lens"] = valid_lens
    for name, t in tensors.items():
        if t.device != device:
            raise ValueError(f"{name} is on {t.device} but the model's parameters are on {device}; "
                             f"move them to the same device")
    if torch.compiler.is_compiling():
        return
    # One host sync for all range checks together, from one reduction over both id tensors.
    # int64: a narrower common dtype could wrap an out-of-range id into range.
    ids = torch.stack((as_dtype(tokens.reshape(-1), torch.int64), as_dtype(segments.reshape(-1), torch.int64)))
    stats = list(torch.aminmax(ids, dim=1))              # (tokens, segments) minima, maxima
    if valid_lens is not None and valid_lens.is_floating_point():
        stats.append(valid_lens.isnan().any().reshape(1).to(ids.dtype))
    (token_min, segment_min, token_max, segment_max, *has_nan) = torch.cat(stats).tolist()
    if token_min < 0 or token_max >= vocab_size:
        raise ValueError(f"token ids must be in [0, {vocab_size}), got values in [{token_min}, {token_max}]")
    if segment_min < 0 or segment_max > 1:
        raise ValueError(f"segment ids must be 0 or 1, got values in [{segment_min}, {segment_max}]")
    if has_nan and has_nan[0]:
        raise ValueError("valid_lens contains NaN")
