"""Eager reference: the BERT encoder of "Dive into Deep Learning", re-implemented.

This module follows ``docs/REFERENCE.md`` call for call (same constructor signatures,
same state_dict keys, same outputs). It is deliberately plain PyTorch: every fast path in
bert_fast is tested against it, so it must stay obviously correct rather than fast.
"""

import math

import torch
from torch import nn
from torch.nn import functional as F

# The value masked attention scores are *replaced* with (not added to). A row whose keys are
# all masked therefore becomes uniform over all L keys, which the fast paths must reproduce.
MASK_VALUE = -1e6


def sequence_mask(X, valid_len, value=0.0):
    """Set ``X[i, j] = value`` where ``float(j) >= valid_len[i]`` (in place, returns X).

    A value X's dtype cannot hold (the -1e6 fill in fp16) is stored as what casting it gives
    (-inf), as every torch before 2.15 stored it: 2.15's scalar fills refuse such a value with
    "cannot be converted ... without overflow", which would make the book's code raise in fp16."""
    maxlen = X.size(1)
    mask = torch.arange(maxlen, dtype=torch.float32, device=X.device)[None, :] < valid_len[:, None]
    if X.is_floating_point() and abs(value) > torch.finfo(X.dtype).max:
        value = torch.tensor(value).to(X.dtype).item()
    X[~mask] = value
    return X


def masked_softmax(X, valid_lens):
    """Softmax over the last axis of (N, Lq, Lk) scores, keys masked by ``valid_lens``.

    ``valid_lens`` is None, (N,) — one length per batch row — or (N, Lq) — one per query.
    """
    if valid_lens is None:
        return F.softmax(X, dim=-1)
    shape = X.shape
    if valid_lens.dim() == 1:
        valid_lens = torch.repeat_interleave(valid_lens, shape[1])
    else:
        valid_lens = valid_lens.reshape(-1)
    X = sequence_mask(X.reshape(-1, shape[-1]), valid_lens, value=MASK_VALUE)
    return F.softmax(X.reshape(shape), dim=-1)


class DotProductAttention(nn.Module):
    """Scaled dot-product attention with masked softmax and dropout on the weights."""

    def __init__(self, dropout, **kwargs):
        super().__init__(**kwargs)
        self.dropout = nn.Dropout(dropout)

    def forward(self, queries, keys, values, valid_lens=None):
        d = queries.shape[-1]
        scores = torch.bmm(queries, keys.transpose(1, 2)) / math.sqrt(d)
        self.attention_weights = masked_softmax(scores, valid_lens)
        return torch.bmm(self.dropout(self.attention_weights), values)


def transpose_qkv(X, num_heads):
    """(B, L, H) -> (B * num_heads, L, H / num_heads); head h takes features h*d:(h+1)*d."""
    X = X.reshape(X.shape[0], X.shape[1], num_heads, -1)
    X = X.permute(0, 2, 1, 3)
    return X.reshape(-1, X.shape[2], X.shape[3])


def transpose_output(X, num_heads):
    """Inverse of :func:`transpose_qkv`."""
    X = X.reshape(-1, num_heads, X.shape[1], X.shape[2])
    X = X.permute(0, 2, 1, 3)
    return X.reshape(X.shape[0], X.shape[1], -1)


class MultiHeadAttention(nn.Module):
    def __init__(self, key_size, query_size, value_size, num_hiddens, num_heads, dropout,
                 bias=False, **kwargs):
        super().__init__(**kwargs)
        self.num_heads = num_heads
        self.attention = DotProductAttention(dropout)
        self.W_q = nn.Linear(query_size, num_hiddens, bias=bias)
        self.W_k = nn.Linear(key_size, num_hiddens, bias=bias)
        self.W_v = nn.Linear(value_size, num_hiddens, bias=bias)
        self.W_o = nn.Linear(num_hiddens, num_hiddens, bias=bias)

    def forward(self, queries, keys, values, valid_lens):
        queries = transpose_qkv(self.W_q(queries), self.num_heads)
        keys = transpose_qkv(self.W_k(keys), self.num_heads)
        values = transpose_qkv(self.W_v(values), self.num_heads)
        if valid_lens is not None:
            # Row b*num_heads + h of the head-major batch belongs to sequence b.
            valid_lens = torch.repeat_interleave(valid_lens, repeats=self.num_heads, dim=0)
        output = self.attention(queries, keys, values, valid_lens)
        return self.W_o(transpose_output(output, self.num_heads))


class AddNorm(nn.Module):
    """Post-norm residual: ``LayerNorm(X + dropout(Y))``."""

    def __init__(self, normalized_shape, dropout, **kwargs):
        super().__init__(**kwargs)
        self.dropout = nn.Dropout(dropout)
        self.ln = nn.LayerNorm(normalized_shape)

    def forward(self, X, Y):
        return self.ln(self.dropout(Y) + X)


class PositionWiseFFN(nn.Module):
    def __init__(self, ffn_num_input, ffn_num_hiddens, ffn_num_outputs, **kwargs):
        super().__init__(**kwargs)
        self.dense1 = nn.Linear(ffn_num_input, ffn_num_hiddens)
        self.relu = nn.ReLU()
        self.dense2 = nn.Linear(ffn_num_hiddens, ffn_num_outputs)

    def forward(self, X):
        return self.dense2(self.relu(self.dense1(X)))


class EncoderBlock(nn.Module):
    def __init__(self, key_size, query_size, value_size, num_hiddens, norm_shape,
                 ffn_num_input, ffn_num_hiddens, num_heads, dropout, use_bias=False, **kwargs):
        super().__init__(**kwargs)
        self.attention = MultiHeadAttention(key_size, query_size, value_size, num_hiddens,
                                            num_heads, dropout, use_bias)
        self.addnorm1 = AddNorm(norm_shape, dropout)
        self.ffn = PositionWiseFFN(ffn_num_input, ffn_num_hiddens, num_hiddens)
        self.addnorm2 = AddNorm(norm_shape, dropout)

    def forward(self, X, valid_lens):
        Y = self.addnorm1(X, self.attention(X, X, X, valid_lens))
        return self.addnorm2(Y, self.ffn(Y))


class BERTEncoder(nn.Module):
    def __init__(self, vocab_size, num_hiddens, norm_shape, ffn_num_input, ffn_num_hiddens,
                 num_heads, num_layers, dropout, max_len=1000, key_size=768, query_size=768,
                 value_size=768, **kwargs):
        super().__init__(**kwargs)
        self.token_embedding = nn.Embedding(vocab_size, num_hiddens)
        self.segment_embedding = nn.Embedding(2, num_hiddens)
        self.blks = nn.Sequential()
        for i in range(num_layers):
            self.blks.add_module(f"{i}", EncoderBlock(
                key_size, query_size, value_size, num_hiddens, norm_shape, ffn_num_input,
                ffn_num_hiddens, num_heads, dropout, True))
        self.pos_embedding = nn.Parameter(torch.randn(1, max_len, num_hiddens))

    def forward(self, tokens, segments, valid_lens):
        X = self.token_embedding(tokens) + self.segment_embedding(segments)
        # Read through .data: no gradient reaches pos_embedding (the book's quirk, kept).
        X = X + self.pos_embedding.data[:, :X.shape[1], :]
        for blk in self.blks:
            X = blk(X, valid_lens)
        return X


class MaskLM(nn.Module):
    """Masked-LM head: gather ``X[b, pred_positions[b, k]]``, then an MLP to vocab logits."""

    def __init__(self, vocab_size, num_hiddens, num_inputs=768, **kwargs):
        super().__init__(**kwargs)
        self.mlp = nn.Sequential(nn.Linear(num_inputs, num_hiddens), nn.ReLU(),
                                 nn.LayerNorm(num_hiddens), nn.Linear(num_hiddens, vocab_size))

    def forward(self, X, pred_positions):
        num_pred_positions = pred_positions.shape[1]
        pred_positions = pred_positions.reshape(-1)
        batch_size = X.shape[0]
        # The book builds batch_idx on the CPU; we build it beside X (same values).
        batch_idx = torch.arange(0, batch_size, device=X.device)
        batch_idx = torch.repeat_interleave(batch_idx, num_pred_positions)
        masked_X = X[batch_idx, pred_positions]
        masked_X = masked_X.reshape((batch_size, num_pred_positions, -1))
        return self.mlp(masked_X)


class NextSentencePred(nn.Module):
    def __init__(self, num_inputs, **kwargs):
        super().__init__(**kwargs)
        self.output = nn.Linear(num_inputs, 2)

    def forward(self, X):
        return self.output(X)


class BERTModel(nn.Module):
    def __init__(self, vocab_size, num_hiddens, norm_shape, ffn_num_input, ffn_num_hiddens,
                 num_heads, num_layers, dropout, max_len=1000, key_size=768, query_size=768,
                 value_size=768, hid_in_features=768, mlm_in_features=768,
                 nsp_in_features=768):
        super().__init__()
        self.encoder = BERTEncoder(vocab_size, num_hiddens, norm_shape, ffn_num_input,
                                   ffn_num_hiddens, num_heads, num_layers, dropout,
                                   max_len=max_len, key_size=key_size, query_size=query_size,
                                   value_size=value_size)
        self.hidden = nn.Sequential(nn.Linear(hid_in_features, num_hiddens), nn.Tanh())
        self.mlm = MaskLM(vocab_size, num_hiddens, mlm_in_features)
        self.nsp = NextSentencePred(nsp_in_features)

    def forward(self, tokens, segments, valid_lens=None, pred_positions=None):
        encoded_X = self.encoder(tokens, segments, valid_lens)
        mlm_Y_hat = self.mlm(encoded_X, pred_positions) if pred_positions is not None else None
        # Index 0 is the '<cls>' token.
        nsp_Y_hat = self.nsp(self.hidden(encoded_X[:, 0, :]))
        return encoded_X, mlm_Y_hat, nsp_Y_hat


def get_tokens_and_segments(tokens_a, tokens_b=None):
    """``['<cls>'] + a + ['<sep>'] (+ b + ['<sep>'])`` and its 0/1 segment ids."""
    tokens = ['<cls>'] + tokens_a + ['<sep>']
    segments = [0] * (len(tokens_a) + 2)
    if tokens_b is not None:
        tokens += tokens_b + ['<sep>']
        segments += [1] * (len(tokens_b) + 1)
    return tokens, segments


def pretraining_loss(model, tokens, segments, valid_lens, pred_positions, mlm_weights, mlm_labels,
                     nsp_labels, loss=None):
    """MLM cross-entropy (weighted by the 0/1 mask over padded prediction slots) + NSP loss.

    ``model`` is a BERTModel (reference or fast); ``loss`` defaults to an unreduced
    ``nn.CrossEntropyLoss``, as in the book's pretraining loop.
    """
    loss = loss or nn.CrossEntropyLoss(reduction="none")
    _, mlm_Y_hat, nsp_Y_hat = model(tokens, segments, valid_lens.reshape(-1), pred_positions)
    vocab_size = mlm_Y_hat.shape[-1]
    mlm_l = loss(mlm_Y_hat.reshape(-1, vocab_size), mlm_labels.reshape(-1)) * mlm_weights.reshape(-1)
    mlm_l = mlm_l.sum() / (mlm_weights.sum() + 1e-8)
    nsp_l = loss(nsp_Y_hat, nsp_labels).mean()
    return mlm_l + nsp_l, mlm_l, nsp_l
