"""What the ops' autograd registrations share."""

import torch


def forbid_double_backward(op_name, what):
    """Give backward op ``op_name`` an autograd formula that raises a clear error.

    The fused backward kernels have no derivative of their own. Without a formula, a custom
    op of Python's raises PyTorch's generic error, and one of the extension's (TORCH_LIBRARY)
    goes through the dispatcher's fallback, which lets a double backward run and silently
    drops the second-order terms: a wrong answer. Plain first-order training never reaches
    this (the backward runs without grad mode unless ``create_graph=True``).
    """
    def backward(ctx, *grads):
        raise NotImplementedError(
            f"double backward (create_graph=True, e.g. a gradient penalty) through {what} is not "
            f"supported by bert_fast's fused kernels ({op_name}); backend='torch' supports it")

    torch.library.register_autograd(op_name, backward, setup_context=lambda ctx, inputs, output: None)
