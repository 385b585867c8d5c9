"""ops.encoder_layer: a layer in one call (eager, triton and cuda backends): one autograd node
in training, the launchers alone in inference.

It must give what the per-op path gives (same launchers, same dropout draws) for values and
every gradient, so each test runs one block both ways: the fused layer, and the per-op path
forced by a no-op forward hook on the attention submodule (a hook is one of the things the
fused path refuses to bypass). CPU: the CPU kernels; with ``interpreted_kernels()`` the Triton
launchers in the interpreter (the GPU's path); on a GPU the same comparison in fp32 and bf16.
"""

import contextlib
import importlib

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from bert_fast import ops
from bert_fast import reference as R
from bert_fast.backend import available_backends
from bert_fast.modules import FastEncoderBlock
from bert_fast.ops._triton import interpreting
from tests.helpers import (BF16_OK, assert_close, held_by_the_graph, interpreted_kernels, needs_cuda, needs_kernels,
                           peak_bytes)

BACKENDS = [b for b in available_backends() if b in ("triton", "cuda")]
B, L, HEADS, HEAD_DIM, FFN = 2, 11, 2, 16, 48        # L not a multiple of the kernels' tiles
H = HEADS * HEAD_DIM
VALID_LENS = {"none": None, "1d": torch.tensor([0.0, 6.5]), "2d": torch.tensor([[3] * L, list(range(L))])}


def make_block(backend, dropout=0.0, use_bias=False, activation="relu", device="cpu", dtype=torch.float32):
    torch.manual_seed(0)
    block = FastEncoderBlock(H, H, H, H, [H], H, FFN, HEADS, dropout, use_bias, activation=activation,
                             backend=backend).to(device, dtype).train()
    with torch.no_grad():          # LayerNorm's affine parameters away from their 1 / 0 init
        for ln in (block.addnorm1.ln, block.addnorm2.ln):
            ln.weight.uniform_(0.5, 1.5), ln.bias.uniform_(-0.5, 0.5)
    return block


def run(block, x, valid_lens, grad_out, seed=0, unpadding=None):
    """(output, {name: grad} of x and every Parameter) of one forward+backward."""
    block.zero_grad(set_to_none=True)
    x = x.detach().requires_grad_()
    torch.manual_seed(seed)
    out = block(x, valid_lens, unpadding=unpadding)
    out.backward(grad_out)
    grads = {name: p.grad for name, p in block.named_parameters()}
    grads["x"] = x.grad
    return out.detach(), out.grad_fn, grads


def fused_and_per_op(block, x, valid_lens, grad_out, unpadding=None):
    fused = run(block, x, valid_lens, grad_out, unpadding=unpadding)
    handle = block.attention.register_forward_hook(lambda *args: None)
    try:
        per_op = run(block, x, valid_lens, grad_out, unpadding=unpadding)
    finally:
        handle.remove()
    assert type(fused[1]).__name__ == "_EncoderLayerBackward", "the fused node was not used"
    assert type(per_op[1]).__name__ != "_EncoderLayerBackward", "the hook did not force the per-op path"
    return fused, per_op


@contextlib.contextmanager
def counting_fused_calls(monkeypatch):
    """Within: the calls of ops.encoder_layer (what the block calls for a fused layer) counted."""
    calls = []
    fused = ops.encoder_layer

    def spy(*args, **kwargs):
        calls.append(1)
        return fused(*args, **kwargs)
    with monkeypatch.context() as patch:
        patch.setattr(ops, "encoder_layer", spy)
        yield calls


def infer_fused_and_per_op(block, x, valid_lens, monkeypatch, grad_mode=torch.inference_mode, seed=0,
                           unpadding=None):
    """The block's output without autograd, through the fused layer and through the per-op path."""
    outputs = []
    for hooked in (False, True):
        handle = block.attention.register_forward_hook(lambda *args: None) if hooked else None
        torch.manual_seed(seed)
        with counting_fused_calls(monkeypatch) as calls, grad_mode():
            outputs.append(block(x, valid_lens, unpadding=unpadding))
        if handle is not None:
            handle.remove()
        assert len(calls) == (0 if hooked else 1), f"hooked={hooked}: {len(calls)} fused calls"
        assert outputs[-1].grad_fn is None
    return outputs


def assert_same(fused, per_op, atol, rtol=0.0):
    assert_close(fused[0], per_op[0], atol=atol, rtol=rtol, what="output")
    assert fused[2].keys() == per_op[2].keys()
    for name, want in per_op[2].items():
        got = fused[2][name]
        assert (got is None) == (want is None), f"grad {name}: {got is None=} {want is None=}"
        if want is not None:
            assert got.shape == want.shape, name
            assert_close(got, want, atol=atol, rtol=rtol, what=f"grad {name}")


def inputs(device="cpu", dtype=torch.float32):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(B, L, H, generator=g).to(device, dtype)
    grad_out = torch.randn(B, L, H, generator=g).to(device, dtype)
    return x, grad_out


# skip_padding: the block on packed valid tokens (N, H) and their ops.Unpadding. "static": a
# CUDA graph's form, num_tokens past the valid count (filler rows that belong to no sequence).
PACKINGS = {"counted": None, "static": B * L}
PACKED_VALID_LENS = {"empty-seq": torch.tensor([0.0, 6.5]), "full-seq": torch.tensor([4, L])}


def packed_inputs(valid_lens, num_tokens, device="cpu", dtype=torch.float32):
    x, grad_out = inputs(device, dtype)
    unpadding = ops.unpadding_for(valid_lens.to(device), L, num_tokens)
    return ops.unpad(x, unpadding), ops.unpad(grad_out, unpadding), unpadding


@pytest.mark.parametrize("activation, use_bias", [("relu", False), ("relu", True), ("gelu", True),
                                                  ("gelu_tanh", False)])
@pytest.mark.parametrize("valid_lens", list(VALID_LENS.values()), ids=list(VALID_LENS))
@pytest.mark.parametrize("backend", BACKENDS)
def test_fused_layer_matches_the_per_op_path(backend, valid_lens, activation, use_bias):
    block = make_block(backend, use_bias=use_bias, activation=activation)
    x, grad_out = inputs()
    assert_same(*fused_and_per_op(block, x, valid_lens, grad_out), atol=1e-5)


@pytest.mark.parametrize("activation, use_bias", [("relu", False), ("gelu", True), ("gelu_tanh", True)])
@pytest.mark.parametrize("valid_lens", list(VALID_LENS.values()), ids=list(VALID_LENS))
@pytest.mark.parametrize("backend", BACKENDS)
def test_fused_inference_matches_the_per_op_path(backend, valid_lens, activation, use_bias, monkeypatch):
    block = make_block(backend, use_bias=use_bias, activation=activation).eval()
    x, _ = inputs()
    fused, per_op = infer_fused_and_per_op(block, x, valid_lens, monkeypatch)
    assert_close(fused, per_op, atol=1e-5, rtol=0, what="output")
    # The packed QKV weight read in place, or concatenated: the same output.
    for linear in (block.attention.W_q, block.attention.W_k, block.attention.W_v):
        linear.weight = torch.nn.Parameter(linear.weight.detach().clone())
    separate, _ = infer_fused_and_per_op(block, x, valid_lens, monkeypatch, grad_mode=torch.no_grad)
    assert_close(separate, per_op, atol=1e-5, rtol=0, what="output, QKV not packed")


@pytest.mark.parametrize("backend", BACKENDS)
def test_fused_inference_in_train_mode_draws_the_per_op_masks(backend, monkeypatch):
    """Dropout without autograd (train mode under no_grad): the per-op path's seeds and masks."""
    block = make_block(backend, dropout=0.3, use_bias=True)
    x, _ = inputs()
    fused, per_op = infer_fused_and_per_op(block, x, VALID_LENS["1d"], monkeypatch, grad_mode=torch.no_grad)
    assert_close(fused, per_op, atol=1e-5, rtol=0, what="output")
    assert (fused - block.eval()(x, VALID_LENS["1d"]).detach()).abs().max() > 0.1, "dropout changed nothing"


@pytest.mark.parametrize("backend", BACKENDS)
def test_fused_layer_with_dropout_draws_the_per_op_masks(backend):
    """The same seeds in the same order: with dropout the two paths give the same result."""
    block = make_block(backend, dropout=0.3, use_bias=True)
    x, grad_out = inputs()
    fused, per_op = fused_and_per_op(block, x, VALID_LENS["1d"], grad_out)
    assert_same(fused, per_op, atol=1e-5)
    without = run(make_block(backend, use_bias=True), x, VALID_LENS["1d"], grad_out)
    assert (fused[0] - without[0]).abs().max() > 0.1, "dropout changed nothing"


@pytest.mark.parametrize("backend", BACKENDS)
def test_frozen_parameters_get_no_gradient(backend):
    block = make_block(backend, use_bias=True)
    for module in (block.attention.W_k, block.ffn.dense2, block.addnorm1.ln):
        for p in module.parameters():
            p.requires_grad_(False)
    x, grad_out = inputs()
    fused, per_op = fused_and_per_op(block, x, VALID_LENS["2d"], grad_out)
    assert_same(fused, per_op, atol=1e-5)
    assert fused[2]["attention.W_k.weight"] is None and fused[2]["ffn.dense2.bias"] is None


@pytest.mark.parametrize("backend", BACKENDS)
def test_qkv_gradients_whether_packed_or_not(backend):
    """W_q, W_k, W_v read in place (packed by pack_qkv_) or concatenated (Parameters replaced
    by separate tensors): the same gradients."""
    block = make_block(backend, use_bias=True)
    x, grad_out = inputs()
    packed = run(block, x, VALID_LENS["1d"], grad_out)
    for linear in (block.attention.W_q, block.attention.W_k, block.attention.W_v):
        linear.weight = torch.nn.Parameter(linear.weight.detach().clone())
    assert block.attention._qkv_packing is None or not block.attention._qkv_packing.holds(
        block.attention._qkv_params())
    separate = run(block, x, VALID_LENS["1d"], grad_out)
    assert type(separate[1]).__name__ == "_EncoderLayerBackward"
    assert_same(packed, separate, atol=1e-6)


@pytest.mark.parametrize("backend", BACKENDS)
def test_where_the_fused_layer_does_not_apply(backend):
    """A hooked submodule takes the per-op path, and the hook runs."""
    block = make_block(backend)
    x, _ = inputs()
    x.requires_grad_()
    plain = block(x, None)
    handle = block.ffn.dense2.register_forward_hook(lambda module, args, output: output * 2.0)
    hooked = block(x, None)
    handle.remove()
    assert type(hooked.grad_fn).__name__ != "_EncoderLayerBackward"
    assert (hooked - plain).abs().max() > 1e-3, "the hook's change did not reach the output"


@needs_kernels
@pytest.mark.parametrize("backend", BACKENDS)
def test_a_norm_the_add_norm_kernel_cannot_take_runs_the_per_op_path(backend, monkeypatch):
    """The fused layer's Triton add-norms skip their input checks: a LayerNorm over other than
    the hidden features (here swapped in after construction, as optimize() or an HF layer can
    hand one over) must take the per-op path, whose add-norm says what is wrong, never reach
    a kernel that would read its (L, H) weight as an (H,) one."""
    block = make_block(backend).eval()
    block.addnorm2.ln = torch.nn.LayerNorm((L, H))
    x, _ = inputs()
    with interpreted_kernels(), counting_fused_calls(monkeypatch) as calls, torch.inference_mode():
        with pytest.raises(ValueError, match=r"weight must have shape \(32,\)"):
            block(x, None)
    assert not calls, "the fused layer ran"


# Under autocast the fused layer makes autocast's casts itself: the GEMMs, attention and
# activation in autocast's dtype, the add-norms in fp32. Against the per-op path under the same
# autocast it differs by rounding only: ReLU's bias is added in the GEMM's fp32 accumulator (the
# per-op path adds the rounded bias after rounding the GEMM), and b_o's and b_2's gradients are
# summed in fp32 before they are rounded. Tolerances: a few units of bf16's (fp16's) last place
# on values of order 1-10.
AMP_TOLERANCE = {torch.bfloat16: 6e-2, torch.float16: 1e-2}


@pytest.mark.parametrize("amp", [None, torch.bfloat16, pytest.param("kernels", marks=needs_kernels)],
                         ids=["fp32", "autocast", "autocast-kernels"])
@pytest.mark.parametrize("dropout", [0.0, 0.3])
@pytest.mark.parametrize("backend", BACKENDS)
def test_a_recomputing_layer_keeps_its_input_and_gives_the_same_gradients(backend, dropout, amp, monkeypatch):
    """ops.encoder_layer(recompute=True), what bert_fast.hf's gradient checkpointing runs: its
    node keeps x and the Parameters only, and its backward runs the forward again with the
    forward's dropout seeds (whatever the generator did since) under the forward's autocast:
    the plain node's output and gradients, bit for bit. "autocast-kernels": through the Triton
    kernels (interpreter; fp16, see below), whose add-norms take the branch in autocast's dtype."""
    if amp != "kernels":
        check_recompute(backend, dropout, amp, monkeypatch)
        return
    if torch.cuda.is_available():
        pytest.skip("interpreter only (the GPU's autocast tests run the kernels on CUDA)")
    with interpreted_kernels():
        check_recompute(backend, dropout, torch.float16, monkeypatch)


def check_recompute(backend, dropout, amp, monkeypatch):
    block = make_block(backend, dropout=dropout, use_bias=True, activation="gelu")
    x, grad_out = inputs()
    params = {id(p) for p in block.parameters()}
    kept = []

    def pack(t):
        kept.append(t)
        return t

    fused = ops.encoder_layer
    with torch.autocast("cpu", amp) if amp else contextlib.nullcontext():
        plain = run(block, x, VALID_LENS["1d"], grad_out)
        block.zero_grad(set_to_none=True)
        x = x.detach().requires_grad_()
        torch.manual_seed(0)
        with monkeypatch.context() as patch, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            patch.setattr(ops, "encoder_layer", lambda *args: fused(*args[:5], recompute=True))
            out = block(x, VALID_LENS["1d"])
        torch.rand(3)           # the generator moves on before the backward
        assert type(out.grad_fn).__name__ == "_RecomputedEncoderLayerBackward"
        activations = [t for t in kept if id(t) not in params]
        assert len(kept) == 1 + len(params) and [t.shape for t in activations] == [x.shape], [t.shape for t in kept]
        out.backward(grad_out)          # (as run()'s, under the autocast)
    grads = {name: p.grad for name, p in block.named_parameters()}
    grads["x"] = x.grad
    assert torch.equal(out, plain[0])
    for name, want in plain[2].items():
        assert (grads[name] is None) == (want is None), name
        assert want is None or torch.equal(grads[name], want), name


def check_autocast(block, valid_lens, amp_dtype, monkeypatch):
    x, grad_out = inputs()
    with torch.autocast("cpu", amp_dtype):
        fused, per_op = fused_and_per_op(block, x, valid_lens, grad_out)
    assert fused[0].dtype == per_op[0].dtype == torch.float32, "LayerNorm's output under autocast is fp32"
    for name, grad in fused[2].items():
        assert grad is None or grad.dtype == torch.float32, f"grad {name}: {grad.dtype}, its Parameter's is fp32"
    assert_same(fused, per_op, atol=AMP_TOLERANCE[amp_dtype], rtol=AMP_TOLERANCE[amp_dtype])
    with torch.autocast("cpu", amp_dtype):
        inferred = infer_fused_and_per_op(block.eval(), x, valid_lens, monkeypatch)
    assert_close(inferred[0], inferred[1], atol=AMP_TOLERANCE[amp_dtype], rtol=AMP_TOLERANCE[amp_dtype],
                 what="inference output")


@pytest.mark.parametrize("activation", ["relu", "gelu"])
@pytest.mark.parametrize("valid_lens", list(VALID_LENS.values()), ids=list(VALID_LENS))
@pytest.mark.parametrize("backend", BACKENDS)
def test_fused_layer_under_autocast_matches_the_per_op_path(backend, valid_lens, activation, monkeypatch):
    check_autocast(make_block(backend, use_bias=True, activation=activation), valid_lens, torch.bfloat16,
                   monkeypatch)


@pytest.mark.parametrize("valid_lens", list(VALID_LENS.values()), ids=list(VALID_LENS))
@pytest.mark.parametrize("backend", BACKENDS)
def test_fused_layer_fed_bf16_under_cpu_autocast_returns_what_the_reference_does(backend, valid_lens):
    """CPU autocast leaves LayerNorm alone: a block fed bf16 activations (a block on its own;
    the encoder's embedding gives fp32) returns bf16, as the reference's and the per-op path's
    add-norms do (the fused layer gave fp32)."""
    block = make_block(backend, use_bias=True)
    reference = R.EncoderBlock(H, H, H, H, [H], H, FFN, HEADS, 0.0, True)
    reference.load_state_dict(block.state_dict())
    x, grad_out = (t.bfloat16() for t in inputs())
    with torch.autocast("cpu", torch.bfloat16):
        fused, per_op = fused_and_per_op(block, x, valid_lens, grad_out)
        want = reference(x, valid_lens)
    assert fused[0].dtype == per_op[0].dtype == want.dtype == torch.bfloat16
    assert_close(fused[0], want, atol=AMP_TOLERANCE[torch.bfloat16], rtol=AMP_TOLERANCE[torch.bfloat16],
                 what="output against the reference")
    assert fused[2]["x"].dtype == torch.bfloat16
    assert_same(fused, per_op, atol=AMP_TOLERANCE[torch.bfloat16], rtol=AMP_TOLERANCE[torch.bfloat16])


@pytest.mark.parametrize("backend", BACKENDS)
def test_fused_layer_under_autocast_with_dropout_draws_the_per_op_masks(backend):
    block = make_block(backend, dropout=0.3, use_bias=True)
    x, grad_out = inputs()
    with torch.autocast("cpu", torch.bfloat16):
        fused, per_op = fused_and_per_op(block, x, VALID_LENS["1d"], grad_out)
        without = run(make_block(backend, use_bias=True), x, VALID_LENS["1d"], grad_out)
    assert (fused[0] - without[0]).abs().max() > 0.1, "dropout changed nothing"
    assert_same(fused, per_op, atol=AMP_TOLERANCE[torch.bfloat16], rtol=AMP_TOLERANCE[torch.bfloat16])


@pytest.mark.parametrize("dropout", [0.0, 0.3])
@pytest.mark.parametrize("packing", list(PACKINGS))
@pytest.mark.parametrize("valid_lens", list(PACKED_VALID_LENS.values()), ids=list(PACKED_VALID_LENS))
@pytest.mark.parametrize("backend", BACKENDS)
def test_fused_layer_on_packed_tokens(backend, valid_lens, packing, dropout, monkeypatch):
    """skip_padding on the CPU, in one node, against the per-op path: without dropout PyTorch's
    fused CPU attention once per sequence (the varlen kernels' CPU twin for a static unpadding,
    which has no host counts), with dropout the twin, drawing the per-op path's masks; and the
    same without autograd (eval; train mode under no_grad with dropout)."""
    block = make_block(backend, dropout=dropout, use_bias=True, activation="gelu" if dropout else "relu")
    x, grad_out, unpadding = packed_inputs(valid_lens, PACKINGS[packing])
    fused, per_op = fused_and_per_op(block, x, valid_lens, grad_out, unpadding)
    assert fused[0].shape == x.shape
    assert_same(fused, per_op, atol=1e-5)
    fused, per_op = infer_fused_and_per_op(block if dropout else block.eval(), x, valid_lens, monkeypatch,
                                           grad_mode=torch.no_grad, unpadding=unpadding)
    assert_close(fused, per_op, atol=1e-5, rtol=0, what="output")


@pytest.mark.parametrize("backend", BACKENDS)
def test_packed_tokens_on_the_cpu_attend_per_sequence(backend, monkeypatch):
    """Without dropout, with host counts: one fused CPU attention call per non-empty sequence,
    forward and backward (not the varlen kernels' twin, whose explicit math is slower)."""
    layer_module = importlib.import_module("bert_fast.ops.encoder_layer")   # ops.encoder_layer: the function
    calls = []
    for name in ("_flash_cpu", "_flash_cpu_backward"):
        op = getattr(layer_module, name)
        monkeypatch.setattr(layer_module, name, lambda *args, op=op, name=name, **kwargs: calls.append(name)
                            or op(*args, **kwargs))
    block = make_block(backend, use_bias=True)
    valid_lens = PACKED_VALID_LENS["empty-seq"]            # one empty sequence, one of 7 tokens
    x, grad_out, unpadding = packed_inputs(valid_lens, None)
    fused = run(block, x, valid_lens, grad_out, unpadding=unpadding)
    assert type(fused[1]).__name__ == "_EncoderLayerBackward"
    assert calls == ["_flash_cpu", "_flash_cpu_backward"], calls


@pytest.mark.parametrize("kernels", [False, pytest.param(True, marks=[needs_kernels, pytest.mark.skipif(
    torch.cuda.is_available() or not interpreting(), reason="the launchers on CPU tensors: interpreter only")])],
    ids=["cpu-kernels", "through-the-kernels"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_fused_layer_on_packed_tokens_of_empty_sequences_only(backend, kernels):
    """Every valid_len 0: no token at all (N = 0), the output empty and the gradients zero (the
    per-op path's attention returns a fresh empty tensor there, so W_q, W_k, W_v get None).
    Through the kernels no backward kernel runs, and the column sums come from zeroed partial
    rows (_DeferredSums)."""
    block = make_block(backend, use_bias=True, activation="gelu" if kernels else "relu")
    valid_lens = torch.zeros(B)
    x, grad_out, unpadding = packed_inputs(valid_lens, None)
    assert x.shape == (0, H)
    with interpreted_kernels() if kernels else contextlib.nullcontext():
        fused, per_op = fused_and_per_op(block, x, valid_lens, grad_out, unpadding)
    assert fused[0].shape == per_op[0].shape == (0, H)
    for name, grad in fused[2].items():
        assert grad is not None and torch.count_nonzero(grad) == 0, name


@pytest.mark.parametrize("kernels", [False, pytest.param(True, marks=needs_kernels)], ids=["cpu", "kernels"])
@pytest.mark.parametrize("packing", [None, "counted", "static"])
@pytest.mark.parametrize("dropout", [0.0, 0.3])
@pytest.mark.parametrize("per_op", [False, True], ids=["fused", "per-op"])
@pytest.mark.parametrize("backend", ["torch", *BACKENDS])
def test_the_graph_holds_nothing_after_the_backward(backend, per_op, dropout, packing, kernels):
    """A training loop's ``loss`` is referenced through the next step's forward: what its graph
    holds after the backward is memory the next forward runs without. Only the dropout seeds
    (one element each) may stay; the key mask (made once for all layers) is made outside."""
    if packing == "static" and not kernels:
        pytest.skip("the static packing runs the kernels (or their CPU twin with dropout)")
    block = make_block(backend, dropout)
    if per_op:
        block.attention.register_forward_hook(lambda *args: None)
    x, _ = inputs()
    valid_lens = PACKED_VALID_LENS["empty-seq"]
    if packing is None:
        key_mask, unpadding = ops.prepare_key_mask(valid_lens, L, backend), None
    else:
        x, _, unpadding = packed_inputs(valid_lens, PACKINGS[packing])
        key_mask = None
    x.requires_grad_()
    with interpreted_kernels() if kernels else contextlib.nullcontext():
        held = held_by_the_graph(lambda: block(x, key_mask, unpadding=unpadding))
    assert all(shape == (1,) and dtype == torch.int64 for shape, dtype in held), held
    assert len(held) <= (3 if dropout else 0), held


@pytest.mark.parametrize("kernels", [False, pytest.param(True, marks=needs_kernels)], ids=["cpu", "kernels"])
@pytest.mark.parametrize("activation", ["relu", "gelu"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_fused_inference_peak_is_the_per_op_paths(backend, activation, kernels):
    """Inference frees each intermediate once read (the function's locals held them to its end:
    twice the per-op path's peak)."""
    block = make_block(backend, activation=activation).eval()
    x, _ = inputs()
    key_mask = ops.prepare_key_mask(VALID_LENS["1d"], L, backend, x.dtype)       # as the encoder makes it
    peaks = []
    with torch.no_grad(), interpreted_kernels() if kernels else contextlib.nullcontext():
        for hooked in (False, True):
            handle = block.attention.register_forward_hook(lambda *args: None) if hooked else None
            peaks.append(peak_bytes(lambda: block(x, key_mask)))
            if handle is not None:
                handle.remove()
    fused, per_op = peaks
    assert 0 < fused <= per_op, f"peak of the fused layer {fused} B, of the per-op path {per_op} B"


@pytest.mark.parametrize("dropout", [0.0, 0.3])
@pytest.mark.parametrize("backend", BACKENDS)
def test_a_retained_graph_runs_its_backward_twice(backend, dropout):
    """retain_graph=True: the second backward reads the same saved tensors (and dropout masks)."""
    block = make_block(backend, dropout)
    x, grad_out = inputs()
    x.requires_grad_()
    out = block(x, VALID_LENS["2d"])
    assert type(out.grad_fn).__name__ == "_EncoderLayerBackward"
    out.backward(grad_out, retain_graph=True)
    first = [t.grad.clone() for t in (x, *block.parameters())]
    out.backward(grad_out)
    for once, twice in zip(first, (x.grad, *(p.grad for p in block.parameters()))):
        assert_close(twice, 2 * once, atol=1e-5, rtol=1e-5, what="gradient after two backwards")


def test_output_is_not_a_view_and_can_be_edited_in_place():
    block = make_block("triton")
    x, _ = inputs()
    out = block(x.requires_grad_(), None)
    assert out._base is None
    out.mul_(2.0).sum().backward()
    assert block.ffn.dense1.weight.grad is not None


# ---------------------------------------------------------------------------------------------
# The Triton launchers (interpreter on CPU tensors): the path a GPU takes.

@needs_kernels
@pytest.mark.skipif(torch.cuda.is_available() or not interpreting(), reason="interpreter only; GPU test below")
@pytest.mark.parametrize("dropout", [0.0, 0.2])
@pytest.mark.parametrize("valid_lens", list(VALID_LENS.values()), ids=list(VALID_LENS))
@pytest.mark.parametrize("backend", BACKENDS)
def test_fused_layer_through_the_kernels(backend, valid_lens, dropout):
    block = make_block(backend, dropout=dropout, use_bias=True, activation="gelu" if dropout else "relu")
    x, grad_out = inputs()
    with interpreted_kernels():
        key_mask = ops.prepare_key_mask(valid_lens, L, backend)
        fused, per_op = fused_and_per_op(block, x, key_mask, grad_out)
    assert_same(fused, per_op, atol=1e-5)


@needs_kernels
@pytest.mark.skipif("cuda" not in BACKENDS, reason="needs the compiled extension")
@pytest.mark.parametrize("activation", ["relu", "gelu"])
@pytest.mark.parametrize("dropout", [0.0, 0.2])
@pytest.mark.parametrize("extension_backward", [False, True], ids=["triton-bwd", "extension-bwd"])
def test_cuda_backend_add_norm_backwards(extension_backward, dropout, activation, monkeypatch):
    """The extension's add-norm forward with either backward (EXTENSION_ADDNORM_BACKWARD):
    Triton's (the default) or the extension's: the same values and gradients as the per-op path.
    Both draw _philox.py's mask, and Triton's backward reads the extension forward's statistics.
    On a GPU, or in the interpreter."""
    layer = importlib.import_module("bert_fast.ops.encoder_layer")
    monkeypatch.setattr(layer, "EXTENSION_ADDNORM_BACKWARD", extension_backward)
    calls, triton_bwd = [], layer._add_layernorm_bwd_triton
    monkeypatch.setattr(layer, "_add_layernorm_bwd_triton", lambda *a, **k: (calls.append(1), triton_bwd(*a, **k))[1])
    device = "cuda" if torch.cuda.is_available() else "cpu"
    block = make_block("cuda", dropout=dropout, use_bias=True, activation=activation, device=device)
    x, grad_out = inputs(device)
    with contextlib.nullcontext() if device == "cuda" else interpreted_kernels():
        fused, per_op = fused_and_per_op(block, x, ops.prepare_key_mask(VALID_LENS["1d"].to(device), L, "cuda"),
                                         grad_out)
    assert len(calls) == (0 if extension_backward else 2), "which backward ran for the two add-norms"
    assert_same(fused, per_op, atol=1e-5)


@needs_kernels
@pytest.mark.skipif(torch.cuda.is_available() or not interpreting(), reason="interpreter only; GPU test below")
@pytest.mark.parametrize("dropout", [0.0, 0.2])
@pytest.mark.parametrize("backend", BACKENDS)
def test_fused_layer_under_autocast_through_the_kernels(backend, dropout, monkeypatch):
    """fp16: the interpreter's tl.dot mistreats bf16 (the GPU's bf16 is checked on the GPU)."""
    block = make_block(backend, dropout=dropout, use_bias=True, activation="gelu" if dropout else "relu")
    with interpreted_kernels():
        check_autocast(block, ops.prepare_key_mask(VALID_LENS["1d"], L, backend), torch.float16, monkeypatch)


class _CountCasts(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.casts = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.casts += func is torch.ops.aten._to_copy.default
        return func(*args, **(kwargs or {}))


@needs_kernels
@pytest.mark.skipif(torch.cuda.is_available() or not interpreting(), reason="interpreter only")
@pytest.mark.parametrize("dropout", [0.0, 0.2])
@pytest.mark.parametrize("backend", BACKENDS)
def test_autocast_add_norms_take_the_branch_in_its_dtype_with_the_same_bits(backend, dropout, monkeypatch):
    """Under autocast on the kernels' path the add-norms read the branch's GEMM output in
    autocast's dtype beside the fp32 residual, and their backward writes the branch's gradient
    in it (encoder_layer._mixed_add_norms): four casts a layer fewer than casting both ways, the
    same output and gradients bit for bit. (On ``cuda`` the casting path's forwards are the
    extension's, the mixed path's Triton's: the same up to rounding.)"""
    layer_module = importlib.import_module("bert_fast.ops.encoder_layer")
    block = make_block(backend, dropout=dropout, use_bias=True, activation="gelu")
    x, grad_out = inputs()
    results, casts = [], []
    for mixed in (True, False):
        with monkeypatch.context() as patch, interpreted_kernels(), torch.autocast("cpu", torch.float16):
            if not mixed:
                patch.setattr(layer_module, "_mixed_add_norms", lambda spec, x: False)
            key_mask = ops.prepare_key_mask(VALID_LENS["1d"], L, backend)
            counter = _CountCasts()
            with counter:
                results.append(run(block, x, key_mask, grad_out))
        casts.append(counter.casts)
        assert type(results[-1][1]).__name__ == "_EncoderLayerBackward"
    (out, _, grads), (want, _, want_grads) = results
    assert out.dtype == torch.float32
    if backend == "triton":
        assert torch.equal(out, want)
        for name, grad in want_grads.items():
            assert (grads[name] is None) == (grad is None), name
            assert grad is None or torch.equal(grads[name], grad), name
    else:
        assert_same(results[0], results[1], atol=AMP_TOLERANCE[torch.float16], rtol=AMP_TOLERANCE[torch.float16])
    assert casts[0] == casts[1] - 4, f"casts with mixed add-norms {casts[0]}, without {casts[1]}"


@needs_kernels
@pytest.mark.skipif(torch.cuda.is_available() or not interpreting(), reason="interpreter only; GPU test below")
@pytest.mark.parametrize("valid_lens", list(VALID_LENS.values()), ids=list(VALID_LENS))
@pytest.mark.parametrize("backend", BACKENDS)
def test_fused_inference_through_the_kernels(backend, valid_lens, monkeypatch):
    block = make_block(backend, use_bias=True, activation="gelu").eval()
    x, _ = inputs()
    with interpreted_kernels():
        key_mask = ops.prepare_key_mask(valid_lens, L, backend)
        fused, per_op = infer_fused_and_per_op(block, x, key_mask, monkeypatch)
    assert_close(fused, per_op, atol=1e-5, rtol=0, what="output")


@needs_kernels
@pytest.mark.parametrize("backend", BACKENDS)
def test_inference_skips_the_attention_lse(backend, monkeypatch):
    """The fused layer's and the per-op path's inference ask the attention kernel for no LSE
    (only a backward reads it); training asks for it."""
    attention = importlib.import_module("bert_fast.ops.attention")
    asked, launcher = [], attention._attention_fwd_triton

    def recording(qkv, valid_lens, num_heads, dropout_p, seed, counts=None, lse=True):
        asked.append(lse)
        return launcher(qkv, valid_lens, num_heads, dropout_p, seed, counts, lse)

    monkeypatch.setattr(attention, "_attention_fwd_triton", recording)
    block = make_block(backend, use_bias=True)
    x, _ = inputs()
    with interpreted_kernels():
        key_mask = ops.prepare_key_mask(VALID_LENS["1d"], L, backend)
        infer_fused_and_per_op(block.eval(), x, key_mask, monkeypatch)
        assert asked == [False, False]
        block.train()(x.requires_grad_(), key_mask).sum().backward()
    assert asked == [False, False, True]


@needs_kernels
@pytest.mark.skipif(torch.cuda.is_available() or not interpreting(), reason="interpreter only; GPU test below")
@pytest.mark.parametrize("dropout", [0.0, 0.2])
@pytest.mark.parametrize("packing", list(PACKINGS))
@pytest.mark.parametrize("backend", BACKENDS)
def test_fused_layer_on_packed_tokens_through_the_kernels(backend, packing, dropout, monkeypatch):
    block = make_block(backend, dropout=dropout, use_bias=True, activation="gelu" if dropout else "relu")
    valid_lens = PACKED_VALID_LENS["empty-seq"]
    x, grad_out, unpadding = packed_inputs(valid_lens, PACKINGS[packing])
    with interpreted_kernels():
        fused, per_op = fused_and_per_op(block, x, valid_lens, grad_out, unpadding)
        assert_same(fused, per_op, atol=1e-5)
        inferred = infer_fused_and_per_op(block.eval(), x, valid_lens, monkeypatch, unpadding=unpadding)
    assert_close(*inferred, atol=1e-5, rtol=0, what="inference output")


@needs_kernels
@pytest.mark.parametrize("activation", ["relu", "gelu"])
@pytest.mark.parametrize("valid_lens", list(VALID_LENS.values()), ids=list(VALID_LENS))
@pytest.mark.parametrize("backend", BACKENDS)
def test_fused_layer_matches_the_torch_backend(backend, valid_lens, activation):
    """Against plain PyTorch (the torch backend's block, same weights), which shares none of the
    fused layer's kernels: the per-op path above shares its backward's bias-gradient sums
    (bias_act's kernel for ReLU too, then column_sums). On a GPU, or in the interpreter."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    block = make_block(backend, use_bias=True, activation=activation, device=device)
    plain = make_block("torch", use_bias=True, activation=activation, device=device)
    plain.load_state_dict(block.state_dict())
    x, grad_out = inputs(device)
    valid_lens = None if valid_lens is None else valid_lens.to(device)
    with contextlib.nullcontext() if device == "cuda" else interpreted_kernels():
        fused = run(block, x, ops.prepare_key_mask(valid_lens, L, backend), grad_out)
    assert type(fused[1]).__name__ == "_EncoderLayerBackward", "the fused node was not used"
    reference = run(plain, x, valid_lens, grad_out)
    assert_same(fused, reference, atol=1e-4)


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float32] + ([torch.bfloat16] if BF16_OK else []), ids=str)
@pytest.mark.parametrize("packing", list(PACKINGS))
@pytest.mark.parametrize("backend", BACKENDS)
def test_gpu_fused_layer_on_packed_tokens_matches_the_per_op_path(backend, packing, dtype, monkeypatch):
    block = make_block(backend, dropout=0.1, use_bias=True, device="cuda", dtype=dtype)
    valid_lens = PACKED_VALID_LENS["empty-seq"].cuda()
    x, grad_out, unpadding = packed_inputs(valid_lens, PACKINGS[packing], "cuda", dtype)
    tolerance = dict(atol=1e-4, rtol=0) if dtype == torch.float32 else dict(atol=3e-2, rtol=2e-2)
    assert_same(*fused_and_per_op(block, x, valid_lens, grad_out, unpadding), **tolerance)
    inferred = infer_fused_and_per_op(block.eval(), x, valid_lens, monkeypatch, unpadding=unpadding)
    assert_close(*inferred, **tolerance, what="inference output")


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float32] + ([torch.bfloat16] if BF16_OK else []), ids=str)
@pytest.mark.parametrize("valid_lens", list(VALID_LENS.values()), ids=list(VALID_LENS))
@pytest.mark.parametrize("backend", BACKENDS)
def test_gpu_fused_layer_matches_the_per_op_path(backend, valid_lens, dtype):
    block = make_block(backend, dropout=0.1, use_bias=True, device="cuda", dtype=dtype)
    x, grad_out = inputs("cuda", dtype)
    valid_lens = None if valid_lens is None else valid_lens.cuda()
    fused, per_op = fused_and_per_op(block, x, valid_lens, grad_out)
    # bf16: the two paths round the same values, but the GEMMs' reduction order may differ.
    assert_same(fused, per_op, atol=1e-4 if dtype == torch.float32 else 3e-2, rtol=0 if dtype == torch.float32 else 2e-2)


@needs_cuda
@pytest.mark.skipif(not BF16_OK, reason="needs a GPU with bf16")
@pytest.mark.parametrize("dropout", [0.0, 0.1])
@pytest.mark.parametrize("backend", BACKENDS)
def test_gpu_fused_layer_under_autocast(backend, dropout):
    """CUDA autocast (bf16, fp32 Parameters: the training step's setting), where the add-norms
    take the branch's GEMM output in bf16 beside the fp32 residual (_mixed_add_norms): fp32
    output and gradients, the per-op path's within bf16's tolerance. (The same bits as the layer
    casting the branch both ways are checked in the interpreter: compiled, the two kernel
    specialisations may differ in fp32's last bits, see helpers.assert_same_computation, which
    bf16's rounding between the layers can then make a bf16 unit.)"""
    block = make_block(backend, dropout=dropout, use_bias=True, activation="gelu", device="cuda")
    x, grad_out = inputs("cuda")
    with torch.autocast("cuda", torch.bfloat16):
        fused, per_op = fused_and_per_op(block, x, VALID_LENS["1d"].cuda(), grad_out)
    assert fused[0].dtype == torch.float32
    assert all(grad is None or grad.dtype == torch.float32 for grad in fused[2].values())
    assert_same(fused, per_op, atol=AMP_TOLERANCE[torch.bfloat16], rtol=AMP_TOLERANCE[torch.bfloat16])


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float32] + ([torch.bfloat16] if BF16_OK else []), ids=str)
@pytest.mark.parametrize("valid_lens", list(VALID_LENS.values()), ids=list(VALID_LENS))
@pytest.mark.parametrize("backend", BACKENDS)
def test_gpu_fused_inference_matches_the_per_op_path(backend, valid_lens, dtype, monkeypatch):
    block = make_block(backend, use_bias=True, device="cuda", dtype=dtype).eval()
    x, _ = inputs("cuda", dtype)
    valid_lens = None if valid_lens is None else valid_lens.cuda()
    fused, per_op = infer_fused_and_per_op(block, x, valid_lens, monkeypatch)
    assert_close(fused, per_op, atol=1e-4 if dtype == torch.float32 else 3e-2,
                 rtol=0 if dtype == torch.float32 else 2e-2, what="output")
