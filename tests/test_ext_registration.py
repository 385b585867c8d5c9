"""The compiled extension as PyTorch sees it: opcheck of its ops (schemas from C++, fake
kernels and autograd from Python), torch.compile through them, gradcheck, backend="cuda" in
the modules (the C++ ops on CPU tensors), and the drop-in result against the reference.

The extension is built by the install (setup.py); bert_fast.build_extension() loads it, or
JIT-compiles it where the install skipped it.
"""

import pytest
import torch

import bert_fast
from bert_fast import FastBERTEncoder, extension
from bert_fast.ops.add_layernorm import add_layernorm, add_layernorm_fwd
from bert_fast.ops.embedding import embedding_sum
from tests.helpers import assert_close, encoder_config, encoder_pair, random_inputs, seed_tensor
from tests.isolated import ChildRunner


@pytest.fixture(scope="module", autouse=True)
def ext_ops():
    bert_fast.build_extension(verbose=False)
    return torch.ops.bert_fast


def embedding_inputs(form, dtype=torch.float32, hidden=24):
    token_weight = torch.randn(30, hidden, dtype=dtype)
    segment_weight = torch.randn(2, hidden, dtype=dtype)
    pos_weight = torch.randn(1, 16, hidden, dtype=dtype)
    if form == "padded":
        tokens, segments, positions = torch.randint(0, 30, (3, 7)), torch.randint(0, 2, (3, 7)), None
    else:
        tokens, segments = torch.randint(0, 30, (11,)), torch.randint(0, 2, (11,))
        positions = torch.randint(0, 16, (11,))
    return tokens, segments, token_weight, segment_weight, pos_weight, positions


@pytest.mark.parametrize("form", ["padded", "packed"])
@pytest.mark.parametrize("learn_pos", [False, True])
def test_opcheck_embedding_sum(ext_ops, form, learn_pos):
    tokens, segments, token_weight, segment_weight, pos_weight, positions = embedding_inputs(form)
    for table in (token_weight, segment_weight, pos_weight):
        table.requires_grad_(learn_pos or table is not pos_weight)
    torch.library.opcheck(ext_ops.ext_embedding_sum_fwd,
                          (tokens, segments, token_weight, segment_weight, pos_weight, positions))
    grad_out = torch.randn(*tokens.shape, 24)
    torch.library.opcheck(ext_ops.ext_embedding_sum_bwd,
                          (grad_out, tokens, segments, positions, 30, 2, 16, learn_pos))


@pytest.mark.parametrize("dropout_p,affine", [(0.0, "both"), (0.0, "none"), (0.3, "both"), (0.5, "weight")])
def test_opcheck_add_layernorm(ext_ops, dropout_p, affine):
    x, residual = torch.randn(2, 3, 40, requires_grad=True), torch.randn(2, 3, 40, requires_grad=True)
    weight = torch.randn(40, requires_grad=True) if affine in ("both", "weight") else None
    bias = torch.randn(40, requires_grad=True) if affine == "both" else None
    seed = seed_tensor(7, "cpu") if dropout_p else None
    torch.library.opcheck(ext_ops.ext_add_layernorm_fwd, (x, residual, weight, bias, 1e-5, seed, dropout_p))
    _, mean, rstd = ext_ops.ext_add_layernorm_fwd(x, residual, weight, bias, 1e-5, seed, dropout_p)
    # The backward op's inputs do not require grad: it has no derivative (a double backward
    # raises, test_double_backward_says_it_is_unsupported).
    torch.library.opcheck(ext_ops.ext_add_layernorm_bwd,
                          (torch.randn(2, 3, 40), x.detach(), residual.detach(),
                           None if weight is None else weight.detach(), mean, rstd, seed,
                           dropout_p, bias is not None))


def test_gradcheck_through_public_functions():
    x, residual = (torch.randn(3, 5, dtype=torch.float64, requires_grad=True) for _ in range(2))
    weight, bias = (torch.randn(5, dtype=torch.float64, requires_grad=True) for _ in range(2))

    def layernorm_with_dropout(*args):
        torch.manual_seed(3)     # one mask for every evaluation
        return add_layernorm(*args, 1e-5, 0.4, True, backend="cuda")

    assert torch.autograd.gradcheck(layernorm_with_dropout, (x, residual, weight, bias))
    tokens, segments, token_weight, segment_weight, pos_weight, _ = embedding_inputs("padded", torch.float64, 4)
    tables = [t.requires_grad_() for t in (token_weight, segment_weight, pos_weight)]
    assert torch.autograd.gradcheck(
        lambda *t: embedding_sum(tokens, segments, *t, learn_pos_embedding=True, backend="cuda"), tables)


def test_add_layernorm_dropout_is_the_triton_ops_mask():
    """The C++ op and the Triton op's CPU twin draw the same mask from one seed."""
    x, residual = torch.randn(6, 96), torch.randn(6, 96)
    weight, bias = torch.randn(96), torch.randn(96)
    seed = seed_tensor(2024, "cpu")
    ours = torch.ops.bert_fast.ext_add_layernorm_fwd(x, residual, weight, bias, 1e-5, seed, 0.25)
    twin = add_layernorm_fwd(x, residual, weight, bias, 1e-5, seed, 0.25)
    for a, b, name in zip(ours, twin, ("out", "mean", "rstd")):
        assert_close(a, b, atol=1e-5, what=name)


def assert_same_results(module, expected_module, inputs, atol):
    """Same output and, for a random weighting of it, the same gradient on every parameter."""
    expected, actual = expected_module(*inputs), module(*inputs)
    assert_close(actual, expected, atol=atol, what="output")
    weights = torch.randn_like(expected)
    (expected * weights).sum().backward()
    (actual * weights).sum().backward()
    params = dict(module.named_parameters())
    for name, p in expected_module.named_parameters():
        if p.grad is not None:
            assert_close(params[name].grad, p.grad, atol=atol, rtol=atol, what=f"grad {name}")


def test_encoder_on_the_cuda_backend_matches_the_reference():
    ref, fast = encoder_pair(encoder_config(num_heads=2, head_dim=16), backend="cuda", learn_pos_embedding=True)
    ref.pos_embedding.requires_grad_(True)
    tokens, segments = random_inputs(3, 11, 50)
    valid_lens = torch.tensor([4, 0, 11.5])
    for module in (ref, fast):
        module.train()
    assert_same_results(fast, ref, (tokens, segments, valid_lens), atol=1e-4)


def test_fullgraph_compile_through_the_extension_ops():
    torch._dynamo.reset()
    ref, fast = encoder_pair(encoder_config(num_layers=1, dropout=0.0), backend="cuda")
    tokens, segments = random_inputs(3, 9, 50)
    valid_lens = torch.tensor([3, 0, 9])
    compiled = torch.compile(fast, fullgraph=True)
    assert_close(compiled(tokens, segments, valid_lens), ref(tokens, segments, valid_lens), atol=1e-4)
    fast.train()
    compiled(tokens, segments, valid_lens).sum().backward()
    assert fast.token_embedding.weight.grad is not None and fast.blks[0].addnorm1.ln.weight.grad is not None


def test_optimize_with_the_cuda_backend():
    ref, _ = encoder_pair(encoder_config(num_layers=1))
    tokens, segments = random_inputs(2, 6, 50)
    expected = ref(tokens, segments, torch.tensor([6, 2]))
    bert_fast.optimize(ref, backend="cuda")
    assert_close(ref(tokens, segments, torch.tensor([6, 2])), expected, atol=1e-5)


def test_info_reports_the_extension():
    from bert_fast.info import report
    text = "\n".join(report())
    assert "cuda    available" in text and "torch.ops.bert_fast.ext_add_layernorm_fwd: CPU" in text
    assert extension.loaded_from() is not None


def test_skip_padding_on_the_cuda_backend_matches_the_torch_backend():
    """skip_padding embeds the packed valid tokens (the ext op's packed form) and normalises them."""
    config = encoder_config(num_heads=2, head_dim=16)
    _, on_torch = encoder_pair(config, backend="torch", skip_padding=True)
    _, on_ext = encoder_pair(config, backend="cuda", skip_padding=True)
    on_ext.load_state_dict(on_torch.state_dict())
    tokens, segments = random_inputs(3, 10, 50)
    assert_same_results(on_ext, on_torch, (tokens, segments, torch.tensor([4, 10, 1])), atol=1e-5)


def compile_before_the_extension_loads(simulate_missing):
    """In a fresh process (nothing has loaded the extension yet): a fullgraph-compiled call of
    a cuda-backend op. Returns (the loaded extension's origin, the max error vs the torch backend)."""
    assert extension.loaded_from() is None, "the child must start without the extension loaded"
    if simulate_missing:
        extension.load = lambda: False
        extension._state["error"] = "simulated: not built"
    tokens, segments = torch.randint(0, 6, (2, 5)), torch.randint(0, 2, (2, 5))
    tables = torch.randn(6, 16), torch.randn(2, 16), torch.randn(1, 8, 16)
    compiled = torch.compile(lambda *a: embedding_sum(*a, backend="cuda"), fullgraph=True)
    error = (compiled(tokens, segments, *tables) - embedding_sum(tokens, segments, *tables)).abs().max()
    return extension.loaded_from(), float(error)


def test_fullgraph_compile_loads_the_extension_on_first_use():
    """Tracing the first op call must not trace load()'s lock and import (a fullgraph error);
    without a built extension, the compiled call gives load()'s clear error."""
    for simulate_missing in (False, True):
        runner = ChildRunner()      # a fresh process per case: nothing loaded yet
        try:
            if simulate_missing:
                with pytest.raises(RuntimeError, match="needs bert_fast's compiled extension.*simulated: not built"):
                    runner.call(compile_before_the_extension_loads, True)
            else:
                origin, error = runner.call(compile_before_the_extension_loads, False)
                assert origin is not None and error == 0.0
        finally:
            runner.close()
