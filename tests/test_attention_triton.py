"""The Triton attention op: kernels (interpreter on CPU, native on CUDA), CPU twins, registration.

References: the book's math (``reference.sequence_mask`` + softmax) in fp64 on the packed
projection, and the torch path (``backend="torch"``) at the kernel's precision for the error
baseline of the STYLE.md rule.
"""

import importlib
import math

import pytest
import torch
from torch.nn import functional as F

from bert_fast import ops
from bert_fast import reference as R
from bert_fast.ops.attention import (_attention_bwd_triton, _attention_dropout_keep_cpu, _attention_dropout_keep_triton,
                                     _attention_fwd_triton, _attention_tiles, _varlen_attention_bwd_cpu,
                                     _varlen_attention_bwd_triton, _varlen_attention_fwd_cpu,
                                     _varlen_attention_fwd_triton, attention_bwd, attention_fwd,
                                     varlen_attention_bwd, varlen_attention_fwd)
from tests.helpers import (DEVICE, FLOOR, assert_close, assert_same_computation, max_err, needs_cuda,
                           needs_kernels, seed_tensor)

FP32_EPS = torch.finfo(torch.float32).eps


def reference(qkv, num_heads, valid_lens=None, keep=None, dropout_p=0.0):
    """The book's attention on a packed (B, L, 3H) projection, in qkv's dtype.

    Returns (context (B, L, H), LSE (B, heads, L)); ``keep`` (B, heads, L, L) applies dropout.
    """
    batch, seqlen, _ = qkv.shape
    q, k, v = (R.transpose_qkv(x, num_heads) for x in qkv.chunk(3, dim=-1))
    scores = torch.bmm(q, k.transpose(1, 2)) / math.sqrt(q.shape[-1])
    if valid_lens is not None:       # what masked_softmax does, keeping the masked scores for the LSE
        lengths = torch.repeat_interleave(valid_lens.to(qkv.device), num_heads, dim=0)
        lengths = torch.repeat_interleave(lengths, seqlen) if lengths.dim() == 1 else lengths.reshape(-1)
        scores = R.sequence_mask(scores.reshape(-1, seqlen), lengths, R.MASK_VALUE).reshape(scores.shape)
    weights = F.softmax(scores, dim=-1)
    if keep is not None:
        weights = weights * keep.flatten(0, 1).to(weights.dtype) / (1.0 - dropout_p)
    out = R.transpose_output(torch.bmm(weights, v), num_heads)
    return out, torch.logsumexp(scores, dim=-1).unflatten(0, (batch, num_heads))


def reference_with_grad(qkv, grad_out, num_heads, valid_lens=None, keep=None, dropout_p=0.0, dtype=torch.float64):
    """Reference context, LSE and d(qkv) computed in ``dtype``."""
    x = qkv.detach().to(dtype).requires_grad_()
    out, lse = reference(x, num_heads, valid_lens, keep, dropout_p)
    (dqkv,) = torch.autograd.grad(out, x, grad_out.to(dtype))
    return out, lse, dqkv


def assert_rule(actual, expected, baseline, dtype, what):
    """STYLE.md: error vs the fp64 reference <= 2x the error of PyTorch at ``dtype`` + floor."""
    err, base = max_err(actual, expected), max_err(baseline, expected)
    bound = 2 * base + FLOOR[dtype]
    assert err <= bound, f"{what}: max error {err:.3g} > {bound:.3g} (PyTorch {dtype} error {base:.3g})"


def assert_lse(actual, expected, what="lse"):
    """LSE to fp32 accuracy relative to its size: a row that sees no key has LSE -1e6 + log L,
    and the kernels' masked score is the fp32 number nearest to -1e6 * log2(e)."""
    assert actual.dtype == torch.float64, f"{what}: dtype {actual.dtype}"
    bound = FLOOR[torch.float32] + 2 * FP32_EPS * expected.double().abs()
    excess = (actual.double() - expected.double()).abs() - bound
    assert excess.max() <= 0, f"{what}: max error {max_err(actual, expected):.3g}, exceeds bound by {excess.max():.3g}"


def random_qkv(batch, seqlen, num_heads, head_dim, dtype=torch.float32, device=DEVICE):
    return torch.randn(batch, seqlen, 3 * num_heads * head_dim, dtype=dtype, device=device)


VALID_LENS_CASES = {
    "none": None,
    "int": torch.tensor([13, 20]),
    "float": torch.tensor([4.0, 16.0]),
    "fractional": torch.tensor([2.5, 19.01]),
    "zero": torch.tensor([0, 0]),
    "negative": torch.tensor([-3.0, 7.0]),
    "beyond_L": torch.tensor([21, 1000]),
    "2d_int": torch.randint(-2, 24, (2, 20), generator=torch.Generator().manual_seed(1)),
    "2d_fractional": torch.rand(2, 20, generator=torch.Generator().manual_seed(2), dtype=torch.float64) * 24 - 2,
}


# ----------------------------------------------------------------------------------------------
# Kernels vs the reference (interpreter on CPU; the same tests run natively on CUDA)
# ----------------------------------------------------------------------------------------------

@needs_kernels
@pytest.mark.parametrize("case", list(VALID_LENS_CASES))
def test_forward_and_backward_match_reference(case):
    valid_lens = VALID_LENS_CASES[case]
    valid_lens = None if valid_lens is None else valid_lens.to(DEVICE)
    qkv = random_qkv(2, 20, 2, 16)                       # L = 20 crosses the interpreter's 16-blocks
    grad_out = torch.randn(2, 20, 32, device=DEVICE)
    out, lse = _attention_fwd_triton(qkv, valid_lens, 2, 0.0, None)
    dqkv = _attention_bwd_triton(grad_out, qkv, out, lse, valid_lens, 2, 0.0, None)
    out64, lse64, dqkv64 = reference_with_grad(qkv, grad_out, 2, valid_lens)
    out32, _, dqkv32 = reference_with_grad(qkv, grad_out, 2, valid_lens, dtype=torch.float32)
    assert out.dtype == qkv.dtype and out.shape == (2, 20, 32) and lse.shape == (2, 2, 20)
    assert_rule(out, out64, out32, torch.float32, "context")
    assert_lse(lse, lse64)
    assert dqkv.shape == qkv.shape
    assert_rule(dqkv, dqkv64, dqkv32, torch.float32, "dqkv")


@needs_kernels
def test_row_that_sees_no_key_is_uniform_and_only_feeds_dv():
    # Sequence 0 sees nothing (uniform over all 17 keys, across two key blocks); sequence 1 is normal.
    qkv = random_qkv(2, 17, 1, 16)
    valid_lens = torch.tensor([0.0, 5.0], device=DEVICE)
    out, lse = _attention_fwd_triton(qkv, valid_lens, 1, 0.0, None)
    v = qkv[0, :, 32:]
    assert_close(out[0], v.mean(0).expand(17, 16), atol=1e-5, what="uniform row")
    grad_out = torch.randn(2, 17, 16, device=DEVICE)
    dqkv = _attention_bwd_triton(grad_out, qkv, out, lse, valid_lens, 1, 0.0, None)
    assert torch.count_nonzero(dqkv[0, :, :32]) == 0, "dQ and dK of a row that sees no key must be zero"
    assert_close(dqkv[0, :, 32:], (grad_out[0].sum(0) / 17).expand(17, 16), atol=1e-5, what="dV of uniform rows")


@needs_kernels
@pytest.mark.parametrize("batch, seqlen, num_heads, head_dim, valid_lens", [
    (1, 17, 1, 80, [11.0]),          # head dim not a power of two, L not a multiple of the block
    (1, 1, 2, 32, None),             # one token
    (3, 5, 2, 96, [[1, 0, 5, 2, 9], [3, 3, 3, 3, 3], [-1, 2, 2, 2, 4]]),
], ids=["d80-L17", "L1", "d96-2d"])
def test_odd_shapes(batch, seqlen, num_heads, head_dim, valid_lens):
    valid_lens = None if valid_lens is None else torch.tensor(valid_lens, device=DEVICE)
    qkv = random_qkv(batch, seqlen, num_heads, head_dim)
    grad_out = torch.randn(batch, seqlen, num_heads * head_dim, device=DEVICE)
    out, lse = _attention_fwd_triton(qkv, valid_lens, num_heads, 0.0, None)
    dqkv = _attention_bwd_triton(grad_out, qkv, out, lse, valid_lens, num_heads, 0.0, None)
    out64, lse64, dqkv64 = reference_with_grad(qkv, grad_out, num_heads, valid_lens)
    out32, _, dqkv32 = reference_with_grad(qkv, grad_out, num_heads, valid_lens, dtype=torch.float32)
    assert_rule(out, out64, out32, torch.float32, "context")
    assert_lse(lse, lse64)
    assert_rule(dqkv, dqkv64, dqkv32, torch.float32, "dqkv")


@needs_kernels
@pytest.mark.parametrize("row_offset_limit", [2**31, 64], ids=["read-strided", "copied"])
def test_strided_inputs(row_offset_limit, monkeypatch):
    # qkv as a (L, B, 3H + 8) buffer seen as (B, L, 3H); grad_out expanded (stride 0 over rows).
    # "copied": rows this far apart would overflow the kernels' int32 row offsets (2**31
    # elements; here lowered to 64), so the launchers read a contiguous copy.
    monkeypatch.setattr(ATTENTION, "_ROW_OFFSET_LIMIT", row_offset_limit)
    buffer = torch.randn(18, 2, 3 * 2 * 16 + 8, device=DEVICE)
    qkv = buffer.transpose(0, 1)[..., 8:]
    grad_out = torch.randn(2, 1, 32, device=DEVICE).expand(2, 18, 32)
    valid_lens = torch.tensor([7, 18], device=DEVICE)
    out, lse = _attention_fwd_triton(qkv, valid_lens, 2, 0.0, None)
    dqkv = _attention_bwd_triton(grad_out, qkv, out, lse, valid_lens, 2, 0.0, None)
    out_c, lse_c = _attention_fwd_triton(qkv.contiguous(), valid_lens, 2, 0.0, None)
    dqkv_c = _attention_bwd_triton(grad_out.contiguous(), qkv.contiguous(), out_c, lse_c, valid_lens, 2, 0.0, None)
    assert_close(out, out_c, atol=0.0, what="context from strided qkv")
    assert_close(dqkv, dqkv_c, atol=0.0, what="dqkv from strided qkv and grad_out")


@needs_kernels
def test_fp16_within_rule_of_fp32_reference():
    qkv = random_qkv(2, 19, 2, 32, dtype=torch.float16)
    valid_lens = torch.tensor([0.0, 12.5], device=DEVICE)
    grad_out = torch.randn(2, 19, 64, device=DEVICE, dtype=torch.float16)
    out, lse = _attention_fwd_triton(qkv, valid_lens, 2, 0.0, None)
    dqkv = _attention_bwd_triton(grad_out, qkv, out, lse, valid_lens, 2, 0.0, None)
    assert out.dtype == dqkv.dtype == torch.float16 and lse.dtype == torch.float64
    out64, lse64, dqkv64 = reference_with_grad(qkv, grad_out, 2, valid_lens)
    # Baseline: the torch path at fp16 (the book's math itself is NaN there: -1e6 is -inf in fp16).
    x = qkv.detach().requires_grad_()
    out16 = ops.packed_self_attention(x, 2, valid_lens)
    (dqkv16,) = torch.autograd.grad(out16, x, grad_out)
    assert_rule(out, out64, out16, torch.float16, "fp16 context")
    assert_lse(lse, lse64)
    assert_rule(dqkv, dqkv64, dqkv16, torch.float16, "fp16 dqkv")


@needs_kernels
@pytest.mark.parametrize("dropout_p", [0.0, 0.3])
def test_forward_without_lse_gives_the_same_output(dropout_p):
    """lse=False (inference): the same context (bits under the interpreter), padded and varlen,
    and no LSE made."""
    seqlen, valid_lens = 13, torch.tensor([5.0, 0.0, 13.0], device=DEVICE)
    qkv = random_qkv(3, seqlen, 2, 16)
    seed = seed_tensor(7) if dropout_p else None
    out, lse = _attention_fwd_triton(qkv, valid_lens, 2, dropout_p, seed)
    bare, no_lse = _attention_fwd_triton(qkv, valid_lens, 2, dropout_p, seed, lse=False)
    assert lse is not None and no_lse is None
    assert_same_computation(bare, out, "padded")
    unpadding = ops.unpadding_for(valid_lens, seqlen)
    packed = ops.unpad(qkv, unpadding)
    args = (packed, unpadding.cu_seqlens, 2, seqlen, dropout_p, seed)
    out_v, lse_v = _varlen_attention_fwd_triton(*args)
    bare_v, no_lse_v = _varlen_attention_fwd_triton(*args, lse=False)
    assert lse_v is not None and no_lse_v is None
    assert_same_computation(bare_v, out_v, "varlen")


@needs_kernels
def test_varlen_matches_padded():
    # A zero-length sequence, and max_seqlen (the padded L) above the longest sequence.
    seqlen, valid_lens = 17, torch.tensor([5.0, 0.0, 13.0], device=DEVICE)
    unpadding = ops.unpadding_for(valid_lens, seqlen)
    qkv = random_qkv(3, seqlen, 2, 16)
    grad_packed = torch.randn(unpadding.indices.numel(), 32, device=DEVICE)
    out, lse = _attention_fwd_triton(qkv, valid_lens, 2, 0.0, None)
    dqkv = _attention_bwd_triton(ops.pad(grad_packed, unpadding), qkv, out, lse, valid_lens, 2, 0.0, None)
    packed = ops.unpad(qkv, unpadding)
    out_v, lse_v = _varlen_attention_fwd_triton(packed, unpadding.cu_seqlens, 2, seqlen, 0.0, None)
    dqkv_v = _varlen_attention_bwd_triton(grad_packed, packed, out_v, lse_v, unpadding.cu_seqlens, 2, seqlen, 0.0, None)
    assert out_v.shape == (18, 32) and lse_v.shape == (2, 18) and dqkv_v.shape == packed.shape
    assert_close(out_v, ops.unpad(out, unpadding), atol=1e-6, what="varlen context")
    assert_close(lse_v, lse.transpose(1, 2).flatten(0, 1)[unpadding.indices].T, atol=1e-6, what="varlen lse")
    assert_close(dqkv_v, ops.unpad(dqkv, unpadding), atol=1e-6, what="varlen dqkv")


@pytest.mark.parametrize("implementation", [pytest.param("kernel", marks=needs_kernels), "cpu twin"])
def test_varlen_rows_of_no_sequence_are_zeros(implementation):
    """A static unpadding (a CUDA graph's bucket) has filler rows past cu_seqlens[-1]: both
    implementations leave their context, LSE and gradient zero, and the valid rows as without."""
    device = DEVICE if implementation == "kernel" else "cpu"
    fwd, bwd = ((_varlen_attention_fwd_triton, _varlen_attention_bwd_triton) if implementation == "kernel"
                else (_varlen_attention_fwd_cpu, _varlen_attention_bwd_cpu))
    p, seed, seqlen = 0.25, seed_tensor(5, device), 9
    valid_lens = torch.tensor([4.0, 0.0, 6.5], device=device)
    qkv = random_qkv(3, seqlen, 2, 8).to(device)
    results = []
    for num_tokens in (None, 20):
        unpadding = ops.unpadding_for(valid_lens, seqlen, num_tokens)
        packed = ops.unpad(qkv, unpadding)
        out, lse = fwd(packed, unpadding.cu_seqlens, 2, seqlen, p, seed)
        grad = torch.ones_like(out)
        results.append((out, lse.T, bwd(grad, packed, out, lse, unpadding.cu_seqlens, 2, seqlen, p, seed)))
    (out, lse, dqkv), (out_s, lse_s, dqkv_s) = results
    assert out.shape[0] == 11 and out_s.shape[0] == 20
    for name, counted, static in (("context", out, out_s), ("lse", lse, lse_s), ("dqkv", dqkv, dqkv_s)):
        assert_close(static[:11], counted, atol=1e-6, what=f"valid rows' {name}")
        assert torch.count_nonzero(static[11:]) == 0, f"filler rows' {name} must be zeros"


@needs_kernels
@pytest.mark.parametrize("dropout_p", [0.0, 0.3])
def test_varlen_without_filler_writes_every_row(dropout_p, monkeypatch):
    """filler=False (an unpadding with host counts: no rows outside the sequences) allocates
    without zero-filling: the kernels must write every row. Fresh tensors are NaN-filled here
    to see one that is not."""
    seqlen, valid_lens = 13, torch.tensor([5.0, 0.0, 13.0], device=DEVICE)
    unpadding = ops.unpadding_for(valid_lens, seqlen)
    packed = ops.unpad(random_qkv(3, seqlen, 2, 16), unpadding)
    seed = seed_tensor(3, DEVICE)
    args = (unpadding.cu_seqlens, 2, seqlen, dropout_p, seed)
    out, lse = _varlen_attention_fwd_triton(packed, *args)
    grad = torch.randn_like(out)
    dqkv = _varlen_attention_bwd_triton(grad, packed, out, lse, *args)
    empty = torch.empty

    def poisoned(*shape, **kwargs):
        t = empty(*shape, **kwargs)
        return t.fill_(float("nan") if t.is_floating_point() else -7)
    monkeypatch.setattr(torch, "empty", poisoned)
    out_e, lse_e = _varlen_attention_fwd_triton(packed, *args, filler=False)
    dqkv_e = _varlen_attention_bwd_triton(grad, packed, out_e, lse_e, *args, filler=False)
    monkeypatch.undo()
    for name, got, want in (("context", out_e, out), ("lse", lse_e, lse), ("dqkv", dqkv_e, dqkv)):
        assert torch.equal(got, want), f"{name}: {torch.isnan(got).sum()} rows' values not written"


# ----------------------------------------------------------------------------------------------
# Dropout
# ----------------------------------------------------------------------------------------------

@needs_kernels
def test_dropout_mask_keep_rate_and_seeds():
    keep = _attention_dropout_keep_triton(2, 2, 48, 0.3, seed_tensor(1234))
    assert keep.shape == (2, 2, 48, 48) and keep.dtype == torch.bool
    rate = keep.float().mean().item()
    assert abs(rate - 0.7) < 0.02, f"keep rate {rate:.4f}, expected 0.7"       # ~5 sigma at n = 9216
    assert torch.equal(keep, _attention_dropout_keep_triton(2, 2, 48, 0.3, seed_tensor(1234))), "same seed, same mask"
    assert not torch.equal(keep, _attention_dropout_keep_triton(2, 2, 48, 0.3, seed_tensor(1235)))
    assert not torch.equal(keep[0, 0], keep[0, 1]) and not torch.equal(keep[0, 0], keep[1, 0]), \
        "every (batch, head) needs its own stream"


@needs_kernels
@pytest.mark.parametrize("seed", [0, 1234, 2**31 - 2, 2**40 + 3])
def test_dropout_mask_of_kernels_and_cpu_twin_are_the_same_bits(seed):
    keep = _attention_dropout_keep_triton(3, 2, 37, 0.3, seed_tensor(seed))
    assert torch.equal(keep.cpu(), _attention_dropout_keep_cpu(3, 2, 37, 0.3, seed_tensor(seed, "cpu")))


@pytest.mark.parametrize("dropout_p", [0.0, 0.3])
def test_cpu_twins_hold_at_most_two_weights_forward_and_three_backward(dropout_p, monkeypatch):
    """The CPU twins (backends triton and cuda on CPU tensors, with dropout) held eight
    (B, heads, L, L) tensors at once: scores kept to the end, a float dropout factor, the
    weights and their gradients out of place, and the whole keep mask's int64 Philox words
    (a training step 1.5x the reference's peak). The keep mask is made a few (batch, head)
    pairs at a time (one here, so that the pairs' Philox temporaries stay below the bound at
    this small L), the same bits whatever the chunk."""
    from bert_fast.ops import attention
    from tests.helpers import peak_bytes
    batch, heads, seqlen, head_dim = 4, 2, 64, 8
    seed = seed_tensor(5, "cpu") if dropout_p else None
    keep = _attention_dropout_keep_cpu(batch, heads, seqlen, 0.3, seed_tensor(5, "cpu"))
    monkeypatch.setattr(attention, "_KEEP_CHUNK_ELEMENTS", 1)
    assert torch.equal(_attention_dropout_keep_cpu(batch, heads, seqlen, 0.3, seed_tensor(5, "cpu")), keep)
    assert _attention_dropout_keep_cpu(batch, heads, 0, 0.3, seed_tensor(5, "cpu")).shape == (batch, heads, 0, 0)
    weights = batch * heads * seqlen * seqlen * 4
    qkv = torch.randn(batch, seqlen, 3 * heads * head_dim)
    valid_lens = torch.tensor([64.0, 30.0, 0.0, 5.0])
    out, lse = attention._attention_fwd_cpu(qkv, valid_lens, heads, dropout_p, seed)
    grad = torch.randn_like(out)
    forward = peak_bytes(lambda: attention._attention_fwd_cpu(qkv, valid_lens, heads, dropout_p, seed))
    backward = peak_bytes(lambda: attention._attention_bwd_cpu(grad, qkv, out, lse, valid_lens, heads, dropout_p, seed))
    assert forward <= 2.25 * weights and backward <= 3.25 * weights, (forward / weights, backward / weights)


@needs_kernels
def test_dropout_forward_and_backward_use_one_mask():
    p, seed = 0.3, seed_tensor(77)
    qkv = random_qkv(2, 19, 2, 16)
    valid_lens = torch.tensor([0.0, 11.5], device=DEVICE)
    grad_out = torch.randn(2, 19, 32, device=DEVICE)
    out, lse = _attention_fwd_triton(qkv, valid_lens, 2, p, seed)
    dqkv = _attention_bwd_triton(grad_out, qkv, out, lse, valid_lens, 2, p, seed)
    keep = _attention_dropout_keep_triton(2, 2, 19, p, seed)
    out64, lse64, dqkv64 = reference_with_grad(qkv, grad_out, 2, valid_lens, keep, p)
    # Scaled by 1/(1-p) and masked exactly as `keep` says, in forward and backward.
    assert_close(out, out64, atol=1e-5, what="dropout context")
    assert_lse(lse, lse64)
    assert_close(dqkv, dqkv64, atol=1e-5, what="dropout dqkv")
    again, _ = _attention_fwd_triton(qkv, valid_lens, 2, p, seed)
    assert torch.equal(out, again), "same seed must repeat"
    other, _ = _attention_fwd_triton(qkv, valid_lens, 2, p, seed + 1)
    assert max_err(other, out) > 1e-2, "another seed must drop other weights"
    # The CPU twin draws the same mask, so it gives the same answer.
    twin_out, _ = attention_fwd(qkv.cpu(), valid_lens.cpu(), 2, p, seed.cpu())
    assert_close(out.cpu(), twin_out, atol=1e-5, what="dropout context vs CPU twin")


@needs_kernels
@pytest.mark.parametrize("one_kernel", [False, True], ids=["two-kernel-bwd", "one-kernel-bwd"])
def test_dropout_a_hair_below_one_drops_everything_without_nan(one_kernel, monkeypatch):
    """p = 1 - 1e-8 rounds to 1.0 in fp32, where the kernels compare it: every weight dropped.
    Their scale 1 / (1 - p) is the host's (1e8), not fp32's inf: 0 * inf made the output and
    gradients NaN. The reference keeps a weight in 1e8, scaled by 1e8."""
    monkeypatch.setattr(ATTENTION, "ONE_KERNEL_BACKWARD_MAX_SEQLEN", 64 if one_kernel else 0)
    p, seed = 1.0 - 1e-8, seed_tensor(3)
    qkv = random_qkv(2, 9, 2, 16)
    valid_lens = torch.tensor([4.0, 9.0], device=DEVICE)
    grad_out = torch.randn(2, 9, 32, device=DEVICE)
    out, lse = _attention_fwd_triton(qkv, valid_lens, 2, p, seed)
    dqkv = _attention_bwd_triton(grad_out, qkv, out, lse, valid_lens, 2, p, seed)
    assert not _attention_dropout_keep_triton(2, 2, 9, p, seed).any()
    assert torch.count_nonzero(out) == 0, "every weight dropped: zero context"
    assert torch.count_nonzero(dqkv) == 0, "and zero gradients"
    twin_out, _ = attention_fwd(qkv.cpu(), valid_lens.cpu(), 2, p, seed.cpu())
    assert torch.count_nonzero(twin_out) == 0


@needs_kernels
def test_varlen_dropout_matches_padded_dropout():
    # The mask is indexed by (batch, head, query, key) within the padded L: both layouts agree.
    p, seed, seqlen = 0.25, seed_tensor(5), 17
    valid_lens = torch.tensor([9.0, 17.0], device=DEVICE)
    unpadding = ops.unpadding_for(valid_lens, seqlen)
    qkv = random_qkv(2, seqlen, 2, 16)
    out, _ = _attention_fwd_triton(qkv, valid_lens, 2, p, seed)
    out_v, _ = _varlen_attention_fwd_triton(ops.unpad(qkv, unpadding), unpadding.cu_seqlens, 2, seqlen, p, seed)
    assert_close(out_v, ops.unpad(out, unpadding), atol=1e-6, what="varlen dropout context")


ATTENTION = importlib.import_module("bert_fast.ops.attention")

# (batch, seqlen, heads, head dim, valid_lens, dropout, varlen): the one-kernel backward against
# the two kernels on the same forward. L 20 and 37 take query blocks past the sequence's end
# (BLOCK_M 16 in the interpreter); d 80 and 192 mask their loads past d.
ONE_KERNEL_CASES = {
    "plain": (2, 20, 2, 16, None, 0.0, False),
    "1d-fractional": (2, 20, 2, 16, [2.5, 19.01], 0.0, False),
    "2d": (3, 5, 2, 96, [[1, 0, 5, 2, 9], [3, 3, 3, 3, 3], [-1, 2, 2, 2, 4]], 0.0, False),
    "zero-lengths-dropout": (2, 19, 2, 16, [0.0, 11.5], 0.3, False),
    "d80-dropout": (1, 37, 1, 80, [30.0], 0.25, False),
    "d192": (1, 9, 1, 192, None, 0.0, False),
    "varlen-dropout": (3, 17, 2, 16, [9.0, 17.0, 0.0], 0.25, True),
}


def backward_after_forward(batch, seqlen, heads, head_dim, valid_lens, p, seed, varlen, dtype, device):
    """(qkv, a closure running the Triton backward of the Triton forward on it): padded with
    ``valid_lens``, or on their packed tokens (varlen)."""
    qkv = random_qkv(batch, seqlen, heads, head_dim, dtype, device)
    grad_out = torch.randn(batch, seqlen, heads * head_dim, device=device).to(dtype)
    if varlen:
        unpadding = ops.unpadding_for(valid_lens, seqlen)
        qkv, grad_out = ops.unpad(qkv, unpadding), ops.unpad(grad_out, unpadding)
        args = (unpadding.cu_seqlens, heads, seqlen, p, seed)
        out, lse = _varlen_attention_fwd_triton(qkv, *args)
        return qkv, lambda: _varlen_attention_bwd_triton(grad_out, qkv, out, lse, *args)
    out, lse = _attention_fwd_triton(qkv, valid_lens, heads, p, seed)
    return qkv, lambda: _attention_bwd_triton(grad_out, qkv, out, lse, valid_lens, heads, p, seed)


def launched_kernels(monkeypatch):
    """The names of the kernels the attention launchers launch from now on."""
    names = []
    real = ATTENTION.launch

    def spy(kernel, like):
        names.append(getattr(kernel, "__name__", None) or kernel.fn.__name__)
        return real(kernel, like)
    monkeypatch.setattr(ATTENTION, "launch", spy)
    return names


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("case", list(ONE_KERNEL_CASES))
def test_one_kernel_backward_matches_the_two_kernels(case, dtype, monkeypatch):
    """ONE_KERNEL_BACKWARD_MAX_SEQLEN: the dK/dV kernel also makes dQ (and delta) where every key
    fits one program. dQ's products are summed in another order (dS^T's columns, not dS's rows),
    so the two agree to rounding, which the tolerance allows: fp32 1e-5, fp16 a few units of its
    last place on gradients of order 1."""
    batch, seqlen, heads, head_dim, valid_lens, p, varlen = ONE_KERNEL_CASES[case]
    valid_lens = None if valid_lens is None else torch.tensor(valid_lens, device=DEVICE)
    seed = seed_tensor(11) if p > 0.0 else None
    qkv, backward = backward_after_forward(batch, seqlen, heads, head_dim, valid_lens, p, seed, varlen, dtype, DEVICE)
    launched = launched_kernels(monkeypatch)
    two = backward()
    assert launched == ["_attention_bwd_dq_kernel", "_attention_bwd_dkdv_kernel"], launched
    monkeypatch.setattr(ATTENTION, "ONE_KERNEL_BACKWARD_MAX_SEQLEN", 128)
    launched.clear()
    one = backward()
    assert launched == ["_attention_bwd_dkdv_kernel"], launched
    tolerance = 1e-5 if dtype == torch.float32 else 4e-3
    assert_close(one.float(), two.float(), atol=tolerance, rtol=tolerance, what=f"{case} dqkv, one kernel vs two")
    # In the interpreter both take 16 queries a step, so dK and dV are the same products; numpy
    # sums them in an order that can follow its SIMD dispatch and the arrays' layout (on another
    # CPU they moved by one unit of fp32's last place): a few units of the last place at most.
    # On a GPU the tiles differ (the sums' order with them): the tolerance above.
    if not qkv.is_cuda:
        third = qkv.shape[-1] // 3
        dkdv_one, dkdv_two = one[..., third:].float(), two[..., third:].float()
        last_place = torch.finfo(dtype).eps * dkdv_two.abs().max()
        assert max_err(dkdv_one, dkdv_two) <= 4 * last_place, "dK/dV changed with the one-kernel backward"


@needs_kernels
@pytest.mark.parametrize("one_kernel", [False, True], ids=["two-kernels", "one-kernel"])
@pytest.mark.parametrize("dtype, shift", [(torch.float32, 24.0), (torch.float16, 4.0)], ids=["fp32", "fp16"])
def test_rows_whose_scores_are_all_very_negative_get_finite_gradients(dtype, shift, one_kernel, monkeypatch):
    """Every score of every row far below 0 (LSE about -94 in fp32, -14 in fp16), no valid_lens,
    and key slots past the sequence's end in the last key block (L 20 and 13, 16-key blocks in
    the interpreter): those slots read K = 0, a score of 0, and exp(0 - LSE) overflowed (fp32 past
    3.4e38; fp16 once dS is cast) into inf * 0 = NaN in dQ, padded and varlen (skip_padding),
    where the reference's gradients are finite."""
    if one_kernel:
        monkeypatch.setattr(ATTENTION, "ONE_KERNEL_BACKWARD_MAX_SEQLEN", 128)
    gen = torch.Generator().manual_seed(0)
    batch, seqlen, d = 2, 20, 16

    def noise():
        return 0.05 * torch.randn(batch, seqlen, d, generator=gen)
    qkv = torch.cat([1.0 + noise(), -shift + noise(), torch.randn(batch, seqlen, d, generator=gen)], -1)
    grad_out = torch.randn(batch, seqlen, d, generator=gen)
    qkv, grad_out = qkv.to(DEVICE, dtype), grad_out.to(DEVICE, dtype)
    out, lse = _attention_fwd_triton(qkv, None, 1, 0.0, None)
    assert lse.max() < (-90 if dtype == torch.float32 else -12), "the case needs very negative scores"
    dqkv = _attention_bwd_triton(grad_out, qkv, out, lse, None, 1, 0.0, None)
    _, _, dqkv64 = reference_with_grad(qkv, grad_out, 1)
    assert_close(dqkv.double(), dqkv64, atol=FLOOR[dtype], rtol=0, what="padded dqkv")

    valid_lens = torch.tensor([20, 13], device=DEVICE)
    unpadding = ops.unpadding_for(valid_lens, seqlen)
    packed, grad_packed = ops.unpad(qkv, unpadding), ops.unpad(grad_out, unpadding)
    args = (unpadding.cu_seqlens, 1, seqlen, 0.0, None)
    out_v, lse_v = _varlen_attention_fwd_triton(packed, *args)
    dqkv_v = _varlen_attention_bwd_triton(grad_packed, packed, out_v, lse_v, *args)
    # The reference on the padded batch, padded rows given no gradient.
    _, _, dqkv64 = reference_with_grad(qkv, ops.pad(grad_packed, unpadding), 1, valid_lens)
    assert_close(dqkv_v.double(), ops.unpad(dqkv64, unpadding), atol=FLOOR[dtype], rtol=0, what="varlen dqkv")


@needs_kernels
def test_one_kernel_backward_leaves_longer_sequences_to_the_two_kernels(monkeypatch):
    monkeypatch.setattr(ATTENTION, "ONE_KERNEL_BACKWARD_MAX_SEQLEN", 16)
    launched = launched_kernels(monkeypatch)
    for seqlen, expected in ((16, ["_attention_bwd_dkdv_kernel"]),
                             (17, ["_attention_bwd_dq_kernel", "_attention_bwd_dkdv_kernel"])):
        qkv = random_qkv(1, seqlen, 1, 16)
        grad_out = torch.randn(1, seqlen, 16, device=DEVICE)
        out, lse = _attention_fwd_triton(qkv, None, 1, 0.0, None)
        out64, _, dqkv64 = reference_with_grad(qkv, grad_out, 1)
        launched.clear()
        dqkv = _attention_bwd_triton(grad_out, qkv, out, lse, None, 1, 0.0, None)
        assert launched == expected, (seqlen, launched)
        assert_close(dqkv, dqkv64, atol=1e-5, what=f"L {seqlen} dqkv")


def test_cpu_twin_dropout_uses_its_seeded_mask_in_forward_and_backward():
    p, seed = 0.4, seed_tensor(99, "cpu")
    qkv = torch.randn(2, 6, 12, dtype=torch.float64, requires_grad=True)
    valid_lens = torch.tensor([[1, 0, 6, 2.5, 3, 4], [6, 6, 6, 6, 6, 6]])
    out, _ = attention_fwd(qkv, valid_lens, 2, p, seed)
    grad_out = torch.randn_like(out)
    (dqkv,) = torch.autograd.grad(out, qkv, grad_out)
    keep = _attention_dropout_keep_cpu(2, 2, 6, p, seed)
    assert 0.3 < keep.float().mean().item() < 0.9
    out64, _, dqkv64 = reference_with_grad(qkv, grad_out, 2, valid_lens, keep, p)
    assert_close(out, out64, atol=1e-12, what="twin dropout context")
    assert_close(dqkv, dqkv64, atol=1e-12, what="twin dropout dqkv")


def test_dropout_needs_a_seed_tensor():
    with pytest.raises(ValueError, match="needs a seed"):
        attention_fwd(QKV, None, 2, 0.1, None)
    with pytest.raises(ValueError, match="one-element int64 tensor"):
        attention_fwd(QKV, None, 2, 0.1, torch.tensor([1, 2]))


def test_public_dropout_repeats_under_manual_seed():
    qkv = torch.randn(2, 8, 12)
    torch.manual_seed(3)
    first = ops.packed_self_attention(qkv, 2, None, 0.5, backend="triton")
    torch.manual_seed(3)
    assert torch.equal(first, ops.packed_self_attention(qkv, 2, None, 0.5, backend="triton"))
    assert not torch.equal(first, ops.packed_self_attention(qkv, 2, None, 0.5, backend="triton"))


# ----------------------------------------------------------------------------------------------
# Registered ops (CPU twins), gradcheck, public API
# ----------------------------------------------------------------------------------------------

# opcheck's test_aot_dispatch_dynamic traces the op's CPU twin under symbolic shapes, ~5-10 s a
# case on the 2-core CI machine: it runs for the cases whose twin does the most (a per-query
# mask, dropout's keep mask, packed with dropout); the others get the schema, autograd and fake
# tensor tests.
_OPCHECK_WITHOUT_AOT = ("test_schema", "test_autograd_registration", "test_faketensor")


def _opcheck(op, args, aot):
    torch.library.opcheck(op, args, **({} if aot else {"test_utils": _OPCHECK_WITHOUT_AOT}))


@pytest.mark.parametrize("valid_lens, dropout_p, aot", [
    (None, 0.0, False), (torch.tensor([0, 3.5]), 0.0, False),
    (torch.tensor([[1, 0, 5, 2, 9], [3, 3, 3, 3, 3]]), 0.0, True), (torch.tensor([4, 2]), 0.2, True),
], ids=["none", "1d", "2d", "dropout"])
def test_opcheck_padded(valid_lens, dropout_p, aot):
    qkv = torch.randn(2, 5, 12, requires_grad=True)
    seed = seed_tensor(7, "cpu") if dropout_p else None
    _opcheck(attention_fwd, (qkv, valid_lens, 2, dropout_p, seed), aot)
    out, lse = attention_fwd(qkv.detach(), valid_lens, 2, dropout_p, seed)
    _opcheck(attention_bwd, (torch.randn_like(out), qkv.detach(), out, lse, valid_lens, 2, dropout_p, seed), aot)


@pytest.mark.parametrize("dropout_p, aot", [(0.0, False), (0.2, True)], ids=["0.0", "0.2"])
def test_opcheck_varlen(dropout_p, aot):
    cu_seqlens = torch.tensor([0, 2, 2, 7], dtype=torch.int32)
    qkv = torch.randn(7, 12, requires_grad=True)
    seed = seed_tensor(3, "cpu") if dropout_p else None
    _opcheck(varlen_attention_fwd, (qkv, cu_seqlens, 2, 6, dropout_p, seed), aot)
    out, lse = varlen_attention_fwd(qkv.detach(), cu_seqlens, 2, 6, dropout_p, seed)
    _opcheck(varlen_attention_bwd, (torch.randn_like(out), qkv.detach(), out, lse, cu_seqlens, 2, 6, dropout_p, seed),
             aot)


def test_gradcheck_through_public_functions():
    qkv = torch.randn(2, 5, 18, dtype=torch.float64, requires_grad=True)
    valid_lens = torch.tensor([[0, 1, 2.5, 9, -1], [5, 5, 0, 1, 3]])
    assert torch.autograd.gradcheck(lambda x: ops.packed_self_attention(x, 2, valid_lens, backend="triton"), (qkv,))
    unpadding = ops.unpadding_for(torch.tensor([2.5, 0.0, 4.0]), 4)
    packed = torch.randn(unpadding.indices.numel(), 18, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(
        lambda x: ops.unpadded_self_attention(x, 2, unpadding, None, backend="triton"), (packed,))


@pytest.mark.parametrize("valid_lens", [None, torch.tensor([3, 0, 9]), torch.tensor([[1, 2, 3, 0, 9, 9, 9, 9, 9]] * 3)],
                         ids=["none", "1d", "2d"])
def test_public_backends_agree(valid_lens):
    qkv = torch.randn(3, 9, 24, requires_grad=True)
    grad_out = torch.randn(3, 9, 8)
    expected = ops.packed_self_attention(qkv, 2, valid_lens)
    out = ops.packed_self_attention(qkv, 2, valid_lens, backend="triton")
    assert_close(out, expected, atol=1e-5)
    (grad_expected,), (grad,) = (torch.autograd.grad(y, qkv, grad_out) for y in (expected, out))
    assert_close(grad, grad_expected, atol=1e-5, what="dqkv")
    if valid_lens is not None and valid_lens.dim() == 1:
        unpadding = ops.unpadding_for(valid_lens, 9)
        packed = ops.unpad(qkv.detach(), unpadding)
        assert_close(ops.unpadded_self_attention(packed, 2, unpadding, valid_lens, backend="triton"),
                     ops.unpadded_self_attention(packed, 2, unpadding, valid_lens), atol=1e-5, what="unpadded")


def test_tiles_for_every_head_dim_and_dtype():
    for head_dim in range(1, 257):
        for element_size in (2, 4):
            block_d, *tiles = _attention_tiles(head_dim, element_size, interpreter=False)
            assert block_d >= max(head_dim, 16) and block_d & (block_d - 1) == 0, (head_dim, block_d)
            for t in tiles:
                for block in (t.block_m, t.block_n):
                    assert block >= 16 and block & (block - 1) == 0, (head_dim, element_size, tiles)
    # Larger head dims and fp32 take smaller tiles (registers, shared memory).
    area = lambda t: t.block_m * t.block_n
    for kernel in range(1, 4):
        assert area(_attention_tiles(256, 2, interpreter=False)[kernel]) < area(_attention_tiles(64, 2, interpreter=False)[kernel])
        assert area(_attention_tiles(64, 4, interpreter=False)[kernel]) <= area(_attention_tiles(64, 2, interpreter=False)[kernel])
    assert _attention_tiles(192, 2, interpreter=False) == _attention_tiles(256, 2, interpreter=False)


# ----------------------------------------------------------------------------------------------
# Input validation (launchers and the registered ops' CPU twins raise the same errors)
# ----------------------------------------------------------------------------------------------

QKV = torch.randn(2, 5, 12)
BAD_PADDED_CALLS = {
    "qkv 2-D": ((torch.randn(5, 12), None, 2, 0.0), r"qkv must be the packed projection \(B, L, 3H\)"),
    "qkv dtype": ((QKV.to(torch.int32), None, 2, 0.0), r"qkv must be one of"),
    "num_heads": ((QKV, None, 0, 0.0), r"num_heads must be a positive int"),
    "not 3 * heads": ((torch.randn(2, 5, 10), None, 2, 0.0), r"divisible by 3 \* num_heads"),
    "head dim": ((torch.randn(1, 2, 3 * 257), None, 1, 0.0), r"head dim must be 1..256"),
    "valid_lens shape": ((QKV, torch.tensor([1, 2, 3]), 2, 0.0), r"valid_lens must have shape \(B,\)"),
    "valid_lens dtype": ((QKV, torch.tensor([True, False]), 2, 0.0), r"valid_lens must be an integer or floating"),
    "valid_lens device": ((QKV, torch.ones(2, device="meta"), 2, 0.0), r"valid_lens is on meta"),
    "dropout": ((QKV, None, 2, 1.0), r"dropout_p must be in \[0, 1\)"),
    "dropout L": ((torch.randn(1, 65537, 3), None, 1, 0.1), r"attention dropout supports sequences up to 65536"),
}


@pytest.mark.parametrize("case", list(BAD_PADDED_CALLS))
def test_padded_validation(case):
    (qkv, valid_lens, num_heads, dropout_p), match = BAD_PADDED_CALLS[case]
    with pytest.raises(ValueError, match=match):
        _attention_fwd_triton(qkv, valid_lens, num_heads, dropout_p, None)
    if qkv.dtype.is_floating_point:
        with pytest.raises(ValueError, match=match):
            attention_fwd(qkv, valid_lens, num_heads, dropout_p, None)


def test_float64_only_on_the_cpu_twin():
    with pytest.raises(ValueError, match="qkv must be one of"):
        _attention_fwd_triton(QKV.double(), None, 2, 0.0, None)
    assert attention_fwd(QKV.double(), None, 2, 0.0, None)[0].dtype == torch.float64


@needs_kernels
def test_grid_limit():
    with pytest.raises(ValueError, match=r"batch \* num_heads must be at most 65535"):
        _attention_fwd_triton(torch.randn(65536, 1, 3, device=DEVICE), None, 1, 0.0, None)


CU_SEQLENS = torch.tensor([0, 2, 5], dtype=torch.int32)
BAD_VARLEN_CALLS = {
    "qkv 3-D": ((QKV, CU_SEQLENS, 2, 5), r"qkv must be the packed projection \(N, 3H\)"),
    "cu_seqlens dtype": ((QKV[0], CU_SEQLENS.long(), 2, 5), r"cu_seqlens must be int32"),
    "cu_seqlens shape": ((QKV[0], CU_SEQLENS[:1], 2, 5), r"cu_seqlens must be 1-D \(B\+1,\)"),
    "cu_seqlens device": ((QKV[0], CU_SEQLENS.to("meta"), 2, 5), r"cu_seqlens is on meta"),
    "max_seqlen": ((QKV[0], CU_SEQLENS, 2, -1), r"max_seqlen must be an int >= 0"),
}


@pytest.mark.parametrize("case", list(BAD_VARLEN_CALLS))
def test_varlen_validation(case):
    (qkv, cu_seqlens, num_heads, max_seqlen), match = BAD_VARLEN_CALLS[case]
    with pytest.raises(ValueError, match=match):
        _varlen_attention_fwd_triton(qkv, cu_seqlens, num_heads, max_seqlen, 0.0, None)
    with pytest.raises(ValueError, match=match):
        varlen_attention_fwd(qkv, cu_seqlens, num_heads, max_seqlen, 0.0, None)


def test_backward_validation():
    out, lse = attention_fwd(QKV, None, 2, 0.0, None)
    with pytest.raises(ValueError, match=r"grad_out must have the context's shape"):
        _attention_bwd_triton(out[:, :4], QKV, out, lse, None, 2, 0.0, None)
    with pytest.raises(ValueError, match=r"grad_out must be torch.float32"):
        attention_bwd(out.double(), QKV, out, lse, None, 2, 0.0, None)
    with pytest.raises(ValueError, match=r"lse must be the forward's float64"):
        _attention_bwd_triton(out, QKV, out, lse.float(), None, 2, 0.0, None)
    packed_out, packed_lse = varlen_attention_fwd(QKV[0], CU_SEQLENS, 2, 5, 0.0, None)
    with pytest.raises(ValueError, match=r"lse must be the forward's float64 \(2, 5\)"):
        _varlen_attention_bwd_triton(packed_out, QKV[0], packed_out, lse, CU_SEQLENS, 2, 5, 0.0, None)


def test_unknown_backend():
    with pytest.raises(ValueError, match="backend must be 'torch', 'triton' or 'cuda'"):
        ops.packed_self_attention(torch.randn(2, 5, 12), 2, backend="Cuda")
    unpadding = ops.unpadding_for(torch.tensor([2, 5]), 5)
    with pytest.raises(ValueError, match="backend must be 'torch', 'triton' or 'cuda'"):
        ops.unpadded_self_attention(torch.randn(7, 12), 2, unpadding, None, backend="Triton")


# ----------------------------------------------------------------------------------------------
# GPU: real sizes, fp16/bf16, vs the torch path
# ----------------------------------------------------------------------------------------------

def _gpu_dtypes():
    dtypes = [torch.float16]
    if torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 0):
        dtypes.append(torch.bfloat16)
    return dtypes


@needs_cuda
@pytest.mark.parametrize("dtype", _gpu_dtypes())
@pytest.mark.parametrize("seqlen, num_heads, head_dim", [(128, 12, 64), (512, 4, 192), (128, 4, 80), (512, 16, 64)])
def test_gpu_real_sizes_vs_torch_path(seqlen, num_heads, head_dim, dtype):
    batch = 4
    qkv = random_qkv(batch, seqlen, num_heads, head_dim, dtype=dtype, device="cuda")
    valid_lens = torch.tensor([seqlen, seqlen // 2 + 0.5, 0, 3], device="cuda")
    grad_out = torch.randn(batch, seqlen, num_heads * head_dim, dtype=dtype, device="cuda")
    x = qkv.detach().requires_grad_()
    out = ops.packed_self_attention(x, num_heads, valid_lens, backend="triton")
    (dqkv,) = torch.autograd.grad(out, x, grad_out)
    expected = {}
    for ref_dtype in (torch.float32, dtype):
        xr = qkv.detach().to(ref_dtype).requires_grad_()
        out_r = ops.packed_self_attention(xr, num_heads, valid_lens)
        expected[ref_dtype] = (out_r, torch.autograd.grad(out_r, xr, grad_out.to(ref_dtype))[0])
    assert_rule(out, expected[torch.float32][0], expected[dtype][0], dtype, "context")
    assert_rule(dqkv, expected[torch.float32][1], expected[dtype][1], dtype, "dqkv")


@needs_cuda
@pytest.mark.parametrize("dtype", _gpu_dtypes())
def test_gpu_varlen_vs_torch_path(dtype):
    seqlen, num_heads = 512, 12
    valid_lens = torch.tensor([512, 300, 0, 1, 77.5], device="cuda")
    unpadding = ops.unpadding_for(valid_lens, seqlen)
    qkv = torch.randn(unpadding.indices.numel(), 3 * num_heads * 64, dtype=dtype, device="cuda")
    grad_out = torch.randn(qkv.shape[0], num_heads * 64, dtype=dtype, device="cuda")
    x = qkv.detach().requires_grad_()
    out = ops.unpadded_self_attention(x, num_heads, unpadding, valid_lens, backend="triton")
    (dqkv,) = torch.autograd.grad(out, x, grad_out)
    expected = {}
    for ref_dtype in (torch.float32, dtype):
        xr = qkv.detach().to(ref_dtype).requires_grad_()
        out_r = ops.unpadded_self_attention(xr, num_heads, unpadding, valid_lens, per_sequence=False)
        expected[ref_dtype] = (out_r, torch.autograd.grad(out_r, xr, grad_out.to(ref_dtype))[0])
    assert_rule(out, expected[torch.float32][0], expected[dtype][0], dtype, "varlen context")
    assert_rule(dqkv, expected[torch.float32][1], expected[dtype][1], dtype, "varlen dqkv")


@needs_cuda
def test_gpu_dropout_keep_rate_and_compile():
    keep = _attention_dropout_keep_triton(4, 12, 512, 0.1, seed_tensor(42, "cuda"))
    rate = keep.float().mean().item()
    assert abs(rate - 0.9) < 1e-3, f"keep rate {rate:.5f}, expected 0.9"
    qkv = random_qkv(2, 128, 4, 64, dtype=torch.float16, device="cuda")
    valid_lens = torch.tensor([100, 7], device="cuda")
    compiled = torch.compile(lambda x: ops.packed_self_attention(x, 4, valid_lens, backend="triton"), fullgraph=True)
    assert_close(compiled(qkv), ops.packed_self_attention(qkv, 4, valid_lens, backend="triton"), atol=0.0,
                 what="compiled context")


@needs_cuda
@pytest.mark.parametrize("dropout_p", [0.0, 0.1])
@pytest.mark.parametrize("varlen", [False, True], ids=["padded", "varlen"])
def test_gpu_one_kernel_backward_at_bert_length(varlen, dropout_p, monkeypatch):
    """The one-kernel backward on the GPU's own tiles (128 keys a program, BERT-base heads, bf16)
    against the two kernels: dQ to bf16 rounding (its sums run in another order), dK and dV
    likewise (another query step)."""
    valid_lens = torch.tensor([128, 100, 37, 1], device="cuda")
    seed = seed_tensor(5, "cuda") if dropout_p else None
    _, backward = backward_after_forward(4, 128, 12, 64, valid_lens, dropout_p, seed, varlen, torch.bfloat16, "cuda")
    two = backward()
    monkeypatch.setattr(ATTENTION, "ONE_KERNEL_BACKWARD_MAX_SEQLEN", 128)
    launched = launched_kernels(monkeypatch)
    one = backward()
    assert launched == ["_attention_bwd_dkdv_kernel"], launched
    assert_close(one.float(), two.float(), atol=2e-2, rtol=1e-2, what="dqkv, one kernel vs two")
