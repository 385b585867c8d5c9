"""The command line of python -m bert_fast.bench: the main job writes a record and says where,
its progress counter counts every step, and every option's help is complete and names no
internals (the same for --suite gpu and --suite host)."""

import argparse
import re
from pathlib import Path

import pytest
import torch

from bert_fast import bench, bench_common, bench_suite, host_bench
from bert_fast.bench_common import BenchModels, Method

RESULTS = Path(__file__).resolve().parent.parent / "benchmarks" / "results"
STEP = re.compile(r"^\[(\d+)/(\d+)\] ", re.MULTILINE)
# A tiny main-job run on the CPU: two lengths, two untimed and two timed calls per method.
TINY_RUN = ["--device", "cpu", "--preset", "small", "--batch", "2", "--seq", "8", "16",
            "--warmup", "2", "--repeats", "2", "--no-compile"]
SHORT_RUN = ["--device", "cpu", "--preset", "small", "--batch", "2", "--seq", "8",
             "--warmup", "1", "--repeats", "1", "--no-compile", "--no-peers"]


def steps_shown(stderr):
    """The [k/N] counters of the progress lines, as (k, N) pairs in order."""
    return [(int(done), int(total)) for done, total in STEP.findall(stderr)]


def assert_counts_one_to_n(steps, expected_total):
    assert [done for done, _ in steps] == list(range(1, expected_total + 1)), steps
    assert {total for _, total in steps} == {expected_total}, steps


def test_main_job_counts_every_step_and_writes_its_record(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    bench.main(TINY_RUN)
    out, err = capsys.readouterr()
    # eager, the two peers, fast, fast_skip_padding: per length 5 first calls (a peer that
    # cannot be built, HF without transformers, is skipped there), 1 untimed and 2 timed rounds.
    assert_counts_one_to_n(steps_shown(err), bench.count_steps(5, 2, warmup=2, repeats=2))
    assert len(steps_shown(err)) == 2 * (5 + 1 + 2)
    [written] = re.findall(r"^wrote (.+)$", out, re.MULTILINE)
    path = tmp_path / written
    assert path.parent == tmp_path / "benchmarks" / "results"
    assert re.fullmatch(rf"{bench_common.device_slug(torch.device('cpu'))}"
                        r"-\d{4}-\d\d-\d\dT\d{4}\.json", path.name), path.name
    record = bench_common.load_json(path)
    assert bench_common.is_main_record(record)
    assert [(row["method"], row["seq"]) for row in record["rows"]] == [
        (method, seq) for seq in (8, 16) for method in ("eager", "torch_transformer", "hf_sdpa", "fast",
                                                         "fast_skip_padding")]
    for seq in (8, 16):
        rows = {row["method"]: row for row in record["rows"] if row["seq"] == seq and row["skipped"] is None}
        others = {name: row["median_ms"] for name, row in rows.items() if not row["ours"]}
        assert "torch_transformer" in others and rows["fast"]["ours"]
        best = min(others, key=others.get)
        for row in rows.values():
            assert row["best_peer"] == best
            assert row["speedup_vs_best_peer"] == pytest.approx(others[best] / row["median_ms"])
            assert row["max_abs_err"] <= 1e-4, row     # the peers run the reference's weights
    assert "JSON" not in out      # the footer names nothing the run did not write
    assert "vs best peer" in out
    # The fraction of the hardware's peak: each row's model TFLOP/s against one matmul of the run.
    peak = record["matmul_peak"]
    assert peak["dtype"] == "float32" and peak["tflops"] > 0 and f"{peak['tflops']:.3g} TFLOP/s" in out
    config = record["config"]["encoder"]
    for row in record["rows"]:
        if row["skipped"] is None:
            flops = bench_suite.encoder_flops(config, row["batch"], row["seq"])
            assert row["model_tflops"] == pytest.approx(flops / row["median_ms"] / 1e9)
            assert row["pct_of_matmul_peak"] == pytest.approx(100 * row["model_tflops"] / peak["tflops"])
    markdown = bench_common.format_markdown([record])
    assert "| TFLOP/s | % peak |" in markdown and "Matmul peak in the same run: float32" in markdown


def test_no_peers_times_eager_and_ours_only(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    bench.main(SHORT_RUN + ["--json", "run.json"])
    rows = bench_common.load_json(tmp_path / "run.json")["rows"]
    assert [row["method"] for row in rows] == ["eager", "fast", "fast_skip_padding"]
    assert all(row["best_peer"] == "eager" for row in rows)


def test_a_second_run_does_not_overwrite_the_first(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    folder = tmp_path / "benchmarks" / "results"
    folder.mkdir(parents=True)
    taken = bench_common.default_record_path(torch.device("cpu"))
    taken.write_text("{}")
    bench.main(SHORT_RUN)
    [written] = re.findall(r"^wrote (.+)$", capsys.readouterr().out, re.MULTILINE)
    assert taken.read_text() == "{}"
    # The same minute: the name gets -2 (a minute later: a new time).
    assert written != str(taken) and written.startswith("benchmarks/results/")


def test_json_and_no_record(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    bench.main(SHORT_RUN + ["--json", "sub/run.json"])
    assert "wrote sub/run.json" in capsys.readouterr().out
    assert bench_common.is_main_record(bench_common.load_json(tmp_path / "sub" / "run.json"))
    bench.main(SHORT_RUN + ["--no-record"])
    assert "wrote" not in capsys.readouterr().out
    assert not (tmp_path / "benchmarks").exists()
    with pytest.raises(SystemExit):
        bench.parse_args(["--json", "x.json", "--no-record"])


def test_a_method_skipped_on_its_first_call_keeps_the_count(capsys):
    """A compile failure skips the method, not its steps: the rounds still run, so the
    counter still ends at the count announced before the run."""
    models = bench_common.build_models("small", torch.float32, torch.device("cpu"),
                                       include_compile=False)

    def fails_to_compile(*inputs):
        raise RuntimeError("no compiler here")

    methods = dict(models.methods, compile=Method("compile", fails_to_compile, may_fail=True))
    rows = bench.run_benchmark(BenchModels(methods, models.reference, models.config), batch=2,
                               seqs=[8], min_len_frac=0.5, seed=0, repeats=2, warmup=3,
                               device=torch.device("cpu"), progress=bench_common.Progress())
    err = capsys.readouterr().err
    assert_counts_one_to_n(steps_shown(err), bench.count_steps(4, 1, warmup=3, repeats=2))
    assert "compile skipped at seq 8: RuntimeError: no compiler here" in err
    assert [row["skipped"] is None for row in rows] == [True, True, True, False]


# Options whose absence means "not this": no default to state.
NO_DEFAULT = {"--plot", "--plot-from", "--table-from", "--readme", "--suite", "--quick"}
PARSERS = {"main job": (bench.build_parser, ["--help"]),
           "--suite gpu": (bench_suite.build_parser, ["--suite", "gpu", "--help"]),
           "--suite host": (host_bench.build_parser, ["--suite", "host", "--help"])}


def internal_names():
    """Module-level names a user has no reason to know: ALL_CAPS constants and names with an
    underscore (functions, modules), of the benchmark modules."""
    names = set()
    for module in (bench, bench_common, bench_suite, host_bench):
        names |= {name for name in vars(module) if not name.startswith("__")
                  and (name.isupper() or "_" in name)}
    return names


@pytest.mark.parametrize("which", list(PARSERS))
def test_help_is_complete_and_names_no_internals(which, capsys):
    build_parser, argv = PARSERS[which]
    with pytest.raises(SystemExit) as exit_code:
        bench.main(argv)
    assert exit_code.value.code == 0
    text = capsys.readouterr().out
    for action in build_parser()._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        option = action.option_strings[0]
        assert action.help and action.help.strip(), f"{which}: {option} has no help"
        assert option in text
        flag = isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction))
        if not flag and option not in NO_DEFAULT:
            assert "default" in action.help, f"{which}: {option}'s help states no default"
    words = set(re.findall(r"[A-Za-z_][A-Za-z0-9_]*", text))
    assert not words & internal_names(), f"{which}: --help names {words & internal_names()}"
    assert not re.findall(r"\b[A-Z][A-Z0-9]*_[A-Z0-9_]+\b", text), which    # e.g. a metavar
    assert "{'" not in text and "['" not in text, f"{which}: a Python repr in --help"


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without a GPU")
@pytest.mark.parametrize("argv", [["--device", "cuda"], ["--suite", "gpu", "--device", "cuda"],
                                  ["--suite", "host", "--device", "cuda:0"], ["--device", "tpu"]],
                         ids=["main", "suite", "host", "unknown"])
def test_a_device_this_machine_lacks_is_a_usage_error(argv, tmp_path, monkeypatch, capsys):
    """Said before the run (no traceback from inside Module.to), and no record folder made."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exit_code:
        bench.main(argv + ["--json", "out/run.json"])
    assert exit_code.value.code == 2
    assert "--device" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_unavailable_backend_and_bad_plot_path_are_usage_errors(monkeypatch, capsys):
    from bert_fast import extension
    monkeypatch.setattr(extension, "load", lambda *args, **kwargs: False)
    with pytest.raises(SystemExit):
        bench.parse_args(["--device", "cpu", "--backends", "cuda"])
    assert "backend 'cuda' needs bert_fast's compiled extension" in capsys.readouterr().err
    pytest.importorskip("matplotlib")
    with pytest.raises(SystemExit):
        bench.parse_args(["--device", "cpu", "--plot", "no/such/folder/x.png"])
    assert "the folder no/such/folder does not exist" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        bench.parse_args(["--table-from", "x.json", "--plot", "x.png"])
    for argv, named in ((["--table-from", "x.json", "--preset", "large", "--json", "y.json"], "--preset, --json"),
                        (["--plot-from", "x.json", "--plot", "x.png", "--batch", "4"], "--batch")):
        with pytest.raises(SystemExit):         # would be ignored: no benchmark runs
            bench.parse_args(argv)
        assert f"runs no benchmark; it does not take {named}" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        bench_suite.parse_args(["--device", "cpu", "--matmul-n", "0"])


@pytest.mark.parametrize("option, message", [
    (["--heads", "0"], "--heads, --ffn, --batch and --seq must be >= 1"), (["--hidden", "0"], "must be >= 1"),
    (["--ffn", "0"], "must be >= 1"), (["--dropout", "1"], "--dropout must be in [0, 1), got 1.0"),
    (["--dropout", "-0.5"], "--dropout must be in [0, 1), got -0.5")])
def test_host_suite_sizes_and_dropout_out_of_range_are_usage_errors(option, message, capsys):
    """Said by the parser (exit 2), not by a ZeroDivisionError or a model's constructor."""
    with pytest.raises(SystemExit) as exit_code:
        bench.main(["--suite", "host", "--no-record", "--device", "cpu", *option])
    assert exit_code.value.code == 2 and message in capsys.readouterr().err


def test_records_that_cannot_be_read_or_drawn_are_named(tmp_path, capsys):
    host = tmp_path / "host.json"
    bench_common.write_json({"kind": bench_common.HOST_RECORD_KIND, "config": {}, "rows": []}, host)
    (tmp_path / "notes.log").write_text("not json")
    for argv, message in (
            (["--table-from", str(tmp_path / "missing.json")], "cannot read"),
            (["--table-from", str(tmp_path / "notes.log")], "notes.log is not a JSON record"),
            (["--table-from", str(RESULTS / "cpu-2core-2026-11-27T0821-host.json"), "--readme",
              str(tmp_path / "missing" / "README.md")], "cannot update"),
            (["--plot-from", str(host), "--plot", str(tmp_path / "x.png")], "host and kernel records have no plot")):
        if "--plot" in argv:
            pytest.importorskip("matplotlib")
        with pytest.raises(SystemExit) as exit_code:
            bench.main(argv)
        assert message in str(exit_code.value.code), (argv, exit_code.value.code)


def test_compiled_reference_is_compiled_static_per_length(monkeypatch):
    """The compile row times a static graph at every length (with automatic dynamic shapes the
    second length compiled a symbolic-length graph that later lengths reused): compiled with
    dynamic=False, Dynamo reset before each length."""
    compiled_with = []
    monkeypatch.setattr(torch, "compile", lambda module, **options: compiled_with.append(options) or module)
    models = bench_common.build_models("small", torch.float32, torch.device("cpu"), include_peers=False,
                                       backends=())
    assert compiled_with == [{"dynamic": False}] and models.methods["compile"].compiled
    resets = []
    monkeypatch.setattr(torch._dynamo, "reset", lambda: resets.append(1))
    bench.run_benchmark(models, batch=1, seqs=[8, 16, 24], min_len_frac=1.0, seed=0, repeats=1, warmup=1,
                        device=torch.device("cpu"))
    assert len(resets) == 3


def test_a_record_missing_a_field_and_an_unknown_suite_are_clear_errors(tmp_path, monkeypatch, capsys):
    """A record of the right kind without its fields gave a KeyError traceback; ``--suite foo``
    listed the GPU suite's choices only."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "partial.json").write_text('{"config": {"encoder": {}}, "rows": []}')
    for argv in (["--table-from", "partial.json"], ["--plot-from", "partial.json", "--plot", "x.png"]):
        with pytest.raises(SystemExit, match=r"a record of partial.json lacks the field '\w+'"):
            bench.main(argv)
    with pytest.raises(SystemExit):
        bench.main(["--suite", "foo"])
    assert "invalid choice: 'foo' (choose from 'gpu', 'host')" in capsys.readouterr().err
