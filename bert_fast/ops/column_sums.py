"""column_sums: the second stage of the Triton backward kernels that reduce over rows.

Such a kernel (add_layernorm's backward for d_weight, d_bias and the branch's bias, bias_act's
for d_bias) runs a few programs per SM (_triton.reduction_programs); each sums its rows' columns
in fp32 registers and stores one row of a (programs, ...) fp32 buffer. This op sums that buffer
over its rows and casts the sums to the gradient's dtype, in one launch. No autograd: it is
called inside the backward launchers, and traced with them under torch.compile.
"""

import torch

from ._triton import cdiv, launch, tl, triton


@triton.jit
def _column_sums_kernel(partial_ptr, out_ptr, n_rows, n_cols, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    # A program sums BLOCK_C columns over every row, BLOCK_R rows a step, in a fixed order
    # (the same sums for the same partials on every run).
    cols = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
    col_in = cols < n_cols
    acc = tl.zeros([BLOCK_R, BLOCK_C], dtype=tl.float32)
    for first_row in range(0, n_rows, BLOCK_R):
        rows = first_row + tl.arange(0, BLOCK_R)
        mask = (rows < n_rows)[:, None] & col_in[None, :]
        acc += tl.load(partial_ptr + rows.to(tl.int64)[:, None] * n_cols + cols[None, :], mask=mask, other=0.0)
    tl.store(out_ptr + cols, tl.sum(acc, axis=0).to(out_ptr.dtype.element_ty), mask=col_in)


# 16 columns (64 B of each fp32 row) a program: N = 768..3072 columns make 48..192 programs,
# each with few steps over the few hundred partial rows.
_COLUMN_SUMS_BLOCKS = dict(BLOCK_R=128, BLOCK_C=16, num_warps=4)


def column_sums(partials, dtype):
    """The sum over dim 0 of contiguous fp32 ``partials`` (programs, ...), shaped
    ``partials.shape[1:]``, in ``dtype``, in one launch. ``partials.sum(0).to(dtype)`` is two,
    and PyTorch's reduction of the extension's partial rows (a few hundred, by 768) took 11 us a
    call on an H100 (a B32 L128 training step's profile, 2026-11-26), a small fraction of the
    bandwidth: too few outputs to spread over the GPU.
    """
    out = torch.empty(partials.shape[1:], dtype=dtype, device=partials.device)
    n_cols = out.numel()
    launch(_column_sums_kernel, out)[(cdiv(n_cols, _COLUMN_SUMS_BLOCKS["BLOCK_C"]),)](
        partials, out, partials.shape[0], n_cols, **_COLUMN_SUMS_BLOCKS)
    return out
