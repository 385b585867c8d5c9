"""optimize(): swap reference-style encoders/blocks, sharing the very same Parameters."""

import copy
import warnings

import pytest
import torch
from torch import nn

import bert_fast
from bert_fast import FastBERTEncoder, FastEncoderBlock
from bert_fast import reference as R
from bert_fast.backend import available_backends
from tests.helpers import assert_close, encoder_config, random_inputs

B, L = 3, 11


def bert_model(dropout=0.0):
    cfg = encoder_config(dropout=dropout)
    H = cfg["num_hiddens"]
    return R.BERTModel(**cfg, hid_in_features=H, mlm_in_features=H, nsp_in_features=H).eval()


def inputs():
    tokens, segments = random_inputs(B, L, 50)
    return tokens, segments, torch.tensor([4.0, 11.0, 0.0]), torch.tensor([[1, 2], [3, 10], [0, 0]])


def test_bert_model_swapped_outputs_equal_parameters_shared():
    model = bert_model()
    params_before = list(model.parameters())
    names_before = [n for n, _ in model.named_parameters()]
    args = inputs()
    expected = model(*args)
    assert bert_fast.optimize(model) is model
    assert isinstance(model.encoder, FastBERTEncoder)
    params_after = list(model.parameters())
    assert len(params_after) == len(params_before)
    assert all(a is b for a, b in zip(params_after, params_before))
    assert [n for n, _ in model.named_parameters()] == names_before
    for a, b in zip(model(*args), expected):
        assert_close(a, b, atol=1e-4)


def test_optimizer_made_before_the_swap_keeps_training():
    model, twin = bert_model(), bert_model()
    twin.load_state_dict(model.state_dict())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    opt_twin = torch.optim.SGD(twin.parameters(), lr=0.1)
    bert_fast.optimize(model)
    args = inputs()
    for m, o in ((model, opt), (twin, opt_twin)):
        m.train()
        o.zero_grad()
        _, mlm, nsp = m(*args)
        (mlm.square().mean() + nsp.square().mean()).backward()
        o.step()
    for (name, a), b in zip(model.named_parameters(), twin.parameters()):
        assert_close(a, b, atol=1e-5, what=name)
    assert not torch.equal(model.encoder.blks[0].attention.W_q.weight,
                           bert_model().encoder.blks[0].attention.W_q.weight)


def test_model_that_is_the_encoder_itself():
    enc = R.BERTEncoder(**encoder_config()).eval()
    tokens, segments, valid_lens, _ = inputs()
    expected = enc(tokens, segments, valid_lens)
    fast = bert_fast.optimize(enc, skip_padding=True)
    assert isinstance(fast, FastBERTEncoder) and fast.skip_padding
    assert fast.token_embedding is enc.token_embedding and fast.pos_embedding is enc.pos_embedding
    mask = torch.arange(L)[None] < valid_lens[:, None]
    assert_close(fast(tokens, segments, valid_lens)[mask], expected[mask], atol=1e-4)


def test_training_mode_and_dropout_carried_over():
    model = bert_model(dropout=0.3).train()
    bert_fast.optimize(model)
    blk = model.encoder.blks[0]
    assert model.encoder.training and blk.training
    assert blk.attention.dropout.p == blk.addnorm1.dropout.p == 0.3


def book_copy(module, name):
    """Re-class ``module`` as a notebook copy of the book's class: same name and attributes,
    no relation to bert_fast's classes."""
    module.__class__ = type(name, (nn.Module,), {"forward": type(module).forward})
    return module


def test_notebook_copies_recognised_by_structure():
    enc = R.BERTEncoder(**encoder_config()).eval()
    for blk in enc.blks:
        book_copy(blk, "EncoderBlock")
    book_copy(enc, "BERTEncoder")
    assert not isinstance(enc, R.BERTEncoder)
    tokens, segments, valid_lens, _ = inputs()
    expected = enc(tokens, segments, valid_lens)
    holder = nn.ModuleDict({"bert": enc})
    bert_fast.optimize(holder)
    assert isinstance(holder["bert"], FastBERTEncoder)
    assert_close(holder["bert"](tokens, segments, valid_lens), expected, atol=1e-4)


def test_standalone_blocks_swapped_with_gelu_and_no_bias():
    blocks = nn.Sequential(*[R.EncoderBlock(32, 32, 32, 32, [32], 32, 64, 4, 0.0) for _ in range(2)]).eval()
    blocks[1].ffn.relu = nn.GELU(approximate="tanh")

    class Stack(nn.Module):      # how the book's TransformerEncoder drives its blocks
        def __init__(self):
            super().__init__()
            self.blks = blocks

        def forward(self, X, valid_lens):
            for blk in self.blks:
                X = blk(X, valid_lens)
            return X

    model = Stack()
    X, valid_lens = torch.randn(2, 6, 32), torch.tensor([[1, 2, 3, 0, 6, 6], [6, 5, 4, 3, 2, 1]])
    expected = model(X, valid_lens)
    bert_fast.optimize(model)
    assert all(isinstance(b, FastEncoderBlock) for b in model.blks)
    assert model.blks[1].ffn.activation == "gelu_tanh"
    assert model.blks[0].attention.W_q.bias is None
    assert_close(model(X, valid_lens), expected, atol=1e-5)


def test_unsupported_variant_left_untouched_with_warning():
    model = nn.Module()
    model.block = R.EncoderBlock(8, 8, 8, 8, [5, 8], 8, 16, 2, 0.0)   # norm over (L, H)
    with pytest.warns(UserWarning, match=r"block \(EncoderBlock\) looks like a reference-style EncoderBlock .*norm_shape \[5, 8\]"):
        bert_fast.optimize(model)
    assert isinstance(model.block, R.EncoderBlock)


def test_a_block_fsdp_wrapped_first_is_left_with_the_order_to_call_them_in():
    """fully_shard gives a module the class FSDP<name> (a subclass): optimize() leaves it and
    says to call optimize() first."""
    model = nn.Module()
    model.block = type("FSDPEncoderBlock", (R.EncoderBlock,), {})(8, 8, 8, 8, [8], 8, 16, 2, 0.0)
    with pytest.warns(UserWarning, match=r"class name 'FSDPEncoderBlock'; call optimize\(\) before fully_shard"):
        bert_fast.optimize(model)
    assert type(model.block).__name__ == "FSDPEncoderBlock"


def test_encoder_with_unsupported_block_keeps_its_other_blocks_fast():
    enc = R.BERTEncoder(**encoder_config()).eval()
    enc.blks[1].ffn.relu = nn.SiLU()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = bert_fast.optimize(enc)
    assert out is enc
    assert any("SiLU" in str(w.message) for w in caught)
    assert isinstance(enc.blks[0], FastEncoderBlock) and isinstance(enc.blks[1], R.EncoderBlock)


def test_other_modules_and_bad_arguments():
    model = nn.Sequential(nn.Linear(4, 4))
    with pytest.warns(UserWarning, match="found nothing to make fast in Sequential"):
        assert bert_fast.optimize(model) is model and isinstance(model[0], nn.Linear)
    with pytest.raises(TypeError, match="expects an nn.Module"):
        bert_fast.optimize("model")
    with pytest.raises(ValueError, match="unknown backend 'tpu'"):
        bert_fast.optimize(bert_model(), backend="tpu")
    with pytest.raises(TypeError, match="skip_padding must be True or False, got 'yes'"):
        bert_fast.optimize(bert_model(), skip_padding="yes")


def test_fast_parts_used_on_their_own_take_the_options():
    """A fast attention or add-norm outside a block is ours: optimize() gives it the backend and
    finds something (no "nothing to make fast" warning)."""
    parts = nn.ModuleDict({"attention": bert_fast.FastMultiHeadAttention(8, 8, 8, 8, 2, 0.0, backend="torch"),
                           "addnorm": bert_fast.FastAddNorm([8], 0.0, backend="torch")})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        bert_fast.optimize(parts, backend="triton")
    assert parts["attention"].backend == parts["addnorm"].backend == "triton"


def test_optimize_is_idempotent():
    model = bert_model()
    bert_fast.optimize(model)
    enc = model.encoder
    bert_fast.optimize(model)
    assert model.encoder is enc


def test_optimize_again_applies_its_options_to_fast_modules(monkeypatch):
    """Fast modules already in the model (an earlier optimize(), or built directly) take the
    options of the last optimize() call, as a swapped encoder does; graphs captured under the
    old options are dropped."""
    import bert_fast.convert as convert
    cleared = []
    monkeypatch.setattr(convert, "clear_cuda_graphs", lambda module: cleared.append(module))
    model = bert_model()
    args = inputs()
    expected = model(*args)
    bert_fast.optimize(model, backend="triton")
    enc = model.encoder

    def backends():
        return {m.backend for m in enc.modules() if hasattr(m, "backend")}

    assert backends() == {"triton"} and not enc.skip_padding and not enc.cuda_graphs
    bert_fast.optimize(model, backend="torch", skip_padding=True, cuda_graphs=True)
    assert model.encoder is enc and backends() == {"torch"} and enc.skip_padding and enc.cuda_graphs
    assert cleared == [enc]
    bert_fast.optimize(model, backend="torch", skip_padding=True, cuda_graphs=True)
    assert cleared == [enc]                 # same options: the graphs are kept
    bert_fast.optimize(model, backend="torch")
    assert not enc.skip_padding and not enc.cuda_graphs and cleared == [enc, enc]
    for a, b in zip(model(*args), expected):
        assert_close(a, b, atol=1e-4)
    block = FastEncoderBlock(**{k: v for k, v in encoder_config().items()
                                if k not in ("vocab_size", "num_layers", "max_len")}, use_bias=True)
    assert bert_fast.optimize(nn.Sequential(block), backend="torch")[0] is block
    assert {m.backend for m in block.modules() if hasattr(m, "backend")} == {"torch"}


def test_hooks_of_the_replaced_modules_carry_over():
    """optimize() replaces the encoder, its blocks, their attention, AddNorms and FFN by fast
    modules taking the same arguments: their hooks move with them (the same dicts: the handles
    still remove them), and hooks on the modules adopted (Linears, LayerNorms, dropouts) stay.
    A hook on a module with no fast counterpart (the attention weights' DotProductAttention)
    leaves the block as it is, with a warning."""
    model = bert_model()
    args = inputs()
    with torch.no_grad():
        plain = model(*args)[0]
    calls = []
    handles = [model.encoder.get_submodule(where).register_forward_hook(
        lambda module, a, output: calls.append(where) or output * 1.25 + 0.1)
        for where in ("", "blks.0", "blks.0.attention", "blks.1.ffn", "blks.0.addnorm2", "blks.1.addnorm1.dropout",
                      "blks.1.attention.W_q")]
    with torch.no_grad():
        expected = model(*args)[0]
        hooks_run = len(calls)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            bert_fast.optimize(model)
        assert isinstance(model.encoder, FastBERTEncoder)
        calls.clear()
        assert_close(model(*args)[0], expected, 1e-4, what="output with the hooks carried over")
        assert len(calls) == hooks_run == 7
        for handle in handles:
            handle.remove()
        assert_close(model(*args)[0], plain, 1e-4, what="output once the hooks are removed")

    model = bert_model()
    model.encoder.blks[1].attention.attention.register_forward_hook(lambda *a: None)
    with pytest.warns(UserWarning, match="a hook on attention.attention, a module the fast block does not have"):
        bert_fast.optimize(model)
    assert not isinstance(model.encoder, FastBERTEncoder)


def _transpose_w_q(model):
    w = model.encoder.blks[0].attention.W_q.weight
    w.data = w.data.t()          # the same address, other strides: the packed view is stale


def _drop_w_q_bias(model):
    model.encoder.blks[0].attention.W_q.bias = None     # K and V keep theirs


def _gelu_activations(model):
    for blk in model.encoder.blks:
        blk.ffn.relu = nn.GELU()


def _tanh_activation(model):
    model.encoder.blks[1].ffn.relu = nn.Tanh()          # no fused op for it: the module is called


def _hook_on_an_activation(model):
    model.encoder.blks[0].ffn.relu.register_forward_hook(lambda module, args, out: out * 0.5)


def _token_padding_idx(model):
    model.encoder.token_embedding.padding_idx = 37      # (a token of the inputs: that row gets no gradient)


def _token_max_norm(model):
    model.encoder.token_embedding.max_norm = 0.5        # the rows read renormalised, in place


def _segment_gradient_by_frequency(model):
    model.encoder.segment_embedding.scale_grad_by_freq = True


@pytest.mark.parametrize("change", [_transpose_w_q, _drop_w_q_bias, _gelu_activations, _tanh_activation,
                                    _hook_on_an_activation, _token_padding_idx, _token_max_norm,
                                    _segment_gradient_by_frequency], ids=lambda f: f.__name__.strip("_"))
@pytest.mark.parametrize("backend", available_backends())
def test_a_model_changed_by_hand_after_optimize_computes_as_the_reference(backend, change):
    """Edits made after optimize() to what the fast modules read: a weight given another layout
    at its address (the packed QKV view kept reading the old one: 0.5 off), a Q bias removed
    (a shape error), the FFN's activation module replaced or hooked (ignored: the fast FFN kept
    its own ReLU, 0.29 off with GELU), an embedding table's padding_idx, max_norm or
    scale_grad_by_freq (ignored: the fused sum read the rows). Values (no_grad and with
    autograd), gradients and the tables (max_norm writes them) in fp64."""
    model = bert_model().double()
    reference = copy.deepcopy(model)
    bert_fast.optimize(model, backend=backend)
    for m in (model, reference):
        change(m)
    args = inputs()
    with torch.no_grad():
        for a, b in zip(model(*args), reference(*args)):
            assert_close(a, b, atol=1e-10, what="no_grad outputs")
    for m in (model, reference):
        m.train()          # dropout 0: the training path
        _, mlm, nsp = m(*args)
        (mlm.square().mean() + nsp.square().mean()).backward()
    grads = {name: p.grad for name, p in reference.named_parameters() if p.grad is not None}
    assert grads and {name for name, p in model.named_parameters() if p.grad is not None} == set(grads)
    for name, p in model.named_parameters():
        if p.grad is not None:
            assert_close(p.grad, grads[name], atol=1e-10, what=f"{name} gradient")
    assert_close(model.encoder.token_embedding.weight, reference.encoder.token_embedding.weight, atol=1e-12,
                 what="token table")


class _GeluFFN(nn.Module):
    """A book-style FFN whose activation has another name (no ``relu``)."""

    def __init__(self, ffn):
        super().__init__()
        self.dense1, self.act, self.dense2 = ffn.dense1, nn.GELU(), ffn.dense2

    def forward(self, X):
        return self.dense2(self.act(self.dense1(X)))


@pytest.mark.parametrize("ffn_change", ["no relu module", "relu a function"])
def test_a_block_whose_ffn_activation_is_not_a_module_named_relu_is_left_with_a_warning(ffn_change):
    """optimize() adopts the FFN's ``relu`` module: an FFN without one (or with a function
    there) raised AttributeError instead of the warning that leaves the block as it is."""
    model = bert_model()
    for blk in model.encoder.blks:
        if ffn_change == "no relu module":
            blk.ffn = _GeluFFN(blk.ffn)
        else:          # (as a class that sets self.relu = torch.relu before nn.Module's bookkeeping sees it)
            del blk.ffn.relu
            object.__setattr__(blk.ffn, "relu", torch.relu)
    args = inputs()
    with torch.no_grad():
        expected = model(*args)[0]
    with pytest.warns(UserWarning, match="FFN activation"):
        bert_fast.optimize(model)
    assert not isinstance(model.encoder, FastBERTEncoder)
    with torch.no_grad():
        assert_close(model(*args)[0], expected, atol=0, what="output of the model left as it was")


def test_a_fast_ffn_pickled_with_its_activation_as_a_name_loads():
    """Before the FFN's activation became its module ``relu`` it was the attribute
    ``activation`` (a name): such a pickle loads with the module made from the name."""
    from bert_fast.modules import FastPositionWiseFFN
    ffn = FastPositionWiseFFN(8, 16, 8, activation="gelu_tanh")
    state = dict(ffn.__dict__)
    state["_modules"] = {name: m for name, m in ffn._modules.items() if name != "relu"}
    state["activation"] = "gelu_tanh"
    old = FastPositionWiseFFN.__new__(FastPositionWiseFFN)
    old.__setstate__(state)
    assert old.activation == "gelu_tanh" and "activation" not in old.__dict__
    X = torch.randn(2, 3, 8)
    assert_close(old(X), ffn(X), atol=0, what="output")
