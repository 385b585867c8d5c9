"""unpad / pad: move between the padded (B, L, ...) layout and packed valid tokens (N, ...).

Used by skip_padding: a token is valid where ``float32(j) < valid_lens[b]`` (the attention
rule), so exactly the queries whose outputs the exact mode defines from valid keys only.
"""

from typing import NamedTuple

import torch
from torch.nn import functional as F


class Unpadding(NamedTuple):
    indices: torch.Tensor      # (N,) int64 flat indices into B*L of the valid tokens
    cu_seqlens: torch.Tensor   # (B+1,) int32 prefix sum of per-sequence valid counts
    seqlens: list              # per-sequence valid counts on the host (the sync we pay anyway)
    batch: int
    seqlen: int


def unpadding_for(valid_lens, seqlen):
    """Indices of the valid tokens for 1-D ``valid_lens``; one host sync (the counts, which
    give the size N of everything unpadded)."""
    positions = torch.arange(seqlen, dtype=torch.float32, device=valid_lens.device)
    valid = positions < valid_lens[:, None]                                   # (B, L)
    counts = valid.sum(dim=1, dtype=torch.int32)
    seqlens = counts.tolist()
    cu_seqlens = F.pad(torch.cumsum(counts, 0, dtype=torch.int32), (1, 0))
    indices = torch.nonzero_static(valid.flatten(), size=sum(seqlens)).squeeze(1)
    return Unpadding(indices, cu_seqlens, seqlens, valid_lens.shape[0], seqlen)


def unpad(x, unpadding):
    """(B, L, ...) -> (N, ...)."""
    return x.flatten(0, 1).index_select(0, unpadding.indices)


def pad(x, unpadding):
    """(N, ...) -> (B, L, ...), zeros at padded positions."""
    # Zeros, not empty: padded rows are keys/values of attention, masked but still multiplied.
    out = x.new_zeros((unpadding.batch, unpadding.seqlen) + tuple(x.shape[1:]))
    # In place through a flat view: fine under autograd (the zeros are no leaf), saves a full
    # copy, and leaves `out` itself no view (FSDP2 warns about modules that return views).
    out.flatten(0, 1).index_copy_(0, unpadding.indices, x)
    return out
