"""Peers: other people's fast BERT encoders, loaded with a reference encoder's weights.

The benchmark matrix (issue 5) times FastBERTEncoder against what a PyTorch user could use
instead. Each function here takes a reference-style ``BERTEncoder`` (``bert_fast.reference``;
a FastBERTEncoder has the same parameters and works too) and returns an nn.Module with
``forward(tokens, segments, valid_lens) -> (B, L, H)`` computing the same function from a
*copy* of its weights, in the encoder's dtype and device:

- :func:`transformer_encoder_peer`: ``torch.nn.TransformerEncoder`` (PyTorch's fused "fast
  path", with nested tensors for padded batches).
- :func:`hf_bert_peer`: HuggingFace ``transformers.BertModel`` (None without transformers).

What the peers support, and so what comparisons against them may use:

- valid_lens None or 1-D (one length per sequence); 2-D (per-query) lengths raise ValueError.
- Only valid positions are comparable. The reference computes padded query rows like any
  other row; PyTorch's nested-tensor path returns zeros there (HF computes them as the
  reference does, up to rounding). Lengths >= L mask nothing, as in the reference.
- Lengths must be >= 1. A sequence of length 0 has no valid position; there the reference
  (its -1e6 mask value) attends uniformly to all L keys, the nested path returns zeros and
  HF returns other finite values.
"""

import copy

import torch
from torch import nn

from .convert import _activation_of


def valid_position_mask(valid_lens, tokens):
    """(B, L) bool for (B, L) ``tokens``: True where position j < valid_lens[b], compared in
    float32 as the reference does (float lengths work). ValueError unless valid_lens is (B,)."""
    batch, seqlen = tokens.shape
    if valid_lens.dim() != 1 or valid_lens.shape[0] != batch:
        raise ValueError(f"the peers take valid_lens of shape (batch,) = ({batch},), got shape "
                         f"{tuple(valid_lens.shape)} (per-query 2-D lengths are not supported)")
    positions = torch.arange(seqlen, dtype=torch.float32, device=valid_lens.device)
    return positions[None, :] < valid_lens.to(torch.float32)[:, None]


def _ffn_activation(ffn):
    """The FFN's activation by name: "relu", "gelu" (erf) or "gelu_tanh"; ValueError otherwise."""
    if isinstance(getattr(ffn, "activation", None), str):  # FastPositionWiseFFN
        return ffn.activation
    return _activation_of(getattr(ffn, "relu", None))  # the reference keeps it as ffn.relu


def _encoder_shape(encoder):
    """The sizes both peers need, after checking the encoder is one they can express."""
    blk = encoder.blks[0]
    attn = blk.attention
    H = encoder.token_embedding.embedding_dim
    for name in ("W_q", "W_k", "W_v"):
        if getattr(attn, name).in_features != H:
            raise ValueError(f"the peers need query/key/value sizes equal to num_hiddens {H}; "
                             f"{name} takes {getattr(attn, name).in_features}")
    dropouts = {p for b in encoder.blks for p in
                (b.attention.attention.dropout.p, b.addnorm1.dropout.p, b.addnorm2.dropout.p)}
    if len(dropouts) != 1:
        raise ValueError(f"the peers need one dropout rate everywhere, got {sorted(dropouts)}")
    eps = blk.addnorm1.ln.eps
    if any(b.addnorm1.ln.eps != eps or b.addnorm2.ln.eps != eps for b in encoder.blks):
        raise ValueError("the peers need one LayerNorm eps for every norm")
    return dict(num_hiddens=H, num_heads=attn.num_heads, num_layers=len(encoder.blks),
                ffn_num_hiddens=blk.ffn.dense1.out_features, dropout=dropouts.pop(), eps=eps,
                activation=_ffn_activation(blk.ffn), max_len=encoder.pos_embedding.shape[1],
                vocab_size=encoder.token_embedding.num_embeddings)


@torch.no_grad()
def _copy_linear(dst, src):
    """dst <- src (weight, and bias or zeros where src has none)."""
    dst.weight.copy_(src.weight)
    if src.bias is None:
        dst.bias.zero_()
    else:
        dst.bias.copy_(src.bias)


@torch.no_grad()
def _copy_layernorm(dst, src):
    dst.weight.copy_(src.weight)
    dst.bias.copy_(src.bias)


def _dtype_device(encoder):
    weight = encoder.token_embedding.weight
    return dict(dtype=weight.dtype, device=weight.device)


# ---------------------------------------------------------------------------------------------
# PyTorch: nn.TransformerEncoder


class TransformerEncoderPeer(nn.Module):
    """The reference's embedding sum, then ``nn.TransformerEncoder`` with a key padding mask.

    When the fused fast path runs (see :func:`transformer_encoder_peer`), a padded batch is
    packed into a nested tensor and padded output positions are zeros.
    """

    def __init__(self, token_embedding, segment_embedding, pos_embedding, encoder):
        super().__init__()
        self.token_embedding = token_embedding
        self.segment_embedding = segment_embedding
        self.pos_embedding = pos_embedding
        self.encoder = encoder

    def forward(self, tokens, segments, valid_lens=None):
        X = self.token_embedding(tokens) + self.segment_embedding(segments)
        # Detached like the reference's .data read: no gradient reaches the position table.
        X = X + self.pos_embedding.detach()[:, :tokens.shape[1], :]
        pad_mask = None if valid_lens is None else ~valid_position_mask(valid_lens, tokens)
        return self.encoder(X, src_key_padding_mask=pad_mask)


def transformer_encoder_peer(encoder):
    """``nn.TransformerEncoder`` with ``encoder``'s weights (copied), as a TransformerEncoderPeer.

    Layer i: ``in_proj = cat(W_q, W_k, W_v)``, ``out_proj = W_o``, ``linear1/linear2 =
    ffn.dense1/dense2``, ``norm1/norm2 = addnorm1.ln/addnorm2.ln``; post-norm, batch_first,
    the reference's activation and dropout. The result has the encoder's dtype, device and
    train/eval mode.

    PyTorch (2.x, torch/nn/modules/transformer.py) takes its fused path,
    ``torch._transformer_encoder_layer_fwd`` per layer, only when all of these hold:

    - by construction here: batch_first, norm_first False, in_proj with bias, one embed
      dim for q/k/v, ReLU or erf GELU, norm1.eps == norm2.eps;
    - an even num_heads (an odd one also turns nested tensors off, with a warning at build);
    - at call time: eval mode, and no gradient wanted (``torch.inference_mode()`` or
      ``torch.no_grad()``, or parameters with requires_grad False), no autocast, no hooks,
      ``torch.backends.mha.get_fastpath_enabled()``.
    When they hold and valid_lens is given (a key padding mask), the encoder also packs the
    batch into a nested tensor, skipping padded tokens, and pads the output back with zeros;
    with valid_lens None the fused layers run on the dense batch. When they fail (training,
    gradients wanted), PyTorch's per-op path runs and padded rows hold real values.
    Nothing in these conditions depends on the dtype (fp32, fp16 and bf16 all qualify).
    """
    shape = _encoder_shape(encoder)
    if shape["activation"] not in ("relu", "gelu"):
        raise ValueError(f"nn.TransformerEncoder's fast path supports relu and gelu (erf) only, "
                         f"not {shape['activation']!r}")
    layer = nn.TransformerEncoderLayer(
        d_model=shape["num_hiddens"], nhead=shape["num_heads"],
        dim_feedforward=shape["ffn_num_hiddens"], dropout=shape["dropout"],
        activation=shape["activation"], layer_norm_eps=shape["eps"], batch_first=True,
        norm_first=False, bias=True)
    # mask_check=False: our padding masks are left-aligned by construction, and checking that
    # costs a device-to-host sync per forward.
    stack = nn.TransformerEncoder(layer, num_layers=shape["num_layers"],
                                  enable_nested_tensor=True, mask_check=False)
    with torch.no_grad():
        for ours, blk in zip(stack.layers, encoder.blks):
            attn = blk.attention
            ours.self_attn.in_proj_weight.copy_(
                torch.cat([attn.W_q.weight, attn.W_k.weight, attn.W_v.weight]))
            if attn.W_q.bias is None:
                ours.self_attn.in_proj_bias.zero_()
            else:
                ours.self_attn.in_proj_bias.copy_(
                    torch.cat([attn.W_q.bias, attn.W_k.bias, attn.W_v.bias]))
            _copy_linear(ours.self_attn.out_proj, attn.W_o)
            _copy_linear(ours.linear1, blk.ffn.dense1)
            _copy_linear(ours.linear2, blk.ffn.dense2)
            _copy_layernorm(ours.norm1, blk.addnorm1.ln)
            _copy_layernorm(ours.norm2, blk.addnorm2.ln)
    peer = TransformerEncoderPeer(copy.deepcopy(encoder.token_embedding),
                                  copy.deepcopy(encoder.segment_embedding),
                                  nn.Parameter(encoder.pos_embedding.detach().clone()), stack)
    return peer.to(**_dtype_device(encoder)).train(encoder.training)


# ---------------------------------------------------------------------------------------------
# HuggingFace: transformers.BertModel

_HF_ACTIVATIONS = {"relu": "relu", "gelu": "gelu", "gelu_tanh": "gelu_pytorch_tanh"}


def _import_transformers():
    """(transformers module, None) or (None, why it cannot be imported)."""
    try:
        import transformers
    except Exception as error:  # ImportError, or a broken install raising something else
        return None, f"transformers is not importable: {type(error).__name__}: {error}"
    return transformers, None


def hf_unavailable_reason():
    """Why :func:`hf_bert_peer` returns None, or None when it works."""
    return _import_transformers()[1]


class HFBertPeer(nn.Module):
    """``transformers.BertModel`` behind the reference's forward signature."""

    def __init__(self, bert):
        super().__init__()
        self.bert = bert

    def forward(self, tokens, segments, valid_lens=None):
        attention_mask = None
        if valid_lens is not None:
            attention_mask = valid_position_mask(valid_lens, tokens).to(torch.long)
        return self.bert(input_ids=tokens, token_type_ids=segments,
                         attention_mask=attention_mask).last_hidden_state


def hf_bert_peer(encoder, attn_implementation="sdpa"):
    """HF ``BertModel`` with ``encoder``'s weights (copied), or None without transformers.

    ``attn_implementation``: "sdpa" (default), "eager", or what the installed transformers
    accepts. The HF model has the encoder's dtype, device and train/eval mode.
    """
    transformers, _ = _import_transformers()
    if transformers is None:
        return None
    shape = _encoder_shape(encoder)
    config = transformers.BertConfig(
        vocab_size=shape["vocab_size"], hidden_size=shape["num_hiddens"],
        num_hidden_layers=shape["num_layers"], num_attention_heads=shape["num_heads"],
        intermediate_size=shape["ffn_num_hiddens"], hidden_act=_HF_ACTIVATIONS[shape["activation"]],
        max_position_embeddings=shape["max_len"], type_vocab_size=2,
        layer_norm_eps=shape["eps"], hidden_dropout_prob=shape["dropout"],
        attention_probs_dropout_prob=shape["dropout"],
        # No padding_idx: HF would withhold gradient from token 0's row, the reference does not.
        pad_token_id=None, attn_implementation=attn_implementation)
    bert = transformers.BertModel(config, add_pooling_layer=False)
    # The reference adds the three embeddings and feeds the sum straight to the first block:
    # no LayerNorm and no dropout after the embedding sum, unlike BERT.
    bert.embeddings.LayerNorm = nn.Identity()
    bert.embeddings.dropout = nn.Identity()
    with torch.no_grad():
        bert.embeddings.word_embeddings.weight.copy_(encoder.token_embedding.weight)
        bert.embeddings.token_type_embeddings.weight.copy_(encoder.segment_embedding.weight)
        bert.embeddings.position_embeddings.weight.copy_(encoder.pos_embedding[0])
    # As in the reference (its .data read), no gradient reaches the position table.
    bert.embeddings.position_embeddings.weight.requires_grad_(False)
    for layer, blk in zip(bert.encoder.layer, encoder.blks):
        attn = blk.attention
        _copy_linear(layer.attention.self.query, attn.W_q)
        _copy_linear(layer.attention.self.key, attn.W_k)
        _copy_linear(layer.attention.self.value, attn.W_v)
        _copy_linear(layer.attention.output.dense, attn.W_o)
        _copy_layernorm(layer.attention.output.LayerNorm, blk.addnorm1.ln)
        _copy_linear(layer.intermediate.dense, blk.ffn.dense1)
        _copy_linear(layer.output.dense, blk.ffn.dense2)
        _copy_layernorm(layer.output.LayerNorm, blk.addnorm2.ln)
    return HFBertPeer(bert).to(**_dtype_device(encoder)).train(encoder.training)
