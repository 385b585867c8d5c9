"""unpad / pad: move between the padded (B, L, ...) layout and packed valid tokens (N, ...).

Used by skip_padding: a token is valid where ``float32(j) < valid_lens[b]`` (the attention
rule), so exactly the queries whose outputs the exact mode defines from valid keys only.

Two forms. Counted (the default): one host read of the per-sequence counts gives N exactly.
Static (``num_tokens`` given, e.g. a CUDA-graph bucket >= the valid count): no host read, so it
can be captured; the packed tensors have ``num_tokens`` rows, the rows past the valid count are
filler that reads slot B*L (a zero row, token 0) and that ``pad`` drops, and they belong to no
sequence of ``cu_seqlens``, so attention never mixes them with real tokens.

Under torch.compile the counted form has no host counts either: N is one data-dependent scalar
(an unbacked SymInt, ``counts.sum().item()``, bounded by B*L through torch._check hints), not B
per-sequence Python ints, and the unpadding is static with exactly N rows (no filler). Nothing
downstream branches on its value, so ``torch.compile(fullgraph=True)`` traces it in one graph,
and a new N is no new graph (no recompile). Without fullgraph, Dynamo (unless
``torch._dynamo.config.capture_scalar_outputs``) breaks the graph at that ``.item()``; the graph
after it takes N as an input size, made dynamic on the second N, so no graph per further N.
"""

from typing import NamedTuple

import torch
from torch.nn import functional as F


class Unpadding(NamedTuple):
    indices: torch.Tensor      # (N,) int64 flat indices into B*L of the valid tokens (filler: B*L)
    cu_seqlens: torch.Tensor   # (B+1,) int32 prefix sum of per-sequence valid counts
    seqlens: list | None       # per-sequence valid counts on the host (the sync we pay); None if static
    batch: int
    seqlen: int

    @property
    def static(self):
        return self.seqlens is None


def unpadding_for(valid_lens, seqlen, num_tokens=None):
    """Indices of the valid tokens for 1-D ``valid_lens``: one host sync (the counts, which give
    the size N of everything unpadded), or none with ``num_tokens`` (at least the valid count;
    the static form of the module docstring)."""
    if torch._C._get_tracing_state():
        # jit.trace would record the counts read here as constants: a traced graph that gives
        # wrong results for any other valid_lens of the same shapes.
        raise RuntimeError("skip_padding=True cannot be traced by torch.jit.trace: the number of valid tokens "
                           "and each sequence's length would be recorded as constants of the traced inputs. "
                           "Trace with skip_padding=False, or use torch.export or torch.compile")
    positions = torch.arange(seqlen, dtype=torch.float32, device=valid_lens.device)
    valid = positions < valid_lens[:, None]                                   # (B, L)
    counts = valid.sum(dim=1, dtype=torch.int32)
    cu_seqlens = F.pad(torch.cumsum(counts, 0, dtype=torch.int32), (1, 0))
    batch = valid_lens.shape[0]
    if num_tokens is None and torch.compiler.is_compiling():
        # No per-sequence Python ints to branch on (see the module docstring): the static form
        # with the exact count, a size-like unbacked SymInt.
        num_tokens = counts.sum().item()
        torch._check(num_tokens >= 0)
        torch._check(num_tokens <= batch * seqlen)
    if num_tokens is None:
        seqlens = counts.tolist()
        num_tokens, filler = sum(seqlens), 0
    else:
        # Slot B*L (unpad's zero row) for the filler rows. Under torch.compile the count is
        # exact, so no filler is used, and B*L, a symbolic size there, passed as nonzero_static's
        # int fill_value would specialise the graph on B*L (a recompile per product, an export
        # guarded on the traced one).
        seqlens, filler = None, 0 if torch.compiler.is_compiling() else batch * seqlen
    indices = torch.nonzero_static(valid.flatten(), size=num_tokens, fill_value=filler).squeeze(1)
    return Unpadding(indices, cu_seqlens, seqlens, batch, seqlen)


def unpad(x, unpadding):
    """(B, L, ...) -> (N, ...)."""
    rows = x.flatten(0, 1)
    if unpadding.static:          # slot B*L for the filler rows
        rows = torch.cat((rows, rows.new_zeros((1,) + rows.shape[1:])))
    return rows.index_select(0, unpadding.indices)


def pad(x, unpadding):
    """(N, ...) -> (B, L, ...), zeros at padded positions (static form: filler rows dropped)."""
    slots = unpadding.batch * unpadding.seqlen
    # Zeros, not empty: padded rows are keys/values of attention, masked but still multiplied.
    if unpadding.static:
        out = x.new_zeros((slots + 1,) + tuple(x.shape[1:]))
        out.index_copy_(0, unpadding.indices, x)
        return out[:slots].unflatten(0, (unpadding.batch, unpadding.seqlen))
    out = x.new_zeros((unpadding.batch, unpadding.seqlen) + tuple(x.shape[1:]))
    # In place through a flat view: fine under autograd (the zeros are no leaf), saves a full
    # copy, and leaves `out` itself no view (FSDP2 warns about modules that return views).
    out.flatten(0, 1).index_copy_(0, unpadding.indices, x)
    return out
