"""add_layernorm's Triton backend: the kernels (Triton's interpreter on CPU, CUDA when present),
the registered ops (opcheck, gradcheck through their CPU twins), dropout, and input validation."""

import pytest
import torch
from torch.nn import functional as F

from bert_fast.backend import available_backends
from bert_fast.ops.add_layernorm import (MAX_HIDDEN, _add_layernorm_bwd_triton, _add_layernorm_fwd_triton,
                                         _layernorm_blocks, _layernorm_bwd_blocks, add_layernorm, add_layernorm_bwd,
                                         add_layernorm_fwd)
from tests.helpers import (assert_close, assert_same_computation, assert_within_rule, BF16_OK, DEVICE, seed_tensor,
                           interpreted_kernels, max_err, needs_cuda, needs_kernels)



def torch_add_layernorm(x, residual, weight, bias, grad_out, keep_scale=None):
    """PyTorch at the inputs' precision: out and (d_x, d_residual, d_weight, d_bias).

    ``keep_scale`` (0 or 1/(1-p) per element) applies a known dropout mask."""
    leaves = [t.detach().requires_grad_() if t is not None else None for t in (x, residual, weight, bias)]
    x_, residual_, weight_, bias_ = leaves
    dropped = x_ * keep_scale.to(x_.dtype) if keep_scale is not None else x_
    out = F.layer_norm(residual_ + dropped, x.shape[-1:], weight_, bias_, 1e-5)
    grads = torch.autograd.grad(out, [t for t in leaves if t is not None], grad_out)
    grads = iter(grads)
    return out.detach(), [next(grads) if t is not None else None for t in leaves]


def make_inputs(shape, dtype, affine, device=DEVICE):
    hidden = shape[-1]
    x = torch.randn(shape, device=device).to(dtype)
    residual = torch.randn(shape, device=device).to(dtype)
    weight = (1 + 0.5 * torch.randn(hidden, device=device)).to(dtype) if affine in ("both", "weight") else None
    bias = torch.randn(hidden, device=device).to(dtype) if affine == "both" else None
    return x, residual, weight, bias, torch.randn(shape, device=device).to(dtype)


def check_kernels_against_torch(shape, dtype, affine, device=DEVICE):
    x, residual, weight, bias, grad_out = make_inputs(shape, dtype, affine, device)
    out, mean, rstd = _add_layernorm_fwd_triton(x, residual, weight, bias, 1e-5, None, 0.0)
    rows = x.numel() // shape[-1]
    assert mean.shape == rstd.shape == (rows,) and mean.dtype == rstd.dtype == torch.float32
    d_residual, d_x, d_weight, d_bias = _add_layernorm_bwd_triton(
        grad_out, x, residual, weight, mean, rstd, 0, 0.0, bias is not None)
    assert d_x is None, "without dropout d_x is d_residual and is not written"
    assert (d_weight is None) == (weight is None) and (d_bias is None) == (bias is None)

    as64 = lambda t: t.double() if t is not None else None
    ref_out, ref_grads = torch_add_layernorm(*map(as64, (x, residual, weight, bias, grad_out)))
    same_out, same_grads = torch_add_layernorm(x, residual, weight, bias, grad_out)
    assert_within_rule(out, ref_out, same_out, "out")
    s = (x.double() + residual.double()).reshape(rows, -1)
    assert_close(mean, s.mean(-1), atol=1e-5 * s.abs().max().item(), what="mean")
    assert_close(rstd, torch.rsqrt(s.var(-1, correction=0) + 1e-5), atol=1e-5, rtol=1e-4, what="rstd")
    for actual, ref, same, name in zip((d_residual, d_weight, d_bias), ref_grads[1:], same_grads[1:],
                                       ("d_residual", "d_weight", "d_bias")):
        if ref is not None:
            assert_within_rule(actual, ref, same, name)
    check_x_bias_gradient((grad_out, x, residual, weight, mean, rstd, 0, 0.0, bias is not None),
                          (d_residual, d_x, d_weight, d_bias), ref_grads[0], same_grads[0])


def check_x_bias_gradient(args, grads, ref_d_x, same_d_x):
    """x_bias=True: the same four gradients, and a fifth, the column sum of d_x (the gradient of
    a bias added to x), within the rule of PyTorch's sum of its own d_x.

    The same bit for bit in the interpreter. Compiled, the x_bias kernel is another kernel, and
    Triton's default fp fusion may contract its multiply-adds into FMAs differently: on an H100
    (2026-11-26, under compute-sanitizer) d_weight at (2, 3, 1000) fp32 differed in its last
    bits. There, the same within 4 units in the last place of the largest value."""
    *same_four, d_x_bias = _add_layernorm_bwd_triton(*args, x_bias=True)
    for a, b, name in zip(same_four, grads, ("d_residual", "d_x", "d_weight", "d_bias")):
        assert (a is None) == (b is None), f"{name}: None with x_bias={a is None}, without={b is None}"
        if a is None:
            continue
        if a.device.type == "cpu":
            assert torch.equal(a, b), f"{name} changed with x_bias"
        else:
            assert_close(a, b, atol=4 * torch.finfo(b.dtype).eps * b.abs().max().item(), what=f"{name} with x_bias")
    hidden = ref_d_x.shape[-1]
    assert_within_rule(d_x_bias, ref_d_x.reshape(-1, hidden).sum(0), same_d_x.reshape(-1, hidden).sum(0), "d_x_bias")


# H = 96 and 1000 are not powers of two; rows 150 is no multiple of ROWS_PER_PROGRAM (16 at
# H = 96) and makes the interpreter's 4 backward programs loop over several row tiles.
@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("shape,affine", [((150, 96), "both"), ((2, 3, 1000), "both"), ((1, 768), "both"),
                                          ((5, 96), "weight"), ((5, 96), "none")])
def test_kernels_match_torch(shape, affine, dtype):
    check_kernels_against_torch(shape, dtype, affine)


@needs_kernels
@pytest.mark.parametrize("dropout_p", [0.0, 0.3])
def test_forward_without_statistics_gives_the_same_output(dropout_p):
    """stats=False (inference): the same output (bits under the interpreter), no mean and rstd."""
    x, residual = torch.randn(37, 96, device=DEVICE), torch.randn(37, 96, device=DEVICE)
    weight, bias = torch.randn(96, device=DEVICE), torch.randn(96, device=DEVICE)
    args = (x, residual, weight, bias, 1e-5, seed_tensor(5) if dropout_p else None, dropout_p)
    out, mean, rstd = _add_layernorm_fwd_triton(*args)
    assert mean is not None and rstd is not None
    bare = _add_layernorm_fwd_triton(*args, stats=False)
    assert bare[1] is None and bare[2] is None
    assert_same_computation(bare[0], out)


@needs_kernels
def test_rows_per_program_depends_on_hidden():
    assert _layernorm_blocks(96) == (128, 16, 8)
    assert _layernorm_blocks(768) == (1024, 2, 8)
    assert _layernorm_blocks(MAX_HIDDEN) == (MAX_HIDDEN, 1, 32)
    # The backward: the same tile on half the warps (16 values a thread), at least 4.
    assert _layernorm_bwd_blocks(96) == (128, 16, 4)
    assert _layernorm_bwd_blocks(768) == (1024, 2, 4)
    assert _layernorm_bwd_blocks(4096) == (4096, 1, 8)
    assert _layernorm_bwd_blocks(MAX_HIDDEN) == (MAX_HIDDEN, 1, 16)


@needs_kernels
def test_strided_inputs_give_the_contiguous_result():
    """A row-strided view is read in place; a transposed residual (last-dim stride != 1) is copied."""
    x_wide = torch.randn(9, 200, device=DEVICE)
    residual_t = torch.randn(96, 9, device=DEVICE)
    x, residual = x_wide[:, :96], residual_t.t()
    weight, bias = torch.randn(96, device=DEVICE), torch.randn(96, device=DEVICE)
    grad_out = torch.randn(96, 9, device=DEVICE).t()

    def fwd_and_bwd(x, residual, grad_out):
        out, mean, rstd = _add_layernorm_fwd_triton(x, residual, weight, bias, 1e-5, seed_tensor(11), 0.3)
        return (out, mean, rstd,
                *_add_layernorm_bwd_triton(grad_out, x, residual, weight, mean, rstd, seed_tensor(11), 0.3, True))

    strided = fwd_and_bwd(x, residual, grad_out)
    contiguous = fwd_and_bwd(x.contiguous(), residual.contiguous(), grad_out.contiguous())
    for a, b, name in zip(strided, contiguous, ("out", "mean", "rstd", "d_residual", "d_x", "d_weight", "d_bias")):
        assert torch.equal(a, b), f"{name}: max abs difference {max_err(a, b):.3g}"


def keep_from_forward(out, mean, rstd):
    """With residual 0, no affine and x in [1, 2], the sum is recovered from the output and the
    statistics: kept elements are x/(1-p) >= 1, dropped ones 0."""
    s = out.double() / rstd.double()[:, None] + mean.double()[:, None]
    return s > 0.5, s


def check_dropout(rows, hidden, dropout_p, dtype, device=DEVICE):
    x = (1 + torch.rand(rows, hidden, device=device)).to(dtype)
    residual = torch.zeros_like(x)
    out, mean, rstd = _add_layernorm_fwd_triton(x, residual, None, None, 1e-5, seed_tensor(1234, device), dropout_p)
    keep, s = keep_from_forward(out, mean, rstd)
    keep_rate = keep.double().mean().item()
    tolerance = 6 * (dropout_p * (1 - dropout_p) / keep.numel()) ** 0.5
    assert abs(keep_rate - (1 - dropout_p)) <= tolerance, f"keep rate {keep_rate} for p = {dropout_p}"
    assert not torch.equal(keep[0], keep[1]), "each row must draw its own mask"
    scale = 1 / (1 - dropout_p)
    # The sum read back through the rounded output is good to about half an ulp of the dtype.
    tol = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}[dtype]
    relative_err = (s[keep] / (x.double()[keep] * scale) - 1).abs().max().item()
    assert relative_err <= tol, f"kept values scaled by 1/(1-p): max relative error {relative_err:.3g}"
    assert_close(s[~keep], torch.zeros_like(s[~keep]), atol=tol, what="dropped values")

    again = _add_layernorm_fwd_triton(x, residual, None, None, 1e-5, seed_tensor(1234, device), dropout_p)[0]
    other_seed = _add_layernorm_fwd_triton(x, residual, None, None, 1e-5, seed_tensor(4321, device), dropout_p)[0]
    assert torch.equal(again, out), "same seed, same output"
    assert not torch.equal(other_seed, out), "another seed, another mask"

    # The backward regenerates the forward's mask: its gradients are those of
    # LayerNorm(residual + x * keep / (1-p)) with the mask read off the forward.
    residual = torch.randn_like(x)
    weight, bias = torch.randn(hidden, device=device).to(dtype), torch.randn(hidden, device=device).to(dtype)
    out, mean, rstd = _add_layernorm_fwd_triton(x, residual, weight, bias, 1e-5, seed_tensor(1234, device), dropout_p)
    grad_out = torch.randn_like(x)
    d_residual, d_x, d_weight, d_bias = _add_layernorm_bwd_triton(grad_out, x, residual, weight, mean, rstd,
                                                                  seed_tensor(1234, device), dropout_p, True)
    keep_scale = keep.double() * scale
    as64 = lambda t: t.double()
    ref_out, ref_grads = torch_add_layernorm(*map(as64, (x, residual, weight, bias, grad_out)), keep_scale)
    same_out, same_grads = torch_add_layernorm(x, residual, weight, bias, grad_out, keep_scale)
    assert_within_rule(out, ref_out, same_out, "out with dropout")
    for actual, ref, same, name in zip((d_x, d_residual, d_weight, d_bias), ref_grads, same_grads,
                                       ("d_x", "d_residual", "d_weight", "d_bias")):
        assert_within_rule(actual, ref, same, name + " with dropout")
    assert torch.all(d_x[~keep] == 0), "d_x is zero wherever the forward dropped"
    check_x_bias_gradient((grad_out, x, residual, weight, mean, rstd, seed_tensor(1234, device), dropout_p, True),
                          (d_residual, d_x, d_weight, d_bias), ref_grads[0], same_grads[0])


@needs_kernels
@pytest.mark.parametrize("dropout_p", [0.1, 0.5])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_dropout(dropout_p, dtype):
    check_dropout(48, 384, dropout_p, dtype)


@needs_kernels
@pytest.mark.parametrize("hidden", [96, 94, 6], ids=["H96", "H94", "H6"])
def test_dropout_of_kernels_and_cpu_twin_agree(hidden):
    """Both draw the mask of _philox.py (four columns a Philox call; H 94 and 6 end their rows
    inside a group), so with dropout on they give the same output."""
    x, residual, weight, bias, grad_out = make_inputs((5, 7, hidden), torch.float32, "both")
    out, mean, rstd = _add_layernorm_fwd_triton(x, residual, weight, bias, 1e-5, seed_tensor(99), 0.3)
    grads = _add_layernorm_bwd_triton(grad_out, x, residual, weight, mean, rstd, seed_tensor(99), 0.3, True)
    cpu = lambda t: t.cpu() if t is not None else None
    twin_out, _, _ = add_layernorm_fwd(*map(cpu, (x, residual, weight, bias)), 1e-5, seed_tensor(99, "cpu"), 0.3)
    twin_grads = add_layernorm_bwd(*map(cpu, (grad_out, x, residual, weight, mean, rstd)), seed_tensor(99, "cpu"),
                                   0.3, True)
    assert_close(out.cpu(), twin_out, atol=1e-5, what="out")
    assert torch.equal(grads[1].cpu() == 0, twin_grads[1] == 0), "d_x is zero exactly where the twin dropped"
    for a, b, name in zip(grads, twin_grads, ("d_residual", "d_x", "d_weight", "d_bias")):
        assert_close(a.cpu(), b, atol=1e-4, what=name)


@needs_kernels
def test_dropout_of_everything_leaves_layernorm_of_residual():
    x, residual, weight, bias, _ = make_inputs((3, 96), torch.float32, "both")
    out = _add_layernorm_fwd_triton(x, residual, weight, bias, 1e-5, seed_tensor(5), 1.0)[0]
    assert_close(out, F.layer_norm(residual, (96,), weight, bias), atol=1e-5)


@pytest.mark.parametrize("backend", ["torch", "triton", "cuda"])
def test_rows_whose_variance_overflows_fp32_give_what_pytorch_gives(backend):
    """Values near 1e20 square past fp32's range: the variance is inf, rstd 0, and PyTorch's
    layer_norm gives zeros (the bias) for such a row, not NaN. Each backend gives PyTorch's
    answer there, and ordinary rows in the same call are unaffected."""
    if backend not in available_backends():
        pytest.skip(f"backend {backend} unavailable")
    x = torch.tensor([[1e20, -1e20, 0.0, 3.0], [3e19, 3e19, 3e19, -3e19], [1e5, 1e5 + 1, 1e5 + 2, 1e5 + 3]])
    weight, bias = torch.tensor([1.0, 2.0, 0.5, 1.0]), torch.tensor([0.0, 0.1, -0.2, 0.3])
    expected = F.layer_norm(x, (4,), weight, bias, 1e-5)
    assert torch.equal(expected[:2], bias.expand(2, 4)), "PyTorch's own answer changed"
    out = add_layernorm(x, torch.zeros_like(x), weight, bias, 1e-5, backend=backend)
    assert not out.isnan().any(), out
    assert_close(out, expected, atol=1e-5, what=f"backend {backend}")


@needs_kernels
def test_empty_input():
    x = torch.randn(0, 4, 96, device=DEVICE)
    weight, bias = torch.randn(96, device=DEVICE), torch.randn(96, device=DEVICE)
    out, mean, rstd = _add_layernorm_fwd_triton(x, x, weight, bias, 1e-5, None, 0.0)
    d_residual, _, d_weight, d_bias = _add_layernorm_bwd_triton(x, x, x, weight, mean, rstd, None, 0.0, True)
    assert out.shape == d_residual.shape == x.shape and mean.shape == (0,)
    assert torch.equal(d_weight, torch.zeros(96, device=DEVICE)) and torch.equal(d_bias, d_weight)


# One case with dropout (55 s of the CI machine each, 2026-11-28): the op's registrations are
# the same for every affine form.
@pytest.mark.parametrize("dropout_p,affine", [(0.0, "both"), (0.0, "none"), (0.3, "weight")])
def test_opcheck(dropout_p, affine):
    x, residual, weight, bias, grad_out = make_inputs((2, 3, 8), torch.float32, affine, "cpu")
    x.requires_grad_()
    residual.requires_grad_()
    seed = seed_tensor(7, "cpu") if dropout_p else None
    torch.library.opcheck(add_layernorm_fwd, (x, residual, weight, bias, 1e-5, seed, dropout_p))
    _, mean, rstd = add_layernorm_fwd(x, residual, weight, bias, 1e-5, seed, dropout_p)
    torch.library.opcheck(add_layernorm_bwd, (grad_out, x.detach(), residual.detach(), weight, mean, rstd, seed,
                                              dropout_p, bias is not None))


@needs_kernels
@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU stand-in for the GPU's case")
@pytest.mark.parametrize("dropout_p", [0.0, 0.3])
def test_opcheck_of_the_triton_launcher(dropout_p):
    """The registered backward through the Triton launcher (whose d_weight and d_bias are views
    of one reduction): its outputs must not alias (opcheck's schema test; torch.library raises
    otherwise). Its fake-tensor tests are the CPU kernel's (test_opcheck): the interpreter
    cannot run on fake tensors."""
    x, residual, weight, bias, grad_out = make_inputs((2, 3, 8), torch.float32, "both", "cpu")
    seed = seed_tensor(7, "cpu") if dropout_p else None
    with interpreted_kernels():
        _, mean, rstd = add_layernorm_fwd(x, residual, weight, bias, 1e-5, seed, dropout_p)
        torch.library.opcheck(add_layernorm_bwd, (grad_out, x, residual, weight, mean, rstd, seed, dropout_p, True),
                              test_utils="test_schema")


@pytest.mark.parametrize("dropout_p,affine", [(0.0, "both"), (0.0, "none"), (0.4, "both")])
def test_gradcheck_through_triton_backend(dropout_p, affine):
    x, residual, weight, bias, _ = make_inputs((2, 3, 5), torch.float64, affine, "cpu")
    inputs = [t.requires_grad_() for t in (x, residual, weight, bias) if t is not None]

    def fn(x, residual, *affine_params):
        weight, bias = (list(affine_params) + [None, None])[:2]
        torch.manual_seed(3)   # one dropout mask for every evaluation
        return add_layernorm(x, residual, weight, bias, 1e-5, dropout_p, True, backend="triton")

    assert torch.autograd.gradcheck(fn, inputs)


def test_triton_backend_on_cpu_matches_torch_backend():
    x, residual, weight, bias, grad_out = make_inputs((2, 5, 96), torch.float32, "both", "cpu")
    leaves = [t.requires_grad_() for t in (x, residual, weight, bias)]
    results = []
    for backend in ("torch", "triton"):
        out = add_layernorm(*leaves, 1e-5, 0.1, training=False, backend=backend)
        results.append((out, *torch.autograd.grad(out, leaves, grad_out)))
    for a, b, name in zip(*results, ("out", "d_x", "d_residual", "d_weight", "d_bias")):
        assert_close(a, b, atol=1e-5, what=name)


def test_triton_backend_dropout_follows_torch_manual_seed():
    x, residual = torch.rand(64, 128) + 1, torch.zeros(64, 128)
    runs = []
    for seed in (0, 0, 1):
        torch.manual_seed(seed)
        runs.append(add_layernorm(x, residual, None, None, 1e-5, 0.25, True, backend="triton"))
    assert torch.equal(runs[0], runs[1]) and not torch.equal(runs[0], runs[2])
    # Dropped elements sit far below the row mean: about a quarter of them.
    dropped_rate = (runs[0] < runs[0].mean(-1, keepdim=True) - 0.5).double().mean().item()
    assert abs(dropped_rate - 0.25) < 0.03, f"dropped rate {dropped_rate}"


def test_unknown_backend():
    x = torch.randn(2, 8)
    with pytest.raises(ValueError, match="backend must be 'torch', 'triton' or 'cuda'"):
        add_layernorm(x, x, None, None, backend="CUDA")


_x, _w = torch.randn(4, 96), torch.randn(96)
VALIDATION_CASES = [
    ((torch.randn(4, MAX_HIDDEN + 1),) * 2 + (None, None), ValueError, "supports H <= 8192"),
    ((torch.randn(4, 0),) * 2 + (None, None), ValueError, "H >= 1"),
    ((_x, torch.randn(4, 95), None, None), ValueError, "residual must have the shape of x"),
    ((_x, _x, torch.randn(95), None), ValueError, r"weight must have shape \(96,\)"),
    ((_x, _x, _w, torch.randn(2, 96)), ValueError, r"bias must have shape \(96,\)"),
    ((_x.double(), _x.double(), None, None), TypeError, "float16, bfloat16 or float32"),
    ((_x, _x.half(), None, None), TypeError, "residual must have the dtype of x"),
    ((_x, _x, _w.half(), None), TypeError, "weight must have the dtype of x"),
    ((_x, _x, _w, _w.to("meta")), ValueError, "bias must be on the device of x"),
]


@pytest.mark.parametrize("args,error,message", VALIDATION_CASES, ids=[c[2] for c in VALIDATION_CASES])
def test_launcher_validation(args, error, message):
    with pytest.raises(error, match=message):
        _add_layernorm_fwd_triton(*args, 1e-5, None, 0.0)


def test_launcher_validation_of_dropout_and_backward_inputs():
    x, w = torch.randn(4, 96), torch.randn(96)
    with pytest.raises(ValueError, match=r"dropout_p must be in \[0, 1\]"):
        _add_layernorm_fwd_triton(x, x, w, w, 1e-5, None, 1.5)
    stats = torch.zeros(4)
    with pytest.raises(ValueError, match="grad_out must match x"):
        _add_layernorm_bwd_triton(x.half(), x, x, w, stats, stats, None, 0.0, True)
    with pytest.raises(ValueError, match=r"mean must be the forward's float32 \(4,\) tensor"):
        _add_layernorm_bwd_triton(x, x, x, w, stats.double(), stats, None, 0.0, True)
    with pytest.raises(ValueError, match=r"rstd must be the forward's float32 \(4,\) tensor"):
        _add_layernorm_bwd_triton(x, x, x, w, stats, torch.zeros(3), None, 0.0, True)


# GPU: the same checks at BERT sizes, in fp16 and bf16, and the public function.
GPU_DTYPES = [torch.float16] + ([torch.bfloat16] if BF16_OK else [])


@needs_cuda
@pytest.mark.parametrize("dtype", GPU_DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(8, 512, 768), (4, 128, 1024), (3, 77, 1000)])
def test_gpu_kernels_match_torch(shape, dtype):
    check_kernels_against_torch(shape, dtype, "both", "cuda")


@needs_cuda
@pytest.mark.parametrize("dtype", GPU_DTYPES, ids=str)
def test_gpu_dropout(dtype):
    check_dropout(1024, 768, 0.1, dtype, "cuda")


@needs_cuda
def test_gpu_public_function_and_compile_match_torch_backend():
    x, residual, weight, bias, grad_out = make_inputs((4, 128, 768), torch.float16, "both", "cuda")
    leaves = [t.requires_grad_() for t in (x, residual, weight, bias)]
    compiled = torch.compile(lambda *a: add_layernorm(*a, backend="triton"), fullgraph=True)
    results = []
    for fn in (lambda *a: add_layernorm(*a, backend="torch"), lambda *a: add_layernorm(*a, backend="triton"),
               compiled):
        out = fn(*leaves)
        results.append((out, *torch.autograd.grad(out, leaves, grad_out)))
    for run in results[1:]:
        for a, b, name in zip(run, results[0], ("out", "d_x", "d_residual", "d_weight", "d_bias")):
            assert_close(a.float(), b.float(), atol=2e-2, rtol=1e-2, what=name)
