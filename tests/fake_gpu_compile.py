"""torch.compile's code for a CUDA GPU, generated and compiled on a machine without one.

``python -m tests.fake_gpu_compile SCENARIO`` (run by tests/test_fake_gpu_compile.py, in a
process of its own: it patches torch.cuda for the whole process). Inductor is handed fake CUDA
tensors (FakeTensorMode: shapes, dtypes and a device, no memory) and a stand-in for the CUDA
device queries it makes (an H100's properties); it then lowers the graph, writes the Triton
source of its own kernels and of ours (the triton_ops' user-defined kernels, re-emitted with the
types Inductor gives their arguments) and compiles every one of them with Triton for sm_90, as
its compile workers do on a GPU machine. Only loading the compiled kernels onto a device is left
out. What this catches, the interpreter cannot: the H100 run of 2026-11-23 saw
``torch.compile(FastBERTEncoder)`` fail with "InductorError: SubprocException" because Inductor
types a Python float argument fp64 (Triton's own launcher: fp32), which our attention kernel's
loop could not compile with. This reproduces that error on the CPU.

Scenarios: "inference" compiles FastBERTEncoder (backend triton) for each valid_lens form and
skip_padding, bf16 and fp32, and once more each as mode="reduce-overhead" would (CUDA graphs);
"hf-inference" a Hugging Face BertModel after optimize() (padded and skip_padding);
"training-ops" a graph of every registered forward and backward op with dropout on (autograd
cannot record on fake CUDA tensors without a CUDA runtime, so the backward ops are called
directly). These two in bf16 only, the dtype of training and of the H100 failure: an fp32 graph
was 17 s (HF) and 64 s (training ops) more of one CPU core (2026-11-28), and the fp32 kernels
compile through Inductor in "inference" and through Triton's launcher in kernel_resources.

The stand-ins (pretend_hopper) are what torch 2.11 and 2.13 need, found by running this: a
future PyTorch may ask the CUDA runtime for something new, and this then fails with a CUDA or
"not linked with support for cuda devices" error outside Inductor's Triton compile step.
"""

import os
import sys
import types

import torch

HOPPER = types.SimpleNamespace(
    name="NVIDIA H100 80GB HBM3 (stand-in)", major=9, minor=0, multi_processor_count=132, warp_size=32,
    total_memory=80 * 2**30, regs_per_multiprocessor=65536, max_threads_per_multi_processor=2048,
    max_threads_per_block=1024, shared_memory_per_block=49152, shared_memory_per_block_optin=232448,
    shared_memory_per_multiprocessor=233472, L2_cache_size=50 * 2**20, gcnArchName="", uuid="stand-in",
    is_integrated=False, clock_rate=1980000, memory_clock_rate=2619000, memory_bus_width=5120,
    pci_bus_id=0, pci_device_id=0, pci_domain_id=0)


class _NoDevice:
    """torch.cuda.device(...) stand-in: there is no device to switch to."""

    def __init__(self, *args, **kwargs):
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def _basic_getitem(original):
    """Tensor.__getitem__ for fake CUDA tensors, through ATen ops: the C++ indexing entry
    switches the current CUDA device first, which needs a CUDA driver."""
    def getitem(self, index):
        if self.device.type != "cuda":
            return original(self, index)
        index = index if isinstance(index, tuple) else (index,)
        if any(isinstance(i, torch.Tensor) for i in index):
            if any(i is None or i is Ellipsis for i in index) or not all(
                    isinstance(i, torch.Tensor) or i == slice(None) for i in index):
                raise NotImplementedError(f"fake_gpu_compile: tensor index {index}")
            return torch.ops.aten.index.Tensor(self, [i if isinstance(i, torch.Tensor) else None for i in index])
        if Ellipsis in index:
            at = index.index(Ellipsis)
            named = sum(1 for i in index if i is not None and i is not Ellipsis)
            index = index[:at] + (slice(None),) * (self.dim() - named) + index[at + 1:]
        out, dim = self, 0
        for i in index:
            if i is None:
                out, dim = torch.ops.aten.unsqueeze.default(out, dim), dim + 1
            elif isinstance(i, slice):
                if i != slice(None):
                    out = torch.ops.aten.slice.Tensor(out, dim, i.start, i.stop, i.step or 1)
                dim += 1
            else:
                out = torch.ops.aten.select.int(out, dim, i)
        return out
    return getitem


def _basic_contiguous(original):
    """Tensor.contiguous for fake CUDA tensors: always ATen's clone (the C++ method switches
    the current CUDA device first, which needs a CUDA driver; asking whether an unbacked-size
    tensor is contiguous would stop the trace). A copy where there was none: the graph may hold
    a clone more than on a GPU, which changes no kernel Inductor compiles."""
    def contiguous(self, memory_format=torch.contiguous_format):
        if self.device.type != "cuda":
            return original(self, memory_format=memory_format)
        return torch.ops.aten.clone.default(self, memory_format=memory_format)
    return contiguous


def _basic_to(original):
    """Tensor.to for fake CUDA tensors, through ATen's _to_copy (same reason as above)."""
    def to(self, *args, **kwargs):
        if self.device.type != "cuda":
            return original(self, *args, **kwargs)
        device, dtype, _, memory_format = torch._C._nn._parse_to(*args, **kwargs)
        device = torch.device(device) if device is not None else self.device
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", 0)
        dtype = dtype or self.dtype
        if device == self.device and dtype == self.dtype and memory_format in (None, torch.preserve_format):
            return self
        return torch.ops.aten._to_copy.default(self, dtype=dtype, device=device,
                                               memory_format=memory_format or torch.preserve_format)
    return to


def _returning(value):
    def stand_in(*args, **kwargs):
        return value
    return stand_in


def pretend_hopper():
    """Patch torch.cuda, Inductor and Triton so that Inductor generates and compiles sm_90 code
    for fake CUDA tensors, with no GPU and no CUDA driver."""
    if os.environ.get("TRITON_INTERPRET", "0") == "1":
        raise RuntimeError("fake_gpu_compile compiles real kernels: run it without TRITON_INTERPRET=1")
    # torch.cuda first: Inductor's modules keep references to its functions when imported.
    cuda = torch.cuda
    # One function object per attribute: Dynamo's trace rules map each to a rule by identity.
    cuda.is_available = _returning(True)
    cuda.device_count = _returning(1)
    cuda.current_device = _returning(0)
    cuda.get_device_properties = _returning(HOPPER)
    cuda.get_device_capability = _returning((9, 0))
    cuda.get_device_name = _returning(HOPPER.name)
    cuda.is_bf16_supported = _returning(True)
    cuda.set_device = _returning(None)
    cuda.synchronize = _returning(None)
    cuda._is_compiled = _returning(True)
    cuda._lazy_init = _returning(None)
    cuda._exchange_device = _returning(0)
    cuda._maybe_exchange_device = _returning(0)
    cuda.device = _NoDevice
    cuda.current_stream = _returning(types.SimpleNamespace(cuda_stream=0, device=torch.device("cuda", 0)))
    cuda.get_rng_state = _returning(torch.zeros(16, dtype=torch.uint8))
    cuda.set_rng_state = _returning(None)
    torch._C._cuda_getCurrentRawStream = _returning(0)
    torch._C._cuda_cudaCachingAllocator_is_enabled = _returning(True)

    import triton
    import torch._inductor.config as inductor_config
    import torch._inductor.fx_passes.joint_graph as joint_graph
    import torch._inductor.runtime.triton_heuristics as heuristics
    import torch._inductor.runtime.triton_helpers as triton_helpers
    import torch._subclasses.fake_tensor as fake_tensor

    fake_tensor.init_gpu_context = lambda device: None
    # Tensor methods written in C++ that switch the current CUDA device first (which needs a
    # driver) go through ATen ops on fake CUDA tensors: indexing, .contiguous(), .to(), ~.
    torch.Tensor.__getitem__ = _basic_getitem(torch.Tensor.__getitem__)
    torch.Tensor.contiguous = _basic_contiguous(torch.Tensor.contiguous)
    torch.Tensor.to = _basic_to(torch.Tensor.to)
    original_invert = torch.Tensor.__invert__
    torch.Tensor.__invert__ = lambda self: (torch.ops.aten.bitwise_not.default(self) if self.device.type == "cuda"
                                            else original_invert(self))

    # Inductor's pattern passes and constant folding run real ops on example CUDA tensors; they
    # rewrite ATen ops only, never a triton_op's kernels.
    joint_graph.lazy_init = lambda *args, **kwargs: None
    inductor_config.pattern_matcher = False
    inductor_config.joint_graph_constant_folding = False
    inductor_config.compile_threads = 1       # compile in this process, where the patches are
    inductor_config.fx_graph_cache = False     # (export's graph modules do not pickle)
    # Compile, but do not load onto a device: what Inductor's workers do (warm_cache_only).
    heuristics.CachingAutotuner._make_launchers = lambda self: None
    triton_helpers.set_driver_to_gpu = lambda: None
    from bert_fast.kernel_resources import TargetDriver
    triton.runtime.driver.set_active(TargetDriver(90))


def _encoder(dtype, **options):
    from bert_fast import FastBERTEncoder
    from tests.helpers import encoder_config
    config = encoder_config(num_heads=2, head_dim=64, num_layers=1, vocab_size=100, dropout=0.1)
    return FastBERTEncoder(**config, backend="triton", **options).to(dtype).eval()


def fake_mode():
    """FakeTensorMode for the inputs and parameters; its ShapeEnv takes the unbacked sizes
    skip_padding's token count makes (one .item() of the valid lengths)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv
    return FakeTensorMode(allow_non_fake_inputs=True, shape_env=ShapeEnv(allow_scalar_outputs=True))


def compile_graph(module, inputs):
    """torch.export of ``module`` on the fake inputs, then Inductor: (generated Python) code."""
    from torch._inductor.compile_fx import compile_fx
    exported = torch.export.export(module, inputs)
    graph = exported.module()
    for parameter in graph.parameters():
        parameter.requires_grad_(False)
    for node in graph.graph.nodes:
        # Inductor traces the graph again in the same ShapeEnv and names the token count anew;
        # export's record of the old name would make it stop ("possible memo disaster").
        node.meta.pop("unbacked_bindings", None)
    return compile_fx(graph, list(inputs))


def reduce_overhead(module, inputs):
    """Compile as mode="reduce-overhead" does (Inductor's CUDA graphs on) and say whether
    Inductor would replay the graph in CUDA graphs: its reasons to skip them are known at
    compile time (CPU ops, unsafe ops in the graph). The input check (check_encoder_values, a
    host read) is kept in a partition of its own, outside the graphs, not a reason to skip."""
    import torch._inductor.config as inductor_config
    from torch._dynamo.utils import counters
    skips = counters["inductor"]["cudagraph_skips"]
    with inductor_config.patch({"triton.cudagraphs": True}):
        compile_graph(module, inputs)
    skipped = counters["inductor"]["cudagraph_skips"] - skips
    print(f"compiled: reduce-overhead, cudagraph skips {skipped}", flush=True)


def inference():
    batch, seqlen = 2, 24
    for dtype in (torch.bfloat16, torch.float32):
        for skip_padding in (False, True):
            encoder = _encoder(dtype, skip_padding=skip_padding)
            with fake_mode(), torch.no_grad():
                encoder.to_empty(device="cuda")     # (.to("cuda") would copy real data)
                tokens = torch.zeros(batch, seqlen, dtype=torch.long, device="cuda")
                segments = torch.zeros(batch, seqlen, dtype=torch.long, device="cuda")
                lengths = [torch.full((batch,), 9.0, device="cuda")]
                if not skip_padding:
                    lengths += [None, torch.full((batch, seqlen), 5.0, device="cuda")]
                for valid_lens in lengths:
                    compile_graph(encoder, (tokens, segments, valid_lens))
                    print(f"compiled: inference {dtype} skip_padding={skip_padding} "
                          f"valid_lens {None if valid_lens is None else tuple(valid_lens.shape)}", flush=True)
                reduce_overhead(encoder, (tokens, segments, lengths[0]))


def hf_inference():
    from transformers import BertConfig, BertModel
    import bert_fast
    config = BertConfig(vocab_size=100, hidden_size=128, num_hidden_layers=1, num_attention_heads=2,
                        intermediate_size=256, max_position_embeddings=64)
    for skip_padding in (False, True):
        model = BertModel(config).eval().to(torch.bfloat16)
        bert_fast.optimize(model, backend="triton", skip_padding=skip_padding)
        with fake_mode(), torch.no_grad():
            model.to_empty(device="cuda")
            input_ids = torch.zeros(2, 24, dtype=torch.long, device="cuda")
            attention_mask = torch.ones(2, 24, dtype=torch.long, device="cuda")
            compile_graph(model, (input_ids, attention_mask))
            print(f"compiled: HF BertModel bf16 skip_padding={skip_padding}", flush=True)


class _TrainingOps(torch.nn.Module):
    """Every registered op's forward and backward, dropout on, as a training step calls them:
    padded (B, L) rows, then the valid tokens packed (skip_padding: N rows, N an unbacked size
    read from cu_seqlens as skip_padding's one host read makes it)."""

    def forward(self, tokens, segments, token_weight, segment_weight, pos_weight, ln_weight, ln_bias,
                w_qkv, ffn_bias, valid_lens, cu_seqlens, seed):
        ops = torch.ops.bert_fast
        heads, p, eps = 2, 0.1, 1e-5
        tables = (token_weight.shape[0], segment_weight.shape[0], pos_weight.shape[1])
        grads = []

        def layer(x, attention, attention_bwd):
            qkv = x @ w_qkv
            context, lse = attention(qkv)
            y, mean, rstd = ops.add_layernorm_fwd(context, x, ln_weight, ln_bias, eps, seed, p)
            h = ops.bias_act_fwd(y, ffn_bias, "gelu")
            d_h, d_bias = ops.bias_act_bwd(h, y, ffn_bias, "gelu")       # (h itself as the gradient: used)
            d_context, d_x, d_ln_weight, d_ln_bias = ops.add_layernorm_bwd(d_h, context, x, ln_weight, mean,
                                                                           rstd, seed, p, True)
            grads.extend((attention_bwd(d_context, qkv, context, lse), d_bias, d_ln_weight, d_ln_bias))
            return d_x

        def embedding_grads(d_x, tokens, segments, positions):
            for deterministic in (False, True):
                grads.extend(ops.embedding_sum_bwd(d_x, tokens, segments, positions, *tables, True,
                                                   deterministic))

        x = ops.embedding_sum_fwd(tokens, segments, token_weight, segment_weight, pos_weight, None, False)
        d_x = layer(x, lambda qkv: ops.attention_fwd(qkv, valid_lens, heads, p, seed),
                    lambda d, qkv, out, lse: ops.attention_bwd(d, qkv, out, lse, valid_lens, heads, p, seed))
        embedding_grads(d_x, tokens, segments, None)

        n = cu_seqlens[-1].item()
        torch._check(n >= 0)
        torch._check(n <= tokens.numel())
        packed_tokens, packed_segments = tokens.flatten()[:n], segments.flatten()[:n]
        positions = torch.arange(tokens.shape[1], device=tokens.device).repeat(tokens.shape[0])[:n]
        x = ops.embedding_sum_fwd(packed_tokens, packed_segments, token_weight, segment_weight, pos_weight,
                                  positions, False)
        max_seqlen = tokens.shape[1]
        d_x = layer(x, lambda qkv: ops.varlen_attention_fwd(qkv, cu_seqlens, heads, max_seqlen, p, seed),
                    lambda d, qkv, out, lse: ops.varlen_attention_bwd(d, qkv, out, lse, cu_seqlens, heads,
                                                                      max_seqlen, p, seed))
        embedding_grads(d_x, packed_tokens, packed_segments, positions)
        return tuple(grads)


def training_ops():
    from bert_fast.ops._autograd import register_ops
    register_ops()          # _TrainingOps calls torch.ops.bert_fast.* by name, which exist from then on
    batch, seqlen, hidden = 2, 24, 128
    with fake_mode(), torch.no_grad():
        def cuda(*shape, dtype=torch.bfloat16):
            return torch.zeros(*shape, dtype=dtype, device="cuda")
        inputs = (cuda(batch, seqlen, dtype=torch.long), cuda(batch, seqlen, dtype=torch.long),
                  cuda(100, hidden), cuda(2, hidden), cuda(1, 64, hidden), cuda(hidden), cuda(hidden),
                  cuda(hidden, 3 * hidden), cuda(hidden), cuda(batch, seqlen, dtype=torch.float32),
                  cuda(batch + 1, dtype=torch.int32), cuda(1, dtype=torch.long))
        compile_graph(_TrainingOps(), inputs)
        print("compiled: training ops bf16", flush=True)


SCENARIOS = {"inference": inference, "hf-inference": hf_inference, "training-ops": training_ops}


if __name__ == "__main__":
    pretend_hopper()
    import bert_fast  # noqa: F401  (registers the ops after the patches, as on a GPU machine)
    SCENARIOS[sys.argv[1]]()
