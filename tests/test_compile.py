"""The fast modules under torch.compile (CPU: the fused-PyTorch path)."""

import pathlib
import subprocess
import sys

import pytest
import torch

import bert_fast
from bert_fast.backend import available_backends

from tests.helpers import assert_close, encoder_config, encoder_pair, needs_cuda, random_inputs
from tests.isolated import BackgroundProcess


def assert_same_gradients(fast, compiled, tokens, segments, valid_lens):
    """The compiled module (of ``fast``) gives eager's parameter gradients."""
    grads = []
    for model in (fast, compiled):
        fast.zero_grad(set_to_none=True)
        out = model(tokens, segments, valid_lens)
        (out * torch.linspace(-1, 1, out.shape[-1])).sum().backward()
        grads.append({name: p.grad.clone() for name, p in fast.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys() and grads[0]
    for name, grad in grads[0].items():
        assert_close(grads[1][name], grad, atol=1e-4, rtol=1e-4, what=f"grad {name}")


# Inductor compiles the 1-D case (what torch.compile does by default); the 2-D mask's graph goes
# to aot_eager: what differs there is the masking Dynamo and AOTAutograd trace (Inductor's second
# compile took ~12 s of the CI machine).
@pytest.mark.parametrize("valid_lens, compiler", [(torch.tensor([3, 0, 9]), "inductor"),
                                                  (torch.tensor([[1, 2, 3, 0, 9, 9, 9, 9, 9]] * 3), "aot_eager")],
                         ids=["1d", "2d"])
def test_fullgraph_compile_matches_reference(valid_lens, compiler):
    torch._dynamo.reset()
    ref, fast = encoder_pair(encoder_config(num_layers=1))
    tokens, segments = random_inputs(3, 9, 50)
    compiled = torch.compile(fast, fullgraph=True, backend=compiler)
    out = compiled(tokens, segments, valid_lens)
    assert_close(out, ref(tokens, segments, valid_lens), atol=1e-4)
    # Training: gradients flow through the compiled graph.
    fast.train()
    compiled(tokens, segments, valid_lens).sum().backward()
    assert fast.blks[0].attention.W_q.weight.grad is not None


def test_fullgraph_compile_through_the_registered_triton_ops():
    """backend="triton" on CPU tensors: the registered ops (their CPU twins) trace cleanly."""
    torch._dynamo.reset()
    ref, fast = encoder_pair(encoder_config(num_layers=1), backend="triton")
    tokens, segments = random_inputs(3, 9, 50)
    valid_lens = torch.tensor([3, 0, 9])
    compiled = torch.compile(fast, fullgraph=True)
    assert_close(compiled(tokens, segments, valid_lens), ref(tokens, segments, valid_lens), atol=1e-4)
    fast.train()
    compiled(tokens, segments, valid_lens).sum().backward()
    assert fast.blks[0].ffn.dense1.weight.grad is not None


def test_fullgraph_compile_with_dropout_through_the_triton_ops():
    """The dropout seed is a device tensor drawn by torch.randint: no host round trip, so
    training with dropout traces into one graph, and the graph's seeds follow torch.manual_seed."""
    torch._dynamo.reset()
    _, fast = encoder_pair(encoder_config(num_layers=1, dropout=0.3), backend="triton")
    fast.train()
    tokens, segments = random_inputs(3, 9, 50)
    valid_lens = torch.tensor([3, 0, 9])
    compiled = torch.compile(fast, fullgraph=True)
    torch.manual_seed(0)
    first = compiled(tokens, segments, valid_lens)
    torch.manual_seed(0)
    assert torch.equal(compiled(tokens, segments, valid_lens), first)
    assert not torch.equal(compiled(tokens, segments, valid_lens), first), "a new draw, a new mask"
    first.sum().backward()
    assert fast.blks[0].attention.W_q.weight.grad is not None


def test_compiled_cpu_dropout_draws_each_mask_in_one_op():
    """On the CPU the triton backend's twins draw the kernels' dropout masks with int64 tensor
    arithmetic (_philox.py, ~360 ops a draw). Traced, a draw must be one bert_fast::philox_words
    node: inlined, a one-layer training graph held 1140 nodes, and its first forward and backward
    took 73 s with Inductor on the CI machine's CPU (36 s so). The compiled masks are eager's
    (same seed, same values)."""
    from torch._dynamo.backends.common import aot_autograd
    torch._dynamo.reset()
    _, fast = encoder_pair(encoder_config(num_layers=1, dropout=0.3), backend="triton")
    fast.train()
    tokens, segments = random_inputs(3, 9, 50)
    valid_lens = torch.tensor([3, 0, 9])
    targets = []

    def keep_graph(gm, example_inputs):
        targets.append([str(node.target) for node in gm.graph.nodes if node.op == "call_function"])
        return gm
    compiled = torch.compile(fast, fullgraph=True, backend=aot_autograd(fw_compiler=keep_graph, bw_compiler=keep_graph))
    outputs = []
    for model in (fast, compiled):
        torch.manual_seed(0)
        outputs.append(model(tokens, segments, valid_lens))
        outputs[-1].sum().backward()
    assert_close(outputs[1], outputs[0], atol=1e-5, rtol=1e-5, what="compiled vs eager, one dropout mask")
    forward, backward = targets
    # Three draws a pass: the attention weights' and the two add-norms'.
    assert forward.count("bert_fast.philox_words.default") == 3, forward
    assert backward.count("bert_fast.philox_words.default") == 3, backward
    # Philox's rounds xor and shift left; nothing else in the layer does.
    inlined = [t for t in forward + backward if "bitwise_xor" in t or "left_shift" in t]
    assert not inlined, f"Philox's arithmetic inlined: {len(inlined)} of its ops"


def test_philox_words_op_passes_opcheck():
    from bert_fast.ops import _philox
    bert_fast.register_ops()
    seed = torch.tensor([2**40 + 7])
    counters = torch.arange(24, dtype=torch.int64).view(4, 6)
    torch.library.opcheck(torch.ops.bert_fast.philox_words, (seed, counters.t(), torch.arange(6).view(6, 1)))
    words = torch.ops.bert_fast.philox_words(seed, counters, torch.tensor(3))
    assert all(torch.equal(a, b) for a, b in zip(words, _philox._philox_words(seed, counters, torch.tensor(3))))


# The registered ops each backend's encoder must show torch.compile (the eager thin path's
# autograd.Functions must not be what it traces).
REGISTERED_OPS = {
    "torch": set(),
    "auto": set(),        # torch on these CPU inputs
    "triton": {"bert_fast.embedding_sum_fwd", "bert_fast.attention_fwd", "bert_fast.add_layernorm_fwd"},
    "cuda": {"bert_fast.ext_embedding_sum_fwd", "bert_fast.attention_fwd", "bert_fast.ext_add_layernorm_fwd"},
}


@pytest.mark.parametrize("backend", available_backends())
def test_thin_eager_path_and_compiled_registered_ops_agree(backend):
    """Eager calls take the thin path (launchers, autograd.Functions); torch.compile(fullgraph)
    traces the registered ops. Both must give the same values and gradients, and the compiled
    graph must hold the registered ops."""
    torch._dynamo.reset()
    _, fast = encoder_pair(encoder_config(num_layers=2), backend=backend)
    tokens, segments = random_inputs(3, 9, 50)
    valid_lens = torch.tensor([3, 0, 9])
    traced = set()

    def recording_backend(gm, example_inputs):
        traced.update(str(node.target).replace("bert_fast::", "bert_fast.").split(".default")[0]
                      for node in gm.graph.nodes if node.op == "call_function")
        return gm.forward

    compiled = torch.compile(fast, fullgraph=True, backend=recording_backend)
    with torch.no_grad():
        assert_close(compiled(tokens, segments, valid_lens), fast(tokens, segments, valid_lens), atol=1e-5,
                     what="compiled vs eager output")
    assert REGISTERED_OPS[backend] <= traced, sorted(traced)
    fast.train()
    assert_same_gradients(fast, compiled, tokens, segments, valid_lens)


def test_skip_padding_thin_and_compiled_agree():
    """skip_padding reads the token count on the host, so it compiles with a graph break; the
    compiled (registered varlen op) and eager (thin path) results still agree."""
    torch._dynamo.reset()
    _, fast = encoder_pair(encoder_config(num_layers=1), backend="triton", skip_padding=True)
    tokens, segments = random_inputs(3, 9, 50)
    valid_lens = torch.tensor([3, 0, 9])
    compiled = torch.compile(fast)
    with torch.no_grad():
        assert_close(compiled(tokens, segments, valid_lens), fast(tokens, segments, valid_lens), atol=1e-5)


def _valid(valid_lens, seqlen):
    return torch.arange(seqlen, dtype=torch.float32)[None, :] < valid_lens[:, None]


@pytest.mark.parametrize("backend", available_backends())
def test_fullgraph_compile_of_skip_padding_matches_eager(backend):
    """skip_padding's token count N is data-dependent: under torch.compile it is one unbacked
    SymInt (no per-sequence host ints, no Python branch on them), so fullgraph traces it, and
    other valid_lens (another N) reuse the same graph. Valid positions equal eager's, padded
    ones are zeros. A new (B, L) recompiles with dynamic sizes (L, the varlen kernels'
    max_seqlen, a SymInt then) and still agrees.
    Inductor compiles the default backend's graphs; the others' go to aot_eager (what this
    checks is Dynamo's and AOTAutograd's; Inductor's two compiles took ~20 s each of the CI
    machine, and it lowers their ops in test_skip_padding_thin_and_compiled_agree and
    test_ext_registration.py)."""
    from torch._dynamo.utils import counters
    torch._dynamo.reset()
    counters.clear()
    _, fast = encoder_pair(encoder_config(num_layers=1), skip_padding=True, backend=backend)
    tokens, segments = random_inputs(3, 9, 50)
    compiled = torch.compile(fast, fullgraph=True, backend="inductor" if backend == "auto" else "aot_eager")
    for valid_lens in (torch.tensor([3.0, 0.0, 9.0]), torch.tensor([2.5, 9.0, 1.0])):   # one dtype: no dtype guard
        valid = _valid(valid_lens, 9)
        with torch.no_grad():
            out, expected = compiled(tokens, segments, valid_lens), fast(tokens, segments, valid_lens)
        assert_close(out[valid], expected[valid], atol=1e-5, what=f"valid positions, valid_lens={valid_lens}")
        assert torch.all(out[~valid] == 0), "padded positions must be zeros"
    assert counters["stats"]["unique_graphs"] == 1, "a new token count must not recompile"
    tokens, segments = random_inputs(2, 13, 50)
    valid_lens = torch.tensor([13.0, 4.0])
    valid = _valid(valid_lens, 13)
    with torch.no_grad():
        out, expected = compiled(tokens, segments, valid_lens), fast(tokens, segments, valid_lens)
    assert_close(out[valid], expected[valid], atol=1e-5, what="valid positions of a second (B, L)")
    # Further (B, L), other products B*L among them: the dynamic graph serves them all (B*L
    # once reached nonzero_static's int fill_value, which specialised it on the product).
    for batch, seqlen in ((4, 7), (5, 11), (2, 5)):
        tokens, segments = random_inputs(batch, seqlen, 50)
        valid_lens = torch.arange(batch, dtype=torch.float32) * 2 + 1
        valid = _valid(valid_lens, seqlen)
        with torch.no_grad():
            out, expected = compiled(tokens, segments, valid_lens), fast(tokens, segments, valid_lens)
        assert_close(out[valid], expected[valid], atol=1e-5, what=f"valid positions at B {batch}, L {seqlen}")
    assert counters["stats"]["unique_graphs"] == 2, "one graph for the first (B, L), one dynamic for the rest"


def test_fullgraph_compile_of_skip_padding_trains():
    """The compiled skip_padding graph (torch backend) gives eager's gradients."""
    torch._dynamo.reset()
    _, fast = encoder_pair(encoder_config(num_layers=1), skip_padding=True, backend="torch")
    fast.train()
    tokens, segments = random_inputs(3, 9, 50)
    valid_lens = torch.tensor([3, 0, 9])
    assert_same_gradients(fast, torch.compile(fast, fullgraph=True), tokens, segments, valid_lens)


@pytest.mark.parametrize("capture_scalars", [False, True], ids=["default", "capture_scalar_outputs"])
def test_skip_padding_compile_does_not_recompile_per_token_count(capture_scalars):
    """Without fullgraph, Dynamo (by default) breaks the graph at N's host read; the graph after
    it sees N as an input size, which is made dynamic on the second N: no graph per further N.
    With capture_scalar_outputs N stays in the one graph: no recompile at all."""
    from torch._dynamo.utils import counters
    torch._dynamo.reset()
    counters.clear()
    _, fast = encoder_pair(encoder_config(num_layers=1), skip_padding=True, backend="torch")
    tokens, segments = random_inputs(3, 9, 50)
    graphs = []
    with torch._dynamo.config.patch(capture_scalar_outputs=capture_scalars):
        compiled = torch.compile(fast, backend="eager")      # recompiles are Dynamo's: no codegen needed
        for valid_lens in ([3, 0, 9], [5, 2, 7], [9, 9, 1], [1, 1, 1]):
            valid_lens = torch.tensor(valid_lens)
            valid = _valid(valid_lens, 9)
            with torch.no_grad():
                out, expected = compiled(tokens, segments, valid_lens), fast(tokens, segments, valid_lens)
            assert_close(out[valid], expected[valid], atol=1e-5)
            assert torch.all(out[~valid] == 0)
            graphs.append(counters["stats"]["unique_graphs"])
    if capture_scalars:
        assert graphs == [1] * 4, graphs
    else:
        assert graphs[1] == graphs[2] == graphs[3], graphs


# ---------------------------------------------------------------------------------------------
# On a GPU: every backend compiled, default mode and mode="reduce-overhead" (CUDA graphs).
GPU_BACKENDS = [b for b in available_backends() if b in ("torch", "triton", "cuda")]


@needs_cuda
@pytest.mark.parametrize("mode", ["default", "reduce-overhead"])
@pytest.mark.parametrize("backend", GPU_BACKENDS)
def test_gpu_compiled_modes_match_eager(backend, mode):
    """Inference: the compiled module's outputs equal eager's over several calls (reduce-overhead
    records a CUDA graph, then replays it; each call's inputs differ). Training (default mode):
    the same parameter gradients. The H100 run of 2026-11-23 saw reduce-overhead fail with an
    InductorError from a compile subprocess (the kernels' float arguments, typed fp64 by
    Inductor; reproduced and fixed on the CPU, tests/test_fake_gpu_compile.py)."""
    torch._dynamo.reset()
    _, fast = encoder_pair(encoder_config(num_layers=2), backend=backend)
    fast = fast.cuda()
    compiled = torch.compile(fast, mode=mode, fullgraph=True, dynamic=False)
    with torch.no_grad():
        for seed in range(4):
            torch.manual_seed(seed)
            tokens, segments = (t.cuda() for t in random_inputs(3, 40, 50))
            valid_lens = torch.tensor([40, 0, 17], device="cuda")
            got = compiled(tokens, segments, valid_lens).clone()
            assert_close(got, fast(tokens, segments, valid_lens), atol=1e-4, what=f"call {seed}")
    if mode == "default":
        fast.train()
        grads = []
        for model in (fast, compiled):
            fast.zero_grad(set_to_none=True)
            model(tokens, segments, valid_lens).square().mean().backward()
            grads.append({name: p.grad.clone() for name, p in fast.named_parameters() if p.grad is not None})
        assert grads[0].keys() == grads[1].keys() and grads[0]
        for name, grad in grads[0].items():
            assert_close(grads[1][name], grad, atol=1e-4, rtol=1e-3, what=f"grad {name}")


# A fresh process: eager use first, then the first trace. The Triton ops are registered with
# torch.library at their first use (ops/_autograd._register_triton_ops), not at import, so that neither
# `import bert_fast` nor eager calls import torch._dynamo and torch._inductor (triton_op's scan
# for kernels does); the trace that comes first must register them itself.
_FRESH_PROCESS = """
import sys
import torch
import bert_fast
from tests.helpers import assert_close, encoder_config, encoder_pair, random_inputs

tracer, backends = sys.argv[1], sys.argv[2:]
assert "torch._dynamo" not in sys.modules, "import bert_fast imported torch._dynamo"
tokens, segments = random_inputs(3, 9, 50)
valid_lens = torch.tensor([3, 0, 9])
models = {}
for backend in backends:
    _, fast = encoder_pair(encoder_config(num_layers=1), backend=backend)
    fast(tokens, segments, valid_lens).sum().backward()
    models[backend] = fast.eval()
assert "torch._dynamo" not in sys.modules, "eager calls imported torch._dynamo"
from bert_fast.ops import _autograd
assert not any(_autograd._REGISTRARS.values()), "eager calls registered the Triton ops"
for backend, fast in models.items():
    traced = set()
    with torch.no_grad():
        expected = fast(tokens, segments, valid_lens)
        if tracer == "compile":
            def recording_backend(gm, example_inputs):
                traced.update(str(node.target) for node in gm.graph.nodes if node.op == "call_function")
                return gm.forward
            out = torch.compile(fast, fullgraph=True, backend=recording_backend)(tokens, segments, valid_lens)
        else:
            graphed = torch.jit.trace(fast, (tokens, segments, valid_lens), check_trace=False)
            traced.update(node.kind() for node in graphed.inlined_graph.nodes())
            out = graphed(tokens, segments, valid_lens)
    assert_close(out, expected, atol=1e-5, what=f"{tracer} vs eager, {backend}")
    assert any("bert_fast::attention_fwd" in op or "bert_fast.attention_fwd" in op for op in traced), sorted(traced)
print("fresh process: ok")
"""


_TRACED_BACKENDS = [b for b in available_backends() if b in ("triton", "cuda")]
# ~7-10 s of one core each (2026-11-28): beside the suite (started by conftest.py when collection ends).
FRESH_PROCESSES = {tracer: BackgroundProcess([sys.executable, "-c", _FRESH_PROCESS, tracer, *_TRACED_BACKENDS],
                                             cwd=pathlib.Path(__file__).resolve().parent.parent)
                   for tracer in ("compile", "trace")}


def start_background(items):
    """From conftest.py when collection ends: the fresh processes the selected tests will read."""
    if not _TRACED_BACKENDS:
        return
    for item in items:
        if getattr(item, "originalname", None) == "test_triton_ops_register_at_first_trace_in_a_fresh_process":
            FRESH_PROCESSES[item.callspec.params["tracer"].split(".")[-1]].start()


@pytest.mark.reads_background
@pytest.mark.parametrize("tracer", ["compile", "jit.trace"])
def test_triton_ops_register_at_first_trace_in_a_fresh_process(tracer):
    """In a new interpreter: import and eager calls (every backend but torch) leave torch._dynamo
    unimported and the Triton ops unregistered; the first torch.compile(fullgraph) or jit.trace
    then registers them, and its graph holds them and matches eager."""
    if not _TRACED_BACKENDS:
        pytest.skip("Triton is not installed")
    out = FRESH_PROCESSES[tracer.split(".")[-1]].stdout()       # fails with its stderr unless it exited 0
    assert out.rstrip().endswith("ok"), out


def _run_in_a_fresh_process(script, *args):
    """Run ``script`` (which prints 'ok' last when its checks pass) in a new interpreter."""
    root = pathlib.Path(__file__).resolve().parent.parent
    run = subprocess.run([sys.executable, "-c", script, *args], cwd=root, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0 and run.stdout.rstrip().endswith("ok"), run.stdout + run.stderr[-3000:]


_LOAD_SAVED = """
import sys
import torch
import bert_fast
from tests.helpers import assert_close

bert_fast.register_ops()
folder = sys.argv[1]
inputs = torch.load(f"{folder}/inputs.pt")
expected = torch.load(f"{folder}/expected.pt")
assert_close(torch.jit.load(f"{folder}/traced.pt")(*inputs), expected, atol=1e-5, what="torch.jit.load")
assert_close(torch.export.load(f"{folder}/exported.pt2").module()(*inputs), expected, atol=1e-5,
             what="torch.export.load")
print("loaded: ok")
"""


@pytest.mark.parametrize("backend", ["triton", "cuda"])
def test_saved_programs_load_in_a_fresh_process_after_register_ops(tmp_path, backend):
    """A jit.traced and an exported encoder hold the registered ops by name (backend cuda: the
    extension's too, which register_ops() did not load: "Unknown builtin op"); a new process
    loads and runs them after bert_fast.register_ops() (README: Tracing)."""
    if backend not in available_backends():
        pytest.skip(f"backend {backend} unavailable")
    _, fast = encoder_pair(encoder_config(num_layers=1), backend=backend)
    fast.eval()
    tokens, segments = random_inputs(3, 9, 50)
    inputs = (tokens, segments, torch.tensor([3, 0, 9]))
    with torch.no_grad():
        torch.jit.trace(fast, inputs, check_trace=False).save(str(tmp_path / "traced.pt"))
        torch.export.save(torch.export.export(fast, inputs), str(tmp_path / "exported.pt2"))
        torch.save(fast(*inputs), tmp_path / "expected.pt")
    torch.save(inputs, tmp_path / "inputs.pt")
    _run_in_a_fresh_process(_LOAD_SAVED, str(tmp_path))


@pytest.mark.parametrize("model", ["encoder", "hf"])
def test_jit_trace_of_skip_padding_raises(model):
    """A jit.trace of skip_padding kept the valid-token count and each sequence's length it saw
    as constants: other lengths of the same shapes gave wrong outputs (0.65 off; found by review).
    It raises instead."""
    tokens, segments = random_inputs(2, 8, 50)
    valid_lens = torch.tensor([8, 3])
    if model == "encoder":
        _, fast = encoder_pair(encoder_config(num_layers=1), skip_padding=True, backend="torch")
        args = (tokens, segments, valid_lens)
    else:
        transformers = pytest.importorskip("transformers")
        config = transformers.BertConfig(vocab_size=50, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                         intermediate_size=64, max_position_embeddings=16)
        fast = bert_fast.optimize(transformers.BertModel(config).eval(), backend="torch", skip_padding=True)
        args = (tokens, (torch.arange(8)[None, :] < valid_lens[:, None]).long())
    with torch.no_grad(), pytest.raises(RuntimeError, match="skip_padding=True cannot be traced by torch.jit.trace"):
        torch.jit.trace(fast, args, check_trace=False, strict=False)


@pytest.mark.parametrize("model", ["encoder", "hf"])
def test_fullgraph_compile_with_a_dynamic_length_matches_eager(model):
    """A compiled lookup's position rows check the length with torch._check; a message closure
    over the (dynamic) length made Dynamo refuse it: fullgraph failed at the second length
    (found by review)."""
    tokens, segments = random_inputs(2, 12, 50)
    if model == "encoder":
        _, fast = encoder_pair(encoder_config(num_layers=1, max_len=16), backend="torch")
        call = lambda m, L: m(tokens[:, :L], segments[:, :L], torch.tensor([3, L]))      # noqa: E731
    else:
        transformers = pytest.importorskip("transformers")
        config = transformers.BertConfig(vocab_size=50, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                         intermediate_size=64, max_position_embeddings=16)
        fast = bert_fast.optimize(transformers.BertModel(config).eval(), backend="torch")
        call = lambda m, L: m(tokens[:, :L], token_type_ids=segments[:, :L]).last_hidden_state    # noqa: E731
    fast.eval()
    compiled = torch.compile(fast, fullgraph=True, dynamic=True, backend="aot_eager")
    with torch.no_grad():
        for length in (8, 12):
            assert_close(call(compiled, length), call(fast, length), atol=1e-5, what=f"L {length}")


def test_programs_saved_before_the_check_op_took_max_len_still_run():
    """bert_fast::check_encoder_values gained max_len: a saved program's call without it (what
    torch.export.load and torch.jit.load replay) takes the default, no length check."""
    tokens, segments = random_inputs(2, 8, 50)
    assert torch.ops.bert_fast.check_encoder_values(tokens, segments, None, 50).item() == 0
    with pytest.raises(ValueError, match="token ids must be in"):
        torch.ops.bert_fast.check_encoder_values(tokens, segments, None, 5)


def test_a_traced_encoder_checks_the_length_when_it_runs():
    """The host's length check is a trace-time check (a guard under torch.compile, which a
    jit.trace and AOTInductor's programs do not check when they run): with check_inputs the
    traced value-check op checks the length too ("size of tensor a (17) must match" before;
    AOTInductor read past the position table)."""
    _, fast = encoder_pair(encoder_config(num_layers=1, max_len=16), backend="torch")
    fast.eval()
    tokens, segments = random_inputs(2, 8, 50)
    with torch.no_grad():
        traced = torch.jit.trace(fast, (tokens, segments, torch.tensor([3, 8])), check_trace=False)
        tokens, segments = random_inputs(2, 17, 50)
        with pytest.raises(Exception, match="sequence length 17 exceeds max_len 16"):
            traced(tokens, segments, torch.tensor([3, 17]))


@pytest.mark.parametrize("skip_padding", [False, True], ids=["exact", "skip_padding"])
def test_export_with_dynamic_batch_and_length_runs_at_other_shapes(skip_padding):
    """torch.export with dynamic B and L: the program runs at other (B, L), products B*L
    included (skip_padding's program was guarded on the exported B*L)."""
    from torch.export import Dim
    _, fast = encoder_pair(encoder_config(num_layers=1), skip_padding=skip_padding, backend="torch")
    batch, length = Dim("batch", min=1, max=16), Dim("length", min=2, max=32)
    tokens, segments = random_inputs(2, 8, 50)
    with torch.no_grad():
        program = torch.export.export(fast, (tokens, segments, torch.tensor([3, 8])),
                                      dynamic_shapes=({0: batch, 1: length}, {0: batch, 1: length}, {0: batch}))
        exported = program.module()
        for rows, seqlen in ((3, 5), (4, 12), (2, 8)):
            tokens, segments = random_inputs(rows, seqlen, 50)
            valid_lens = torch.arange(rows) * 3 % (seqlen + 1)
            assert_close(exported(tokens, segments, valid_lens), fast(tokens, segments, valid_lens), atol=1e-5,
                         what=f"exported program at B {rows}, L {seqlen}")


def test_exported_bert_model_with_a_dynamic_number_of_predictions_runs_with_one():
    """The book's MaskLM gathers with flattened (B*P,) indices, which torch.export guards on
    P != 1: an exported FastBERTModel with a dynamic P refused one prediction per sequence
    (found by review). FastMaskLM gathers with (B, P) indices, the same values."""
    from torch.export import Dim
    cfg = encoder_config(num_layers=1)
    hidden = cfg["num_hiddens"]
    model = bert_fast.FastBERTModel(**cfg, hid_in_features=hidden, mlm_in_features=hidden, nsp_in_features=hidden,
                                    backend="torch").eval()
    batch, length, predictions = Dim("batch", min=1, max=16), Dim("length", min=2, max=32), Dim("P", min=1, max=8)
    tokens, segments = random_inputs(2, 8, 50)
    args = (tokens, segments, torch.tensor([3, 8]), torch.tensor([[0, 1, 2], [3, 4, 5]]))
    with torch.no_grad():
        program = torch.export.export(model, args, dynamic_shapes=(
            {0: batch, 1: length}, {0: batch, 1: length}, {0: batch}, {0: batch, 1: predictions}))
        exported = program.module()
        for rows, seqlen, count in ((2, 8, 1), (3, 12, 2), (1, 5, 1)):
            tokens, segments = random_inputs(rows, seqlen, 50)
            args = (tokens, segments, torch.arange(rows) % seqlen + 1, torch.randint(0, seqlen, (rows, count)))
            for got, expected in zip(exported(*args), model(*args)):
                assert_close(got, expected, atol=1e-5, what=f"B {rows}, L {seqlen}, P {count}")


@pytest.mark.parametrize("fullgraph", [False, True])
def test_always_on_checks_under_compile(fullgraph):
    """A shape, dtype or length check that fails while Dynamo traces: without fullgraph our
    ValueError/TypeError itself; with it, Dynamo's Unsupported ("Observed exception") carrying
    our message (README: Input checks). Never a wrong answer."""
    torch._dynamo.reset()
    _, fast = encoder_pair(encoder_config(num_layers=1, max_len=16), backend="torch")
    compiled = torch.compile(fast, fullgraph=fullgraph, backend="aot_eager")
    tokens, segments = random_inputs(2, 8, 50)
    compiled(tokens, segments, None)
    cases = [((*random_inputs(2, 20, 50), None), ValueError, "sequence length 20 exceeds max_len 16"),
             ((tokens.float(), segments, None), TypeError, "tokens must have dtype torch.int64"),
             ((tokens, segments, torch.tensor([1, 2, 3])), ValueError, "valid_lens must have shape")]
    for args, error, message in cases:
        if fullgraph:
            with pytest.raises(torch._dynamo.exc.Unsupported, match="Observed exception") as caught:
                compiled(*args)
            text = str(caught.value)     # its format varies: torch 2.11 ValueError([ConstantVariable(str: '...')])
            assert error.__name__ in text and message in text, text
        else:
            with pytest.raises(error, match=message):
                compiled(*args)
