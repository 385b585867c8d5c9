"""Drop-in fast modules. Same constructor arguments, attribute names and state_dict keys as
the reference (``bert_fast.reference``), so ``load_state_dict(strict=True)`` works both ways
and ``optimize()`` can hand them the original submodules. The modules only hold parameters
and call ops; the data path is: tokens -> embedding_sum -> blocks (attention, add_layernorm,
linear_act, add_layernorm) -> output.
"""

import torch
from torch import nn
from torch.nn import functional as F

from . import ops
from .backend import backend_for, resolve_backend
from .checks import check_encoder_inputs
from .reference import AddNorm, BERTModel, MaskLM, NextSentencePred


def _normalized_size(norm_shape, num_hiddens):
    shape = (norm_shape,) if isinstance(norm_shape, int) else tuple(norm_shape)
    if shape != (num_hiddens,):
        raise ValueError(f"norm_shape must be [num_hiddens] = [{num_hiddens}] (LayerNorm over the "
                         f"hidden features), got {list(shape)}; other shapes are not supported")
    return shape


class FastMultiHeadAttention(nn.Module):
    """The reference MultiHeadAttention; self-attention runs one packed QKV GEMM.

    Unlike the reference it does not keep ``attention_weights`` (never materialised).
    """

    def __init__(self, key_size, query_size, value_size, num_hiddens, num_heads, dropout,
                 bias=False, *, backend=None, **kwargs):
        super().__init__(**kwargs)
        if num_hiddens % num_heads != 0:
            raise ValueError(f"num_hiddens ({num_hiddens}) must be divisible by num_heads ({num_heads})")
        self.num_heads = num_heads
        self.backend = resolve_backend(backend)
        self.dropout = nn.Dropout(dropout)
        self.W_q = nn.Linear(query_size, num_hiddens, bias=bias)
        self.W_k = nn.Linear(key_size, num_hiddens, bias=bias)
        self.W_v = nn.Linear(value_size, num_hiddens, bias=bias)
        self.W_o = nn.Linear(num_hiddens, num_hiddens, bias=bias)

    def _packed_qkv(self):
        """(3H, in) weight and (3H,) bias of the packed projection.

        Concatenated per call (gradients reach W_q/W_k/W_v through the concatenation), except
        when autograd does not record them (no_grad, inference mode, frozen weights) after
        ``pack_qkv_()``: then the three lie back to back in memory and the packed weight is a
        view of them, so no copy at all. Never cached: a cache keyed on tensor identity and
        version counters goes stale under wrappers that swap parameter storage (FSDP); a view
        of the live memory cannot.
        """
        projections = (self.W_q, self.W_k, self.W_v)
        packed = []
        for tensors in ([p.weight for p in projections], [p.bias for p in projections]):
            if tensors[0] is None:
                packed.append(None)
                continue
            view = None
            recorded = torch.is_grad_enabled() and any(t.requires_grad for t in tensors)
            if not recorded and not torch.compiler.is_compiling():
                view = _back_to_back_view(tensors)
            packed.append(torch.cat(tensors) if view is None else view)
        return tuple(packed)

    @torch.no_grad()
    def pack_qkv_(self):
        """Store W_q, W_k and W_v (weights, and biases) back to back in one buffer, in place, so
        that inference (no autograd) reads the packed projection without concatenating it on
        every call: 6 H^2 bytes of copies (bf16) and two launches saved per layer and call, which
        matters at small batches and under CUDA graphs.

        The Parameters stay the same objects (their ``.data`` is moved; optimizers and
        ``optimize()``'s sharing are kept); state_dict keys and values are unchanged. Moving or
        casting the module afterwards (``.to``, ``.half``) undoes the packing (results stay
        correct; call again). The three then share one storage: ``torch.save`` keeps that,
        while ``safetensors.torch.save_file`` refuses shared tensors (use ``save_model``).
        Returns self.
        """
        for name in ("weight", "bias"):
            params = [getattr(p, name) for p in (self.W_q, self.W_k, self.W_v)]
            if params[0] is None or params[0].is_meta or _back_to_back_view(params) is not None:
                continue
            if len({(p.dtype, p.device, p.shape[1:]) for p in params}) != 1:
                continue       # cannot share one buffer; the per-call concatenation stays
            buffer = torch.cat([p.detach() for p in params])
            for param, part in zip(params, buffer.split([p.shape[0] for p in params])):
                param.data = part
        return self

    def forward(self, queries, keys, values, valid_lens=None, *, unpadding=None):
        """As the reference. With ``unpadding`` (skip_padding), ``queries`` is the (N, H)
        packed valid tokens of a self-attention and ``unpadding`` says where they sit."""
        dropout_p = self.dropout.p if self.training else 0.0
        backend = backend_for(self.backend, queries.device)
        if unpadding is not None:
            qkv = F.linear(queries, *self._packed_qkv())
            context = ops.unpadded_self_attention(qkv, self.num_heads, unpadding, valid_lens,
                                                  dropout_p, backend=backend)
        elif queries is keys and keys is values:
            qkv = F.linear(queries, *self._packed_qkv())
            context = ops.packed_self_attention(qkv, self.num_heads, valid_lens, dropout_p,
                                                backend=backend)
        else:
            context = ops.multi_head_attention(self.W_q(queries), self.W_k(keys), self.W_v(values),
                                    self.num_heads, valid_lens, dropout_p)
        return self.W_o(context)


def _back_to_back_view(tensors):
    """The concatenation of ``tensors`` along dim 0 as a view (no copy) when they are plain
    contiguous tensors lying back to back in one storage, else None.

    Runs on every inference forward of every layer, packed or not: the address test that
    rejects separate allocations comes first, and the rest costs a few microseconds of host
    time (call it only where autograd records nothing: the view is made without detach)."""
    first = tensors[0]
    if any(type(t) not in (torch.Tensor, nn.Parameter) for t in tensors):
        return None     # tensor subclasses (DTensor, FSDP's) have no storage of their own to view
    end = first.data_ptr()
    for t in tensors:
        if t.data_ptr() != end:
            return None
        end += t.numel() * t.element_size()
    dtype, device, row_shape = first.dtype, first.device, first.shape[1:]
    # Adjacent addresses may still be two allocations side by side: one storage, or no view.
    storage = first.untyped_storage().data_ptr()
    for t in tensors:
        if (t.dtype != dtype or t.device != device or not t.is_contiguous() or t.shape[1:] != row_shape
                or t.untyped_storage().data_ptr() != storage):
            return None
    rows = sum(t.shape[0] for t in tensors)
    return first.as_strided((rows, *row_shape), first.stride(), first.storage_offset())


class FastAddNorm(AddNorm):
    """``LayerNorm(X + dropout(Y))``: the reference's module, forward through the op."""

    def __init__(self, normalized_shape, dropout, *, backend=None, **kwargs):
        super().__init__(normalized_shape, dropout, **kwargs)
        self.backend = resolve_backend(backend)

    def forward(self, X, Y):
        return ops.add_layernorm(Y, X, self.ln.weight, self.ln.bias, self.ln.eps,
                                 self.dropout.p, self.training,
                                 backend=backend_for(self.backend, X.device))


class FastPositionWiseFFN(nn.Module):
    def __init__(self, ffn_num_input, ffn_num_hiddens, ffn_num_outputs, *, activation="relu",
                 backend=None, **kwargs):
        super().__init__(**kwargs)
        self.backend = resolve_backend(backend)
        if activation not in ops.ACTIVATIONS:
            raise ValueError(f"activation must be one of {ops.ACTIVATIONS}, got {activation!r}")
        self.activation = activation
        self.dense1 = nn.Linear(ffn_num_input, ffn_num_hiddens)
        self.dense2 = nn.Linear(ffn_num_hiddens, ffn_num_outputs)

    def forward(self, X):
        hidden = ops.linear_act(X, self.dense1.weight, self.dense1.bias, self.activation,
                                backend=backend_for(self.backend, X.device))
        return self.dense2(hidden)


class FastEncoderBlock(nn.Module):
    """The reference EncoderBlock (post-norm), fast path.

    ``forward(X, valid_lens)`` as the reference. Inside FastBERTEncoder with skip_padding,
    X is the (N, H) packed valid tokens and ``unpadding`` says where they sit in (B, L).
    """

    def __init__(self, key_size, query_size, value_size, num_hiddens, norm_shape, ffn_num_input,
                 ffn_num_hiddens, num_heads, dropout, use_bias=False, *, activation="relu",
                 backend=None, **kwargs):
        super().__init__(**kwargs)
        norm_shape = _normalized_size(norm_shape, num_hiddens)
        for name, size in (("query_size", query_size), ("key_size", key_size),
                           ("value_size", value_size), ("ffn_num_input", ffn_num_input)):
            if size != num_hiddens:
                raise ValueError(f"{name} ({size}) must equal num_hiddens ({num_hiddens}): the block "
                                 f"feeds its hidden state to that layer")
        self.attention = FastMultiHeadAttention(key_size, query_size, value_size, num_hiddens,
                                                num_heads, dropout, use_bias, backend=backend)
        self.addnorm1 = FastAddNorm(norm_shape, dropout, backend=backend)
        self.ffn = FastPositionWiseFFN(ffn_num_input, ffn_num_hiddens, num_hiddens,
                                       activation=activation, backend=backend)
        self.addnorm2 = FastAddNorm(norm_shape, dropout, backend=backend)

    def forward(self, X, valid_lens=None, *, unpadding=None):
        Y = self.addnorm1(X, self.attention(X, X, X, valid_lens, unpadding=unpadding))
        return self.addnorm2(Y, self.ffn(Y))


class FastBERTEncoder(nn.Module):
    """Drop-in for the reference BERTEncoder.

    Keyword-only options:
      activation: "relu" (the reference), "gelu" (erf, original BERT) or "gelu_tanh".
      learn_pos_embedding: False keeps the reference's quirk (no gradient reaches
        pos_embedding); True makes the position table learnable.
      skip_padding: compute valid tokens only (1-D valid_lens).
        Valid positions match the exact mode; padded positions of the output are zeros
        (the exact mode computes real values there).
      backend: "auto" (default: triton for CUDA inputs, else torch), "torch" or "triton"
        (see bert_fast.backend).
      check_inputs: validate ids, lengths, shapes and devices (one host sync); set False
        (or flip the attribute) in a production loop that already guarantees them.
    """

    def __init__(self, vocab_size, num_hiddens, norm_shape, ffn_num_input, ffn_num_hiddens,
                 num_heads, num_layers, dropout, max_len=1000, key_size=768, query_size=768,
                 value_size=768, *, activation="relu", learn_pos_embedding=False,
                 skip_padding=False, backend=None, check_inputs=True, **kwargs):
        super().__init__(**kwargs)
        self.backend = resolve_backend(backend)
        self.learn_pos_embedding = learn_pos_embedding
        self.skip_padding = skip_padding
        self.check_inputs = check_inputs
        self.token_embedding = nn.Embedding(vocab_size, num_hiddens)
        self.segment_embedding = nn.Embedding(2, num_hiddens)
        self.blks = nn.Sequential()
        for i in range(num_layers):
            self.blks.add_module(f"{i}", FastEncoderBlock(
                key_size, query_size, value_size, num_hiddens, norm_shape, ffn_num_input,
                ffn_num_hiddens, num_heads, dropout, True, activation=activation,
                backend=self.backend))
        self.pos_embedding = nn.Parameter(torch.randn(1, max_len, num_hiddens))

    def pack_qkv_(self):
        """FastMultiHeadAttention.pack_qkv_() for every block (for inference); returns self."""
        for blk in self.blks:
            blk.attention.pack_qkv_()
        return self

    def validate_inputs(self, tokens, segments, valid_lens=None):
        """What forward checks when check_inputs is True (bert_fast.checks: one host sync)."""
        check_encoder_inputs(tokens, segments, valid_lens, vocab_size=self.token_embedding.num_embeddings,
                             max_len=self.pos_embedding.shape[1], device=self.pos_embedding.device,
                             skip_padding=self.skip_padding)

    def forward(self, tokens, segments, valid_lens=None):
        if self.check_inputs:
            self.validate_inputs(tokens, segments, valid_lens)
        embed = dict(token_weight=self.token_embedding.weight,
                     segment_weight=self.segment_embedding.weight,
                     pos_weight=self.pos_embedding, learn_pos_embedding=self.learn_pos_embedding,
                     backend=backend_for(self.backend, tokens.device))
        if not (self.skip_padding and valid_lens is not None):
            X = ops.embedding_sum(tokens, segments, **embed)
            for blk in self.blks:
                X = blk(X, valid_lens)
            return X
        if valid_lens.dim() != 1:
            raise ValueError("skip_padding=True needs 1-D valid_lens of shape (batch,)")
        unpadding = ops.unpadding_for(valid_lens, tokens.shape[1])
        X = ops.embedding_sum(ops.unpad(tokens, unpadding), ops.unpad(segments, unpadding),
                              positions=unpadding.indices % tokens.shape[1], **embed)
        for blk in self.blks:
            X = blk(X, valid_lens, unpadding=unpadding)
        return ops.pad(X, unpadding)


class FastBERTModel(BERTModel):
    """Drop-in for the reference BERTModel: FastBERTEncoder plus the reference's heads.

    Takes FastBERTEncoder's keyword-only options. The forward pass is the reference's.
    """

    def __init__(self, vocab_size, num_hiddens, norm_shape, ffn_num_input, ffn_num_hiddens,
                 num_heads, num_layers, dropout, max_len=1000, key_size=768, query_size=768,
                 value_size=768, hid_in_features=768, mlm_in_features=768,
                 nsp_in_features=768, **options):
        # Not BERTModel.__init__: it would allocate a reference encoder only to replace it.
        nn.Module.__init__(self)
        self.encoder = FastBERTEncoder(vocab_size, num_hiddens, norm_shape, ffn_num_input,
                                       ffn_num_hiddens, num_heads, num_layers, dropout,
                                       max_len=max_len, key_size=key_size, query_size=query_size,
                                       value_size=value_size, **options)
        self.hidden = nn.Sequential(nn.Linear(hid_in_features, num_hiddens), nn.Tanh())
        self.mlm = MaskLM(vocab_size, num_hiddens, mlm_in_features)
        self.nsp = NextSentencePred(nsp_in_features)
