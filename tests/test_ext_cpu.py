"""The compiled extension's C++ CPU ops (csrc/*_cpu.cpp, torch.ops.bert_fast.ext_*) against their
PyTorch CPU twins and the eager math: forward and backward (the bwd ops called directly, compared
with autograd of the eager math), fp32 and bf16, odd H, one-row inputs, strided inputs, the
dropout mask (bit for bit against tl.randint4x's words), thread-count independence, and input validation."""

import importlib

import pytest
import torch
from torch.nn import functional as F

import bert_fast
from bert_fast.ops._triton import tl, triton
from tests.helpers import (assert_close, assert_within_rule, DEVICE, max_err, needs_kernels,
                           seed_tensor)
from tests.isolated import ExtOpsInChild

# The op modules, not the functions of the same name that bert_fast.ops exports.
embedding_mod = importlib.import_module("bert_fast.ops.embedding")
add_layernorm_mod = importlib.import_module("bert_fast.ops.add_layernorm")

DTYPES = [torch.float32, torch.bfloat16]
DTYPE_IDS = ["fp32", "bf16"]


@pytest.fixture(scope="module")
def ops():
    bert_fast.build_extension()
    return torch.ops.bert_fast


@pytest.fixture(scope="module")
def ops_in_child(ops):
    """The same ops, each call run in a child process (tests/isolated.py). The tests of bad
    input call these: a failed check that kills the process (an extension linked with its own
    libstdc++ did) fails that test alone and names the input. After ``ops``: this process
    builds the extension, the child then only loads it."""
    return ExtOpsInChild()


def with_threads(n, fn):
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        return fn()
    finally:
        torch.set_num_threads(before)


def assert_equal(actual, expected, what):
    assert actual.shape == expected.shape and actual.dtype == expected.dtype, (
        f"{what}: {actual.dtype} {tuple(actual.shape)} != {expected.dtype} {tuple(expected.shape)}")
    assert torch.equal(actual, expected), f"{what}: max abs difference {max_err(actual, expected):.3g}"


# ---------------------------------------------------------------------------------------------
# embedding_sum

def make_tables(n_tokens, max_len, hidden, dtype):
    return (torch.randn(n_tokens, hidden).to(dtype), torch.randn(2, hidden).to(dtype),
            torch.randn(1, max_len, hidden).to(dtype))


def index_case(case):
    """(tokens, segments, positions, n_tokens, max_len). Few distinct ids, so rows repeat ids."""
    if case == "padded":           # tokens read through a transpose (non-contiguous), int32 segments
        return (torch.randint(0, 6, (9, 4)).t(), torch.randint(0, 2, (4, 9), dtype=torch.int32), None, 7, 12)
    if case == "padded_BL1":       # B * L = 1
        return torch.randint(0, 6, (1, 1)), torch.randint(0, 2, (1, 1)), None, 7, 3
    if case == "packed":           # int32 tokens, int64 segments and positions
        n = 40
        return (torch.randint(0, 6, (n,), dtype=torch.int32), torch.randint(0, 2, (n,)),
                torch.randint(0, 10, (n,)), 7, 10)
    if case == "packed_N1":
        return torch.tensor([3]), torch.tensor([1], dtype=torch.int32), torch.tensor([5]), 7, 10
    raise ValueError(case)


def eager_embedding_sum(tokens, segments, tables, positions, grad_out):
    """The eager math at the tables' precision: out and the three table gradients."""
    leaves = [t.detach().requires_grad_() for t in tables]
    token_weight, segment_weight, pos_weight = leaves
    pos = pos_weight[0, : tokens.shape[-1]] if positions is None else pos_weight[0][positions]
    out = F.embedding(tokens, token_weight) + F.embedding(segments, segment_weight) + pos
    return out.detach(), list(torch.autograd.grad(out, leaves, grad_out))


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("case,hidden", [("padded", 96), ("padded_BL1", 1000), ("packed", 1000),
                                         ("packed_N1", 96)])
@pytest.mark.parametrize("learn_pos_embedding", [False, True], ids=["frozen_pos", "learn_pos"])
def test_embedding_sum_matches_twin_and_eager(ops, case, hidden, dtype, learn_pos_embedding):
    tokens, segments, positions, n_tokens, max_len = index_case(case)
    tables = make_tables(n_tokens, max_len, hidden, dtype)
    grad_out = torch.randn(*tokens.shape, hidden).to(dtype)

    out = ops.ext_embedding_sum_fwd(tokens, segments, *tables, positions)
    grads = ops.ext_embedding_sum_bwd(grad_out, tokens, segments, positions, n_tokens, 2, max_len,
                                      learn_pos_embedding)
    # The forward adds in the twin's order in fp32: the same bits.
    assert_equal(out, embedding_mod._embedding_sum_fwd_cpu(tokens, segments, *tables, positions), "out vs twin")
    twin_grads = embedding_mod._embedding_sum_bwd_cpu(grad_out, tokens, segments, positions, n_tokens, 2,
                                                      max_len, learn_pos_embedding, True)
    names = ("token grad", "segment grad", "position grad")
    for actual, twin, name in zip(grads, twin_grads, names):
        assert actual.dtype == twin.dtype == dtype and actual.shape == twin.shape, name
        assert_close(actual, twin, atol=1e-5 if dtype == torch.float32 else 3e-2, rtol=1e-2, what=name + " vs twin")

    ref_out, ref_grads = eager_embedding_sum(tokens, segments, [t.double() for t in tables], positions,
                                             grad_out.double())
    same_out, same_grads = eager_embedding_sum(tokens, segments, tables, positions, grad_out)
    assert_within_rule(out, ref_out, same_out, "out")
    for actual, ref, same, name in zip(grads[:2], ref_grads, same_grads, names):
        assert_within_rule(actual, ref, same, name)
    if learn_pos_embedding:
        assert grads[2].shape == (1, max_len, hidden)
        assert_within_rule(grads[2], ref_grads[2], same_grads[2], names[2])
        if positions is None:
            assert torch.all(grads[2][0, tokens.shape[1]:] == 0), "padded form: rows >= L stay zero"
    else:
        assert grads[2].numel() == 0, "no position gradient unless learn_pos_embedding"


def test_embedding_sum_fp64(ops):
    tokens, segments, positions, n_tokens, max_len = index_case("packed")
    tables = make_tables(n_tokens, max_len, 33, torch.float64)
    grad_out = torch.randn(*tokens.shape, 33, dtype=torch.float64)
    ref_out, ref_grads = eager_embedding_sum(tokens, segments, tables, positions, grad_out)
    assert_close(ops.ext_embedding_sum_fwd(tokens, segments, *tables, positions), ref_out, atol=1e-12)
    grads = ops.ext_embedding_sum_bwd(grad_out, tokens, segments, positions, n_tokens, 2, max_len, True)
    for actual, ref in zip(grads, ref_grads):
        assert actual.dtype == torch.float64
        assert_close(actual, ref, atol=1e-12)


def test_embedding_sum_strided_tables_and_grad(ops):
    tokens, segments, positions, n_tokens, max_len = index_case("padded")
    hidden = 96
    token_weight = torch.randn(hidden, n_tokens).t()                       # column stride != 1
    segment_weight = torch.randn(2, 2 * hidden)[:, :hidden]                # row stride 2H
    pos_weight = torch.randn(1, max_len, hidden + 5)[..., :hidden]
    grad_out = torch.randn(hidden, *tokens.shape).permute(1, 2, 0)
    tables = (token_weight, segment_weight, pos_weight)
    contiguous = [t.contiguous() for t in tables]
    assert_equal(ops.ext_embedding_sum_fwd(tokens, segments, *tables, positions),
                 ops.ext_embedding_sum_fwd(tokens.contiguous(), segments, *contiguous, positions), "out")
    strided = ops.ext_embedding_sum_bwd(grad_out, tokens, segments, positions, n_tokens, 2, max_len, True)
    dense = ops.ext_embedding_sum_bwd(grad_out.contiguous(), tokens.contiguous(), segments, positions,
                                      n_tokens, 2, max_len, True)
    for a, b, name in zip(strided, dense, ("token grad", "segment grad", "position grad")):
        assert_equal(a, b, name)


@pytest.mark.parametrize("case", ["padded", "packed"])
def test_embedding_sum_backward_is_independent_of_thread_count(ops, case):
    # Many rows with few ids: every table row sums many gradient rows.
    n = 3000
    tokens, segments = torch.randint(0, 5, (n,)), torch.randint(0, 2, (n,))
    positions = torch.randint(0, 50, (n,))
    if case == "padded":
        tokens, segments, positions = tokens.view(60, 50), segments.view(60, 50), None
    grad_out = torch.randn(*tokens.shape, 200)
    run = lambda: ops.ext_embedding_sum_bwd(grad_out, tokens, segments, positions, 5, 2, 50, True)
    one, two, again = with_threads(1, run), with_threads(2, run), run()
    for a, b, c, name in zip(one, two, again, ("token grad", "segment grad", "position grad")):
        assert_equal(a, b, name + ", 1 vs 2 threads")
        assert_equal(a, c, name + ", repeated")


def test_embedding_sum_empty_batch(ops):
    tokens = torch.zeros(0, dtype=torch.int64)
    tables = make_tables(7, 10, 96, torch.float32)
    assert ops.ext_embedding_sum_fwd(tokens, tokens, *tables, tokens).shape == (0, 96)
    token_grad, segment_grad, pos_grad = ops.ext_embedding_sum_bwd(torch.zeros(0, 96), tokens, tokens, tokens,
                                                                   7, 2, 10, True)
    assert torch.equal(token_grad, torch.zeros(7, 96)) and torch.equal(pos_grad, torch.zeros(1, 10, 96))


@pytest.mark.parametrize("bad", ["token", "negative_token", "segment", "negative_segment", "position",
                                 "negative_position"])
def test_embedding_sum_ids_out_of_range(ops_in_child, bad):
    tokens, segments, positions, n_tokens, max_len = index_case("packed")
    tokens, segments, positions = tokens.clone(), segments.clone(), positions.clone()
    target, value, message = {
        "token": (tokens, n_tokens, rf"tokens id {n_tokens} .* ids must be in \[0, {n_tokens}\)"),
        "negative_token": (tokens, -1, rf"tokens id -1 .* ids must be in \[0, {n_tokens}\)"),
        "segment": (segments, 2, r"segments id 2 .* ids must be in \[0, 2\)"),
        "negative_segment": (segments, -1, r"segments id -1 .* ids must be in \[0, 2\)"),
        "position": (positions, max_len, rf"positions id {max_len} .* ids must be in \[0, {max_len}\)"),
        "negative_position": (positions, -1, rf"positions id -1 .* ids must be in \[0, {max_len}\)"),
    }[bad]
    target[17] = value
    tables = make_tables(n_tokens, max_len, 8, torch.float32)
    with pytest.raises(IndexError, match=message):
        ops_in_child.ext_embedding_sum_fwd(tokens, segments, *tables, positions)
    with pytest.raises(IndexError, match=message):
        ops_in_child.ext_embedding_sum_bwd(torch.randn(len(tokens), 8), tokens, segments, positions, n_tokens, 2,
                                           max_len, True)


_ids, _tables = torch.randint(0, 3, (2, 5)), make_tables(7, 10, 8, torch.float32)
_packed = torch.randint(0, 3, (10,))
EMBEDDING_FWD_CASES = [
    ((_ids.float(), _ids, *_tables, None), "int32 or int64"),
    ((_ids, _ids, *_tables, _ids), "positions are only for packed"),
    ((_packed, _packed, *_tables, None), "packed .* need positions"),
    ((_ids, _ids[:, :4], *_tables, None), "segments must have the shape of tokens"),
    ((_packed, _packed, *_tables, _packed[:9]), "positions must have the shape of tokens"),
    ((_ids.view(1, 2, 5), _ids.view(1, 2, 5), *_tables, None), r"\(B, L\) \(padded\) or \(N,\)"),
    ((_ids, _ids, _tables[0][0], *_tables[1:], None), "must be 2-D"),
    ((_ids, _ids, *_tables[:2], _tables[2][0], None), r"pos_weight must be \(1, max_len, H\)"),
    ((_ids, _ids, _tables[0], _tables[1][:, :7], _tables[2], None), "the same H"),
    ((_ids, _ids, _tables[0].double(), *_tables[1:], None), "one dtype"),
    ((torch.randint(0, 3, (2, 11)), torch.randint(0, 2, (2, 11)), *_tables, None),
     "sequence length 11 exceeds the position table's max_len 10"),
]


@pytest.mark.parametrize("args,message", EMBEDDING_FWD_CASES, ids=[c[1] for c in EMBEDDING_FWD_CASES])
def test_embedding_sum_fwd_validation_matches_twin(ops_in_child, args, message):
    """The same error type as the twin's checks, with a message that says what was wrong."""
    with pytest.raises(Exception) as twin_error:
        embedding_mod._embedding_sum_fwd_cpu(*args)
    with pytest.raises(twin_error.type, match=message):
        ops_in_child.ext_embedding_sum_fwd(*args)


_grad = torch.randn(2, 5, 8)
EMBEDDING_BWD_CASES = [
    ((_grad[:, :4], _ids, _ids, None, 7, 2, 10), r"grad_out must be tokens.shape \+ \(H,\)"),
    ((_grad[..., :0], _ids, _ids, None, 7, 2, 10), "H >= 1"),
    ((_grad, _ids, _ids, None, 0, 2, 10), "n_tokens .* must be >= 1, got 0"),
    ((_grad, _ids, _ids, None, 7, 2, 4), "exceeds the position table's max_len 4"),
    ((_grad, _ids, _ids, _ids, 7, 2, 10), "positions are only for packed"),
]


@pytest.mark.parametrize("args,message", EMBEDDING_BWD_CASES, ids=[c[1] for c in EMBEDDING_BWD_CASES])
def test_embedding_sum_bwd_validation_matches_twin(ops_in_child, args, message):
    with pytest.raises(Exception) as twin_error:
        embedding_mod._embedding_sum_bwd_cpu(*args, True, True)
    with pytest.raises(twin_error.type, match=message):
        ops_in_child.ext_embedding_sum_bwd(*args, True)


# ---------------------------------------------------------------------------------------------
# add_layernorm

def make_ln_inputs(shape, dtype, affine):
    hidden = shape[-1]
    x, residual, grad_out = (torch.randn(shape).to(dtype) for _ in range(3))
    weight = (1 + 0.5 * torch.randn(hidden)).to(dtype) if affine in ("both", "weight") else None
    bias = torch.randn(hidden).to(dtype) if affine == "both" else None
    return x, residual, weight, bias, grad_out


def eager_add_layernorm(x, residual, weight, bias, grad_out, keep_scale=None):
    """The eager math at the inputs' precision: out and [d_x, d_residual, d_weight, d_bias]
    (None for absent parameters). ``keep_scale`` (0 or 1/(1-p)) applies a known dropout mask."""
    leaves = [t.detach().requires_grad_() if t is not None else None for t in (x, residual, weight, bias)]
    x_, residual_, weight_, bias_ = leaves
    dropped = x_ * keep_scale.to(x_.dtype) if keep_scale is not None else x_
    out = F.layer_norm(residual_ + dropped, x.shape[-1:], weight_, bias_, 1e-5)
    grads = iter(torch.autograd.grad(out, [t for t in leaves if t is not None], grad_out))
    return out.detach(), [next(grads) if t is not None else None for t in leaves]


def run_ln(ops, x, residual, weight, bias, grad_out, seed=None, dropout_p=0.0):
    out, mean, rstd = ops.ext_add_layernorm_fwd(x, residual, weight, bias, 1e-5, seed, dropout_p)
    grads = ops.ext_add_layernorm_bwd(grad_out, x, residual, weight, mean, rstd, seed, dropout_p, bias is not None)
    return out, mean, rstd, grads


def check_ln_against_eager(x, residual, weight, bias, grad_out, out, grads, keep_scale=None):
    """out and grads (d_residual, d_x, d_weight, d_bias) within the tolerance rule."""
    as64 = lambda t: t.double() if t is not None else None
    ks64 = keep_scale.double() if keep_scale is not None else None
    ref_out, ref_grads = eager_add_layernorm(*map(as64, (x, residual, weight, bias, grad_out)), ks64)
    same_out, same_grads = eager_add_layernorm(x, residual, weight, bias, grad_out, keep_scale)
    assert_within_rule(out, ref_out, same_out, "out")
    d_residual, d_x, d_weight, d_bias = grads
    ours = {"d_residual": d_residual, "d_x": d_x if keep_scale is not None else None,
            "d_weight": d_weight if weight is not None else None, "d_bias": d_bias if bias is not None else None}
    refs = dict(zip(("d_x", "d_residual", "d_weight", "d_bias"), zip(ref_grads, same_grads)))
    for name, actual in ours.items():
        if actual is not None:
            assert_within_rule(actual, *refs[name], name)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("shape,affine", [((150, 96), "both"), ((2, 3, 1000), "both"), ((1, 1, 768), "both"),
                                          ((1, 96), "weight"), ((5, 96), "none")])
def test_add_layernorm_matches_twin_and_eager(ops, shape, affine, dtype):
    x, residual, weight, bias, grad_out = make_ln_inputs(shape, dtype, affine)
    out, mean, rstd, grads = run_ln(ops, x, residual, weight, bias, grad_out)
    rows = x.numel() // shape[-1]
    assert out.shape == shape and out.dtype == dtype
    assert mean.shape == rstd.shape == (rows,) and mean.dtype == rstd.dtype == torch.float32
    d_residual, d_x, d_weight, d_bias = grads
    assert d_x.numel() == 0, "without dropout d_x equals d_residual and is not returned"
    assert (d_weight.numel() == 0) == (weight is None) and (d_bias.numel() == 0) == (bias is None)

    # The registered op: statistics flattened to (rows,) (the CPU kernel keeps (..., 1)).
    twin_out, twin_mean, twin_rstd = add_layernorm_mod.add_layernorm_fwd(x, residual, weight, bias, 1e-5, None, 0.0)
    assert_close(mean, twin_mean, atol=1e-5, what="mean vs twin")
    assert_close(rstd, twin_rstd, atol=1e-5, rtol=1e-5, what="rstd vs twin")
    one_ulp = 1e-5 if dtype == torch.float32 else 2 ** -7
    assert_close(out, twin_out, atol=one_ulp, rtol=one_ulp, what="out vs twin")
    twin_grads = add_layernorm_mod.add_layernorm_bwd(grad_out, x, residual, weight, mean, rstd, None, 0.0,
                                                     bias is not None)
    for actual, twin, name in zip(grads, twin_grads, ("d_residual", "d_x", "d_weight", "d_bias")):
        assert actual.shape == twin.shape and actual.dtype == twin.dtype, name
        assert_close(actual, twin, atol=1e-4 if dtype == torch.float32 else 5e-2, rtol=one_ulp,
                     what=name + " vs twin")
    check_ln_against_eager(x, residual, weight, bias, grad_out, out, grads)


def test_add_layernorm_fp64(ops):
    x, residual, weight, bias, grad_out = make_ln_inputs((7, 33), torch.float64, "both")
    out, mean, rstd, (d_residual, _, d_weight, d_bias) = run_ln(ops, x, residual, weight, bias, grad_out)
    assert mean.dtype == rstd.dtype == torch.float64
    ref_out, ref_grads = eager_add_layernorm(x, residual, weight, bias, grad_out)
    for actual, ref in zip((out, d_residual, d_weight, d_bias), (ref_out, *ref_grads[1:])):
        assert_close(actual, ref, atol=1e-10)


def test_add_layernorm_strided_inputs(ops):
    x = torch.randn(9, 200)[:, :96]               # row stride 200
    residual = torch.randn(96, 9).t()             # column stride 9
    grad_out = torch.randn(96, 9).t()
    weight, bias = torch.randn(96), torch.randn(96)
    seed = seed_tensor(11, "cpu")
    strided = run_ln(ops, x, residual, weight, bias, grad_out, seed, 0.3)
    dense = run_ln(ops, x.contiguous(), residual.contiguous(), weight, bias, grad_out.contiguous(), seed, 0.3)
    for a, b, name in zip((*strided[:3], *strided[3]), (*dense[:3], *dense[3]),
                          ("out", "mean", "rstd", "d_residual", "d_x", "d_weight", "d_bias")):
        assert_equal(a, b, name)


def test_add_layernorm_backward_is_independent_of_thread_count(ops):
    # 3000 rows: many chunks of the d_weight / d_bias reduction.
    x, residual, weight, bias, grad_out = make_ln_inputs((3000, 96), torch.float32, "both")
    run = lambda: run_ln(ops, x, residual, weight, bias, grad_out, seed_tensor(5, "cpu"), 0.2)
    one, two = with_threads(1, run), with_threads(2, run)
    for a, b, name in zip((*one[:3], *one[3]), (*two[:3], *two[3]),
                          ("out", "mean", "rstd", "d_residual", "d_x", "d_weight", "d_bias")):
        assert_equal(a, b, name + ", 1 vs 2 threads")


def test_add_layernorm_empty_input(ops):
    x = torch.randn(0, 4, 96)
    weight, bias = torch.randn(96), torch.randn(96)
    out, mean, rstd, (d_residual, _, d_weight, d_bias) = run_ln(ops, x, x, weight, bias, x)
    assert out.shape == d_residual.shape == x.shape and mean.shape == (0,)
    assert torch.equal(d_weight, torch.zeros(96)) and torch.equal(d_bias, torch.zeros(96))


# Dropout: the mask is philox.h's, the words tl.randint4x draws: element (r, c) takes word c % 4
# of the call with counter r * ceil(H / 4) + c // 4. Written here element by element (each
# element's own call, its word picked by c % 4), not as the op kernels interleave them.

@triton.jit
def _tl_randint4x_keep_kernel(keep_ptr, seed, n, hidden, dropout_p, BLOCK: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    rows, cols = offsets // hidden, offsets % hidden
    counter = rows.to(tl.int64) * ((hidden + 3) // 4) + cols // 4
    w0, w1, w2, w3 = tl.randint4x(seed, counter)
    word = tl.where(cols % 4 == 0, w0, tl.where(cols % 4 == 1, w1, tl.where(cols % 4 == 2, w2, w3)))
    keep = tl.uint_to_uniform_float(word) >= dropout_p
    tl.store(keep_ptr + offsets, keep.to(tl.int8), mask=offsets < n)


def tl_randint4x_keep(seed, shape, dropout_p):
    n = torch.Size(shape).numel()
    keep = torch.empty(n, dtype=torch.int8, device=DEVICE)
    _tl_randint4x_keep_kernel[(triton.cdiv(n, 1024),)](keep, seed, n, shape[-1], dropout_p, BLOCK=1024)
    return keep.cpu().bool().view(shape)


@needs_kernels
@pytest.mark.parametrize("hidden", [96, 94], ids=["H96", "H94"])
@pytest.mark.parametrize("seed", [1234, 2**40 + 7], ids=["seed_lo", "seed_hi"])
@pytest.mark.parametrize("dropout_p", [0.1, 0.5])
def test_dropout_mask_is_philox_four_columns_a_call(ops, seed, dropout_p, hidden):
    """d_x is d_residual / (1-p) where x was kept and 0 where it was dropped: the kept set is
    exactly philox.h's (four columns a Philox call; H 94 ends its rows inside a group), and it
    is the Python twin's."""
    shape = (3, 5, hidden)
    x, residual, weight, bias, grad_out = make_ln_inputs(shape, torch.float32, "both")
    seed_t = seed_tensor(seed, "cpu")
    _, mean, rstd, grads = run_ln(ops, x, residual, weight, bias, grad_out, seed_t, dropout_p)
    d_residual, d_x = grads[:2]
    assert torch.all(d_residual != 0), "a zero d_residual would hide the mask"
    keep = d_x != 0
    expected = tl_randint4x_keep(seed, shape, dropout_p)
    assert torch.equal(keep, expected), f"{(keep != expected).sum().item()} of {keep.numel()} mask bits differ"
    scale = torch.tensor(1 / (1 - dropout_p), dtype=torch.float32)
    assert torch.equal(d_x[keep], d_residual[keep] * scale), "kept: d_x = d_residual / (1-p)"
    twin_d_x = add_layernorm_mod._add_layernorm_bwd_cpu(grad_out, x, residual, weight, mean, rstd, seed_t,
                                                        dropout_p, True)[1]
    assert torch.equal(twin_d_x != 0, keep), "the Python twin draws the same mask"


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("dropout_p", [0.3, 1.0])
def test_dropout_forward_and_backward(ops, dtype, dropout_p):
    x, residual, weight, bias, grad_out = make_ln_inputs((40, 96), dtype, "both")
    seed = seed_tensor(77, "cpu")
    out, mean, rstd, grads = run_ln(ops, x, residual, weight, bias, grad_out, seed, dropout_p)
    keep = grads[1] != 0
    if dropout_p == 1.0:
        assert not keep.any(), "p = 1 drops everything"
    else:
        keep_rate = keep.double().mean().item()
        assert abs(keep_rate - (1 - dropout_p)) < 6 * (dropout_p * (1 - dropout_p) / keep.numel()) ** 0.5
    keep_scale = keep.double() * (1 / (1 - dropout_p) if dropout_p < 1 else 0.0)
    check_ln_against_eager(x, residual, weight, bias, grad_out, out, grads, keep_scale.to(dtype))
    twin_out = add_layernorm_mod._add_layernorm_fwd_cpu(x, residual, weight, bias, 1e-5, seed, dropout_p)[0]
    one_ulp = 1e-5 if dtype == torch.float32 else 2 ** -7
    assert_close(out, twin_out, atol=one_ulp, rtol=one_ulp, what="out vs twin")
    other_seed = ops.ext_add_layernorm_fwd(x, residual, weight, bias, 1e-5, seed_tensor(78, "cpu"), dropout_p)[0]
    assert torch.equal(out, other_seed) == (dropout_p == 1.0), "another seed, another mask"


_x, _w = torch.randn(4, 96), torch.randn(96)
LN_FWD_CASES = [
    ((torch.randn(4, 0),) * 2 + (None, None, 1e-5, None, 0.0), ValueError, "H >= 1"),
    ((_x, torch.randn(4, 95), None, None, 1e-5, None, 0.0), ValueError, "residual must have the shape of x"),
    ((_x, _x, torch.randn(95), None, 1e-5, None, 0.0), ValueError, r"weight must have shape \(96,\)"),
    ((_x, _x, _w, torch.randn(2, 96), 1e-5, None, 0.0), ValueError, r"bias must have shape \(96,\)"),
    ((_x.int(), _x.int(), None, None, 1e-5, None, 0.0), TypeError, "float32, float64, float16 or bfloat16"),
    ((_x, _x.double(), None, None, 1e-5, None, 0.0), TypeError, "residual must have the dtype of x"),
    ((_x, _x, _w.bfloat16(), None, 1e-5, None, 0.0), TypeError, "weight must have the dtype of x"),
    ((_x, _x, _w, _w, 1e-5, None, 1.5), ValueError, r"dropout_p must be in \[0, 1\]"),
    ((_x, _x, _w, _w, 1e-5, None, -0.1), ValueError, r"dropout_p must be in \[0, 1\]"),
    ((_x, _x, _w, _w, 1e-5, None, 0.1), ValueError, "needs a seed"),
    ((_x, _x, _w, _w, 1e-5, torch.tensor([1], dtype=torch.int32), 0.1), ValueError, "one-element int64"),
    ((_x, _x, _w, _w, 1e-5, torch.tensor([1, 2]), 0.1), ValueError, "one-element int64"),
]


@pytest.mark.parametrize("args,error,message", LN_FWD_CASES, ids=[c[2] for c in LN_FWD_CASES])
def test_add_layernorm_fwd_validation(ops_in_child, args, error, message):
    with pytest.raises(error, match=message):
        ops_in_child.ext_add_layernorm_fwd(*args)


def test_add_layernorm_bwd_validation(ops_in_child):
    x, w, stats = torch.randn(4, 96), torch.randn(96), torch.zeros(4)
    bwd = ops_in_child.ext_add_layernorm_bwd
    with pytest.raises(ValueError, match="grad_out must match x"):
        bwd(x.bfloat16(), x, x, w, stats, stats, None, 0.0, True)
    with pytest.raises(ValueError, match=r"mean must be the forward's Float \(4,\) tensor"):
        bwd(x, x, x, w, stats.double(), stats, None, 0.0, True)
    with pytest.raises(ValueError, match=r"rstd must be the forward's Float \(4,\) tensor"):
        bwd(x, x, x, w, stats, torch.zeros(3), None, 0.0, True)
    with pytest.raises(ValueError, match="needs a seed"):
        bwd(x, x, x, w, stats, stats, None, 0.5, True)


def test_a_tensor_left_on_meta_is_an_error_not_uninitialised_memory(ops):
    """The fake kernels also answer the Meta dispatch key, which outranks CPU and CUDA: one
    tensor left on "meta" among CPU ones (a model not fully materialised) reached them, and they
    returned uninitialised memory (found by review); they check as the ops do."""
    x, w, stats = torch.randn(4, 8), torch.randn(8), torch.zeros(4)
    meta = w.to("meta")
    with pytest.raises(ValueError, match=r"weight must be on the device of x \(cpu\), got meta"):
        ops.ext_add_layernorm_fwd(x, x, meta, w, 1e-5, None, 0.0)
    with pytest.raises(ValueError, match=r"bias must have shape \(8,\)"):
        ops.ext_add_layernorm_fwd(x, x, w, torch.empty(7, device="meta"), 1e-5, None, 0.0)
    with pytest.raises(ValueError, match=r"weight must be on the device of x \(cpu\), got meta"):
        bert_fast.ops.add_layernorm(x, x, meta, w, backend="cuda")
    with pytest.raises(ValueError, match=r"weight must be on the device of x \(cpu\), got meta"):
        ops.ext_add_layernorm_bwd(x, x, x, meta, stats, stats, None, 0.0, True)
    with pytest.raises(ValueError, match=r"rstd must be the forward's float32 \(4,\) tensor"):
        ops.ext_add_layernorm_bwd(x, x, x, w, stats, torch.zeros(3, device="meta"), None, 0.0, True)
    # All on meta (what torch.compile's fake tensors see): shapes, no error.
    out, mean, rstd = ops.ext_add_layernorm_fwd(x.to("meta"), x.to("meta"), meta, meta, 1e-5, None, 0.0)
    assert out.shape == (4, 8) and out.device.type == "meta" and mean.shape == rstd.shape == (4,)


# ---------------------------------------------------------------------------------------------
# backend="cuda" asks the extension before each call (extension.require_extension)

def test_cuda_backend_rejects_devices_the_extension_lacks(ops):
    x = torch.empty(2, 8, device="meta")
    with pytest.raises(ValueError, match="run on CPU and CUDA tensors, got a tensor on meta"):
        bert_fast.ops.add_layernorm(x, x, None, None, backend="cuda")
    ids = torch.zeros(1, 3, dtype=torch.long, device="meta")
    with pytest.raises(ValueError, match="got a tensor on meta"):
        bert_fast.ops.embedding_sum(ids, ids, torch.empty(5, 8, device="meta"), torch.empty(2, 8, device="meta"),
                                    torch.empty(1, 4, 8, device="meta"), backend="cuda")


def test_cuda_backend_without_cuda_kernels_says_so(ops, monkeypatch):
    # A CUDA tensor with an extension built without its CUDA ops: the check, not the dispatcher,
    # answers (the tensor's device is faked: this machine may have no GPU).
    monkeypatch.setitem(bert_fast.extension._state, "cuda_kernels", False)

    class OnCuda:
        is_cpu, is_cuda, device = False, True, torch.device("cuda")

    with pytest.raises(RuntimeError, match="built without CUDA"):
        bert_fast.extension.require_extension(OnCuda())
    bert_fast.extension.require_extension(torch.zeros(1))      # CPU tensors still pass
