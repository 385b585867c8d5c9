"""add_layernorm: post-norm residual ``LayerNorm(residual + dropout(x))`` over the last dim H.

Layouts: ``x`` and ``residual`` are (..., H) with the same shape; the leading dims are
flattened into ``rows``. ``weight``/``bias`` are (H,) or None (no affine). The Triton
launchers need the last dim contiguous (stride 1) and take any row stride; an input whose
last dim is strided (or whose leading dims do not flatten to one stride) is copied with
``.contiguous()`` first. ``mean``/``rstd`` come back as fp32 (rows,) tensors.

Cost model (s = bytes per element, rows x H elements; the op is memory-bound):
  forward   reads x, residual; writes out; writes 8 B/row of statistics  ->  ~3 s bytes/elem.
  backward  reads grad_out, x, residual; writes d_residual (and d_x when dropout is on,
            since then d_x = mask * d_residual / (1-p) differs from d_residual)
            ->  4 s (5 s with dropout) bytes/elem, plus (programs x H) fp32 partial sums.
  Recomputing ``residual + dropout(x)`` in the backward costs the same traffic as saving the
  sum in the forward (write once, read once) and keeps no extra activation alive.
  ~10 FLOPs/elem either way; with dropout, each group of four elements also runs one 10-round
  Philox (``tl.randint4x``, ~80 integer instructions) in both passes. With one call an element
  (until 2026-11-27) that cost as much time as the memory traffic: on an H200
  (2026-11-26T2258-layernorm-tiles.log) the backward took 27.8 µs at 4096x768 with dropout 0.1
  against 13.0 without, on an H100 the forward 19.6 against 6.1 (2026-11-27T0157). The
  extension's CUDA kernels (csrc/philox.h) draw the same four-column groups, since its forward
  and Triton's backward share the mask. Not yet timed on a GPU.

Triton layout: each program normalises ROWS_PER_PROGRAM rows held as one
(ROWS_PER_PROGRAM, BLOCK_H) tile, BLOCK_H = next power of two >= H with the tail masked.
At H = 768 one row is only 1.5 KB in fp16; a tile of several rows keeps more bytes in flight
per program and loads weight/bias once for all of them. Registers bound the tile size (see
_layernorm_blocks); the compiler decides how the warps split the tile. The backward holds
the same tile on half the warps (_layernorm_bwd_blocks: measured 4-5x faster on an H100) and
runs a fixed number of programs (4 per SM) that stride over the row tiles, each accumulating its
d_weight/d_bias contribution in fp32 registers and writing one row of a (programs, H) fp32
buffer; the second stage is ops.column_sums, which sums the buffer's few hundred rows (~1.6 MB
at H = 768 on 132 SMs) and casts the sums to the gradients' dtype in one launch (PyTorch's
``buffer.sum(0)``, then a cast, were two, the reduction at a fraction of the bandwidth).
"""

import torch
from torch.library import triton_op
from torch.nn import functional as F

from .. import extension
from ..extension import require_extension
from ._autograd import (autocasting, below_autograd, deferred_ops, forbid_double_backward, once_differentiable,
                        records_grad, thin_apply, use_registered_op)
from ._philox import check_seed, dropout_seed, interleaved_keep, keep_scale, row_keep
from ._triton import (as_dtype, cdiv, compute_dtype, cpu_kernel, KERNEL_DTYPES, launch, next_power_of_2,
                      nothing_to_launch, reduction_programs, require_triton, rows, tl, triton, uses_triton)
from .column_sums import column_sums

# The whole row lives in registers (one tile row per normalised row).
MAX_HIDDEN = 8192


def _add_layernorm_torch(x, residual, weight, bias, eps, dropout_p, training):
    if dropout_p > 0.0 and training:
        x = F.dropout(x, dropout_p, training=True)
    return F.layer_norm(residual + x, weight.shape if weight is not None else x.shape[-1:],
                        weight, bias, eps)


@triton.jit
def _dropped_sum(x_ptr, residual_ptr, rows64, cols, mask, x_row_stride, residual_row_stride,
                 hidden, dropout_p, keep_scale, seed_ptr, HAS_DROPOUT: tl.constexpr):
    """``residual + dropout(x)`` of a tile in fp32, and the dropout keep mask (the tile mask
    when there is no dropout). Forward and backward both call it, so the backward sees the
    forward's mask: it is keyed on the logical element index, not the memory offset, so it is
    the same whatever the strides of the tensors each pass gets."""
    x = tl.load(x_ptr + rows64 * x_row_stride + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    s = tl.load(residual_ptr + rows64 * residual_row_stride + cols[None, :], mask=mask,
                other=0.0).to(tl.float32)
    keep = mask
    if HAS_DROPOUT:
        keep = _row_keep(seed_ptr, rows64, hidden, dropout_p, ROWS=x.shape[0], BLOCK_H=x.shape[1])
        x = tl.where(keep, x * keep_scale, 0.0)
    return s + x, keep


@triton.jit
def _row_keep(seed_ptr, rows64, hidden, dropout_p, ROWS: tl.constexpr, BLOCK_H: tl.constexpr):
    """The keep mask (ROWS, BLOCK_H) of columns 0..BLOCK_H-1 of ``rows64`` ((ROWS, 1) int64):
    one Philox call a group of four columns (_philox.py's rule), its words interleaved back
    into column order."""
    groups = tl.arange(0, BLOCK_H // 4)
    counter = rows64 * ((hidden + 3) // 4) + groups[None, :]
    w0, w1, w2, w3 = tl.randint4x(tl.load(seed_ptr), counter)
    return interleaved_keep(w0, w1, w2, w3, dropout_p, ROWS, BLOCK_H)


@triton.jit
def _add_layernorm_fwd_kernel(x_ptr, residual_ptr, weight_ptr, bias_ptr, out_ptr, mean_ptr, rstd_ptr,
                              x_row_stride, residual_row_stride, n_rows, hidden, eps,
                              dropout_p, keep_scale, seed_ptr,
                              HAS_WEIGHT: tl.constexpr, HAS_BIAS: tl.constexpr,
                              HAS_DROPOUT: tl.constexpr, BLOCK_H: tl.constexpr,
                              ROWS_PER_PROGRAM: tl.constexpr, STORE_STATS: tl.constexpr = True):
    # fp32 whatever the caller typed them (torch.compile types float arguments fp64).
    eps = tl.cast(eps, tl.float32)
    dropout_p, keep_scale = tl.cast(dropout_p, tl.float32), tl.cast(keep_scale, tl.float32)
    rows = tl.program_id(0) * ROWS_PER_PROGRAM + tl.arange(0, ROWS_PER_PROGRAM)
    cols = tl.arange(0, BLOCK_H)
    row_in = rows < n_rows
    col_in = cols < hidden
    mask = row_in[:, None] & col_in[None, :]
    rows64 = rows.to(tl.int64)[:, None]
    s, _keep = _dropped_sum(x_ptr, residual_ptr, rows64, cols, mask, x_row_stride,
                            residual_row_stride, hidden, dropout_p, keep_scale, seed_ptr, HAS_DROPOUT)
    mean = tl.sum(s, axis=1) / hidden
    centered = tl.where(mask, s - mean[:, None], 0.0)
    rstd = tl.rsqrt(tl.sum(centered * centered, axis=1) / hidden + eps)
    out = centered * rstd[:, None]
    if HAS_WEIGHT:
        out *= tl.load(weight_ptr + cols, mask=col_in, other=0.0).to(tl.float32)[None, :]
    if HAS_BIAS:
        out += tl.load(bias_ptr + cols, mask=col_in, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + rows64 * hidden + cols[None, :], out.to(out_ptr.dtype.element_ty), mask=mask)
    if STORE_STATS:       # the statistics are for the backward: inference needs none
        tl.store(mean_ptr + rows, mean, mask=row_in)
        tl.store(rstd_ptr + rows, rstd, mask=row_in)


@triton.jit
def _add_layernorm_bwd_kernel(grad_out_ptr, x_ptr, residual_ptr, weight_ptr, mean_ptr, rstd_ptr,
                              d_residual_ptr, d_x_ptr, partial_ptr,
                              grad_row_stride, x_row_stride, residual_row_stride, n_rows, hidden,
                              dropout_p, keep_scale, seed_ptr,
                              HAS_WEIGHT: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_X_BIAS: tl.constexpr,
                              HAS_DROPOUT: tl.constexpr, STORE_D_X: tl.constexpr, BLOCK_H: tl.constexpr,
                              ROWS_PER_PROGRAM: tl.constexpr):
    # Column sums of this program's rows go to partial_ptr, (programs, parts, hidden) fp32, in
    # the order d_weight, d_bias, d_x_bias (those asked for): the host reduces them in one sum.
    # d_x_bias is the column sum of d_x, the gradient of a bias added to x before this op (the
    # sublayer's output bias), so that bias needs no pass of its own over d_x. d_x is stored
    # (STORE_D_X) where it differs from d_residual: with dropout, or in x's narrower dtype.
    # fp32 whatever the caller typed them: fp64 (torch.compile's type for a float argument)
    # would make the loop-carried sums fp64, which Triton refuses to compile.
    dropout_p, keep_scale = tl.cast(dropout_p, tl.float32), tl.cast(keep_scale, tl.float32)
    program = tl.program_id(0)
    cols = tl.arange(0, BLOCK_H)
    col_in = cols < hidden
    if HAS_WEIGHT:
        weight = tl.load(weight_ptr + cols, mask=col_in, other=0.0).to(tl.float32)
    d_weight_acc = tl.zeros([BLOCK_H], dtype=tl.float32)
    d_bias_acc = tl.zeros([BLOCK_H], dtype=tl.float32)
    d_x_bias_acc = tl.zeros([BLOCK_H], dtype=tl.float32)
    for first_row in range(program * ROWS_PER_PROGRAM, n_rows, tl.num_programs(0) * ROWS_PER_PROGRAM):
        rows = first_row + tl.arange(0, ROWS_PER_PROGRAM)
        row_in = rows < n_rows
        mask = row_in[:, None] & col_in[None, :]
        rows64 = rows.to(tl.int64)[:, None]
        dy = tl.load(grad_out_ptr + rows64 * grad_row_stride + cols[None, :], mask=mask,
                     other=0.0).to(tl.float32)
        s, keep = _dropped_sum(x_ptr, residual_ptr, rows64, cols, mask, x_row_stride,
                               residual_row_stride, hidden, dropout_p, keep_scale, seed_ptr, HAS_DROPOUT)
        mean = tl.load(mean_ptr + rows, mask=row_in, other=0.0)
        rstd = tl.load(rstd_ptr + rows, mask=row_in, other=0.0)
        x_hat = tl.where(mask, (s - mean[:, None]) * rstd[:, None], 0.0)
        if HAS_WEIGHT:
            d_x_hat = dy * weight[None, :]
            d_weight_acc += tl.sum(dy * x_hat, axis=0)
        else:
            d_x_hat = dy
        if HAS_BIAS:
            d_bias_acc += tl.sum(dy, axis=0)
        # d_sum = rstd * (d_x_hat - mean(d_x_hat) - x_hat * mean(d_x_hat * x_hat)), masked
        # columns contribute zeros to both means.
        mean_d_x_hat = tl.sum(d_x_hat, axis=1) / hidden
        mean_d_x_hat_x_hat = tl.sum(d_x_hat * x_hat, axis=1) / hidden
        d_sum = (d_x_hat - mean_d_x_hat[:, None] - x_hat * mean_d_x_hat_x_hat[:, None]) * rstd[:, None]
        tl.store(d_residual_ptr + rows64 * hidden + cols[None, :],
                 d_sum.to(d_residual_ptr.dtype.element_ty), mask=mask)
        d_x = d_sum
        if HAS_DROPOUT:
            d_x = tl.where(keep, d_sum * keep_scale, 0.0)
        if STORE_D_X:
            tl.store(d_x_ptr + rows64 * hidden + cols[None, :], d_x.to(d_x_ptr.dtype.element_ty), mask=mask)
        if HAS_X_BIAS:
            # fp32 before d_x is rounded to its dtype; padded columns of d_sum are not zero.
            d_x_bias_acc += tl.sum(tl.where(mask, d_x, 0.0), axis=0)
    parts: tl.constexpr = HAS_WEIGHT + HAS_BIAS + HAS_X_BIAS
    if HAS_WEIGHT:
        tl.store(partial_ptr + program * parts * hidden + cols, d_weight_acc, mask=col_in)
    if HAS_BIAS:
        tl.store(partial_ptr + (program * parts + HAS_WEIGHT) * hidden + cols, d_bias_acc, mask=col_in)
    if HAS_X_BIAS:
        tl.store(partial_ptr + (program * parts + HAS_WEIGHT + HAS_BIAS) * hidden + cols, d_x_bias_acc,
                 mask=col_in)


def _layernorm_blocks(hidden):
    """(BLOCK_H, ROWS_PER_PROGRAM, num_warps) for rows of ``hidden`` features.

    Tiles of ~2048 elements at 8 fp32 values per thread. More per thread does not fit: with
    the brief's first idea, a row per warp at H = 768 (4 rows of 1024 on 4 warps, 32 values per
    thread), ptxas (sm_90) gives the backward 255 registers and spills; at 8 values per thread
    it takes ~80 registers and the forward ~50. So at H = 768 a program holds 2 rows on 8 warps,
    small H up to 16 rows, H >= 2048 one row on 8 to 32 warps. At least 16 columns: the dropout
    mask draws groups of four (_row_keep).
    """
    block_h = max(16, next_power_of_2(hidden))
    rows_per_program = max(1, min(16, 2048 // block_h))
    num_warps = max(4, min(32, block_h * rows_per_program // 256))
    return block_h, rows_per_program, num_warps


def _layernorm_bwd_blocks(hidden):
    """(BLOCK_H, ROWS_PER_PROGRAM, num_warps) for the backward: the forward's tile, on half the
    warps (16 fp32 values a thread instead of 8).

    Measured on an H100 (scripts/layernorm_bwd_tiles.py, 2026-11-26, H 768 bf16; the record
    benchmarks/results/nvidia-h100-80gb-hbm3-2026-11-26T1517-layernorm-tiles.log): 2 rows on 4
    warps took 11.3 µs at 4096 rows and 25.0 at 8192 against 59.2 and 132.1 on the forward's 8
    warps (47.4 against 111.4 with dropout), with the same gradients bit for bit; it was the
    fastest of the 7 shapes at every size but 128 rows with dropout (5.1 µs against 4.6).
    """
    block_h, rows_per_program, _ = _layernorm_blocks(hidden)
    return block_h, rows_per_program, max(4, min(32, block_h * rows_per_program // 512))


def _check_dropout_p(dropout_p):
    if not 0.0 <= dropout_p <= 1.0:
        raise ValueError(f"dropout_p must be in [0, 1], got {dropout_p}")


def _check_fwd_inputs(x, residual, weight, bias, seed, dropout_p, triton=True):
    """``triton``: also the Triton kernels' own limits (H, dtypes); the extension's fake kernels
    check the rest (its ops have limits of their own, per device)."""
    if x.dim() < 1 or x.shape[-1] == 0:
        raise ValueError(f"x must have shape (..., H) with H >= 1, got {tuple(x.shape)}")
    hidden = x.shape[-1]
    if triton and hidden > MAX_HIDDEN:
        raise ValueError(f"the Triton add_layernorm supports H <= {MAX_HIDDEN}, got H = {hidden}; "
                         f"use backend='torch'")
    if residual.shape != x.shape:
        raise ValueError(f"residual must have the shape of x {tuple(x.shape)}, got {tuple(residual.shape)}")
    for name, t in (("weight", weight), ("bias", bias)):
        if t is not None and t.shape != (hidden,):
            raise ValueError(f"{name} must have shape ({hidden},) or be None, got {tuple(t.shape)}")
    if triton and x.dtype not in KERNEL_DTYPES:
        raise TypeError(f"the Triton add_layernorm takes float16, bfloat16 or float32, got {x.dtype}")
    for name, t in (("residual", residual), ("weight", weight), ("bias", bias)):
        if t is not None and t.dtype != x.dtype:
            raise TypeError(f"{name} must have the dtype of x ({x.dtype}), got {t.dtype}")
        if t is not None and t.device != x.device:
            raise ValueError(f"{name} must be on the device of x ({x.device}), got {t.device}")
    _check_dropout_p(dropout_p)
    check_seed(seed, dropout_p, x.device)


def _add_layernorm_fwd_triton(x, residual, weight, bias, eps, seed, dropout_p, stats=True, check=True):
    """Triton forward: (out shaped like x, mean (rows,) fp32, rstd (rows,) fp32).
    ``stats=False`` (inference: no backward will read them): mean and rstd are None, neither
    allocated nor stored. ``check=False``: the inputs are made by our own code (the fused
    encoder layer's, whose module checked the user's), so shapes, dtypes and devices hold by
    construction; the checks were ~4 us of host time a call, 24 calls a BERT-base forward.

    Unchecked, x may be in a narrower float dtype than residual, weight and bias (the fused
    layer under autocast: the branch's GEMM output in autocast's dtype, the residual in the
    norm's, fp32): the kernel reads each in its own dtype and sums in fp32, as a cast of x
    would, and out takes the residual's dtype; one cast launch a call fewer."""
    if check:
        _check_fwd_inputs(x, residual, weight, bias, seed, dropout_p)
    require_triton(x, residual, weight, bias)
    hidden = x.shape[-1]
    x2, x_stride, n_rows = rows(x, hidden)
    residual2, residual_stride, _ = rows(residual, hidden)
    # Allocated in x's shape (contiguous: the kernel writes rows of `hidden`), not as a view of
    # a 2-D buffer: autograd forbids in-place edits of an op's output that is a view. In the
    # residual's dtype, x's but for the fused layer's mixed inputs (_layer_forward).
    # empty_like and new_empty: ~1.5 us less host time than torch.empty(x.shape, dtype=..., device=...).
    out = torch.empty_like(residual, memory_format=torch.contiguous_format)
    mean = x.new_empty(n_rows, dtype=torch.float32) if stats else None
    rstd = x.new_empty(n_rows, dtype=torch.float32) if stats else None
    if not nothing_to_launch(n_rows):
        block_h, rows_per_program, num_warps = _layernorm_blocks(hidden)
        launch(_add_layernorm_fwd_kernel, out)[(cdiv(n_rows, rows_per_program),)](
            x2, residual2, weight, bias, out, mean, rstd,
            x_stride, residual_stride, n_rows, hidden, eps,
            dropout_p, keep_scale(dropout_p), seed,
            HAS_WEIGHT=weight is not None, HAS_BIAS=bias is not None, HAS_DROPOUT=dropout_p > 0.0,
            BLOCK_H=block_h, ROWS_PER_PROGRAM=rows_per_program, STORE_STATS=stats, num_warps=num_warps)
    return out, mean, rstd


def _check_bwd_inputs(grad_out, x, residual, weight, mean, rstd, seed, dropout_p, triton=True):
    _check_fwd_inputs(x, residual, weight, None, seed, dropout_p, triton)
    if grad_out.shape != x.shape or grad_out.dtype != x.dtype:
        raise ValueError(f"grad_out must match x: shape {tuple(x.shape)} and dtype {x.dtype}, got "
                         f"{tuple(grad_out.shape)} and {grad_out.dtype}")
    n_rows = x.numel() // x.shape[-1]
    stats_dtype = compute_dtype(x.dtype)
    for name, t in (("mean", mean), ("rstd", rstd)):
        if t.shape != (n_rows,) or t.dtype != stats_dtype:
            raise ValueError(f"{name} must be the forward's {str(stats_dtype).removeprefix('torch.')} "
                             f"({n_rows},) tensor, got {t.dtype} {tuple(t.shape)}")


def _add_layernorm_bwd_triton(grad_out, x, residual, weight, mean, rstd, seed, dropout_p, has_bias,
                              x_bias=False, check=True, defer_sums=False):
    """Triton backward: (d_residual, d_x, d_weight, d_bias), shaped like the forward's inputs,
    and with ``x_bias`` a fifth, d_x's column sum: the gradient of a bias added to x.

    Gradients this call need not compute come back as None (as the CPU kernel's; the registered
    op returns empty tensors): d_x when dropout_p == 0 (it equals d_residual) and x has the
    residual's dtype, d_weight when weight is None, d_bias when not has_bias. The (H,) gradients
    are views of one (parts, H) tensor: one reduction makes them all. With the forward's mixed
    inputs (see _add_layernorm_fwd_triton) d_residual and the sums take the residual's dtype and
    d_x is stored in x's, rounded once from fp32 as a cast of d_residual would be.

    ``check=False``: the inputs are a forward's, checked when it ran, and the forward's output
    gradient (autograd gives it the output's shape and dtype): the backward of our own
    Functions, where the checks were ~13 us of host time a call (a quarter of the launcher's).

    ``defer_sums``: (d_residual, d_x, partials) instead, the column sums left as the kernel's
    (programs, parts, H) fp32 partial rows (None without parts), for the caller to sum with
    other kernels' in one launch (column_sums.joint_column_sums).
    """
    if check:
        _check_bwd_inputs(grad_out, x, residual, weight, mean, rstd, seed, dropout_p)
        require_triton(grad_out, x, residual, weight, mean, rstd)
    hidden = x.shape[-1]
    grad2, grad_stride, n_rows = rows(grad_out, hidden)
    x2, x_stride, _ = rows(x, hidden)
    residual2, residual_stride, _ = rows(residual, hidden)
    has_dropout = dropout_p > 0.0
    block_h, rows_per_program, num_warps = _layernorm_bwd_blocks(hidden)
    programs = reduction_programs(x.device, cdiv(n_rows, rows_per_program))
    d_residual = torch.empty_like(residual, memory_format=torch.contiguous_format)
    store_d_x = has_dropout or x.dtype != residual.dtype
    d_x = torch.empty_like(x, memory_format=torch.contiguous_format) if store_d_x else None
    has_weight = weight is not None
    parts = has_weight + has_bias + x_bias
    # Programs without rows still store their (zero) partial rows, so it needs no zeroing.
    partials = x.new_empty(programs, parts, hidden, dtype=torch.float32) if parts else None
    empty = nothing_to_launch(n_rows)
    if not empty:
        launch(_add_layernorm_bwd_kernel, d_residual)[(programs,)](
            grad2, x2, residual2, weight, mean, rstd, d_residual, d_x, partials,
            grad_stride, x_stride, residual_stride, n_rows, hidden,
            dropout_p, keep_scale(dropout_p), seed,
            HAS_WEIGHT=has_weight, HAS_BIAS=has_bias, HAS_X_BIAS=x_bias, HAS_DROPOUT=has_dropout,
            STORE_D_X=store_d_x, BLOCK_H=block_h, ROWS_PER_PROGRAM=rows_per_program, num_warps=num_warps)
    if defer_sums:
        return d_residual, d_x, partials.zero_() if empty and parts else partials
    if parts:
        sums = (torch.zeros((parts, hidden), dtype=residual.dtype, device=x.device) if empty
                else column_sums(partials, residual.dtype))
        sums = iter(sums.unbind(0))
    grads = (d_residual, d_x, next(sums) if has_weight else None, next(sums) if has_bias else None)
    return grads + (next(sums),) if x_bias else grads


def _dropout_keep_scale_cpu(x, seed, dropout_p, dtype):
    """The CPU twins' dropout as a factor (0 or 1/(1-p)) for ``x`` of shape (..., H): the
    kernels' mask over the flattened rows (_philox.row_keep: four columns a Philox call)."""
    hidden = x.shape[-1]
    keep = row_keep(seed, dropout_p, x.numel() // hidden if hidden else 0, hidden, x.device)
    return keep.view(x.shape).to(dtype) * keep_scale(dropout_p)


def _dropped_sum_cpu(x, residual, seed, dropout_p, acc):
    """``residual + dropout(x)`` in the statistics dtype, and the dropout factor (or None)."""
    keep_scale = _dropout_keep_scale_cpu(x, seed, dropout_p, acc) if dropout_p > 0.0 else None
    x = as_dtype(x, acc)
    return as_dtype(residual, acc) + (x if keep_scale is None else x * keep_scale), keep_scale


def _add_layernorm_fwd_cpu(x, residual, weight, bias, eps, seed, dropout_p):
    """The CPU kernel: one ``native_layer_norm`` over the fp32 (fp64) sum, as the Triton
    kernel's math (statistics in fp32, output rounded once). Its output is a fresh contiguous
    tensor of x's shape (never a view, see the Triton launcher); its statistics keep
    native_layer_norm's (..., 1) shape (the registered op flattens them)."""
    acc = compute_dtype(x.dtype)
    if dropout_p == 0.0 and x.dtype == acc:     # the common case, in as few calls as possible
        return torch.native_layer_norm(residual + x, x.shape[-1:], weight, bias, eps)
    _check_dropout_p(dropout_p)
    check_seed(seed, dropout_p, x.device)
    s, _ = _dropped_sum_cpu(x, residual, seed, dropout_p, acc)
    out, mean, rstd = torch.native_layer_norm(s, x.shape[-1:], as_dtype(weight, acc), as_dtype(bias, acc), eps)
    return as_dtype(out, x.dtype), mean, rstd


_native_layer_norm_backward = torch.ops.aten.native_layer_norm_backward.default


def _add_layernorm_bwd_cpu(grad_out, x, residual, weight, mean, rstd, seed, dropout_p, has_bias):
    """(d_residual, d_x, d_weight, d_bias), None for those not computed (the registered op
    returns empty tensors instead). Statistics of either shape: (rows,) or (..., 1)."""
    acc, hidden = mean.dtype, x.shape[-1]
    fast = dropout_p == 0.0 and x.dtype == acc       # the common case, in as few calls as possible
    if fast:
        s, keep_scale = residual + x, None
    else:
        _check_dropout_p(dropout_p)
        check_seed(seed, dropout_p, x.device)
        s, keep_scale = _dropped_sum_cpu(x, residual, seed, dropout_p, acc)
        grad_out, weight = as_dtype(grad_out, acc), as_dtype(weight, acc)
    if mean.dim() != s.dim():
        stats_shape = s.shape[:-1] + (1,)
        mean, rstd = mean.view(stats_shape), rstd.view(stats_shape)
    # With a weight, d_bias comes out of the same call: it only needs *a* bias of its shape.
    bias_stand_in = weight if has_bias else None
    d_sum, d_weight, d_bias = _native_layer_norm_backward(
        grad_out, s, (hidden,), mean, rstd, weight, bias_stand_in,
        [True, weight is not None, bias_stand_in is not None])
    if has_bias and bias_stand_in is None:
        d_bias = grad_out.reshape(-1, hidden).sum(0)
    if fast:
        return d_sum, None, d_weight, d_bias
    return (as_dtype(d_sum, x.dtype), as_dtype(d_sum * keep_scale, x.dtype) if keep_scale is not None else None,
            as_dtype(d_weight, x.dtype), as_dtype(d_bias, x.dtype))


def _add_layernorm_fwd(x, residual, weight, bias, eps, seed, dropout_p, stats=True):
    """The launcher for the inputs' device: the Triton kernel, or the CPU kernel (which makes
    the statistics whatever ``stats`` says: native_layer_norm does)."""
    if cpu_kernel(x):
        return _add_layernorm_fwd_cpu(x, residual, weight, bias, eps, seed, dropout_p)
    return _add_layernorm_fwd_triton(x, residual, weight, bias, eps, seed, dropout_p, stats)


def _add_layernorm_bwd(grad_out, x, residual, weight, mean, rstd, seed, dropout_p, has_bias, x_bias=False,
                       check=True):
    """The launcher for the inputs' device; ``x_bias``: also d_x's column sum (a fifth output,
    see _add_layernorm_bwd_triton), which the CPU kernel sums separately; ``check``: see there."""
    if cpu_kernel(x):
        grads = _add_layernorm_bwd_cpu(grad_out, x, residual, weight, mean, rstd, seed, dropout_p, has_bias)
        if not x_bias:
            return grads
        d_x = grads[1] if dropout_p > 0.0 else grads[0]
        return grads + (d_x.sum(tuple(range(d_x.dim() - 1))),)
    return _add_layernorm_bwd_triton(grad_out, x, residual, weight, mean, rstd, seed, dropout_p, has_bias, x_bias,
                                     check)


def _saved_bwd(grad_out, x, residual, weight, mean, rstd, seed, dropout_p, has_bias, x_bias=False):
    """_add_layernorm_bwd on a forward's saved tensors, checked when the forward ran."""
    return _add_layernorm_bwd(grad_out, x, residual, weight, mean, rstd, seed, dropout_p, has_bias, x_bias, False)


def _add_layernorm_fwd_op(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor | None,
                          bias: torch.Tensor | None, eps: float, seed: torch.Tensor | None,
                          dropout_p: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(LayerNorm(residual + dropout(x)), mean, rstd); dropout_p = 0 turns dropout off."""
    out, mean, rstd = _add_layernorm_fwd(x, residual, weight, bias, eps, seed, dropout_p)
    return out, mean.reshape(-1), rstd.reshape(-1)      # the CPU kernel's are (..., 1)


def _add_layernorm_bwd_op(grad_out: torch.Tensor, x: torch.Tensor, residual: torch.Tensor,
                          weight: torch.Tensor | None, mean: torch.Tensor, rstd: torch.Tensor,
                          seed: torch.Tensor | None,
                          dropout_p: float, has_bias: bool
                          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(d_residual, d_x, d_weight, d_bias); see _add_layernorm_bwd_triton for the empty ones."""
    d_residual, d_x, d_weight, d_bias = _add_layernorm_bwd(grad_out, x, residual, weight, mean, rstd, seed,
                                                           dropout_p, has_bias)
    if d_weight is not None and d_bias is not None:
        # The Triton launcher's are views of one tensor, and a custom op's outputs may not
        # alias (below autograd a view has no _base to tell): this path is torch.compile's.
        d_bias = d_bias.clone()
    # Gradients not computed: the CPU kernel's None, an empty tensor each in the schema.
    return tuple(x.new_empty(0) if g is None else g for g in (d_residual, d_x, d_weight, d_bias))


def _setup_context(ctx, inputs, output):
    x, residual, weight, bias, _eps, seed, dropout_p = inputs
    _out, mean, rstd = output
    ctx.save_for_backward(x, residual, weight, mean, rstd, seed)
    ctx.dropout_p, ctx.has_bias = dropout_p, bias is not None
    ctx.mark_non_differentiable(mean, rstd)


def _input_grads(ctx, saved, backward_op, grad_out):
    """(d_x, d_residual, d_weight, d_bias) of the forward's inputs, None where not differentiable."""
    x, residual, weight, mean, rstd, seed = saved
    d_residual, d_x, d_weight, d_bias = backward_op(
        grad_out, x, residual, weight, mean, rstd, seed, ctx.dropout_p, ctx.has_bias)
    return (d_x if ctx.dropout_p > 0.0 else d_residual, d_residual,
            d_weight if weight is not None else None, d_bias if ctx.has_bias else None)


def _backward(ctx, grad_out, _grad_mean, _grad_rstd, backward_op=None):
    return _input_grads(ctx, ctx.saved_tensors, backward_op or add_layernorm_bwd, grad_out) + (None,) * 3


def _register_ops():
    """The registered ops, add_layernorm_fwd and add_layernorm_bwd (at first use: deferred_ops)."""
    global add_layernorm_fwd, add_layernorm_bwd
    add_layernorm_fwd = triton_op("bert_fast::add_layernorm_fwd", mutates_args=())(_add_layernorm_fwd_op)
    add_layernorm_bwd = triton_op("bert_fast::add_layernorm_bwd", mutates_args=())(_add_layernorm_bwd_op)
    add_layernorm_fwd.register_autograd(_backward, setup_context=_setup_context)
    forbid_double_backward("bert_fast::add_layernorm_bwd", "add_layernorm")


__getattr__ = deferred_ops(__name__, _register_ops, "add_layernorm_fwd", "add_layernorm_bwd")


# ----------------------------------------------------------------------------------------------
# The compiled extension's op (backend="cuda"; csrc/add_layernorm_cpu.cpp, csrc/add_layernorm.cu):
# its schema is in csrc/registration.cpp, its fake kernels and autograd here. Same arguments
# and outputs as the Triton op, so the autograd glue above serves both.
# ----------------------------------------------------------------------------------------------

# The fake kernels check what the ops check (but their per-device limits): they also answer
# the Meta dispatch key, which outranks CPU and CUDA, so a call with one tensor left on "meta"
# (a model not fully materialised) reaches them instead of the op's checks.

def _ext_fwd_fake(x, residual, weight, bias, eps, seed, dropout_p):
    _check_fwd_inputs(x, residual, weight, bias, seed, dropout_p, triton=False)
    rows = x.numel() // x.shape[-1]
    stats_dtype = compute_dtype(x.dtype)
    return (x.new_empty(x.shape), x.new_empty(rows, dtype=stats_dtype), x.new_empty(rows, dtype=stats_dtype))


def _ext_bwd_fake(grad_out, x, residual, weight, mean, rstd, seed, dropout_p, has_bias):
    _check_bwd_inputs(grad_out, x, residual, weight, mean, rstd, seed, dropout_p, triton=False)
    hidden = x.shape[-1]
    # Gradients not computed come back as (distinct) empty tensors.
    return (x.new_empty(x.shape), x.new_empty(x.shape if dropout_p > 0.0 else 0),
            x.new_empty(hidden if weight is not None else 0), x.new_empty(hidden if has_bias else 0))


def _ext_backward(ctx, grad_out, _grad_mean, _grad_rstd):
    return _backward(ctx, grad_out, _grad_mean, _grad_rstd, torch.ops.bert_fast.ext_add_layernorm_bwd)


def register_extension_ops():
    """Fake kernels and autograd of the extension's op; bert_fast.extension calls this once."""
    torch.library.register_fake("bert_fast::ext_add_layernorm_fwd", _ext_fwd_fake)
    torch.library.register_fake("bert_fast::ext_add_layernorm_bwd", _ext_bwd_fake)
    torch.library.register_autograd("bert_fast::ext_add_layernorm_fwd", _ext_backward,
                                    setup_context=_setup_context)
    forbid_double_backward("bert_fast::ext_add_layernorm_bwd", "add_layernorm")


def _ext_fwd(*args):
    return below_autograd(extension.OP_ENTRIES["ext_add_layernorm_fwd"], *args)


def _ext_bwd(*args):
    return below_autograd(extension.OP_ENTRIES["ext_add_layernorm_bwd"], *args)


class _AddLayerNorm(torch.autograd.Function):
    """The eager path under autograd: the forward and backward launchers (Triton or CPU kernel,
    or with ``extension`` the compiled extension's), no custom-op dispatch."""

    @staticmethod
    def forward(ctx, extension, x, residual, weight, bias, eps, seed, dropout_p):
        forward_op = _ext_fwd if extension else _add_layernorm_fwd
        out, mean, rstd = forward_op(x, residual, weight, bias, eps, seed, dropout_p)
        # The statistics saved, not kept on ctx: ctx lives as long as the graph (a loss still
        # referenced in the next step's forward), saved tensors only until the backward.
        ctx.save_for_backward(x, residual, weight, mean, rstd)
        ctx.seed = seed
        ctx.extension, ctx.dropout_p, ctx.has_bias = extension, dropout_p, bias is not None
        return out

    @staticmethod
    @once_differentiable("add_layernorm", "bert_fast::add_layernorm_bwd")
    def backward(ctx, grad_out):
        backward_op = _ext_bwd if ctx.extension else _saved_bwd
        return (None, *_input_grads(ctx, (*ctx.saved_tensors, ctx.seed), backward_op, grad_out), None, None, None)


def autocast_norm_dtype(x, residual):
    """The dtype of the reference's LayerNorm(x + residual) under autocast (x: the sublayer's
    output, in autocast's dtype): fp32 on CUDA, where LayerNorm is one of autocast's fp32 ops;
    on the CPU, whose autocast leaves LayerNorm alone, the sum's dtype (fp32 for an fp32
    residual, as the encoder's embedding gives; bf16 for a block fed bf16)."""
    return torch.float32 if x.is_cuda else torch.promote_types(x.dtype, residual.dtype)


def add_layernorm(x, residual, weight, bias, eps=1e-5, dropout_p=0.0, training=False, *,
                  backend="torch"):
    """``LayerNorm(residual + dropout(x))`` over the last dim; weight/bias may be None.

    backend="torch": F.dropout + F.layer_norm. backend="triton": the fused kernel (Triton on
    CUDA, one native_layer_norm over the fp32 sum on the CPU). backend="cuda": the compiled
    extension's kernels (CUDA, or C++ on the CPU). Eager calls go straight to the launchers
    (through _AddLayerNorm when autograd records); under torch.compile the registered ops. The
    triton and cuda backends draw the same dropout mask (see _philox.py) from a seed drawn on
    the inputs' device, so ``torch.manual_seed`` makes a run repeatable; no seed is drawn
    without dropout.
    """
    if not uses_triton(backend):
        return _add_layernorm_torch(x, residual, weight, bias, eps, dropout_p, training)
    if autocasting():
        norm_dtype = autocast_norm_dtype(x, residual)
        x, residual, weight, bias = (as_dtype(t, norm_dtype) for t in (x, residual, weight, bias))
    if training and dropout_p > 0.0:
        dropout_p = float(dropout_p)
        seed = dropout_seed(dropout_p, x.device)
    else:
        dropout_p, seed = 0.0, None
    extension = backend == "cuda"
    if extension:
        require_extension(x)
    if use_registered_op():
        forward = torch.ops.bert_fast.ext_add_layernorm_fwd if extension else add_layernorm_fwd
        return forward(x, residual, weight, bias, float(eps), seed, dropout_p)[0]
    if records_grad(x, residual, weight, bias):
        return thin_apply(_AddLayerNorm, extension, x, residual, weight, bias, eps, seed, dropout_p)
    if extension:
        return _ext_fwd(x, residual, weight, bias, float(eps), seed, dropout_p)[0]
    return _add_layernorm_fwd(x, residual, weight, bias, eps, seed, dropout_p, False)[0]
