"""embedding_sum with ids outside their tables (check_inputs=False, torch.compile): no backend
reads outside a table or wraps a negative id.

- CPU paths (the torch backend on CPU tensors, the triton backend's CPU kernels, the cuda
  backend's C++ CPU op), forward and backward: IndexError naming the tensor, the id and the
  allowed range.
- The Triton kernels (run here in the interpreter through interpreted_kernels(), as on a GPU): an
  out-of-range id is never dereferenced; that table adds zeros to the row in the forward, and
  the row adds nothing to that table in the backward (atomic and deterministic).
- Compiled (CPU): the torch backend's lookups and the triton backend's CPU kernel (traced into)
  guard as the Triton kernels do, as does embedding_layernorm's; the cuda backend's registered
  op raises as in eager. Never the wrapped row.

Calls that could read or write out of bounds run in a child process (tests/isolated.py), so a
crash fails one test instead of the run. Tables sit inside NaN-filled buffers: a read one row
before or after a table gives NaN in the output.
"""

import pytest
import torch
from torch.nn import functional as F

from bert_fast.backend import available_backends
from bert_fast.ops import embedding as emb
from bert_fast.ops._triton import interpreting
from bert_fast.ops.embedding_layernorm import embedding_layernorm
from tests.helpers import interpreted_kernels, needs_cuda
from tests.isolated import call_in_child

N_TOKENS, N_SEGMENTS, MAX_LEN, HIDDEN = 6, 2, 8, 16
BACKENDS = [b for b in available_backends() if b != "auto"]
TABLE_ROWS = {"tokens": N_TOKENS, "segments": N_SEGMENTS, "positions": MAX_LEN}
# (form, which ids, the bad value's name): padded ids read position j at column j, so only the
# packed form has position ids to get wrong.
CASES = [(form, kind, value) for form in ("padded", "packed") for kind in TABLE_ROWS
         for value in ("negative", "too_large") if not (form == "padded" and kind == "positions")]
CASE_IDS = [f"{form}-{kind}-{value}" for form, kind, value in CASES]
BAD_ROW = 3           # the flat index of the bad id
# interpreted_kernels() needs the interpreter; on a GPU the GPU test below runs the same kernels.
needs_interpreter = pytest.mark.skipif(torch.cuda.is_available() or not interpreting(),
                                       reason="Triton's interpreter (TRITON_INTERPRET=1, no GPU)")


def bad_value(kind, value):
    return -1 if value == "negative" else TABLE_ROWS[kind]


def guarded_tables(dtype=torch.float32):
    """The three tables, each a view into a buffer with a NaN row on either side."""
    def inside(rows, lead=()):
        buf = torch.full((*lead, rows + 2, HIDDEN), float("nan"), dtype=dtype)
        table = buf[..., 1:rows + 1, :]
        table.copy_(torch.randn(*lead, rows, HIDDEN).to(dtype))
        return table
    torch.manual_seed(0)
    return inside(N_TOKENS), inside(N_SEGMENTS), inside(MAX_LEN, (1,))


def ids_with_bad(form, kind, value):
    """(tokens, segments, positions) with one id of ``kind`` set out of range at BAD_ROW."""
    g = torch.Generator().manual_seed(1)
    if form == "padded":
        shape, positions = (2, 5), None
    else:
        shape = (10,)
        positions = torch.randint(0, MAX_LEN, shape, generator=g)
    ids = {"tokens": torch.randint(0, N_TOKENS, shape, generator=g),
           "segments": torch.randint(0, N_SEGMENTS, shape, generator=g), "positions": positions}
    ids[kind].view(-1)[BAD_ROW] = bad_value(kind, value)
    return ids["tokens"], ids["segments"], ids["positions"]


def message(kind, value):
    n = TABLE_ROWS[kind]
    return rf"{kind} id {bad_value(kind, value)} at flat index {BAD_ROW} .* ids must be in \[0, {n}\)"


def position_ids(tokens, positions):
    return positions if positions is not None else torch.arange(tokens.shape[-1]).expand_as(tokens)


def guarded_reference(tokens, segments, positions, tables, grad_out):
    """The documented guarded result, in fp64: an out-of-range id's table adds zeros to the row
    (forward) and gets nothing from it (backward)."""
    out = torch.zeros(*tokens.shape, HIDDEN, dtype=torch.float64)
    grads = []
    g = grad_out.double().reshape(-1, HIDDEN)
    for ids, table in zip((tokens, segments, position_ids(tokens, positions)),
                          (tables[0], tables[1], tables[2][0])):
        rows = table.shape[0]
        ok = (ids >= 0) & (ids < rows)
        safe = torch.where(ok, ids, 0)
        out += torch.where(ok[..., None], table.double()[safe], 0.0)
        flat_ok, flat = ok.reshape(-1), safe.reshape(-1)
        grads.append(torch.zeros(rows, HIDDEN, dtype=torch.float64).index_add_(0, flat[flat_ok], g[flat_ok]))
    return out, grads


def wrapped_row(tokens, segments, positions, tables):
    """What row BAD_ROW would be if a negative id counted from the end of its table."""
    token_table, segment_table, pos_table = tables[0], tables[1], tables[2][0]
    pos = position_ids(tokens, positions).reshape(-1)[BAD_ROW]
    return (token_table[tokens.reshape(-1)[BAD_ROW]] + segment_table[segments.reshape(-1)[BAD_ROW]]
            + pos_table[pos]).double()


# ---------------------------------------------------------------------------------------------
# Child-process entry points (module level: call_in_child pickles them by reference).

def embedding_forward(backend, tokens, segments, positions, tables, kernels):
    """embedding_sum's forward (Triton launchers on CPU tensors when ``kernels``)."""
    if kernels:
        with interpreted_kernels():
            return emb.embedding_sum(tokens, segments, *tables, positions=positions, backend=backend,
                                     learn_pos_embedding=True)
    return emb.embedding_sum(tokens, segments, *tables, positions=positions, backend=backend,
                             learn_pos_embedding=True)


def embedding_forward_backward(backend, tokens, segments, positions, tables, grad_out, kernels, deterministic):
    """(out, [token_grad, segment_grad, pos_grad]) through embedding_sum's autograd."""
    leaves = [t.detach().clone().requires_grad_() for t in tables]
    if kernels:
        with interpreted_kernels():
            out = emb.embedding_sum(tokens, segments, *leaves, positions=positions, backend=backend,
                                    learn_pos_embedding=True, deterministic=deterministic)
            out.backward(grad_out)
    else:
        out = emb.embedding_sum(tokens, segments, *leaves, positions=positions, backend=backend,
                                learn_pos_embedding=True, deterministic=deterministic)
        out.backward(grad_out)
    return out.detach(), [leaf.grad for leaf in leaves]


def backward_op(backend, grad_out, tokens, segments, positions, deterministic):
    """The backward op alone (the CPU kernel: triton's registered op, or the extension's)."""
    rows = (N_TOKENS, N_SEGMENTS, MAX_LEN)
    if backend == "cuda":
        return torch.ops.bert_fast.ext_embedding_sum_bwd(grad_out, tokens, segments, positions, *rows, True)
    return emb.embedding_sum_bwd(grad_out, tokens, segments, positions, *rows, True, deterministic)


def triton_backward(grad_out, tokens, segments, positions, deterministic):
    """The Triton backward launcher (interpreter), as a GPU calls it."""
    return emb._embedding_sum_bwd_triton(grad_out, tokens, segments, positions, N_TOKENS, N_SEGMENTS, MAX_LEN,
                                         True, deterministic)


# ---------------------------------------------------------------------------------------------
# CPU paths: a clear IndexError, forward and backward.

@pytest.mark.parametrize("form,kind,value", CASES, ids=CASE_IDS)
@pytest.mark.parametrize("backend", BACKENDS)
def test_cpu_paths_raise_a_clear_error(backend, form, kind, value):
    tokens, segments, positions = ids_with_bad(form, kind, value)
    tables = guarded_tables()
    with pytest.raises(IndexError, match=message(kind, value)):
        call_in_child(embedding_forward, backend, tokens, segments, positions, tables, False)
    if backend == "torch":
        return        # its backward is F.embedding's, reached only through the forward above
    grad_out = torch.randn(*tokens.shape, HIDDEN)
    for deterministic in (False, True):
        with pytest.raises(IndexError, match=message(kind, value)):
            call_in_child(backward_op, backend, grad_out, tokens, segments, positions, deterministic)


# ---------------------------------------------------------------------------------------------
# The Triton kernels (interpreter): guarded, never the wrapped row, nothing out of bounds.

@pytest.mark.parametrize("form,kind,value", CASES, ids=CASE_IDS)
@needs_interpreter
def test_triton_forward_is_guarded(form, kind, value):
    tokens, segments, positions = ids_with_bad(form, kind, value)
    tables = guarded_tables()
    out = call_in_child(embedding_forward, "triton", tokens, segments, positions, tables, True)
    assert not out.isnan().any(), "the kernel read a row outside a table"
    expected, _ = guarded_reference(tokens, segments, positions, tables, torch.zeros(*tokens.shape, HIDDEN))
    torch.testing.assert_close(out.double(), expected, atol=1e-6, rtol=0)
    if value == "negative":
        got = out.reshape(-1, HIDDEN)[BAD_ROW].double()
        assert not torch.allclose(got, wrapped_row(tokens, segments, positions, tables)), "a wrapped index"


@needs_interpreter
@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic", "deterministic"])
@pytest.mark.parametrize("form,kind,value", CASES, ids=CASE_IDS)
def test_triton_backward_is_guarded(form, kind, value, deterministic):
    tokens, segments, positions = ids_with_bad(form, kind, value)
    tables = guarded_tables()
    grad_out = torch.randn(*tokens.shape, HIDDEN, generator=torch.Generator().manual_seed(2))
    _, expected = guarded_reference(tokens, segments, positions, tables, grad_out)
    grads = call_in_child(triton_backward, grad_out, tokens, segments, positions, deterministic)
    for name, got, want in zip(("token", "segment", "position"), grads, expected):
        torch.testing.assert_close(got.reshape(want.shape).double(), want, atol=1e-5, rtol=0,
                                   msg=lambda m, name=name: f"{name} gradient: {m}")
    # And through embedding_sum's autograd (the eager path a GPU takes).
    out, leaf_grads = call_in_child(embedding_forward_backward, "triton", tokens, segments, positions, tables,
                                    grad_out, True, deterministic)
    assert not out.isnan().any()
    for got, want in zip(leaf_grads, expected):
        torch.testing.assert_close(got.reshape(want.shape).double(), want, atol=1e-5, rtol=0)


# ---------------------------------------------------------------------------------------------
# torch.compile (CPU): never the wrapped row, never an unchecked read.

def _compiled_embedding_sum(tokens, segments, token_weight, segment_weight, pos_weight, positions, backend):
    return emb.embedding_sum(tokens, segments, token_weight, segment_weight, pos_weight, positions=positions,
                             backend=backend, learn_pos_embedding=True)


def compiled_forward(backend, tokens, segments, positions, tables):
    """Inference (no table needs a gradient): a graph of its own, with no backward."""
    compiled = torch.compile(_compiled_embedding_sum, fullgraph=True, dynamic=False)
    return compiled(tokens, segments, *tables, positions, backend)


def compiled_forward_backward(backend, tokens, segments, positions, tables, grad_out):
    """(out, table gradients, border gradients). The leaves are the NaN-bordered buffers and the
    compiled call takes the tables as views into them: a read outside a table gives NaN, a write
    outside one shows as a gradient on a border row."""
    compiled = torch.compile(_compiled_embedding_sum, fullgraph=True, dynamic=False)
    buffers = []
    for table in tables:      # (rebuilt here: a view's base does not cross to the child process)
        buffer = torch.full((*table.shape[:-2], table.shape[-2] + 2, HIDDEN), float("nan"), dtype=table.dtype)
        buffer[..., 1:-1, :] = table
        buffers.append(buffer.requires_grad_())
    out = compiled(tokens, segments, *(b[..., 1:-1, :] for b in buffers), positions, backend)
    grads = torch.autograd.grad(out, buffers, grad_out)
    return (out.detach(), [g[..., 1:-1, :] for g in grads],
            torch.stack([g[..., (0, -1), :].reshape(2, -1) for g in grads]))


@pytest.mark.parametrize("form,kind,value", CASES, ids=CASE_IDS)
@pytest.mark.parametrize("backend", [b for b in BACKENDS if b in ("torch", "triton")])
def test_compiled_lookups_guard(backend, form, kind, value):
    """Compiled, the torch backend's lookups and the triton backend's CPU kernel (traced into,
    as every triton_op) guard as the Triton kernels do, forward and backward: ids are not
    readable while tracing, and Inductor itself asserts on torch 2.13 but reads and writes
    outside the table unchecked on 2.11."""
    tokens, segments, positions = ids_with_bad(form, kind, value)
    tables = guarded_tables()
    grad_out = torch.randn(*tokens.shape, HIDDEN, generator=torch.Generator().manual_seed(2))
    expected_out, expected = guarded_reference(tokens, segments, positions, tables, grad_out)
    # Inference: torch 2.11's Inductor wrapped a negative id in the triton backend's graph.
    out = call_in_child(compiled_forward, backend, tokens, segments, positions, tables)
    assert not out.isnan().any(), "a read outside a table"
    torch.testing.assert_close(out.double(), expected_out, atol=1e-5, rtol=0)
    out, grads, borders = call_in_child(compiled_forward_backward, backend, tokens, segments, positions, tables,
                                        grad_out)
    assert not out.isnan().any(), "a read outside a table"
    assert not borders.any(), "a gradient written outside a table"
    torch.testing.assert_close(out.double(), expected_out, atol=1e-5, rtol=0)
    for got, want in zip(grads, expected):
        torch.testing.assert_close(got.reshape(want.shape).double(), want, atol=1e-5, rtol=0)


def compiled_embedding_layernorm(tokens, segments, positions, tables, weight, bias):
    def call(tokens, segments, token_weight, segment_weight, pos_weight, positions):
        return embedding_layernorm(tokens, segments, token_weight, segment_weight, pos_weight, weight, bias, 1e-5,
                                   positions=positions, backend="triton")
    return torch.compile(call, fullgraph=True, dynamic=False)(tokens, segments, tables[0], tables[1], tables[2][0],
                                                              positions)


@pytest.mark.parametrize("form,kind,value", CASES, ids=CASE_IDS)
def test_compiled_embedding_layernorm_guards(form, kind, value):
    """embedding_layernorm (the HF path) compiled: an out-of-range id's table adds a zero row to
    the normalised sum, as embedding_sum's guarded lookups."""
    tokens, segments, positions = ids_with_bad(form, kind, value)
    tables = guarded_tables()
    weight, bias = torch.randn(HIDDEN), torch.randn(HIDDEN)
    out = call_in_child(compiled_embedding_layernorm, tokens, segments, positions, tables, weight, bias)
    summed, _ = guarded_reference(tokens, segments, positions, tables, torch.zeros(*tokens.shape, HIDDEN))
    expected = F.layer_norm(summed, (HIDDEN,), weight.double(), bias.double(), 1e-5)
    torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=0)


@pytest.mark.skipif("cuda" not in BACKENDS, reason="the extension is not built")
def test_compiled_extension_op_raises_on_cpu():
    """Compiled, the cuda backend calls the extension's registered op, opaque to Inductor,
    whose C++ CPU kernel checks the ids on the host as in eager."""
    compiled = torch.compile(_compiled_embedding_sum, fullgraph=True, dynamic=False)
    tables = guarded_tables()
    tokens, segments, positions = ids_with_bad("packed", "tokens", "negative")
    assert not compiled(tokens.clamp(min=0), segments, *tables, positions, "cuda").isnan().any()
    for kind in TABLE_ROWS:
        for value in ("negative", "too_large"):
            tokens, segments, positions = ids_with_bad("packed", kind, value)
            with pytest.raises((RuntimeError, IndexError), match="out of (bounds|range)"):
                compiled(tokens, segments, *tables, positions, "cuda")


# ---------------------------------------------------------------------------------------------
# On a GPU: the Triton kernels and the extension's CUDA kernels give the same guarded result.

def cuda_forward_backward(backend, tokens, segments, positions, tables, grad_out, deterministic):
    args = [t.cuda() if t is not None else None for t in (tokens, segments, positions)]
    out, grads = embedding_forward_backward(backend, *args, [t.cuda() for t in tables], grad_out.cuda(), False,
                                            deterministic)
    return out.cpu(), [g.cpu() for g in grads]


@needs_cuda
@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic", "deterministic"])
@pytest.mark.parametrize("form,kind,value", CASES, ids=CASE_IDS)
@pytest.mark.parametrize("backend", [b for b in BACKENDS if b in ("triton", "cuda")])
def test_gpu_kernels_are_guarded(backend, form, kind, value, deterministic):
    tokens, segments, positions = ids_with_bad(form, kind, value)
    tables = [t.contiguous() for t in guarded_tables()]
    grad_out = torch.randn(*tokens.shape, HIDDEN, generator=torch.Generator().manual_seed(2))
    expected_out, expected = guarded_reference(tokens, segments, positions, tables, grad_out)
    out, grads = call_in_child(cuda_forward_backward, backend, tokens, segments, positions, tables, grad_out,
                               deterministic)
    torch.testing.assert_close(out.double(), expected_out, atol=1e-5, rtol=0)
    for got, want in zip(grads, expected):
        torch.testing.assert_close(got.reshape(want.shape).double(), want, atol=1e-5, rtol=0)
