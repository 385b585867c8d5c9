"""column_sums: the second stage of the Triton backward kernels that reduce over rows.

Such a kernel (add_layernorm's backward for d_weight, d_bias and the branch's bias, bias_act's
for d_bias) runs a few programs per SM (_triton.reduction_programs); each sums its rows' columns
in fp32 registers and stores one row of a (programs, ...) fp32 buffer. This op sums that buffer
over its rows and casts the sums to the gradient's dtype, in one launch; joint_column_sums does
the same for up to three such buffers in one launch (the fused encoder layer's backward). No
autograd: it is called inside the backward launchers, and traced with them under torch.compile.
"""

import torch

from ._triton import cdiv, launch, tl, triton


@triton.jit
def _sum_rows(partial_ptr, n_rows, n_cols, cols, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    """The sums over a (n_rows, n_cols) buffer's rows of its columns ``cols``, BLOCK_R rows a
    step, in a fixed order (the same sums for the same partials on every run)."""
    col_in = cols < n_cols
    acc = tl.zeros([BLOCK_R, BLOCK_C], dtype=tl.float32)
    for first_row in range(0, n_rows, BLOCK_R):
        rows = first_row + tl.arange(0, BLOCK_R)
        mask = (rows < n_rows)[:, None] & col_in[None, :]
        acc += tl.load(partial_ptr + rows.to(tl.int64)[:, None] * n_cols + cols[None, :], mask=mask, other=0.0)
    return tl.sum(acc, axis=0)


# The sizes are not specialised: Triton's divisibility-by-16 specialisation follows the call's
# arguments, so a buffer's sums on its own could take another load layout, and another order of
# summing, than the same buffer's in a joint call (seen on an H200, fp32: the fused layer's and
# the per-op path's gradients must agree bitwise). Each program instead picks its layout from its
# own buffer's width, at run time: 16-byte loads where the width is a multiple of 4 (every BERT
# width), one float a load elsewhere. Unspecialised, the loads were scalar everywhere and the
# joint sums of a BERT-base layer took 11.9 us on an H100 (L2-warm, 29.6 in a training step), the
# specialised kernel's 16-byte loads 4.9 us (2026-11-28, scripts/column_sums_tiles.py).
@triton.jit(do_not_specialize=["a_rows", "b_rows", "c_rows", "a_cols", "b_cols", "c_cols"])
def _column_sums_kernel(out_ptr, a_ptr, b_ptr, c_ptr, a_rows, b_rows, c_rows, a_cols, b_cols, c_cols,
                        BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    # Up to three contiguous fp32 (rows, cols) buffers a, b, c (one left out has 0 columns); their
    # column sums go to out side by side: a's, then b's, then c's. A program sums BLOCK_C columns
    # of one buffer over every row.
    program = tl.program_id(0)
    b_first = tl.cdiv(a_cols, BLOCK_C)          # the first program of b's columns, then of c's
    c_first = b_first + tl.cdiv(b_cols, BLOCK_C)
    in_b, in_c = program >= b_first, program >= c_first
    partial_ptr = tl.where(in_c, c_ptr, tl.where(in_b, b_ptr, a_ptr))
    n_rows = tl.where(in_c, c_rows, tl.where(in_b, b_rows, a_rows))
    n_cols = tl.where(in_c, c_cols, tl.where(in_b, b_cols, a_cols))
    out_ptr += tl.where(in_c, a_cols + b_cols, tl.where(in_b, a_cols, 0))
    cols = (program - tl.where(in_c, c_first, tl.where(in_b, b_first, 0))) * BLOCK_C + tl.arange(0, BLOCK_C)
    if n_cols % 4 == 0:
        # (n_cols // 4) * 4 is n_cols, written so that the compiler knows it a multiple of 4
        # (rows start 16 bytes apart): a hint on n_cols itself would reach the other branch too.
        sums = _sum_rows(partial_ptr, n_rows, (n_cols // 4) * 4, cols, BLOCK_R, BLOCK_C)
    else:
        sums = _sum_rows(partial_ptr, n_rows, n_cols, cols, BLOCK_R, BLOCK_C)
    tl.store(out_ptr + cols, sums.to(out_ptr.dtype.element_ty), mask=cols < n_cols)


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
    _launch(out, (partials,))
    return out


def joint_column_sums(partials, dtype):
    """column_sums of up to three buffers in one launch: a flat tensor in ``dtype`` holding each
    buffer's sums (flattened) in turn, for the caller to split. The buffers may have different
    numbers of rows. The fused encoder layer's backward sums its two add-norms' and its FFN
    bias's partial rows this way: one launch a layer where each kernel's own were three."""
    if not 1 <= len(partials) <= 3:
        raise ValueError(f"joint_column_sums takes one to three buffers, got {len(partials)}")
    out = torch.empty(sum(p.numel() // p.shape[0] for p in partials), dtype=dtype, device=partials[0].device)
    _launch(out, partials)
    return out


def _launch(out, partials):
    block_c = _COLUMN_SUMS_BLOCKS["BLOCK_C"]
    rows = [p.shape[0] for p in partials]
    cols = [p.numel() // n for p, n in zip(partials, rows)]
    programs = sum(cdiv(n, block_c) for n in cols)
    missing = 3 - len(partials)            # left out: no columns (the first buffer's pointer stands in)
    launch(_column_sums_kernel, out)[(programs,)](
        out, *partials, *(partials[0],) * missing, *rows, *(0,) * missing, *cols, *(0,) * missing,
        **_COLUMN_SUMS_BLOCKS)
