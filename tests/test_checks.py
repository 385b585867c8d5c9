"""Bad input gets a clear error that says what was wrong and what is allowed."""

import pytest
import torch

from bert_fast import FastBERTEncoder, FastEncoderBlock, FastMultiHeadAttention, extension
from tests.helpers import encoder_config, encoder_pair, interpreted_kernels, random_inputs

B, L = 2, 7


@pytest.fixture
def fast():
    return encoder_pair(encoder_config(max_len=16))[1]


def call(model, tokens=None, segments=None, valid_lens="default"):
    t, s = random_inputs(B, L, 50)
    tokens = t if tokens is None else tokens
    segments = s if segments is None else segments
    valid_lens = torch.tensor([3, 7]) if isinstance(valid_lens, str) else valid_lens
    return model(tokens, segments, valid_lens)


@pytest.mark.parametrize("kwargs,error,message", [
    (dict(tokens=torch.tensor([[0, 1, 50, 2, 3, 4, 5], [0] * 7])), ValueError, r"token ids must be in \[0, 50\)"),
    (dict(tokens=torch.tensor([[0, -1, 5, 2, 3, 4, 5], [0] * 7])), ValueError, r"token ids must be in \[0, 50\)"),
    (dict(tokens=torch.zeros(B, L)), TypeError, r"tokens must have dtype torch.int64 \(torch.long\) or torch.int32"),
    (dict(tokens=torch.zeros(B, L, dtype=torch.bool)), TypeError, r"tokens must have dtype torch.int64 \(torch.long\) or torch.int32"),
    (dict(tokens=torch.zeros(B * L, dtype=torch.long)), ValueError, r"tokens must have shape \(batch, seq_len\)"),
    (dict(tokens=[[1, 2]]), TypeError, "tokens must be a torch.Tensor"),
    (dict(segments=torch.full((B, L), 2)), ValueError, "segment ids must be 0 or 1"),
    (dict(segments=torch.full((B, L), -1)), ValueError, "segment ids must be 0 or 1"),
    (dict(segments=torch.zeros(B, L + 1, dtype=torch.long)), ValueError, "segments must have the shape of tokens"),
    (dict(segments=torch.zeros(B, L)), TypeError, r"segments must have dtype torch.int64 \(torch.long\) or torch.int32"),
    (dict(tokens=torch.zeros(B, 17, dtype=torch.long), segments=torch.zeros(B, 17, dtype=torch.long)),
     ValueError, "sequence length 17 exceeds max_len 16"),
    (dict(valid_lens=torch.tensor([1, 2, 3])), ValueError, r"valid_lens must have shape \(batch,\)"),
    (dict(valid_lens=torch.ones(B, L + 1)), ValueError, r"valid_lens must have shape \(batch,\)"),
    (dict(valid_lens=torch.ones(B, 1, L)), ValueError, r"valid_lens must have shape \(batch,\)"),
    (dict(valid_lens=torch.tensor([True, False])), TypeError, "valid_lens must have a real"),
    (dict(valid_lens=torch.tensor([1.0, float("nan")])), ValueError, "valid_lens contains NaN"),
    (dict(valid_lens=[3, 7]), TypeError, "valid_lens must be a torch.Tensor or None"),
    (dict(tokens=torch.zeros(B, 0, dtype=torch.long), segments=torch.zeros(B, 0, dtype=torch.long),
          valid_lens=None), ValueError, "tokens must be non-empty"),
])
def test_bad_inputs_raise_clear_errors(fast, kwargs, error, message):
    with pytest.raises(error, match=message):
        call(fast, **kwargs)


def test_inputs_on_another_device(fast):
    # The meta device stands in for "another device" on a CPU-only machine.
    tokens = torch.zeros(B, L, dtype=torch.long, device="meta")
    with pytest.raises(ValueError, match="tokens is on meta but the model's parameters are on cpu"):
        call(fast, tokens=tokens, segments=tokens)
    with pytest.raises(ValueError, match="valid_lens is on meta"):
        call(fast, valid_lens=torch.ones(B, device="meta"))


def test_checks_can_be_turned_off():
    cfg = encoder_config(max_len=16)
    fast = FastBERTEncoder(**cfg, check_inputs=False).eval()
    tokens, segments = random_inputs(B, L, 50)
    fast(tokens, segments, torch.tensor([3, 7]))     # runs without validating
    assert not fast.check_inputs


def test_value_check_inside_a_cuda_graph_capture_says_to_turn_it_off(fast, monkeypatch):
    """Inside a capture the value check's host read would end the capture with a CUDA error;
    it raises first, saying how to capture (tests/test_cuda_graph.py runs a real capture)."""
    from bert_fast import checks
    monkeypatch.setattr(checks, "_capturing_cuda_graph", lambda t: True)
    monkeypatch.setattr(checks, "_check_values", lambda *args: pytest.fail("read the values"))
    with pytest.raises(RuntimeError, match=r"check_inputs=True reads the input values.*"
                                           r"module.check_inputs = False.*module.validate_inputs"):
        call(fast)
    fast.check_inputs = False
    call(fast)


@pytest.mark.parametrize("change,message", [
    (dict(norm_shape=[7, 64]), r"norm_shape must be \[num_hiddens\]"),
    (dict(num_heads=3), "must be divisible by num_heads"),
    (dict(query_size=32), r"query_size \(32\) must equal num_hiddens"),
    (dict(ffn_num_input=32), r"ffn_num_input \(32\) must equal num_hiddens"),
])
def test_unsupported_config(change, message):
    with pytest.raises(ValueError, match=message):
        FastBERTEncoder(**{**encoder_config(), **change})


def test_unknown_options():
    with pytest.raises(ValueError, match="activation must be one of"):
        FastBERTEncoder(**encoder_config(), activation="swish")
    with pytest.raises(ValueError, match="unknown backend 'tpu'"):
        FastEncoderBlock(8, 8, 8, 8, [8], 8, 16, 2, 0.0, backend="tpu")
    with pytest.raises(ValueError, match="must be divisible"):
        FastMultiHeadAttention(8, 8, 8, 10, 3, 0.0)


def test_cuda_backend_without_the_extension_says_how_to_build_it(monkeypatch):
    from bert_fast import extension
    monkeypatch.setattr(extension, "load", lambda: False)
    with pytest.raises(ValueError, match="backend 'cuda' needs bert_fast's compiled extension.*build_extension"):
        FastBERTEncoder(**encoder_config(), backend="cuda")


def test_backend_from_environment(monkeypatch):
    monkeypatch.setenv("BERT_FAST_BACKEND", "tpu")
    with pytest.raises(ValueError, match="unknown backend 'tpu'"):
        FastBERTEncoder(**encoder_config())
    monkeypatch.setenv("BERT_FAST_BACKEND", "torch")
    assert FastBERTEncoder(**encoder_config()).backend == "torch"
    monkeypatch.delenv("BERT_FAST_BACKEND")
    encoder = FastBERTEncoder(**encoder_config())
    assert encoder.backend == "auto" and encoder.blks[0].addnorm1.backend == "auto"


def test_auto_backend_follows_the_device():
    from bert_fast import backend
    from bert_fast.ops._triton import HAS_TRITON
    assert backend.backend_for("auto", torch.device("cpu")) == "torch"
    if not (backend.AUTO_USES_TRITON_ON_CUDA and HAS_TRITON):
        expected = "torch"
    elif torch.cuda.is_available() and extension.kernel_image_problem(0) is None:     # built with CUDA kernels for this GPU
        expected = "cuda"
    else:
        expected = "triton"
    assert backend.backend_for("auto", torch.device("cuda")) == expected
    assert backend.backend_for("auto", torch.device("cuda", 0)) == expected
    backend_for = backend.backend_for
    assert backend_for("torch", torch.device("cuda")) == "torch"
    assert backend_for("triton", torch.device("cpu")) == "triton"


@pytest.mark.parametrize("problem", [None, "no kernel image is available for execution on the device"])
def test_auto_prefers_the_extension_where_its_kernels_run_on_the_gpu(monkeypatch, problem):
    """auto on CUDA inputs: the extension's kernels (backend cuda) where kernel_image_problem
    finds none for that GPU, else Triton's; asked per GPU index, never for CPU inputs."""
    from bert_fast import backend
    from bert_fast.ops._triton import HAS_TRITON
    if not HAS_TRITON:
        pytest.skip("auto runs CUDA inputs on the torch backend without Triton")
    asked = []
    monkeypatch.setattr(extension, "kernel_image_problem", lambda index=None: asked.append(index) or problem)
    expected = "cuda" if problem is None else "triton"
    assert backend.backend_for("auto", torch.device("cuda", 1)) == expected
    assert backend.backend_for("auto", torch.device("cpu")) == "torch"
    assert asked == [1]
    monkeypatch.setattr(backend, "AUTO_USES_EXTENSION_ON_CUDA", False)
    assert backend.backend_for("auto", torch.device("cuda", 1)) == "triton" and asked == [1]


def test_auto_runs_triton_inside_our_graph_captures(monkeypatch):
    """Inside capturing_graph (our captures' warmup and record) auto runs CUDA inputs on
    triton even where it would pick the extension; explicit backends and CPU inputs keep theirs,
    and graph keys (graph_backend_for) name what the capture runs."""
    from bert_fast import backend
    from bert_fast.ops._triton import HAS_TRITON
    if not HAS_TRITON:
        pytest.skip("auto runs CUDA inputs on the torch backend without Triton")
    monkeypatch.setattr(extension, "kernel_image_problem", lambda index=None: None)
    gpu, cpu = torch.device("cuda", 0), torch.device("cpu")
    assert backend.backend_for("auto", gpu) == "cuda"
    with backend.capturing_graph():
        with backend.capturing_graph():         # nested: still inside until the outer one ends
            pass
        assert [backend.backend_for(b, gpu) for b in ("auto", "cuda", "torch")] == ["triton", "cuda", "torch"]
        assert backend.backend_for("auto", cpu) == "torch"
    assert backend.backend_for("auto", gpu) == "cuda"
    with pytest.raises(RuntimeError), backend.capturing_graph():
        raise RuntimeError("a failed capture")
    assert backend.backend_for("auto", gpu) == "cuda"
    assert [backend.graph_backend_for(b, gpu) for b in ("auto", "cuda", "triton")] == ["triton", "cuda", "triton"]
    assert backend.graph_backend_for("auto", cpu) == "torch"
    monkeypatch.setattr(backend, "AUTO_CAPTURES_TRITON", False)
    with backend.capturing_graph():
        assert backend.backend_for("auto", gpu) == "cuda"
    assert backend.graph_backend_for("auto", gpu) == "cuda"


def test_kernel_image_problem_says_why_the_extension_cannot_run_on_a_gpu():
    if not extension.load():
        assert "not built" in extension.kernel_image_problem(0)
    elif not extension.has_cuda_kernels():
        assert extension.kernel_image_problem(0) == "the extension was built without its CUDA ops"
    elif not torch.cuda.is_available():       # CUDA kernels built (a CUDA build of torch), no GPU
        assert extension.kernel_image_problem(0) == "no CUDA device 0 (0 visible)"
    else:
        assert extension.kernel_image_problem(0) is None, "the extension's kernels should run on this GPU"
        count = torch.cuda.device_count()
        assert torch.ops.bert_fast.ext_cuda_kernel_image_problem(count) == f"no CUDA device {count} ({count} visible)"


def test_kernel_image_problem_is_worked_out_once_per_gpu(monkeypatch):
    """auto asks on every layer of every forward: without an extension, the import must not be
    tried again each time; a loaded extension is asked again."""
    loads = []
    monkeypatch.setattr(extension, "_image_problems", {})
    monkeypatch.setattr(extension, "load", lambda: loads.append(1) or False)
    monkeypatch.setattr(extension, "load_error", lambda: "no bert_fast._C here")
    for _ in range(3):
        assert extension.kernel_image_problem(5) == "the extension is not built (no bert_fast._C here)"
    assert len(loads) == 1
    extension._image_problems.clear()           # what loading an extension does
    extension.kernel_image_problem(5)
    assert len(loads) == 2


def test_segment_ids_of_a_wider_dtype_are_checked_without_wrapping():
    """int32 tokens with an int64 segment id of 2**33: read in a common narrower dtype it would
    wrap to 0 and pass; it must be reported."""
    _, fast = encoder_pair(encoder_config(num_layers=1))
    tokens = torch.randint(0, 50, (2, 5), dtype=torch.int32)
    segments = torch.zeros(2, 5, dtype=torch.int64)
    segments[1, 3] = 2 ** 33
    with pytest.raises(ValueError, match="segment ids must be 0 or 1"):
        fast(tokens, segments, torch.tensor([5, 3]))


@pytest.mark.parametrize("tokens,segments,valid_lens", [
    (torch.tensor([[0, 49]]), torch.tensor([[0, 1]]), torch.tensor([1.5])),
    (torch.tensor([[0, 50]]), torch.tensor([[0, 1]]), None),
    (torch.tensor([[-1, 3]], dtype=torch.int32), torch.tensor([[0, 1]]), None),
    (torch.tensor([[0, 3]], dtype=torch.int32), torch.tensor([[0, 2 ** 33]]), None),
    (torch.tensor([[0, 3]]), torch.tensor([[-1, 0]]), torch.tensor([[1, 2]])),
    (torch.tensor([[0, 3]]), torch.tensor([[0, 0]]), torch.tensor([float("nan")])),
], ids=["valid", "token-high", "token-negative", "segment-wide", "segment-negative", "nan"])
def test_value_check_of_host_and_device_inputs_agree(tokens, segments, valid_lens):
    """The value check reads CPU inputs per tensor (no sync to save there) and CUDA inputs in one
    stacked read (one sync); the GPU's form runs on CUDA tensors where there is a GPU, else on CPU
    tensors standing for CUDA ones (kernels_on_cpu). Both accept and reject the same inputs with
    the same message."""
    from bert_fast.checks import _check_values

    def outcome(*inputs):
        try:
            _check_values(*inputs, 50)
        except ValueError as error:
            return str(error)
        return "accepted"

    on_host = outcome(tokens, segments, valid_lens)
    if torch.cuda.is_available():
        as_on_device = outcome(*(t if t is None else t.cuda() for t in (tokens, segments, valid_lens)))
    else:
        with interpreted_kernels():
            as_on_device = outcome(tokens, segments, valid_lens)
    assert on_host == as_on_device
    assert (on_host == "accepted") == (tokens.min() >= 0 and tokens.max() < 50 and segments.min() >= 0
                                       and segments.max() <= 1 and (valid_lens is None or not valid_lens.isnan().any()))
