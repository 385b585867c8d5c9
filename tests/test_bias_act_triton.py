"""bias_act / linear_act's Triton backend: the epilogue kernels (Triton's interpreter on CPU, CUDA
when present), the registered ops (opcheck, gradcheck through their CPU twins), validation."""

import pytest
import torch
from torch.nn import functional as F

from bert_fast.ops.bias_act import (ACTIVATIONS, _bias_act_bwd_cpu, _bias_act_bwd_triton, _bias_act_fwd_triton,
                                    bias_act_bwd, bias_act_fwd, linear_act)
from tests.helpers import (assert_close, assert_within_rule, BF16_OK, DEVICE,
                           max_err, needs_cuda, needs_kernels, peak_bytes)

# The interpreter evaluates sigmoid's exp with numpy, which warns when it overflows to inf
# (the result, 0 or 1, is right).
pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")


def torch_bias_act(h, bias, activation, grad_out):
    """PyTorch at the inputs' precision: act(h + bias) and (d_h, d_bias)."""
    h = h.detach().requires_grad_()
    bias = bias.detach().requires_grad_() if bias is not None else None
    z = h + bias if bias is not None else h
    if activation == "relu":
        out = F.relu(z)
    else:
        out = F.gelu(z, approximate="tanh" if activation == "gelu_tanh" else "none")
    grads = torch.autograd.grad(out, [h] + ([bias] if bias is not None else []), grad_out)
    return out.detach(), (grads[0], grads[1] if bias is not None else None)


def check_kernels_against_torch(shape, dtype, activation, with_bias, device=DEVICE):
    # Spread of 3 so that every part of GELU (tails and the curved middle) is exercised.
    h = (3 * torch.randn(shape, device=device)).to(dtype)
    bias = torch.randn(shape[-1], device=device).to(dtype) if with_bias else None
    grad_out = torch.randn(shape, device=device).to(dtype)
    out = _bias_act_fwd_triton(h, bias, activation)
    saved = out if activation == "relu" else h
    d_h, d_bias = _bias_act_bwd_triton(grad_out, saved, bias, activation)
    assert out.dtype == d_h.dtype == dtype and out.shape == d_h.shape == h.shape
    assert (d_bias.numel() == 0) == (bias is None)

    ref_out, (ref_d_h, ref_d_bias) = torch_bias_act(h.double(), bias.double() if with_bias else None, activation,
                                                    grad_out.double())
    same_out, (same_d_h, same_d_bias) = torch_bias_act(h, bias, activation, grad_out)
    assert_within_rule(out, ref_out, same_out, f"{activation} out")
    assert_within_rule(d_h, ref_d_h, same_d_h, f"{activation} d_h")
    if with_bias:
        assert_within_rule(d_bias, ref_d_bias, same_d_bias, f"{activation} d_bias")


# N = 96 and 1000 are not powers of two (1000 also spans 4 column blocks of 256 with a masked
# tail); rows 37 and 150 are no multiple of BLOCK_M (16 at N = 96, 8 at N = 1000), and the
# interpreter's few backward programs loop over several row tiles.
@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("shape,with_bias", [((150, 96), True), ((37, 1000), True), ((1, 96), True),
                                             ((2, 3, 96), False)])
def test_kernels_match_torch(shape, with_bias, activation, dtype):
    check_kernels_against_torch(shape, dtype, activation, with_bias)


@needs_kernels
@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_cpu_kernels_allocate_one_output_with_a_bias(activation):
    """The CPU forward applies the activation to its fresh h + bias in place (the sum and an
    output of its own were two (rows, N) tensors at once: the inference peak at the FFN); the
    backward writes GELU's derivative over its own h + bias (its formulas in tensor ops held
    four such tensors: the training peak of a GELU model)."""
    from bert_fast.ops.bias_act import bias_act
    h, bias = torch.randn(16, 24), torch.randn(24)
    with torch.no_grad():
        out = bias_act(h, bias, activation)
        assert peak_bytes(lambda: bias_act(h, bias, activation)) == out.untyped_storage().nbytes()
        saved = out if activation == "relu" else h
        grad = torch.randn_like(h)
        d_h, d_bias = _bias_act_bwd_cpu(grad, saved, bias, activation)
        mask = h.numel() + 8 if activation == "relu" else 0       # ReLU's: saved <= 0 (bool), a 0-d 0.0
        assert peak_bytes(lambda: _bias_act_bwd_cpu(grad, saved, bias, activation)) <= h.nbytes + 2 * bias.nbytes + mask
    assert_close(d_h, bias_act_bwd(grad, saved, bias, activation)[0], atol=1e-6)
    want = torch.relu(h + bias) if activation == "relu" else F.gelu(
        h + bias, approximate="tanh" if activation == "gelu_tanh" else "none")
    assert torch.equal(out, want)
    before = h.clone()
    bias_act(h, None, activation)
    assert torch.equal(h, before), "without a bias, the activation is not applied to h in place"


def test_strided_inputs_give_the_contiguous_result():
    """A row-strided view is read in place; a transposed grad (last-dim stride != 1) is copied."""
    h = torch.randn(9, 200, device=DEVICE)[:, :96]
    bias = torch.randn(96, device=DEVICE)
    grad_out = torch.randn(96, 9, device=DEVICE).t()
    for activation in ("relu", "gelu"):
        results = []
        for h_, grad_out_ in ((h, grad_out), (h.contiguous(), grad_out.contiguous())):
            out = _bias_act_fwd_triton(h_, bias, activation)
            results.append((out, *_bias_act_bwd_triton(grad_out_, out if activation == "relu" else h_, bias,
                                                        activation)))
        for a, b, name in zip(*results, ("out", "d_h", "d_bias")):
            assert torch.equal(a, b), f"{activation} {name}: max abs difference {max_err(a, b):.3g}"


@needs_kernels
def test_relu_backward_reads_only_the_output():
    """d_h = grad where out > 0: zero at out == 0 (h + b <= 0), like torch.relu's backward."""
    h = torch.tensor([[-1.0, 0.0, 2.0, -3.0]], device=DEVICE)
    bias = torch.tensor([1.0, 0.0, -2.0, 4.0], device=DEVICE)
    out = _bias_act_fwd_triton(h, bias, "relu")
    d_h, d_bias = _bias_act_bwd_triton(torch.ones_like(h), out, bias, "relu")
    assert torch.equal(out, torch.tensor([[0.0, 0.0, 0.0, 1.0]], device=DEVICE))
    assert torch.equal(d_h, torch.tensor([[0.0, 0.0, 0.0, 1.0]], device=DEVICE)) and torch.equal(d_bias, d_h[0])


@pytest.mark.parametrize("implementation", [pytest.param("kernel", marks=needs_kernels), "cpu twin"])
def test_relu_backward_passes_the_gradient_of_a_nan_output(implementation):
    """torch.relu's backward (threshold_backward: out <= 0 ? 0 : grad) passes a NaN output's
    gradient; ``out > 0 ? grad : 0`` dropped it, so a NaN in training left dense1's bias
    gradient finite where the reference's is NaN (found by review)."""
    out = torch.tensor([[float("nan"), 2.0, 0.0, -0.0]], device=DEVICE if implementation == "kernel" else "cpu")
    grad = torch.ones_like(out)
    if implementation == "kernel":
        d_h, d_bias = _bias_act_bwd_triton(grad, out, torch.zeros(4, device=out.device), "relu")
    else:
        d_h, d_bias = _bias_act_bwd_cpu(grad, out, torch.zeros(4), "relu")
    expected = torch.ops.aten.threshold_backward(grad, out, 0)
    assert torch.equal(d_h, expected) and torch.equal(d_bias, expected[0]), (d_h, d_bias)


@needs_kernels
def test_empty_input():
    h, bias = torch.randn(0, 96, device=DEVICE), torch.randn(96, device=DEVICE)
    out = _bias_act_fwd_triton(h, bias, "gelu")
    d_h, d_bias = _bias_act_bwd_triton(h, h, bias, "gelu")
    assert out.shape == d_h.shape == (0, 96) and torch.equal(d_bias, torch.zeros(96, device=DEVICE))


@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_opcheck(activation):
    h = torch.randn(2, 3, 6, requires_grad=True)
    bias = torch.randn(6, requires_grad=True)
    for b in (bias, None):
        torch.library.opcheck(bias_act_fwd, (h, b, activation))
        torch.library.opcheck(bias_act_bwd, (torch.randn(2, 3, 6), h.detach(), b.detach() if b is not None else None,
                                             activation))


@pytest.mark.parametrize("with_bias", [True, False], ids=["bias", "no_bias"])
@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_gradcheck_through_triton_backend(activation, with_bias):
    x = torch.randn(2, 3, 5, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(6, 5, dtype=torch.float64, requires_grad=True)
    bias = torch.randn(6, dtype=torch.float64, requires_grad=True) if with_bias else None
    inputs = (x, weight, bias) if with_bias else (x, weight)
    fn = lambda x, weight, bias=None: linear_act(x, weight, bias, activation, backend="triton")
    assert torch.autograd.gradcheck(fn, inputs)


@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_triton_backend_on_cpu_matches_torch_backend(activation):
    leaves = [torch.randn(2, 5, 16, requires_grad=True), torch.randn(24, 16, requires_grad=True),
              torch.randn(24, requires_grad=True)]
    grad_out = torch.randn(2, 5, 24)
    results = []
    for backend in ("torch", "triton"):
        out = linear_act(*leaves, activation, backend=backend)
        results.append((out, *torch.autograd.grad(out, leaves, grad_out)))
    for a, b, name in zip(*results, ("out", "d_x", "d_weight", "d_bias")):
        assert_close(a, b, atol=1e-5, what=f"{activation} {name}")


def test_unknown_backend_and_activation():
    x, weight = torch.randn(2, 8), torch.randn(4, 8)
    with pytest.raises(ValueError, match="backend must be 'torch', 'triton' or 'cuda'"):
        linear_act(x, weight, None, backend="CUDA")
    with pytest.raises(ValueError, match="activation must be one of"):
        linear_act(x, weight, None, "silu", backend="triton")


_h, _b = torch.randn(4, 96), torch.randn(96)
VALIDATION_CASES = [
    ((_h, _b, "silu"), ValueError, "activation must be one of"),
    ((torch.randn(4, 0), None, "relu"), ValueError, "N >= 1"),
    ((_h, torch.randn(95), "relu"), ValueError, r"bias must have shape \(96,\)"),
    ((_h.double(), None, "relu"), TypeError, "float16, bfloat16 or float32"),
    ((_h, _b.half(), "relu"), TypeError, "bias must have the dtype of h"),
    ((_h, _b.to("meta"), "relu"), ValueError, "bias must be on the device of h"),
]


@pytest.mark.parametrize("args,error,message", VALIDATION_CASES, ids=[c[2] for c in VALIDATION_CASES])
def test_launcher_validation(args, error, message):
    with pytest.raises(error, match=message):
        _bias_act_fwd_triton(*args)


def test_backward_launcher_validation():
    with pytest.raises(ValueError, match="grad_out must match saved"):
        _bias_act_bwd_triton(_h.half(), _h, _b, "gelu")
    with pytest.raises(TypeError, match="bias must have the dtype of saved"):
        _bias_act_bwd_triton(_h, _h, _b.half(), "gelu")


# GPU: BERT-base's FFN shapes in fp16 and bf16, and the public function against the torch path.
GPU_DTYPES = [torch.float16] + ([torch.bfloat16] if BF16_OK else [])


@needs_cuda
@pytest.mark.parametrize("dtype", GPU_DTYPES, ids=str)
@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("shape", [(8, 512, 3072), (3, 77, 1000)])
def test_gpu_kernels_match_torch(shape, activation, dtype):
    check_kernels_against_torch(shape, dtype, activation, True, "cuda")


def check_linear_act_paths(activation, shape, dtype, device):
    """linear_act's triton backend, eager and compiled, against its torch backend.

    For ReLU the gradients are checked against each path's own forward: where the pre-activation
    z is within rounding of 0, the paths may round z to different sides (cuBLASLt's epilogue
    adds the bias to the fp32 accumulator, the compiled path to the rounded GEMM output), and
    one such flip moves a d_x row by grad_out * a weight row, far above any tolerance that
    catches a kernel error (fp16 on an H100: 0.41 against 0.11). So: the masks must agree
    wherever |z| (fp64) exceeds a rounding margin, and each path's gradients must equal the
    linear's GEMMs on its own mask."""
    rows, k, n = shape
    gen = torch.Generator(device=device).manual_seed(0)
    leaves = [torch.randn(rows, k, device=device, generator=gen).to(dtype).requires_grad_(),
              (0.05 * torch.randn(n, k, device=device, generator=gen)).to(dtype).requires_grad_(),
              torch.randn(n, device=device, generator=gen).to(dtype).requires_grad_()]
    grad_out = torch.randn(rows, n, device=device, generator=gen).to(dtype)
    compiled = torch.compile(lambda *a: linear_act(*a, activation, backend="triton"), fullgraph=True)
    results = []
    for fn in (lambda *a: linear_act(*a, activation, backend="torch"),
               lambda *a: linear_act(*a, activation, backend="triton"), compiled):
        out = fn(*leaves)
        results.append((out, *torch.autograd.grad(out, leaves, grad_out)))
    x, weight, bias = (t.detach().double() for t in leaves)
    z = x @ weight.t() + bias
    margin = 8 * torch.finfo(dtype).eps * (x.abs() @ weight.abs().t() + bias.abs())
    for out, *grads in results:
        assert_close(out.float(), results[0][0].float(), atol=2e-2, rtol=1e-2, what=f"{activation} out")
        if activation != "relu":
            for got, want, name in zip(grads, results[0][1:], ("d_x", "d_weight", "d_bias")):
                assert_close(got.float(), want.float(), atol=2e-2, rtol=1e-2, what=f"{activation} {name}")
            continue
        mask = out > 0
        clear = z.abs() > margin
        assert torch.equal(mask[clear], (z > 0)[clear]), "relu mask differs where z is clear of 0"
        d_z = grad_out.double() * mask
        for got, want, name in zip(grads, (d_z @ weight, d_z.t() @ x, d_z.sum(0)), ("d_x", "d_weight", "d_bias")):
            assert_close(got.double(), want, atol=2e-2, rtol=1e-2, what=f"relu {name} (own mask)")


@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_linear_act_and_compile_match_torch_backend(activation):
    check_linear_act_paths(activation, (24, 32, 48), torch.float32, "cpu")


@needs_cuda
@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_gpu_linear_act_and_compile_match_torch_backend(activation):
    check_linear_act_paths(activation, (512, 768, 3072), torch.float16, "cuda")


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_linear_act_under_autocast_follows_its_cast_lists(backend):
    """Under autocast the GEMM runs in the autocast dtype, as F.linear does there (the epilogue
    path is left out while autocast is on)."""
    x, weight, bias = torch.randn(4, 8), torch.randn(16, 8), torch.randn(16)
    with torch.autocast("cpu", torch.bfloat16):
        out = linear_act(x, weight, bias, "relu", backend=backend)
        expected = torch.relu(torch.nn.functional.linear(x, weight, bias))
    assert out.dtype == expected.dtype == torch.bfloat16
    assert_close(out.float(), expected.float(), atol=5e-2)
