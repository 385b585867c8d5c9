"""What each Triton kernel costs a GPU, found without one: ``python -m bert_fast.kernel_resources``.

Runs the ops' GPU launch path (the same launchers, tile choices and specialisations a CUDA
tensor gets) on CPU tensors, but where the launcher would launch a kernel, Triton compiles it
ahead of time for a GPU target instead (``JITFunction.warmup`` with a driver that names the
target): the whole chain, Python AST to PTX to a cubin from ptxas, for sm_80 or sm_90, on a
machine with no GPU and no CUDA driver. For each distinct compiled kernel it reports the
dynamic shared memory (Triton's metadata) and the registers and local memory per thread
(``cuobjdump -res-usage`` on the cubin; local memory is where ptxas spills registers).

Triton's interpreter, which runs the kernels in the CPU tests, checks none of this: it accepts
code the compiler rejects, and knows nothing of shared memory or registers. A kernel that needs
more shared memory than the GPU has fails at its first launch ("out of resource"); one that
spills runs slowly. tests/test_fake_gpu_compile.py holds every kernel to the limits below for
sm_90 in bf16 and fp32 (the two tile tables); this command's default adds sm_80 and fp16.

The kernels' outputs are never computed: the launchers' output buffers stay uninitialised, so
this is for compiling, not for checking values. Run it in a process of its own, without
TRITON_INTERPRET=1 (the interpreter replaces the kernels this compiles), and without a CUDA
device in use (it replaces Triton's active driver).
"""

import argparse
import contextlib
import dataclasses
import functools
import importlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile

import torch

# Dynamic shared memory one block may use (opt-in maximum), bytes: sm_80 (A100) 163 KB, sm_86 and
# sm_89 (consumer Ampere and Ada) 99 KB, sm_90 (H100) 227 KB. The kernels stay within the
# smallest, so one tile table serves every GPU from sm_80 on.
SHARED_LIMIT = {80: 166912, 86: 101376, 89: 101376, 90: 232448}
PORTABLE_SHARED_LIMIT = min(SHARED_LIMIT.values())
# Local memory per thread the kernels may use (spilled registers): a few bytes of spill are
# harmless; more means the tiles ask for more registers than a thread has.
LOCAL_LIMIT = 64


@dataclasses.dataclass
class KernelRecord:
    """One distinct compiled kernel: its name, constexpr values and resources on one target."""
    kernel: str
    arch: int
    constexprs: dict
    num_warps: int
    num_stages: int
    shared_bytes: int
    registers: int
    local_bytes: int
    stack_bytes: int


class TargetDriver:
    """What compiling a kernel asks of Triton's active driver (``JITFunction.warmup`` here,
    Inductor's compile step in tests/fake_gpu_compile.py), answered for a named target: nothing
    is launched, so no device, stream or CUDA driver is ever touched."""

    def __init__(self, arch):
        from triton.backends.compiler import GPUTarget
        self.target = GPUTarget("cuda", arch, 32)

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def get_current_target(self):
        return self.target

    def is_active(self):
        return True


def _cuobjdump():
    """Triton's bundled cuobjdump, else the CUDA toolkit's."""
    import triton
    bundled = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    found = bundled if os.path.exists(bundled) else shutil.which("cuobjdump")
    if found is None:
        raise RuntimeError("cuobjdump not found (neither in triton's package nor on PATH)")
    return found


def _resource_usage(cubin, workdir):
    """(registers, local bytes, stack bytes) per thread of the one function in a cubin."""
    path = os.path.join(workdir, "kernel.cubin")
    with open(path, "wb") as f:
        f.write(cubin)
    text = subprocess.run([_cuobjdump(), "-res-usage", path], check=True, capture_output=True,
                          text=True).stdout
    usage = re.search(r"REG:(\d+) STACK:(\d+) SHARED:\d+ LOCAL:(\d+)", text)
    if usage is None:
        raise RuntimeError(f"cuobjdump -res-usage printed no resource line:\n{text}")
    registers, stack, local = map(int, usage.groups())
    return registers, local, stack


class _AheadOfTimeLaunch:
    """Stands in for ``launch(kernel, like)``: ``[grid](*args, **kwargs)`` compiles, never launches."""

    def __init__(self, kernel, like, session):
        self.kernel, self.session = kernel, session

    def __getitem__(self, grid):
        from .ops._triton import with_pinned_options

        def compile_for_target(*args, **kwargs):     # with the eager launches' options
            compiled = self.kernel.warmup(*args, grid=grid, **with_pinned_options(kwargs))
            self.session.add(self.kernel, compiled)
        return compile_for_target


class _Session:
    def __init__(self, arch, workdir):
        self.arch, self.workdir = arch, workdir
        self.records, self._seen = [], set()

    def add(self, kernel, compiled):
        if id(compiled) in self._seen:      # Triton's in-memory cache: the same specialisation
            return
        self._seen.add(id(compiled))
        constexprs = {kernel.arg_names[path[0]]: value for path, value in compiled.src.constants.items()
                      if len(path) == 1}
        registers, local, stack = _resource_usage(compiled.asm["cubin"], self.workdir)
        meta = compiled.metadata
        self.records.append(KernelRecord(kernel.__name__, self.arch, _jsonable(constexprs), meta.num_warps,
                                         meta.num_stages, meta.shared, registers, local, stack))


def _jsonable(constexprs):
    return {name: value if isinstance(value, (int, float, str, bool, type(None))) else str(value)
            for name, value in constexprs.items()}


OP_FILES = ("add_layernorm", "attention", "bias_act", "column_sums", "embedding", "embedding_layernorm",
            "graph_inputs")


def _op_modules():
    # By file name: bert_fast.ops re-exports functions under some of these names.
    return [importlib.import_module(f"bert_fast.ops.{name}") for name in OP_FILES]


def defined_kernels():
    """Names of the Triton kernels (``@triton.jit`` functions named ``*_kernel``) in the op files
    (under TRITON_INTERPRET=1, ``@triton.jit`` makes InterpretedFunctions)."""
    import triton
    from triton.runtime.interpreter import InterpretedFunction
    return {name for module in _op_modules() for name, value in vars(module).items()
            if name.endswith("_kernel") and isinstance(value, (triton.JITFunction, InterpretedFunction))}


@contextlib.contextmanager
def targeting(arch):
    """Within: Triton's active driver is TargetDriver(arch), so a kernel compiles for
    ``sm_<arch>`` on a machine without a GPU, and the ops' launchers take CPU tensors."""
    if os.environ.get("TRITON_INTERPRET", "0") == "1":
        raise RuntimeError("compiling real kernels for a GPU target: run without TRITON_INTERPRET=1")
    from triton.runtime import driver
    from .ops import _triton
    previous_driver = getattr(driver, "_active", None)     # None where no GPU driver loaded
    driver.set_active(TargetDriver(arch))
    try:
        with _triton.launchers_take_cpu_tensors():
            yield
    finally:
        driver.set_active(previous_driver)


@contextlib.contextmanager
def compiling_for(arch):
    """Within: the ops' Triton launchers take CPU tensors, and compile their kernels for
    ``sm_<arch>`` instead of launching them. Yields the list of KernelRecords it fills."""
    from .ops import _triton
    op_modules = _op_modules()
    with targeting(arch), tempfile.TemporaryDirectory() as workdir:
        session = _Session(arch, workdir)
        try:
            for module in op_modules:
                module.launch = functools.partial(_AheadOfTimeLaunch, session=session)
            yield session.records
        finally:
            for module in op_modules:
                module.launch = _triton.launch


# ----------------------------------------------------------------------------------------------
# What to compile: the launch paths of the modules and ops, over the configurations that change
# a kernel's specialisation (dtype, head dim's tile class, masks, varlen, dropout, activation,
# learned positions, deterministic embedding backward).
# ----------------------------------------------------------------------------------------------

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}
# (num_heads, head_dim): BERT-base's 12 x 64, and one head dim per other tile class (BLOCK_D 32,
# 128 and 256; 96 and 192 are the odd ones, loads masked past d).
HEAD_CONFIGS = ((12, 64), (4, 32), (2, 96), (2, 192))
BERT_BASE = HEAD_CONFIGS[0]


def _encoder(num_heads, head_dim, dtype, device="cpu", **options):
    from .modules import FastBERTEncoder
    hidden = num_heads * head_dim
    return FastBERTEncoder(vocab_size=64, num_hiddens=hidden, norm_shape=[hidden], ffn_num_input=hidden,
                           ffn_num_hiddens=4 * hidden, num_heads=num_heads, num_layers=1, dropout=0.1,
                           max_len=64, key_size=hidden, query_size=hidden, value_size=hidden,
                           backend="triton", **options).to(device, dtype)


def run_workload(dtype, num_heads, head_dim, batch=2, seqlen=24, device="cpu", every_mask=True):
    """Every launch path of the triton backend at one dtype and head configuration: training
    forward+backward (dropout on) and inference, for each valid_lens form, padded and
    skip_padding, each activation, and the ops the modules do not reach on their own. On CPU
    tensors here; scripts/sanitize_kernels.py runs it on a GPU (``device="cuda"``).
    every_mask=False: the encoder gets 1-D valid_lens only (padded and packed), the same tiles
    in fewer compiles (collect())."""
    from . import ops
    from .ops.attention import _attention_dropout_keep_triton
    from .ops.embedding_layernorm import embedding_layernorm
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 64, (batch, seqlen), generator=generator).to(device)
    segments = torch.randint(0, 2, (batch, seqlen), generator=generator).to(device)
    valid_lens_forms = (None, torch.tensor([float(seqlen), seqlen / 2], device=device),
                        torch.arange(1, seqlen + 1, device=device).repeat(batch, 1))
    encoder_lens_forms = valid_lens_forms if every_mask else valid_lens_forms[1:2]
    for activation, learn_pos in (("relu", False), ("gelu", True), ("gelu_tanh", False)):
        for skip_padding in (False, True):
            encoder = _encoder(num_heads, head_dim, dtype, device, activation=activation,
                               skip_padding=skip_padding, learn_pos_embedding=learn_pos)
            for valid_lens in encoder_lens_forms:
                if skip_padding and valid_lens is not None and valid_lens.dim() == 2:
                    continue          # skip_padding takes 1-D lengths
                encoder.train()
                encoder(tokens, segments, valid_lens).float().sum().backward()
                encoder.eval()
                with torch.no_grad():
                    encoder(tokens, segments, valid_lens)
    hidden = num_heads * head_dim
    tables = [torch.randn(rows, hidden, dtype=dtype, device=device, requires_grad=True) for rows in (64, 2, 64)]
    tables[2] = tables[2].detach().unsqueeze(0).requires_grad_()
    for deterministic in (False, True):
        out = ops.embedding_sum(tokens, segments, *tables, backend="triton", learn_pos_embedding=True,
                                deterministic=deterministic)
        out.float().sum().backward()
    # HF's embeddings, LayerNorm fused in (padded ids, then packed ids with their positions); its
    # backward launches embedding_sum's kernels, compiled above.
    norm = (torch.ones(hidden, dtype=dtype, device=device), torch.zeros(hidden, dtype=dtype, device=device))
    positions = torch.arange(seqlen, device=device).repeat(batch)
    with torch.no_grad():
        embedding_layernorm(tokens, segments, tables[0], tables[1], tables[2][0], *norm, 1e-12, backend="triton")
        embedding_layernorm(tokens.flatten(), segments.flatten(), tables[0], tables[1], tables[2][0], *norm, 1e-12,
                            positions=positions, backend="triton")
    _attention_dropout_keep_triton(batch, num_heads, seqlen, 0.1, torch.zeros(1, dtype=torch.int64, device=device))
    if head_dim == 64:      # BERT's; each config compiles 3 more variants per dtype and arch
        one_kernel_attention_backward(dtype, num_heads, head_dim, batch, device)
    stage_graph_inputs(tokens, segments, valid_lens_forms)


def one_kernel_attention_backward(dtype, num_heads, head_dim, batch, device, seqlen=128):
    """The attention backward in one launch (off by default: ops.attention's
    ONE_KERNEL_BACKWARD_MAX_SEQLEN), at BERT's training length, whose 128 keys one program holds:
    padded with a key mask and dropout, without either, and packed (varlen) with dropout."""
    attention = importlib.import_module("bert_fast.ops.attention")
    saved = attention.ONE_KERNEL_BACKWARD_MAX_SEQLEN
    attention.ONE_KERNEL_BACKWARD_MAX_SEQLEN = seqlen
    try:
        qkv = torch.randn(batch, seqlen, 3 * num_heads * head_dim, dtype=dtype, device=device)
        grad = torch.randn(batch, seqlen, num_heads * head_dim, dtype=dtype, device=device)
        seed = torch.zeros(1, dtype=torch.int64, device=device)
        lengths = torch.full((batch,), float(seqlen), device=device)
        for valid_lens, p in ((lengths, 0.1), (None, 0.0)):
            out, lse = attention._attention_fwd_triton(qkv, valid_lens, num_heads, p, seed)
            attention._attention_bwd_triton(grad, qkv, out, lse, valid_lens, num_heads, p, seed)
        cu_seqlens = torch.arange(0, (batch + 1) * seqlen, seqlen, dtype=torch.int32, device=device)
        packed, packed_grad = qkv.flatten(0, 1), grad.flatten(0, 1)
        out, lse = attention._varlen_attention_fwd_triton(packed, cu_seqlens, num_heads, seqlen, 0.1, seed)
        attention._varlen_attention_bwd_triton(packed_grad, packed, out, lse, cu_seqlens, num_heads, seqlen, 0.1, seed)
    finally:
        attention.ONE_KERNEL_BACKWARD_MAX_SEQLEN = saved


def stage_graph_inputs(tokens, segments, valid_lens_forms):
    """cuda_graphs=True's staging kernel (ops.graph_inputs) for each lengths form (none, 1-D,
    2-D; int, float, half; attention masks), with and without segments and clamping, int64 and
    int32 ids; with segments the ids guarded (as when the value check reads after the replay)."""
    from .ops import graph_inputs
    batch, seqlen = tokens.shape
    device = tokens.device
    zeros = functools.partial(torch.zeros, device=device)
    stats = zeros(len(graph_inputs.STATS), dtype=torch.int64)
    for lengths in (*valid_lens_forms, torch.full((batch,), seqlen, device=device),
                    torch.full((batch,), seqlen, device=device).half()):
        for ids, segment_ids in ((tokens, segments), (tokens.int(), None)):
            lengths_shape = (batch + 1,) if lengths is None or lengths.dim() == 1 else (batch + 1, seqlen + 8)
            lengths_dtype = torch.int64 if lengths is None else (
                torch.float32 if lengths.dtype == torch.float16 else lengths.dtype)
            buffers = (zeros(batch + 1, seqlen + 8, dtype=ids.dtype), zeros(batch + 1, seqlen + 8, dtype=ids.dtype),
                       zeros(lengths_shape, dtype=lengths_dtype))
            graph_inputs.stage_inputs((ids, segment_ids, lengths), buffers, stats, full_length=seqlen,
                                      clamp=lengths is not None,
                                      id_limits=None if segment_ids is None else (int(tokens.max()) + 1, 2))
    # Hugging Face models' attention masks: a bool buffer, the mask given or None.
    for mask in (None, torch.ones(batch, seqlen, dtype=torch.int64, device=device)):
        buffers = (zeros(batch + 1, seqlen + 8, dtype=tokens.dtype), zeros(batch + 1, seqlen + 8, dtype=segments.dtype),
                   zeros(batch + 1, seqlen + 8, dtype=torch.bool))
        graph_inputs.stage_inputs((tokens, segments, mask), buffers, stats, full_length=seqlen, clamp=False)


def collect(archs=(90, 80), dtypes=tuple(DTYPES), head_configs=HEAD_CONFIGS):
    """KernelRecords of every distinct kernel the workloads compile, per target: every launch
    path at BERT's head config, the 1-D valid_lens paths (padded and packed) at the other tile
    classes. The other forms would add 8 attention compiles per head config and dtype (1-2 s of
    a CPU core each) of the same tiles. Measured at all four configs (sm_90, bf16 and fp32,
    2026-11-28): shared memory within 128 B of the 1-D form's; registers within 5 for 2-D and
    within 25% for no lengths, at most 179 of 255 at the other configs; no spills."""
    records = []
    for arch in archs:
        with compiling_for(arch) as compiled:
            for dtype in dtypes:
                for num_heads, head_dim in head_configs:
                    run_workload(DTYPES[dtype], num_heads, head_dim,
                                 every_mask=(num_heads, head_dim) == BERT_BASE)
        records += compiled
    return records


def violations(records):
    """What breaks the limits: shared memory beyond PORTABLE_SHARED_LIMIT, local memory (spills)
    beyond LOCAL_LIMIT."""
    found = []
    for r in records:
        if r.shared_bytes > PORTABLE_SHARED_LIMIT:
            found.append(f"{r.kernel} sm_{r.arch} {r.constexprs}: {r.shared_bytes} B of shared memory "
                         f"> {PORTABLE_SHARED_LIMIT}")
        if r.local_bytes > LOCAL_LIMIT:
            found.append(f"{r.kernel} sm_{r.arch} {r.constexprs}: {r.local_bytes} B of local memory "
                         f"(register spills) per thread > {LOCAL_LIMIT}")
    return found


def _table(records):
    lines = ["| kernel | sm | constexprs | warps | stages | shared KB | regs | local B |",
             "|---|---|---|---|---|---|---|---|"]
    for r in sorted(records, key=lambda r: (r.kernel, r.arch, -r.shared_bytes)):
        consts = ", ".join(f"{k}={v}" for k, v in r.constexprs.items())
        lines.append(f"| {r.kernel} | {r.arch} | {consts} | {r.num_warps} | {r.num_stages} | "
                     f"{r.shared_bytes / 1024:.1f} | {r.registers} | {r.local_bytes} |")
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(
        prog="python -m bert_fast.kernel_resources",
        description="Compile every Triton kernel the ops launch for GPU targets (no GPU needed) and "
                    "report shared memory, registers and spills per kernel.")
    parser.add_argument("--arch", type=int, action="append", choices=sorted(SHARED_LIMIT),
                        help="compute capability x10 to compile for; repeatable (default: 90 and 80)")
    parser.add_argument("--dtype", action="append", choices=sorted(DTYPES), help="repeatable (default: all)")
    parser.add_argument("--json", metavar="PATH", help="also write the records as JSON to PATH")
    args = parser.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET", "0") == "1":
        parser.error("TRITON_INTERPRET=1 is set: the interpreter replaces the kernels this compiles; unset it")
    records = collect(tuple(args.arch or (90, 80)), tuple(args.dtype or DTYPES))
    print(_table(records))
    if args.json:
        with open(args.json, "w") as f:
            json.dump([dataclasses.asdict(r) for r in records], f, indent=1)
    problems = violations(records)
    for problem in problems:
        print("over the limit:", problem, file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
