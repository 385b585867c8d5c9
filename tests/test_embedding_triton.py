"""embedding_sum's Triton backend: the kernels (Triton's interpreter on CPU, CUDA when present),
the atomic and the deterministic backward, the registered ops (opcheck, gradcheck through their
CPU twins), the position table's opt-in gradient, and input validation."""

import pytest
import torch

from bert_fast.ops.embedding import (CARRY_BLOCK, _chunk_blocks, _embedding_sum_bwd_triton,
                                     _embedding_sum_fwd_triton, _embedding_sum_torch, embedding_sum,
                                     embedding_sum_bwd, embedding_sum_fwd)
from tests.helpers import (assert_close, assert_within_rule, BF16_OK, DEVICE,
                           max_err, needs_cuda, needs_kernels)



def make_tables(n_tokens, n_segments, max_len, hidden, dtype, device=DEVICE):
    return (torch.randn(n_tokens, hidden, device=device).to(dtype),
            torch.randn(n_segments, hidden, device=device).to(dtype),
            torch.randn(1, max_len, hidden, device=device).to(dtype))


def torch_embedding_sum(tokens, segments, tables, positions, grad_out):
    """PyTorch at the tables' precision (the learnable form): out and the three table grads."""
    leaves = [t.detach().requires_grad_() for t in tables]
    out = _embedding_sum_torch(tokens, segments, *leaves, positions, True)
    return out.detach(), list(torch.autograd.grad(out, leaves, grad_out))


def index_case(case, device=DEVICE):
    """(tokens, segments, positions, n_tokens, max_len) for a named layout.

    Token ids come from a few values, so rows repeat ids: the atomics hit one address from many
    rows, and the deterministic reduction sees runs that cross its 16-row chunks."""
    if case == "padded":          # (3, 7), tokens read through a transpose (non-contiguous)
        tokens = torch.randint(0, 4, (7, 3), device=device).t()
        return tokens, torch.randint(0, 2, (3, 7), device=device, dtype=torch.int32), None, 11, 9
    if case == "padded_B1":
        return (torch.randint(0, 3, (1, 21), device=device), torch.randint(0, 2, (1, 21), device=device),
                None, 5, 21)
    if case == "padded_L1":
        return (torch.randint(0, 3, (6, 1), device=device), torch.randint(0, 2, (6, 1), device=device),
                None, 5, 4)
    if case == "unpadded":        # int32 ids; positions repeat too
        n = 45
        return (torch.randint(0, 5, (n,), device=device, dtype=torch.int32),
                torch.randint(0, 2, (n,), device=device, dtype=torch.int32),
                torch.randint(0, 12, (n,), device=device, dtype=torch.int32), 7, 12)
    raise ValueError(case)


def run_kernels(case, hidden, dtype, learn_pos_embedding, deterministic, device=DEVICE):
    tokens, segments, positions, n_tokens, max_len = index_case(case, device)
    tables = make_tables(n_tokens, 2, max_len, hidden, dtype, device)
    grad_out = torch.randn(*tokens.shape, hidden, device=device).to(dtype)
    out = _embedding_sum_fwd_triton(tokens, segments, *tables, positions)
    grads = _embedding_sum_bwd_triton(grad_out, tokens, segments, positions, n_tokens, 2, max_len,
                                      learn_pos_embedding, deterministic)
    return (tokens, segments, positions, tables, grad_out), out, grads


def check_against_torch(inputs, out, grads, learn_pos_embedding):
    tokens, segments, positions, tables, grad_out = inputs
    ref_out, ref_grads = torch_embedding_sum(tokens, segments, [t.double() for t in tables], positions,
                                             grad_out.double())
    same_out, same_grads = torch_embedding_sum(tokens, segments, tables, positions, grad_out)
    assert out.dtype == tables[0].dtype
    assert_within_rule(out, ref_out, same_out, "out")
    names = ("token grad", "segment grad", "position grad")
    for actual, ref, same, name in zip(grads[:2], ref_grads, same_grads, names):
        assert_within_rule(actual, ref, same, name)
    if learn_pos_embedding:
        assert_within_rule(grads[2], ref_grads[2], same_grads[2], names[2])
    else:
        assert grads[2].numel() == 0, "no position gradient unless learn_pos_embedding"


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("case,hidden", [("padded", 96), ("padded_B1", 1000), ("padded_L1", 768),
                                         ("unpadded", 37)])
def test_forward_matches_torch(case, hidden, dtype):
    inputs, out, _ = run_kernels(case, hidden, dtype, False, False)
    tokens, segments, positions, tables, grad_out = inputs
    ref_out, _ = torch_embedding_sum(tokens, segments, [t.double() for t in tables], positions, grad_out.double())
    same_out, _ = torch_embedding_sum(tokens, segments, tables, positions, grad_out)
    assert out.shape == (*tokens.shape, hidden)
    assert_within_rule(out, ref_out, same_out, "out")


# H = 96 and 37 are not powers of two (37 is not a multiple of the 32-wide H blocks either).
@needs_kernels
@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic", "deterministic"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("case,hidden,learn_pos_embedding", [("padded", 96, True), ("padded_B1", 37, True),
                                                             ("padded_L1", 96, False), ("unpadded", 37, True),
                                                             ("unpadded", 37, False)])
def test_kernels_match_torch(case, hidden, learn_pos_embedding, dtype, deterministic):
    check_against_torch(*run_kernels(case, hidden, dtype, learn_pos_embedding, deterministic),
                        learn_pos_embedding)


@needs_kernels
def test_strided_tables_give_the_contiguous_result():
    tokens, segments, _, n_tokens, max_len = index_case("padded")
    wide = [torch.randn(n_tokens, 120, device=DEVICE), torch.randn(2, 120, device=DEVICE),
            torch.randn(1, max_len, 120, device=DEVICE)]
    strided = [wide[0][:, 7:103], wide[1][:, :96], wide[2][:, :, 20:116]]
    out = _embedding_sum_fwd_triton(tokens, segments, *strided, None)
    expected = _embedding_sum_fwd_triton(tokens.contiguous(), segments, *[t.contiguous() for t in strided], None)
    assert torch.equal(out, expected), f"max abs difference {max_err(out, expected):.3g}"


def long_runs(kind, n, device=DEVICE):
    """Sorted-id layouts that stress the deterministic reduction's chunk boundaries."""
    chunk = _chunk_blocks(1)[0]
    if kind == "one_id":          # one run over every chunk: the carry pass loops over > CARRY_BLOCK heads
        return torch.full((n,), 3, device=device)
    if kind == "chunk_aligned":   # runs of exactly one and two chunks, starting at chunk starts
        lengths = torch.tensor([chunk, 2 * chunk], device=device).repeat(n // (3 * chunk) + 1)
        return torch.repeat_interleave(torch.arange(len(lengths), device=device), lengths)[:n]
    return torch.where(torch.rand(n, device=device) < 0.8, 0, torch.randint(0, 6, (n,), device=device))


@needs_kernels
@pytest.mark.parametrize("kind,n", [("one_id", 300), ("chunk_aligned", 100), ("mostly_one_id", 150)])
def test_deterministic_backward_is_repeatable_and_matches_atomics(kind, n):
    hidden, max_len = 20, 8
    if kind == "one_id":
        assert n > _chunk_blocks(hidden)[0] * (CARRY_BLOCK + 1), "the run must outlast one carry step"
    tokens = long_runs(kind, n)[torch.randperm(n, device=DEVICE)]
    n_tokens = int(tokens.max()) + 1
    segments = torch.randint(0, 2, (n,), device=DEVICE)
    positions = torch.randint(0, max_len, (n,), device=DEVICE)
    grad_out = torch.randn(n, hidden, device=DEVICE)
    args = (grad_out, tokens, segments, positions, n_tokens, 2, max_len, True)
    first = _embedding_sum_bwd_triton(*args, True)
    second = _embedding_sum_bwd_triton(*args, True)
    atomic = _embedding_sum_bwd_triton(*args, False)
    _, reference = torch_embedding_sum(tokens, segments, make_tables(n_tokens, 2, max_len, hidden, torch.float64),
                                       positions, grad_out.double())
    for a, b, c, ref, name in zip(first, second, atomic, reference, ("token", "segment", "position")):
        assert torch.equal(a, b), f"{name} grad: two deterministic calls differ by {max_err(a, b):.3g}"
        # fp32 sums of up to 300 unit normals: ~1e-5 apart in any order.
        assert_close(a, c, atol=1e-4, what=f"{name} grad, deterministic vs atomic")
        assert_close(a, ref.float(), atol=1e-4, what=f"{name} grad vs fp64")


@needs_kernels
@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic", "deterministic"])
def test_empty_packed_batch(deterministic):
    """All sequences empty (skip_padding with valid_lens 0): N = 0 launches nothing."""
    empty = torch.zeros(0, dtype=torch.int64, device=DEVICE)
    tables = make_tables(5, 2, 4, 8, torch.float32)
    out = _embedding_sum_fwd_triton(empty, empty, *tables, empty)
    grads = _embedding_sum_bwd_triton(out, empty, empty, empty, 5, 2, 4, True, deterministic)
    assert out.shape == (0, 8)
    for grad, table in zip(grads, tables):
        assert torch.equal(grad, torch.zeros_like(table).view(grad.shape)) and grad.shape[-2] == table.shape[-2]


# The registered ops on CPU run their PyTorch twins.
@pytest.mark.parametrize("case", ["padded", "unpadded"])
def test_opcheck(case):
    tokens, segments, positions, n_tokens, max_len = index_case(case, "cpu")
    tables = [t.requires_grad_() for t in make_tables(n_tokens, 2, max_len, 6, torch.float32, "cpu")]
    torch.library.opcheck(embedding_sum_fwd, (tokens, segments, *tables, positions, False))
    grad_out = torch.randn(*tokens.shape, 6)
    for learn_pos_embedding, deterministic in ((True, False), (False, True)):
        torch.library.opcheck(embedding_sum_bwd, (grad_out, tokens, segments, positions, n_tokens, 2, max_len,
                                                  learn_pos_embedding, deterministic))


@pytest.mark.parametrize("case,learn_pos_embedding", [("padded", False), ("padded", True), ("unpadded", True)])
def test_gradcheck_through_triton_backend(case, learn_pos_embedding):
    tokens, segments, positions, n_tokens, max_len = index_case(case, "cpu")
    tables = [t.requires_grad_() for t in make_tables(n_tokens, 2, max_len, 3, torch.float64, "cpu")]
    pos_weight = tables[2] if learn_pos_embedding else tables[2].detach()

    def fn(token_weight, segment_weight, pos_weight):
        return embedding_sum(tokens, segments, token_weight, segment_weight, pos_weight, positions=positions,
                             learn_pos_embedding=learn_pos_embedding, backend="triton")

    assert torch.autograd.gradcheck(fn, (*tables[:2], pos_weight))


@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic", "deterministic"])
@pytest.mark.parametrize("learn_pos_embedding", [False, True], ids=["frozen_pos", "learn_pos"])
@pytest.mark.parametrize("case", ["padded", "unpadded"])
def test_triton_backend_matches_torch_backend(case, learn_pos_embedding, deterministic):
    """The public function: same output and gradients; pos_weight gets one only when asked."""
    tokens, segments, positions, n_tokens, max_len = index_case(case, "cpu")
    tables = make_tables(n_tokens, 2, max_len, 10, torch.float32, "cpu")
    grad_out = torch.randn(*tokens.shape, 10)
    results = []
    for backend in ("torch", "triton"):
        leaves = [t.clone().requires_grad_() for t in tables]
        out = embedding_sum(tokens, segments, *leaves, positions=positions,
                            learn_pos_embedding=learn_pos_embedding, backend=backend,
                            deterministic=deterministic)
        out.backward(grad_out)
        results.append((out, *(t.grad for t in leaves)))
    torch_run, triton_run = results
    for a, b, name in zip(triton_run, torch_run, ("out", "token grad", "segment grad", "position grad")):
        if b is None:
            assert a is None, f"{name}: the triton backend gave one, the torch backend none"
        else:
            assert_close(a, b, atol=1e-5, what=name)
    assert (triton_run[3] is None) == (not learn_pos_embedding)


def test_unknown_backend():
    tokens, segments, _, n_tokens, max_len = index_case("padded", "cpu")
    with pytest.raises(ValueError, match="backend must be 'torch', 'triton' or 'cuda'"):
        embedding_sum(tokens, segments, *make_tables(n_tokens, 2, max_len, 4, torch.float32, "cpu"),
                      backend="CUDA")


_tok = torch.zeros(2, 3, dtype=torch.int64)
_flat = torch.zeros(6, dtype=torch.int64)
_tw, _sw, _pw = torch.randn(5, 4), torch.randn(2, 4), torch.randn(1, 8, 4)
FWD_VALIDATION_CASES = [
    ((_tok.float(), _tok, _tw, _sw, _pw, None), TypeError, "tokens must be an int32 or int64 tensor"),
    ((_tok, _tok.to(torch.int16), _tw, _sw, _pw, None), TypeError, "segments must be an int32 or int64"),
    ((_flat, _flat, _tw, _sw, _pw, _flat.float()), TypeError, "positions must be an int32 or int64"),
    ((_tok[None], _tok[None], _tw, _sw, _pw, None), ValueError, r"tokens must be \(B, L\) \(padded\) or \(N,\)"),
    ((_tok, _tok[:, :2], _tw, _sw, _pw, None), ValueError, "segments must have the shape of tokens"),
    ((_flat, _flat, _tw, _sw, _pw, None), ValueError, r"packed \(1-D\) tokens need positions"),
    ((_tok, _tok, _tw, _sw, _pw, _tok), ValueError, r"positions are only for packed \(1-D\) tokens"),
    ((_flat, _flat, _tw, _sw, _pw, _flat[:5]), ValueError, "positions must have the shape of tokens"),
    ((_tok, _tok, _tw[0], _sw, _pw, None), ValueError, r"must be 2-D \(rows, H\)"),
    ((_tok, _tok, _tw, _sw, _pw[0], None), ValueError, r"pos_weight must be \(1, max_len, H\)"),
    ((_tok, _tok, _tw[:, :0], _sw[:, :0], _pw[:, :, :0], None), ValueError, "H >= 1"),
    ((_tok, _tok, _tw, _sw[:, :3], _pw, None), ValueError, "all tables need the same H"),
    ((_tok, _tok, _tw, _sw, _pw[:, :, :3], None), ValueError, "all tables need the same H"),
    ((_tok, _tok, _tw, _sw.half(), _pw, None), TypeError, "all tables need one dtype"),
    ((_tok, _tok, _tw, _sw, _pw[:, :2], None), ValueError, "length 3 exceeds the position table's max_len 2"),
    ((_tok, _tok.to("meta"), _tw, _sw, _pw, None), ValueError, "segments is on meta"),
    ((_tok, _tok, _tw.double(), _sw.double(), _pw.double(), None), TypeError, "float16, bfloat16 or float32"),
]


@pytest.mark.parametrize("args,error,message", FWD_VALIDATION_CASES, ids=[c[2] for c in FWD_VALIDATION_CASES])
def test_forward_launcher_validation(args, error, message):
    with pytest.raises(error, match=message):
        _embedding_sum_fwd_triton(*args)


_grad = torch.randn(2, 3, 4)
BWD_VALIDATION_CASES = [
    ((_grad[:, :2], _tok, _tok, None, 5, 2, 8), ValueError, r"grad_out must be tokens.shape \+ \(H,\)"),
    ((_grad[..., :0], _tok, _tok, None, 5, 2, 8), ValueError, "grad_out needs H >= 1"),
    ((_grad, _tok, _tok.double(), None, 5, 2, 8), TypeError, "segments must be an int32 or int64"),
    ((_grad.view(6, 4), _flat, _flat, None, 5, 2, 8), ValueError, r"packed \(1-D\) tokens need positions"),
    ((_grad, _tok, _tok, None, 0, 2, 8), ValueError, r"n_tokens \(rows of that table\) must be >= 1"),
    ((_grad, _tok, _tok, None, 5, 2, 2), ValueError, "exceeds the position table's max_len 2"),
    ((_grad, _tok.to("meta"), _tok, None, 5, 2, 8), ValueError, "tokens is on meta"),
    ((_grad.double(), _tok, _tok, None, 5, 2, 8), TypeError, "float16, bfloat16 or float32"),
]


@pytest.mark.parametrize("args,error,message", BWD_VALIDATION_CASES, ids=[c[2] for c in BWD_VALIDATION_CASES])
def test_backward_launcher_validation(args, error, message):
    with pytest.raises(error, match=message):
        _embedding_sum_bwd_triton(*args, True, False)


# GPU: BERT-base sizes (vocab 30522, H 768), fp16 and bf16, padded and packed, vs the torch path.
GPU_DTYPES = [torch.float16] + ([torch.bfloat16] if BF16_OK else [])


def gpu_inputs(dtype, packed, vocab=30522, hidden=768, batch=8, seqlen=512):
    tables = make_tables(vocab, 2, 512, hidden, dtype, "cuda")
    tokens = torch.randint(0, vocab, (batch, seqlen), device="cuda")
    tokens[:, seqlen // 2:] = 0     # padding: a 2K-row run of one id
    segments = torch.randint(0, 2, (batch, seqlen), device="cuda")
    positions = None
    if packed:
        valid = torch.arange(seqlen, device="cuda") < torch.randint(1, seqlen + 1, (batch, 1), device="cuda")
        positions = torch.arange(seqlen, device="cuda").expand(batch, -1)[valid]
        tokens, segments = tokens[valid], segments[valid]
    return tokens, segments, positions, tables, torch.randn(*tokens.shape, hidden, device="cuda").to(dtype)


@needs_cuda
@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic", "deterministic"])
@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
@pytest.mark.parametrize("dtype", GPU_DTYPES, ids=str)
def test_gpu_kernels_match_torch(dtype, packed, deterministic):
    tokens, segments, positions, tables, grad_out = gpu_inputs(dtype, packed)
    out = _embedding_sum_fwd_triton(tokens, segments, *tables, positions)
    grads = _embedding_sum_bwd_triton(grad_out, tokens, segments, positions, 30522, 2, 512, True, deterministic)
    check_against_torch((tokens, segments, positions, tables, grad_out), out, grads, True)


@needs_cuda
@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
def test_gpu_deterministic_backward_is_bitwise_repeatable(packed):
    tokens, segments, positions, _, grad_out = gpu_inputs(torch.float16, packed)
    args = (grad_out, tokens, segments, positions, 30522, 2, 512, True, True)
    first, second = _embedding_sum_bwd_triton(*args), _embedding_sum_bwd_triton(*args)
    for a, b, name in zip(first, second, ("token", "segment", "position")):
        assert torch.equal(a, b), f"{name} grad: two calls differ by {max_err(a, b):.3g}"


@needs_cuda
def test_gpu_public_function_and_compile_match_torch_backend():
    tokens, segments, positions, tables, grad_out = gpu_inputs(torch.float16, packed=True)

    def run(backend, compile_it=False):
        leaves = [t.clone().requires_grad_() for t in tables]
        fn = lambda *w: embedding_sum(tokens, segments, *w, positions=positions, learn_pos_embedding=True,
                                      backend=backend)
        out = (torch.compile(fn, fullgraph=True) if compile_it else fn)(*leaves)
        return (out, *torch.autograd.grad(out, leaves, grad_out))

    expected = run("torch")
    for results in (run("triton"), run("triton", compile_it=True)):
        for a, b, name in zip(results, expected, ("out", "token grad", "segment grad", "position grad")):
            assert_close(a.float(), b.float(), atol=5e-2, rtol=1e-2, what=name)
