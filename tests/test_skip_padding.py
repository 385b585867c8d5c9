"""skip_padding: valid positions match the exact mode; padded rows are zeros."""

import pytest
import torch

from bert_fast.backend import available_backends

from tests.helpers import assert_close, encoder_config, encoder_pair, random_inputs

B, L = 4, 13


def valid_mask(valid_lens, seqlen):
    return torch.arange(seqlen, dtype=torch.float32)[None, :] < valid_lens[:, None]


@pytest.mark.parametrize("valid_lens", [
    torch.tensor([5, 13, 1, 9]),
    torch.tensor([2.5, 0.0, 13.0, 7.25]),     # fractional, an empty sequence
    torch.tensor([20, 13, 30, 14]),           # >= L: nothing padded
    torch.tensor([0, 0, 0, 3]),
], ids=["int", "fractional_zero", "beyond_L", "mostly_empty"])
@pytest.mark.parametrize("training", [False, True], ids=["eval", "train"])
def test_valid_positions_match_exact_mode(valid_lens, training):
    cfg = encoder_config()
    ref, exact = encoder_pair(cfg)
    _, skip = encoder_pair(cfg, skip_padding=True)
    skip.load_state_dict(ref.state_dict())
    for m in (ref, exact, skip):
        m.train(training)
    tokens, segments = random_inputs(B, L, 50)
    mask = valid_mask(valid_lens, L)
    out_ref, out_exact, out_skip = (m(tokens, segments, valid_lens) for m in (ref, exact, skip))
    assert_close(out_skip[mask], out_exact[mask], atol=1e-5, what="valid positions vs exact")
    assert_close(out_skip[mask], out_ref[mask], atol=1e-4, what="valid positions vs reference")
    assert torch.all(out_skip[~mask] == 0), "padded positions must be zeros"
    # A loss over valid positions only: every gradient equals the exact mode's.
    w = torch.randn_like(out_ref) * mask[..., None]
    (out_ref * w).sum().backward()
    (out_skip * w).sum().backward()
    skip_params = dict(skip.named_parameters())
    for name, p in ref.named_parameters():
        if p.grad is None:
            assert skip_params[name].grad is None, name
        else:
            assert_close(skip_params[name].grad, p.grad, atol=1e-4, rtol=1e-4, what=f"grad {name}")


def test_no_valid_lens_is_the_exact_mode():
    cfg = encoder_config()
    ref, skip = encoder_pair(cfg, skip_padding=True)
    tokens, segments = random_inputs(B, L, 50)
    assert_close(skip(tokens, segments, None), ref(tokens, segments, None), atol=1e-4)


def test_two_dimensional_valid_lens_rejected():
    _, skip = encoder_pair(encoder_config(), skip_padding=True)
    tokens, segments = random_inputs(B, L, 50)
    with pytest.raises(ValueError, match="1-D valid_lens"):
        skip(tokens, segments, torch.full((B, L), 5))
    skip.check_inputs = False     # the module still refuses, even unchecked
    with pytest.raises(ValueError, match="1-D valid_lens"):
        skip(tokens, segments, torch.full((B, L), 5))


def test_learn_pos_embedding_gradient_matches_exact_mode():
    cfg = encoder_config()
    _, exact = encoder_pair(cfg, learn_pos_embedding=True)
    _, skip = encoder_pair(cfg, learn_pos_embedding=True, skip_padding=True)
    skip.load_state_dict(exact.state_dict())
    tokens, segments = random_inputs(B, L, 50)
    valid_lens = torch.tensor([5, 13, 0, 9])
    w = torch.randn(B, L, cfg["num_hiddens"]) * valid_mask(valid_lens, L)[..., None]
    (exact(tokens, segments, valid_lens) * w).sum().backward()
    (skip(tokens, segments, valid_lens) * w).sum().backward()
    assert_close(skip.pos_embedding.grad, exact.pos_embedding.grad, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("backend", available_backends())
def test_a_static_token_count_gives_the_counted_result(backend):
    """skip_padding with a static bound on the valid tokens (what a CUDA graph captures: no host
    read): the filler rows past the valid count change nothing and are dropped."""
    _, skip = encoder_pair(encoder_config(), skip_padding=True, backend=backend)
    tokens, segments = random_inputs(B, L, 50)
    valid_lens = torch.tensor([2.5, 0.0, 13.0, 7.25])          # 3 + 0 + 13 + 8 = 24 valid tokens
    with torch.no_grad():
        expected = skip(tokens, segments, valid_lens)
        for num_tokens in (24, 25, 32, B * L):
            out = skip._forward(tokens, segments, valid_lens, num_tokens=num_tokens)
            assert_close(out, expected, atol=1e-5, what=f"num_tokens={num_tokens}")


def test_static_unpadding_round_trip_and_filler():
    from bert_fast import ops
    valid_lens = torch.tensor([2.5, 0.0, 4.0])
    unpadding = ops.unpadding_for(valid_lens, 4, num_tokens=9)
    assert unpadding.static and unpadding.seqlens is None
    assert unpadding.indices.tolist() == [0, 1, 2, 8, 9, 10, 11, 12, 12]    # filler: slot B*L = 12
    assert unpadding.cu_seqlens.tolist() == [0, 3, 3, 7]
    x = torch.randn(3, 4, 5)
    packed = ops.unpad(x, unpadding)
    assert packed.shape == (9, 5) and torch.all(packed[7:] == 0)
    back = ops.pad(packed + 1.0, unpadding)              # the filler rows' values are dropped
    keep = torch.arange(4)[None] < valid_lens[:, None]
    assert torch.equal(back[keep], x[keep] + 1.0) and torch.all(back[~keep] == 0)
    with pytest.raises(ValueError, match="per-sequence counts on the host"):
        ops.unpadded_self_attention(torch.randn(9, 12), 2, unpadding, valid_lens, per_sequence=True)
