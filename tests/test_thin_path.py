"""The eager path a GPU takes, run in Triton's interpreter on CPU tensors.

On a CPU the triton and cuda backends run their ops' CPU kernels; on a GPU the same eager path
calls the Triton launchers, directly or through the ops' autograd.Functions, with the
visible-key counts prepared once per forward. ``kernels_on_cpu()`` routes CPU tensors to the
launchers (interpreter only), so that path's plumbing is checked here against the reference,
forward and backward, before any GPU runs it.
"""

import contextlib
import importlib

import pytest
import torch

import bert_fast
from bert_fast import ops
from bert_fast.backend import available_backends
from bert_fast.ops._triton import kernels_on_cpu
from tests.helpers import (assert_close, compare_forward_backward, compare_under_autocast, encoder_config,
                           encoder_pair, needs_kernels, random_inputs)

pytestmark = [needs_kernels, pytest.mark.skipif(torch.cuda.is_available(),
                                                reason="on a GPU the GPU tests run this path for real")]

B, L = 2, 11          # L not a multiple of the interpreter's 16-wide tiles


@pytest.mark.parametrize("valid_lens", [None, torch.tensor([0.0, 6.5]), torch.tensor([[3] * L, list(range(L))])],
                         ids=["none", "1d", "2d"])
@pytest.mark.parametrize("backend", [b for b in available_backends() if b in ("triton", "cuda")])
def test_encoder_through_the_kernels_matches_the_reference(backend, valid_lens):
    ref, fast = encoder_pair(encoder_config(num_heads=2, head_dim=16, num_layers=2, ffn=48), backend=backend)
    ref.train(), fast.train()           # dropout 0: the training path, deterministic
    tokens, segments = random_inputs(B, L, 50)
    with kernels_on_cpu():
        key_mask = ops.prepare_key_mask(valid_lens, L, backend)
        assert valid_lens is None or key_mask.counts is not None, "the kernels read visible-key counts"
        compare_forward_backward(ref, fast, tokens, segments, valid_lens)
        ref.eval(), fast.eval()
        with torch.inference_mode():     # straight to the launchers, no Function
            assert_close(fast(tokens, segments, valid_lens), ref(tokens, segments, valid_lens), atol=1e-4)


@pytest.mark.parametrize("activation", ["relu", "gelu"])
@pytest.mark.parametrize("backend", [b for b in available_backends() if b in ("triton", "cuda")])
def test_autocast_training_through_the_kernels(backend, activation):
    """Mixed precision as people fine-tune (autocast, fp32 weights) on the GPU's path: the
    GEMMs in autocast's dtype with the bias cast along (as the reference's Linear under
    autocast), the add-norms in fp32; values and gradients within its error of the reference
    under the same autocast (tests/test_modules.py checks the CPU kernels in bf16). In fp16:
    Triton's interpreter mistreats bfloat16 in tl.dot, which the GPU runs right (its bf16 tests)."""
    cfg = encoder_config(num_heads=2, head_dim=16, num_layers=2, ffn=48)
    ref, fast = encoder_pair(cfg, backend=backend, activation=activation)
    if activation == "gelu":        # the reference's FFN is ReLU: give it the same GELU
        for blk in ref.blks:
            blk.ffn.relu = torch.nn.GELU()
    ref.train(), fast.train()
    tokens, segments = random_inputs(B, L, 50)
    with kernels_on_cpu():
        compare_under_autocast(ref, fast, tokens, segments, torch.tensor([4, 11]), torch.float16, 1e-2)


@pytest.mark.parametrize("activation, gemm_epilogue", [("relu", True), ("relu", False), ("gelu", None)])
def test_ffn_paths_through_the_kernels(activation, gemm_epilogue):
    """ReLU in the GEMM epilogue (_LinearReLU) and GEMM + the bias_act kernel (_BiasAct)."""
    x = torch.randn(2, 5, 16, requires_grad=True)
    weight = torch.randn(24, 16, requires_grad=True)
    bias = torch.randn(24, requires_grad=True)
    expected = ops.linear_act(x, weight, bias, activation)         # torch backend
    grads = torch.autograd.grad(expected.sum(), (x, weight, bias))
    with kernels_on_cpu():
        out = ops.linear_act(x, weight, bias, activation, backend="triton", gemm_epilogue=gemm_epilogue)
        assert_close(out, expected, atol=1e-5)
        for got, want, name in zip(torch.autograd.grad(out.sum(), (x, weight, bias)), grads, ("x", "weight", "bias")):
            assert_close(got, want, atol=1e-4, what=f"d{name}")


def test_skip_padding_through_the_varlen_kernel():
    cfg = encoder_config(num_heads=2, head_dim=16, num_layers=1, ffn=48)
    ref, fast = encoder_pair(cfg, backend="triton", skip_padding=True)
    ref.train(), fast.train()
    tokens, segments = random_inputs(B, L, 50)
    with kernels_on_cpu():
        compare_forward_backward(ref, fast, tokens, segments, torch.tensor([4.0, 11.0]), valid_only=True)


def test_kernels_on_cpu_is_for_the_interpreter_only(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        with kernels_on_cpu():
            pass


def test_functions_take_the_full_apply_inside_functorch_transforms():
    # thin_apply skips Function.apply's Python preamble only outside transforms; inside one the
    # full apply runs, and these Functions (no setup_context) get functorch's own error.
    x = torch.randn(2, 8, requires_grad=True)
    out = ops.add_layernorm(x, x, None, None, backend="triton")
    assert type(out.grad_fn).__name__ == "_AddLayerNormBackward"
    with pytest.raises(RuntimeError, match="setup_context"):
        torch.func.grad(lambda t: ops.add_layernorm(t, t, None, None, backend="triton").sum())(x.detach())


class _HostReads(torch.utils._python_dispatch.TorchDispatchMode):
    """Records what reads a tensor's values on the host: on a GPU each read waits for the device
    (a sync), and inside a CUDA graph capture it is an error. The ATen calls are seen by the
    mode; .tolist(), .numpy() and .cpu() of a CPU tensor reach no ATen call, so the test
    wraps them (monkeypatch)."""
    # _local_scalar_dense: .item(), bool(t), int(t); the rest size their output by the data.
    READS = ("aten._local_scalar_dense", "aten.nonzero", "aten.masked_select", "aten.unique",
             "aten._unique", "aten.repeat_interleave.Tensor", "aten.equal", "aten.is_nonzero")
    METHODS = ("tolist", "numpy", "cpu")

    def __init__(self, monkeypatch):
        super().__init__()
        self.seen = []
        for name in self.METHODS:
            monkeypatch.setattr(torch.Tensor, name, self._recording(name, getattr(torch.Tensor, name)))

    def _recording(self, name, method):
        def recorded(tensor, *args, **kwargs):
            self.seen.append(f"Tensor.{name}")
            return method(tensor, *args, **kwargs)
        return recorded

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if str(func).startswith(self.READS):
            self.seen.append(str(func))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("dropout", [0.0, 0.2])
@pytest.mark.parametrize("valid_lens", [None, torch.tensor([0, 6]), torch.tensor([0.0, 6.5]),
                                        torch.tensor([[3] * L, list(range(L))])], ids=["none", "1d", "1d-float", "2d"])
def test_gpu_path_reads_no_values_on_the_host(valid_lens, dropout, monkeypatch):
    """Without the input check (check_inputs=False) and skip_padding, the forward, in training
    and inference, and the backward make no host read: the GPU never waits for the host's next
    launch on a value, and the training step can be captured in a CUDA graph
    (torch.cuda.make_graphed_callables). The value check (check_inputs=True) reads by design,
    once: the test sees it. (The CPU kernels read ids on purpose, to report a bad one: they
    are on the host already. Not this path.)"""
    cfg = dict(encoder_config(num_heads=2, head_dim=16, num_layers=2, ffn=48), dropout=dropout)
    _, fast = encoder_pair(cfg, backend="triton", check_inputs=False)
    tokens, segments = random_inputs(B, L, 50)
    with kernels_on_cpu():
        for training in (True, False):
            fast.train(training)
            reads = _HostReads(monkeypatch)
            with reads, torch.inference_mode(not training):
                out = fast(tokens, segments, valid_lens)
                if training:
                    out.square().mean().backward()
            assert reads.seen == [], f"training={training}: {reads.seen}"
            assert out.isfinite().all() and (not training or fast.blks[0].ffn.dense1.weight.grad is not None)
        fast.check_inputs = True
        reads = _HostReads(monkeypatch)
        with reads:
            fast(tokens, segments, valid_lens)
        assert reads.seen == ["Tensor.tolist"], reads.seen


@pytest.mark.parametrize("per_op", [False, True], ids=["fused-layer", "per-op"])
def test_backward_checks_nothing_its_forward_checked(per_op, monkeypatch):
    """The backward launchers of our own Functions (the fused layer's, and the per-op path's
    add_layernorm, bias_act/linear+ReLU and attention) take the forward's saved tensors and an
    output gradient autograd shaped: their input checks ran with the forward (~13 us a call on
    the host, a quarter of add_layernorm's backward launcher). Direct calls still check."""
    from importlib import import_module
    modules = [import_module(f"bert_fast.ops.{name}") for name in ("add_layernorm", "bias_act", "attention")]
    calls = []
    for module, name in [(modules[0], "_check_bwd_inputs"), (modules[1], "_check_inputs"),
                         (modules[2], "_check_bwd_inputs"), (modules[2], "_check_attention_inputs")]:
        original = getattr(module, name)
        monkeypatch.setattr(module, name, lambda *args, _f=original, _n=name, **kwargs: (calls.append(_n),
                                                                                         _f(*args, **kwargs))[1])
    cfg = dict(encoder_config(num_heads=2, head_dim=16, num_layers=2, ffn=48), dropout=0.2)
    _, fast = encoder_pair(cfg, backend="triton")
    fast.train()
    if per_op:        # a hook on a sublayer makes the block take the per-op path (modules.fused_layer)
        for block in fast.blks:
            block.attention.register_forward_hook(lambda *args: None)
    tokens, segments = random_inputs(B, L, 50)
    with kernels_on_cpu():
        out = fast(tokens, segments, torch.tensor([4, 11]))
        assert calls, "the forward checks its inputs"
        calls.clear()
        out.square().mean().backward()
        assert calls == [] and fast.blks[0].attention.W_q.weight.grad is not None, calls
        grad = torch.ones(3, 8)
        with pytest.raises(ValueError, match="mean must be"):
            modules[0]._add_layernorm_bwd(grad, grad, grad, None, torch.zeros(2), torch.ones(3), None, 0.0, False)
        assert calls == ["_check_bwd_inputs"]


@pytest.mark.parametrize("model", ["book", "hf"])
def test_deterministic_algorithms_make_the_embedding_backward_deterministic(model, monkeypatch):
    """torch.use_deterministic_algorithms(True): the token table's gradient by the sort-based
    kernels, not atomics (PyTorch's own embedding backward follows the setting; the modules
    ignored it, found by review)."""
    embedding = importlib.import_module("bert_fast.ops.embedding")
    launched = []
    real = embedding.launch
    monkeypatch.setattr(embedding, "launch", lambda kernel, like: launched.append(kernel.__name__) or real(kernel, like))
    tokens, segments = random_inputs(B, L, 50)
    if model == "book":
        _, fast = encoder_pair(encoder_config(num_heads=2, head_dim=16, num_layers=1, ffn=48), backend="triton")
        run = lambda: fast(tokens, segments, torch.tensor([3, 11]))        # noqa: E731
    else:
        transformers = pytest.importorskip("transformers")
        config = transformers.BertConfig(vocab_size=50, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                         intermediate_size=48, max_position_embeddings=16)
        fast = bert_fast.optimize(transformers.BertModel(config), backend="triton")
        run = lambda: fast(tokens, attention_mask=torch.ones_like(tokens)).last_hidden_state    # noqa: E731
    fast.train()
    for deterministic in (False, True):
        launched.clear()
        with kernels_on_cpu(), _deterministic_algorithms(deterministic):
            run().sum().backward()
        assert ("_embedding_sum_bwd_chunk_kernel" in launched) == deterministic, (deterministic, launched)


@contextlib.contextmanager
def _deterministic_algorithms(mode):
    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(mode)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(before)
