"""linear_act: ``act(x @ W^T + b)`` for the first FFN layer; ReLU or GELU (erf / tanh).

backend="torch": ``F.linear`` with its bias, then the activation (ReLU in place).
backend="triton": ``bias_act(F.linear(x, W), b, act)``: cuBLAS computes ``h = x @ W^T`` without
bias, and one Triton kernel applies the epilogue ``act(h + b)`` (fp32 math, output in the input
dtype). ``h``/the output are (..., N) with the last dim contiguous (any row stride); ``b`` is
(N,) or None.

Cost model (s = bytes per element, rows x N elements of h; the epilogue is memory-bound, the
GEMM before it costs 2 rows K N FLOPs):
  forward   reads h, writes act(h + b)                                     -> 2 s bytes/elem.
  backward  reads grad_out and one saved tensor, writes d_h; d_bias is summed from the fp32
            d_h in registers (programs x N fp32 partials, then ops.column_sums) -> 3 s bytes/elem.
  Saved for backward: ReLU keeps only its output (which dense2 keeps anyway): out > 0 exactly
  where h + b > 0. GELU keeps h (its input) and recomputes h + b and GELU' in the backward.
  Against the torch path: the forward moves the same bytes (cuBLAS adds the bias inside the
  GEMM, then one activation pass); the backward saves one read of d_h, which PyTorch's
  linear backward makes again to sum d_bias.

The epilogue inside the GEMM (the default for ReLU, ``GEMM_EPILOGUE``): ``torch._addmm_activation``
runs cuBLASLt's bias+ReLU epilogue on CUDA (one launch; the separate bias_act pass over the
(rows, 3072) activation was 13% of the GPU time of a BERT-base forward at B128 L128 on an H100,
../shared/gpu-runs/h100-2026-11-23/SUMMARY.md section 5) and addmm + relu in one call on the CPU.
ReLU in the epilogue is exact (bias added to the fp32 accumulator, then max(0, .), rounded once).
Its backward (``_LinearReLU``) masks the gradient with the saved output and runs the linear's
GEMMs. GELU stays on GEMM + bias_act: cuBLASLt's GELU epilogue is the tanh form on CUDA while
the same call computes the erf form on the CPU, and it keeps no pre-activation for the backward.
Which of the two paths is faster per shape on a GPU is still to be measured; both are tested
(``gemm_epilogue=`` picks one per call).
"""

import torch
from torch.library import triton_op
from torch.nn import functional as F

from ._autograd import (autocasting, deferred_ops, forbid_double_backward, once_differentiable, records_grad,
                        thin_apply, use_registered_op)
from ._triton import (as_dtype, cdiv, compute_dtype, cpu_kernel, KERNEL_DTYPES, launch, next_power_of_2,
                      nothing_to_launch, reduction_programs, require_triton, rows, tl, triton, uses_triton)
from .column_sums import column_sums
# Shared with add_layernorm: the dtypes the kernels take, the rows the launchers walk, and the
# grid of a kernel that reduces over rows.

ACTIVATIONS = ("relu", "gelu", "gelu_tanh")


def _linear_act_torch(x, weight, bias, activation):
    y = F.linear(x, weight, bias)
    if activation == "relu":
        # In place is safe under autograd: linear's backward never reads its own output. Not on
        # a view (F.linear's of a 3-D input, recording): autograd would rebuild its base in the
        # backward (CopySlices), three activation-sized buffers. (Compiled: functionalised, as before.)
        return F.relu(y, inplace=torch.compiler.is_compiling() or not (y.requires_grad and y._is_view()))
    if activation == "gelu":
        return F.gelu(y)
    if activation == "gelu_tanh":
        return F.gelu(y, approximate="tanh")
    raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")


@triton.jit
def _gelu_tanh_twice_arg(z):
    # 0.5 (1 + tanh(u)) = sigmoid(2u), u = sqrt(2/pi) (z + 0.044715 z^3): so gelu_tanh(z) =
    # z sigmoid(2u). tl has no tanh on every target, and 1 - tanh^2 would cancel for large |z|,
    # while sigmoid(2u) sigmoid(-2u) (= (1 - tanh^2) / 4) stays accurate.
    return 1.5957691216057308 * (z + 0.044715 * z * z * z)


@triton.jit
def _activation(z, ACTIVATION: tl.constexpr):
    if ACTIVATION == "relu":
        # z < 0, not z > 0, so NaN passes through as in torch.relu.
        return tl.where(z < 0.0, 0.0, z)
    elif ACTIVATION == "gelu":
        return 0.5 * z * (1.0 + tl.erf(z * 0.7071067811865476))          # erf(z / sqrt 2)
    else:
        return z * tl.sigmoid(_gelu_tanh_twice_arg(z))


@triton.jit
def _gelu_grad(z, ACTIVATION: tl.constexpr):
    if ACTIVATION == "gelu":
        # Phi(z) + z phi(z), phi the standard normal density (1/sqrt(2 pi) = 0.3989...).
        return (0.5 * (1.0 + tl.erf(z * 0.7071067811865476))
                + z * tl.exp(-0.5 * z * z) * 0.3989422804014327)
    else:
        # d/dz [z sigmoid(2u)] = sigmoid(2u) + z sigmoid(2u) sigmoid(-2u) d(2u)/dz.
        twice_u = _gelu_tanh_twice_arg(z)
        gate = tl.sigmoid(twice_u)
        return gate + z * gate * tl.sigmoid(-twice_u) * 1.5957691216057308 * (1.0 + 3.0 * 0.044715 * z * z)


@triton.jit
def _bias_act_fwd_kernel(h_ptr, bias_ptr, out_ptr, n_rows, n_cols, h_row_stride,
                         ACTIVATION: tl.constexpr, HAS_BIAS: tl.constexpr,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_in = cols < n_cols
    mask = (rows < n_rows)[:, None] & col_in[None, :]
    rows64 = rows.to(tl.int64)[:, None]
    z = tl.load(h_ptr + rows64 * h_row_stride + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    if HAS_BIAS:
        z += tl.load(bias_ptr + cols, mask=col_in, other=0.0).to(tl.float32)[None, :]
    out = _activation(z, ACTIVATION)
    tl.store(out_ptr + rows64 * n_cols + cols[None, :], out.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _bias_act_bwd_kernel(grad_out_ptr, saved_ptr, bias_ptr, d_h_ptr, d_bias_partial_ptr,
                         n_rows, n_cols, grad_row_stride, saved_row_stride,
                         ACTIVATION: tl.constexpr, HAS_BIAS: tl.constexpr,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    # saved: the forward's output for ReLU, its input h for the GELUs.
    row_program = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_in = cols < n_cols
    if HAS_BIAS and ACTIVATION != "relu":
        bias = tl.load(bias_ptr + cols, mask=col_in, other=0.0).to(tl.float32)
    # d_bias accumulates in a tile of the tile's shape, summed over its rows once after the loop:
    # the warps hold different rows, so a sum over rows inside the loop went through shared
    # memory and two barriers every iteration (the compiled TTGIR's tt.reduce in the loop), and
    # the kernel ran at a fifth of its forward's bandwidth on an H100 (229 µs at 8192x3072 bf16
    # against 33; benchmarks/results/nvidia-h100-80gb-hbm3-2026-11-26T1517-kernels-small.log).
    d_bias_acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for first_row in range(row_program * BLOCK_M, n_rows, tl.num_programs(0) * BLOCK_M):
        rows = first_row + tl.arange(0, BLOCK_M)
        mask = (rows < n_rows)[:, None] & col_in[None, :]
        rows64 = rows.to(tl.int64)[:, None]
        dy = tl.load(grad_out_ptr + rows64 * grad_row_stride + cols[None, :], mask=mask,
                     other=0.0).to(tl.float32)
        saved = tl.load(saved_ptr + rows64 * saved_row_stride + cols[None, :], mask=mask,
                        other=0.0).to(tl.float32)
        if ACTIVATION == "relu":
            # saved <= 0, not > 0: a NaN output passes its gradient, as torch.relu's backward
            # (threshold_backward) does.
            d_z = tl.where(saved <= 0.0, 0.0, dy)
        else:
            if HAS_BIAS:
                saved += bias[None, :]
            d_z = dy * _gelu_grad(saved, ACTIVATION)
        tl.store(d_h_ptr + rows64 * n_cols + cols[None, :], d_z.to(d_h_ptr.dtype.element_ty), mask=mask)
        if HAS_BIAS:
            d_bias_acc += d_z          # masked elements are 0: loaded as 0, and where() keeps 0
    if HAS_BIAS:
        tl.store(d_bias_partial_ptr + row_program * n_cols + cols, tl.sum(d_bias_acc, axis=0), mask=col_in)


def _bias_act_blocks(n_cols):
    """(BLOCK_M, BLOCK_N, num_warps): tiles of ~2048 elements at 8 fp32 values per thread
    (ptxas, sm_90: GELU's backward takes ~60 registers there, 168 at 32 values per thread), at
    most 256 columns wide so that N = 3072 spreads over 12 column programs per row tile."""
    block_n = min(256, next_power_of_2(n_cols))
    block_m = max(1, min(64, 2048 // block_n))
    return block_m, block_n, max(4, min(8, block_m * block_n // 256))


def _bias_act_bwd_blocks(n_cols):
    """The backward's (BLOCK_M, BLOCK_N, num_warps): tiles of ~2048 elements on 4 warps, 16 fp32
    values per thread, at most 128 columns wide. The fastest of 7 shapes at every case timed on an
    H200 (scripts/bias_act_bwd_tiles.py, 2026-11-26, N 3072 bf16, 4 programs per SM): 4096 and
    8192 rows, ReLU 23.3 and 41.2 us against the forward's tiles' (8, 256, 8 warps) 29.4 and 46.5;
    GELU 36.5 and 66.6 against 40.4 and 69.2."""
    block_n = min(128, next_power_of_2(n_cols))
    return max(1, min(64, 2048 // block_n)), block_n, 4


def _check_activation(activation):
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")


def _check_inputs(h, bias, activation, what="h"):
    _check_activation(activation)
    if h.dim() < 1 or h.shape[-1] == 0:
        raise ValueError(f"{what} must have shape (..., N) with N >= 1, got {tuple(h.shape)}")
    if h.dtype not in KERNEL_DTYPES:
        raise TypeError(f"the Triton bias_act takes float16, bfloat16 or float32, got {h.dtype}")
    if bias is not None:
        if bias.shape != h.shape[-1:]:
            raise ValueError(f"bias must have shape ({h.shape[-1]},) or be None, got {tuple(bias.shape)}")
        if bias.dtype != h.dtype:
            raise TypeError(f"bias must have the dtype of {what} ({h.dtype}), got {bias.dtype}")
        if bias.device != h.device:
            raise ValueError(f"bias must be on the device of {what} ({h.device}), got {bias.device}")


def _bias_act_fwd_triton(h, bias, activation):
    """Triton forward: act(h + bias), shaped like h, in h's dtype."""
    _check_inputs(h, bias, activation)
    require_triton(h, bias)
    n_cols = h.shape[-1]
    h2, h_stride, n_rows = rows(h, n_cols)
    # h's shape, contiguous (the kernel writes rows of n_cols): an output that is a view of a
    # 2-D buffer could not be edited in place under autograd.
    out = torch.empty_like(h, memory_format=torch.contiguous_format)
    if not nothing_to_launch(n_rows):
        block_m, block_n, num_warps = _bias_act_blocks(n_cols)
        grid = (cdiv(n_rows, block_m), cdiv(n_cols, block_n))
        launch(_bias_act_fwd_kernel, out)[grid](
            h2, bias, out, n_rows, n_cols, h_stride,
            ACTIVATION=activation, HAS_BIAS=bias is not None,
            BLOCK_M=block_m, BLOCK_N=block_n, num_warps=num_warps)
    return out


def _bias_act_bwd_triton(grad_out, saved, bias, activation, check=True, defer_sum=False):
    """Triton backward: (d_h, d_bias); d_bias is an empty (0-element) tensor when bias is None.

    ``saved`` is the forward's output for "relu" and its input h for "gelu"/"gelu_tanh".
    ``check=False``: the inputs are a forward's, checked when it ran (the backward of our own
    Functions; see add_layernorm's _add_layernorm_bwd_triton). ``defer_sum``: (d_h, partials)
    instead, d_bias left as the kernel's (programs, N) fp32 partial rows (None without bias), as
    add_layernorm's ``defer_sums``.
    """
    if check:
        _check_inputs(saved, bias, activation, what="saved")
        if grad_out.shape != saved.shape or grad_out.dtype != saved.dtype:
            raise ValueError(f"grad_out must match saved: shape {tuple(saved.shape)} and dtype {saved.dtype}, "
                             f"got {tuple(grad_out.shape)} and {grad_out.dtype}")
        require_triton(grad_out, saved, bias)
    n_cols = saved.shape[-1]
    grad2, grad_stride, n_rows = rows(grad_out, n_cols)
    saved2, saved_stride, _ = rows(saved, n_cols)
    block_m, block_n, num_warps = _bias_act_bwd_blocks(n_cols)
    col_programs = cdiv(n_cols, block_n)
    row_programs = reduction_programs(saved.device, cdiv(n_rows, block_m), col_programs)
    d_h = torch.empty_like(saved, memory_format=torch.contiguous_format)
    # Every program stores its partial row (zeros if it had no rows): no zeroing needed.
    d_bias_partial = saved.new_empty(row_programs, n_cols, dtype=torch.float32) if bias is not None else None
    empty = nothing_to_launch(n_rows)
    if not empty:
        launch(_bias_act_bwd_kernel, d_h)[(row_programs, col_programs)](
            grad2, saved2, bias, d_h, d_bias_partial, n_rows, n_cols, grad_stride, saved_stride,
            ACTIVATION=activation, HAS_BIAS=bias is not None,
            BLOCK_M=block_m, BLOCK_N=block_n, num_warps=num_warps)
    if defer_sum:
        return d_h, d_bias_partial.zero_() if empty and bias is not None else d_bias_partial
    if bias is None:
        d_bias = saved.new_empty(0)
    else:
        d_bias = torch.zeros_like(bias) if empty else column_sums(d_bias_partial, saved.dtype)
    return d_h, d_bias


def _bias_act_fwd_cpu(h, bias, activation):
    _check_activation(activation)
    z = as_dtype(h, compute_dtype(h.dtype))
    if bias is not None:
        z = z + as_dtype(bias, z.dtype)
    approximate = "tanh" if activation == "gelu_tanh" else "none"
    if z is h:          # h is the caller's
        out = torch.relu(z) if activation == "relu" else F.gelu(z, approximate=approximate)
    else:               # on the fresh sum in place: one (rows, N) tensor less at the peak
        out = torch.relu_(z) if activation == "relu" else torch._C._nn.gelu_(z, approximate=approximate)
    return as_dtype(out, h.dtype)


_gelu_backward = torch.ops.aten.gelu_backward.default
_gelu_backward_into = torch.ops.aten.gelu_backward.grad_input


def _bias_act_bwd_cpu(grad_out, saved, bias, activation):
    _check_activation(activation)
    acc = compute_dtype(saved.dtype)
    dy = as_dtype(grad_out, acc)
    if activation == "relu":
        d_z = torch.where(saved <= 0, 0.0, dy)     # (NaN passes, as in threshold_backward)
    else:
        z = as_dtype(saved, acc)
        if bias is not None:
            z = z + as_dtype(bias, acc)
        # PyTorch's GELU derivative in one op (the kernel's formulas written with tensor ops held
        # four (rows, N) temporaries at once: the training peak of a GELU model on the CPU),
        # into z where z is this function's own (an elementwise op may write over its input).
        approximate = "tanh" if activation == "gelu_tanh" else "none"
        if z is saved:
            d_z = _gelu_backward(dy, z, approximate=approximate)
        else:
            d_z = _gelu_backward_into(dy, z, approximate=approximate, grad_input=z)
    d_bias = (as_dtype(d_z.reshape(-1, saved.shape[-1]).sum(0), saved.dtype) if bias is not None
              else saved.new_empty(0))
    return as_dtype(d_z, saved.dtype), d_bias


def _bias_act_fwd(h, bias, activation):
    """The launcher for h's device: the Triton kernel, or the CPU kernel."""
    if cpu_kernel(h):
        return _bias_act_fwd_cpu(h, bias, activation)
    return _bias_act_fwd_triton(h, bias, activation)


def _bias_act_bwd(grad_out, saved, bias, activation, check=True):
    if cpu_kernel(saved):
        return _bias_act_bwd_cpu(grad_out, saved, bias, activation)
    return _bias_act_bwd_triton(grad_out, saved, bias, activation, check)


def _bias_act_fwd_op(h: torch.Tensor, bias: torch.Tensor | None, activation: str) -> torch.Tensor:
    """act(h + bias); bias may be None."""
    return _bias_act_fwd(h, bias, activation)


def _bias_act_bwd_op(grad_out: torch.Tensor, saved: torch.Tensor, bias: torch.Tensor | None,
                     activation: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(d_h, d_bias) from the forward's output (relu) or input (gelu); d_bias empty if no bias."""
    return _bias_act_bwd(grad_out, saved, bias, activation)


def _saved_for_backward(h, output, activation):
    # ReLU's output says where h + b > 0; the GELUs recompute from their input.
    return output if activation == "relu" else h


def _setup_context(ctx, inputs, output):
    h, bias, activation = inputs
    ctx.save_for_backward(_saved_for_backward(h, output, activation), bias)
    ctx.activation = activation


def _backward(ctx, grad_out):
    saved, bias = ctx.saved_tensors
    d_h, d_bias = bias_act_bwd(grad_out, saved, bias, ctx.activation)
    return d_h, d_bias if bias is not None else None, None


def _register_ops():
    """The registered ops, bias_act_fwd and bias_act_bwd (at first use: deferred_ops)."""
    global bias_act_fwd, bias_act_bwd
    bias_act_fwd = triton_op("bert_fast::bias_act_fwd", mutates_args=())(_bias_act_fwd_op)
    bias_act_bwd = triton_op("bert_fast::bias_act_bwd", mutates_args=())(_bias_act_bwd_op)
    bias_act_fwd.register_autograd(_backward, setup_context=_setup_context)
    forbid_double_backward("bert_fast::bias_act_bwd", "bias_act")


__getattr__ = deferred_ops(__name__, _register_ops, "bias_act_fwd", "bias_act_bwd")


class _BiasAct(torch.autograd.Function):
    """The eager bias_act under autograd: the launchers, no custom-op dispatch."""

    @staticmethod
    def forward(ctx, h, bias, activation):
        out = _bias_act_fwd(h, bias, activation)
        ctx.save_for_backward(_saved_for_backward(h, out, activation), bias)
        ctx.activation = activation
        return out

    @staticmethod
    @once_differentiable("bias_act", "bert_fast::bias_act_bwd")
    def backward(ctx, grad_out):
        saved, bias = ctx.saved_tensors
        d_h, d_bias = _bias_act_bwd(grad_out, saved, bias, ctx.activation, check=False)
        return d_h, d_bias if bias is not None else None, None


def bias_act(h, bias, activation="relu"):
    """``act(h + bias)``: the fused kernel (Triton on CUDA, PyTorch on the CPU); eager calls go
    straight to it (through _BiasAct when autograd records), compiled ones through the op."""
    if use_registered_op():
        return bias_act_fwd(h, bias, activation)
    if records_grad(h, bias):
        return thin_apply(_BiasAct, h, bias, activation)
    return _bias_act_fwd(h, bias, activation)


# Bias + ReLU inside the GEMM (see the module docstring); False: GEMM, then the bias_act kernel.
GEMM_EPILOGUE = True



def _linear_relu_epilogue(x, weight, bias):
    """relu(x @ weight^T + bias) in one GEMM with a fused epilogue, shaped x.shape[:-1] + (N,).

    Written through ``out=`` into a tensor of the final shape: an output that is a view (of the
    2-D GEMM result) could not be edited in place under autograd.
    """
    if x.dim() == 2:
        return torch._addmm_activation(bias, x, weight.t())
    out = torch.empty((*x.shape[:-1], weight.shape[0]), dtype=x.dtype, device=x.device)
    torch._addmm_activation(bias, x.reshape(-1, x.shape[-1]), weight.t(), out=out.view(-1, weight.shape[0]))
    return out


_threshold_backward = torch.ops.aten.threshold_backward.default


def _relu_bwd(grad_out, out, bias):
    """ReLU's backward from its output (out > 0 exactly where the pre-activation is): (d_z as
    rows (-1, N), the bias's gradient, None without ``bias``). On the Triton launchers' tensors
    bias_act's backward kernel masks the gradient and sums the bias's partial rows from the fp32
    values as it goes (then column_sums): d_z is not read again for the bias, 25 MB a layer in a
    BERT-base B32 L128 step. Elsewhere threshold_backward, then a sum over d_z. For backward
    functions only: the inputs are a forward's, not checked again."""
    if cpu_kernel(out):
        d_z, d_bias = _threshold_backward(grad_out, out, 0), None
    else:
        d_z, d_bias = _bias_act_bwd_triton(grad_out, out, bias, "relu", check=False)
    if d_z.dim() != 2:
        d_z = d_z.reshape(-1, out.shape[-1])
    if bias is None:
        return d_z, None
    return d_z, d_z.sum(0) if d_bias is None else d_bias


class _LinearReLU(torch.autograd.Function):
    """relu(x W^T + b) through the GEMM epilogue; the backward masks the gradient with the
    saved output (out > 0 exactly where the pre-activation is) and runs the linear's GEMMs."""

    @staticmethod
    def forward(ctx, x, weight, bias):
        out = _linear_relu_epilogue(x, weight, bias)
        ctx.save_for_backward(x, weight, bias, out)
        return out

    @staticmethod
    @once_differentiable("linear + relu", "aten::_addmm_activation")
    def backward(ctx, grad_out):
        x, weight, bias, out = ctx.saved_tensors
        need_x, need_weight, need_bias = ctx.needs_input_grad
        d_z, d_bias = _relu_bwd(grad_out, out, bias if need_bias else None)
        return ((d_z @ weight).view(x.shape) if need_x else None,
                d_z.t() @ x.reshape(-1, x.shape[-1]) if need_weight else None,
                d_bias)


def linear_act(x, weight, bias, activation="relu", *, backend="torch", gemm_epilogue=None):
    """``act(x @ weight^T + bias)``; see the module docstring for the paths.

    ReLU with a bias runs in the GEMM's epilogue (``gemm_epilogue``, default GEMM_EPILOGUE; on
    backend="torch" only where autograd records nothing; never under autocast, whose cast lists
    hold F.linear but not every device's _addmm_activation). Otherwise backend="torch":
    F.linear, then the activation; other backends: the GEMM without bias, then the fused
    bias_act kernel. Eager calls launch directly (autograd through _LinearReLU / _BiasAct);
    torch.compile sees F.linear and the registered bias_act op.
    """
    _check_activation(activation)
    compiling = use_registered_op()
    epilogue = ((GEMM_EPILOGUE if gemm_epilogue is None else gemm_epilogue) and activation == "relu"
                and bias is not None and not compiling and not autocasting())
    recorded = records_grad(x, weight, bias)
    if epilogue and not recorded:
        # Nothing records this output, so it may be a view of the 2-D GEMM result.
        out = torch._addmm_activation(bias, x.reshape(-1, x.shape[-1]), weight.t())
        return out.view(*x.shape[:-1], weight.shape[0])
    if not uses_triton(backend):
        return _linear_act_torch(x, weight, bias, activation)
    if epilogue:
        return thin_apply(_LinearReLU, x, weight, bias)
    h = F.linear(x, weight)
    if bias is not None and bias.dtype != h.dtype:
        # Under autocast the GEMM's output is in autocast's dtype; F.linear(x, weight, bias)
        # (the reference's Linear) would cast the bias along, and so does this.
        bias = bias.to(h.dtype)
    if compiling:
        return bias_act_fwd(h, bias, activation)
    return bias_act(h, bias, activation)
