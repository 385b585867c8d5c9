"""The ops on their own: attention masking in fp64, padding helpers, embedding_sum."""

import pytest
import torch

from bert_fast import ops
from bert_fast import reference as R
from bert_fast.ops._triton import HAS_TRITON
from tests.helpers import assert_close


def reference_attention(q, k, v, num_heads, valid_lens):
    """The book's path: heads to the batch axis, bmm, masked_softmax, bmm, heads back."""
    attn = R.DotProductAttention(0.0)
    heads = lambda x: R.transpose_qkv(x, num_heads)
    if valid_lens is not None:
        valid_lens = torch.repeat_interleave(valid_lens, num_heads, dim=0)
    return R.transpose_output(attn(heads(q), heads(k), heads(v), valid_lens), num_heads)


@pytest.mark.parametrize("valid_lens", [
    None,
    torch.tensor([0.0, 2.5, 9.0]),
    torch.tensor([-1, 3, 100]),
    torch.tensor([[0, 1, 2, 3, 4, 5, 6], [7, 0, 7, 0, 7, 0, 7], [2, 2, 2, 2, 2, 2, 2]]),
    torch.tensor([[0.5, -2.0, 1.5, 7.0, 6.99, 0.0, 3.0]] * 3, dtype=torch.float64),
])
def test_attention_matches_reference_in_fp64_with_gradients(valid_lens):
    q, k, v = (torch.randn(3, 7, 12, dtype=torch.float64, requires_grad=True) for _ in range(3))
    expected = reference_attention(q, k, v, 3, valid_lens)
    out = ops.multi_head_attention(q, k, v, 3, valid_lens)
    assert_close(out, expected, atol=1e-12)
    w = torch.randn_like(out)
    grads_ref = torch.autograd.grad((expected * w).sum(), (q, k, v))
    grads = torch.autograd.grad((out * w).sum(), (q, k, v))
    for g, g_ref, name in zip(grads, grads_ref, "qkv"):
        assert_close(g, g_ref, atol=1e-12, what=f"d{name}")


def test_row_without_valid_key_is_uniform_over_all_keys():
    q, k, v = torch.randn(2, 5, 8), torch.randn(2, 5, 8), torch.randn(2, 5, 8)
    out = ops.multi_head_attention(q, k, v, 2, torch.tensor([0, 5]))
    assert_close(out[0], v[0].mean(0).expand(5, 8), atol=1e-6)


def test_attention_gradcheck():
    q, k, v = (torch.randn(2, 4, 6, dtype=torch.float64, requires_grad=True) for _ in range(3))
    valid_lens = torch.tensor([[0, 1, 3, 4], [2, 2, 0, 9]])
    assert torch.autograd.gradcheck(lambda q, k, v: ops.multi_head_attention(q, k, v, 2, valid_lens), (q, k, v))


def test_pad_unpad_round_trip():
    valid_lens = torch.tensor([2.5, 0.0, 4.0])
    unpadding = ops.unpadding_for(valid_lens, 4)
    assert unpadding.indices.tolist() == [0, 1, 2, 8, 9, 10, 11]
    assert unpadding.cu_seqlens.tolist() == [0, 3, 3, 7] and unpadding.cu_seqlens.dtype == torch.int32
    assert unpadding.seqlens == [3, 0, 4]
    x = torch.randn(3, 4, 5, requires_grad=True)
    packed = ops.unpad(x, unpadding)
    assert packed.shape == (7, 5)
    back = ops.pad(packed, unpadding)
    keep = torch.arange(4)[None] < valid_lens[:, None]
    assert torch.equal(back[keep], x[keep]) and torch.all(back[~keep] == 0)
    back.sum().backward()
    assert torch.equal(x.grad, keep[..., None].float().expand(3, 4, 5))


def test_embedding_sum_padded_and_unpadded():
    token_w, segment_w, pos_w = torch.randn(20, 6), torch.randn(2, 6), torch.randn(1, 10, 6)
    tokens, segments = torch.randint(0, 20, (2, 5)), torch.randint(0, 2, (2, 5))
    expected = token_w[tokens] + segment_w[segments] + pos_w[:, :5]
    assert_close(ops.embedding_sum(tokens, segments, token_w, segment_w, pos_w), expected, atol=1e-6)
    positions = torch.tensor([0, 3, 4])
    flat = ops.embedding_sum(tokens[0, positions], segments[0, positions], token_w, segment_w, pos_w,
                             positions=positions)
    assert_close(flat, expected[0, positions], atol=1e-6)


@pytest.mark.parametrize("per_sequence", [True, False], ids=["per_sequence", "repadded"])
@pytest.mark.parametrize("valid_lens", [torch.tensor([2.5, 0.0, 7.0, 1.0]), torch.tensor([0, 0, 0, 0])],
                         ids=["mixed", "all_empty"])
def test_unpadded_self_attention_matches_padded(per_sequence, valid_lens):
    qkv = torch.randn(4, 7, 3 * 12, dtype=torch.float64, requires_grad=True)
    expected = ops.packed_self_attention(qkv, 3, valid_lens)
    unpadding = ops.unpadding_for(valid_lens, 7)
    packed = ops.unpad(qkv, unpadding)
    out = ops.unpadded_self_attention(packed, 3, unpadding, valid_lens, per_sequence=per_sequence)
    assert out.shape == (sum(unpadding.seqlens), 12)
    assert_close(out, ops.unpad(expected, unpadding), atol=1e-12)
    if out.numel():
        w = torch.randn_like(out)
        grad = torch.autograd.grad((out * w).sum(), qkv)[0]
        grad_ref = torch.autograd.grad((ops.unpad(expected, unpadding) * w).sum(), qkv)[0]
        assert_close(grad, grad_ref, atol=1e-12, what="dqkv")


@pytest.mark.skipif(not HAS_TRITON, reason="needs triton")
def test_triton_forward_outputs_are_not_views():
    """Autograd forbids in-place edits of a custom op's output that is a view of another
    tensor, so the launchers allocate their outputs in the final shape (run in the
    interpreter on CPU tensors, on the GPU where there is one)."""
    from bert_fast.ops.add_layernorm import _add_layernorm_fwd_triton
    from bert_fast.ops.bias_act import _bias_act_fwd_triton
    from bert_fast.ops.embedding import _embedding_sum_fwd_triton
    from tests.helpers import DEVICE, needs_kernels

    if needs_kernels.args[0]:
        pytest.skip(needs_kernels.kwargs["reason"])
    x, residual = (torch.randn(2, 5, 32, device=DEVICE) for _ in range(2))
    weight, bias = torch.ones(32, device=DEVICE), torch.zeros(32, device=DEVICE)
    tokens = torch.randint(0, 10, (2, 5), device=DEVICE)
    outputs = {
        "add_layernorm": _add_layernorm_fwd_triton(x, residual, weight, bias, 1e-5, None, 0.0)[0],
        "bias_act": _bias_act_fwd_triton(x, bias, "relu"),
        "embedding_sum": _embedding_sum_fwd_triton(tokens, tokens % 2, torch.randn(10, 32, device=DEVICE),
                                                   torch.randn(2, 32, device=DEVICE),
                                                   torch.randn(1, 8, 32, device=DEVICE), None),
    }
    for name, out in outputs.items():
        assert out.shape == (2, 5, 32) and out.is_contiguous(), name
        assert not out._is_view(), f"{name}: the output is a view"
