"""embedding_layernorm: ``LayerNorm(token + segment + position embeddings)`` in one pass.

What Hugging Face's BertEmbeddings computes before its dropout (the book's encoder has no
LayerNorm there, so ``embedding_sum`` stops at the sum). Same layouts as embedding_sum, except
that the position table is ``(max_len, H)`` (an ``nn.Embedding``'s weight) and the output is
normalised over H with ``weight``/``bias`` (H,) or None and the caller's ``eps``:

  padded   tokens/segments (B, L); position j of every row reads ``pos_weight[j]``.
  packed   tokens/segments/positions (N,); any position ids (HF's ``position_ids``, flattened).

``padding_idx`` (the token table's, as nn.Embedding(padding_idx=...)): that row gets no gradient.

Paths:
  torch    three F.embedding lookups summed in HF's order, then F.layer_norm (autograd native).
           Also what runs on CPU tensors for every backend, and under torch.compile (Inductor
           fuses the gathers into the normalisation itself).
  triton   (and cuda, which has no kernel of its own for this op) on CUDA tensors: one Triton
           kernel gathers the three rows of a tile, sums them in fp32, normalises and writes
           the output and the fp32 mean/rstd. The backward recomputes the sum with
           embedding_sum's forward kernel (one gather, instead of keeping a (B, L, H) activation
           alive), runs PyTorch's native LayerNorm backward on it, and scatters the result into
           the tables with embedding_sum's backward kernel.

Cost model (R rows, e bytes per element): forward reads R token rows (R H e), segment and
position rows (served from L2), writes R H e + 8 R: ~2 R H e, the same as embedding_sum alone,
so the LayerNorm's own read and write of R H e (~2 R H e more as separate ops) are saved.
Backward: recompute (2 R H e), LN backward (~4 R H e), scatter (embedding_sum's cost).
"""

import torch
from torch.nn import functional as F

from ._autograd import once_differentiable, records_grad, thin_apply, use_registered_op
from ._triton import (KERNEL_DTYPES, cdiv, cpu_kernel, launch, nothing_to_launch, require_triton, tl,
                      triton, uses_triton)
from .embedding import (_check_fwd_inputs, _check_id_ranges, _embedding_rows, _embedding_sum_bwd,
                        _embedding_sum_fwd, _flat_ids, _fwd_blocks, _guarded_lookup, _positions)


def _embedding_layernorm_torch(tokens, segments, token_weight, segment_weight, pos_weight, positions,
                               weight, bias, eps, padding_idx):
    # Compiled, ids cannot be read: guarded lookups as in embedding_sum (an out-of-range id adds a
    # zero row; Inductor on torch 2.11 would read outside the table). Eager: F.embedding's error.
    compiling = torch.compiler.is_compiling()
    lookup = _guarded_lookup if compiling else F.embedding
    # HF's order of additions (token + segment, then + position), so fp32 results match it closely.
    out = lookup(tokens, token_weight, padding_idx) + lookup(segments, segment_weight)
    if compiling:
        pos = lookup(_positions(tokens, positions, pos_weight), pos_weight)
    else:
        pos = pos_weight[: tokens.shape[-1]] if positions is None else lookup(positions, pos_weight)
    out = out + pos
    return F.layer_norm(out, out.shape[-1:], weight, bias, eps)


@triton.jit
def _embedding_layernorm_fwd_kernel(out_ptr, mean_ptr, rstd_ptr, token_ids_ptr, segment_ids_ptr,
                                     position_ids_ptr, token_weight_ptr, segment_weight_ptr, pos_weight_ptr,
                                     weight_ptr, bias_ptr, n_rows, seq_len, hidden, n_tokens, n_segments,
                                     max_len, eps, token_row_stride, token_col_stride, segment_row_stride,
                                     segment_col_stride, pos_row_stride, pos_col_stride,
                                     HAS_POSITIONS: tl.constexpr, HAS_WEIGHT: tl.constexpr,
                                     HAS_BIAS: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr):
    eps = tl.cast(eps, tl.float32)      # fp32 whatever the caller typed it (torch.compile: fp64)
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.arange(0, BLOCK_H)
    row_in = rows < n_rows
    col_in = cols < hidden
    mask = row_in[:, None] & col_in[None, :]
    # The tile holds whole rows (BLOCK_H >= H), so the statistics need no second pass.
    x = _embedding_rows(rows, cols, token_ids_ptr, segment_ids_ptr, position_ids_ptr,
                        token_weight_ptr, segment_weight_ptr, pos_weight_ptr,
                        n_rows, seq_len, hidden, n_tokens, n_segments, max_len,
                        token_row_stride, token_col_stride, segment_row_stride,
                        segment_col_stride, pos_row_stride, pos_col_stride, HAS_POSITIONS)
    mean = tl.sum(x, axis=1) / hidden
    centred = tl.where(mask, x - mean[:, None], 0.0)
    rstd = 1.0 / tl.sqrt(tl.sum(centred * centred, axis=1) / hidden + eps)
    y = centred * rstd[:, None]
    if HAS_WEIGHT:
        y = y * tl.load(weight_ptr + cols, mask=col_in, other=0.0).to(tl.float32)[None, :]
    if HAS_BIAS:
        y = y + tl.load(bias_ptr + cols, mask=col_in, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + rows.to(tl.int64)[:, None] * hidden + cols[None, :], y.to(out_ptr.dtype.element_ty),
             mask=mask)
    tl.store(mean_ptr + rows, mean, mask=row_in)
    tl.store(rstd_ptr + rows, rstd, mask=row_in)


def _check_norm_params(weight, bias, hidden, table):
    for name, p in (("weight", weight), ("bias", bias)):
        if p is None:
            continue
        if p.shape != (hidden,):
            raise ValueError(f"LayerNorm {name} must have shape ({hidden},), got {tuple(p.shape)}")
        if p.dtype != table.dtype or p.device != table.device:
            raise ValueError(f"LayerNorm {name} must be {table.dtype} on {table.device} like the tables, "
                             f"got {p.dtype} on {p.device}")


def _embedding_layernorm_fwd_triton(tokens, segments, token_weight, segment_weight, pos_weight, positions,
                                    weight, bias, eps):
    """(out tokens.shape + (H,), mean (R,) fp32, rstd (R,) fp32); ``pos_weight`` (1, max_len, H)."""
    _check_fwd_inputs(tokens, segments, token_weight, segment_weight, pos_weight, positions)
    if token_weight.dtype not in KERNEL_DTYPES:
        raise TypeError(f"the Triton embedding_layernorm takes float16, bfloat16 or float32 tables, "
                        f"got {token_weight.dtype}")
    hidden = token_weight.shape[1]
    _check_norm_params(weight, bias, hidden, token_weight)
    require_triton(tokens, segments, token_weight, segment_weight, pos_weight, positions, weight, bias)
    # The interpreter runs on CPU tensors, whose ids can be checked on the host for free.
    _check_id_ranges(tokens, segments, positions, token_weight.shape[0], segment_weight.shape[0],
                     pos_weight.shape[1])
    n_rows = tokens.numel()
    out = torch.empty((*tokens.shape, hidden), dtype=token_weight.dtype, device=token_weight.device)
    mean = torch.empty(n_rows, dtype=torch.float32, device=token_weight.device)
    rstd = torch.empty_like(mean)
    if not nothing_to_launch(n_rows):
        block_t, block_h, num_warps = _fwd_blocks(hidden)
        launch(_embedding_layernorm_fwd_kernel, out)[(cdiv(n_rows, block_t),)](
            out, mean, rstd, _flat_ids(tokens), _flat_ids(segments),
            _flat_ids(positions) if positions is not None else None,
            token_weight, segment_weight, pos_weight, weight, bias, n_rows, tokens.shape[-1], hidden,
            token_weight.shape[0], segment_weight.shape[0], pos_weight.shape[1], float(eps),
            token_weight.stride(0), token_weight.stride(1), segment_weight.stride(0),
            segment_weight.stride(1), pos_weight.stride(1), pos_weight.stride(2),
            HAS_POSITIONS=positions is not None, HAS_WEIGHT=weight is not None, HAS_BIAS=bias is not None,
            BLOCK_T=block_t, BLOCK_H=block_h, num_warps=num_warps)
    return out, mean, rstd


class _EmbeddingLayerNorm(torch.autograd.Function):
    """The kernel path under autograd; ``pos_weight`` is (1, max_len, H)."""

    @staticmethod
    def forward(ctx, tokens, segments, token_weight, segment_weight, pos_weight, positions, weight, bias, eps,
                padding_idx):
        out, mean, rstd = _embedding_layernorm_fwd_triton(tokens, segments, token_weight, segment_weight,
                                                          pos_weight, positions, weight, bias, eps)
        # Tables and ids, not the (R, H) sum: the backward regathers it.
        ctx.save_for_backward(tokens, segments, positions, token_weight, segment_weight, pos_weight, weight,
                              bias, mean, rstd)
        ctx.padding_idx = padding_idx
        return out

    @staticmethod
    @once_differentiable("embedding_layernorm", "embedding_layernorm's backward")
    def backward(ctx, grad_out):
        tokens, segments, positions, token_weight, segment_weight, pos_weight, weight, bias, mean, rstd = \
            ctx.saved_tensors
        summed = _embedding_sum_fwd(tokens, segments, token_weight, segment_weight, pos_weight, positions)
        hidden = summed.shape[-1]
        stats_shape = (*summed.shape[:-1], 1)
        needs = ctx.needs_input_grad
        grad_sum, grad_weight, grad_bias = torch.ops.aten.native_layer_norm_backward(
            grad_out.contiguous(), summed, [hidden], mean.view(stats_shape), rstd.view(stats_shape), weight, bias,
            [True, weight is not None and needs[6], bias is not None and needs[7]])
        token_grad, segment_grad, pos_grad = _embedding_sum_bwd(
            grad_sum, tokens, segments, positions, token_weight.shape[0], segment_weight.shape[0],
            pos_weight.shape[1], True, torch.are_deterministic_algorithms_enabled())
        if ctx.padding_idx is not None:
            token_grad[ctx.padding_idx] = 0      # nn.Embedding(padding_idx=...): that row never learns
        return (None, None, token_grad if needs[2] else None, segment_grad if needs[3] else None,
                pos_grad if needs[4] else None, None, grad_weight, grad_bias, None, None)


def _padding_row(padding_idx, n_rows):
    """nn.Embedding's padding_idx as a row number in [0, n_rows) (it accepts negative ones)."""
    if padding_idx is None:
        return None
    row = padding_idx + n_rows if padding_idx < 0 else padding_idx
    if not 0 <= row < n_rows:
        raise ValueError(f"padding_idx {padding_idx} is outside the token table's {n_rows} rows")
    return row


def embedding_layernorm(tokens, segments, token_weight, segment_weight, pos_weight, weight, bias, eps, *,
                        positions=None, padding_idx=None, backend="torch"):
    """``LayerNorm(token_weight[tokens] + segment_weight[segments] + pos_weight[position])``.

    ``pos_weight``: (max_len, H). Padded (B, L) ids read position j at column j unless
    ``positions`` (B, L) says otherwise; packed (N,) ids need ``positions`` (N,). Every table
    is learnable (no reference quirk here). ``padding_idx``: the token table row that gets no
    gradient. backend="torch" (and every backend on CPU tensors, and under torch.compile):
    PyTorch ops; "triton"/"cuda" on CUDA: the fused kernel (see the module docstring).
    """
    if pos_weight.dim() != 2:
        raise ValueError(f"pos_weight must be (max_len, H), got shape {tuple(pos_weight.shape)}")
    padding_idx = _padding_row(padding_idx, token_weight.shape[0])
    if tokens.dim() == 2 and positions is not None:
        # Arbitrary (B, L) position ids: the packed form reads them row by row.
        if positions.dim() != 2 or positions.shape[1] != tokens.shape[1] or positions.shape[0] not in (1, tokens.shape[0]):
            raise ValueError(f"positions must be (B, L) or (1, L) for tokens of shape {tuple(tokens.shape)}, "
                             f"got {tuple(positions.shape)}")
        positions = positions.expand(tokens.shape)
    if (not uses_triton(backend) or cpu_kernel(token_weight) or use_registered_op()):
        return _embedding_layernorm_torch(tokens, segments, token_weight, segment_weight, pos_weight, positions,
                                          weight, bias, eps, padding_idx)
    shape = tokens.shape
    if tokens.dim() == 2 and positions is not None:
        tokens, segments, positions = tokens.reshape(-1), segments.reshape(-1), positions.reshape(-1)
    args = (tokens, segments, token_weight, segment_weight, pos_weight[None], positions, weight, bias, eps)
    if records_grad(token_weight, segment_weight, pos_weight, weight, bias):
        out = thin_apply(_EmbeddingLayerNorm, *args, padding_idx)
    else:
        out = _embedding_layernorm_fwd_triton(*args)[0]
    return out.view(*shape, out.shape[-1])
