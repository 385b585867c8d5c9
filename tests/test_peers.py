"""The benchmark's peers (bert_fast.peers) compute the reference encoder's function.

Compared on valid positions only: the peers' padded rows are unspecified (see peers.py).
"""

import pytest
import torch

from bert_fast import peers
from bert_fast import reference as R

from .helpers import assert_close, encoder_config, random_inputs

# nn.TransformerEncoder's nested tensors warn that their API is a prototype.
pytestmark = pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors:UserWarning")

BATCH, SEQLEN = 3, 9
LENGTHS = [5, 9, 1]


def _needs_transformers():
    # exc_type=ImportError: a broken install (not just a missing one) skips too.
    pytest.importorskip("transformers", exc_type=ImportError)


def _hf_peer(encoder):
    _needs_transformers()
    return peers.hf_bert_peer(encoder)


PEERS = {"transformer_encoder": peers.transformer_encoder_peer, "hf_bert_sdpa": _hf_peer}


@pytest.fixture
def reference():
    return R.BERTEncoder(**encoder_config(num_heads=2, head_dim=16)).eval()


def _inputs(encoder):
    return random_inputs(BATCH, SEQLEN, encoder.token_embedding.num_embeddings)


def _valid_lens(kind):
    return {"none": None, "int": torch.tensor(LENGTHS), "past_end": torch.tensor([5, 12, 1]),
            "float": torch.tensor(LENGTHS, dtype=torch.float32) + 0.5}[kind]


def _assert_matches_on_valid_positions(peer, reference, tokens, segments, valid_lens):
    with torch.inference_mode():
        actual = peer(tokens, segments, valid_lens)
        expected = reference(tokens, segments, valid_lens)
    valid = (torch.ones(tokens.shape, dtype=torch.bool) if valid_lens is None
             else peers.valid_position_mask(valid_lens, tokens))
    assert_close(actual[valid], expected[valid], atol=1e-5, what="valid positions")
    return actual


@pytest.mark.parametrize("lengths", ["int", "float", "past_end", "none"])
@pytest.mark.parametrize("name", PEERS)
def test_peer_matches_reference(name, lengths, reference):
    peer = PEERS[name](reference).eval()
    tokens, segments = _inputs(reference)
    _assert_matches_on_valid_positions(peer, reference, tokens, segments, _valid_lens(lengths))


@pytest.mark.parametrize("name", PEERS)
def test_peer_owns_its_weights(name, reference):
    peer = PEERS[name](reference).eval()
    before = {k: v.clone() for k, v in reference.state_dict().items()}
    peer_params = list(peer.parameters())
    assert len(peer_params) > 0
    reference_storages = {p.data_ptr() for p in reference.parameters()}
    assert not any(p.data_ptr() in reference_storages for p in peer_params)
    with torch.no_grad():
        for p in peer_params:
            p.add_(1.0)
    for key, value in reference.state_dict().items():
        assert torch.equal(value, before[key]), f"changing the peer changed the reference's {key}"


@pytest.mark.parametrize("name", PEERS)
def test_peer_rejects_2d_valid_lens(name, reference):
    peer = PEERS[name](reference).eval()
    tokens, segments = _inputs(reference)
    per_query = torch.full((BATCH, SEQLEN), 4)
    with pytest.raises(ValueError, match="shape"), torch.inference_mode():
        peer(tokens, segments, per_query)
    with pytest.raises(ValueError, match="shape"), torch.inference_mode():
        peer(tokens, segments, torch.tensor([3, 4]))  # one length short


@pytest.mark.parametrize("name", PEERS)
def test_peer_follows_encoder_dtype_and_mode(name, reference):
    reference = reference.to(torch.bfloat16).train()
    peer = PEERS[name](reference)
    assert all(p.dtype == torch.bfloat16 for p in peer.parameters())
    assert peer.training and all(m.training for m in peer.modules())


def _ran_fused_layers(peer, tokens, segments, valid_lens):
    """Whether PyTorch ran its fused encoder-layer kernel (the "fast path")."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        output = peer(tokens, segments, valid_lens)
    return output, any(e.name == "aten::_transformer_encoder_layer_fwd" for e in prof.events())


@pytest.mark.parametrize("lengths", ["int", "none"])
def test_transformer_encoder_takes_fast_path(lengths, reference):
    peer = peers.transformer_encoder_peer(reference).eval()
    tokens, segments = _inputs(reference)
    valid_lens = _valid_lens(lengths)
    with torch.inference_mode():
        output, fused = _ran_fused_layers(peer, tokens, segments, valid_lens)
    assert fused, "nn.TransformerEncoder did not take its fused fast path"
    if valid_lens is not None:
        # Nested tensors skip padded tokens and pad the output back with zeros.
        padded = ~peers.valid_position_mask(valid_lens, tokens)
        assert torch.count_nonzero(output[padded]) == 0


def test_transformer_encoder_fast_path_detection_sees_slow_path(reference):
    """The check above can fail: with gradients wanted, PyTorch runs its per-op path."""
    peer = peers.transformer_encoder_peer(reference).eval()
    tokens, segments = _inputs(reference)
    output, fused = _ran_fused_layers(peer, tokens, segments, _valid_lens("int"))
    assert not fused
    padded = ~peers.valid_position_mask(_valid_lens("int"), tokens)
    assert torch.count_nonzero(output[padded]) > 0


def test_hf_peer_uses_requested_attention(reference):
    _needs_transformers()
    for implementation in ("sdpa", "eager"):
        peer = peers.hf_bert_peer(reference, attn_implementation=implementation)
        assert peer.bert.config._attn_implementation == implementation
    assert peers.hf_unavailable_reason() is None


def test_hf_peer_is_none_without_transformers(monkeypatch, reference):
    import sys
    monkeypatch.setitem(sys.modules, "transformers", None)  # makes `import transformers` fail
    assert peers.hf_bert_peer(reference) is None
    assert "transformers" in peers.hf_unavailable_reason()


@pytest.mark.parametrize("name", PEERS)
def test_peer_zero_biases_where_reference_has_none(name, reference):
    # The book's MultiHeadAttention defaults to bias=False (BERTEncoder turns biases on).
    for blk in reference.blks:
        for linear in (blk.attention.W_q, blk.attention.W_k, blk.attention.W_v, blk.attention.W_o):
            linear.register_parameter("bias", None)
    peer = PEERS[name](reference).eval()
    tokens, segments = _inputs(reference)
    _assert_matches_on_valid_positions(peer, reference, tokens, segments, _valid_lens("int"))
