"""attention: multi-head scaled dot-product attention with the reference's valid_lens rule.

Torch path: PyTorch SDPA with a boolean key mask. The reference *replaces* masked scores with
-1e6, which a boolean mask reproduces exactly (exp(-1e6 - max) is 0 in every float type)
wherever a visible score is above about -1e6 + 100, i.e. for any logits a trained model makes
(a row whose visible scores are all below -1e6 gets the book's weight on its masked keys,
none here: 0.40 off with Q/K weights scaled x3000, measured 2026-11-27; the Triton kernels
replace as the book does), and except for one case: a query row that sees no key at all (valid_len <= 0). There the
reference softmaxes L equal scores and returns the uniform average of all L values; with
a boolean mask that row would be NaN. We get the reference's answer, and its gradients, by
unmasking every key for such rows and zeroing their query: all scores become exactly 0,
the softmax is exactly uniform, and no gradient flows to Q or K from that row — as in the
reference, where the -1e6 constants cut those paths too.

Triton path (``backend="triton"``): flash-style kernels that never materialise the (L, L)
weights. They read Q, K, V straight from the packed projection ``qkv`` (B, L, 3H) through its
strides (head h of Q is features ``h*d:(h+1)*d``, of K the same in the second third, of V in
the last), write the context in merged-head layout (B, L, H), and keep one statistic per
query row, the log-sum-exp of its scaled scores (LSE, (B, heads, L)), for the backward. Masked
scores are replaced by -1e6 inside the kernel exactly as in the reference, so a row that sees
no key comes out uniform over its L keys by the online softmax itself; only key slots past the
sequence's end (block padding) are excluded with -inf. The varlen form runs on the packed
valid tokens of skip_padding, ``qkv`` (N, 3H) with int32 ``cu_seqlens`` (B+1,): sequence b is
rows ``cu_seqlens[b]:cu_seqlens[b+1]``, every key of a sequence is visible to its queries, and
the grid is sized by a static ``max_seqlen`` (no host sync): programs past a sequence's end exit.

The LSE is stored in fp64, the one departure from "statistics in fp32": a row that sees no key
has LSE = -1e6 + log L, where fp32 resolves only steps of 1/16, so a backward that recomputes
its weights as exp(score - LSE) would get 1/L wrong by up to ~4%. Kernels read the fp64 LSE once
per row and split it into two fp32 parts; all per-element math stays fp32.

Dropout on the weights: keep (b, h, i, j) iff word j % 4 of philox(seed, counter=(i * ceil(L / 4)
+ j // 4, b * heads + h)) mapped to [0, 1) is >= p (_philox.py's attention mask: one Philox call
for four keys; the CPU twin draws the same bits), kept weights scaled by 1/(1-p); ``seed`` is a
one-element int64 tensor on the device. The counter is unique per four weights for L <= 65536,
and the backward kernels regenerate the same bits.

Cost model, per (batch, head) with sequence length L and head dim d (e = bytes per element):
  forward   2 GEMMs (Q K^T, P V): 4 L^2 d FLOPs. HBM: Q, K, V read once per query block (K, V
            re-reads mostly hit L2) and the context written once: ~(3 + 1) L d e bytes, + 8 L (LSE).
  backward  dQ kernel (first): delta = rowsum(dO * O) of its rows (stored for the next kernel),
            then 3 GEMMs (recompute Q K^T, dP = dO V^T, dQ += dS K); dK/dV kernel: 4 GEMMs
            (recompute K Q^T, dV += P^T dO, dP^T = V dO^T, dK += dS^T Q): 14 L^2 d FLOPs, 1.4x
            the 10 L^2 d of a fused single-kernel backward, paid to stay deterministic without
            atomics. HBM: ~(3 + 2 + 3) L d e bytes (qkv, O and dO, dqkv) + stats.
            For L <= 128 the dK/dV kernel can make dQ too (ONE_KERNEL_BACKWARD_MAX_SEQLEN,
            off by default until timed on a GPU): one program holds every key, so dQ of a query
            block (dS^T's columns times K) is complete there, still without atomics: 10 L^2 d
            FLOPs, one launch, the dropout mask drawn once; but B * heads programs, not
            L / BLOCK_N times as many.
Arithmetic intensity ~L / e FLOP per byte: near the ridge of an A100 / H100 (~150-300 FLOP/B in
fp16) at BERT's L = 128-512, so the target is HBM bandwidth at L = 128 and a large fraction of
the tensor-core peak at L >= 512 (not measured yet: needs a GPU).
"""

import math
from typing import NamedTuple

import torch
from torch.library import triton_op
from torch.nn import functional as F

from ..reference import MASK_VALUE
from ._autograd import (deferred_ops, forbid_double_backward, once_differentiable, records_grad, thin_apply,
                        use_registered_op)
from ._philox import check_seed, dropout_seed, interleaved_keep, keep_scale, philox_uniform, philox_words
from ._triton import (as_dtype, cdiv, compute_dtype, cpu_kernel, interpreting, launch, next_power_of_2,
                      require_triton, tl, triton, uses_triton, values_on_host)
from .padding import pad, unpad


def key_mask(valid_lens, num_queries, num_keys, device):
    """Boolean mask (True = attend) for SDPA, and the 0/1 factor for queries that see no key.

    Returns ``(mask, query_keep)`` broadcastable to (B, heads, Lq, Lk) and (B, heads, Lq, d),
    both bool (``q * query_keep`` keeps q's dtype).
    The comparison ``float32(j) < valid_len`` promotes exactly as the reference does.
    """
    keys = torch.arange(num_keys, dtype=torch.float32, device=device)
    if valid_lens.dim() == 1:
        visible = keys < valid_lens[:, None]                      # (B, Lk)
        sees_none = ~visible[:, :1]                               # (B, 1)
        mask = (visible | sees_none)[:, None, None, :]            # (B, 1, 1, Lk)
        query_keep = (~sees_none)[:, None, None, :]               # (B, 1, 1, 1)
    else:
        visible = keys < valid_lens[:, :, None]                   # (B, Lq, Lk)
        sees_none = ~visible[:, :, :1]                            # (B, Lq, 1)
        mask = (visible | sees_none)[:, None]                     # (B, 1, Lq, Lk)
        query_keep = (~sees_none)[:, None]                        # (B, 1, Lq, 1)
    return mask, query_keep


class KeyMask(NamedTuple):
    """``valid_lens`` of a self-attention of length L in the form its path reads, made once per
    encoder forward and shared by every layer (``prepare_key_mask``): the visible-key counts
    for the kernels, or SDPA's mask and query factor (key_mask) for the PyTorch path."""
    valid_lens: torch.Tensor
    counts: torch.Tensor | None = None          # (B, L) int32, _visible_key_counts
    sdpa_mask: torch.Tensor | None = None       # key_mask()[0], bool or additive in q's dtype
    # key_mask()[1], bool or in q's dtype; None where every query sees a key.
    query_keep: torch.Tensor | None = None


def _launches_kernels(backend, tensor):
    """Whether this backend's attention runs our Triton kernels (and reads visible-key counts)
    for tensors like ``tensor``: on CUDA, outside torch.compile (which takes raw valid_lens)."""
    return uses_triton(backend) and not cpu_kernel(tensor) and not use_registered_op()


def prepare_key_mask(valid_lens, seqlen, backend="torch", dtype=None):
    """valid_lens (None, (B,) or (B, L)) as the KeyMask the backend's attention reads for
    sequences of length ``seqlen``; a KeyMask or None is returned as it is. ``dtype`` (the
    activations'): SDPA's mask is made additive (0 / -inf) in it, once, rather than boolean,
    which SDPA would turn into a float mask on every call."""
    if valid_lens is None or isinstance(valid_lens, KeyMask):
        return valid_lens
    if _launches_kernels(backend, valid_lens):
        return KeyMask(valid_lens, counts=_visible_key_counts(valid_lens, valid_lens.shape[0], seqlen))
    if uses_triton(backend) and use_registered_op():
        return KeyMask(valid_lens)      # the registered op takes valid_lens as it is
    mask, query_keep = key_mask(valid_lens, seqlen, seqlen, valid_lens.device)
    if values_on_host(valid_lens) and bool(query_keep.all()):
        # Every query sees a key (nearly always), read where that costs no sync: no query to
        # zero, so no multiply in every layer's forward and backward.
        query_keep = None
    if dtype is not None and dtype.is_floating_point:
        mask = torch.full(mask.shape, float("-inf"), dtype=dtype, device=mask.device).masked_fill_(mask, 0.0)
        if query_keep is not None:      # q's dtype once, not a bool promotion per multiply
            query_keep = query_keep.to(dtype)
    return KeyMask(valid_lens, sdpa_mask=mask, query_keep=query_keep)


def _raw(valid_lens):
    return valid_lens.valid_lens if isinstance(valid_lens, KeyMask) else valid_lens


_ZERO_MASKS = {}


def _unmasked(q, num_keys):
    """attn_mask for an SDPA call that masks nothing: None, or on the CPU with fewer than 16 keys
    a zero additive mask (kept per size and dtype). Without a mask PyTorch's CPU kernel then
    gives zeros, not NaN, for a query whose scores are NaN (torch 2.13), where the reference's
    softmax gives NaN; with one it propagates NaN."""
    if not q.is_cpu or num_keys >= 16:
        return None
    if torch.compiler.is_compiling():
        return q.new_zeros(1, 1, 1, num_keys)
    mask = _ZERO_MASKS.get((num_keys, q.dtype))
    if mask is None:
        with torch.inference_mode(False):       # usable in any later mode
            mask = _ZERO_MASKS[num_keys, q.dtype] = torch.zeros(1, 1, 1, num_keys, dtype=q.dtype)
    return mask


def _sdpa(q, k, v, valid_lens, dropout_p):
    """SDPA on (B, heads, L, d) with the reference's masking rule (see the module docstring);
    ``valid_lens``: None, raw or a KeyMask."""
    mask = None if valid_lens is not None else _unmasked(q, k.shape[2])
    if valid_lens is not None:
        if (isinstance(valid_lens, KeyMask) and valid_lens.sdpa_mask is not None
                and (valid_lens.sdpa_mask.dtype == torch.bool or valid_lens.sdpa_mask.dtype == q.dtype)):
            mask, query_keep = valid_lens.sdpa_mask, valid_lens.query_keep
        else:
            mask, query_keep = key_mask(_raw(valid_lens), q.shape[2], k.shape[2], q.device)
        if query_keep is not None:
            q = q * query_keep
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p)


def multi_head_attention(queries, keys, values, num_heads, valid_lens=None, dropout_p=0.0):
    """(B, Lq, H), (B, Lk, H), (B, Lk, H) -> (B, Lq, H), heads split and merged as the reference.

    Inputs may be strided views (e.g. the three thirds of a packed QKV projection).
    ``dropout_p`` acts on the attention weights; pass 0 in eval mode.
    """
    batch, num_queries, hidden = queries.shape

    def split_heads(x):
        return x.unflatten(-1, (num_heads, -1)).transpose(1, 2)   # (B, heads, L, d)

    out = _sdpa(split_heads(queries), split_heads(keys), split_heads(values), valid_lens, dropout_p)
    return out.transpose(1, 2).reshape(batch, num_queries, hidden)


def _packed_sdpa(qkv, num_heads, valid_lens, dropout_p):
    """The PyTorch path on a packed (B, L, 3H) projection: one split into the three, SDPA."""
    batch, seqlen, _ = qkv.shape
    q, k, v = qkv.unflatten(-1, (3, num_heads, -1)).permute(2, 0, 3, 1, 4).unbind(0)
    return _sdpa(q, k, v, valid_lens, dropout_p).transpose(1, 2).reshape(batch, seqlen, -1)


# ----------------------------------------------------------------------------------------------
# Triton kernels
# ----------------------------------------------------------------------------------------------

_LOG2E = tl.constexpr(math.log2(math.e))
_LN2 = tl.constexpr(math.log(2.0))
# Kernels work in base 2 (exp2); this is the reference's replacement score in those units.
_MASKED_SCORE_LOG2 = tl.constexpr(MASK_VALUE * math.log2(math.e))
# Float arguments (sm_scale, dropout_p) are cast to fp32 first thing in each kernel: Triton's
# launcher passes a Python float as fp32, but torch.compile's code (Inductor, for a triton_op)
# types it fp64, and fp64 then spreads through the scores into the loop-carried statistics,
# which Triton refuses to compile ("m_i has initial type fp32 but is re-assigned to fp64").

_MAX_HEAD_DIM = 256
_MAX_DROPOUT_SEQLEN = 65536      # the Philox counter i * L + j must fit 32 bits
_MAX_GRID_Y = 65535              # CUDA's limit on the second grid axis (batch * heads)

# The saved LSE's strides (heads * L and L; N for packed tokens) are not specialised: Triton
# would otherwise compile each attention kernel again whenever their divisibility by 16 changes
# with the length (L 92 after L 90 at 12 heads: 4.7 s of compiling a training step on first use),
# for the same code: compiled for sm_90 without the specialisation, every kernel's PTX is byte
# for byte one that the specialised kernel compiles to, at every dtype, mask form, packed or
# padded, with and without dropout (2026-11-29, kernel_resources' workload at 12 heads of 64,
# L 19, 20 and 24). Other length-dependent integers do change the code and stay specialised:
# max_seqlen here (mask compares), the row count and the ids' strides of the row kernels
# (vectorised loads).
_UNSPECIALISED_LSE_STRIDES = ["stride_lse_b", "stride_lse_h"]


@triton.jit
def _sequence_span(cu_seqlens, b, max_seqlen, IS_VARLEN: tl.constexpr):
    """First row (int64) and length of sequence b: packed rows for varlen, the padded L else."""
    if IS_VARLEN:
        first = tl.load(cu_seqlens + b)
        seq_len = tl.load(cu_seqlens + b + 1) - first
    else:
        first = b * 0
        seq_len = b * 0 + max_seqlen
    return first.to(tl.int64), seq_len


@triton.jit
def _dropout_keep(seed_ptr, bh, queries, first_key, max_seqlen, dropout_p,
                  BLOCK_Q: tl.constexpr, BLOCK_K: tl.constexpr):
    """Keep mask (BLOCK_Q, BLOCK_K) of the weights of ``queries`` and keys first_key + 0..BLOCK_K-1
    (first_key a multiple of 4) of (batch * heads + head) ``bh``. One Philox call draws four
    consecutive keys' words, where the integer work of a call per weight was the largest cost of
    the kernels with dropout; the words are interleaved back into key order."""
    groups = first_key // 4 + tl.arange(0, BLOCK_K // 4)
    counter = (queries.to(tl.int64)[:, None] * ((max_seqlen + 3) // 4) + groups[None, :]).to(tl.uint32)
    zero = counter * 0
    w0, w1, w2, w3 = tl.philox(tl.load(seed_ptr), counter, zero + bh.to(tl.uint32), zero, zero)
    return interleaved_keep(w0, w1, w2, w3, dropout_p, BLOCK_Q, BLOCK_K)


@triton.jit
def _split_lse(lse):
    """fp64 LSE (natural log) -> base-2 value as hi + lo fp32 parts, (s - hi) - lo exact enough."""
    lse2 = lse * _LOG2E
    hi = lse2.to(tl.float32)
    return hi, (lse2 - hi.to(tl.float64)).to(tl.float32)


@triton.jit(do_not_specialize=_UNSPECIALISED_LSE_STRIDES)
def _attention_fwd_kernel(
        qkv, out, lse, visible_counts, cu_seqlens,
        stride_qkv_b, stride_qkv_l, stride_qkv_f,
        stride_out_b, stride_out_l, stride_out_f,
        stride_lse_b, stride_lse_h, stride_lse_l,
        stride_counts_b, stride_counts_l,
        num_heads, head_dim, max_seqlen, sm_scale, dropout_p, keep_scale, seed_ptr,
        HAS_VALID_LENS: tl.constexpr, IS_VARLEN: tl.constexpr, HAS_DROPOUT: tl.constexpr,
        DOT_PRECISION: tl.constexpr, STORE_LSE: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    """One program: BLOCK_M queries of one (batch, head) against all keys, online softmax.
    STORE_LSE: write each query's log-sum-exp (what the backward reads; inference skips it)."""
    sm_scale, dropout_p = tl.cast(sm_scale, tl.float32), tl.cast(dropout_p, tl.float32)
    keep_scale = tl.cast(keep_scale, tl.float32)
    start_m = tl.program_id(0) * BLOCK_M
    bh = tl.program_id(1)
    b = bh // num_heads
    h = bh % num_heads
    first, seq_len = _sequence_span(cu_seqlens, b, max_seqlen, IS_VARLEN)
    if start_m >= seq_len:
        return
    hidden = num_heads * head_dim
    qkv += b.to(tl.int64) * stride_qkv_b + first * stride_qkv_l + h * head_dim * stride_qkv_f
    out += b.to(tl.int64) * stride_out_b + first * stride_out_l + h * head_dim * stride_out_f

    queries = start_m + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    query_ok = queries < seq_len
    d_ok = offs_d < head_dim
    q = tl.load(qkv + queries[:, None] * stride_qkv_l + offs_d[None, :] * stride_qkv_f,
                mask=query_ok[:, None] & d_ok[None, :], other=0.0)
    # int32 offsets, not a tile of 64-bit pointers: half the registers.
    kv_offsets = offs_n[:, None] * stride_qkv_l + offs_d[None, :] * stride_qkv_f
    if HAS_VALID_LENS:
        counts = tl.load(visible_counts + b * stride_counts_b + queries * stride_counts_l,
                         mask=query_ok, other=0)

    qk_scale = sm_scale * _LOG2E
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for start_n in range(0, seq_len, BLOCK_N):
        keys = start_n + offs_n
        key_ok = keys < seq_len
        kv_mask = key_ok[:, None] & d_ok[None, :]
        k_block = qkv + (hidden * stride_qkv_f + start_n * stride_qkv_l)
        k = tl.load(k_block + kv_offsets, mask=kv_mask, other=0.0)
        v = tl.load(k_block + hidden * stride_qkv_f + kv_offsets, mask=kv_mask, other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale
        if HAS_VALID_LENS:
            s = tl.where(keys[None, :] < counts[:, None], s, _MASKED_SCORE_LOG2)
        s = tl.where(key_ok[None, :], s, float("-inf"))
        # Key 0 is always in bounds, so m_new is finite from the first block on.
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        if HAS_DROPOUT:
            keep = _dropout_keep(seed_ptr, bh, queries, start_n, max_seqlen, dropout_p, BLOCK_M, BLOCK_N)
            p = tl.where(keep, p, 0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    acc = acc / l_i[:, None]
    if HAS_DROPOUT:
        acc = acc * keep_scale
    tl.store(out + queries[:, None] * stride_out_l + offs_d[None, :] * stride_out_f,
             acc.to(out.dtype.element_ty), mask=query_ok[:, None] & d_ok[None, :])
    if STORE_LSE:
        lse += b.to(tl.int64) * stride_lse_b + h * stride_lse_h + first * stride_lse_l
        tl.store(lse + queries * stride_lse_l,
                 m_i.to(tl.float64) * _LN2 + tl.log(l_i).to(tl.float64), mask=query_ok)


@triton.jit(do_not_specialize=_UNSPECIALISED_LSE_STRIDES)
def _attention_bwd_dkdv_kernel(
        qkv, out, dout, lse, delta, dqkv, visible_counts, cu_seqlens,
        stride_qkv_b, stride_qkv_l, stride_qkv_f,
        stride_out_b, stride_out_l, stride_out_f,
        stride_dout_b, stride_dout_l, stride_dout_f,
        stride_dqkv_b, stride_dqkv_l, stride_dqkv_f,
        stride_lse_b, stride_lse_h, stride_lse_l,
        stride_counts_b, stride_counts_l,
        num_heads, head_dim, max_seqlen, sm_scale, dropout_p, keep_scale, seed_ptr,
        HAS_VALID_LENS: tl.constexpr, IS_VARLEN: tl.constexpr, HAS_DROPOUT: tl.constexpr,
        DOT_PRECISION: tl.constexpr, WITH_DQ: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    """One program: dK, dV of BLOCK_N keys of one (batch, head), looping over all queries.

    Works on transposed (key, query) tiles so dK and dV accumulate without transposes. Query
    rows past the sequence's end load zero Q and dO (and zero delta), so they add nothing
    whatever weight the zero LSE gives them. Delta and LSE share one layout (strides).

    WITH_DQ (the whole backward in one launch, for sequences of at most BLOCK_N keys: one
    program a (batch, head) holds every key): each query block's dQ is then complete in the
    program (dS^T's columns times K) and stored as it goes, and delta = rowsum(dO * O) is made
    from O here (``delta`` unused), where the two-kernel backward recomputes S, P and the
    dropout mask in the dQ kernel and passes delta through memory.
    """
    sm_scale, dropout_p = tl.cast(sm_scale, tl.float32), tl.cast(dropout_p, tl.float32)
    keep_scale = tl.cast(keep_scale, tl.float32)
    start_n = tl.program_id(0) * BLOCK_N
    bh = tl.program_id(1)
    b = bh // num_heads
    h = bh % num_heads
    first, seq_len = _sequence_span(cu_seqlens, b, max_seqlen, IS_VARLEN)
    if start_n >= seq_len:
        return
    hidden = num_heads * head_dim
    qkv += b.to(tl.int64) * stride_qkv_b + first * stride_qkv_l + h * head_dim * stride_qkv_f
    out += b.to(tl.int64) * stride_out_b + first * stride_out_l + h * head_dim * stride_out_f
    dout += b.to(tl.int64) * stride_dout_b + first * stride_dout_l + h * head_dim * stride_dout_f
    dqkv += b.to(tl.int64) * stride_dqkv_b + first * stride_dqkv_l + h * head_dim * stride_dqkv_f
    stats_offset = b.to(tl.int64) * stride_lse_b + h * stride_lse_h + first * stride_lse_l
    lse += stats_offset
    delta += stats_offset

    keys = start_n + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < head_dim
    kv_mask = (keys < seq_len)[:, None] & d_ok[None, :]
    kv_offsets = keys[:, None] * stride_qkv_l + offs_d[None, :] * stride_qkv_f
    k = tl.load(qkv + hidden * stride_qkv_f + kv_offsets, mask=kv_mask, other=0.0)
    v = tl.load(qkv + 2 * hidden * stride_qkv_f + kv_offsets, mask=kv_mask, other=0.0)

    qk_scale = sm_scale * _LOG2E
    dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    for start_m in range(0, seq_len, BLOCK_M):
        queries = start_m + offs_m
        query_ok = queries < seq_len
        q_mask = query_ok[:, None] & d_ok[None, :]
        q = tl.load(qkv + queries[:, None] * stride_qkv_l + offs_d[None, :] * stride_qkv_f,
                    mask=q_mask, other=0.0)
        do = tl.load(dout + queries[:, None] * stride_dout_l + offs_d[None, :] * stride_dout_f,
                     mask=q_mask, other=0.0)
        lse_hi, lse_lo = _split_lse(tl.load(lse + queries * stride_lse_l, mask=query_ok, other=0.0))
        if WITH_DQ:
            o = tl.load(out + queries[:, None] * stride_out_l + offs_d[None, :] * stride_out_f,
                        mask=q_mask, other=0.0)
            delta_rows = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
        else:
            delta_rows = tl.load(delta + queries * stride_lse_l, mask=query_ok, other=0.0)

        s_t = tl.dot(k, tl.trans(q), input_precision=DOT_PRECISION) * qk_scale
        if HAS_VALID_LENS:
            counts = tl.load(visible_counts + b * stride_counts_b + queries * stride_counts_l,
                             mask=query_ok, other=0)
            visible_t = keys[:, None] < counts[None, :]
            s_t = tl.where(visible_t, s_t, _MASKED_SCORE_LOG2)
        elif WITH_DQ:
            # Key slots past the end (K = 0, score 0) as in the forward: exp2(0 - LSE) overflows
            # where every score of a row is very negative, and inf * 0 in dQ's dot is NaN.
            # (Without WITH_DQ those slots' dK, dV rows are never stored.)
            s_t = tl.where((keys < seq_len)[:, None], s_t, float("-inf"))
        p_t = tl.exp2(s_t - lse_hi[None, :] - lse_lo[None, :])
        dp_t = tl.dot(v, tl.trans(do), input_precision=DOT_PRECISION)
        if HAS_DROPOUT:
            keep_t = tl.trans(_dropout_keep(seed_ptr, bh, queries, start_n, max_seqlen, dropout_p, BLOCK_M, BLOCK_N))
            z_t = tl.where(keep_t, p_t * keep_scale, 0.0)
            dp_t = tl.where(keep_t, dp_t * keep_scale, 0.0)
        else:
            z_t = p_t
        dv += tl.dot(z_t.to(do.dtype), do, input_precision=DOT_PRECISION)
        ds_t = p_t * (dp_t - delta_rows[None, :])
        if HAS_VALID_LENS:
            # Replaced scores are constants: no gradient reaches Q or K through them.
            ds_t = tl.where(visible_t, ds_t, 0.0)
        dk += tl.dot(ds_t.to(q.dtype), q, input_precision=DOT_PRECISION)
        if WITH_DQ:
            dq = tl.dot(tl.trans(ds_t.to(k.dtype)), k, input_precision=DOT_PRECISION) * sm_scale
            tl.store(dqkv + queries[:, None] * stride_dqkv_l + offs_d[None, :] * stride_dqkv_f,
                     dq.to(dqkv.dtype.element_ty), mask=q_mask)

    dk *= sm_scale
    d_offsets = keys[:, None] * stride_dqkv_l + offs_d[None, :] * stride_dqkv_f
    tl.store(dqkv + hidden * stride_dqkv_f + d_offsets, dk.to(dqkv.dtype.element_ty), mask=kv_mask)
    tl.store(dqkv + 2 * hidden * stride_dqkv_f + d_offsets, dv.to(dqkv.dtype.element_ty), mask=kv_mask)


@triton.jit(do_not_specialize=_UNSPECIALISED_LSE_STRIDES)
def _attention_bwd_dq_kernel(
        qkv, out, dout, lse, delta, dqkv, visible_counts, cu_seqlens,
        stride_qkv_b, stride_qkv_l, stride_qkv_f,
        stride_out_b, stride_out_l, stride_out_f,
        stride_dout_b, stride_dout_l, stride_dout_f,
        stride_dqkv_b, stride_dqkv_l, stride_dqkv_f,
        stride_lse_b, stride_lse_h, stride_lse_l,
        stride_counts_b, stride_counts_l,
        num_heads, head_dim, max_seqlen, sm_scale, dropout_p, keep_scale, seed_ptr,
        HAS_VALID_LENS: tl.constexpr, IS_VARLEN: tl.constexpr, HAS_DROPOUT: tl.constexpr,
        DOT_PRECISION: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    """One program: dQ of BLOCK_M queries of one (batch, head), looping over all keys; first
    delta = rowsum(dO * O) in fp32 of its rows, which it uses and stores for the dK/dV kernel
    (launched after it: no pass of its own over O and dO).

    Key rows past the sequence's end load zero K and V, so whatever weight they get, their
    dS multiplies a zero K row.
    """
    sm_scale, dropout_p = tl.cast(sm_scale, tl.float32), tl.cast(dropout_p, tl.float32)
    keep_scale = tl.cast(keep_scale, tl.float32)
    start_m = tl.program_id(0) * BLOCK_M
    bh = tl.program_id(1)
    b = bh // num_heads
    h = bh % num_heads
    first, seq_len = _sequence_span(cu_seqlens, b, max_seqlen, IS_VARLEN)
    if start_m >= seq_len:
        return
    hidden = num_heads * head_dim
    qkv += b.to(tl.int64) * stride_qkv_b + first * stride_qkv_l + h * head_dim * stride_qkv_f
    out += b.to(tl.int64) * stride_out_b + first * stride_out_l + h * head_dim * stride_out_f
    dout += b.to(tl.int64) * stride_dout_b + first * stride_dout_l + h * head_dim * stride_dout_f
    dqkv += b.to(tl.int64) * stride_dqkv_b + first * stride_dqkv_l + h * head_dim * stride_dqkv_f
    stats_offset = b.to(tl.int64) * stride_lse_b + h * stride_lse_h + first * stride_lse_l

    queries = start_m + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    query_ok = queries < seq_len
    d_ok = offs_d < head_dim
    q_mask = query_ok[:, None] & d_ok[None, :]
    q = tl.load(qkv + queries[:, None] * stride_qkv_l + offs_d[None, :] * stride_qkv_f,
                mask=q_mask, other=0.0)
    do = tl.load(dout + queries[:, None] * stride_dout_l + offs_d[None, :] * stride_dout_f,
                 mask=q_mask, other=0.0)
    o = tl.load(out + queries[:, None] * stride_out_l + offs_d[None, :] * stride_out_f, mask=q_mask, other=0.0)
    delta_rows = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
    tl.store(delta + stats_offset + queries * stride_lse_l, delta_rows, mask=query_ok)
    lse_hi, lse_lo = _split_lse(tl.load(lse + stats_offset + queries * stride_lse_l, mask=query_ok, other=0.0))
    if HAS_VALID_LENS:
        counts = tl.load(visible_counts + b * stride_counts_b + queries * stride_counts_l,
                         mask=query_ok, other=0)
    kv_offsets = offs_n[:, None] * stride_qkv_l + offs_d[None, :] * stride_qkv_f

    qk_scale = sm_scale * _LOG2E
    dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for start_n in range(0, seq_len, BLOCK_N):
        if HAS_DROPOUT:       # drawn first: 187 registers a thread (sm_90, bf16) where after dP, 200
            keep = _dropout_keep(seed_ptr, bh, queries, start_n, max_seqlen, dropout_p, BLOCK_M, BLOCK_N)
        keys = start_n + offs_n
        kv_mask = (keys < seq_len)[:, None] & d_ok[None, :]
        k_block = qkv + (hidden * stride_qkv_f + start_n * stride_qkv_l)
        k = tl.load(k_block + kv_offsets, mask=kv_mask, other=0.0)
        v = tl.load(k_block + hidden * stride_qkv_f + kv_offsets, mask=kv_mask, other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale
        if HAS_VALID_LENS:
            visible = keys[None, :] < counts[:, None]
            s = tl.where(visible, s, _MASKED_SCORE_LOG2)
        else:
            # Key slots past the end (K = 0, score 0) as in the forward: exp2(0 - LSE) overflows
            # where every score of a row is very negative (fp16: below ~-11), and inf * 0 in the
            # dot below is NaN. (With valid_lens, ds's where() below drops them.)
            s = tl.where((keys < seq_len)[None, :], s, float("-inf"))
        p = tl.exp2(s - lse_hi[:, None] - lse_lo[:, None])
        dp = tl.dot(do, tl.trans(v), input_precision=DOT_PRECISION)
        if HAS_DROPOUT:
            dp = tl.where(keep, dp * keep_scale, 0.0)
        ds = p * (dp - delta_rows[:, None])
        if HAS_VALID_LENS:
            ds = tl.where(visible, ds, 0.0)
        dq += tl.dot(ds.to(k.dtype), k, input_precision=DOT_PRECISION)

    dq *= sm_scale
    tl.store(dqkv + queries[:, None] * stride_dqkv_l + offs_d[None, :] * stride_dqkv_f,
             dq.to(dqkv.dtype.element_ty), mask=q_mask)


@triton.jit
def _attention_dropout_keep_kernel(keep, max_seqlen, dropout_p, seed_ptr,
                                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Materialise the kernels' keep mask (B, heads, L, L) as int8: for tests only."""
    dropout_p = tl.cast(dropout_p, tl.float32)
    queries = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    keys = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    bh = tl.program_id(2)
    kept = _dropout_keep(seed_ptr, bh, queries, tl.program_id(1) * BLOCK_N, max_seqlen, dropout_p, BLOCK_M, BLOCK_N)
    tl.store(keep + bh.to(tl.int64) * max_seqlen * max_seqlen + queries[:, None] * max_seqlen + keys[None, :],
             kept.to(tl.int8), mask=(queries < max_seqlen)[:, None] & (keys < max_seqlen)[None, :])


# ----------------------------------------------------------------------------------------------
# Launchers
# ----------------------------------------------------------------------------------------------

class _Tiles(NamedTuple):
    block_m: int
    block_n: int
    num_warps: int
    num_stages: int


# Tiles per (BLOCK_D, element size): forward (BLOCK_M, BLOCK_N, warps, stages), then the dK/dV
# kernel (queries streamed, keys resident) and the dQ kernel (queries resident, keys streamed).
# Chosen without a GPU, from Triton's ahead-of-time compile for sm80 and sm90 (now
# `python -m bert_fast.kernel_resources`, held to its limits by tests/test_fake_gpu_compile.py),
# fp16/bf16/fp32, with and without valid_lens, varlen and dropout: no register spills, and at
# most 67 KB of shared memory, which sm86/89 (99 KB) hold as well. Timings on a GPU may move them.
# Moved so far: the d = 64, 16-bit forward, from (128, 64, 8, 3) to (64, 64, 4, 3), the fastest
# of 7 candidates at every suite shape on an H100 (scripts/attention_tiles.py, 2026-11-26:
# B1 L128 10.4 vs 11.3 us, B128 L128 49.2 vs 51.7, B16 L512 padded 54.8 vs 56.5, varlen 26.4
# vs 31.7; same outputs bit for bit, since BLOCK_N sets the order of the sums). Its backward,
# from dK/dV (32, 128, 8, 2) and dQ (128, 32, 8, 2) to (16, 64, 4, 2) and (64, 64, 4, 2), each the
# fastest of 7 candidates at both shapes timed on an H200 (attention_tiles.py --backward,
# 2026-11-26, the other kernel's tiles as they were; both kernels of a call, bf16, key mask):
# dK/dV 51.0 vs 54.5 us at B32 L128, 213 vs 258 at B16 L512; dQ 50.0 vs 54.5 and 238 vs 258;
# the same gradients bit for bit. Then dK/dV to 3 stages, (16, 64, 4, 3), the fastest of 7 in
# all four cases on an H100 (2026-11-27, both kernels of a call): 46.3 vs 50.9 us at B32 L128
# and 185 vs 200 at B16 L512; with dropout 0.1 on the weights 74.5 vs 83.9 and 391 vs 465.
_GPU_TILES = {
    (64, 2): (_Tiles(64, 64, 4, 3), _Tiles(16, 64, 4, 3), _Tiles(64, 64, 4, 2)),
    (128, 2): (_Tiles(128, 32, 8, 2), _Tiles(32, 32, 8, 2), _Tiles(64, 32, 8, 2)),
    (256, 2): (_Tiles(32, 32, 8, 2), _Tiles(16, 32, 8, 2), _Tiles(32, 16, 8, 2)),
    # fp32 products are FMA loops (ieee precision): registers, not shared memory, limit the tiles.
    (64, 4): (_Tiles(64, 32, 8, 2), _Tiles(32, 32, 8, 2), _Tiles(32, 32, 8, 2)),
    (128, 4): (_Tiles(32, 16, 8, 2), _Tiles(16, 32, 8, 2), _Tiles(32, 16, 8, 2)),
    (256, 4): (_Tiles(32, 16, 8, 2), _Tiles(16, 16, 8, 2), _Tiles(16, 16, 8, 2)),
}


def _attention_tiles(head_dim, element_size, interpreter=None):
    """``(BLOCK_D, forward tiles, dK/dV tiles, dQ tiles)`` for a head dim and element size in bytes.

    BLOCK_D is the next power of two >= d (loads mask the rest); d = 192 shares d = 256's
    smaller tiles. Under Triton's interpreter, 16 x 16 tiles: it runs tiles as numpy arrays,
    and test sequences of ~20 tokens then cross block boundaries.
    """
    block_d = max(16, 1 << (head_dim - 1).bit_length())
    if interpreting() if interpreter is None else interpreter:
        tiles = _Tiles(16, 16, 1, 1)
        return block_d, tiles, tiles, tiles
    return (block_d,) + _GPU_TILES[max(64, block_d), min(element_size, 4)]


_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_CPU_DTYPES = _DTYPES + (torch.float64,)     # the CPU twins also serve fp64 gradchecks


def _check_qkv(qkv, num_heads, layout, dtypes):
    """Shape and dtype of a packed projection; returns the head dim."""
    expected_dim = 3 if layout == "(B, L, 3H)" else 2
    if qkv.dim() != expected_dim:
        raise ValueError(f"qkv must be the packed projection {layout}, got shape {tuple(qkv.shape)}")
    if qkv.dtype not in dtypes:
        raise ValueError(f"qkv must be one of {', '.join(map(str, dtypes))}, got {qkv.dtype}")
    if isinstance(num_heads, bool) or not isinstance(num_heads, int) or num_heads < 1:
        raise ValueError(f"num_heads must be a positive int, got {num_heads!r}")
    if qkv.shape[-1] % (3 * num_heads) != 0:
        raise ValueError(f"the last dim of qkv ({qkv.shape[-1]}) must be 3 * num_heads * head_dim "
                         f"(divisible by 3 * num_heads = {3 * num_heads})")
    head_dim = qkv.shape[-1] // (3 * num_heads)
    if not 1 <= head_dim <= _MAX_HEAD_DIM:
        raise ValueError(f"head dim must be 1..{_MAX_HEAD_DIM}, got {head_dim}")
    return head_dim


def _check_dropout(dropout_p, max_seqlen, seed, device):
    if not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"dropout_p must be in [0, 1), got {dropout_p}")
    if dropout_p > 0.0 and max_seqlen > _MAX_DROPOUT_SEQLEN:
        raise ValueError(f"attention dropout supports sequences up to {_MAX_DROPOUT_SEQLEN} tokens, "
                         f"got {max_seqlen}")
    check_seed(seed, dropout_p, device)


def _check_attention_inputs(qkv, valid_lens, num_heads, dropout_p, seed, dtypes=_DTYPES):
    head_dim = _check_qkv(qkv, num_heads, "(B, L, 3H)", dtypes)
    batch, seqlen = qkv.shape[:2]
    if valid_lens is not None:
        if tuple(valid_lens.shape) not in ((batch,), (batch, seqlen)):
            raise ValueError(f"valid_lens must have shape (B,) = ({batch},) or (B, L) = ({batch}, {seqlen}), "
                             f"got {tuple(valid_lens.shape)}")
        if valid_lens.dtype == torch.bool or valid_lens.dtype.is_complex:
            raise ValueError(f"valid_lens must be an integer or floating point tensor, got {valid_lens.dtype}")
        if valid_lens.device != qkv.device:
            raise ValueError(f"valid_lens is on {valid_lens.device} but qkv is on {qkv.device}")
    _check_dropout(dropout_p, seqlen, seed, qkv.device)
    return head_dim


def _check_varlen_inputs(qkv, cu_seqlens, num_heads, max_seqlen, dropout_p, seed, dtypes=_DTYPES):
    head_dim = _check_qkv(qkv, num_heads, "(N, 3H)", dtypes)
    if cu_seqlens.dim() != 1 or cu_seqlens.shape[0] < 2:
        raise ValueError(f"cu_seqlens must be 1-D (B+1,) with B >= 1, got shape {tuple(cu_seqlens.shape)}")
    if cu_seqlens.dtype != torch.int32:
        raise ValueError(f"cu_seqlens must be int32, got {cu_seqlens.dtype}")
    if cu_seqlens.device != qkv.device:
        raise ValueError(f"cu_seqlens is on {cu_seqlens.device} but qkv is on {qkv.device}")
    if isinstance(max_seqlen, bool) or not isinstance(max_seqlen, (int, torch.SymInt)) or max_seqlen < 0:
        raise ValueError(f"max_seqlen must be an int >= 0 (at least the longest sequence), got {max_seqlen!r}")
    _check_dropout(dropout_p, max_seqlen, seed, qkv.device)
    return head_dim


def _check_bwd_inputs(grad_out, out, lse, qkv, num_heads, head_dim, lse_shape):
    context_shape = tuple(qkv.shape[:-1]) + (num_heads * head_dim,)
    for name, t in (("grad_out", grad_out), ("out", out)):
        if tuple(t.shape) != context_shape:
            raise ValueError(f"{name} must have the context's shape {context_shape}, got {tuple(t.shape)}")
        if t.dtype != qkv.dtype or t.device != qkv.device:
            raise ValueError(f"{name} must be {qkv.dtype} on {qkv.device} like qkv, got {t.dtype} on {t.device}")
    if tuple(lse.shape) != lse_shape or lse.dtype != torch.float64 or lse.device != qkv.device:
        raise ValueError(f"lse must be the forward's float64 {lse_shape} on {qkv.device}, "
                         f"got {lse.dtype} {tuple(lse.shape)} on {lse.device}")


def _visible_key_counts(valid_lens, batch, seqlen):
    """How many keys each query sees, as an int32 (B, L) view (stride 0 over queries for 1-D).

    Key j is visible iff float32(j) < valid_len, i.e. j < ceil(valid_len) for integer j; the
    ceil runs in the dtype the reference compares in (float32, or float64 for float64 lengths).
    """
    lengths = as_dtype(valid_lens, compute_dtype(valid_lens.dtype))
    counts = torch.ceil(lengths).nan_to_num(nan=0.0).clamp(0, seqlen).to(torch.int32)
    return counts[:, None].expand(batch, seqlen) if counts.dim() == 1 else counts


def _strides(t):
    """(batch, row, column) strides; packed varlen tensors have no batch axis (stride 0)."""
    return tuple(t.stride()) if t.dim() == 3 else (0,) + tuple(t.stride())


def _launch_config(qkv, head_dim, batch, num_heads):
    if batch * num_heads > _MAX_GRID_Y:
        raise ValueError(f"batch * num_heads must be at most {_MAX_GRID_Y}, got {batch} * {num_heads} (a CUDA "
                         f"grid limit of the Triton attention); split the batch or use backend='torch'")
    # fp32 inputs get fp32 products (PyTorch's default for fp32 matmuls), not TF32.
    precision = "ieee" if qkv.dtype == torch.float32 else None
    return _attention_tiles(head_dim, qkv.element_size()) + (precision,)


# The kernels offset a row by (row index) * (row stride) in int32 arithmetic: a strided view
# whose rows lie 2**31 elements apart over the sequence (a sequence-first (L, B, 3H) tensor
# transposed, at large B*L) is read through a contiguous copy.
_ROW_OFFSET_LIMIT = 2**31


def _row_addressable(t, rows):
    return t.contiguous() if t.stride(-2) * rows >= _ROW_OFFSET_LIMIT else t


def _launch_fwd(qkv, out, lse, counts, cu_seqlens, batch, num_heads, head_dim, max_seqlen,
                dropout_p, seed):
    """qkv, out, lse, counts go by their strides; cu_seqlens must be contiguous; lse None: not
    written."""
    block_d, tiles, _, _, precision = _launch_config(qkv, head_dim, batch, num_heads)
    if max_seqlen == 0 or batch == 0:
        return
    qkv = _row_addressable(qkv, max_seqlen)
    grid = (cdiv(max_seqlen, tiles.block_m), batch * num_heads)
    launch(_attention_fwd_kernel, out)[grid](
        qkv, out, lse, counts, cu_seqlens,
        *_strides(qkv), *_strides(out), *(_strides(lse) if lse is not None else (0, 0, 0)),
        *(counts.stride() if counts is not None else (0, 0)),
        num_heads, head_dim, max_seqlen, 1.0 / math.sqrt(head_dim), dropout_p, keep_scale(dropout_p), seed,
        HAS_VALID_LENS=counts is not None, IS_VARLEN=cu_seqlens is not None,
        HAS_DROPOUT=dropout_p > 0.0, DOT_PRECISION=precision, STORE_LSE=lse is not None,
        BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n, BLOCK_D=block_d,
        num_warps=tiles.num_warps, num_stages=tiles.num_stages)


# The backward in one launch (the dK/dV kernel WITH_DQ) for sequences of at most this many keys;
# 0: always the two kernels. Off until a GPU times it against them (scripts/attention_tiles.py
# --backward compares both); the interpreter's tests run it at every shape they cover.
ONE_KERNEL_BACKWARD_MAX_SEQLEN = 0


def _one_kernel_tiles(max_seqlen, block_d, interpreter=None):
    """Tiles of the one-kernel backward at ``max_seqlen``, or None where it does not apply:
    longer sequences, or every key's dK and dV accumulators (BLOCK_N x BLOCK_D fp32 each) over
    128 x 64 (the registers of a program). BLOCK_N holds every key; queries go BLOCK_M a step."""
    if max_seqlen > ONE_KERNEL_BACKWARD_MAX_SEQLEN:
        return None
    block_n = max(16, next_power_of_2(max_seqlen))
    if block_n * block_d > 128 * 64:
        return None
    if interpreting() if interpreter is None else interpreter:
        return _Tiles(16, block_n, 1, 1)
    # Chosen without a GPU, to fit the registers: 8 warps hold the 128-key accumulators at
    # 64 fp32 values a thread; 16 query rows a step take 154-185 registers a thread (ptxas,
    # sm_90, bf16, d 64), 32 rows 170-255.
    return _Tiles(16, block_n, 8 if block_n * block_d > 64 * 64 else 4, 2)


def _launch_bwd(grad_out, qkv, out, lse, dqkv, counts, cu_seqlens, batch, num_heads, head_dim,
                max_seqlen, dropout_p, seed):
    block_d, _, dkdv_tiles, dq_tiles, precision = _launch_config(qkv, head_dim, batch, num_heads)
    if max_seqlen == 0 or batch == 0:
        return
    qkv, out, grad_out = (_row_addressable(t, max_seqlen) for t in (qkv, out, grad_out))
    lse = lse.contiguous()    # delta takes its layout, and the kernels read both with lse's strides
    counts_strides = counts.stride() if counts is not None else (0, 0)
    scalars = (num_heads, head_dim, max_seqlen, 1.0 / math.sqrt(head_dim), dropout_p, keep_scale(dropout_p), seed)
    flags = dict(HAS_VALID_LENS=counts is not None, IS_VARLEN=cu_seqlens is not None,
                 HAS_DROPOUT=dropout_p > 0.0, DOT_PRECISION=precision, BLOCK_D=block_d)
    one_kernel = _one_kernel_tiles(max_seqlen, block_d) if ONE_KERNEL_BACKWARD_MAX_SEQLEN else None
    if one_kernel is None:
        delta = torch.empty_like(lse, dtype=torch.float32)
        # dQ first: it writes delta, which the dK/dV kernel reads.
        launch(_attention_bwd_dq_kernel, dqkv)[(cdiv(max_seqlen, dq_tiles.block_m), batch * num_heads)](
            qkv, out, grad_out, lse, delta, dqkv, counts, cu_seqlens,
            *_strides(qkv), *_strides(out), *_strides(grad_out), *_strides(dqkv), *_strides(lse), *counts_strides,
            *scalars, **flags, BLOCK_M=dq_tiles.block_m, BLOCK_N=dq_tiles.block_n,
            num_warps=dq_tiles.num_warps, num_stages=dq_tiles.num_stages)
    else:
        delta, dkdv_tiles = lse, one_kernel       # (delta: unread, any pointer of lse's layout)
    launch(_attention_bwd_dkdv_kernel, dqkv)[(cdiv(max_seqlen, dkdv_tiles.block_n), batch * num_heads)](
        qkv, out, grad_out, lse, delta, dqkv, counts, cu_seqlens,
        *_strides(qkv), *_strides(out), *_strides(grad_out), *_strides(dqkv), *_strides(lse), *counts_strides,
        *scalars, **flags, WITH_DQ=one_kernel is not None, BLOCK_M=dkdv_tiles.block_m,
        BLOCK_N=dkdv_tiles.block_n, num_warps=dkdv_tiles.num_warps, num_stages=dkdv_tiles.num_stages)


def _attention_fwd_triton(qkv, valid_lens, num_heads, dropout_p, seed, counts=None, lse=True):
    """(B, L, 3H) packed projection -> context (B, L, H) and fp64 LSE (B, heads, L).

    ``counts``: _visible_key_counts(valid_lens, B, L) when the caller made it already (once per
    encoder forward), else computed here. ``lse=False`` (inference: no backward will read it):
    the LSE is None, neither allocated nor written.
    """
    head_dim = _check_attention_inputs(qkv, valid_lens, num_heads, dropout_p, seed)
    require_triton(qkv, valid_lens)
    batch, seqlen, _ = qkv.shape
    out = qkv.new_empty(batch, seqlen, num_heads * head_dim)
    lse = torch.empty(batch, num_heads, seqlen, dtype=torch.float64, device=qkv.device) if lse else None
    if counts is None and valid_lens is not None:
        counts = _visible_key_counts(valid_lens, batch, seqlen)
    _launch_fwd(qkv, out, lse, counts, None, batch, num_heads, head_dim, seqlen, dropout_p, seed)
    return out, lse


def _attention_bwd_triton(grad_out, qkv, out, lse, valid_lens, num_heads, dropout_p, seed, counts=None,
                          check=True):
    """Gradient of the packed projection, (B, L, 3H), from the forward's context and LSE.
    ``check=False``: the inputs are a forward's, checked when it ran (the backward of our own
    Functions; see add_layernorm's _add_layernorm_bwd_triton)."""
    batch, seqlen, _ = qkv.shape
    if check:
        head_dim = _check_attention_inputs(qkv, valid_lens, num_heads, dropout_p, seed)
        _check_bwd_inputs(grad_out, out, lse, qkv, num_heads, head_dim, (batch, num_heads, seqlen))
        require_triton(grad_out, qkv, out, lse, valid_lens)
    else:
        head_dim = qkv.shape[-1] // (3 * num_heads)
    dqkv = torch.empty_like(qkv, memory_format=torch.contiguous_format)
    if counts is None and valid_lens is not None:
        counts = _visible_key_counts(valid_lens, batch, seqlen)
    _launch_bwd(grad_out, qkv, out, lse, dqkv, counts, None, batch, num_heads, head_dim, seqlen,
                dropout_p, seed)
    return dqkv


def _varlen_attention_fwd_triton(qkv, cu_seqlens, num_heads, max_seqlen, dropout_p, seed, filler=True, lse=True):
    """(N, 3H) packed valid tokens -> context (N, H) and fp64 LSE (heads, N) (None with
    ``lse=False``, as _attention_fwd_triton's).

    ``max_seqlen`` must be >= every sequence's length (the padded L); ``cu_seqlens[-1] <= N``.
    Rows past ``cu_seqlens[-1]`` (a static unpadding's filler) belong to no sequence and are
    zeros. ``filler=False`` says there are none (``cu_seqlens[-1] == N``, an unpadding with host
    counts): then every row is written and nothing is zero-filled first (two fills fewer).
    """
    head_dim = _check_varlen_inputs(qkv, cu_seqlens, num_heads, max_seqlen, dropout_p, seed)
    require_triton(qkv, cu_seqlens)
    num_tokens = qkv.shape[0]
    new = torch.zeros if filler else torch.empty     # the kernel never writes rows of no sequence
    out = new(num_tokens, num_heads * head_dim, dtype=qkv.dtype, device=qkv.device)
    lse = new(num_heads, num_tokens, dtype=torch.float64, device=qkv.device) if lse else None
    _launch_fwd(qkv, out, lse, None, cu_seqlens.contiguous(), cu_seqlens.shape[0] - 1, num_heads, head_dim,
                max_seqlen, dropout_p, seed)
    return out, lse


def _varlen_attention_bwd_triton(grad_out, qkv, out, lse, cu_seqlens, num_heads, max_seqlen, dropout_p, seed,
                                 filler=True, check=True):
    """Gradient of the packed valid tokens' projection, (N, 3H); ``filler`` as for the forward,
    ``check`` as for _attention_bwd_triton."""
    if check:
        head_dim = _check_varlen_inputs(qkv, cu_seqlens, num_heads, max_seqlen, dropout_p, seed)
        _check_bwd_inputs(grad_out, out, lse, qkv, num_heads, head_dim, (num_heads, qkv.shape[0]))
        require_triton(grad_out, qkv, out, lse, cu_seqlens)
    else:
        head_dim = qkv.shape[-1] // (3 * num_heads)
    dqkv = (torch.zeros if filler else torch.empty)(qkv.shape, dtype=qkv.dtype, device=qkv.device)
    _launch_bwd(grad_out, qkv, out, lse, dqkv, None, cu_seqlens.contiguous(), cu_seqlens.shape[0] - 1, num_heads,
                head_dim, max_seqlen, dropout_p, seed)
    return dqkv


def _attention_dropout_keep_triton(batch, num_heads, max_seqlen, dropout_p, seed):
    """The keep mask (B, heads, L, L) the kernels apply for this seed: lets tests rebuild it."""
    keep = torch.empty(batch, num_heads, max_seqlen, max_seqlen, dtype=torch.int8, device=seed.device)
    require_triton(keep)
    block_m = block_n = 16 if interpreting() else 64
    grid = (cdiv(max_seqlen, block_m), cdiv(max_seqlen, block_n), batch * num_heads)
    launch(_attention_dropout_keep_kernel, keep)[grid](keep, max_seqlen, dropout_p, seed,
                                                 BLOCK_M=block_m, BLOCK_N=block_n)
    return keep.view(torch.bool)


# ----------------------------------------------------------------------------------------------
# CPU twins: the same ops in plain PyTorch (explicit math, at least fp32)
# ----------------------------------------------------------------------------------------------

def _split_heads_cpu(qkv, num_heads):
    """(B, L, 3H) -> q, k, v each (B, heads, L, d), computed in at least fp32."""
    return as_dtype(qkv, compute_dtype(qkv.dtype)).unflatten(-1, (3, num_heads, -1)).permute(2, 0, 3, 1, 4)


def _merge_heads_cpu(x):
    return x.transpose(1, 2).flatten(2)


# Keys of the (B * heads, L, ceil(L / 4) * 4) keep mask made at once by its CPU twin: Philox's
# temporaries are int64, several per key alive at once, so the whole mask at once would hold
# more memory than the attention weights themselves.
_KEEP_CHUNK_ELEMENTS = 1 << 18


def _attention_dropout_keep_cpu(batch, num_heads, max_seqlen, dropout_p, seed):
    """The kernels' keep mask (B, heads, L, L), bit for bit: key j of query i is word j % 4 of
    the Philox call with counters (i * ceil(L / 4) + j // 4, batch * heads + head), see
    _dropout_keep. Made a few (batch, head) pairs at a time (_KEEP_CHUNK_ELEMENTS)."""
    groups = cdiv(max_seqlen, 4)
    counter = (torch.arange(max_seqlen, dtype=torch.int64, device=seed.device)[:, None] * groups
               + torch.arange(groups, dtype=torch.int64, device=seed.device)[None, :]) & 0xFFFFFFFF
    threshold = torch.tensor(dropout_p, dtype=torch.float32)
    pairs = batch * num_heads
    keep = torch.empty(pairs, max_seqlen, max_seqlen, dtype=torch.bool, device=seed.device)
    step = max(1, _KEEP_CHUNK_ELEMENTS // max(1, max_seqlen * groups * 4))
    for first in range(0, pairs, step):
        bh = torch.arange(first, min(first + step, pairs), dtype=torch.int64, device=seed.device).view(-1, 1, 1)
        wide = torch.empty(bh.shape[0], max_seqlen, groups, 4, dtype=torch.bool, device=seed.device)
        for word, bits in enumerate(philox_words(seed, counter, bh)):   # word w: keys 4 * group + w
            wide[..., word] = philox_uniform(bits) >= threshold
        keep[first:first + step] = wide.flatten(-2)[..., :max_seqlen]
    return keep.view(batch, num_heads, max_seqlen, max_seqlen)


def _drop_cpu_(x, keep, dropout_p):
    """x * keep / (1 - p) in place (x fresh): what the kernels do to weights and their gradients."""
    return x.mul_(keep).mul_(keep_scale(dropout_p))


def _attention_probs_cpu(q, k, valid_lens, dropout_p, seed, with_lse):
    """Softmax of the scores with the reference's replacement, the visible mask (or None), the
    dropout keep mask (or None), and with_lse the rows' log-sum-exp (fp64, the kernels' output).
    Made in place where it can: no more than two (B, heads, L, L) tensors at once, so that the
    twins' peak memory stays near the reference's."""
    scores = (q @ k.transpose(-1, -2)).div_(math.sqrt(q.shape[-1]))
    visible = None
    if valid_lens is not None:
        keys = torch.arange(k.shape[2], dtype=torch.float32, device=k.device)
        lengths = valid_lens[:, None, None, None] if valid_lens.dim() == 1 else valid_lens[:, None, :, None]
        visible = keys < lengths                                   # (B, 1, 1 or L, L)
        scores.masked_fill_(~visible, MASK_VALUE)
    # One head at a time: an fp64 copy of all the scores would be two more (B, heads, L, L).
    lse = torch.stack([torch.logsumexp(s.double(), dim=-1) for s in scores.unbind(1)], 1) if with_lse else None
    probs = torch.softmax(scores, dim=-1)
    del scores
    keep = _attention_dropout_keep_cpu(*probs.shape[:3], dropout_p, seed) if dropout_p > 0.0 else None
    return probs, visible, keep, lse


def _attention_fwd_cpu(qkv, valid_lens, num_heads, dropout_p, seed):
    _check_attention_inputs(qkv, valid_lens, num_heads, dropout_p, seed, _CPU_DTYPES)
    q, k, v = _split_heads_cpu(qkv, num_heads)
    weights, _, keep, lse = _attention_probs_cpu(q, k, valid_lens, dropout_p, seed, with_lse=True)
    if keep is not None:
        _drop_cpu_(weights, keep, dropout_p)
    return _merge_heads_cpu(weights @ v).to(qkv.dtype), lse


def _attention_bwd_cpu(grad_out, qkv, out, lse, valid_lens, num_heads, dropout_p, seed):
    """Exact: recomputes the softmax from the scores (the LSE is only the kernels' shortcut)."""
    head_dim = _check_attention_inputs(qkv, valid_lens, num_heads, dropout_p, seed, _CPU_DTYPES)
    _check_bwd_inputs(grad_out, out, lse, qkv, num_heads, head_dim, (qkv.shape[0], num_heads, qkv.shape[1]))
    return _attention_grads_cpu(grad_out, qkv, valid_lens, num_heads, dropout_p, seed)


def _attention_grads_cpu(grad_out, qkv, valid_lens, num_heads, dropout_p, seed):
    """The packed QKV gradient, from the recomputed weights (inputs checked by the caller)."""
    q, k, v = _split_heads_cpu(qkv, num_heads)
    probs, visible, keep, _ = _attention_probs_cpu(q, k, valid_lens, dropout_p, seed, with_lse=False)
    dout = grad_out.to(q.dtype).unflatten(-1, (num_heads, -1)).transpose(1, 2)
    if keep is None:
        dv = probs.transpose(-1, -2) @ dout
    else:
        dv = _drop_cpu_(probs.mul(keep), keep, dropout_p).transpose(-1, -2) @ dout
    dprobs = dout @ v.transpose(-1, -2)
    if keep is not None:
        _drop_cpu_(dprobs, keep, dropout_p)
        del keep
    # dscores = probs * (dprobs - rowsum(probs * dprobs)), in dprobs' memory.
    dscores = dprobs.sub_((probs * dprobs).sum(-1, keepdim=True)).mul_(probs)
    del probs
    if visible is not None:
        dscores.masked_fill_(~visible, 0.0)     # replaced scores are constants
    scale = 1.0 / math.sqrt(q.shape[-1])
    grads = (dscores @ k * scale, dscores.transpose(-1, -2) @ q * scale, dv)
    return torch.cat([_merge_heads_cpu(g) for g in grads], dim=-1).to(qkv.dtype)


def _padded_rows_cpu(cu_seqlens, num_tokens, max_seqlen):
    """Row of each packed token in the (B * max_seqlen) padded layout, without a host sync. A
    token of no sequence (past cu_seqlens[-1]: a static unpadding's filler) gets row
    B * max_seqlen, one past the layout: it is dropped going in and reads zeros coming out, as
    the kernels leave such rows unwritten."""
    tokens = torch.arange(num_tokens, dtype=torch.int32, device=cu_seqlens.device)
    sequence = torch.searchsorted(cu_seqlens[1:], tokens, right=True)
    batch = cu_seqlens.shape[0] - 1
    return torch.where(sequence < batch, sequence * max_seqlen + (tokens - cu_seqlens[sequence]), batch * max_seqlen)


def _padded_cpu(x, rows, batch, max_seqlen):
    """Packed rows -> (B, max_seqlen, .) with zeros elsewhere (filler rows dropped)."""
    padded = x.new_zeros(batch * max_seqlen + 1, x.shape[-1]).index_copy(0, rows, x)
    return padded[:-1].unflatten(0, (batch, max_seqlen))


def _packed_cpu(padded, rows):
    """(B * max_seqlen, .) -> the packed rows, zeros for filler rows."""
    return F.pad(padded, (0, 0, 0, 1))[rows]


def _varlen_attention_fwd_cpu(qkv, cu_seqlens, num_heads, max_seqlen, dropout_p, seed):
    """Through the padded twin: sequence b sees its cu_seqlens[b+1] - cu_seqlens[b] keys."""
    _check_varlen_inputs(qkv, cu_seqlens, num_heads, max_seqlen, dropout_p, seed, _CPU_DTYPES)
    batch = cu_seqlens.shape[0] - 1
    rows = _padded_rows_cpu(cu_seqlens, qkv.shape[0], max_seqlen)
    out, lse = _attention_fwd_cpu(_padded_cpu(qkv, rows, batch, max_seqlen), cu_seqlens.diff(),
                                  num_heads, dropout_p, seed)
    lse = F.pad(lse.transpose(0, 1).flatten(1), (0, 1))[:, rows]        # (heads, N)
    return _packed_cpu(out.flatten(0, 1), rows), lse


def _varlen_attention_bwd_cpu(grad_out, qkv, out, lse, cu_seqlens, num_heads, max_seqlen, dropout_p, seed):
    head_dim = _check_varlen_inputs(qkv, cu_seqlens, num_heads, max_seqlen, dropout_p, seed, _CPU_DTYPES)
    _check_bwd_inputs(grad_out, out, lse, qkv, num_heads, head_dim, (num_heads, qkv.shape[0]))
    batch = cu_seqlens.shape[0] - 1
    rows = _padded_rows_cpu(cu_seqlens, qkv.shape[0], max_seqlen)
    dqkv = _attention_grads_cpu(_padded_cpu(grad_out, rows, batch, max_seqlen),
                                _padded_cpu(qkv, rows, batch, max_seqlen), cu_seqlens.diff(), num_heads, dropout_p, seed)
    return _packed_cpu(dqkv.flatten(0, 1), rows)


# ----------------------------------------------------------------------------------------------
# Registered ops (CUDA: Triton kernels; CPU: the twins) and their autograd
# ----------------------------------------------------------------------------------------------

def _attention_fwd(qkv, valid_lens, num_heads, dropout_p, seed, counts=None, lse=True):
    """The launcher for qkv's device: the Triton kernel, or the CPU twin (explicit math).
    ``lse=False``: the kernel neither allocates nor writes the LSE (the twin makes it anyway)."""
    if cpu_kernel(qkv):
        return _attention_fwd_cpu(qkv, valid_lens, num_heads, dropout_p, seed)
    return _attention_fwd_triton(qkv, valid_lens, num_heads, dropout_p, seed, counts, lse)


def _attention_bwd(grad_out, qkv, out, lse, valid_lens, num_heads, dropout_p, seed, counts=None, check=True):
    if cpu_kernel(qkv):
        return _attention_bwd_cpu(grad_out, qkv, out, lse, valid_lens, num_heads, dropout_p, seed)
    return _attention_bwd_triton(grad_out, qkv, out, lse, valid_lens, num_heads, dropout_p, seed, counts, check)


def _varlen_attention_fwd(qkv, cu_seqlens, num_heads, max_seqlen, dropout_p, seed, filler=True, lse=True):
    """``filler``, ``lse``: see _varlen_attention_fwd_triton (the CPU twin zeroes filler rows
    and makes the LSE either way)."""
    if cpu_kernel(qkv):
        return _varlen_attention_fwd_cpu(qkv, cu_seqlens, num_heads, max_seqlen, dropout_p, seed)
    return _varlen_attention_fwd_triton(qkv, cu_seqlens, num_heads, max_seqlen, dropout_p, seed, filler, lse)


def _varlen_attention_bwd(grad_out, qkv, out, lse, cu_seqlens, num_heads, max_seqlen, dropout_p, seed, filler=True,
                          check=True):
    if cpu_kernel(qkv):
        return _varlen_attention_bwd_cpu(grad_out, qkv, out, lse, cu_seqlens, num_heads, max_seqlen, dropout_p, seed)
    return _varlen_attention_bwd_triton(grad_out, qkv, out, lse, cu_seqlens, num_heads, max_seqlen, dropout_p, seed,
                                        filler, check)


def _attention_fwd_op(qkv: torch.Tensor, valid_lens: torch.Tensor | None, num_heads: int, dropout_p: float,
                      seed: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Self-attention of a packed (B, L, 3H) projection -> (context (B, L, H), fp64 LSE (B, heads, L))."""
    return _attention_fwd(qkv, valid_lens, num_heads, dropout_p, seed)


def _attention_bwd_op(grad_out: torch.Tensor, qkv: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
                      valid_lens: torch.Tensor | None, num_heads: int, dropout_p: float,
                      seed: torch.Tensor | None) -> torch.Tensor:
    """Gradient (B, L, 3H) of the packed projection."""
    return _attention_bwd(grad_out, qkv, out, lse, valid_lens, num_heads, dropout_p, seed)


def _varlen_attention_fwd_op(qkv: torch.Tensor, cu_seqlens: torch.Tensor, num_heads: int, max_seqlen: int,
                             dropout_p: float, seed: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Self-attention within each sequence of packed (N, 3H) tokens -> ((N, H), fp64 LSE (heads, N))."""
    return _varlen_attention_fwd(qkv, cu_seqlens, num_heads, max_seqlen, dropout_p, seed)


def _varlen_attention_bwd_op(grad_out: torch.Tensor, qkv: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
                             cu_seqlens: torch.Tensor, num_heads: int, max_seqlen: int, dropout_p: float,
                             seed: torch.Tensor | None) -> torch.Tensor:
    """Gradient (N, 3H) of the packed valid tokens' projection."""
    return _varlen_attention_bwd(grad_out, qkv, out, lse, cu_seqlens, num_heads, max_seqlen, dropout_p, seed)


def _attention_setup_context(ctx, inputs, output):
    qkv, valid_lens, ctx.num_heads, ctx.dropout_p, seed = inputs
    out, lse = output
    ctx.mark_non_differentiable(lse)
    ctx.save_for_backward(qkv, valid_lens, out, lse, seed)


def _attention_backward(ctx, grad_out, grad_lse):
    qkv, valid_lens, out, lse, seed = ctx.saved_tensors
    dqkv = attention_bwd(grad_out, qkv, out, lse, valid_lens, ctx.num_heads, ctx.dropout_p, seed)
    return dqkv, None, None, None, None


def _varlen_attention_setup_context(ctx, inputs, output):
    qkv, cu_seqlens, ctx.num_heads, ctx.max_seqlen, ctx.dropout_p, seed = inputs
    out, lse = output
    ctx.mark_non_differentiable(lse)
    ctx.save_for_backward(qkv, cu_seqlens, out, lse, seed)


def _varlen_attention_backward(ctx, grad_out, grad_lse):
    qkv, cu_seqlens, out, lse, seed = ctx.saved_tensors
    dqkv = varlen_attention_bwd(grad_out, qkv, out, lse, cu_seqlens, ctx.num_heads, ctx.max_seqlen,
                                ctx.dropout_p, seed)
    return dqkv, None, None, None, None, None


def _register_ops():
    """The registered ops, (varlen_)attention_fwd and (varlen_)attention_bwd (at first use: deferred_ops)."""
    global attention_fwd, attention_bwd, varlen_attention_fwd, varlen_attention_bwd
    attention_fwd = triton_op("bert_fast::attention_fwd", mutates_args=())(_attention_fwd_op)
    attention_bwd = triton_op("bert_fast::attention_bwd", mutates_args=())(_attention_bwd_op)
    varlen_attention_fwd = triton_op("bert_fast::varlen_attention_fwd", mutates_args=())(_varlen_attention_fwd_op)
    varlen_attention_bwd = triton_op("bert_fast::varlen_attention_bwd", mutates_args=())(_varlen_attention_bwd_op)
    attention_fwd.register_autograd(_attention_backward, setup_context=_attention_setup_context)
    varlen_attention_fwd.register_autograd(_varlen_attention_backward, setup_context=_varlen_attention_setup_context)
    forbid_double_backward("bert_fast::attention_bwd", "attention")
    forbid_double_backward("bert_fast::varlen_attention_bwd", "attention (skip_padding)")


__getattr__ = deferred_ops(__name__, _register_ops, "attention_fwd", "attention_bwd", "varlen_attention_fwd",
                           "varlen_attention_bwd")


class _Attention(torch.autograd.Function):
    """The eager attention under autograd: the launchers, no custom-op dispatch. ``lengths``
    is valid_lens (padded form, with its visible-key ``counts`` when made already) or
    cu_seqlens (varlen form, ``max_seqlen`` set; ``filler`` as for _varlen_attention_fwd)."""

    @staticmethod
    def forward(ctx, qkv, lengths, counts, num_heads, max_seqlen, dropout_p, seed, filler=True):
        if max_seqlen is None:
            out, lse = _attention_fwd(qkv, lengths, num_heads, dropout_p, seed, counts)
        else:
            out, lse = _varlen_attention_fwd(qkv, lengths, num_heads, max_seqlen, dropout_p, seed, filler)
        ctx.save_for_backward(qkv, lengths, counts, out, lse, seed)
        ctx.num_heads, ctx.max_seqlen, ctx.dropout_p, ctx.filler = num_heads, max_seqlen, dropout_p, filler
        return out

    @staticmethod
    @once_differentiable("attention", "bert_fast::attention_bwd")
    def backward(ctx, grad_out):
        qkv, lengths, counts, out, lse, seed = ctx.saved_tensors
        if ctx.max_seqlen is None:
            dqkv = _attention_bwd(grad_out, qkv, out, lse, lengths, ctx.num_heads, ctx.dropout_p, seed, counts,
                                  check=False)
        else:
            dqkv = _varlen_attention_bwd(grad_out, qkv, out, lse, lengths, ctx.num_heads, ctx.max_seqlen,
                                         ctx.dropout_p, seed, ctx.filler, check=False)
        return dqkv, None, None, None, None, None, None, None


# ----------------------------------------------------------------------------------------------
# Public functions (what the modules call)
# ----------------------------------------------------------------------------------------------

def _runs_kernel(qkv, dropout_p):
    """Eager triton/cuda backends: the Triton kernels on CUDA. On the CPU with dropout the twin
    (explicit math, the kernels' Philox mask); without dropout the PyTorch path, the same
    function at a fraction of the host time (no LSE, one SDPA call)."""
    return not cpu_kernel(qkv) or dropout_p > 0.0


def packed_self_attention(qkv, num_heads, valid_lens=None, dropout_p=0.0, *, backend="torch"):
    """Self-attention reading Q, K, V straight from a (B, L, 3H) packed projection.

    ``valid_lens``: None, (B,), (B, L), or a KeyMask (prepare_key_mask: what an encoder makes
    once for all its layers).
    """
    if not uses_triton(backend):
        return _packed_sdpa(qkv, num_heads, valid_lens, dropout_p)
    compiling = use_registered_op()
    if not (compiling or _runs_kernel(qkv, dropout_p)):
        return _packed_sdpa(qkv, num_heads, valid_lens, 0.0)
    dropout_p = float(dropout_p)
    seed = dropout_seed(dropout_p, qkv.device)
    if compiling:
        return attention_fwd(qkv, _raw(valid_lens), num_heads, dropout_p, seed)[0]
    counts = valid_lens.counts if isinstance(valid_lens, KeyMask) else None
    valid_lens = _raw(valid_lens)
    if records_grad(qkv):
        return thin_apply(_Attention, qkv, valid_lens, counts, num_heads, None, dropout_p, seed)
    return _attention_fwd(qkv, valid_lens, num_heads, dropout_p, seed, counts, lse=False)[0]


def unpadded_self_attention(qkv, num_heads, unpadding, valid_lens, dropout_p=0.0, *,
                            per_sequence=None, backend="torch"):
    """Self-attention over packed valid tokens: (N, 3H) -> (N, H), for skip_padding.

    Every query of a sequence is valid and sees exactly its sequence's valid keys, so each
    sequence is plain unmasked attention over its own tokens. The triton backend runs that as
    one varlen launch over ``unpadding.cu_seqlens``, bounded by the padded length (``valid_lens``
    is already applied by the unpadding). The torch backend (and the others on the CPU without
    dropout) runs it on the CPU as one SDPA call per sequence (no padding copies, no masked
    work); elsewhere, and for a static unpadding (no host counts), as one call over the
    re-padded (B, L) layout with the key mask, which keeps the launch count independent of B.
    Under torch.compile the unpadding is static (unpadding_for: N is one unbacked SymInt, no
    per-sequence host ints), so it is the re-padded form: no Python branch on a data-dependent
    size, and ``torch.compile(fullgraph=True)`` traces it in one graph.
    ``per_sequence`` forces one or the other (the PyTorch path only).
    """
    if uses_triton(backend):
        dropout_p = float(dropout_p)
        seed = dropout_seed(dropout_p, qkv.device)
        args = (qkv, unpadding.cu_seqlens, num_heads, unpadding.seqlen, dropout_p, seed)
        if use_registered_op():
            return varlen_attention_fwd(*args)[0]
        if _runs_kernel(qkv, dropout_p):
            if records_grad(qkv):
                return thin_apply(_Attention, qkv, unpadding.cu_seqlens, None, num_heads, unpadding.seqlen,
                                  dropout_p, seed, unpadding.static)
            return _varlen_attention_fwd(*args, filler=unpadding.static, lse=False)[0]
    hidden = qkv.shape[-1] // 3
    if per_sequence is None:
        per_sequence = qkv.device.type == "cpu" and not unpadding.static
    if per_sequence and unpadding.static:
        raise ValueError("per_sequence attention needs the per-sequence counts on the host; a static "
                         "unpadding (num_tokens given, or made under torch.compile) has none: use "
                         "per_sequence=None or False")
    if not per_sequence:
        context = packed_self_attention(pad(qkv, unpadding), num_heads, valid_lens, dropout_p)
        return unpad(context, unpadding)
    outputs = []
    for chunk in qkv.split(unpadding.seqlens):
        if chunk.shape[0] == 0:
            continue
        # 4-D (1, heads, n, d): 3-D inputs would miss SDPA's fused CPU kernel.
        q, k, v = (x.unflatten(-1, (num_heads, -1)).transpose(0, 1)[None] for x in chunk.chunk(3, dim=-1))
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=_unmasked(q, k.shape[2]), dropout_p=dropout_p)
        outputs.append(out[0].transpose(0, 1).reshape(-1, hidden))
    # No valid token: an empty context still cut from qkv, so the projection's weights get zero
    # gradients, not None (as on the other backends: DDP and FSDP expect every rank's the same).
    return torch.cat(outputs) if outputs else qkv[:, :hidden].clone()
