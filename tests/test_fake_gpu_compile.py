"""What a GPU's compiler makes of our kernels, checked on this CPU machine.

Triton's interpreter runs the kernels' arithmetic in the other tests; it compiles nothing. Here
Triton compiles them for real, for sm_90 (H100), in child processes without TRITON_INTERPRET:
  * through torch.compile: Inductor generates the code of a GPU graph holding our triton_ops
    (tests/fake_gpu_compile.py) and compiles its kernels and ours, with the argument types it
    gives them. The H100 run of 2026-11-23 failed here ("InductorError: SubprocException");
  * through the eager launchers: every kernel at every tile configuration the launchers pick
    (bert_fast.kernel_resources), held to the shared-memory and register-spill limits.
  * what a new sequence length compiles again: the attention kernels, at lengths whose only
    difference is in arguments left unspecialised, nothing.
Each child's compiled kernels land in a Triton cache of its own, where the test finds one cubin
per kernel it expects, compiled for sm_90. The children start when collection ends
(conftest.py) and run beside the rest of the suite; the tests that read them run last.
"""

import importlib.util
import json
import os
import pathlib
import re
import sys
import textwrap

import pytest
import torch

from bert_fast import kernel_resources
from bert_fast.ops._triton import HAS_TRITON
from tests.isolated import BackgroundProcess

REPO = pathlib.Path(__file__).resolve().parent.parent

pytestmark = [
    pytest.mark.skipif(not HAS_TRITON, reason="needs triton"),
    pytest.mark.skipif(torch.cuda.is_available(),
                       reason="on a GPU the GPU tests compile and run the kernels for real"),
]

# The kernels each torch.compile scenario must compile (Inductor's own kernels come beside them).
INFERENCE_KERNELS = {"_embedding_sum_fwd_kernel", "_attention_fwd_kernel", "_add_layernorm_fwd_kernel",
                     "_bias_act_fwd_kernel"}
HF_KERNELS = {"_attention_fwd_kernel", "_add_layernorm_fwd_kernel", "_bias_act_fwd_kernel"}   # (embeddings: PyTorch)
TRAINING_KERNELS = INFERENCE_KERNELS | {
    "_attention_bwd_dkdv_kernel", "_attention_bwd_dq_kernel",
    "_add_layernorm_bwd_kernel", "_bias_act_bwd_kernel", "_column_sums_kernel", "_embedding_sum_bwd_kernel",
    "_embedding_sum_bwd_pos_kernel", "_embedding_sum_bwd_chunk_kernel", "_embedding_sum_bwd_carry_kernel"}


def _compiling_for_sm90(*args):
    """A child process of this Python that compiles for sm_90, its caches in a directory of its own."""
    def env(workdir):
        env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(workdir / "inductor"),
                   TRITON_CACHE_DIR=str(workdir / "triton"), PYTHONPATH=str(REPO))
        env.pop("TRITON_INTERPRET", None)
        return env
    return BackgroundProcess([sys.executable, *args], env=env, cwd=REPO)


CHILDREN = {scenario: _compiling_for_sm90("-m", "tests.fake_gpu_compile", scenario)
            for scenario in ("inference", "hf-inference", "training-ops")}
# One child a tile table (150-175 s of one core each on the CI machine): at the suite's end, where
# one child with both was the last thing running, they keep both cores busy.
KERNEL_RESOURCES = [_compiling_for_sm90("-m", "bert_fast.kernel_resources", "--arch", "90", "--dtype", dtype)
                    for dtype in ("bf16", "fp32")]
for _child in KERNEL_RESOURCES:
    _child.command += ("--json", str(_child.workdir / "kernels.json"))

# The attention kernels compiled ahead of time for sm_90 (as the eager launchers compile them)
# at lengths that differ only in what the saved LSE's strides are divisible by, padded and packed:
# after each length, the number of distinct compiled kernels so far.
_LENGTHS_CHILD = textwrap.dedent("""
    import importlib, json, torch
    from bert_fast import kernel_resources
    attention = importlib.import_module("bert_fast.ops.attention")
    heads, head_dim, compiled = 4, 16, {}
    with kernel_resources.compiling_for(90) as records:
        for seqlen in (90, 92):          # heads * L: 360, then 368, a multiple of 16; L itself is not
            qkv = torch.randn(2, seqlen, 3 * heads * head_dim, dtype=torch.bfloat16)
            lengths = torch.tensor([float(seqlen), seqlen / 2])
            out, lse = attention._attention_fwd_triton(qkv, lengths, heads, 0.0, None)
            attention._attention_bwd_triton(out, qkv, out, lse, lengths, heads, 0.0, None)
            compiled[f"padded L {seqlen}"] = len(records)
        for total in (90, 96):           # the packed LSE's head stride is the token count
            cu_seqlens = torch.tensor([0, 45, total], dtype=torch.int32)
            qkv = torch.randn(total, 3 * heads * head_dim, dtype=torch.bfloat16)
            max_seqlen = max(45, total - 45)            # 45, then 51: neither a multiple of 16
            out, lse = attention._varlen_attention_fwd_triton(qkv, cu_seqlens, heads, max_seqlen, 0.0, None)
            attention._varlen_attention_bwd_triton(out, qkv, out, lse, cu_seqlens, heads, max_seqlen, 0.0, None)
            compiled[f"packed N {total}"] = len(records)
    print(json.dumps(compiled))
""")
ATTENTION_LENGTHS = _compiling_for_sm90("-c", _LENGTHS_CHILD)


def _children_of(item):
    """The children a test of this file reads."""
    if hasattr(item, "callspec"):
        return [CHILDREN[item.callspec.params["scenario"]]]
    if item.originalname == "test_every_kernel_compiles_for_gpus_within_their_limits":
        return KERNEL_RESOURCES
    if item.originalname == "test_a_new_length_compiles_attention_again_only_where_its_code_differs":
        return [ATTENTION_LENGTHS]
    return []


def start_background(items):
    """From conftest.py when collection ends: start the children the selected tests will read."""
    if not HAS_TRITON or torch.cuda.is_available():
        return
    for item in items:
        if getattr(item, "module", None) is not sys.modules[__name__]:
            continue
        for child in _children_of(item):
            if child is not CHILDREN["hf-inference"] or importlib.util.find_spec("transformers"):
                child.start()


def _compiled_kernels(triton_cache):
    """{kernel name: set of target archs} of the cubins in a Triton cache."""
    found = {}
    for metadata in pathlib.Path(triton_cache).rglob("*.json"):
        if metadata.name.startswith("__grp__"):
            continue
        meta = json.loads(metadata.read_text())
        if (metadata.parent / f"{meta['name']}.cubin").exists():
            found.setdefault(meta["name"], set()).add(meta["target"]["arch"])
    return found


# (scenario, kernels it must compile, graphs it compiles)
SCENARIOS = [("inference", INFERENCE_KERNELS, 12), ("hf-inference", HF_KERNELS, 2),
             ("training-ops", TRAINING_KERNELS, 1)]


@pytest.mark.reads_background
@pytest.mark.parametrize("scenario, kernels, graphs", SCENARIOS, ids=[s[0] for s in SCENARIOS])
def test_torch_compile_generates_and_compiles_our_kernels_for_sm90(scenario, kernels, graphs):
    """FastBERTEncoder (every valid_lens form, skip_padding; bf16 and fp32; default mode and
    reduce-overhead's CUDA graphs, which Inductor keeps), an HF BertModel after optimize(), and
    the forward and backward ops with dropout, padded and packed (these two bf16): Inductor's
    code for an H100 compiles. Without the kernels' fp32 cast of float arguments this fails as
    the H100 run did; without nothing_to_launch, skip_padding's unbacked token count stops the
    trace."""
    if scenario == "hf-inference":
        pytest.importorskip("transformers")
    child = CHILDREN[scenario]
    out = child.stdout()
    assert out.count("compiled:") == graphs, out
    # reduce-overhead (inference): Inductor keeps the CUDA graphs (the input check outside them).
    assert "cudagraph skips" not in out or set(re.findall(r"cudagraph skips (\d+)", out)) == {"0"}, out
    compiled = _compiled_kernels(child.workdir / "triton")
    missing = sorted(k for k in kernels if 90 not in compiled.get(k, ()))
    assert not missing, f"no sm_90 cubin for {missing}; compiled: {sorted(compiled)}"


@pytest.mark.reads_background
def test_every_kernel_compiles_for_gpus_within_their_limits():
    """Every launch path of the triton backend, compiled ahead of time for sm_90, bf16 and fp32
    (the two tile tables), at head dim 64; at 32, 96 and 192 (the other tile classes) those of
    1-D valid_lens, padded and packed (kernel_resources.collect): each compiles, fits the
    shared memory of every GPU from sm_80 on (kernel_resources.PORTABLE_SHARED_LIMIT) and spills
    no more than kernel_resources.LOCAL_LIMIT bytes per thread. Every kernel in the op files is
    among them."""
    records = []
    for child in KERNEL_RESOURCES:
        child.stdout()
        records += [kernel_resources.KernelRecord(**r) for r in json.loads((child.workdir / "kernels.json").read_text())]
    assert not kernel_resources.violations(records)
    assert {r.arch for r in records} == {90}
    defined = kernel_resources.defined_kernels()
    assert defined and not defined - {r.kernel for r in records}, defined - {r.kernel for r in records}
    # The tile table's largest forward tile is held to the limit for real: it needs over half of it.
    attention = [r for r in records if r.kernel == "_attention_fwd_kernel"]
    assert max(r.shared_bytes for r in attention) > kernel_resources.PORTABLE_SHARED_LIMIT // 2


@pytest.mark.reads_background
def test_a_new_length_compiles_attention_again_only_where_its_code_differs():
    """Triton compiles a kernel again for each new pattern of its integer arguments' divisibility
    by 16 (and of which are 1). The saved LSE's strides (heads * L; the packed token count) are
    left unspecialised, because their divisibility changes nothing in the compiled code
    (ops/attention.py): a length whose only difference is there compiles nothing new. Without
    that, L 92 after L 90 compiled the three attention kernels again, and so did 96 packed tokens
    after 90."""
    compiled = json.loads(ATTENTION_LENGTHS.stdout().splitlines()[-1])
    # forward, dQ and dK/dV: three kernels padded, three more packed (IS_VARLEN), none again
    assert compiled == {"padded L 90": 3, "padded L 92": 3, "packed N 90": 6, "packed N 96": 6}, compiled


def test_violations_name_the_kernel_and_the_limit():
    record = kernel_resources.KernelRecord("_k", 90, {"BLOCK_M": 256}, 8, 3, shared_bytes=200_000, registers=255,
                                           local_bytes=512, stack_bytes=512)
    problems = kernel_resources.violations([record])
    assert len(problems) == 2
    assert "_k sm_90" in problems[0] and "200000 B of shared memory" in problems[0]
    assert "512 B of local memory" in problems[1]
