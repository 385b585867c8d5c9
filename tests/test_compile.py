"""The fast modules under torch.compile (CPU: the fused-PyTorch path)."""

import pytest
import torch

from tests.helpers import assert_close, encoder_config, encoder_pair, random_inputs


@pytest.mark.parametrize("valid_lens", [torch.tensor([3, 0, 9]), torch.tensor([[1, 2, 3, 0, 9, 9, 9, 9, 9]] * 3)],
                         ids=["1d", "2d"])
def test_fullgraph_compile_matches_reference(valid_lens):
    torch._dynamo.reset()
    ref, fast = encoder_pair(encoder_config(num_layers=1))
    tokens, segments = random_inputs(3, 9, 50)
    compiled = torch.compile(fast, fullgraph=True)
    out = compiled(tokens, segments, valid_lens)
    assert_close(out, ref(tokens, segments, valid_lens), atol=1e-4)
    # Training: gradients flow through the compiled graph.
    fast.train()
    compiled(tokens, segments, valid_lens).sum().backward()
    assert fast.blks[0].attention.W_q.weight.grad is not None


def test_fullgraph_compile_through_the_registered_triton_ops():
    """backend="triton" on CPU tensors: the registered ops (their CPU twins) trace cleanly."""
    torch._dynamo.reset()
    ref, fast = encoder_pair(encoder_config(num_layers=1), backend="triton")
    tokens, segments = random_inputs(3, 9, 50)
    valid_lens = torch.tensor([3, 0, 9])
    compiled = torch.compile(fast, fullgraph=True)
    assert_close(compiled(tokens, segments, valid_lens), ref(tokens, segments, valid_lens), atol=1e-4)
    fast.train()
    compiled(tokens, segments, valid_lens).sum().backward()
    assert fast.blks[0].ffn.dense1.weight.grad is not None


def test_fullgraph_compile_with_dropout_through_the_triton_ops():
    """The dropout seed is a device tensor drawn by torch.randint: no host round trip, so
    training with dropout traces into one graph, and the graph's seeds follow torch.manual_seed."""
    torch._dynamo.reset()
    _, fast = encoder_pair(encoder_config(num_layers=1, dropout=0.3), backend="triton")
    fast.train()
    tokens, segments = random_inputs(3, 9, 50)
    valid_lens = torch.tensor([3, 0, 9])
    compiled = torch.compile(fast, fullgraph=True)
    torch.manual_seed(0)
    first = compiled(tokens, segments, valid_lens)
    torch.manual_seed(0)
    assert torch.equal(compiled(tokens, segments, valid_lens), first)
    assert not torch.equal(compiled(tokens, segments, valid_lens), first), "a new draw, a new mask"
    first.sum().backward()
    assert fast.blks[0].attention.W_q.weight.grad is not None
