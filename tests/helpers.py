"""Shared helpers for the tests: model pairs with equal weights, and error reporting."""

import contextlib
import weakref

import pytest
import torch
from torch.multiprocessing.reductions import StorageWeakRef

from bert_fast import FastBERTEncoder
from bert_fast import cuda_graph
from bert_fast import reference as R
from bert_fast.ops._triton import HAS_TRITON, interpreting, kernels_on_cpu

# Error floors of the tolerance rule in ../shared/STYLE.md (flash-attention's rule).
FLOOR = {torch.float32: 1e-4, torch.float16: 1e-2, torch.bfloat16: 5e-2}


def encoder_config(num_heads=2, head_dim=32, num_layers=2, vocab_size=50, ffn=None, dropout=0.0,
                   max_len=64):
    H = num_heads * head_dim
    return dict(vocab_size=vocab_size, num_hiddens=H, norm_shape=[H], ffn_num_input=H,
                ffn_num_hiddens=ffn or 2 * H, num_heads=num_heads, num_layers=num_layers,
                dropout=dropout, max_len=max_len, key_size=H, query_size=H, value_size=H)


def encoder_pair(config, **fast_options):
    """A reference encoder and a fast one with the reference's weights, both in eval mode."""
    ref = R.BERTEncoder(**config).eval()
    fast = FastBERTEncoder(**config, **fast_options).eval()
    fast.load_state_dict(ref.state_dict(), strict=True)
    return ref, fast


def random_inputs(batch, seqlen, vocab_size):
    tokens = torch.randint(0, vocab_size, (batch, seqlen))
    segments = torch.randint(0, 2, (batch, seqlen))
    return tokens, segments


def max_err(actual, expected):
    diff = (actual.double() - expected.double()).abs()
    return diff.max().item() if diff.numel() else 0.0


def autograd_node_names(output):
    """The class names of the autograd nodes reachable from ``output`` (its grad_fn and every
    node behind it), each node once."""
    seen, stack, names = set(), [output.grad_fn], []
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        names.append(type(node).__name__)
        stack.extend(next_node for next_node, _ in node.next_functions)
    return names


def assert_close(actual, expected, atol, rtol=0.0, what="output"):
    """|actual - expected| <= atol + rtol * max|expected|, reporting the max error."""
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    err = max_err(actual, expected)
    bound = atol + rtol * max_err(expected, torch.zeros_like(expected))
    assert err <= bound, f"{what}: max abs error {err:.3g} > {bound:.3g}"


def assert_same_computation(actual, expected, what="output"):
    """Two specialisations of one kernel (a constexpr apart, e.g. whether it also stores
    statistics) that do the same arithmetic in the same order: bitwise under Triton's
    interpreter. On a GPU the compiled variants' PTX holds the same float operations in the same
    order, yet ptxas contracts multiplies and adds into FMAs as each one's schedule allows, so
    the two may differ in the last bits (seen on an H200 on 2026-11-26: the add-norm forward with
    and without its statistics): there, within a few fp32 ulps, far below any real mistake."""
    if actual.device.type == "cpu":
        assert torch.equal(actual, expected), f"{what}: not the same bits"
    else:
        assert_close(actual, expected, atol=1e-5, rtol=1e-5, what=what)


def compare_forward_backward(ref, fast, tokens, segments, valid_lens, atol=1e-4, valid_only=False):
    """Same output, and the same gradient on every parameter (names are shared), for a random
    loss over the output. ``valid_only`` (skip_padding, whose padded rows are zeros by design):
    outputs and loss over the valid positions of 1-D ``valid_lens`` only."""
    out_ref, out_fast = ref(tokens, segments, valid_lens), fast(tokens, segments, valid_lens)
    w = torch.randn_like(out_ref)
    if valid_only:
        valid = (torch.arange(tokens.shape[1])[None, :] < valid_lens[:, None])[..., None]
        w, out_ref, out_fast = w * valid, out_ref * valid, out_fast * valid
    assert_close(out_fast, out_ref, atol=atol, what="output")
    (out_ref * w).sum().backward()
    (out_fast * w).sum().backward()
    ref_params, fast_params = dict(ref.named_parameters()), dict(fast.named_parameters())
    assert ref_params.keys() == fast_params.keys()
    for name, p in ref_params.items():
        q = fast_params[name]
        if p.grad is None:
            assert q.grad is None, f"{name}: fast has a gradient where the reference has none"
            continue
        assert_close(q.grad, p.grad, atol=atol, rtol=atol, what=f"grad {name}")


def compare_under_autocast(ref, fast, tokens, segments, valid_lens, dtype, tol):
    """A forward under CPU autocast in ``dtype`` and a backward of a fixed loss, for both
    models: the output is fp32 (LayerNorm's under autocast) and the same within ``tol``, and
    so is every fp32 Parameter's gradient."""
    results = []
    for model in (ref, fast):
        with torch.autocast("cpu", dtype):
            out = model(tokens, segments, valid_lens)
        (out.float() * torch.linspace(-1, 1, out.shape[-1])).sum().backward()
        results.append((out, {name: p.grad for name, p in model.named_parameters() if p.grad is not None}))
    (expected, expected_grads), (out, grads) = results
    assert out.dtype == expected.dtype == torch.float32
    assert_close(out, expected, atol=tol, rtol=tol / 2)
    assert grads.keys() == expected_grads.keys()
    for name, want in expected_grads.items():
        assert grads[name].dtype == torch.float32, name
        assert_close(grads[name], want, atol=tol, rtol=tol, what=f"grad {name}")


def assert_within_rule(actual, reference, same_precision_torch, what="output"):
    """STYLE.md: error vs the (fp64) reference <= 2x PyTorch's error at that precision + floor."""
    bound = 2 * max_err(same_precision_torch, reference) + FLOOR[actual.dtype]
    assert_close(actual, reference.to(actual.dtype), atol=bound, what=what)

class _MadeTensors(torch.utils._python_dispatch.TorchDispatchMode):
    """Within: a weak reference, shape and dtype of every tensor an op makes."""

    def __init__(self):
        super().__init__()
        self.made = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in torch.utils._pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self.made.append((weakref.ref(t), tuple(t.shape), t.dtype))
        return out


def held_by_the_graph(forward):
    """(shape, dtype) of each tensor ``forward()`` makes that the autograd graph of its output
    still holds once the backward has run: what a loss kept referenced (a training loop's
    ``loss`` is, through the next step's forward) keeps alive."""
    with _MadeTensors() as mode:
        out = forward()
    loss = out.sum()
    del out
    loss.backward()
    alive = [i for i, (ref, _, _) in enumerate(mode.made) if ref() is not None]
    del loss
    return [mode.made[i][1:] for i in alive if mode.made[i][0]() is None]


class _LiveBytes(torch.utils._python_dispatch.TorchDispatchMode):
    """Within: the peak of the bytes held by the storages that ops made (not those of the
    tensors an op was given: a view or an in-place op's result), as each op returns."""

    def __init__(self):
        super().__init__()
        self.storages, self.peak = {}, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        given = {t.untyped_storage()._cdata for t in torch.utils._pytree.tree_leaves((args, kwargs))
                 if isinstance(t, torch.Tensor)}
        out = func(*args, **(kwargs or {}))
        for t in torch.utils._pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.untyped_storage()._cdata not in given:
                storage = t.untyped_storage()
                self.storages.setdefault(storage._cdata, (StorageWeakRef(storage), storage.nbytes()))
        self.storages = {key: (ref, size) for key, (ref, size) in self.storages.items() if not ref.expired()}
        self.peak = max(self.peak, sum(size for _, size in self.storages.values()))
        return out


def peak_bytes(forward):
    """The peak of the memory that ``forward()``'s ops allocate (tensors on any device)."""
    with _LiveBytes() as mode:
        forward()
    return mode.peak


# Kernel tests run on CUDA when there is one, else on CPU tensors under the interpreter.
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
needs_kernels = pytest.mark.skipif(not (HAS_TRITON and (torch.cuda.is_available() or interpreting())),
                                   reason="Triton kernels need CUDA or TRITON_INTERPRET=1 (set by conftest.py "
                                          "when there is no CUDA)")
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
BF16_OK = torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 0)


@contextlib.contextmanager
def interpreted_kernels():
    """Within: the Triton launchers take CPU tensors (kernels_on_cpu), where Triton's interpreter
    runs (conftest.py sets it when there is no CUDA). On a GPU machine Triton compiles for the
    GPU, so CPU tensors cannot reach its kernels: the test is skipped there (its GPU tests run the
    same kernels on CUDA tensors)."""
    if not (HAS_TRITON and interpreting()):
        pytest.skip("the Triton kernels on CPU tensors need TRITON_INTERPRET=1 (set by conftest.py when "
                    "there is no CUDA)")
    with kernels_on_cpu():
        yield


def seed_tensor(value, device=DEVICE):
    """A dropout seed as the ops take it: a one-element int64 tensor."""
    return torch.tensor([value], dtype=torch.int64, device=device)


# A CPU stand-in for the CUDA steps of bert_fast.cuda_graph's automatic graphs (tests replace
# cuda_graph._steps with it: test_cuda_graph.py, test_hf.py).

class StubGraph:
    def __init__(self, steps, run, output):
        self.steps, self.run, self.output = steps, run, output

    def replay(self):
        self.steps.replays += 1
        self.steps.active = True
        try:
            with torch.inference_mode():      # the static output is an inference tensor, as on the GPU
                for static, new in zip(cuda_graph._tensors(self.output), cuda_graph._tensors(self.run())):
                    static.copy_(new)
        finally:
            self.steps.active = False


class StubSteps(cuda_graph._CudaGraphSteps):
    """cuda_graph._steps on the CPU: "capture" runs the forward once on the static buffers and
    keeps its output; "replay" runs it again there, writing that output in place. ``active``
    is True while either runs (what the graph would contain); ``fail`` makes captures raise;
    ``waits`` counts the waits for a replay. The stats' reads are the base class's (on the CPU:
    at once)."""

    def __init__(self, fail=False):
        self.fail = fail
        self.attempts = self.replays = self.waits = 0
        self.active = False
        self.inference_mode_at_capture = []
        self.pools = []         # the pool of every capture attempt

    def supports(self, device):
        return True

    def capturing(self, device):
        return False

    def new_pool(self, device):
        return object()

    def order_after(self, previous, device):
        return None

    def wait(self, device):
        self.waits += 1

    def capture(self, run, device, pool):
        self.attempts += 1
        self.pools.append(pool)
        self.inference_mode_at_capture.append(torch.is_inference_mode_enabled())
        if self.fail:
            raise RuntimeError("simulated capture failure\nsecond line")
        self.active = True
        try:
            output = run()
        finally:
            self.active = False
        return StubGraph(self, run, output), output
