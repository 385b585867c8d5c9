"""attention: multi-head scaled dot-product attention with the reference's valid_lens rule.

Torch path: PyTorch SDPA with a boolean key mask. The reference *replaces* masked scores with
-1e6, which a boolean mask reproduces exactly (exp(-1e6 - max) is 0 in every float type)
except for one case: a query row that sees no key at all (valid_len <= 0). There the
reference softmaxes L equal scores and returns the uniform average of all L values; with
a boolean mask that row would be NaN. We get the reference's answer, and its gradients, by
unmasking every key for such rows and zeroing their query: all scores become exactly 0,
the softmax is exactly uniform, and no gradient flows to Q or K from that row — as in the
reference, where the -1e6 constants cut those paths too.
"""

import torch
from torch.nn import functional as F

from .padding import pad, unpad


def key_mask(valid_lens, num_queries, num_keys, device):
    """Boolean mask (True = attend) for SDPA, and the 0/1 factor for queries that see no key.

    Returns ``(mask, query_keep)`` broadcastable to (B, heads, Lq, Lk) and (B, heads, Lq, d).
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


def attention(queries, keys, values, num_heads, valid_lens=None, dropout_p=0.0):
    """(B, Lq, H), (B, Lk, H), (B, Lk, H) -> (B, Lq, H), heads split and merged as the reference.

    Inputs may be strided views (e.g. the three thirds of a packed QKV projection).
    ``dropout_p`` acts on the attention weights; pass 0 in eval mode.
    """
    batch, num_queries, hidden = queries.shape
    head_dim = hidden // num_heads

    def split_heads(x):
        return x.unflatten(-1, (num_heads, head_dim)).transpose(1, 2)   # (B, heads, L, d)

    q, k, v = split_heads(queries), split_heads(keys), split_heads(values)
    mask = None
    if valid_lens is not None:
        mask, query_keep = key_mask(valid_lens, num_queries, k.shape[2], q.device)
        q = q * query_keep.to(q.dtype)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p)
    return out.transpose(1, 2).reshape(batch, num_queries, hidden)


def packed_self_attention(qkv, num_heads, valid_lens=None, dropout_p=0.0):
    """Self-attention reading Q, K, V straight from a (B, L, 3H) packed projection."""
    q, k, v = qkv.chunk(3, dim=-1)
    return attention(q, k, v, num_heads, valid_lens, dropout_p)


def unpadded_self_attention(qkv, num_heads, unpadding, valid_lens, dropout_p=0.0, *,
                            per_sequence=None):
    """Self-attention over packed valid tokens: (N, 3H) -> (N, H), for skip_padding.

    Every query of a sequence is valid and sees exactly its sequence's valid keys, so each
    sequence is plain unmasked attention over its own tokens. On the CPU we run it that way,
    one SDPA call per sequence (no padding copies, no masked work). Elsewhere one call over
    the re-padded (B, L) layout with the key mask keeps the launch count independent of B.
    ``per_sequence`` forces one or the other.
    """
    hidden = qkv.shape[-1] // 3
    if per_sequence is None:
        per_sequence = qkv.device.type == "cpu"
    if not per_sequence:
        context = packed_self_attention(pad(qkv, unpadding), num_heads, valid_lens, dropout_p)
        return unpad(context, unpadding)
    outputs = []
    for chunk in qkv.split(unpadding.seqlens):
        if chunk.shape[0] == 0:
            continue
        # 4-D (1, heads, n, d): 3-D inputs would miss SDPA's fused CPU kernel.
        q, k, v = (x.unflatten(-1, (num_heads, -1)).transpose(0, 1)[None] for x in chunk.chunk(3, dim=-1))
        out = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p)
        outputs.append(out[0].transpose(0, 1).reshape(-1, hidden))
    return torch.cat(outputs) if outputs else qkv.new_empty(0, hidden)
