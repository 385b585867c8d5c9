"""Issue 12: no input gives a crash or a silent wrong answer, eager or under torch.compile.

The rule (bert_fast.checks): type/shape/dtype/device checks and constructor checks always run;
value checks (id ranges, NaN lengths) run unless check_inputs=False, compiled too.
"""

import math
import re
import warnings

import pytest
import torch

from bert_fast import FastBERTEncoder, FastBERTModel, FastEncoderBlock, optimize
from bert_fast import reference as R
from bert_fast.backend import available_backends

from tests.helpers import assert_close, encoder_config, encoder_pair, random_inputs
from tests.isolated import BackgroundCall, call_in_child

BACKENDS = available_backends()
V = 50


# ------------------------------------------------------------------ item 1: compiled value checks

def _describe_error(fn):
    try:
        fn()
    except Exception as error:          # noqa: BLE001 - reported to the parent as text
        return f"{type(error).__name__}: {error}"
    return "no error"


def compiled_bad_ids(backend, fullgraph):
    """In a child: a tiny encoder compiled, fed good ids, then out-of-range ones (which made
    Inductor's bounds check abort the process); each outcome as text."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    # Large enough that Inductor runs the embedding's kernel in parallel: there its bounds check
    # aborted the process (SIGABRT; with smaller inputs it raised a RuntimeError).
    config = encoder_config(num_heads=2, head_dim=32, num_layers=1, vocab_size=V, max_len=128)
    _, fast = encoder_pair(config, backend=backend)
    compiled = torch.compile(fast, fullgraph=fullgraph)
    tokens, segments = random_inputs(16, 128, V)
    valid_lens = torch.arange(16.0) * 8 + 8      # float: the NaN case below reuses the graph (an int tensor recompiled)
    outcome = {"matches_eager": bool(torch.allclose(compiled(tokens, segments, valid_lens),
                                                    fast(tokens, segments, valid_lens), atol=1e-4))}
    for name, (t, s) in {
        "token_high": (tokens.clone().index_put_((torch.tensor(0), torch.tensor(0)), torch.tensor(V)), segments),
        "token_negative": (tokens.clone().index_put_((torch.tensor(1), torch.tensor(2)), torch.tensor(-1)), segments),
        "segment_2": (tokens, segments.clone().fill_(2)),
    }.items():
        outcome[name] = _describe_error(lambda: compiled(t, s, valid_lens))
    outcome["nan_lens"] = _describe_error(lambda: compiled(tokens, segments, valid_lens.clone().index_put_((torch.tensor(3),), torch.tensor(math.nan))))
    outcome["good_after"] = _describe_error(lambda: compiled(tokens, segments, valid_lens))
    # check_inputs=False: the shape checks still run (the value checks do not).
    fast.check_inputs = False
    outcome["unchecked_bad_segments_shape"] = _describe_error(
        lambda: compiled(tokens, segments[:, :-1], valid_lens))
    return outcome


COMPILED_BACKENDS = [b for b in ("torch", "triton") if b in BACKENDS]
# An Inductor compile each, 10-25 s of one core (2026-11-28): beside the suite (started by
# conftest.py when collection ends), each in a process of its own, which an abort (as Inductor's
# bounds check once gave) fails alone.
BAD_IDS_COMPILES = {backend: BackgroundCall(compiled_bad_ids, backend, True) for backend in COMPILED_BACKENDS}


def start_background(items):
    """From conftest.py when collection ends: the compiles the selected tests will read."""
    for item in items:
        if getattr(item, "originalname", None) == "test_out_of_range_ids_raise_under_torch_compile":
            BAD_IDS_COMPILES[item.callspec.params["backend"]].start()


@pytest.mark.reads_background
@pytest.mark.parametrize("backend", COMPILED_BACKENDS)
def test_out_of_range_ids_raise_under_torch_compile(backend):
    outcome = BAD_IDS_COMPILES[backend].result()
    assert outcome["matches_eager"]
    assert outcome["token_high"].startswith(f"ValueError: token ids must be in [0, {V})"), outcome
    assert outcome["token_negative"].startswith(f"ValueError: token ids must be in [0, {V})"), outcome
    assert outcome["segment_2"].startswith("ValueError: segment ids must be 0 or 1"), outcome
    assert outcome["nan_lens"] == "ValueError: valid_lens contains NaN", outcome
    assert outcome["good_after"] == "no error", outcome
    # fullgraph: a check that fails while Dynamo traces comes out as Dynamo's Unsupported
    # ("Observed exception"), our ValueError in its text (README: Input checks).
    unchecked = outcome["unchecked_bad_segments_shape"]
    assert unchecked.startswith("Unsupported: Observed exception"), outcome
    assert "ValueError" in unchecked and "segments must have the shape of tokens" in unchecked, outcome


# ------------------------------------------------------------------ items 3 and 8: always-on checks

@pytest.mark.parametrize("check_inputs", [True, False])
@pytest.mark.parametrize("skip_padding", [True, False])
@pytest.mark.parametrize("backend", BACKENDS)
def test_shape_checks_run_with_check_inputs_off(backend, skip_padding, check_inputs):
    _, fast = encoder_pair(encoder_config(num_heads=2, head_dim=4, num_layers=1, max_len=16),
                           backend=backend, skip_padding=skip_padding, check_inputs=check_inputs)
    tokens, segments = random_inputs(3, 6, V)
    fast(tokens, segments, torch.tensor([6, 2, 4]))
    with pytest.raises(ValueError, match=r"valid_lens must have shape \(batch,\) = \(3,\)"):
        fast(tokens, segments, torch.tensor([4]))
    with pytest.raises(ValueError, match="segments must have the shape of tokens"):
        fast(tokens, segments[:, :-1], torch.tensor([6, 2, 4]))
    with pytest.raises(ValueError, match="exceeds max_len 16"):
        fast(*random_inputs(3, 17, V), None)
    with pytest.raises(ValueError, match="tokens is on meta"):
        fast(tokens.to("meta"), segments, None)


@pytest.mark.parametrize("check_inputs", [True, False])
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.int16, torch.uint8, torch.int8, torch.float32, torch.bool])
def test_only_int32_and_int64_ids(backend, dtype, check_inputs):
    _, fast = encoder_pair(encoder_config(num_heads=2, head_dim=4, num_layers=1),
                           backend=backend, check_inputs=check_inputs)
    tokens, segments = random_inputs(2, 5, V)
    with pytest.raises(TypeError, match=rf"tokens must have dtype torch.int64 \(torch.long\) or torch.int32.*got {dtype}"):
        fast(tokens.to(dtype), segments, None)
    with pytest.raises(TypeError, match=rf"segments must have dtype torch.int64 \(torch.long\) or torch.int32.*got {dtype}"):
        fast(tokens, segments.to(dtype), None)
    expected = fast(tokens, segments, None)
    torch.testing.assert_close(fast(tokens.int(), segments.int(), None), expected)


# ------------------------------------------------------------------ item 4: the block's valid_lens

@pytest.mark.parametrize("backend", BACKENDS)
def test_block_rejects_valid_lens_that_would_broadcast(backend):
    args = (8, 8, 8, 8, [8], 8, 16, 2, 0.0)
    ref = R.EncoderBlock(*args).eval()
    fast = FastEncoderBlock(*args, backend=backend).eval()
    X = torch.randn(3, 5, 8)
    with pytest.raises(Exception):
        ref(X, torch.tensor([4]))       # the reference refuses too
    for bad in (torch.tensor([4]), torch.tensor([4, 4]), torch.ones(3, 4), torch.ones(3, 5, 1)):
        with pytest.raises(ValueError, match=r"valid_lens must have shape \(batch,\) = \(3,\)"):
            fast(X, bad)
    fast(X, torch.tensor([5, 1, 3]))
    fast(X, torch.full((3, 5), 2))


# ------------------------------------------------------------------ items 5 and 6: constructors

BAD_CONSTRUCTOR_ARGS = [
    (dict(num_heads=0), ValueError, "num_heads must be a positive int, got 0"),
    (dict(num_heads=-2), ValueError, "num_heads must be a positive int, got -2"),
    (dict(num_heads=2.0), TypeError, r"num_heads must be a positive int, got 2.0 \(float\)"),
    (dict(num_heads=True), TypeError, "num_heads must be a positive int, got True"),
    (dict(num_hiddens=0, norm_shape=[0], ffn_num_input=0, key_size=0, query_size=0, value_size=0),
     ValueError, "must be a positive int, got 0"),
    (dict(ffn_num_hiddens=0), ValueError, "ffn_num_hiddens must be a positive int, got 0"),
    (dict(dropout=1.0), ValueError, r"dropout must be in \[0, 1\), got 1.0 \(p=1 would drop everything"),
    (dict(dropout=-0.1), ValueError, r"dropout must be in \[0, 1\), got -0.1"),
    (dict(dropout=math.nan), ValueError, r"dropout must be in \[0, 1\), got nan"),
    (dict(dropout="0.1"), TypeError, r"dropout must be a float in \[0, 1\)"),
]
ENCODER_ONLY_ARGS = [
    (dict(vocab_size=0), ValueError, "vocab_size must be a positive int, got 0"),
    (dict(num_layers=0), ValueError, "num_layers must be a positive int, got 0"),
    (dict(num_layers=2.5), TypeError, "num_layers must be a positive int"),
    (dict(max_len=0), ValueError, "max_len must be a positive int, got 0"),
    (dict(skip_padding="yes"), TypeError, r"skip_padding must be True or False, got 'yes' \(str\)"),
    (dict(check_inputs=None), TypeError, "check_inputs must be True or False, got None"),
    (dict(cuda_graphs=2), TypeError, "cuda_graphs must be True or False, got 2"),
    (dict(learn_pos_embedding="no"), TypeError, "learn_pos_embedding must be True or False"),
]


def test_flags_take_any_true_or_false():
    """numpy's bools and a one-element tensor are True or False as well (config values)."""
    import numpy as np
    for value, want in ((np.True_, True), (np.bool_(False), False), (torch.tensor(True), True), (1, True)):
        encoder = FastBERTEncoder(**encoder_config(), skip_padding=value, check_inputs=value)
        assert encoder.skip_padding is want and encoder.check_inputs is want


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("change,error,message", BAD_CONSTRUCTOR_ARGS + ENCODER_ONLY_ARGS)
def test_encoder_and_model_constructors_refuse_bad_arguments(backend, change, error, message):
    config = {**encoder_config(num_heads=2, head_dim=4), **change}
    with pytest.raises(error, match=message):
        FastBERTEncoder(**config, backend=backend)
    with pytest.raises(error, match=message):
        FastBERTModel(**config, hid_in_features=8, mlm_in_features=8, nsp_in_features=8, backend=backend)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("change,error,message", BAD_CONSTRUCTOR_ARGS)
def test_block_constructor_refuses_bad_arguments(backend, change, error, message):
    config = {k: v for k, v in encoder_config(num_heads=2, head_dim=4).items()
              if k not in ("vocab_size", "num_layers", "max_len")}
    config = {**config, **change}
    with pytest.raises(error, match=message):
        FastEncoderBlock(config["key_size"], config["query_size"], config["value_size"], config["num_hiddens"],
                         config["norm_shape"], config["ffn_num_input"], config["ffn_num_hiddens"],
                         config["num_heads"], config["dropout"], backend=backend)


def test_model_head_sizes_checked():
    with pytest.raises(ValueError, match="nsp_in_features must be a positive int, got 0"):
        FastBERTModel(**encoder_config(num_heads=2, head_dim=4), hid_in_features=8, mlm_in_features=8,
                      nsp_in_features=0)


def test_dropout_just_below_one_is_accepted():
    FastBERTEncoder(**encoder_config(num_heads=2, head_dim=4, dropout=0.999))
    FastBERTEncoder(**encoder_config(num_heads=2, head_dim=4, dropout=0))


# ------------------------------------------------------------------ item 8: optimize()

def assert_left_untouched_with_warnings(model, why):
    """optimize() leaves the encoder and its blocks (looked at one by one after it) as they are,
    with a warning for each naming ``why``."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        optimize(model, "torch")
    assert type(model[0]) is R.BERTEncoder and all(type(b) is R.EncoderBlock for b in model[0].blks)
    messages = [str(w.message) for w in caught]
    where = ["0 (BERTEncoder)"] + [f"0.blks.{i} (EncoderBlock)" for i in range(len(model[0].blks))]
    assert len(messages) == len(where), messages
    for message, name in zip(messages, where):
        assert re.search(rf"bert_fast.optimize: {re.escape(name)} .*left untouched: unsupported {why}", message), message


def test_optimize_skips_a_reference_whose_heads_do_not_divide_with_a_warning():
    model = torch.nn.Sequential(R.BERTEncoder(**{**encoder_config(num_heads=2, head_dim=4), "num_heads": 3}))
    assert_left_untouched_with_warnings(model, r"num_heads 3 \(must be a positive divisor of num_hiddens 8\)")


def test_optimize_skips_a_reference_with_dropout_one_with_a_warning():
    model = torch.nn.Sequential(R.BERTEncoder(**encoder_config(num_heads=2, head_dim=4, dropout=1.0)))
    assert_left_untouched_with_warnings(model, r"dropout 1.0 \(must be in \[0, 1\)\)")


def test_optimize_handles_cycles_and_shared_modules():
    encoder = R.BERTEncoder(**encoder_config(num_heads=2, head_dim=4, num_layers=1))
    outer = torch.nn.Module()
    outer.inner = torch.nn.Module()
    outer.inner.back = outer            # a cycle
    outer.inner.encoder = encoder
    outer.again = encoder               # the same encoder twice
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert optimize(outer, "torch") is outer
    assert isinstance(outer.inner.encoder, FastBERTEncoder)
    assert outer.again is outer.inner.encoder, "a shared module gets one replacement"
    assert outer.inner.back is outer


def test_value_checks_under_vmap_say_to_turn_them_off():
    """torch.func.vmap forbids the host read of check_inputs=True (PyTorch's error speaks of
    .item()): ours names the setting; with it off, backend 'torch' runs under vmap."""
    ref, fast = encoder_pair(encoder_config(), backend="torch")
    tokens, segments = random_inputs(2, 6, encoder_config()["vocab_size"])

    def per_sequence(model):
        return torch.func.vmap(lambda t, s: model(t, s, None))(tokens[:, None], segments[:, None])[:, 0]

    with pytest.raises(ValueError, match="check_inputs=True reads the input values on the host, which "
                                         "torch.func.vmap does not allow: set check_inputs=False"):
        per_sequence(fast)
    fast.check_inputs = False
    assert (per_sequence(fast) - per_sequence(ref)).abs().max() < 1e-5


@pytest.mark.parametrize("grad_enabled", [False, True], ids=["no_grad", "grad"])
@pytest.mark.parametrize("skip_padding", [False, True], ids=["exact", "skip_padding"])
def test_vmap_over_stacked_parameters_runs_an_ensemble(skip_padding, grad_enabled):
    """Model ensembling (torch.func.stack_module_state + functional_call under vmap): the
    packed QKV of inference viewed the Parameters' memory, which vmap's wrapped Parameters do
    not have (PyTorch's "Cannot access data pointer"); under a transform they are concatenated."""
    config = encoder_config()
    pairs = [encoder_pair(config, backend="torch", check_inputs=False, skip_padding=skip_padding) for _ in range(2)]
    base = pairs[0][1]
    params, buffers = torch.func.stack_module_state([fast for _, fast in pairs])
    tokens, segments = random_inputs(2, 6, config["vocab_size"])
    valid_lens = torch.tensor([4, 6])
    with torch.set_grad_enabled(grad_enabled):
        ensemble = torch.func.vmap(lambda p, b: torch.func.functional_call(base, (p, b), (tokens, segments, valid_lens)))
        outputs = ensemble(params, buffers)
    valid = (torch.arange(6) < valid_lens[:, None])[..., None]
    for out, (ref, _) in zip(outputs, pairs, strict=True):
        assert_close(out * valid, ref(tokens, segments, valid_lens) * valid, atol=1e-5)


def run_block_on(backend, shape, training):
    """(In a child: the fused layer's CPU flash attention on an empty X died of SIGFPE.)"""
    hidden = shape[-1]
    block = FastEncoderBlock(hidden, hidden, hidden, hidden, [hidden], hidden, 2 * hidden, 4, 0.0,
                             backend=backend).train(training)
    return block(torch.randn(shape), torch.zeros(shape[0])).shape


@pytest.mark.parametrize("training", [False, True], ids=["eval", "train"])
@pytest.mark.parametrize("shape", [(2, 0, 32), (0, 3, 32)], ids=["no-token", "no-sequence"])
@pytest.mark.parametrize("backend", available_backends())
def test_a_block_on_an_empty_batch_raises_as_the_reference(backend, shape, training):
    """The block's empty X gets the per-op path, which raises a RuntimeError from PyTorch's
    shape checks, as the reference does (no crash)."""
    ref = R.EncoderBlock(32, 32, 32, 32, [32], 32, 64, 4, 0.0).train(training)
    with pytest.raises(RuntimeError):
        ref(torch.randn(shape), torch.zeros(shape[0]))
    with pytest.raises(RuntimeError):
        call_in_child(run_block_on, backend, shape, training)
