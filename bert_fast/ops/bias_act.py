"""linear_act: ``act(x @ W^T + b)`` for the first FFN layer; ReLU or GELU (erf / tanh)."""

from torch.nn import functional as F

ACTIVATIONS = ("relu", "gelu", "gelu_tanh")


def linear_act(x, weight, bias, activation="relu"):
    y = F.linear(x, weight, bias)
    if activation == "relu":
        # In place is safe under autograd: linear's backward never reads its own output.
        return F.relu(y, inplace=True)
    if activation == "gelu":
        return F.gelu(y)
    if activation == "gelu_tanh":
        return F.gelu(y, approximate="tanh")
    raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")
