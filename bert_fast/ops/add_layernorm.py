"""add_layernorm: post-norm residual ``LayerNorm(residual + dropout(x))``."""

from torch.nn import functional as F


def add_layernorm(x, residual, weight, bias, eps=1e-5, dropout_p=0.0, training=False):
    if dropout_p > 0.0 and training:
        x = F.dropout(x, dropout_p, training=True)
    return F.layer_norm(residual + x, weight.shape if weight is not None else x.shape[-1:],
                        weight, bias, eps)
