"""The reference itself follows docs/REFERENCE.md (these pin the contract down)."""

import math

import torch

from bert_fast import reference as R
from tests.helpers import encoder_config


def test_masked_softmax_rules():
    scores = torch.randn(3, 2, 5)
    # float and fractional lengths, 0 (uniform over all keys), > L (nothing masked)
    p = R.masked_softmax(scores.clone(), torch.tensor([2.5, 0.0, 9.0]))
    assert torch.all(p[0, :, 3:] == 0) and torch.allclose(p[0].sum(-1), torch.ones(2))
    assert torch.allclose(p[1], torch.full((2, 5), 0.2))
    assert torch.allclose(p[2], torch.softmax(scores[2], -1))
    # 2-D: one length per query
    p = R.masked_softmax(scores.clone(), torch.tensor([[1, 4], [0, 5], [3, 3]]))
    assert torch.all(p[0, 0, 1:] == 0) and torch.all(p[0, 1, 4:] == 0)
    assert torch.allclose(p[1, 0], torch.full((5,), 0.2))


def test_the_fill_in_fp16_is_what_its_cast_gives_on_every_torch():
    """-1e6 does not fit fp16: torch before 2.15 stored the scalar fill as -inf, 2.15 refuses
    it ("cannot be converted to type c10::Half without overflow"). The reference keeps the
    first on every torch, so its fp16 baseline (a row that sees no key is NaN) stays one thing."""
    scores = torch.randn(2, 1, 3).half()
    p = R.masked_softmax(scores.clone(), torch.tensor([2, 0]))
    masked = R.sequence_mask(scores.reshape(2, 3).clone(), torch.tensor([2, 0]), R.MASK_VALUE)
    assert masked[0, 2] == -math.inf and torch.all(masked[1] == -math.inf)
    assert torch.equal(masked[0, :2], scores[0, 0, :2])
    assert torch.all(p[0, 0, 2] == 0) and torch.isnan(p[1]).all()
    # Values the dtype holds are stored as given; bf16 holds -1e6 (rounded to its precision).
    assert R.sequence_mask(scores.reshape(2, 3).clone(), torch.tensor([2, 0]), -7.0)[1, 0] == -7.0
    assert R.sequence_mask(torch.zeros(1, 2, dtype=torch.bfloat16), torch.tensor([1]), R.MASK_VALUE)[0, 1] == \
        torch.tensor(R.MASK_VALUE).bfloat16()


def test_state_dict_keys_and_shapes():
    cfg = encoder_config(num_heads=2, head_dim=8, num_layers=2)
    enc = R.BERTEncoder(**cfg)
    sd = enc.state_dict()
    H = cfg["num_hiddens"]
    assert sd["token_embedding.weight"].shape == (cfg["vocab_size"], H)
    assert sd["segment_embedding.weight"].shape == (2, H)
    assert sd["pos_embedding"].shape == (1, cfg["max_len"], H)
    for i in range(2):
        for w in ("W_q", "W_k", "W_v", "W_o"):
            assert sd[f"blks.{i}.attention.{w}.weight"].shape == (H, H)
            assert sd[f"blks.{i}.attention.{w}.bias"].shape == (H,)
        assert sd[f"blks.{i}.ffn.dense1.weight"].shape == (cfg["ffn_num_hiddens"], H)
        assert sd[f"blks.{i}.addnorm2.ln.bias"].shape == (H,)


def test_no_gradient_reaches_pos_embedding():
    enc = R.BERTEncoder(**encoder_config(num_heads=2, head_dim=8))
    tokens = torch.randint(0, 50, (2, 6))
    enc(tokens, torch.zeros_like(tokens), torch.tensor([3, 6])).sum().backward()
    assert enc.pos_embedding.grad is None
    assert enc.token_embedding.weight.grad is not None


def test_attention_scale_and_head_order():
    mha = R.MultiHeadAttention(8, 8, 8, 8, 2, 0.0, bias=False).eval()
    X = torch.randn(1, 3, 8)
    q, k, v = (X @ W.weight.T for W in (mha.W_q, mha.W_k, mha.W_v))
    heads = []
    for h in range(2):
        sl = slice(4 * h, 4 * h + 4)
        w = torch.softmax(q[0, :, sl] @ k[0, :, sl].T / math.sqrt(4), -1)
        heads.append(w @ v[0, :, sl])
    expected = torch.cat(heads, -1) @ mha.W_o.weight.T
    assert torch.allclose(mha(X, X, X, None)[0], expected, atol=1e-6)


def test_get_tokens_and_segments():
    tokens, segments = R.get_tokens_and_segments(["a", "b"], ["c"])
    assert tokens == ["<cls>", "a", "b", "<sep>", "c", "<sep>"]
    assert segments == [0, 0, 0, 0, 1, 1]
    assert R.get_tokens_and_segments(["a"]) == (["<cls>", "a", "<sep>"], [0, 0, 0])


def test_bert_model_heads():
    cfg = encoder_config(num_heads=2, head_dim=8)
    H = cfg["num_hiddens"]
    model = R.BERTModel(**cfg, hid_in_features=H, mlm_in_features=H, nsp_in_features=H)
    tokens = torch.randint(0, 50, (2, 7))
    encoded, mlm, nsp = model(tokens, torch.zeros_like(tokens), torch.tensor([5, 7]),
                              torch.tensor([[1, 2], [3, 6]]))
    assert encoded.shape == (2, 7, H) and mlm.shape == (2, 2, 50) and nsp.shape == (2, 2)
    assert model(tokens, torch.zeros_like(tokens))[1] is None
