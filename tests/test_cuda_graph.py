"""capture_encoder: CUDA-graph replay of the encoder's inference forward.

The argument checks run on the CPU; everything that captures a graph needs a GPU. On the GPU
the graphed call is compared with the eager call of the same module on the same inputs, in
the same (inference) mode, so the kernels and their launch parameters are the same: bf16 must
match bit for bit, fp32 within the fp32 floor (it should be bitwise too; the floor only keeps
the test about the graph, not about cuBLAS heuristics).
"""

import pytest
import torch

import bert_fast.cuda_graph as cuda_graph
import bert_fast.modules as modules
from bert_fast import FastBERTEncoder, FastBERTModel
from bert_fast import reference as R
from bert_fast.backend import resolve_backend
from bert_fast.cuda_graph import GraphedEncoder, capture_encoder
from tests.helpers import BF16_OK, FLOOR, assert_close, encoder_config, max_err, needs_cuda, random_inputs

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
