"""FastBERTEncoder / FastBERTModel against the eager reference: outputs and every gradient."""

import copy

import pytest
import torch

from bert_fast import FastBERTEncoder, FastBERTModel, FastEncoderBlock, optimize
from bert_fast import reference as R
from bert_fast.backend import available_backends
from tests.helpers import (FLOOR, assert_close, compare_forward_backward, compare_under_autocast, encoder_config,
                           encoder_pair, interpreted_kernels, max_err, random_inputs)

B, L = 3, 13   # L not a multiple of 16


def valid_lens_case(name, batch, seqlen):
    return {
        "none": None,
        "int": torch.tensor([5, seqlen, 1])[:batch],
        "float": torch.tensor([5.0, float(seqlen), 2.0])[:batch],
        "fractional": torch.tensor([2.5, 7.25, 0.5])[:batch],
        "zero": torch.tensor([0, 4, 0])[:batch],
        "negative": torch.tensor([-3, 4, 2])[:batch],
        "beyond_L": torch.tensor([seqlen + 10, 3, 100])[:batch],
        "2d": torch.randint(-1, seqlen + 2, (batch, seqlen)),
        "2d_float": torch.rand(batch, seqlen) * (seqlen + 2) - 1,
    }[name]


VALID_LENS = ["none", "int", "float", "fractional", "zero", "negative", "beyond_L", "2d", "2d_float"]


@pytest.mark.parametrize("case", VALID_LENS)
@pytest.mark.parametrize("training", [False, True], ids=["eval", "train"])
def test_matches_reference(case, training):
    ref, fast = encoder_pair(encoder_config(num_heads=2, head_dim=32))
    ref.train(training), fast.train(training)   # dropout is 0: train mode must match too
    tokens, segments = random_inputs(B, L, 50)
    compare_forward_backward(ref, fast, tokens, segments, valid_lens_case(case, B, L))


@pytest.mark.parametrize("num_heads,head_dim", [(2, 192), (2, 64), (3, 32), (2, 96)])
@pytest.mark.parametrize("case", ["int", "2d"])
def test_head_dims(num_heads, head_dim, case):
    ref, fast = encoder_pair(encoder_config(num_heads=num_heads, head_dim=head_dim, num_layers=1))
    tokens, segments = random_inputs(B, L, 50)
    compare_forward_backward(ref, fast, tokens, segments, valid_lens_case(case, B, L))


@pytest.mark.parametrize("batch,seqlen", [(1, 13), (2, 1), (1, 1), (2, 16), (2, 33)])
def test_odd_shapes(batch, seqlen):
    ref, fast = encoder_pair(encoder_config())
    tokens, segments = random_inputs(batch, seqlen, 50)
    for valid_lens in (torch.randint(0, seqlen + 1, (batch,)), torch.randint(0, seqlen + 1, (batch, seqlen))):
        ref.zero_grad(), fast.zero_grad()
        compare_forward_backward(ref, fast, tokens, segments, valid_lens)


def test_non_contiguous_inputs():
    ref, fast = encoder_pair(encoder_config())
    tokens = torch.randint(0, 50, (L, B)).t()                  # transposed view
    segments = torch.randint(0, 2, (B, 2 * L))[:, ::2]         # strided view
    valid_lens = torch.tensor([4, 0, 9, 1, 13, 2])[::2]        # strided 1-D
    assert not tokens.is_contiguous() and not segments.is_contiguous()
    compare_forward_backward(ref, fast, tokens, segments, valid_lens)
    valid_lens_2d = torch.randint(0, L + 1, (L, B)).t()
    assert_close(fast(tokens, segments, valid_lens_2d), ref(tokens, segments, valid_lens_2d), atol=1e-4)


def test_integer_dtypes_of_inputs():
    ref, fast = encoder_pair(encoder_config())
    tokens, segments = random_inputs(B, L, 50)
    valid_lens = torch.tensor([3, 13, 7], dtype=torch.int32)
    expected = ref(tokens, segments, valid_lens)
    out = fast(tokens.int(), segments.int(), valid_lens)
    assert_close(out, expected, atol=1e-4)
    assert_close(fast(tokens, segments, valid_lens.double()), expected, atol=1e-4)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_against_fp32_reference(dtype):
    """STYLE.md rule: error vs the fp32 reference <= 2x the reference's own error in that
    dtype, plus a floor (bf16 5e-2, fp16 1e-2)."""
    ref, fast = encoder_pair(encoder_config(num_heads=2, head_dim=64))
    tokens, segments = random_inputs(B, L, 50)
    valid_lens = torch.tensor([5, 0, 11])
    expected = ref(tokens, segments, valid_lens)
    ref_low = R.BERTEncoder(**encoder_config(num_heads=2, head_dim=64)).eval()
    ref_low.load_state_dict(ref.state_dict())
    ref_low.to(dtype), fast.to(dtype)
    out = fast(tokens, segments, valid_lens)
    assert out.dtype == dtype and out.isfinite().all()
    # In fp16 the reference's -1e6 fill overflows to -inf, so its valid_len-0 row is NaN;
    # the fast path keeps the fp32 meaning (uniform attention). Baseline over finite rows.
    out_low = ref_low(tokens, segments, valid_lens)
    finite = out_low.isfinite()
    baseline = max_err(out_low[finite], expected[finite])
    err = max_err(out, expected)
    assert err <= 2 * baseline + FLOOR[dtype], f"{dtype}: error {err:.3g}, reference in {dtype}: {baseline:.3g}"


@pytest.mark.parametrize("backend", available_backends())
def test_autocast_training_matches_the_reference_under_autocast(backend):
    """Mixed precision as people fine-tune (torch.autocast, fp32 weights): the output dtype the
    reference gives there (fp32: LayerNorm is an fp32 op under autocast), and values and
    gradients within bf16's error of the reference under the same autocast."""
    ref, fast = encoder_pair(encoder_config(num_layers=2), backend=backend)
    ref.train(), fast.train()
    tokens, segments = random_inputs(B, L, 50)
    compare_under_autocast(ref, fast, tokens, segments, torch.tensor([5, 0, 11]), torch.bfloat16, 5e-2)


def test_learn_pos_embedding_gradient():
    cfg = encoder_config()
    ref, fast = encoder_pair(cfg, learn_pos_embedding=True)
    tokens, segments = random_inputs(B, L, 50)
    valid_lens = torch.tensor([5, 13, 0])
    # The reference with the position table used as a learnable parameter (no .data).
    X = ref.token_embedding(tokens) + ref.segment_embedding(segments) + ref.pos_embedding[:, :L]
    for blk in ref.blks:
        X = blk(X, valid_lens)
    out = fast(tokens, segments, valid_lens)
    assert_close(out, X, atol=1e-4)
    w = torch.randn_like(X)
    (X * w).sum().backward()
    (out * w).sum().backward()
    assert_close(fast.pos_embedding.grad, ref.pos_embedding.grad, atol=1e-4, rtol=1e-4, what="pos grad")
    assert fast.pos_embedding.grad[:, L:].abs().max() == 0
    assert fast.pos_embedding.grad[:, :L].abs().max() > 0


def test_default_pos_embedding_gets_no_gradient():
    _, fast = encoder_pair(encoder_config())
    tokens, segments = random_inputs(B, L, 50)
    fast(tokens, segments, torch.tensor([5, 13, 0])).sum().backward()
    assert fast.pos_embedding.grad is None


@pytest.mark.parametrize("activation,module", [("gelu", torch.nn.GELU()),
                                               ("gelu_tanh", torch.nn.GELU(approximate="tanh"))])
def test_gelu_activations(activation, module):
    ref, fast = encoder_pair(encoder_config(), activation=activation)
    for blk in ref.blks:
        blk.ffn.relu = module    # the reference's FFN with BERT's activation
    tokens, segments = random_inputs(B, L, 50)
    compare_forward_backward(ref, fast, tokens, segments, torch.tensor([4, 13, 0]))


def test_state_dict_round_trip_both_ways():
    cfg = encoder_config()
    ref, fast = R.BERTEncoder(**cfg), FastBERTEncoder(**cfg)
    assert ref.state_dict().keys() == fast.state_dict().keys()
    fast.load_state_dict(ref.state_dict(), strict=True)
    ref2 = R.BERTEncoder(**cfg)
    ref2.load_state_dict(fast.state_dict(), strict=True)
    for name, t in ref.state_dict().items():
        assert torch.equal(t, ref2.state_dict()[name]), name


def test_block_matches_reference_block_without_bias():
    """A standalone block, as the book's transformer encoder uses it (no attention bias)."""
    args = (32, 32, 32, 32, [32], 32, 64, 4, 0.0)
    ref = R.EncoderBlock(*args).eval()
    fast = FastEncoderBlock(*args).eval()
    fast.load_state_dict(ref.state_dict(), strict=True)
    X = torch.randn(2, 9, 32)
    for valid_lens in (None, torch.tensor([3, 0]), torch.randint(0, 10, (2, 9))):
        assert_close(fast(X, valid_lens), ref(X, valid_lens), atol=1e-5)


def test_cross_attention_matches_reference():
    ref = R.MultiHeadAttention(16, 24, 8, 32, 4, 0.0, bias=True).eval()
    from bert_fast import FastMultiHeadAttention
    fast = FastMultiHeadAttention(16, 24, 8, 32, 4, 0.0, bias=True).eval()
    fast.load_state_dict(ref.state_dict(), strict=True)
    q, k, v = torch.randn(2, 5, 24), torch.randn(2, 7, 16), torch.randn(2, 7, 8)
    for valid_lens in (None, torch.tensor([3, 0]), torch.randint(0, 8, (2, 5))):
        assert_close(fast(q, k, v, valid_lens), ref(q, k, v, valid_lens), atol=1e-5)


def test_weight_updates_between_calls_are_seen():
    ref, fast = encoder_pair(encoder_config())
    tokens, segments = random_inputs(B, L, 50)
    valid_lens = torch.tensor([4, 13, 7])
    with torch.no_grad():
        fast(tokens, segments, valid_lens)
        for model in (ref, fast):                   # in-place update, as an optimizer does
            model.blks[0].attention.W_k.weight.mul_(1.5)
            model.blks[1].attention.W_v.bias.add_(0.25)
        assert_close(fast(tokens, segments, valid_lens), ref(tokens, segments, valid_lens), atol=1e-4)
        fast.load_state_dict(R.BERTEncoder(**encoder_config()).state_dict())
        ref.load_state_dict(fast.state_dict())
        assert_close(fast(tokens, segments, valid_lens), ref(tokens, segments, valid_lens), atol=1e-4)
    with torch.inference_mode():
        expected = ref(tokens, segments, valid_lens)
        assert_close(fast(tokens, segments, valid_lens), expected, atol=1e-4)
    # After inference mode, a frozen model must still work with autograd on its inputs.
    for p in fast.parameters():
        p.requires_grad_(False)
    assert_close(fast(tokens, segments, valid_lens), expected, atol=1e-4)


def test_dropout_is_active_in_training_and_repeatable_by_seed():
    cfg = encoder_config(dropout=0.5)
    ref, fast = encoder_pair(cfg)
    fast.train()
    tokens, segments = random_inputs(B, L, 50)
    valid_lens = torch.tensor([4, 13, 7])
    torch.manual_seed(1)
    a = fast(tokens, segments, valid_lens)
    torch.manual_seed(1)
    b = fast(tokens, segments, valid_lens)
    assert torch.equal(a, b)
    assert max_err(a, ref(tokens, segments, valid_lens)) > 1e-2
    fast.eval()
    assert_close(fast(tokens, segments, valid_lens), ref(tokens, segments, valid_lens), atol=1e-4)


@pytest.mark.parametrize("skip_padding", [False, True], ids=["exact", "skip_padding"])
@pytest.mark.parametrize("backend", available_backends())
def test_activation_checkpointing_and_saved_tensor_hooks_give_the_same_gradients(backend, skip_padding):
    """What fine-tuning scripts wrap around an encoder to save memory: torch.utils.checkpoint
    of the whole encoder (non-reentrant) or of each block (reentrant, the older default), and
    saved-tensor hooks (save_on_cpu offloading). The recomputed forward must draw the same
    dropout masks (the seeds come from the device's generator, whose state checkpoint restores)
    and every saved tensor must go through the hooks: gradients bit-identical to a plain step."""
    from torch.utils.checkpoint import checkpoint
    fast = FastBERTEncoder(**encoder_config(dropout=0.3), backend=backend, skip_padding=skip_padding).train()
    tokens, segments = random_inputs(B, L, 50)
    valid_lens = torch.tensor([4.0, 13.0, 0.0])
    params = [p for name, p in fast.named_parameters() if name != "pos_embedding"]  # no gradient: the quirk

    def step(forward):
        fast.zero_grad(set_to_none=True)
        torch.manual_seed(7)
        out = forward()
        out.square().sum().backward()   # not autograd.grad: the reentrant checkpoint refuses it
        return [out.detach()] + [p.grad for p in params]

    def blocks_checkpointed():
        X = fast.token_embedding(tokens) + fast.segment_embedding(segments) + fast.pos_embedding.data[:, :L, :]
        for blk in fast.blks:
            X = checkpoint(blk, X, valid_lens, use_reentrant=True)
        return X

    def offloaded():
        with torch.autograd.graph.save_on_cpu():
            return fast(tokens, segments, valid_lens)

    packed = []

    def through_pack_hooks():
        def pack(t):
            packed.append(t)
            return t.clone()
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            return fast(tokens, segments, valid_lens)

    expected = step(lambda: fast(tokens, segments, valid_lens))
    variants = {"checkpoint(encoder)": lambda: checkpoint(fast, tokens, segments, valid_lens, use_reentrant=False),
                "save_on_cpu": offloaded, "saved_tensors_hooks": through_pack_hooks}
    if not skip_padding:   # the blocks of a skip_padding encoder take the packed rows its forward makes
        variants["checkpoint(each block, reentrant)"] = blocks_checkpointed
    for what, forward in variants.items():
        for actual, wanted in zip(step(forward), expected, strict=True):
            assert torch.equal(actual, wanted), f"{what}: {max_err(actual, wanted)}"
    assert packed, "no saved tensor went through the hooks"


@pytest.mark.parametrize("with_positions", [True, False])
def test_bert_model_matches_reference(with_positions):
    cfg = encoder_config()
    H = cfg["num_hiddens"]
    heads = dict(hid_in_features=H, mlm_in_features=H, nsp_in_features=H)
    ref = R.BERTModel(**cfg, **heads).eval()
    fast = FastBERTModel(**cfg, **heads).eval()
    fast.load_state_dict(ref.state_dict(), strict=True)
    tokens, segments = random_inputs(B, L, 50)
    valid_lens = torch.tensor([6.0, 13.0, 9.0])
    pred_positions = torch.tensor([[1, 2, 5], [0, 12, 3], [8, 1, 1]]) if with_positions else None
    out_ref = ref(tokens, segments, valid_lens, pred_positions)
    out_fast = fast(tokens, segments, valid_lens, pred_positions)
    for a, b, what in zip(out_fast, out_ref, ("encoded", "mlm", "nsp")):
        if b is None:
            assert a is None
        else:
            assert_close(a, b, atol=1e-4, what=what)
    # Pretraining loss and its gradients.
    if with_positions:
        args = (tokens, segments, valid_lens, pred_positions, torch.ones(B, 3), torch.randint(0, 50, (B, 3)),
                torch.randint(0, 2, (B,)))
        loss_ref, loss_fast = R.pretraining_loss(ref, *args)[0], R.pretraining_loss(fast, *args)[0]
        assert_close(loss_fast, loss_ref, atol=1e-5)
        loss_ref.backward(), loss_fast.backward()
        fast_params = dict(fast.named_parameters())
        for name, p in ref.named_parameters():
            if p.grad is not None:
                assert_close(fast_params[name].grad, p.grad, atol=1e-4, rtol=1e-4, what=name)


@pytest.mark.parametrize("case", ["none", "fractional", "zero", "2d"])
@pytest.mark.parametrize("training", [False, True], ids=["eval", "train"])
def test_triton_backend_matches_reference(case, training):
    """backend="triton" end to end: on CPU tensors the registered ops run their PyTorch
    twins, so outputs and gradients must match the reference like the torch backend's."""
    ref, fast = encoder_pair(encoder_config(), backend="triton", learn_pos_embedding=False)
    ref.train(training), fast.train(training)
    tokens, segments = random_inputs(B, L, 50)
    compare_forward_backward(ref, fast, tokens, segments, valid_lens_case(case, B, L))


def test_triton_backend_gelu_and_learned_positions():
    cfg = encoder_config()
    ref_torch, fast_torch = encoder_pair(cfg, activation="gelu", learn_pos_embedding=True)
    _, fast_triton = encoder_pair(cfg, activation="gelu", learn_pos_embedding=True, backend="triton")
    fast_triton.load_state_dict(fast_torch.state_dict())
    tokens, segments = random_inputs(B, L, 50)
    compare_forward_backward(fast_torch, fast_triton, tokens, segments, torch.tensor([4, 13, 0]))


def _qkv_weight_is_a_view(attention):
    with torch.no_grad():
        weight, bias = attention._packed_qkv()
    return (weight.data_ptr() == attention.W_q.weight.data_ptr()
            and bias.data_ptr() == attention.W_q.bias.data_ptr())


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_qkv_is_packed_by_default_and_read_in_place_with_the_same_results(backend):
    ref, fast = encoder_pair(encoder_config(), backend=backend)
    tokens, segments = random_inputs(B, L, 50)
    valid_lens = torch.tensor([4, 13, 0])
    attention = fast.blks[0].attention
    assert _qkv_weight_is_a_view(attention)            # packed at construction, kept by load_state_dict
    with torch.no_grad():
        before = fast(tokens, segments, valid_lens)
    # Under autograd the projection is concatenated: every gradient matches the reference's.
    compare_forward_backward(ref, fast, tokens, segments, valid_lens)
    # Parameters replaced by hand: concatenated per call, the same results; pack_qkv_ packs them.
    attention.W_k.weight = torch.nn.Parameter(attention.W_k.weight.detach().clone())
    assert not _qkv_weight_is_a_view(attention)
    state = {name: t.clone() for name, t in fast.state_dict().items()}
    params = list(fast.parameters())
    with torch.no_grad():
        assert torch.equal(fast(tokens, segments, valid_lens), before)
    assert fast.pack_qkv_() is fast and _qkv_weight_is_a_view(attention)
    assert list(fast.parameters()) == params           # the same Parameter objects
    assert all(torch.equal(t, state[name]) for name, t in fast.state_dict().items())
    with torch.no_grad():
        assert torch.equal(fast(tokens, segments, valid_lens), before)
    # Frozen weights: autograd records nothing through them, so the plain view serves, and the
    # gradient still reaches an input that asks for one.
    fast.requires_grad_(False)
    weight, _ = attention._packed_qkv()
    assert weight.data_ptr() == attention.W_q.weight.data_ptr() and weight.grad_fn is None
    x = torch.randn(5, attention.W_q.in_features, requires_grad=True)
    torch.nn.functional.linear(x, weight).sum().backward()
    assert_close(x.grad, weight.sum(0).expand(5, -1), atol=1e-5, what="input gradient")


def test_packed_qkv_sees_loaded_and_updated_weights_and_survives_casts_and_assign():
    ref, fast = encoder_pair(encoder_config())
    tokens, segments = random_inputs(B, L, 50)
    valid_lens = torch.tensor([13, 5, 9])
    ref.blks[1].attention.W_k.weight.data.mul_(0.5)
    fast.load_state_dict(ref.state_dict())             # copies in place: still packed
    assert _qkv_weight_is_a_view(fast.blks[1].attention)
    with torch.no_grad():
        assert_close(fast(tokens, segments, valid_lens), ref(tokens, segments, valid_lens), atol=1e-5)
        fast.blks[1].attention.W_v.bias.add_(1.0)      # an in-place update (an optimizer step)
        ref.blks[1].attention.W_v.bias.add_(1.0)
        assert_close(fast(tokens, segments, valid_lens), ref(tokens, segments, valid_lens), atol=1e-5)
        ref64, fast64 = ref.double(), fast.double()    # a cast moves each Parameter: packed again
        assert _qkv_weight_is_a_view(fast64.blks[0].attention)
        assert_close(fast64(tokens, segments, valid_lens), ref64(tokens, segments, valid_lens), atol=1e-10)
    fast64.load_state_dict(ref64.state_dict(), assign=True)     # new Parameters: packed again
    assert fast64.blks[0].attention.W_q.weight is not ref64.blks[0].attention.W_q.weight
    assert _qkv_weight_is_a_view(fast64.blks[0].attention)
    with torch.no_grad():
        assert_close(fast64(tokens, segments, valid_lens), ref64(tokens, segments, valid_lens), atol=1e-10)


@pytest.mark.parametrize("backend", available_backends())
def test_models_built_or_cast_in_inference_mode_run(backend):
    """Made under torch.inference_mode (e.g. loaded inside a serving block), the Parameters are
    inference tensors; packing Q/K/V must keep them so (a normal tensor as such a Parameter's
    .data made every later view of it raise "Inference tensors do not track version counter")."""
    cfg = encoder_config()
    tokens, segments = random_inputs(B, L, 50)
    valid_lens = torch.tensor([4, 13, 7])
    with torch.inference_mode():
        torch.manual_seed(0)
        ref = R.BERTEncoder(**cfg).eval()
        fast = FastBERTEncoder(**cfg, backend=backend).eval()
        fast.load_state_dict(ref.state_dict())
        converted = optimize(copy.deepcopy(ref), backend)
        for model in (fast, converted):
            assert _qkv_weight_is_a_view(model.blks[0].attention)
            assert_close(model(tokens, segments, valid_lens), ref(tokens, segments, valid_lens), atol=1e-4)
    # Made normally and cast in inference mode (the cast repacks Q/K/V).
    ref, fast = encoder_pair(cfg, backend=backend)
    with torch.inference_mode():
        ref.double(), fast.double()
        assert_close(fast(tokens, segments, valid_lens), ref(tokens, segments, valid_lens), atol=1e-6)


def test_packed_state_dict_saves_and_loads_with_torch_save_and_safetensors(tmp_path):
    ref, fast = encoder_pair(encoder_config(num_layers=1))
    path = tmp_path / "fast.pt"
    torch.save(fast.state_dict(), path)
    reloaded = R.BERTEncoder(**encoder_config(num_layers=1))
    reloaded.load_state_dict(torch.load(path), strict=True)
    assert all(torch.equal(t, ref.state_dict()[name]) for name, t in reloaded.state_dict().items())
    safetensors = pytest.importorskip("safetensors.torch", reason="safetensors is not installed")
    safetensors.save_file(fast.state_dict(), tmp_path / "fast.safetensors")
    loaded = safetensors.load_file(tmp_path / "fast.safetensors")
    assert all(torch.equal(loaded[name], t) for name, t in ref.state_dict().items())


def test_pack_qkv_after_optimize_keeps_the_shared_modules_working():
    import bert_fast

    torch.manual_seed(0)
    model = R.BERTEncoder(**encoder_config()).eval()
    tokens, segments = random_inputs(B, L, 50)
    valid_lens = torch.tensor([3, 13, 7])
    original_W_k = model.blks[0].attention.W_k           # optimize() adopts this very module
    x = torch.randn(5, original_W_k.in_features)
    with torch.no_grad():
        expected, expected_projection = model(tokens, segments, valid_lens), original_W_k(x)
    fast = bert_fast.optimize(model)                     # packs the adopted W_q/W_k/W_v in place
    assert fast.blks[0].attention.W_k is original_W_k and _qkv_weight_is_a_view(fast.blks[0].attention)
    with torch.no_grad():
        assert_close(fast(tokens, segments, valid_lens), expected, atol=1e-5)
        assert torch.equal(original_W_k(x), expected_projection)


@pytest.mark.parametrize("skip_padding", [False, True], ids=["exact", "skip_padding"])
@pytest.mark.parametrize("backend", available_backends())
def test_output_can_be_edited_in_place_as_the_reference_allows(backend, skip_padding):
    """Autograd forbids in-place edits of an op's output that is a view; the reference's output
    is none, so ours must not be either (a user's ``out.mul_()`` or ``out[mask] = 0``)."""
    ref, fast = encoder_pair(encoder_config(), backend=backend, skip_padding=skip_padding)
    tokens, segments = random_inputs(B, L, 50)
    valid_lens = torch.tensor([4, 13, 9])
    # Valid positions only: skip_padding's padded rows are zeros by design.
    valid = (torch.arange(L)[None, :] < valid_lens[:, None])[..., None]
    for model in (ref, fast):
        out = model(tokens, segments, valid_lens)
        out.mul_(2.0)
        (out * valid).sum().backward()
    grads = dict(ref.named_parameters())
    for name, param in fast.named_parameters():
        if grads[name].grad is not None:
            assert_close(param.grad, grads[name].grad, atol=1e-4, rtol=1e-4, what=f"grad {name}")


@pytest.mark.parametrize("backend", available_backends())
@pytest.mark.parametrize("how", ["backward", "grad", "grad_allow_unused"])
def test_double_backward_runs_on_torch_and_says_it_is_unsupported_elsewhere(backend, how):
    """A gradient penalty through the whole encoder (create_graph=True, then differentiated
    again): the torch path gives the reference's with the forward under SDPA's math kernel; the
    fused kernels have no second derivative and must say so, also to autograd.grad (which
    returned None, or zeros with materialize_grads, where the error node was not tied to the
    weights), never drop the terms."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    ref, fast = encoder_pair(encoder_config(num_layers=1), backend=backend)
    tokens, segments = random_inputs(B, L, 50)

    def penalty_grad(encoder):
        with sdpa_kernel(SDPBackend.MATH):
            out = encoder(tokens, segments, torch.tensor([4, 13, 9]))
        weight = torch.sin(torch.arange(out.numel(), dtype=out.dtype)).view_as(out)
        grad, = torch.autograd.grad((out * weight).sum(), encoder.token_embedding.weight, create_graph=True)
        penalty = grad.pow(2).sum()
        target = encoder.blks[0].ffn.dense1.weight
        if how == "backward":
            penalty.backward()
            return target.grad
        return torch.autograd.grad(penalty, target, allow_unused=how == "grad_allow_unused")[0]

    if backend in ("torch", "auto"):        # auto: torch for these CPU inputs
        assert_close(penalty_grad(fast), penalty_grad(ref), atol=1e-3, rtol=1e-4, what="second derivative")
        return
    with pytest.raises(NotImplementedError, match=r"double backward .* not supported .* backend='torch'"):
        penalty_grad(fast)


@pytest.mark.parametrize("tracer", ["jit.trace", "make_fx"])
@pytest.mark.parametrize("backend", available_backends())
def test_traced_forward_is_not_specialised_on_the_traced_valid_lens(backend, tracer):
    """The eager path reads CPU valid_lens on the host to leave out work (no query sees no key):
    never while tracing, or the traced graph would keep that choice for every later input."""
    import warnings
    from torch.fx.experimental.proxy_tensor import make_fx
    torch.manual_seed(0)
    encoder = FastBERTEncoder(**encoder_config(num_heads=2, head_dim=8, num_layers=2, vocab_size=50),
                              backend=backend, check_inputs=False).eval()
    tokens, segments = random_inputs(2, 6, 50)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")        # jit.trace's warnings about the traced Python
        if tracer == "jit.trace":
            traced = torch.jit.trace(encoder, (tokens, segments, torch.tensor([3.0, 6.0])), check_trace=False)
        else:
            traced = make_fx(lambda *args: encoder(*args))(tokens, segments, torch.tensor([3.0, 6.0]))
    empty_first = torch.tensor([0.0, 6.0])           # its queries see no key: uniform attention
    assert_close(traced(tokens, segments, empty_first), encoder(tokens, segments, empty_first), 1e-6,
                 what="traced output, a sequence with valid_len 0")


@pytest.mark.parametrize("backend", [b for b in available_backends() if b in ("triton", "cuda")])
def test_jit_trace_records_the_kernels(backend):
    """torch.jit.trace records the registered ops (the eager launchers' Triton launches would be
    invisible to it: the traced graph would allocate each output and never fill it). Through the
    kernels: on a GPU, else in Triton's interpreter."""
    import contextlib
    import warnings
    from bert_fast.ops._triton import HAS_TRITON, interpreting
    if not HAS_TRITON or not (torch.cuda.is_available() or interpreting()):
        pytest.skip("needs the Triton kernels (a GPU, or TRITON_INTERPRET=1)")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    encoder = FastBERTEncoder(**encoder_config(num_heads=2, head_dim=8, num_layers=2, vocab_size=50),
                              backend=backend, check_inputs=False).to(device).eval()
    tokens, segments = (t.to(device) for t in random_inputs(2, 6, 50))
    on_kernels = contextlib.nullcontext() if device == "cuda" else interpreted_kernels()
    with on_kernels, torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        traced = torch.jit.trace(encoder, (tokens, segments, torch.tensor([3.0, 6.0], device=device)),
                                 check_trace=False)
        recorded = {node.kind() for node in traced.inlined_graph.nodes() if node.kind().startswith("bert_fast::")}
        layernorm = "bert_fast::ext_add_layernorm_fwd" if backend == "cuda" else "bert_fast::add_layernorm_fwd"
        assert {layernorm, "bert_fast::attention_fwd"} <= recorded, recorded
        tokens, segments = (t.to(device) for t in random_inputs(2, 6, 50))      # new inputs
        valid_lens = torch.tensor([0.0, 5.0], device=device)
        assert_close(traced(tokens, segments, valid_lens), encoder(tokens, segments, valid_lens), 1e-5,
                     what="traced output on new inputs")


@pytest.mark.parametrize("backend", available_backends())
def test_jit_traced_encoder_keeps_the_value_check(backend):
    """check_inputs=True under torch.jit.trace: the check is recorded as its op (as under
    torch.compile) and runs at every call of the traced graph, with its message."""
    import warnings
    torch.manual_seed(0)
    encoder = FastBERTEncoder(**encoder_config(num_heads=2, head_dim=8, num_layers=2, vocab_size=50),
                              backend=backend).eval()
    tokens, segments = random_inputs(2, 6, 50)
    valid_lens = torch.tensor([3.0, 6.0])
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        traced = torch.jit.trace(encoder, (tokens, segments, valid_lens), check_trace=False)
        assert "bert_fast::check_encoder_values" in {node.kind() for node in traced.inlined_graph.nodes()}
        assert_close(traced(tokens, segments, valid_lens), encoder(tokens, segments, valid_lens), 1e-5)
        tokens[0, 0] = 50
        with pytest.raises(RuntimeError, match=r"token ids must be in \[0, 50\)"):
            traced(tokens, segments, valid_lens)


# Modules the fast path reads the Parameters of (unless they must be called) and modules it calls.
HOOKED_MODULES = ["token_embedding", "segment_embedding", "blks.0.attention.W_q", "blks.0.attention.W_k",
                  "blks.1.attention.W_v", "blks.0.attention.W_o", "blks.1.ffn.dense1", "blks.0.ffn.dense2",
                  "blks.0.addnorm1.ln", "blks.1.addnorm2.dropout", "blks.0.attention", "blks.1.ffn", "blks.0"]


def _shift(module, args, output):
    return output * 1.5 + 0.25


@pytest.mark.parametrize("skip_padding", [False, True], ids=["exact", "skip_padding"])
@pytest.mark.parametrize("backend", available_backends())
@pytest.mark.parametrize("where", HOOKED_MODULES)
def test_hooks_run_as_in_the_reference(where, backend, skip_padding):
    """The fast modules read most submodules' Parameters instead of calling them (one packed QKV
    GEMM, the fused add-norm, the bias+activation GEMM, the embedding sum): a hook on one of them
    makes the module call it, so it runs and changes values and gradients as in the reference.
    (Under skip_padding a hook on a block sees the packed valid tokens: this one works per token.)"""
    ref, fast = encoder_pair(encoder_config(num_layers=2), backend=backend, skip_padding=skip_padding)
    ref.train(), fast.train()       # dropout 0: gradients comparable
    tokens, segments = random_inputs(B, L, 50)
    valid_lens = torch.tensor([5.0, 13.0, 1.0])
    calls = []
    for model in (ref, fast):
        model.get_submodule(where).register_forward_hook(lambda *args: calls.append(1) or _shift(*args))
    outputs = []
    for model in (ref, fast):
        out = model(tokens, segments, valid_lens)
        out.square().sum().backward()
        outputs.append(out)
    assert len(calls) == 2, f"the hook on {where} ran {len(calls) - 1} times in the fast encoder, not once"
    valid = (torch.arange(L)[None, :] < valid_lens[:, None])[..., None]
    assert_close(outputs[1] * valid, outputs[0] * valid, 1e-4, what=f"output, a hook on {where}")
    if not skip_padding:
        for (name, p), q in zip(ref.named_parameters(), fast.parameters()):
            assert (p.grad is None) == (q.grad is None), name
            if p.grad is not None:
                assert_close(q.grad, p.grad, 1e-3, rtol=1e-4, what=f"grad {name}, a hook on {where}")


class _LoRALinear(torch.nn.Linear):
    """An nn.Linear subclass with a forward of its own, as adapter libraries make."""

    def forward(self, x):
        return super().forward(x) + 0.5 * x[..., :self.out_features].flip(-1)


class _ScaledNorm(torch.nn.LayerNorm):
    def forward(self, x):
        return 0.5 * super().forward(x)


@pytest.mark.parametrize("backend", available_backends())
def test_linear_and_layernorm_subclasses_are_called(backend):
    """Subclasses with a forward of their own (put in after construction, or adopted by
    optimize()) are called, not read as a plain Linear / LayerNorm."""
    ref, fast = encoder_pair(encoder_config(num_layers=1), backend=backend)
    for model in (ref, fast):
        attention = model.blks[0].attention
        lora = _LoRALinear(attention.W_v.in_features, attention.W_v.out_features)
        lora.load_state_dict(attention.W_v.state_dict())
        attention.W_v = lora
        model.blks[0].addnorm2.ln = _ScaledNorm(model.blks[0].addnorm2.ln.normalized_shape)
    tokens, segments = random_inputs(B, L, 50)
    valid_lens = torch.tensor([5, 13, 0])
    with torch.no_grad():
        assert_close(fast(tokens, segments, valid_lens), ref(tokens, segments, valid_lens), 1e-4,
                     what="output with a LoRA-style W_v and a LayerNorm subclass")


@pytest.mark.parametrize("backend", available_backends())
def test_a_forward_set_on_an_instance_is_called(backend):
    """accelerate's hooks replace a module's forward on the instance: such a module is called."""
    ref, fast = encoder_pair(encoder_config(num_layers=1), backend=backend)
    for model in (ref, fast):
        for where in ("blks.0.ffn.dense1", "blks.0.attention.W_k", "blks.0.addnorm2.ln", "segment_embedding"):
            module = model.get_submodule(where)
            module.forward = (lambda plain: lambda x: plain(x) * 1.5)(module.forward)
    tokens, segments = random_inputs(B, L, 50)
    valid_lens = torch.tensor([5, 13, 0])
    with torch.no_grad():
        assert_close(fast(tokens, segments, valid_lens), ref(tokens, segments, valid_lens), 1e-4,
                     what="output with forwards set on instances")


@pytest.mark.parametrize("backend", available_backends())
@pytest.mark.parametrize("which", ["W_q", "W_k", "W_v"])
def test_weights_changed_in_place_before_the_backward(backend, which):
    """A weight changed in place between forward and backward (an optimizer step or an EMA
    update before the backward of a kept graph): autograd raises, as for the reference, or the
    gradient is the one of the forward's weights; never one of the new weights. The fused layer
    reads W_q/W_k/W_v through one packed view, which shares W_q's version counter only."""
    torch.manual_seed(0)
    config = encoder_config(dropout=0.0)
    encoder = FastBERTEncoder(**config, backend=backend).train()
    tokens, segments = random_inputs(B, L, config["vocab_size"])
    out = encoder(tokens, segments, torch.tensor([4.0, 13.0, 7.0]))
    weight = torch.sin(torch.arange(out.numel(), dtype=out.dtype)).view_as(out)
    table = encoder.token_embedding.weight
    expected = torch.autograd.grad((out * weight).sum(), table, retain_graph=True)[0]
    with torch.no_grad():
        getattr(encoder.blks[1].attention, which).weight.mul_(2.0)
    try:
        grad = torch.autograd.grad((out * weight).sum(), table)[0]
    except RuntimeError as error:
        assert "modified by an inplace operation" in str(error)
    else:
        assert_close(grad, expected, FLOOR[torch.float32], what=f"gradient after {which} changed in place")


def _prune_w_q(attention):
    import torch.nn.utils.prune  # noqa: F401  (not imported by torch.nn.utils)
    torch.nn.utils.prune.random_unstructured(attention.W_q, "weight", amount=0.5)


def _prune_w_k_bias(attention):
    import torch.nn.utils.prune  # noqa: F401
    torch.nn.utils.prune.l1_unstructured(attention.W_k, "bias", amount=0.5)


def _parametrize_w_k(attention):
    class Half(torch.nn.Module):
        def forward(self, weight):
            return weight * 0.5

    torch.nn.utils.parametrize.register_parametrization(attention.W_k, "weight", Half())


def _weight_norm_w_v(attention):
    torch.nn.utils.parametrizations.weight_norm(attention.W_v)


@pytest.mark.parametrize("backend", available_backends())
@pytest.mark.parametrize("reparametrize", [_prune_w_q, _prune_w_k_bias, _parametrize_w_k, _weight_norm_w_v],
                         ids=lambda f: f.__name__.strip("_"))
def test_pruned_and_parametrized_projections(backend, reparametrize):
    """Pruning, a parametrization or weight_norm on W_q/W_k/W_v takes the tensor out of the
    Linear's Parameters: the fast module calls the Linear (values and gradients as the
    reference's) and .double(), .to() and load_state_dict, which pack the QKV Parameters, leave
    it alone (they raised KeyError: 'weight')."""
    ref, fast = encoder_pair(encoder_config(num_layers=2), backend=backend)
    for encoder in (ref, fast):
        torch.manual_seed(0)
        reparametrize(encoder.blks[0].attention)
        encoder.double()
    fast.load_state_dict(ref.state_dict())
    compare_forward_backward(ref, fast, *random_inputs(B, L, 50), torch.tensor([4.0, 13.0, 7.0], dtype=torch.float64),
                             atol=1e-10)


@pytest.mark.parametrize("backend", available_backends())
def test_each_dropout_follows_its_own_module_mode(backend):
    """The reference calls its Dropout modules, so each follows its own mode: MC dropout (an
    eval encoder, its Dropout modules in train mode) drops, and an encoder in train mode with
    its Dropout modules in eval drops nothing. The fast modules read the block's mode instead:
    MC dropout silently did nothing."""
    config = encoder_config(dropout=0.2)
    ref, fast = encoder_pair(config, backend=backend)
    tokens, segments = random_inputs(B, L, config["vocab_size"])
    valid_lens = torch.tensor([4.0, 13.0, 7.0])
    with torch.no_grad():
        plain = fast(tokens, segments, valid_lens)
        for dropout in (m for m in fast.modules() if isinstance(m, torch.nn.Dropout)):
            dropout.train()
        assert max_err(fast(tokens, segments, valid_lens), plain) > 1e-2, "MC dropout must drop"
        for encoder in (ref, fast):
            encoder.train()
            for dropout in (m for m in encoder.modules() if isinstance(m, torch.nn.Dropout)):
                dropout.eval()
        assert_close(fast(tokens, segments, valid_lens), ref(tokens, segments, valid_lens), FLOOR[torch.float32],
                     what="train mode, every Dropout module in eval")


@pytest.mark.parametrize("backend", ["triton", "cuda"])
@pytest.mark.parametrize("copy_kind", ["deepcopy", "pickle"])
def test_a_copied_encoders_fused_layers_read_the_packed_qkv_in_place(backend, copy_kind, monkeypatch):
    """After copy.deepcopy or pickling, the kept packing names the old addresses: the fused
    layer concatenated W_q, W_k, W_v on every call (the per-op path made the packing anew; found
    by review). It is made anew there too, read in place: no concatenation."""
    import io
    from bert_fast import ops
    if backend not in available_backends():
        pytest.skip(f"backend {backend} unavailable")
    _, fast = encoder_pair(encoder_config(), backend=backend)
    if copy_kind == "deepcopy":
        fast = copy.deepcopy(fast)
    else:
        buffer = io.BytesIO()
        torch.save(fast, buffer)
        buffer.seek(0)
        fast = torch.load(buffer, weights_only=False)
    seen = []
    real = ops.encoder_layer
    monkeypatch.setattr(ops, "encoder_layer", lambda spec, x, mask, params, packed, recompute=False: seen.append(packed)
                        or real(spec, x, mask, params, packed))
    tokens, segments = random_inputs(B, L, 50)
    with torch.no_grad():
        fast(tokens, segments, torch.tensor([4, 13, 0]))
    assert len(seen) == len(fast.blks)
    for blk, (weight, _) in zip(fast.blks, seen):
        assert weight is not None and weight.data_ptr() == blk.attention.W_q.weight.data_ptr()


@pytest.mark.parametrize("skip_padding", [False, True], ids=["exact", "skip_padding"])
@pytest.mark.parametrize("backend", available_backends())
def test_a_nan_in_a_query_weight_propagates_as_in_the_reference(backend, skip_padding):
    """PyTorch's CPU attention kernel, given no mask and fewer than 16 keys, makes a query whose
    scores are NaN a row of zeros (torch 2.13), where the reference's softmax gives NaN: a NaN
    weight gave a finite output (found by review). With a zero additive mask it propagates."""
    cfg = encoder_config(num_layers=1)
    ref, fast = encoder_pair(cfg, backend=backend, skip_padding=skip_padding)
    with torch.no_grad():
        for model in (ref, fast):
            model.blks[0].attention.W_q.weight[0, 0] = float("nan")
    tokens, segments = random_inputs(2, 8, 50)
    valid_lens = torch.tensor([8, 8]) if skip_padding else None
    for model in (ref, fast):
        model.train()
    outputs = [model(tokens, segments, valid_lens) for model in (ref, fast)]
    for out in outputs:
        out.sum().backward()
    assert outputs[0].isnan().sum() == outputs[1].isnan().sum() == outputs[0].numel()
    grads = [{n: p.grad.isnan().sum().item() for n, p in m.named_parameters() if p.grad is not None} for m in (ref, fast)]
    assert grads[0] == grads[1]


def test_mlm_positions_of_another_batch_raise():
    """FastMaskLM's (B, P) gather would broadcast a (1, P) pred_positions over the batch, where
    the book's gather raises: it raises, saying the shape it needs."""
    cfg = encoder_config(num_layers=1)
    hidden = cfg["num_hiddens"]
    model = FastBERTModel(**cfg, hid_in_features=hidden, mlm_in_features=hidden, nsp_in_features=hidden).eval()
    tokens, segments = random_inputs(2, 8, 50)
    for bad in (torch.tensor([[0, 1, 2]]), torch.tensor([0, 1, 2])):
        with pytest.raises(ValueError, match=r"pred_positions must have shape \(batch, num_predictions\) with batch 2"):
            model(tokens, segments, None, bad)


def test_mlm_positions_of_a_wrong_dtype_device_or_range_raise():
    """Positions of a float or bool dtype (a bool tensor would index as a mask), on another device
    (a meta tensor gave uninitialised memory), or out of [-L, L) (a device-side assert on CUDA)
    raise, saying what is allowed; negative ones count from the end, as in the reference; with
    check_inputs=False only the value check is off (PyTorch's indexing error on the CPU)."""
    cfg = encoder_config(num_layers=1)
    hidden = cfg["num_hiddens"]
    ref = R.BERTModel(**cfg, hid_in_features=hidden, mlm_in_features=hidden, nsp_in_features=hidden).eval()
    model = FastBERTModel(**cfg, hid_in_features=hidden, mlm_in_features=hidden, nsp_in_features=hidden).eval()
    model.load_state_dict(ref.state_dict())
    tokens, segments = random_inputs(2, 8, 50)
    for bad, error, message in ((torch.tensor([[0.0, 1.0], [2.0, 3.0]]), TypeError, "must be torch.int64"),
                                (torch.tensor([[True, False], [True, True]]), TypeError, "must be torch.int64"),
                                (torch.tensor([[0, 1], [2, 3]], device="meta"), ValueError, "device"),
                                ([[0, 1], [2, 3]], TypeError, "must be a tensor"),
                                (torch.tensor([[0, 8], [2, 3]]), ValueError, r"in \[-8, 8\).*\[0, 8\]"),
                                (torch.tensor([[0, 1], [-9, 3]]), ValueError, r"in \[-8, 8\).*\[-9, 3\]")):
        with pytest.raises(error, match=message):
            model(tokens, segments, None, bad)
    model.encoder.check_inputs = False
    with pytest.raises(TypeError, match="must be torch.int64"):
        model(tokens, segments, None, torch.tensor([[0.0, 1.0], [2.0, 3.0]]))
    with pytest.raises(IndexError):
        model(tokens, segments, None, torch.tensor([[0, 8], [2, 3]]))
    model.encoder.check_inputs = True
    allowed = torch.tensor([[-8, 7], [-1, 0]], dtype=torch.int32)
    assert_close(model(tokens, segments, None, allowed)[1], ref(tokens, segments, None, allowed)[1], atol=1e-5)


@pytest.mark.parametrize("backend", available_backends())
def test_a_batch_without_a_valid_token_gives_every_parameter_a_gradient(backend):
    """skip_padding with every valid_len 0 (a data-parallel rank's share can be that): every
    Parameter gets a gradient, zeros where nothing reached it, on every backend. The torch
    backend's attention gave an empty context cut from the QKV projection: its weights got None,
    and FSDP2's reduce-scatter then sent fewer bytes on that rank (gloo aborted the process)."""
    encoder = FastBERTEncoder(**encoder_config(), skip_padding=True, learn_pos_embedding=True,
                              backend=backend).train()
    tokens, segments = random_inputs(2, 5, encoder_config()["vocab_size"])
    encoder(tokens, segments, torch.tensor([0, 0])).sum().backward()
    missing = [name for name, p in encoder.named_parameters() if p.grad is None]
    assert not missing, missing
    assert all(not p.grad.any() for name, p in encoder.named_parameters() if "attention" in name)


@pytest.mark.parametrize("change", ["reassigned", "quantized"])
def test_q_k_v_parameters_replaced_after_construction_are_freed(change):
    """The packed QKV that inference reads names W_q/W_k/W_v and views their buffer: once they
    are replaced (a new Parameter, quantize_dynamic's modules, FSDP2's shards) the next call
    forgets it, so it keeps no copy of them alive (12 MB at H 512, 4 layers, it did)."""
    import gc
    import weakref

    encoder = FastBERTEncoder(**encoder_config(), backend="torch").eval()
    old = [weakref.ref(blk.attention.W_q.weight) for blk in encoder.blks]
    if change == "reassigned":
        for blk in encoder.blks:
            for name in ("W_q", "W_k", "W_v"):
                linear = getattr(blk.attention, name)
                linear.weight = torch.nn.Parameter(linear.weight.detach().clone())
    else:
        torch.ao.quantization.quantize_dynamic(encoder, {torch.nn.Linear}, inplace=True)
    tokens, segments = random_inputs(2, 5, encoder_config()["vocab_size"])
    with torch.no_grad():
        encoder(tokens, segments, torch.tensor([3, 5]))
    gc.collect()
    assert not any(ref() is not None for ref in old)
