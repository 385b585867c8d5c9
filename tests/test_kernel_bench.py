"""kernel_bench: row arithmetic, the graph-or-do_bench decision, the CLI; one GPU pass.

Everything but the last test runs without a GPU: the CUDA parts of ``measure`` (``_sync``,
``_graph_ms``, ``_do_bench_ms``) are replaced by stubs, the rest is the real code. The GPU test
times a tiny add_layernorm in CUDA graphs and checks the point of the module: the graph-timed
GPU time per call is well below the host time per call that single-call timing used to report.
"""

import json
import os
import subprocess
import sys

import pytest
import torch

import bert_fast.kernel_bench as kb
from tests.helpers import needs_cuda, needs_kernels

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# --------------------------------------------------------------------------- row arithmetic

def test_gbps_and_tflops():
    assert kb.gbps(3e9, 1.0) == pytest.approx(3000.0)          # 3 GB in 1 ms
    assert kb.gbps(1e9, 0.5) == pytest.approx(2000.0)
    assert kb.tflops(2e12, 1000.0) == pytest.approx(2.0)       # 2 TFLOP in 1 s
    assert kb.tflops(4 * 16 * 12 * 512**2 * 64, 0.1) == pytest.approx(128.8490189, rel=1e-6)


def test_figures_from_gpu_ms():
    row = kb.with_figures(dict(ms=0.5), nbytes=10**9, copy_gbps=4000.0)
    assert row["bytes"] == 10**9
    assert row["gbps"] == pytest.approx(2000.0)
    assert row["frac_of_copy"] == pytest.approx(0.5)
    row = kb.with_figures(dict(ms=0.25), flops=5e8)         # 5e8 in 0.25 ms
    assert row["tflops"] == pytest.approx(2.0) and "gbps" not in row


def test_no_figures_without_a_time():
    row = kb.with_figures(dict(ms=None, error="failed eagerly: x"), nbytes=100, copy_gbps=1.0)
    assert row["gbps"] is None and row["frac_of_copy"] is None
    assert kb.with_figures(dict(ms=None), flops=1e9)["tflops"] is None


def test_percentiles():
    median, p20, p80 = kb._percentiles([float(v) for v in range(1, 12)])   # 1 .. 11
    assert (median, p20, p80) == pytest.approx((6.0, 3.0, 9.0))
    assert kb._percentiles([0.5]) == (0.5, 0.5, 0.5)


# --------------------------------------------------------------------------- measure()

class Counter:
    def __init__(self, fail=None):
        self.calls, self.fail = 0, fail

    def __call__(self):
        self.calls += 1
        if self.fail:
            raise self.fail


@pytest.fixture
def no_cuda_sync(monkeypatch):
    monkeypatch.setattr(kb, "_sync", lambda: None)


def fail_if_called(*args):
    raise AssertionError("should not be called")


def test_measure_times_the_gpu_in_a_graph_and_the_host_per_call(monkeypatch, no_cuda_sync):
    seen = {}

    def graph_ms(fn, calls, replays):
        seen.update(calls=calls, replays=replays)
        return [0.02, 0.01, 0.03, 0.02, 0.02]
    monkeypatch.setattr(kb, "_graph_ms", graph_ms)
    monkeypatch.setattr(kb, "_do_bench_ms", fail_if_called)
    fn = Counter()
    row = kb.measure(fn)
    assert seen == dict(calls=kb.CALLS_PER_GRAPH, replays=kb.REPLAYS)
    assert row["timed_by"] == "cuda graph" and "note" not in row and "error" not in row
    assert row["ms"] == pytest.approx(0.02)
    assert row["ms_p20"] <= row["ms"] <= row["ms_p80"]
    assert row["host_us"] > 0
    # One eager call first, then HOST_ROUNDS rounds of HOST_CALLS for the host time.
    assert fn.calls == 1 + kb.HOST_CALLS * kb.HOST_ROUNDS


def test_measure_lists_the_kernels_when_asked(monkeypatch, no_cuda_sync):
    """--kernels: measure() adds kernel_breakdown's answer to the row, format_row prints it
    under the row; a profiler failure is a note, the times stay."""
    monkeypatch.setattr(kb, "_graph_ms", lambda fn, calls, replays: [0.02] * 5)
    breakdown = {"_add_layernorm_bwd_kernel": (1.0, 140.0), "reduce_kernel": (2.0, 6.5)}
    monkeypatch.setattr(kb, "kernel_breakdown", lambda fn: breakdown)
    assert "kernels" not in kb.measure(Counter())
    monkeypatch.setattr(kb, "BREAKDOWN", True)
    row = kb.measure(Counter())
    assert row["kernels"] == breakdown and row["ms"] == pytest.approx(0.02)
    row.update(op="add_layernorm", direction="fwd+bwd", tokens=8192, hidden=768, method="triton",
               gbps=None, frac_of_copy=None)
    lines = kb.format_row(row).splitlines()
    assert "140.0 us  1.0x  _add_layernorm_bwd_kernel" in lines[1] and "6.5 us  2.0x  reduce_kernel" in lines[2]

    def profiler_fails(fn):
        raise RuntimeError("CUPTI_ERROR_INSUFFICIENT_PRIVILEGES")
    monkeypatch.setattr(kb, "kernel_breakdown", profiler_fails)
    row = kb.measure(Counter())
    assert "kernels" not in row and row["ms"] == pytest.approx(0.02)
    assert row["note"].startswith("no kernel breakdown: RuntimeError: CUPTI_ERROR_INSUFFICIENT_PRIVILEGES")


def test_measure_falls_back_to_do_bench_when_capture_raises(monkeypatch, no_cuda_sync):
    def capture_fails(fn, calls, replays):
        raise RuntimeError("CUDA error: operation not permitted when stream is capturing\nmore")
    monkeypatch.setattr(kb, "_graph_ms", capture_fails)
    monkeypatch.setattr(kb, "_do_bench_ms", lambda fn: (0.2, 0.1, 0.3))
    row = kb.measure(Counter())
    assert row["timed_by"] == "do_bench"
    assert (row["ms"], row["ms_p20"], row["ms_p80"]) == (0.2, 0.1, 0.3)
    assert "not capturable in a CUDA graph (RuntimeError: CUDA error: operation not permitted when " \
           "stream is capturing)" in row["note"], row["note"]
    assert "do_bench" in row["note"] and "error" not in row
    assert row["host_us"] is not None
    # The row still gets its figures, from the do_bench time.
    assert kb.with_figures(row, nbytes=2 * 10**8)["gbps"] == pytest.approx(1000.0)


def test_capture_failure_names_the_first_cause():
    try:
        try:
            raise RuntimeError("CUDA error: operation not permitted when stream is capturing")
        finally:
            raise RuntimeError("CUDA error: operation failed due to a previous error during capture")
    except RuntimeError as error:
        text = kb._capture_failure(error)
    assert text == ("RuntimeError: CUDA error: operation not permitted when stream is capturing; then "
                    "RuntimeError: CUDA error: operation failed due to a previous error during capture")
    assert kb._capture_failure(ValueError("plain")) == "ValueError: plain"


def test_measure_reports_a_method_that_fails_eagerly(monkeypatch, no_cuda_sync):
    monkeypatch.setattr(kb, "_graph_ms", fail_if_called)
    monkeypatch.setattr(kb, "_do_bench_ms", fail_if_called)
    row = kb.measure(Counter(fail=ValueError("head_dim 300 > 256")))
    assert row["error"] == "failed eagerly: ValueError: head_dim 300 > 256"
    assert row["ms"] is None and row["host_us"] is None and row["timed_by"] is None


def test_measure_reports_do_bench_failing_after_capture(monkeypatch, no_cuda_sync):
    def raises(*args):
        raise RuntimeError("boom")
    monkeypatch.setattr(kb, "_graph_ms", raises)
    monkeypatch.setattr(kb, "_do_bench_ms", raises)
    row = kb.measure(Counter())
    assert row["error"] == "do_bench failed too: RuntimeError: boom" and row["ms"] is None
    assert "not capturable" in row["note"]


def test_fwd_bwd_step_resets_grads_inside_the_step():
    w = torch.ones(3, requires_grad=True)
    step = kb._fwd_bwd(lambda: w * 2, [w])
    step()
    first = w.grad.clone()
    step()
    # Set to None and made afresh by each step: the same grad, not twice it (accumulated).
    assert torch.equal(w.grad, first)


@needs_kernels
def test_rows_on_cpu_with_stub_timings(monkeypatch):
    """The row builders with measure() stubbed: fields, figures, the op filter; the ops'
    forwards run once each (in the interpreter on the CPU) to build the fwd+bwd steps."""
    monkeypatch.setattr(kb, "measure", lambda fn: dict(ms=0.5, ms_p20=0.4, ms_p80=0.6, host_us=50.0,
                                                       timed_by="cuda graph"))
    rows = kb.memory_bound_rows(torch.device("cpu"), torch.float16, copy_gbps=100.0, tokens=512,
                                sizes=((32, 64),), only=("add_layernorm", "bias_act relu"))
    assert {r["op"] for r in rows} == {"add_layernorm", "bias_act relu"}
    by_key = {(r["op"], r["method"], r["direction"]): r for r in rows}
    ln = by_key["add_layernorm", "triton", "fwd"]
    assert ln["bytes"] == 3 * 512 * 32 * 2 and ln["gbps"] == pytest.approx(ln["bytes"] / 0.5e-3 / 1e9)
    assert ln["frac_of_copy"] == pytest.approx(ln["gbps"] / 100.0)
    assert by_key["bias_act relu", "torch", "fwd+bwd"]["hidden"] == 64
    attention = kb.attention_rows(torch.device("cpu"), torch.float16, batch=2, head_dim=16, num_heads=2,
                                  seqlens=(16,))
    assert len(attention) == 8
    for row in attention:
        flops = 4 * 2 * 2 * 16**2 * 16 * (1 if row["direction"] == "fwd" else 3.5)
        assert row["tflops"] == pytest.approx(flops / 0.5e-3 / 1e12)
        assert kb.format_row(row).startswith("attention")
    # Fewer tokens than a sequence of 512 (a batch-1 forward): one sequence of that length.
    embedding = kb.memory_bound_rows(torch.device("cpu"), torch.float16, copy_gbps=100.0, tokens=128,
                                     sizes=((32, 64),), only=("embedding_sum",))
    assert {(r["op"], r["tokens"]) for r in embedding} == {("embedding_sum", 128)}
    assert by_key["add_layernorm", "triton", "fwd"]["tokens"] == 512


def test_format_row_with_note_error_and_missing_times():
    row = dict(op="add_layernorm", direction="fwd", tokens=8, hidden=4, method="triton", ms=None,
               host_us=None, gbps=None, frac_of_copy=None, error="failed eagerly: ValueError: x")
    assert "error: failed eagerly" in kb.format_row(row)
    row.update(ms=0.015, host_us=120.0, gbps=2500.0, frac_of_copy=0.85, note="not capturable ...")
    del row["error"]
    text = kb.format_row(row)
    assert "0.0150 ms GPU" in text and "120.0 us host" in text and "(85% of copy)" in text
    assert "note: not capturable" in text


def test_timing_description_is_json_and_names_the_counts():
    timing = json.loads(json.dumps(kb.timing_description()))
    assert timing["calls_per_graph"] == kb.CALLS_PER_GRAPH and timing["l2_flush"] is False
    assert "CUDA graph" in timing["gpu"] and "perf_counter" in timing["host"]


# --------------------------------------------------------------------------- the command line

def test_parse_args():
    args = kb.parse_args([])
    assert (args.dtype, args.json) == ("bfloat16", None)
    args = kb.parse_args(["--json", "out.json", "--dtype", "float16"])
    assert (args.dtype, args.json) == ("float16", "out.json")
    with pytest.raises(SystemExit) as exit_info:
        kb.parse_args(["--dtype", "float32"])
    assert exit_info.value.code == 2
    assert (args.ops, args.tokens, args.kernels) == (list(kb.OP_CHOICES), [8192], False)
    args = kb.parse_args(["--ops", "add_layernorm", "embedding_sum", "--tokens", "128", "1024"])
    assert (args.ops, args.tokens) == (["add_layernorm", "embedding_sum"], [128, 1024])
    assert kb.parse_args(["--kernels"]).kernels
    for tokens in ("700", "0"):     # embedding_sum's sequences: up to 512 tokens, all the same length
        with pytest.raises(SystemExit) as exit_info:
            kb.parse_args(["--tokens", tokens])
        assert exit_info.value.code == 2


def test_main_without_cuda_exits_with_a_message(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit) as exit_info:
        kb.main(["--json", "never-written.json"])
    assert "kernel_bench needs a CUDA GPU" in str(exit_info.value.code)
    assert not os.path.exists("never-written.json")


def test_main_refuses_the_triton_interpreter(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    with pytest.raises(SystemExit) as exit_info:
        kb.main([])
    assert "TRITON_INTERPRET=1 is set" in str(exit_info.value.code)


def test_cli_without_cuda_prints_the_message_not_a_traceback():
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    env.pop("TRITON_INTERPRET", None)
    done = subprocess.run([sys.executable, "-m", "bert_fast.kernel_bench"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 1, done.stderr
    assert "kernel_bench needs a CUDA GPU" in done.stderr and "Traceback" not in done.stderr, done.stderr


# --------------------------------------------------------------------------- GPU

@needs_cuda
def test_graph_timing_on_gpu(monkeypatch):
    monkeypatch.setattr(kb, "CALLS_PER_GRAPH", 20)
    monkeypatch.setattr(kb, "REPLAYS", 5)
    device = torch.device("cuda")
    copy_gbps, copy = kb.copy_bandwidth(device, nbytes=64 * 2**20)
    assert copy["timed_by"] == "cuda graph" and copy_gbps > 0, copy
    rows = kb.memory_bound_rows(device, torch.float16, copy_gbps, tokens=1024, sizes=((768, 3072),),
                                only=("add_layernorm",))
    for row in rows:
        print(kb.format_row(row))
    for row in (r for r in rows if r["method"] == "triton"):
        assert row["timed_by"] == "cuda graph", row
        # The point of graph timing: one add_layernorm of 1024x768 runs in a few us on the GPU,
        # while enqueuing it from Python takes tens; single-call timing reported the latter.
        assert row["ms"] * 1e3 < row["host_us"] / 2, row

    # A call that synchronises cannot be captured: do_bench times it, and the next method is
    # still captured (the failed capture left the stream and the context usable).
    x = torch.ones(1024, device=device)
    row = kb.measure(lambda: (x * 2).sum().item())
    assert row["timed_by"] == "do_bench" and "not capturable" in row["note"] and row["ms"] > 0, row
    assert torch.cuda.current_stream() == torch.cuda.default_stream()
    row = kb.measure(lambda: x.mul(2))
    assert row["timed_by"] == "cuda graph" and row["ms"] > 0, row


def test_small_m_gemms_split_over_k_sum_to_the_product():
    """scripts/small_m_gemm.py --split-k (a GPU probe) times K split into S partial GEMMs read
    as views of x and the weight: their sum must be the GEMM, else its times are of another one."""
    from scripts.small_m_gemm import split_k_partials
    x, weight = torch.randn(16, 96, dtype=torch.float64), torch.randn(40, 96, dtype=torch.float64)
    for splits in (2, 4, 8):
        partials = split_k_partials(x, weight, splits)
        assert partials.shape == (splits, 16, 40)
        chunk = 96 // splits
        assert torch.allclose(partials[1], x[:, chunk:2 * chunk] @ weight[:, chunk:2 * chunk].t())
        assert torch.allclose(partials.sum(0), x @ weight.t())
