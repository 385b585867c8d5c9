"""bert_fast.cuda_graph: capture_encoder (manual, one shape) and graphed_forward (automatic,
FastBERTEncoder(cuda_graphs=True), shape buckets).

capture_encoder: the argument checks run on the CPU; everything that captures a graph needs a
GPU. On the GPU the graphed call is compared with the eager call of the same module on the same
inputs, in the same (inference) mode, so with a named backend the kernels and their launch
parameters are the same: bf16 must match bit for bit, fp32 within the fp32 floor (it should be
bitwise too; the floor only keeps the test about the graph, not about cuBLAS heuristics). The
"auto" tests run fp32 (floor): auto captures Triton's kernels, its eager calls may run the
extension's.

graphed_forward: the whole machinery (buckets, padding and slicing, keys, invalidation, LRU,
fallbacks, input checks) runs on the CPU with cuda_graph._steps replaced by a stub whose
"capture" runs the forward once on the static buffers and whose "replay" runs it again there.
The padded call may sum in another order than the eager one (other GEMM sizes): fp32 within
the fp32 floor 1e-4. On the GPU the same with real graphs, every backend, exact and
skip_padding, fp32 (floor) and bf16 (STYLE.md's rule against the fp32 encoder).
"""

import copy
import threading
import time
import warnings

import pytest
import torch
from torch import nn

import bert_fast.cuda_graph as cuda_graph
import bert_fast.modules as modules
from bert_fast.ops import graph_inputs
from bert_fast import FastBERTEncoder, FastBERTModel
from bert_fast import reference as R
from bert_fast.backend import resolve_backend
from bert_fast.cuda_graph import (CudaGraphFallbackWarning, GraphedEncoder, bucket_batch, bucket_seqlen,
                                  bucket_tokens, capture_encoder, clear_cuda_graphs, cuda_graph_stats)
from tests.helpers import (BF16_OK, FLOOR, StubGraph, StubSteps, assert_close, assert_within_rule, encoder_config, max_err,
                           needs_cuda, random_inputs)
from tests.isolated import call_in_child

B, L = 3, 37          # L not a multiple of 16
VOCAB = 50            # encoder_config's default vocab_size


# --------------------------------------------------------------------------- argument checks (CPU)

def cpu_encoder(**options):
    return FastBERTEncoder(**encoder_config(), **options).eval()


def test_rejects_cpu_encoder_and_inputs():
    tokens, segments = random_inputs(B, L, VOCAB)
    with pytest.raises(ValueError, match=r"CUDA tensors on one device; found parameters on cpu, "
                                         r"tokens on cpu, segments on cpu, valid_lens on cpu"):
        capture_encoder(cpu_encoder(), tokens, segments, torch.tensor([3, 5, 7]))


def test_rejects_training_mode():
    tokens, segments = random_inputs(B, L, VOCAB)
    with pytest.raises(ValueError, match=r"training mode: call encoder\.eval\(\) first.*"
                                         r"torch\.cuda\.make_graphed_callables"):
        capture_encoder(cpu_encoder().train(), tokens, segments)


def test_rejects_skip_padding_with_valid_lens():
    tokens, segments = random_inputs(B, L, VOCAB)
    with pytest.raises(ValueError, match=r"skip_padding=True and valid_lens was given: skip_padding "
                                         r"reads the per-sequence lengths on the host.*skip_padding=False"):
        capture_encoder(cpu_encoder(skip_padding=True), tokens, segments, torch.tensor([3, 5, 7]))


def test_rejects_whole_model():
    model = FastBERTModel(**encoder_config()).eval()
    tokens, segments = random_inputs(B, L, VOCAB)
    with pytest.raises(TypeError, match=r"not a whole FastBERTModel.*capture model\.encoder"):
        capture_encoder(model, tokens, segments)


@pytest.mark.parametrize("warmup_iters", [0, -1, 1.5, True])
def test_rejects_bad_warmup_iters(warmup_iters):
    tokens, segments = random_inputs(B, L, VOCAB)
    with pytest.raises(ValueError, match=r"warmup_iters must be an int >= 1"):
        capture_encoder(cpu_encoder(), tokens, segments, warmup_iters=warmup_iters)


def test_rejects_non_tensor_inputs():
    tokens, segments = random_inputs(B, L, VOCAB)
    with pytest.raises(TypeError, match="tokens must be a torch.Tensor, got list"):
        capture_encoder(cpu_encoder(), tokens.tolist(), segments)
    with pytest.raises(TypeError, match="valid_lens must be a torch.Tensor or None, got list"):
        capture_encoder(cpu_encoder(), tokens, segments, [3, 5, 7])


def test_checks_off_restores_attribute_on_error():
    """The mechanism capture_encoder uses around warmup and capture (the GPU test below
    makes a real capture fail)."""
    encoder = cpu_encoder()
    with pytest.raises(RuntimeError, match="boom"):
        with cuda_graph._module_checks_off(encoder):
            assert encoder.check_inputs is False
            raise RuntimeError("boom")
    assert encoder.check_inputs is True
    reference = R.BERTEncoder(**encoder_config()).eval()
    with cuda_graph._module_checks_off(reference):
        pass
    assert not hasattr(reference, "check_inputs")


# --------------------------------------------------------------------------- GPU

BACKENDS = ["torch", "triton", "cuda"]
DTYPES = [torch.float32, pytest.param(torch.bfloat16, marks=pytest.mark.skipif(
    not BF16_OK, reason="bf16 needs compute capability >= 8.0"))]
VALID_LENS = ["none", "1d_int", "1d_float", "2d_int", "2d_float"]


def require_backend(backend):
    try:
        resolve_backend(backend)
    except ValueError as error:
        pytest.skip(f"backend {backend!r} unusable here: {error}")


def gpu_encoder(backend="auto", dtype=torch.float32, **options):
    require_backend(backend)
    encoder = FastBERTEncoder(**encoder_config(), backend=backend, **options).eval()
    return encoder.to(device="cuda", dtype=dtype)


def make_valid_lens(case, variant=0):
    """Two different valid_lens of each kind (variant 0 and 1), with rows that see no key
    (0 or negative) and rows that see every key (>= L)."""
    if case == "none":
        return None
    if case == "1d_int":
        values = torch.tensor([[5, L, 0], [L + 4, 3, 17]][variant])
    elif case == "1d_float":
        values = torch.tensor([[2.5, 30.0, float(L + 3)], [7.0, 1.5, 0.0]][variant])
    elif case == "2d_int":
        values = torch.randint(-1, L + 2, (B, L), dtype=torch.int32)
    else:
        values = torch.rand(B, L) * (L + 2) - 1
    return values.cuda()


def gpu_inputs(batch=B, seqlen=L):
    return tuple(t.cuda() for t in random_inputs(batch, seqlen, VOCAB))


def eager(encoder, tokens, segments, valid_lens):
    with torch.inference_mode():
        return encoder(tokens, segments, valid_lens)


def assert_matches_eager(actual, expected, what):
    if expected.dtype == torch.float32:
        assert_close(actual, expected, atol=FLOOR[torch.float32], what=what)
    else:
        assert actual.dtype == expected.dtype and actual.shape == expected.shape, what
        assert torch.equal(actual, expected), \
            f"{what}: not bitwise equal to the eager call, max abs error {max_err(actual, expected):.3g}"


@needs_cuda
@pytest.mark.parametrize("case", VALID_LENS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("backend", BACKENDS)
def test_replay_matches_eager_and_follows_new_inputs(backend, dtype, case):
    encoder = gpu_encoder(backend, dtype)
    tokens, segments = gpu_inputs()
    valid_lens = make_valid_lens(case, 0)
    graphed = capture_encoder(encoder, tokens, segments, valid_lens)
    assert_matches_eager(graphed(tokens, segments, valid_lens),
                         eager(encoder, tokens, segments, valid_lens), "example inputs")

    # Change one input at a time: each copy into the static buffers must reach the graph.
    new_tokens, new_segments = gpu_inputs()
    changes = [("new tokens", (new_tokens, segments, valid_lens)),
               ("new segments", (new_tokens, new_segments, valid_lens))]
    if valid_lens is not None:
        changes.append(("new valid_lens", (new_tokens, new_segments, make_valid_lens(case, 1))))
    previous = eager(encoder, tokens, segments, valid_lens)
    for what, inputs in changes:
        expected = eager(encoder, *inputs)
        assert not torch.equal(expected, previous), f"{what}: the test's inputs do not change the output"
        assert_matches_eager(graphed(*inputs), expected, what)
        previous = expected


@needs_cuda
def test_capture_with_skip_padding_and_no_valid_lens():
    """skip_padding only changes the path when valid_lens is given; without it the exact path runs."""
    encoder = gpu_encoder(skip_padding=True)
    tokens, segments = gpu_inputs()
    graphed = capture_encoder(encoder, tokens, segments)
    new_tokens, new_segments = gpu_inputs()
    assert_matches_eager(graphed(new_tokens, new_segments), eager(encoder, new_tokens, new_segments, None),
                         "skip_padding encoder, valid_lens=None")


@needs_cuda
def test_auto_captures_triton_kernels(monkeypatch):
    """An auto encoder warms up and is captured on Triton's kernels (AUTO_CAPTURES_TRITON: the
    extension's save host time, which a replay does not spend); its eager calls keep auto's
    choice; the replay matches the eager call."""
    from bert_fast import backend
    real_backend_for, seen = backend.backend_for, []
    monkeypatch.setattr(backend, "backend_for", lambda name, device: seen.append(real_backend_for(name, device))
                        or seen[-1])
    encoder = gpu_encoder()
    tokens, segments = gpu_inputs()
    valid_lens = make_valid_lens("1d_int", 0)
    graphed = capture_encoder(encoder, tokens, segments, valid_lens)
    assert seen and set(seen) == {"triton"}, seen
    seen.clear()
    expected = eager(encoder, tokens, segments, valid_lens)
    assert seen and set(seen) == {real_backend_for("auto", tokens.device)}, seen
    assert_matches_eager(graphed(tokens, segments, valid_lens), expected, "auto: Triton in the graph")


@needs_cuda
def test_clone_output():
    encoder = gpu_encoder()
    tokens, segments = gpu_inputs()
    valid_lens = make_valid_lens("1d_int", 0)
    new_tokens, new_segments = gpu_inputs()

    graphed = capture_encoder(encoder, tokens, segments, valid_lens)
    first = graphed(tokens, segments, valid_lens)
    second = graphed(new_tokens, new_segments, valid_lens)
    assert first.data_ptr() != second.data_ptr()
    assert first.data_ptr() != graphed.static_output.data_ptr()
    # The second call did not overwrite the first result.
    assert_matches_eager(first, eager(encoder, tokens, segments, valid_lens), "first output after a second call")

    shared = capture_encoder(encoder, tokens, segments, valid_lens, clone_output=False)
    first = shared(tokens, segments, valid_lens)
    second = shared(new_tokens, new_segments, valid_lens)
    assert first is second is shared.static_output
    # ... and the static output holds the latest call's result.
    assert_matches_eager(first, eager(encoder, new_tokens, new_segments, valid_lens), "static output")


@needs_cuda
def test_repr_and_attributes():
    encoder = gpu_encoder()
    tokens, segments = gpu_inputs()
    graphed = capture_encoder(encoder, tokens, segments, make_valid_lens("1d_int"))
    assert isinstance(graphed, GraphedEncoder)
    assert isinstance(graphed.graph, torch.cuda.CUDAGraph)
    assert graphed.encoder is encoder
    assert repr(graphed) == (f"GraphedEncoder(FastBERTEncoder, tokens=({B}, {L}), segments=({B}, {L}), "
                             f"valid_lens=({B},), device=cuda:{torch.cuda.current_device()}, "
                             f"clone_output=True)")


def mismatches():
    """(name, how to change the (tokens, segments, valid_lens) of a 1-D capture, error, message)."""
    return [
        ("tokens shape", lambda t, s, v: (t[:, :-1], s, v), ValueError,
         rf"tokens: expected shape \({B}, {L}\), dtype torch.int64, device cuda:\d \(the captured example\), "
         rf"got shape \({B}, {L - 1}\)"),
        ("batch", lambda t, s, v: (t[:-1], s[:-1], v[:-1]), ValueError, rf"tokens: expected shape \({B}, {L}\)"),
        ("segments dtype", lambda t, s, v: (t, s.int(), v), ValueError,
         r"segments: expected .*dtype torch.int64.*got .*dtype torch.int32"),
        ("valid_lens dtype", lambda t, s, v: (t, s, v.float()), ValueError,
         r"valid_lens: expected .*dtype torch.int64.*got .*dtype torch.float32"),
        ("valid_lens 2-D", lambda t, s, v: (t, s, v[:, None].expand(B, L)), ValueError,
         rf"valid_lens: expected shape \({B},\).*got shape \({B}, {L}\)"),
        ("valid_lens None", lambda t, s, v: (t, s, None), ValueError,
         r"valid_lens: the graph was captured with valid_lens of shape .*got None"),
        ("tokens on cpu", lambda t, s, v: (t.cpu(), s, v), ValueError, r"tokens: expected .*got .*device cpu"),
        ("tokens list", lambda t, s, v: (t.tolist(), s, v), TypeError, "tokens must be a torch.Tensor, got list"),
    ]


@needs_cuda
@pytest.mark.parametrize("name,change,error,message", mismatches(), ids=[m[0] for m in mismatches()])
def test_rejects_mismatched_arguments(name, change, error, message):
    encoder = gpu_encoder()
    tokens, segments = gpu_inputs()
    valid_lens = make_valid_lens("1d_int")
    graphed = capture_encoder(encoder, tokens, segments, valid_lens)
    with pytest.raises(error, match=message):
        graphed(*change(tokens, segments, valid_lens))


@needs_cuda
def test_rejects_valid_lens_when_captured_without():
    encoder = gpu_encoder()
    tokens, segments = gpu_inputs()
    graphed = capture_encoder(encoder, tokens, segments)
    with pytest.raises(ValueError, match=r"valid_lens: the graph was captured with valid_lens=None, "
                                         r"got shape \(3,\)"):
        graphed(tokens, segments, make_valid_lens("1d_int"))


@needs_cuda
def test_input_check_runs_eagerly_and_never_inside_the_graph(monkeypatch):
    # Every input check, the module's own in forward and capture_encoder's, goes through
    # modules.check_encoder_inputs: record whether a capture was under way at each call.
    checks = []
    real_check = modules.check_encoder_inputs

    def recorded(*args, **kwargs):
        checks.append(torch.cuda.is_current_stream_capturing())
        return real_check(*args, **kwargs)

    monkeypatch.setattr(modules, "check_encoder_inputs", recorded)
    encoder = gpu_encoder()
    tokens, segments = gpu_inputs()
    valid_lens = make_valid_lens("1d_int")
    graphed = capture_encoder(encoder, tokens, segments, valid_lens, warmup_iters=3)
    # One check of the example, before capture; none in the 3 warmup calls or the capture.
    assert checks == [False], "the input check ran during warmup or capture, or not before it"
    assert encoder.check_inputs is True

    bad_tokens = tokens.clone()
    bad_tokens[1, 4] = VOCAB
    with pytest.raises(ValueError, match=rf"token ids must be in \[0, {VOCAB}\)"):
        graphed(bad_tokens, segments, valid_lens)
    graphed(tokens, segments, valid_lens)
    assert checks == [False] * 3

    encoder.check_inputs = False        # turning it off removes the per-call check (and its sync)
    graphed(tokens, segments, valid_lens)
    assert checks == [False] * 3


@needs_cuda
@pytest.mark.parametrize("fail_on_call", [1, 4], ids=["warmup", "capture"])
def test_check_inputs_restored_after_failed_capture(monkeypatch, fail_on_call):
    encoder = gpu_encoder()
    tokens, segments = gpu_inputs()
    calls = []
    block_forward = encoder.blks[0].forward

    def failing_forward(*args, **kwargs):
        calls.append(encoder.check_inputs)
        if len(calls) == fail_on_call:
            raise RuntimeError("simulated failure")
        return block_forward(*args, **kwargs)

    monkeypatch.setattr(encoder.blks[0], "forward", failing_forward)
    with pytest.raises(RuntimeError, match="simulated failure"):
        capture_encoder(encoder, tokens, segments, warmup_iters=3)
    assert calls == [False] * fail_on_call
    assert encoder.check_inputs is True


@needs_cuda
@pytest.mark.parametrize("case", ["1d_int", "2d_float"])
def test_reference_encoder_can_be_captured(case):
    encoder = R.BERTEncoder(**encoder_config()).eval().cuda()
    tokens, segments = gpu_inputs()
    graphed = capture_encoder(encoder, tokens, segments, make_valid_lens(case, 0))
    assert not hasattr(encoder, "check_inputs")
    new_tokens, new_segments = gpu_inputs()
    new_valid_lens = make_valid_lens(case, 1)
    assert_matches_eager(graphed(new_tokens, new_segments, new_valid_lens),
                         eager(encoder, new_tokens, new_segments, new_valid_lens), "reference encoder")


@needs_cuda
@pytest.mark.parametrize("pack_qkv", [False, True], ids=["qkv-concatenated", "qkv-packed"])
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_in_place_weight_changes_are_seen(backend, pack_qkv):
    encoder = gpu_encoder(backend)
    tokens, segments = gpu_inputs()
    valid_lens = make_valid_lens("1d_int")
    unpacked = eager(encoder, tokens, segments, valid_lens)
    if pack_qkv:
        encoder.pack_qkv_()
        assert torch.equal(eager(encoder, tokens, segments, valid_lens), unpacked)
    graphed = capture_encoder(encoder, tokens, segments, valid_lens)
    before = graphed(tokens, segments, valid_lens)

    for weight in (encoder.blks[0].ffn.dense1.weight, encoder.blks[1].attention.W_k.weight):
        with torch.no_grad():
            weight.mul_(0.5)
        after = graphed(tokens, segments, valid_lens)
        assert not torch.equal(after, before)
        assert_matches_eager(after, eager(encoder, tokens, segments, valid_lens), "after mul_ on a weight")
        before = after

    # The QKV projection is concatenated inside the graph (or, packed, read in place), so
    # it follows a load_state_dict too.
    other = FastBERTEncoder(**encoder_config()).state_dict()
    encoder.load_state_dict(other)
    assert_matches_eager(graphed(tokens, segments, valid_lens), eager(encoder, tokens, segments, valid_lens),
                         "after load_state_dict")


@needs_cuda
def test_graphs_for_two_shapes_share_a_pool():
    encoder = gpu_encoder()
    pool = torch.cuda.graph_pool_handle()
    graphs = {}
    for seqlen in (21, L):
        tokens, segments = gpu_inputs(seqlen=seqlen)
        graphs[seqlen] = capture_encoder(encoder, tokens, segments, make_valid_lens("1d_int"), pool=pool)
    for seqlen, graphed in graphs.items():
        tokens, segments = gpu_inputs(seqlen=seqlen)
        valid_lens = make_valid_lens("1d_int", 1)
        assert_matches_eager(graphed(tokens, segments, valid_lens), eager(encoder, tokens, segments, valid_lens),
                             f"L={seqlen} with a shared pool")


@needs_cuda
def test_capture_inside_inference_mode_replay_outside():
    encoder = gpu_encoder()
    tokens, segments = gpu_inputs()
    valid_lens = make_valid_lens("1d_float")
    with torch.inference_mode():
        graphed = capture_encoder(encoder, tokens, segments, valid_lens)
    out = graphed(tokens, segments, valid_lens)
    assert not out.is_inference() and not out.requires_grad
    assert_matches_eager(out, eager(encoder, tokens, segments, valid_lens), "replay outside inference mode")
    with torch.inference_mode():
        assert_matches_eager(graphed(tokens, segments, valid_lens), eager(encoder, tokens, segments, valid_lens),
                             "replay inside inference mode")


# =========================================================================== graphed_forward
# FastBERTEncoder(cuda_graphs=True): automatic capture per shape bucket.

AUTO_MAX_LEN = 200     # room for L = 130 (bucket 160)


@pytest.fixture
def stub(monkeypatch):
    steps = StubSteps()
    monkeypatch.setattr(cuda_graph, "_steps", steps)
    return steps


def auto_encoder(**options):
    options.setdefault("cuda_graphs", True)
    return FastBERTEncoder(**encoder_config(max_len=AUTO_MAX_LEN), **options).eval()


def auto_model():
    config = encoder_config(max_len=AUTO_MAX_LEN)
    width = config["num_hiddens"]
    return FastBERTModel(**config, hid_in_features=width, mlm_in_features=width, nsp_in_features=width,
                         cuda_graphs=True).eval()


def graphed(encoder, tokens, segments, valid_lens=None):
    with torch.no_grad():
        return encoder(tokens, segments, valid_lens)


def eager_forward(encoder, tokens, segments, valid_lens=None):
    with torch.no_grad():
        return encoder._forward(tokens, segments, valid_lens)


def lengths(case, batch, seqlen, device="cpu"):
    """valid_lens of each form. "_pos": every row sees a key (L can be padded in exact mode);
    "_zero": rows of length 0 or below, which see no key (exact mode keeps L exact)."""
    def pick(values):
        return torch.tensor([values[i % len(values)] for i in range(batch)], device=device)

    if case == "none":
        return None
    if case == "1d_int_pos":
        return pick([seqlen, 3, seqlen + 9, 1, 5])
    if case == "1d_int_zero":
        return pick([3, 0, seqlen, -2, 6])
    if case == "1d_float_pos":
        return pick([2.5, 0.5, seqlen + 3.0, 7.25, 1.0])
    if case == "1d_float_zero":
        return pick([0.0, 2.5, seqlen - 0.5, 0.75])
    if case == "2d_int_pos":
        return torch.randint(1, seqlen + 3, (batch, seqlen), device=device)
    if case == "2d_float_zero":
        return (torch.rand(batch, seqlen, device=device) * (seqlen + 2) - 1).round(decimals=1)
    raise ValueError(case)


LENGTH_CASES = ["none", "1d_int_pos", "1d_int_zero", "1d_float_pos", "1d_float_zero", "2d_int_pos", "2d_float_zero"]


def only_bucket(encoder):
    buckets = cuda_graph_stats(encoder)["buckets"]
    assert len(buckets) == 1, buckets
    return buckets[0]


def assert_eager_result(actual, expected, what="graphed call"):
    assert actual.shape == expected.shape and actual.dtype == expected.dtype, what
    assert actual.is_contiguous(), f"{what}: the output is not contiguous"
    assert_close(actual, expected, atol=FLOOR[torch.float32], what=what)


# --------------------------------------------------------------------------- buckets

def test_bucket_batch():
    table = {1: 1, 2: 2, 3: 4, 5: 8, 8: 8, 9: 10, 15: 16, 16: 16, 17: 20, 31: 32, 33: 40, 100: 112, 129: 160}
    assert {b: bucket_batch(b) for b in table} == table
    for batch in range(9, 2000):
        padded = bucket_batch(batch)
        assert batch <= padded < 1.25 * batch, batch


def test_bucket_seqlen():
    table = {1: 16, 7: 16, 16: 16, 17: 32, 37: 48, 127: 128, 128: 128, 129: 160, 200: 224, 257: 320, 512: 512,
             513: 640}
    assert {n: bucket_seqlen(n, 4096) for n in table} == table
    assert bucket_seqlen(37, 40) == 40          # never beyond the position table
    assert bucket_seqlen(37, 37) == 37
    assert bucket_seqlen(5, 8) == 8
    assert bucket_seqlen(50, 40) == 50          # an L beyond the table is left to the eager check
    for seqlen in range(129, 3000):
        padded = bucket_seqlen(seqlen, 4096)
        assert seqlen <= padded < 1.25 * seqlen, seqlen


def test_bucket_tokens_keeps_padding_out_of_the_gemms():
    table = {0: 16, 1: 16, 16: 16, 17: 32, 128: 128, 129: 160, 1000: 1024, 1025: 1280}
    assert {n: bucket_tokens(n, 10 ** 6) for n in table} == table
    assert bucket_tokens(100, 64) == 64         # at most every slot of the padded batch
    previous = 0
    for count in range(1, 20000):
        padded = bucket_tokens(count, 10 ** 6)
        assert count <= padded < 1.25 * count + 16 and padded % 16 == 0 and padded >= previous, count
        previous = padded


# --------------------------------------------------------------------------- padding and slicing

@pytest.mark.parametrize("batch,seqlen", [(1, 7), (5, 37), (2, 130)])
@pytest.mark.parametrize("skip_padding", [False, True], ids=["exact", "skip_padding"])
@pytest.mark.parametrize("case", LENGTH_CASES)
def test_graphed_matches_eager(stub, staging, case, skip_padding, batch, seqlen):
    if skip_padding and case.startswith("2d"):
        pytest.skip("skip_padding takes 1-D valid_lens (test_skip_padding_rejects_2d_lengths)")
    encoder = auto_encoder(skip_padding=skip_padding)
    tokens, segments = random_inputs(batch, seqlen, VOCAB)
    valid_lens = lengths(case, batch, seqlen)
    expected = eager_forward(encoder, tokens, segments, valid_lens)
    assert_eager_result(graphed(encoder, tokens, segments, valid_lens), expected)

    bucket = only_bucket(encoder)
    sees_no_key = valid_lens is not None and not bool((valid_lens > 0).all())
    exact_length = sees_no_key and not skip_padding
    assert bucket["batch"] == bucket_batch(batch)
    assert bucket["seq_len"] == (seqlen if exact_length else bucket_seqlen(seqlen, AUTO_MAX_LEN))
    if skip_padding:
        if valid_lens is None:
            count = batch * seqlen
        else:
            count = int((torch.arange(seqlen, dtype=torch.float32) < valid_lens[:, None]).sum())
        assert bucket["num_tokens"] == bucket_tokens(count, bucket["batch"] * bucket["seq_len"])
    else:
        assert bucket["num_tokens"] is None
    if skip_padding and valid_lens is not None:        # padded positions are zeros, as eager's
        positions = torch.arange(seqlen, dtype=torch.float32)
        padded = ~(positions < valid_lens[:, None])
        assert torch.equal(expected[padded], torch.zeros_like(expected[padded]))

    # Same bucket, other inputs: the buffers follow (a replay, no capture).
    tokens, segments = random_inputs(batch, seqlen, VOCAB)
    assert_eager_result(graphed(encoder, tokens, segments, valid_lens),
                        eager_forward(encoder, tokens, segments, valid_lens), "second call")
    assert stub.attempts == 1 and stub.replays == 2
    stats = cuda_graph_stats(encoder)
    assert stats["captures"] == 1 and stats["replays"] == 2


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_graphed_matches_eager_per_backend(stub, backend):
    encoder = auto_encoder(backend=backend)
    tokens, segments = random_inputs(B, L, VOCAB)
    for case in ("none", "1d_float_pos", "2d_int_pos"):
        valid_lens = lengths(case, B, L)
        assert_eager_result(graphed(encoder, tokens, segments, valid_lens),
                            eager_forward(encoder, tokens, segments, valid_lens), f"{backend}, {case}")


def test_nan_lengths_keep_their_meaning(stub):
    """Without the input check a NaN length reaches the forward; NaN stays NaN (a row that sees
    no key), and such a call keeps its exact L."""
    encoder = auto_encoder(check_inputs=False)
    tokens, segments = random_inputs(B, L, VOCAB)
    valid_lens = torch.tensor([float("nan"), 4.5, 40.0])
    expected = eager_forward(encoder, tokens, segments, valid_lens)
    assert_eager_result(graphed(encoder, tokens, segments, valid_lens), expected)
    assert only_bucket(encoder)["seq_len"] == L


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_low_precision_lengths_are_held_in_float32(stub, dtype):
    encoder = auto_encoder()
    tokens, segments = random_inputs(B, 200, VOCAB)     # L 200 -> bucket 224; bf16 cannot hold 200.5
    valid_lens = torch.tensor([199.0, 3.5, 250.0], dtype=dtype)
    assert_eager_result(graphed(encoder, tokens, segments, valid_lens),
                        eager_forward(encoder, tokens, segments, valid_lens))
    assert only_bucket(encoder)["valid_lens_dtype"] == torch.float32


def test_smaller_call_in_the_same_bucket_leaves_nothing_behind(stub):
    """(4, 40) then (3, 33): same bucket (4, 48); the second call must not see the first's
    fourth row or columns 33-39 (under skip_padding a stale length would add tokens)."""
    for skip_padding in (False, True):
        encoder = auto_encoder(skip_padding=skip_padding)
        for batch, seqlen, case in ((4, 40, "1d_int_pos"), (3, 33, "1d_int_pos"), (3, 33, "none"),
                                    (4, 40, "none"), (2, 33, "1d_float_pos")):
            tokens, segments = random_inputs(batch, seqlen, VOCAB)
            valid_lens = lengths(case, batch, seqlen)
            assert_eager_result(graphed(encoder, tokens, segments, valid_lens),
                                eager_forward(encoder, tokens, segments, valid_lens),
                                f"skip_padding={skip_padding}, ({batch}, {seqlen}), {case}")
        # Exact: the first four share bucket (4, 48) with int64 lengths (None included), (2, 33)
        # float lengths is bucket (2, 48). skip_padding: the token counts 84, 69, 99, 160, 4 make
        # five num_tokens buckets (96, 80, 112, 160, 16).
        assert len(cuda_graph_stats(encoder)["buckets"]) == (5 if skip_padding else 2), skip_padding


def test_output_is_a_fresh_tensor(stub):
    encoder = auto_encoder()
    tokens, segments = random_inputs(B, L, VOCAB)
    first = graphed(encoder, tokens, segments)
    kept = first.clone()
    other_tokens, other_segments = random_inputs(B, L, VOCAB)
    second = graphed(encoder, other_tokens, other_segments)
    assert second.data_ptr() != first.data_ptr()
    assert torch.equal(first, kept), "the second call overwrote the first call's output"
    state = cuda_graph._states[encoder]
    (entry,) = state.graphs.values()
    assert first.data_ptr() != entry.output.data_ptr()


def test_inference_mode_and_no_grad(stub):
    encoder = auto_encoder()
    tokens, segments = random_inputs(B, L, VOCAB)
    with torch.inference_mode():
        inside = encoder(tokens, segments)
    assert inside.is_inference()
    outside = graphed(encoder, tokens, segments)
    assert not outside.is_inference() and not outside.requires_grad
    assert torch.equal(inside, outside)
    assert stub.attempts == 1 and stub.inference_mode_at_capture == [True]


def test_model_and_module_call(stub):
    model = auto_model()
    assert model.encoder.cuda_graphs
    tokens, segments = random_inputs(B, L, VOCAB)
    valid_lens = lengths("1d_int_pos", B, L)
    with torch.no_grad():
        encoded, _, nsp = model(tokens, segments, valid_lens)
        model.encoder.cuda_graphs = False
        expected, _, expected_nsp = model(tokens, segments, valid_lens)
    assert_eager_result(encoded, expected)
    assert_close(nsp, expected_nsp, atol=FLOOR[torch.float32], what="nsp")
    assert stub.attempts == 1


def test_skip_padding_rejects_2d_lengths(stub):
    encoder = auto_encoder(skip_padding=True)
    tokens, segments = random_inputs(B, L, VOCAB)
    with pytest.raises(ValueError, match=r"skip_padding=True needs 1-D valid_lens"):
        graphed(encoder, tokens, segments, lengths("2d_int_pos", B, L))
    encoder.check_inputs = False
    with pytest.raises(ValueError, match=r"skip_padding=True needs 1-D valid_lens"):
        graphed(encoder, tokens, segments, lengths("2d_int_pos", B, L))
    assert stub.attempts == 0


# --------------------------------------------------------------------------- keys

def test_buckets_and_keys(stub):
    encoder = auto_encoder()
    calls = [((3, 37), torch.int64, "1d_int_pos", 1),     # bucket (4, 48)
             ((3, 40), torch.int64, "1d_int_pos", 1),     # same bucket: replay
             ((4, 33), torch.int64, "1d_int_pos", 1),     # same bucket
             ((3, 50), torch.int64, "1d_int_pos", 2),     # L bucket 64
             ((2, 37), torch.int64, "1d_int_pos", 3),     # B bucket 2
             ((3, 37), torch.int32, "1d_int_pos", 4),     # tokens dtype
             ((3, 37), torch.int64, "1d_float_pos", 5),   # valid_lens dtype
             ((3, 37), torch.int64, "2d_int_pos", 6),     # valid_lens 2-D
             ((3, 37), torch.int64, "none", 6)]           # None: the int64 1-D graph
    for (batch, seqlen), dtype, case, captures in calls:
        tokens, segments = (t.to(dtype) for t in random_inputs(batch, seqlen, VOCAB))
        valid_lens = lengths(case, batch, seqlen)
        assert_eager_result(graphed(encoder, tokens, segments, valid_lens),
                            eager_forward(encoder, tokens, segments, valid_lens))
        assert stub.attempts == captures, ((batch, seqlen), dtype, case)


def test_settings_are_part_of_the_key(stub):
    encoder = auto_encoder()
    tokens, segments = random_inputs(B, L, VOCAB)
    graphed(encoder, tokens, segments)
    previous = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("high" if previous == "highest" else "highest")
    try:
        graphed(encoder, tokens, segments)
    finally:
        torch.set_float32_matmul_precision(previous)
    graphed(encoder, tokens, segments)
    encoder.skip_padding = True
    graphed(encoder, tokens, segments)
    encoder.skip_padding = False
    encoder.backend = "triton"
    graphed(encoder, tokens, segments)
    assert stub.attempts == 4
    encoder.backend = "auto"
    graphed(encoder, tokens, segments)                  # the first call's graph
    with torch.autocast("cpu", dtype=torch.bfloat16):   # a graph replays the casts it captured
        graphed(encoder, tokens, segments)
        graphed(encoder, tokens, segments)
    with torch.autocast("cpu", dtype=torch.float16):
        graphed(encoder, tokens, segments)
    graphed(encoder, tokens, segments)
    assert stub.attempts == 6


def replace_weight(encoder):
    old = encoder.blks[0].ffn.dense1.weight
    encoder.blks[0].ffn.dense1.weight = nn.Parameter(old.detach() * 0.5)


def load_assign(encoder):
    state = {name: value.clone() * 0.5 for name, value in encoder.state_dict().items()}
    encoder.load_state_dict(state, assign=True)


def swap_data(encoder):
    encoder.blks[1].addnorm2.ln.bias.data = encoder.blks[1].addnorm2.ln.bias.data + 1


def move_dtype(encoder):
    encoder.double()
    encoder.float()


def replace_submodule(encoder):
    dense2 = encoder.blks[0].ffn.dense2
    encoder.blks[0].ffn.dense2 = nn.Linear(dense2.in_features, dense2.out_features).eval()


def append_block(encoder):
    encoder.blks.append(copy.deepcopy(encoder.blks[1]))


def pop_block(encoder):           # ModuleList.pop deletes the attribute: no registration hook fires
    encoder.blks.pop(len(encoder.blks) - 1)


def insert_block(encoder):        # ModuleList.insert writes its _modules directly: no hook either
    encoder.blks.insert(0, copy.deepcopy(encoder.blks[1]))


def write_parameter_dict(encoder):  # what torch.func.functional_call does: no registration hook
    dense1 = encoder.blks[0].ffn.dense1
    dense1._parameters["weight"] = nn.Parameter(dense1.weight.detach() * 0.5)


def repack(encoder):
    attention = encoder.blks[0].attention
    attention.W_k.weight = nn.Parameter(attention.W_k.weight.detach().clone())   # unpacked
    attention.pack_qkv_()                                                          # packed anew


@pytest.mark.parametrize("change", [replace_weight, load_assign, swap_data, move_dtype, replace_submodule,
                                    append_block, pop_block, insert_block, write_parameter_dict, repack],
                         ids=lambda f: f.__name__)
def test_replaced_parameters_invalidate(stub, change):
    encoder = auto_encoder()
    tokens, segments = random_inputs(B, L, VOCAB)
    valid_lens = lengths("1d_int_pos", B, L)
    graphed(encoder, tokens, segments, valid_lens)
    tokens2, segments2 = random_inputs(B, 60, VOCAB)
    graphed(encoder, tokens2, segments2)
    assert stub.attempts == 2
    before = eager_forward(encoder, tokens, segments, valid_lens)
    change(encoder)
    after = eager_forward(encoder, tokens, segments, valid_lens)
    assert not torch.equal(before, after) or change in (move_dtype, repack)
    assert_eager_result(graphed(encoder, tokens, segments, valid_lens), after, f"after {change.__name__}")
    stats = cuda_graph_stats(encoder)
    assert stub.attempts == 3 and stats["invalidations"] == 1
    # The tree is checked after the replay's launch: that replay ran (the third of four: one a
    # capture, and the made-again call's), was waited for, and the call made again, checking first.
    assert stub.replays == 4 and stub.waits == 1
    assert len(stats["buckets"]) == 1, "the other bucket's graph was not dropped"


def test_functional_call_is_followed(stub):
    """torch.func.functional_call swaps tensors into the modules' dicts for one call: that call
    replays nothing captured with the module's own weights, and the next plain call nothing
    captured with the temporary ones."""
    encoder = auto_encoder()
    tokens, segments = random_inputs(B, L, VOCAB)
    own = eager_forward(encoder, tokens, segments)
    graphed(encoder, tokens, segments)
    halved = {name: p.detach() * 0.5 for name, p in encoder.named_parameters()}
    with torch.no_grad():
        expected = torch.func.functional_call(encoder, halved, (tokens, segments), {"valid_lens": None})
        assert_eager_result(torch.func.functional_call(encoder, halved, (tokens, segments)), expected)
    assert_eager_result(graphed(encoder, tokens, segments), own, "after functional_call")
    assert cuda_graph_stats(encoder)["invalidations"] == 2


def test_snapshot_keeps_replaced_memory_alive(stub):
    """A replay launched before the tree check reads the captured tensors' memory: a tensor
    given new memory (``p.data = ...``) keeps its old storage alive through the snapshot until
    the next call has checked, and a call on CPU inputs (a model moved off the GPU) lets go."""
    encoder = auto_encoder()
    tokens, segments = random_inputs(B, 32, VOCAB)
    graphed(encoder, tokens, segments)
    weight = encoder.blks[0].ffn.dense1.weight
    address = weight.data_ptr()
    weight.data = weight.data.clone()
    state = cuda_graph._state_of(encoder)
    assert any(storage.data_ptr() == address for storage in state.snapshot.storages)
    assert_eager_result(graphed(encoder, tokens, segments), eager_forward(encoder, tokens, segments))
    assert not any(storage.data_ptr() == address for storage in state.snapshot.storages)
    stub.supports = lambda device: False
    with pytest.warns(CudaGraphFallbackWarning):
        graphed(encoder, tokens, segments)
    assert state.snapshot is None


def test_calls_register_nothing_and_other_registrations_keep_the_graphs(stub):
    """The snapshot's short path: a graphed call registers no parameter, buffer or module (so
    the registration count stands still and the identity comparisons are skipped); a module
    built elsewhere moves the count, the next call compares everything once, finds this tree
    unchanged and keeps its graphs."""
    encoder = auto_encoder()
    tokens, segments = random_inputs(B, L, VOCAB)
    graphed(encoder, tokens, segments)
    count = cuda_graph._registrations
    graphed(encoder, tokens, segments)
    assert cuda_graph._registrations == count, "a graphed call registered a parameter, buffer or module"
    nn.Linear(4, 4)
    assert cuda_graph._registrations > count
    assert_eager_result(graphed(encoder, tokens, segments), eager_forward(encoder, tokens, segments))
    assert stub.attempts == 1 and "invalidations" not in cuda_graph_stats(encoder)
    assert cuda_graph._state_of(encoder).snapshot.registrations == cuda_graph._registrations


def test_in_place_changes_keep_the_graphs(stub):
    encoder = auto_encoder()
    tokens, segments = random_inputs(B, L, VOCAB)
    graphed(encoder, tokens, segments)
    with torch.no_grad():
        encoder.blks[0].ffn.dense1.weight.mul_(0.5)
    encoder.load_state_dict(auto_encoder().state_dict())
    assert_eager_result(graphed(encoder, tokens, segments), eager_forward(encoder, tokens, segments))
    assert stub.attempts == 1 and "invalidations" not in cuda_graph_stats(encoder)


def test_copies_have_their_own_graphs(stub):
    encoder = auto_encoder()
    tokens, segments = random_inputs(B, L, VOCAB)
    graphed(encoder, tokens, segments)
    twin = copy.deepcopy(encoder)         # no CUDAGraph on the module: deepcopy works
    assert cuda_graph_stats(twin)["buckets"] == []
    assert_eager_result(graphed(twin, tokens, segments), eager_forward(encoder, tokens, segments))
    assert stub.attempts == 2


# --------------------------------------------------------------------------- memory bounds

def call_bucket(encoder, seqlen):
    tokens, segments = random_inputs(1, seqlen, VOCAB)
    graphed(encoder, tokens, segments)


def held_lengths(encoder):
    return [bucket["seq_len"] for bucket in cuda_graph_stats(encoder)["buckets"]]


def test_lru_eviction(stub):
    encoder = auto_encoder()
    assert cuda_graph.DEFAULT_MAX_GRAPHS == 8
    for seqlen in (16, 32, 48, 64, 80, 96, 112, 128, 160, 192):      # 10 buckets
        call_bucket(encoder, seqlen)
    assert held_lengths(encoder) == [48, 64, 80, 96, 112, 128, 160, 192]

    encoder.max_cuda_graphs = 2
    with pytest.warns(CudaGraphFallbackWarning) as record:
        call_bucket(encoder, 16)                      # captured again; evicts down to 2
        assert held_lengths(encoder) == [192, 16]
        call_bucket(encoder, 192)                     # a hit: most recently used now
        assert held_lengths(encoder) == [16, 192]
        call_bucket(encoder, 32)                      # evicts 16, the least recently used
        assert held_lengths(encoder) == [192, 32]
    stats = cuda_graph_stats(encoder)
    assert stats["captures"] == 12 and stats["evictions"] == 10 and stub.attempts == 12
    # Evictions past the limit: shapes span more buckets than kept, which one warning says.
    (message,) = fallback_warnings(record)
    assert "has dropped 3 graphs to keep max_cuda_graphs=2" in message and "keep capturing" in message


def test_no_eviction_warning_below_the_limit(stub):
    encoder = auto_encoder()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for seqlen in (16, 32, 48, 64, 80, 96, 112, 128, 160, 192, 16, 32, 48, 64, 80):   # 7 evictions
            call_bucket(encoder, seqlen)
    assert cuda_graph_stats(encoder)["evictions"] == 7
    with pytest.warns(CudaGraphFallbackWarning, match="has dropped 8 graphs to keep max_cuda_graphs=8"):
        call_bucket(encoder, 96)
    with warnings.catch_warnings():
        warnings.simplefilter("error")        # once per encoder
        call_bucket(encoder, 112)
    assert cuda_graph_stats(encoder)["evictions"] == 9 and "eager_capture" not in cuda_graph_stats(encoder)


@pytest.mark.parametrize("limit", [0, -1, 1.5, True, "8"])
def test_rejects_bad_graph_limit(stub, limit):
    encoder = auto_encoder()
    encoder.max_cuda_graphs = limit
    with pytest.raises(ValueError, match=r"max_cuda_graphs must be an int >= 1"):
        call_bucket(encoder, 16)


def test_one_pool_per_encoder(stub):
    encoder = auto_encoder()
    for seqlen in (16, 32):
        call_bucket(encoder, seqlen)
    state = cuda_graph._states[encoder]
    pool = state.pool
    assert pool is not None and len(state.graphs) == 2
    call_bucket(encoder, 48)
    assert state.pool is pool


def test_clear(stub):
    model = auto_model()
    encoder = model.encoder
    for seqlen in (16, 32):
        call_bucket(encoder, seqlen)
    assert clear_cuda_graphs(encoder) == 2
    assert cuda_graph_stats(encoder) == {"buckets": [], "failed": []}
    call_bucket(encoder, 16)
    assert stub.attempts == 3
    assert clear_cuda_graphs(model) == 1          # a model: every encoder in it
    assert clear_cuda_graphs(model) == 0
    with pytest.raises(TypeError, match="expects an nn.Module"):
        clear_cuda_graphs("encoder")


# --------------------------------------------------------------------------- fallbacks

def fallback_warnings(record):
    return [str(w.message) for w in record if issubclass(w.category, CudaGraphFallbackWarning)]


def test_training_mode_runs_eagerly_with_one_warning(stub):
    encoder = auto_encoder().train()          # dropout 0: train mode is deterministic
    tokens, segments = random_inputs(B, L, VOCAB)
    with pytest.warns(CudaGraphFallbackWarning) as record:
        for _ in range(3):
            out = graphed(encoder, tokens, segments)
    messages = fallback_warnings(record)
    assert len(messages) == 1 and "training mode" in messages[0] and ".eval()" in messages[0]
    assert torch.equal(out, eager_forward(encoder, tokens, segments))
    assert stub.attempts == 0 and cuda_graph_stats(encoder)["eager_training"] == 3

    encoder.eval()
    encoder.blks[1].ffn.train()               # one submodule training is training too
    with warnings.catch_warnings():
        warnings.simplefilter("error")        # already warned for this reason: silent
        graphed(encoder, tokens, segments)
    assert stub.attempts == 0
    encoder.eval()
    graphed(encoder, tokens, segments)
    assert stub.attempts == 1 and stub.replays == 1

    # After a capture the tree is checked after the replay's launch: the first call with a
    # submodule training replays, waits and runs eagerly; the next ones check first (no replay).
    encoder.blks[1].ffn.train()
    for _ in range(3):
        assert torch.equal(graphed(encoder, tokens, segments), eager_forward(encoder, tokens, segments))
    assert stub.replays == 2 and stub.waits == 1 and cuda_graph_stats(encoder)["eager_training"] == 7
    encoder.eval()
    graphed(encoder, tokens, segments)
    graphed(encoder, tokens, segments)
    assert stub.attempts == 1 and stub.replays == 4 and stub.waits == 1


def test_autograd_runs_eagerly_with_one_warning(stub):
    encoder = auto_encoder()
    tokens, segments = random_inputs(B, L, VOCAB)
    with pytest.warns(CudaGraphFallbackWarning, match=r"autograd is recording.*inference_mode") as record:
        out = encoder(tokens, segments)
        encoder(tokens, segments)
    assert len(fallback_warnings(record)) == 1
    assert out.requires_grad
    out.sum().backward()                      # gradients flow: it was the eager forward
    assert encoder.blks[0].ffn.dense1.weight.grad is not None
    assert stub.attempts == 0

    for parameter in encoder.parameters():    # frozen: nothing to record, graphs serve
        parameter.requires_grad_(False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = encoder(tokens, segments)
    assert not out.requires_grad and stub.attempts == 1
    assert_eager_result(out, eager_forward(encoder, tokens, segments))


@pytest.mark.parametrize("where", ["submodule", "global"])
def test_hooks_under_grad_mode_run_eagerly(stub, where):
    """Prompt tuning: a frozen encoder, a hook that adds a trainable tensor of the caller's. A
    replay runs no hook: grad mode on, the eager forward gives that tensor its gradient."""
    encoder = auto_encoder()
    for parameter in encoder.parameters():
        parameter.requires_grad_(False)
    prompt = torch.zeros(encoder.blks[0].ffn.dense1.in_features, requires_grad=True)

    def add_prompt(module, args, output):
        return output + prompt if module is encoder.token_embedding else None
    register = (encoder.token_embedding.register_forward_hook if where == "submodule"
                else torch.nn.modules.module.register_module_forward_hook)
    handle = register(add_prompt)
    tokens, segments = random_inputs(B, L, VOCAB)
    try:
        with pytest.warns(CudaGraphFallbackWarning, match=r"forward hooks") as record:
            out = encoder(tokens, segments)
            encoder(tokens, segments)
        assert len(fallback_warnings(record)) == 1
        out.sum().backward()
        assert prompt.grad is not None and torch.count_nonzero(prompt.grad) > 0
        assert stub.attempts == 0
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            graphed(encoder, tokens, segments)       # without grad mode the graphs serve
        assert stub.attempts == 1
    finally:
        handle.remove()


def test_dispatch_modes_see_the_eager_forward(stub):
    """FakeTensorMode (shape inference) or a FLOP counter: the mode must see the ops, and a
    replay would keep its fake tensors as the graphs' static buffers."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.utils.flop_counter import FlopCounterMode
    encoder = auto_encoder(check_inputs=False)       # (the checks read values: no fake tensor has them)
    tokens, segments = random_inputs(B, L, VOCAB)
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        fake = graphed(encoder, mode.from_tensor(tokens), mode.from_tensor(segments))
    assert fake.shape == (B, L, encoder.blks[0].ffn.dense1.in_features)
    with FlopCounterMode(display=False) as counter:
        graphed(encoder, tokens, segments)
    assert counter.get_total_flops() > 0
    assert stub.attempts == 0
    assert_eager_result(graphed(encoder, tokens, segments), eager_forward(encoder, tokens, segments))
    assert stub.attempts == 1


def test_the_host_benchmarks_op_counter_sees_the_replay(stub):
    """The host benchmark counts ops per call under a dispatch mode: graphs must replay under
    it (its "cuda_graphs forward" rows counted the eager forward's ops)."""
    from bert_fast.host_bench import _OpCounter
    encoder = auto_encoder(check_inputs=False)
    tokens, segments = random_inputs(B, L, VOCAB)
    expected = eager_forward(encoder, tokens, segments)
    graphed(encoder, tokens, segments)
    replays = stub.replays
    with _OpCounter() as replayed:
        assert_eager_result(graphed(encoder, tokens, segments), expected)
    assert stub.replays == replays + 1 and replayed.calls > 0     # (the stub's replay runs the ops: no fewer here)


def test_new_matmul_precision_api_and_any_autocast_are_in_the_key(stub):
    """torch.backends.cuda.matmul.fp32_precision (the legacy getter raises once it is used, on
    torch 2.13), fp16 accumulation and autocast for another device type are read by the
    forward: each change captures again."""
    encoder = auto_encoder()
    tokens, segments = random_inputs(B, L, VOCAB)
    graphed(encoder, tokens, segments)
    assert stub.attempts == 1
    matmul = torch.backends.cuda.matmul
    for name, value in (("fp32_precision", "tf32"), ("allow_fp16_accumulation", True)):
        before, attempts = getattr(matmul, name), stub.attempts   # (cuBLASModule: no monkeypatch)
        setattr(matmul, name, value)
        try:
            graphed(encoder, tokens, segments)
        finally:
            setattr(matmul, name, before)
        assert stub.attempts == attempts + 1, name
    attempts = stub.attempts
    with torch.autocast("cpu", dtype=torch.bfloat16):
        graphed(encoder, tokens, segments)
    assert stub.attempts == attempts + 1


def test_cpu_inputs_run_eagerly_with_one_warning():
    """No stub: the real steps have no graphs for CPU tensors."""
    encoder = auto_encoder()
    tokens, segments = random_inputs(B, L, VOCAB)
    valid_lens = lengths("1d_float_pos", B, L)
    with pytest.warns(CudaGraphFallbackWarning, match=r"inputs are on cpu; CUDA graphs need CUDA tensors") as record:
        out = graphed(encoder, tokens, segments, valid_lens)
        graphed(encoder, tokens, segments, valid_lens)
    assert len(fallback_warnings(record)) == 1
    assert record[0].filename == __file__, "the warning should point at the caller"
    assert torch.equal(out, eager_forward(encoder, tokens, segments, valid_lens))
    assert cuda_graph_stats(encoder)["eager_device"] == 2


class CpuOnlySteps(StubSteps):
    def supports(self, device):
        return device.type == "cpu"


def test_inputs_on_another_device_raise_and_keep_the_graphs(monkeypatch):
    """Inputs on another device than the module's get the eager forward's error, and leave the
    graphs and counters as they were (meta stands for the other device)."""
    steps = CpuOnlySteps()
    monkeypatch.setattr(cuda_graph, "_steps", steps)
    encoder = auto_encoder()
    for seqlen in (16, 32):
        call_bucket(encoder, seqlen)
    tokens, segments = random_inputs(1, 16, VOCAB)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(ValueError, match="tokens is on meta but the model's parameters are on cpu"):
            graphed(encoder, tokens.to("meta"), segments.to("meta"))
        call_bucket(encoder, 16)
    stats = cuda_graph_stats(encoder)
    assert steps.attempts == 2 and len(stats["buckets"]) == 2 and "invalidations" not in stats
    assert not any(name.startswith("eager_") for name in stats)


class SlowStubSteps(StubSteps):
    """Captures and replays that take long enough for another thread to come in meanwhile."""

    def __init__(self):
        super().__init__()
        self.captures = []         # (start, end) of each capture

    def capture(self, run, device, pool):
        start = time.perf_counter()
        time.sleep(0.05)
        result = super().capture(run, device, pool)
        self.captures.append((start, time.perf_counter()))
        return result


def test_threads_calling_one_encoder_get_their_own_results(monkeypatch):
    """Calls share the static buffers: a lock per encoder serialises them (else a thread reads
    another's replay)."""
    monkeypatch.setattr(cuda_graph, "_steps", SlowStubSteps())
    replay = StubGraph.replay

    def slow_replay(graph):
        time.sleep(0.002)
        replay(graph)

    monkeypatch.setattr(StubGraph, "replay", slow_replay)
    encoder = auto_encoder(check_inputs=False)
    inputs = [random_inputs(2, 16, VOCAB) for _ in range(2)]
    expected = [eager_forward(encoder, *x) for x in inputs]
    graphed(encoder, *inputs[0])
    wrong = [0, 0]

    def serve(i):
        for _ in range(10):
            wrong[i] += max_err(graphed(encoder, *inputs[i]), expected[i]) > FLOOR[torch.float32]

    threads = [threading.Thread(target=serve, args=(i,)) for i in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert wrong == [0, 0]


def test_one_capture_at_a_time_in_the_process(monkeypatch):
    """Captures share each device's capture stream: two threads' encoders capture in turn."""
    steps = SlowStubSteps()
    monkeypatch.setattr(cuda_graph, "_steps", steps)
    encoders = [auto_encoder(), auto_encoder()]
    threads = [threading.Thread(target=call_bucket, args=(encoder, 32)) for encoder in encoders]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    (start0, end0), (start1, end1) = sorted(steps.captures)
    assert end0 <= start1


def test_failed_capture_runs_eagerly_and_is_not_retried(stub):
    stub.fail = True
    encoder = auto_encoder()
    tokens, segments = random_inputs(B, L, VOCAB)
    valid_lens = lengths("1d_int_pos", B, L)
    with pytest.warns(CudaGraphFallbackWarning) as record:
        out = graphed(encoder, tokens, segments, valid_lens)
        again = graphed(encoder, tokens, segments, valid_lens)      # the same bucket: not retried
        call_bucket(encoder, 100)                                   # another bucket: tried, silently
    (message,) = fallback_warnings(record)
    assert "capturing the CUDA graph of bucket (batch 4, seq_len 48" in message
    assert "RuntimeError: simulated capture failure)" in message and "second line" not in message
    assert torch.equal(out, eager_forward(encoder, tokens, segments, valid_lens)) and torch.equal(out, again)
    assert stub.attempts == 2
    stats = cuda_graph_stats(encoder)
    assert len(stats["failed"]) == 2 and stats["buckets"] == [] and stats["eager_capture"] == 3

    stub.fail = False
    clear_cuda_graphs(encoder)                                      # forgets failures
    graphed(encoder, tokens, segments, valid_lens)
    assert stub.attempts == 3 and len(cuda_graph_stats(encoder)["buckets"]) == 1


def test_capture_after_a_failed_one_uses_a_new_pool(stub):
    """The allocator may refuse a failed capture's pool ("already recording to mempool_id", torch
    2.11 on an H200): captures share one pool until one fails, and the next one gets a new pool;
    the graph held from before still replays."""
    encoder = auto_encoder()
    call_bucket(encoder, 40)
    call_bucket(encoder, 80)
    stub.fail = True
    with pytest.warns(CudaGraphFallbackWarning):
        call_bucket(encoder, 120)
    stub.fail = False
    call_bucket(encoder, 160)
    call_bucket(encoder, 40)
    first, second, failed, after = stub.pools
    assert first is second is failed and after is not failed
    stats = cuda_graph_stats(encoder)
    assert len(stats["buckets"]) == 3 and len(stats["failed"]) == 1 and stats["replays"] == 4, stats


def test_failure_of_the_forward_itself_propagates(stub, monkeypatch):
    """A capture that fails because the forward fails: the eager call fails too and raises;
    the bucket is not marked failed (the inputs, not the graph, were the problem)."""
    encoder = auto_encoder()
    tokens, segments = random_inputs(B, L, VOCAB)

    def broken(*args, **kwargs):
        raise RuntimeError("broken block")

    monkeypatch.setattr(encoder.blks[0], "forward", broken)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(RuntimeError, match="broken block"):
            graphed(encoder, tokens, segments)
    assert cuda_graph_stats(encoder)["failed"] == [] and encoder.check_inputs is True


def test_compile_tracing_and_outer_capture_run_eagerly_without_warning(stub, monkeypatch):
    encoder = auto_encoder()
    tokens, segments = random_inputs(B, L, VOCAB)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with monkeypatch.context() as patch:
            patch.setattr(torch.compiler, "is_compiling", lambda: True)
            out = graphed(encoder, tokens, segments)
        with monkeypatch.context() as patch:
            patch.setattr(stub, "capturing", lambda device: True)
            graphed(encoder, tokens, segments)
    assert torch.equal(out, eager_forward(encoder, tokens, segments))
    assert stub.attempts == 0


# --------------------------------------------------------------------------- input checks

def test_input_check_runs_before_capture_and_replay(stub, monkeypatch):
    # The values are checked from the staged inputs' stats (graph_inputs: one host read per call),
    # outside the graph, with the eager check's messages; the eager check itself never runs.
    reads, checks = [], []
    real_stats, real_check = graph_inputs.input_stats, modules.check_encoder_inputs

    def recorded_stats(*args, **kwargs):
        reads.append(stub.active)
        return real_stats(*args, **kwargs)

    def recorded_check(*args, **kwargs):
        checks.append(stub.active)
        return real_check(*args, **kwargs)

    monkeypatch.setattr(graph_inputs, "input_stats", recorded_stats)
    monkeypatch.setattr(modules, "check_encoder_inputs", recorded_check)
    encoder = auto_encoder()
    tokens, segments = random_inputs(B, L, VOCAB)
    valid_lens = lengths("1d_int_pos", B, L)
    bad_tokens = tokens.clone()
    bad_tokens[1, 4] = VOCAB
    with pytest.raises(ValueError, match=rf"token ids must be in \[0, {VOCAB}\)"):
        graphed(encoder, bad_tokens, segments, valid_lens)
    assert stub.attempts == 0 and reads == [False] and checks == []

    graphed(encoder, tokens, segments, valid_lens)          # capture + replay: one read, before both
    assert reads == [False, False] and checks == [] and stub.attempts == 1 and stub.replays == 1
    assert encoder.check_inputs is True

    with pytest.raises(ValueError, match=r"segment ids must be 0 or 1"):
        graphed(encoder, tokens, segments + 1, valid_lens)
    assert stub.replays == 1, "replayed after a failed input check"
    with pytest.raises(ValueError, match=r"valid_lens must have shape \(batch,\)"):
        graphed(encoder, tokens, segments, valid_lens[:2])
    with pytest.raises(ValueError, match=r"sequence length 201 exceeds max_len 200"):
        graphed(encoder, *random_inputs(1, AUTO_MAX_LEN + 1, VOCAB))
    float_lens = valid_lens.float()
    float_lens[0] = float("nan")
    with pytest.raises(ValueError, match=r"valid_lens contains NaN"):
        graphed(encoder, tokens, segments, float_lens)

    encoder.check_inputs = False            # off: no check; a read only where L is padded (keyless rows)
    count = len(reads), len(checks)
    graphed(encoder, tokens, segments, valid_lens)
    assert (len(reads), len(checks)) == (count[0] + 1, count[1]) and stub.replays == 2
    graphed(encoder, tokens[:, :32], segments[:, :32], valid_lens)       # L = 32, a bucket length: no read
    assert (len(reads), len(checks)) == (count[0] + 1, count[1]) and stub.replays == 3
    assert not any(reads + checks), "an input check ran inside a capture or replay"


@pytest.mark.parametrize("seqlen", [L, 32], ids=["L_padded", "L_bucket"])
@pytest.mark.parametrize("skip_padding", [False, True], ids=["exact", "skip_padding"])
def test_input_check_from_the_staged_inputs(stub, staging, skip_padding, seqlen):
    """Each bad value gets the eager check's error, whichever way the inputs are staged; valid
    calls after them replay (the buffers hold the valid call's values). Where the call needs no
    other read (exact mode at a bucket length) the replay is launched before the values are
    read: it must find the bad ids staged clamped (the torch backend's CPU lookup, which the stub's
    replay runs, raises IndexError for an id out of range), and its output is not returned.
    Elsewhere the check comes before any replay."""
    after_launch = not skip_padding and seqlen == 32
    encoder = auto_encoder(skip_padding=skip_padding)
    tokens, segments = random_inputs(B, seqlen, VOCAB)
    valid_lens = lengths("1d_float_pos", B, seqlen)
    expected = eager_forward(encoder, tokens, segments, valid_lens)
    assert_eager_result(graphed(encoder, tokens, segments, valid_lens), expected)
    low, high, bad_segments, nan_lens = tokens.clone(), tokens.clone(), segments.clone(), valid_lens.clone()
    low[0, 3], high[2, seqlen - 1], bad_segments[1, 0], nan_lens[2] = -1, VOCAB, 2, float("nan")
    id_buffer, segment_buffer, _ = next(iter(cuda_graph._state_of(encoder).slots.values())).buffers
    for args, message in [((low, segments, valid_lens), rf"token ids must be in \[0, {VOCAB}\), got values in \[-1, "),
                          ((high, segments, valid_lens), rf"token ids must be in \[0, {VOCAB}\), got values in \[0, {VOCAB}\]"),
                          ((tokens, bad_segments, valid_lens), r"segment ids must be 0 or 1, got values in \[0, 2\]"),
                          ((tokens, segments, nan_lens), r"valid_lens contains NaN")]:
        with pytest.raises(ValueError, match=message):
            graphed(encoder, *args)
        if after_launch:
            assert 0 <= int(id_buffer.min()) and int(id_buffer.max()) < VOCAB and int(segment_buffer.max()) <= 1
    assert stub.replays == (5 if after_launch else 1)
    assert_eager_result(graphed(encoder, tokens, segments, valid_lens), expected, "after the errors")
    assert stub.attempts == 1 and stub.replays == (6 if after_launch else 2)


def test_staging_kernel_failure_falls_back_to_torch_ops(stub, monkeypatch):
    """A staging kernel that cannot run (e.g. a GPU this Triton cannot compile for) costs one
    warning; that device's calls then stage with PyTorch ops, with the same results."""
    attempts = []

    def failing(*args, **kwargs):
        attempts.append(1)
        raise RuntimeError("no kernel image is available for execution on the device\nsecond line")

    monkeypatch.setattr(graph_inputs, "cpu_kernel", lambda t: False)      # CPU tensors take the kernel's path
    monkeypatch.setattr(graph_inputs, "stage_inputs", failing)
    monkeypatch.setattr(graph_inputs, "_FAILED_DEVICES", set())
    encoder = auto_encoder()
    tokens, segments = random_inputs(B, L, VOCAB)
    valid_lens = lengths("1d_float_pos", B, L)
    expected = eager_forward(encoder, tokens, segments, valid_lens)
    with pytest.warns(RuntimeWarning, match=r"staging kernel failed on cpu \(RuntimeError: no kernel image"):
        assert_eager_result(graphed(encoder, tokens, segments, valid_lens), expected)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert_eager_result(graphed(encoder, tokens, segments, valid_lens), expected, "second call")
    assert len(attempts) == 1 and stub.attempts == 1 and stub.replays == 2


def test_tensor_subclass_parameters_run_eagerly(stub):
    class Tagged(torch.Tensor):
        pass

    encoder = auto_encoder()
    encoder.register_buffer("tag", torch.zeros(1).as_subclass(Tagged))
    tokens, segments = random_inputs(B, L, VOCAB)
    with pytest.warns(CudaGraphFallbackWarning, match=r"tensor subclass \(Tagged 'tag'\)"):
        out = graphed(encoder, tokens, segments)
    assert torch.equal(out, eager_forward(encoder, tokens, segments)) and stub.attempts == 0


# --------------------------------------------------------------------------- graphed_forward on the GPU

AUTO_GPU_CASES = ["none", "1d_int_pos", "1d_int_zero", "1d_float_pos", "2d_int_pos", "2d_float_zero"]


def auto_gpu_pair(backend, dtype, **options):
    """(fp32 eager encoder, the same weights in ``dtype`` with cuda_graphs=True), on the GPU."""
    require_backend(backend)
    reference = FastBERTEncoder(**encoder_config(max_len=AUTO_MAX_LEN), backend=backend, **options).eval().cuda()
    encoder = copy.deepcopy(reference).to(dtype)
    encoder.cuda_graphs = True
    return reference, encoder


def auto_gpu_inputs(batch, seqlen, case):
    tokens, segments = (t.cuda() for t in random_inputs(batch, seqlen, VOCAB))
    return tokens, segments, lengths(case, batch, seqlen, device="cuda")


def assert_graphed_within_rule(reference, encoder, inputs, what):
    """The graphed call against the eager one: fp32 within the fp32 floor; lower precision by
    STYLE.md's rule, against the fp32 encoder's eager call."""
    with torch.inference_mode():
        actual = encoder(*inputs)
        same_precision = encoder._forward(*inputs)
        expected = reference._forward(*inputs) if actual.dtype != torch.float32 else same_precision
    assert actual.shape == same_precision.shape and actual.dtype == same_precision.dtype, what
    if actual.dtype == torch.float32:
        assert_close(actual, expected, atol=FLOOR[torch.float32], what=what)
    else:
        assert_within_rule(actual, expected, same_precision, what=what)
    return actual


@needs_cuda
@pytest.mark.parametrize("skip_padding", [False, True], ids=["exact", "skip_padding"])
@pytest.mark.parametrize("case", AUTO_GPU_CASES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("backend", BACKENDS)
def test_auto_graph_matches_eager(backend, dtype, case, skip_padding):
    if skip_padding and case.startswith("2d"):
        pytest.skip("skip_padding takes 1-D valid_lens")
    reference, encoder = auto_gpu_pair(backend, dtype, skip_padding=skip_padding)
    first = auto_gpu_inputs(B, L, case)
    assert_graphed_within_rule(reference, encoder, first, "first call (capture)")
    # Same shapes and lengths, new ids: the same bucket, replayed with the new inputs.
    tokens, segments, _ = auto_gpu_inputs(B, L, case)
    second = (tokens, segments, first[2])
    out = assert_graphed_within_rule(reference, encoder, second, "second call (replay)")
    stats = cuda_graph_stats(encoder)
    assert stats["captures"] == 1 and stats["replays"] == 2, stats
    assert not any(name.startswith("eager_") for name in stats), stats
    with torch.inference_mode():
        assert not torch.equal(out, encoder._forward(*first)), "the replay did not follow the new inputs"
    # Another shape of the same (B, L) bucket.
    assert_graphed_within_rule(reference, encoder, auto_gpu_inputs(4, 45, case), "(4, 45)")


def bad_ids_after_the_launch(backend):
    """In a child process: at L 32 (a bucket length) with valid_lens None the value check reads
    the staged id ranges after the replay is launched. The replay must read the bad ids staged as
    0 (the torch backend's lookup is F.embedding, whose device-side assert would end the CUDA
    context), the call raise the check's error, and the next call replay correctly."""
    require_backend(backend)
    _, encoder = auto_gpu_pair(backend, torch.float32)
    tokens, segments, _ = auto_gpu_inputs(B, 32, "none")
    with torch.inference_mode():
        encoder(tokens, segments)
        for bad_tokens, bad_segments in [(tokens.clone().fill_(VOCAB), segments), (tokens.clone().fill_(-1), segments),
                                         (tokens, segments + 1)]:
            try:
                encoder(bad_tokens, bad_segments)
            except ValueError as error:
                assert "ids must be" in str(error), error
            else:
                raise AssertionError("bad ids gave no error")
        actual, expected = encoder(tokens, segments), encoder._forward(tokens, segments)
    torch.cuda.synchronize()
    assert_close(actual, expected, atol=FLOOR[torch.float32], what="after the bad calls")
    assert cuda_graph_stats(encoder)["replays"] == 2


@needs_cuda
@pytest.mark.parametrize("backend", BACKENDS)
def test_auto_graph_bad_ids_checked_after_the_launch(backend):
    require_backend(backend)
    call_in_child(bad_ids_after_the_launch, backend)


@needs_cuda
def test_auto_graph_failed_capture_leaves_cuda_usable(monkeypatch):
    """A forward that synchronises during capture (an .item()) invalidates it: the call runs
    eagerly, warns once, and the next bucket captures and replays normally."""
    reference, encoder = auto_gpu_pair("auto", torch.float32)
    block_forward = encoder.blks[0].forward
    sync_in = {48}

    def syncing(X, *args, **kwargs):
        out = block_forward(X, *args, **kwargs)
        if torch.cuda.is_current_stream_capturing() and X.shape[1] in sync_in:
            out.sum().item()
        return out

    monkeypatch.setattr(encoder.blks[0], "forward", syncing)
    inputs = auto_gpu_inputs(B, L, "1d_int_pos")
    with pytest.warns(CudaGraphFallbackWarning, match=r"capturing the CUDA graph of bucket \(batch 4, seq_len 48"):
        assert_graphed_within_rule(reference, encoder, inputs, "after a failed capture")
    assert len(cuda_graph_stats(encoder)["failed"]) == 1
    torch.cuda.empty_cache()          # what the next torch.cuda.graph does first; fails if the allocator
    torch.cuda.synchronize()          # still believes a capture is under way
    assert_graphed_within_rule(reference, encoder, auto_gpu_inputs(B, 60, "1d_int_pos"), "next bucket")
    stats = cuda_graph_stats(encoder)
    assert stats["captures"] == 2 and len(stats["buckets"]) == 1 and stats["replays"] == 1, stats


@needs_cuda
def test_auto_graph_follows_parameters():
    reference, encoder = auto_gpu_pair("auto", torch.float32)
    inputs = auto_gpu_inputs(B, L, "1d_float_pos")
    assert_graphed_within_rule(reference, encoder, inputs, "captured")
    with torch.no_grad():
        encoder.blks[0].ffn.dense1.weight.mul_(0.5)         # in place: the graph reads it
    assert_graphed_within_rule(reference, encoder, inputs, "after mul_")
    assert cuda_graph_stats(encoder)["captures"] == 1
    state = {name: value.clone() for name, value in FastBERTEncoder(
        **encoder_config(max_len=AUTO_MAX_LEN)).state_dict().items()}
    encoder.load_state_dict(state, assign=True)              # replaced (on the CPU): eager names the device
    encoder.cuda()
    assert_graphed_within_rule(reference, encoder, inputs, "after load_state_dict(assign=True) and .cuda()")
    stats = cuda_graph_stats(encoder)
    assert stats["captures"] == 2 and stats["invalidations"] == 1


@needs_cuda
def test_auto_graph_across_streams():
    reference, encoder = auto_gpu_pair("auto", torch.float32)
    side = torch.cuda.Stream()
    first, second = auto_gpu_inputs(B, L, "1d_int_pos"), auto_gpu_inputs(B, L, "1d_int_pos")
    with torch.inference_mode():
        expected = [encoder._forward(*first), encoder._forward(*second)]
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            out_side = encoder(*first)
        out_main = encoder(*second)       # waits for the side stream's replay before refilling the buffers
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
    assert_close(out_side, expected[0], atol=FLOOR[torch.float32], what="replay on a side stream")
    assert_close(out_main, expected[1], atol=FLOOR[torch.float32], what="then on the main stream")

    # Eviction after a stream switch: the dropped buffers are recorded on the last replay's stream.
    encoder.max_cuda_graphs = 1
    other = auto_gpu_inputs(B, 70, "1d_int_pos")
    with torch.inference_mode():
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            out_other = encoder(*other)
        torch.cuda.current_stream().wait_stream(side)
        expected_other = encoder._forward(*other)
    assert_close(out_other, expected_other, atol=FLOOR[torch.float32], what="after an eviction on a side stream")
    assert cuda_graph_stats(encoder)["evictions"] == 1


@needs_cuda
def test_auto_graph_memory_is_bounded_and_released():
    reference, encoder = auto_gpu_pair("auto", torch.float32)
    encoder.max_cuda_graphs = 2
    # A first round creates what lives on (the capture stream's cuBLAS workspace, autotuning).
    assert_graphed_within_rule(reference, encoder, auto_gpu_inputs(2, 16, "none"), "first round")
    clear_cuda_graphs(encoder)
    torch.cuda.synchronize()
    baseline = torch.cuda.memory_allocated()
    for seqlen in (16, 32, 48, 64, 80):
        assert_graphed_within_rule(reference, encoder, auto_gpu_inputs(2, seqlen, "none"), f"L={seqlen}")
    stats = cuda_graph_stats(encoder)
    assert len(stats["buckets"]) == 2 and stats["evictions"] == 3
    assert clear_cuda_graphs(encoder) == 2
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() <= baseline + 2 ** 20, "graphs' buffers outlived clear_cuda_graphs"


@needs_cuda
def test_capture_encoder_of_an_auto_graph_encoder():
    """capture_encoder runs the module's eager forward: no graphs inside its warmup."""
    reference, encoder = auto_gpu_pair("auto", torch.float32)
    tokens, segments, valid_lens = auto_gpu_inputs(B, L, "1d_int_pos")
    graphed_encoder = capture_encoder(encoder, tokens, segments, valid_lens)
    assert encoder.cuda_graphs is True and encoder.check_inputs is True
    assert cuda_graph_stats(encoder)["buckets"] == []
    assert_matches_eager(graphed_encoder(tokens, segments, valid_lens),
                         eager(reference, tokens, segments, valid_lens), "capture_encoder")


def test_optimize_passes_cuda_graphs(stub):
    import bert_fast
    config = encoder_config(max_len=AUTO_MAX_LEN)
    reference = R.BERTEncoder(**config).eval()
    tokens, segments = random_inputs(B, L, VOCAB)
    valid_lens = lengths("1d_int_pos", B, L)
    with torch.no_grad():
        expected = reference(tokens, segments, valid_lens)
    fast = bert_fast.optimize(reference, cuda_graphs=True)
    assert isinstance(fast, FastBERTEncoder) and fast.cuda_graphs
    assert_eager_result(graphed(fast, tokens, segments, valid_lens), expected, "optimized reference")
    assert stub.attempts == 1


# --------------------------------------------------------------------------- training (GPU)
# Graphs for training are PyTorch's torch.cuda.make_graphed_callables (README, "CUDA graphs for
# training"): the forward and the backward each captured once, replayed on every step, the
# parameters' gradients accumulated by autograd as in eager. The eager path reads no values on
# the host (tests/test_thin_path.py), so it can be captured with check_inputs off.

def graphed_for_training(encoder, inputs):
    encoder.check_inputs = False
    # allow_unused_input: pos_embedding gets no gradient (REFERENCE.md's quirk), and neither
    # do the integer inputs.
    return torch.cuda.make_graphed_callables(encoder, inputs, allow_unused_input=True)


def training_inputs(case, variant):
    """make_graphed_callables takes tensors only: no valid_lens is no third argument."""
    tokens, segments = gpu_inputs()
    valid_lens = make_valid_lens(case, variant)
    return (tokens, segments) if valid_lens is None else (tokens, segments, valid_lens)


@needs_cuda
@pytest.mark.parametrize("case", ["none", "1d_int", "2d_float"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_training_steps_in_make_graphed_callables_match_eager(backend, case):
    """Three steps (forward, backward, an in-place SGD update) on new inputs each: the graphed
    encoder's outputs and gradients equal the eager copy's, so the replays read the inputs
    copied in and the parameters as updated in place."""
    eager_encoder = gpu_encoder(backend, check_inputs=False).train()
    graphed_encoder = graphed_for_training(copy.deepcopy(eager_encoder), training_inputs(case, 0))
    for step in range(3):
        inputs = training_inputs(case, step % 2)
        weight = torch.randn(B, L, eager_encoder.blks[0].ffn.dense2.out_features, device="cuda")
        results = []
        for encoder in (eager_encoder, graphed_encoder):
            encoder.zero_grad(set_to_none=True)
            out = encoder(*inputs)
            (out * weight).sum().backward()
            results.append((out.detach().clone(), {name: p.grad.clone() for name, p in encoder.named_parameters()
                                                   if p.grad is not None}))
            with torch.no_grad():
                for p in encoder.parameters():
                    if p.grad is not None:
                        p.add_(p.grad, alpha=-1e-3)
        (out_eager, grads_eager), (out_graphed, grads_graphed) = results
        assert_close(out_graphed, out_eager, atol=FLOOR[torch.float32], what=f"step {step}: output")
        assert grads_graphed.keys() == grads_eager.keys() and grads_eager, step
        for name, grad in grads_eager.items():
            assert_close(grads_graphed[name], grad, atol=1e-4, rtol=1e-3, what=f"step {step}: grad {name}")


@needs_cuda
def test_training_graph_with_dropout_draws_new_masks_each_replay():
    """The dropout seeds are drawn on the device inside the graph (torch.randint with the CUDA
    generator's graph-safe state): each replay drops other elements."""
    torch.manual_seed(0)
    encoder = FastBERTEncoder(**encoder_config(dropout=0.1), check_inputs=False).cuda().train()
    inputs = training_inputs("1d_int", 0)
    graphed = graphed_for_training(encoder, inputs)
    outputs = []
    for _ in range(2):
        out = graphed(*inputs)
        out.sum().backward()
        outputs.append(out.detach().clone())
    assert all(o.isfinite().all() for o in outputs)
    assert not torch.equal(outputs[0], outputs[1]), "two replays drew the same dropout masks"


@needs_cuda
def test_training_capture_with_the_value_check_on_says_to_turn_it_off():
    encoder = gpu_encoder("auto").train()
    inputs = training_inputs("1d_int", 0)
    with pytest.raises(RuntimeError, match=r"check_inputs=True reads the input values.*module.check_inputs = False"):
        torch.cuda.make_graphed_callables(encoder, inputs, allow_unused_input=True)
    torch.cuda.synchronize()          # the capture ended cleanly: CUDA still works, and so does a capture
    graphed_for_training(encoder, inputs)(*inputs).sum().backward()
