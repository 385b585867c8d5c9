"""The benchmark matrix (python -m bert_fast.bench --suite gpu) in its CPU smoke mode: every
method of every shape is a row (timed, or skipped with a reason), the figures are finite, the
exact methods match the fp32 reference, and --table-from / --plot-from read the record."""

import datetime
import math
import os
import sys
from pathlib import Path

import pytest
import torch

import bert_fast
from bert_fast import bench, bench_common, bench_suite
from bert_fast.reference import BERTModel
from tests.isolated import BackgroundProcess

FP32_TOLERANCE = 1e-4       # STYLE.md's floor for fp32
CPU = torch.device("cpu")
INFERENCE_PEERS = ["eager", "compile", "compile_max_autotune", "torch_transformer", "hf_sdpa"]


def expected_methods(shape):
    """The row names of a shape on this CPU, in the suite's order."""
    suffixes = [bench_suite.backend_suffix(b) for b in bench_suite.default_backends(CPU)]
    if shape == "train":
        return ["eager", "compile", "graphed", "hf_sdpa"] + [f"{name}{suffix}" for suffix in suffixes
                                                             for name in ("optimize", "optimize_skip_padding")] + [
            "optimize_compile", "optimize_compile_reduce_overhead", "optimize_graphed", "hf_optimize"]
    names = INFERENCE_PEERS + ["hf_optimize", "hf_optimize_cuda_graphs"] + [f"{name}{suffix}" for suffix in suffixes
                               for name in ("fast", "fast_skip_padding")]
    names += ["fast_cuda_graphs", "fast_skip_padding_cuda_graphs"]
    return names + (["fast_compile_reduce_overhead", "fast_cuda_graph"] if shape == "latency" else [])


def test_method_names_are_the_rows_of_each_shape():
    # expected_methods is this file's own statement of the matrix; the pytest matrix
    # (benchmarks/test_gpu_matrix.py) is parametrized from bench_suite.method_names.
    backends = bench_suite.default_backends(CPU)
    for name, shape in bench_suite.SHAPES.items():
        assert bench_suite.method_names(shape, backends) == expected_methods(name)


def test_the_matmul_peak_is_its_fastest_call(monkeypatch):
    # On a shared machine a slow moment in a short median once put the eager encoder at "116%
    # of peak"; the peak is what the hardware did at its best, the median kept beside it.
    durations = iter([9.0, 9.0, 9.0] + [4.0, 2.0, 3.0, 8.0, 5.0])    # 3 untimed, 5 timed (s)
    monkeypatch.setattr(bench_suite, "time_interleaved", lambda methods, inputs, device, rounds, untimed_rounds: {
        "matmul": [next(durations) for _ in range(untimed_rounds + rounds)][untimed_rounds:]})
    peak = bench_suite.measure_matmul_peak("float32", CPU, 8, rounds=5, warmup=3)
    assert peak["fastest_ms"] == 2e3 and peak["median_ms"] == 4e3 and peak["calls"] == 5
    assert peak["tflops"] == pytest.approx(2 * 8 ** 3 / 2.0 / 1e12)
    assert peak["median_tflops"] == pytest.approx(2 * 8 ** 3 / 4.0 / 1e12)
    assert bench_common.matmul_peak_words(peak).endswith("(8³, fastest of 5 calls)")
    # Records before it took the median of 10 calls and say so when their tables are redrawn.
    old = dict(dtype="float32", n=1024, median_ms=10.0, tflops=0.215)
    assert bench_common.matmul_peak_words(old) == "float32 0.215 TFLOP/s (1024³, median of 10 calls)"


ROOT = Path(__file__).resolve().parent.parent
# The suite's CPU smoke run, as a user runs it (~28 s of one core, 2026-11-28): beside the rest
# of the suite (started by conftest.py when collection ends; the tests that read it run last).
SUITE_RUN = BackgroundProcess([sys.executable, "-m", "bert_fast.bench", "--suite", "gpu", "--device", "cpu",
                               "--preset", "demo", "--quick", "--dtype", "float32", "--rounds", "1"], cwd=ROOT)
SUITE_RUN.command += ["--json", str(SUITE_RUN.workdir / "record.json")]


@pytest.fixture(scope="module")
def record_path():
    SUITE_RUN.stdout()          # fails with its output unless it exited 0
    return SUITE_RUN.workdir / "record.json"


@pytest.fixture(scope="module")
def record(record_path):
    return bench_common.load_json(record_path)


def rows_of(record, shape):
    return [row for row in record["rows"] if row["shape"] == shape]


@pytest.mark.reads_background
def test_record_describes_the_run(record):
    assert bench_common.is_suite_record(record)
    assert record["environment"]["device"] == "cpu" and record["environment"]["torch"] == torch.__version__
    assert "--suite" in record["command"] and record["date"]
    assert record["config"]["flop_formula"] and record["config"]["quick"] is True
    [peak] = record["matmul_peaks"]
    assert peak["dtype"] == "float32" and math.isfinite(peak["tflops"]) and peak["tflops"] > 0
    # Which code ran (version and, in a checkout, commit), and that the run finished.
    assert record["environment"]["bert_fast"].startswith(bert_fast.__version__)
    assert record["complete"] is True
    assert "Incomplete run" not in bench_common.suite_record_markdown(record)
    cut_short = dict(record, complete=False)       # what a run stopped by a time limit leaves
    assert "**Incomplete run**" in bench_common.suite_record_markdown(cut_short)


@pytest.mark.reads_background
@pytest.mark.parametrize("shape", list(bench_suite.SHAPES))
def test_every_method_is_a_row(record, shape):
    rows = rows_of(record, shape)
    assert [row["method"] for row in rows] == expected_methods(shape)
    for row in rows:
        assert row["skipped"] is None or (isinstance(row["skipped"], str) and row["skipped"]), row
    skipped = {row["method"]: row["skipped"] for row in rows if row["skipped"] is not None}
    # --quick leaves compile out; CUDA graphs need CUDA; the exact paths always run on a CPU.
    assert all("not asked" in skipped[name] for name in skipped if "compile" in name and "reduce" not in name)
    assert "compile" in skipped
    cuda_only = (["fast_cuda_graphs", "fast_skip_padding_cuda_graphs"] if shape != "train" else
                 ["graphed", "optimize_graphed"]) + (
        ["fast_compile_reduce_overhead", "fast_cuda_graph"] if shape == "latency" else [])
    for name in cuda_only:
        assert "CUDA only" in skipped[name]
    assert "eager" not in skipped
    assert not any(name.startswith(("fast", "optimize")) for name in skipped
                   if name not in cuda_only and not name.startswith("optimize_compile")), skipped
    if shape == "train":         # not asked (--quick) before CUDA only
        assert "not asked" in skipped["optimize_compile_reduce_overhead"]


@pytest.mark.reads_background
@pytest.mark.parametrize("shape", list(bench_suite.SHAPES))
def test_figures_are_finite(record, shape):
    rows = rows_of(record, shape)
    timed = [row for row in rows if row["skipped"] is None]
    peers = {row["method"] for row in timed if not row["ours"]}
    for row in timed:
        for key in ("median_ms", "p90_ms", "valid_tokens_per_s", "padded_tokens_per_s",
                    "model_tflops", "pct_of_matmul_peak", "speedup_vs_eager", "speedup_vs_best_peer"):
            assert math.isfinite(row[key]) and row[key] > 0, (row["method"], key, row[key])
        assert row["p90_ms"] >= row["median_ms"]
        assert row["best_peer"] in peers
        assert math.isfinite(row["error"])
        assert row["peak_memory_mib"] is None      # CPU: no allocator statistics
    eager = next(row for row in timed if row["method"] == "eager")
    assert eager["speedup_vs_eager"] == pytest.approx(1.0)


@pytest.mark.reads_background
@pytest.mark.parametrize("shape", list(bench_suite.SHAPES))
def test_exact_methods_match_the_fp32_reference(record, shape):
    for row in rows_of(record, shape):
        if row["skipped"] is None and (row["ours"] or row["method"] == "eager"):
            assert row["error"] <= FP32_TOLERANCE, (row["method"], row["error"])


@pytest.mark.reads_background
def test_table_from_prints_every_group(record_path, record, capsys):
    bench.main(["--table-from", str(record_path)])
    table = capsys.readouterr().out
    assert record["environment"]["device_name"] in table
    assert table.count("| method | median ms |") == len(bench_suite.SHAPES)
    for shape in bench_suite.SHAPES:
        assert f"demo · float32 · {shape}**" in table
    for row in record["rows"]:
        assert row["method"] in table
    assert "skipped: CUDA only" in table


@pytest.mark.reads_background
def test_plot_from_draws_a_suite_record(record_path, tmp_path):
    pytest.importorskip("matplotlib")
    png = tmp_path / "suite.png"
    bench.main(["--plot", str(png), "--plot-from", str(record_path)])
    assert png.stat().st_size > 0


def test_a_failing_method_becomes_a_skipped_row():
    def broken(*inputs):
        raise RuntimeError("no kernel for this\nsecond line")

    calls = []

    def fails_while_timing(*inputs):
        calls.append(1)
        if len(calls) > 1:
            raise torch.cuda.OutOfMemoryError("out of memory")

    shape = bench_suite.Shape("toy", 2, 4, 1.0)
    methods = [bench_suite.SuiteMethod("eager", lambda *inputs: torch.zeros(2, 4, 1)),
               bench_suite.SuiteMethod("broken", broken, ours=True),
               bench_suite.SuiteMethod("oom", fails_while_timing),
               bench_suite.unavailable("missing", "not installed")]
    inputs = (None, None, torch.tensor([4, 4]))
    workload = bench_suite.Workload(shape, methods, inputs, check=lambda method, output: 0.0,
                                    prepare_timing=lambda methods: None,
                                    grad_context=torch.inference_mode, flops=1e6)
    results = bench_suite.measure(workload, CPU, rounds=2, warmup=1, progress=bench_common.Progress())
    rows = bench_suite.make_rows(workload, results, preset="toy", dtype_name="float32",
                                 matmul_peak_tflops=1.0)
    skipped = {row["method"]: row["skipped"] for row in rows}
    assert skipped["eager"] is None
    assert skipped["broken"] == "RuntimeError: no kernel for this"
    assert skipped["oom"].startswith("failed while timing: OutOfMemoryError")
    assert skipped["missing"] == "not installed"


def test_default_record_path_never_overwrites(tmp_path):
    when = datetime.datetime(2026, 11, 21, 9, 5)
    slug = bench_common.device_slug(CPU)
    assert slug.startswith("cpu-")
    first = bench_common.default_record_path(CPU, "matrix", now=when, folder=tmp_path)
    assert first == tmp_path / f"{slug}-2026-11-21T0905-matrix.json"
    first.write_text("{}")
    assert bench_common.default_record_path(CPU, "matrix", now=when, folder=tmp_path).name == \
        f"{slug}-2026-11-21T0905-matrix-2.json"
    assert bench_common.default_record_path(CPU, now=when, folder=tmp_path).name == \
        f"{slug}-2026-11-21T0905.json"


def test_default_bench_run_is_unchanged():
    args = bench.parse_args([])
    assert (args.preset, args.batch, args.dtype, args.seq) == ("base", 8, "float32", [128])
    assert args.suite is None and args.table_from is None
    assert not bench.suite_requested([]) and bench.suite_requested(["--suite", "gpu"])


def _matrix_env(workdir):
    # Not as an xdist worker: pytest-benchmark reads PYTEST_XDIST_WORKER and turns itself off.
    return {name: value for name, value in os.environ.items() if not name.startswith("PYTEST_XDIST")}


# ~20 s of one core (2026-11-28): beside the suite (started by conftest.py when collection ends).
MATRIX_SMOKE_RUN = BackgroundProcess(
    [sys.executable, "-m", "pytest", "benchmarks/test_gpu_matrix.py", "-q", "-p", "no:cacheprovider",
     "--matrix-device", "cpu", "--matrix-preset", "demo", "--matrix-dtype", "float32", "--matrix-quick",
     "--matrix-shapes", "mixed", "-k", "not compile"], env=_matrix_env, cwd=ROOT)
MATRIX_SMOKE_RUN.command += ["--matrix-record", str(MATRIX_SMOKE_RUN.workdir / "matrix.json")]


def start_background(items):
    """From conftest.py when collection ends: the runs the selected tests will read."""
    if any("record_path" in getattr(item, "fixturenames", ()) for item in items):
        SUITE_RUN.start()
    if any(getattr(item, "originalname", None) == "test_pytest_matrix_smoke_run" for item in items):
        MATRIX_SMOKE_RUN.start()


@pytest.mark.reads_background
def test_pytest_matrix_smoke_run():
    """benchmarks/test_gpu_matrix.py on the CPU (demo preset, quick shapes, no compile): every
    test passes or skips, and its record has the suite's rows with timings and speedups. One
    shape (the training shape's rows come from the same suite code: test_every_method_is_a_row)."""
    out = MATRIX_SMOKE_RUN.stdout()         # fails with its output unless pytest exited 0
    assert "bert_fast GPU matrix" in out and "demo-float32-mixed" in out
    record = bench_common.load_json(MATRIX_SMOKE_RUN.workdir / "matrix.json")
    assert bench_common.is_suite_record(record) and "pytest" in record["command"]
    assert {row["shape"] for row in record["rows"]} == {"mixed"}
    rows = rows_of(record, "mixed")
    assert [row["method"] for row in rows] == [
        name for name in expected_methods("mixed") if "compile" not in name]
    for row in rows:
        if "cuda_graphs" in row["method"] or "graphed" in row["method"]:          # CUDA only
            assert "CUDA only" in row["skipped"], row
            continue
        assert row["skipped"] is None, row
        assert row["median_ms"] > 0 and row["speedup_vs_eager"] > 0 and math.isfinite(row["error"])
        assert row["best_peer"] is not None
        if row["ours"]:
            assert row["error"] <= FP32_TOLERANCE, row


MAIN_JOB_RECORD = ROOT / "benchmarks" / "results" / "cpu-2core-2026-11-21.json"


def test_table_from_prints_a_main_job_record(capsys):
    bench.main(["--table-from", str(MAIN_JOB_RECORD)])
    table = capsys.readouterr().out
    record = bench_common.load_json(MAIN_JOB_RECORD)
    assert record["environment"]["device_name"] in table and " ".join(record["command"]) in table
    for row in record["rows"]:
        assert f"| {row['method']} | {row['seq']} | {row['median_ms']:.1f} |" in table


@pytest.mark.reads_background
def test_readme_gets_the_tables_between_its_markers(tmp_path, record_path):
    readme = tmp_path / "README.md"
    readme.write_text(f"# title\n\nbefore\n{bench_common.README_BEGIN}\nold table\n{bench_common.README_END}\nafter\n")
    for _ in range(2):      # rewriting is idempotent
        bench.main(["--table-from", str(MAIN_JOB_RECORD), str(record_path), "--readme", str(readme)])
        text = readme.read_text()
        assert text == bench_common.replace_generated_table(
            f"# title\n\nbefore\n{bench_common.README_BEGIN}\n{bench_common.README_END}\nafter\n",
            bench_common.table_from_files([MAIN_JOB_RECORD, record_path]))
    assert "old table" not in text and "| eager | 128 |" in text and "demo · float32 · train" in text


def test_table_from_says_what_is_wrong(tmp_path):
    readme = tmp_path / "README.md"
    readme.write_text("no markers here\n")
    with pytest.raises(SystemExit, match="needs the lines"):
        bench.main(["--table-from", str(MAIN_JOB_RECORD), "--readme", str(readme)])
    assert readme.read_text() == "no markers here\n"
    other = tmp_path / "other.json"
    other.write_text('{"rows": []}')
    with pytest.raises(SystemExit, match="none of them"):
        bench.main(["--table-from", str(other)])
    with pytest.raises(SystemExit):
        bench.parse_args(["--readme", str(readme)])      # --readme needs --table-from


H100_RECORDS = [ROOT / "benchmarks" / "results" / f"nvidia-h100-80gb-hbm3-2026-11-23-{part}-bf16.json"
                for part in ("base", "train-latency")]


def test_table_from_renders_the_h100_records(capsys):
    bench.main(["--table-from", *map(str, H100_RECORDS)])
    table = capsys.readouterr().out
    assert table.count("Measured on **NVIDIA H100 80GB HBM3** (cuda)") == 2
    assert "torch 2.11.0+cu130, triton 3.6.0, CUDA 13.0" in table
    for shape in ("dense", "long", "mixed", "train", "latency"):
        assert table.count(f"**base · bfloat16 · {shape}**") == 1
    # Medians from the JSON: dense eager 12.998... ms, latency fast_cuda_graph 0.659... ms.
    assert "| eager | 12.998 | 13.152 |" in table
    assert "| **fast_cuda_graph** | 0.659 | 0.678 |" in table and "| 11.93× |" in table
    assert "| **fast_compile_reduce_overhead** | skipped: InductorError: SubprocException" in table
    for record in map(bench_common.load_json, H100_RECORDS):
        for row in record["rows"]:
            name = f"**{row['method']}**" if row["ours"] else row["method"]
            cell = f"skipped: {row['skipped']}" if row["skipped"] else f"{row['median_ms']:.3f}"
            assert f"| {name} | {cell} |" in table


def test_readme_replaces_only_the_block_naming_the_records(tmp_path):
    # Marker paths are relative to the README's folder; the command's, to the working directory.
    (tmp_path / "results").mkdir()
    h100 = []
    for path in H100_RECORDS:
        h100.append(tmp_path / "results" / path.name)
        h100[-1].write_bytes(path.read_bytes())
    cpu_begin = bench_common.readme_begin_marker([MAIN_JOB_RECORD])
    h100_begin = bench_common.readme_begin_marker([f"results/{path.name}" for path in h100])
    end = bench_common.README_END
    readme = tmp_path / "README.md"
    readme.write_text(f"# title\n\n{cpu_begin}\nold cpu\n{end}\n\nbetween\n\n{h100_begin}\nold h100\n{end}\nafter\n")
    cpu_table = bench_common.table_from_files([MAIN_JOB_RECORD])
    h100_table = bench_common.table_from_files(h100)

    bench.main(["--table-from", *map(str, h100), "--readme", str(readme)])
    assert readme.read_text() == (f"# title\n\n{cpu_begin}\nold cpu\n{end}\n\nbetween\n\n"
                                  f"{h100_begin}\n\n{h100_table}\n\n{end}\nafter\n")
    expected = (f"# title\n\n{cpu_begin}\n\n{cpu_table}\n\n{end}\n\nbetween\n\n"
                f"{h100_begin}\n\n{h100_table}\n\n{end}\nafter\n")
    for _ in range(2):      # rewriting is idempotent
        bench.main(["--table-from", str(MAIN_JOB_RECORD), "--readme", str(readme)])
        assert readme.read_text() == expected
    # Records that no block names (one of the pair, or the pair reversed): no place, no change.
    for records in ([h100[0]], h100[::-1]):
        with pytest.raises(SystemExit, match="needs the lines"):
            bench.main(["--table-from", *map(str, records), "--readme", str(readme)])
        assert readme.read_text() == expected
    assert [block.records for block in bench_common.generated_blocks(expected)] == [
        (str(MAIN_JOB_RECORD),), tuple(f"results/{path.name}" for path in h100)]
    unclosed = f"{bench_common.README_BEGIN}\n{h100_begin}\n{end}\n"
    with pytest.raises(ValueError, match="has no"):
        bench_common.replace_generated_table(unclosed, "table", h100)


@pytest.mark.parametrize("document, least_blocks", [("README.md", 2), ("docs/gpu-runs.md", 5), ("docs/host-time.md", 2)])
def test_the_readme_tables_are_those_of_their_records(document, least_blocks):
    """Every generated block of README.md and of the docs it moved its run history to holds
    what --table-from makes of the records its marker names, read from the document's folder
    (rerun the marker's command after changing a record or the table code)."""
    path = ROOT / document
    text = path.read_text(encoding="utf-8")
    blocks = bench_common.generated_blocks(text)
    assert len(blocks) >= least_blocks
    for block in blocks:
        records = [path.parent / record for record in block.records]
        assert text == bench_common.replace_generated_table(
            text, bench_common.table_from_files(records), records, base_dir=path.parent), block.records


def test_graphed_train_step_captures_once_per_training_state(monkeypatch):
    """TrainStep(graph_encoder=True), the graphed rows' step, with make_graphed_callables
    stubbed (graphs need CUDA): one capture per training state, check_inputs off, the whole
    encoder call's arguments, and a new capture wraps the class's forward, not the last one's."""
    captures = []

    def fake_make_graphed_callables(module, sample_args, allow_unused_input=False):
        captures.append(dict(training=module.training, check_inputs=module.check_inputs,
                             args=sample_args, allow_unused_input=allow_unused_input))
        original, state = module.forward, module.training

        def graphed_forward(*args):        # as PyTorch's: the graphs only in the captured state
            captures[-1]["replays"] = captures[-1].get("replays", 0) + 1
            assert module.training == state
            return original(*args)
        module.forward = graphed_forward
        return module

    monkeypatch.setattr(torch.cuda, "make_graphed_callables", fake_make_graphed_callables)
    config = dict(vocab_size=64, num_hiddens=32, norm_shape=[32], ffn_num_input=32, ffn_num_hiddens=64,
                  num_heads=2, num_layers=2, dropout=0.0, max_len=32, key_size=32, query_size=32,
                  value_size=32, hid_in_features=32, mlm_in_features=32, nsp_in_features=32)
    model = bert_fast.optimize(BERTModel(**config)).eval()
    batch = bench_suite.make_train_batch(bench_suite.Shape("train", 2, 16, 0.5), 64, 0, "cpu")
    step = bench_suite.TrainStep(model, CPU, graph_encoder=True)
    step(*batch), step(*batch)
    model.train()
    step(*batch), step(*batch)
    assert [(c["training"], c["check_inputs"], c["allow_unused_input"], c["replays"]) for c in captures] == [
        (False, False, True, 2), (True, False, True, 2)]
    assert all(c["args"] == tuple(batch[:3]) for c in captures)
