"""Fixtures of the encoder benchmarks: per shape, the methods on shared weights, one batch of
inputs and the fp32 eager output they are checked against (built once per session)."""

from pathlib import Path
from typing import NamedTuple

import pytest
import torch

from bert_fast import bench_suite
from bert_fast.bench_common import (DTYPES, BenchModels, EncoderInputs, build_models, default_device,
                                    first_call, group_key, group_markdown, groups, make_inputs,
                                    write_json)


class BenchShape(NamedTuple):
    preset: str
    batch: int
    seq: int
    min_len_frac: float = 0.5

    @property
    def id(self):
        return f"{self.preset}-b{self.batch}-l{self.seq}"


# Small enough that the whole suite, torch.compile included, runs in about a minute on a
# 2-core CPU; the CLI (python -m bert_fast.bench) is the tool for model-sized numbers.
BENCH_SHAPES = [BenchShape("small", batch=4, seq=64), BenchShape("demo", batch=4, seq=32)]




class BenchCase(NamedTuple):
    shape: BenchShape
    device: torch.device
    models: BenchModels
    inputs: EncoderInputs
    reference_output: torch.Tensor


@pytest.fixture(scope="session", params=BENCH_SHAPES, ids=lambda shape: shape.id)
def bench_case(request):
    shape = request.param
    device = default_device()
    models = build_models(shape.preset, torch.float32, device, seed=0, backends=bench_suite.default_backends(device),
                          include_peers=True)
    inputs = make_inputs(shape.batch, shape.seq, shape.min_len_frac, models.config["vocab_size"],
                         seed=0, device=device)
    with torch.inference_mode():
        reference_output = models.reference(*inputs)
    return BenchCase(shape, device, models, inputs, reference_output)


@pytest.fixture(scope="session")
def fp32_matmul_peak():
    """TFLOP/s of one square fp32 matmul on the benchmarks' device (timed once a session): the
    peak each forward's model TFLOP/s are a share of (as the CLI's % peak)."""
    device = default_device()
    return bench_suite.measure_matmul_peak("float32", device, bench_suite.default_matmul_size(device, "float32"))


# --------------------------------------------------------------------------- the GPU matrix
# test_gpu_matrix.py: bench_suite's workloads, one test per (preset, dtype, shape, method).

MATRIX_KEY = pytest.StashKey["Matrix"]()


def pytest_addoption(parser):
    group = parser.getgroup("bert_fast GPU matrix (benchmarks/test_gpu_matrix.py)")
    group.addoption("--matrix-preset", nargs="+", default=["base", "large"], metavar="PRESET",
                    help="presets of the matrix (default: base large)")
    group.addoption("--matrix-dtype", nargs="+", default=["bfloat16", "float16"], metavar="DTYPE",
                    help="dtypes of the matrix (default: bfloat16 float16)")
    group.addoption("--matrix-shapes", nargs="+", default=list(bench_suite.SHAPES), metavar="SHAPE",
                    help=f"shapes of the matrix (default: all of {list(bench_suite.SHAPES)})")
    group.addoption("--matrix-backends", nargs="+", metavar="BACKEND",
                    help="FastBERTEncoder backends (default: auto and every other one that can run)")
    group.addoption("--matrix-device", metavar="DEVICE",
                    help="default: cuda; without CUDA the matrix is skipped unless a device is named "
                         "(--matrix-device cpu --matrix-preset demo --matrix-quick is the smoke run)")
    group.addoption("--matrix-quick", action="store_true",
                    help="the CLI's --quick shapes and rounds (B <= 2, L <= 32)")
    group.addoption("--matrix-record", metavar="PATH",
                    help="also write the rows as a suite record (python -m bert_fast.bench "
                         "--table-from PATH prints it)")


class Matrix:
    """The state the matrix's tests share: one workload at a time (a group's tests run one
    after another, so the previous group's models are freed before the next is built), the
    matmul peak per dtype, and every row for the record and the summary."""

    def __init__(self, config):
        self.config = config
        argv = ["--suite", "gpu", "--preset", *config.getoption("matrix_preset"),
                "--dtype", *config.getoption("matrix_dtype"),
                "--shapes", *config.getoption("matrix_shapes")]
        for flag, value in (("--device", config.getoption("matrix_device")),
                            ("--backends", config.getoption("matrix_backends"))):
            if value:
                argv += [flag, *([value] if isinstance(value, str) else value)]
        if config.getoption("matrix_quick"):
            argv += ["--quick", "--compile"]    # -k "not compile" leaves compile out
        self.runnable = bool(config.getoption("matrix_device")) or torch.cuda.is_available()
        try:
            self.options, self.shapes = bench_suite.parse_args(argv)
        except SystemExit as error:     # argparse printed what was wrong
            raise pytest.UsageError(f"bad --matrix-* option (the suite's {argv[2:]})") from error
        self.device = self.options.device
        self.record_path = config.getoption("matrix_record")
        if self.record_path:
            Path(self.record_path).parent.mkdir(parents=True, exist_ok=True)
        self.rows = []
        self.peaks = {}
        self._key = self._workload = None
        self._first_calls = {}

    def cases(self):
        """(preset, dtype name, Shape, method name) in the order the tests should run: eager
        and the peers before bert_fast's methods, so that their speedups can be computed."""
        return [(preset, dtype, shape, method) for preset in self.options.preset
                for dtype in self.options.dtype for shape in self.shapes
                for method in bench_suite.method_names(shape, self.options.backends)]

    def workload(self, preset, dtype_name, shape):
        key = (preset, dtype_name, shape.name)
        if key != self._key:
            self._key = self._workload = None
            self._first_calls = {}
            bench_suite.release_memory()
            self._workload = bench_suite.build_workload(shape, preset, DTYPES[dtype_name], self.device, self.options)
            self._key = key
        return self._workload

    def first_call(self, method):
        """(error, first call ms, skip reason) of a method of the current workload, called once."""
        if method.name not in self._first_calls:
            workload = self._workload
            with workload.grad_context():
                output, seconds, why = first_call(method, workload.inputs, self.device)
                error = workload.check(method, output) if why is None else None
            self._first_calls[method.name] = (error, 1e3 * seconds, why)
        return self._first_calls[method.name]

    def matmul_peak(self, dtype_name):
        if dtype_name not in self.peaks:
            self.peaks[dtype_name] = bench_suite.measure_matmul_peak(dtype_name, self.device,
                                                         bench_suite.matmul_size(self.options, dtype_name))
        return self.peaks[dtype_name]["tflops"]

    def add_rows(self, rows):
        """Adds rows, recomputes the speedups of their group; returns the group."""
        self.rows += rows
        key = group_key(rows[0])
        group = [row for row in self.rows if group_key(row) == key]
        bench_suite.add_speedups(group)
        if self.record_path:
            # Rewritten after every test, as the CLI does after every group: an interrupted
            # run keeps what it measured.
            write_json(self.record(), self.record_path)
        return group

    def record(self):
        return bench_suite.make_suite_record(self.rows, list(self.peaks.values()), self.options, self.shapes,
                                 self.device, ["pytest", *self.config.invocation_params.args])


def pytest_configure(config):
    if config.getoption("matrix_preset", None) is not None:
        config.stash[MATRIX_KEY] = Matrix(config)


@pytest.fixture(scope="session")
def matrix(pytestconfig):
    return pytestconfig.stash[MATRIX_KEY]


def pytest_terminal_summary(terminalreporter, config):
    matrix = config.stash.get(MATRIX_KEY, None)
    if matrix is None or not matrix.rows:
        return
    terminalreporter.section("bert_fast GPU matrix")
    for group in groups(matrix.rows):
        terminalreporter.write_line(group_markdown(group) + "\n")
    if matrix.record_path:
        terminalreporter.write_line(f"record: {matrix.record_path} "
                                    f"(python -m bert_fast.bench --table-from {matrix.record_path})")


def pytest_generate_tests(metafunc):
    """``matrix_case``: every (preset, dtype, shape, method) of the matrix, or one skipped case."""
    if "matrix_case" not in metafunc.fixturenames:
        return
    matrix = metafunc.config.stash[MATRIX_KEY]
    if not matrix.runnable:
        metafunc.parametrize("matrix_case", [pytest.param(None, id="needs-CUDA", marks=pytest.mark.skip(
            reason="the GPU matrix needs CUDA (--matrix-device cpu --matrix-preset demo --matrix-quick "
                   "runs a CPU smoke version)"))])
        return
    metafunc.parametrize("matrix_case", [
        pytest.param(case, id=f"{case[0]}-{case[1]}-{case[2].name}-{case[3]}") for case in matrix.cases()])
