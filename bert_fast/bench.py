"""Side-by-side benchmark of the BERT encoder: ``python -m bert_fast.bench``.

Runs, on the same weights and the same inputs:

  eager              bert_fast.reference.BERTEncoder, eval mode (the baseline)
  compile            torch.compile(reference encoder), default mode
  fast               FastBERTEncoder (exact mode)
  fast_skip_padding  FastBERTEncoder(skip_padding=True)

Shared machines are noisy, so the methods are timed interleaved: every round calls each
method once (the order rotates from round to round), and the median and p90 come from the
same rounds for all methods. Every method's output is checked against an fp32 eager forward.

The pieces (build_models, make_inputs, max_error, run_benchmark, format_table, write_json,
plot_speedup) are reused by ``benchmarks/test_bench_encoder.py`` and by the benchmark matrix,
``python -m bert_fast.bench --suite gpu`` (bert_fast/bench_suite.py), whose records
``--table-from`` prints as markdown and ``--plot-from`` draws.
"""

import argparse
import copy
import datetime
import json
import math
import os
import platform
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, NamedTuple

import numpy as np
import torch

from . import extension, ops
from .backend import BACKENDS, backend_for
from .modules import FastBERTEncoder
from .reference import BERTEncoder

# Sizes from ../shared/REFERENCE.md ("Sizes people use").
PRESETS = {
    "demo": dict(vocab_size=10000, num_hiddens=768, ffn_num_hiddens=1024, num_heads=4,
                 num_layers=2, max_len=1000),
    # The book's pretraining run on WikiText-2 (whose vocabulary has 20256 tokens).
    "small": dict(vocab_size=20256, num_hiddens=128, ffn_num_hiddens=256, num_heads=2,
                  num_layers=2, max_len=1000),
    "base": dict(vocab_size=30522, num_hiddens=768, ffn_num_hiddens=3072, num_heads=12,
                 num_layers=12, max_len=512),
    "large": dict(vocab_size=30522, num_hiddens=1024, ffn_num_hiddens=4096, num_heads=16,
                  num_layers=24, max_len=512),
}
# Default lengths and rounds per preset. A forward of the small presets takes milliseconds, so
# more rounds are cheap and the first ones still carry start-up effects; base (about 1.5 s a
# forward on a 2-core CPU, plus about 50 s to compile) keeps the default run near 2 minutes.
RUN_DEFAULTS = {
    "demo": dict(seqs=[32, 128], repeats=30, warmup=3),
    "small": dict(seqs=[64, 128], repeats=30, warmup=3),
    "base": dict(seqs=[128], repeats=10, warmup=1),
    "large": dict(seqs=[128], repeats=5, warmup=1),
}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
METHOD_NAMES = ("eager", "compile", "fast", "fast_skip_padding")
BASELINE = "eager"


def encoder_config(preset):
    """BERTEncoder keyword arguments of a preset (dropout is set but everything runs in eval)."""
    hidden = PRESETS[preset]["num_hiddens"]
    return dict(PRESETS[preset], norm_shape=[hidden], ffn_num_input=hidden, dropout=0.1,
                key_size=hidden, query_size=hidden, value_size=hidden)


def default_device():
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def synchronize(device):
    """Wait for queued kernels, so a host timer measures the work and not the launch."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@dataclass
class Method:
    name: str
    forward: Callable          # (tokens, segments, valid_lens) -> (B, L, H)
    # Its padded positions are zeros by design, so only valid positions are compared.
    valid_positions_only: bool = False
    # A failure on the first call (compilation) skips the method instead of ending the run.
    may_fail: bool = False


class BenchModels(NamedTuple):
    methods: dict              # name -> Method, in METHOD_NAMES order
    reference: torch.nn.Module  # fp32 eager encoder with the same weights
    config: dict               # encoder_config(preset)


def fast_encoder_sharing(eager, config, **options):
    """A FastBERTEncoder in eval mode on ``eager``'s tensors: built on the meta device and
    given them with ``load_state_dict(assign=True)``, so no second init and no second copy."""
    with torch.device("meta"):
        fast = FastBERTEncoder(**config, **options)
    fast.load_state_dict(eager.state_dict(), strict=True, assign=True)
    return fast.eval()


def build_models(preset, dtype, device, *, seed=0, include_compile=True, backends=("auto",)):
    """The benchmarked methods of one preset, all on the same weights, in eval mode.

    ``backends``: the FastBERTEncoder backends to time; methods of a backend other than "auto"
    are named with it, e.g. "fast[cuda]".

    The reference is initialised on the CPU with ``seed`` (the same weights on every device),
    then moved. The fast encoders share the eager encoder's tensors (fast_encoder_sharing).
    """
    config = encoder_config(preset)
    torch.manual_seed(seed)
    reference = BERTEncoder(**config).eval().to(device)
    eager = reference if dtype == torch.float32 else copy.deepcopy(reference).to(dtype)
    methods = {"eager": Method("eager", eager)}
    if include_compile:
        methods["compile"] = Method("compile", torch.compile(eager), may_fail=True)
    for backend in backends:
        for name, skip_padding in (("fast", False), ("fast_skip_padding", True)):
            name = name if backend == "auto" else f"{name}[{backend}]"
            fast = fast_encoder_sharing(eager, config, skip_padding=skip_padding, backend=backend)
            methods[name] = Method(name, fast, valid_positions_only=skip_padding)
    return BenchModels(methods, reference, config)


class EncoderInputs(NamedTuple):
    tokens: torch.Tensor
    segments: torch.Tensor
    valid_lens: torch.Tensor


def make_inputs(batch, seq, min_len_frac, vocab_size, seed, device):
    """Random ids and lengths drawn uniformly from the integers in [ceil(min_len_frac*seq), seq].

    Drawn on the CPU from ``seed`` so every device sees the same inputs.
    """
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab_size, (batch, seq), generator=generator)
    segments = torch.randint(0, 2, (batch, seq), generator=generator)
    valid_lens = torch.randint(math.ceil(min_len_frac * seq), seq + 1, (batch,), generator=generator)
    return EncoderInputs(tokens.to(device), segments.to(device), valid_lens.to(device))


def max_error(output, reference_output, valid_lens=None):
    """Max |output - reference_output| in fp32; only at valid positions if valid_lens is given."""
    if valid_lens is not None:
        unpadding = ops.unpadding_for(valid_lens, output.shape[1])
        output, reference_output = ops.unpad(output, unpadding), ops.unpad(reference_output, unpadding)
    diff = (output.float() - reference_output.float()).abs()
    return diff.max().item() if diff.numel() else 0.0


def first_call(method, inputs, device):
    """Call a method once (the call that compiles) → (output, seconds, skip_reason).

    A failure of a ``may_fail`` method gives ``(None, seconds, one-line reason)``; any other
    failure propagates.
    """
    start = time.perf_counter()
    try:
        output = method.forward(*inputs)
        synchronize(device)
    except Exception as error:
        if not method.may_fail:
            raise
        first_line = (str(error).strip().splitlines() or [""])[0]
        return None, time.perf_counter() - start, f"{type(error).__name__}: {first_line}"[:200]
    return output, time.perf_counter() - start, None


def _rotated(items, shift):
    shift %= len(items)
    return items[shift:] + items[:shift]


def time_interleaved(methods, inputs, device, *, rounds, untimed_rounds=0, on_call=None):
    """Seconds per call of each method over ``rounds`` rounds, each calling every method once.

    Rotating the order spreads drift of the machine (other jobs, clocks, caches) over all
    methods instead of charging it to whichever runs last. ``on_call(name, round, rounds)`` is
    told before each call; untimed rounds are numbered ``-untimed_rounds .. -1``.
    """
    seconds = {method.name: [] for method in methods}
    for round_index in range(-untimed_rounds, rounds):
        for method in _rotated(list(methods), round_index):
            if on_call is not None:
                on_call(method.name, round_index, rounds)
            synchronize(device)
            start = time.perf_counter()
            method.forward(*inputs)
            synchronize(device)
            if round_index >= 0:
                seconds[method.name].append(time.perf_counter() - start)
    return seconds


class Progress:
    """A status line on stderr, rewritten in place with '\\r', and notes that stay.

    When stderr is not a terminal (a log file, CI) a rewritten line would pile up into one
    long line, so updates become ordinary lines, at most one every ``log_interval_s``.
    """

    def __init__(self, stream=sys.stderr, log_interval_s=10.0):
        self.stream = stream
        self.interactive = stream.isatty()
        self.log_interval_s = log_interval_s
        self.last_logged = -math.inf
        self.width = 0

    def update(self, message):
        if self.interactive:
            self._write("\r" + message.ljust(self.width))
            self.width = len(message)
        elif time.monotonic() - self.last_logged >= self.log_interval_s:
            self.last_logged = time.monotonic()
            self._write(message + "\n")

    def note(self, message):
        self._write(("\r" + message.ljust(self.width) if self.interactive else message) + "\n")
        self.width = 0

    def close(self):
        if self.width:
            self._write("\n")
            self.width = 0

    def _write(self, text):
        self.stream.write(text)
        self.stream.flush()


def run_benchmark(models, *, batch, seqs, min_len_frac, seed, repeats, warmup, device,
                  progress=None):
    """Benchmark every method at every sequence length → list of row dicts (see _row).

    ``warmup`` counts the untimed calls per method before timing; the first one (which
    compiles) is also the one whose output is checked against the fp32 reference.
    """
    if warmup < 1 or repeats < 1:
        raise ValueError(f"warmup and repeats must be >= 1, got {warmup} and {repeats}")
    methods = list(models.methods.values())
    calls_total = len(seqs) * len(methods) * (warmup + repeats)
    calls_done = 0
    rows = []
    for seq in seqs:
        inputs = make_inputs(batch, seq, min_len_frac, models.config["vocab_size"], seed, device)
        reference_output = None
        first_calls = {}
        with torch.inference_mode():
            for method in methods:
                if progress:
                    progress.update(f"[{calls_done + 1}/{calls_total}] seq {seq} {method.name}: "
                                    f"first call ({'compiling, ' if method.may_fail else ''}checking)")
                output, seconds, skip_reason = first_call(method, inputs, device)
                calls_done += 1
                if skip_reason is not None:
                    calls_done += warmup + repeats - 1
                    if progress:
                        progress.note(f"{method.name} skipped at seq {seq}: {skip_reason}")
                    first_calls[method.name] = (None, seconds, skip_reason)
                    continue
                if method.may_fail and progress:
                    progress.note(f"{method.name}: first call at seq {seq} took {seconds:.1f} s "
                                  f"(compilation; not timed)")
                if reference_output is None:
                    # In fp32 the eager model is the reference: reuse its output.
                    reference_output = (output if method.forward is models.reference
                                        else models.reference(*inputs).float())
                error = max_error(output, reference_output,
                                  inputs.valid_lens if method.valid_positions_only else None)
                first_calls[method.name] = (error, seconds, None)
                del output

            timed = [m for m in methods if first_calls[m.name][2] is None]

            def on_call(name, round_index, rounds):
                nonlocal calls_done
                calls_done += 1
                if progress:
                    what = ("warmup" if round_index < 0
                            else f"round {round_index + 1}/{rounds}")
                    progress.update(f"[{calls_done}/{calls_total}] seq {seq} {name}: {what}")

            seconds = time_interleaved(timed, inputs, device, rounds=repeats,
                                       untimed_rounds=warmup - 1, on_call=on_call)
        baseline_median = (float(np.median(seconds[BASELINE])) if BASELINE in seconds else None)
        for method in methods:
            error, first_seconds, skip_reason = first_calls[method.name]
            rows.append(_row(method, seq, inputs, error, first_seconds, skip_reason,
                             seconds.get(method.name), baseline_median))
    if progress:
        progress.close()
    return rows


def _row(method, seq, inputs, error, first_seconds, skip_reason, seconds, baseline_median):
    batch = inputs.tokens.shape[0]
    valid_tokens = int(inputs.valid_lens.sum())
    row = dict(method=method.name, seq=seq, batch=batch, valid_tokens=valid_tokens,
               padded_tokens=batch * seq, first_call_ms=1e3 * first_seconds, skipped=skip_reason)
    if skip_reason is not None:
        return row
    median, p90 = np.percentile(seconds, [50, 90])
    row.update(
        latencies_ms=[1e3 * s for s in seconds], median_ms=1e3 * median, p90_ms=1e3 * p90,
        valid_tokens_per_s=valid_tokens / median, padded_tokens_per_s=batch * seq / median,
        speedup_vs_eager=(baseline_median / median) if baseline_median else None,
        max_abs_err=error,
        error_positions="valid" if method.valid_positions_only else "all")
    return row


def format_table(rows):
    """Plain-text table of the rows, with footnotes on what the columns count."""
    header = ("method", "seq", "median ms", "p90 ms", "valid tok/s", "vs eager", "max abs err")
    lines = []
    for row in rows:
        if row["skipped"] is not None:
            lines.append((row["method"], str(row["seq"]), f"skipped: {row['skipped']}"))
            continue
        error = f"{row['max_abs_err']:.2e}" + ("*" if row["error_positions"] == "valid" else "")
        speedup = row["speedup_vs_eager"]
        lines.append((row["method"], str(row["seq"]), f"{row['median_ms']:.1f}",
                      f"{row['p90_ms']:.1f}", f"{row['valid_tokens_per_s']:,.0f}",
                      f"{speedup:.2f}x" if speedup is not None else "-", error))
    full = [line for line in lines if len(line) == len(header)] + [header]
    widths = [max(len(line[i]) for line in full) for i in range(len(header))]

    def render(line):
        if len(line) < len(header):  # a skipped row: the reason runs across the number columns
            return f"{line[0]:<{widths[0]}}  {line[1]:>{widths[1]}}  {line[2]}"
        return "  ".join([f"{line[0]:<{widths[0]}}"]
                         + [f"{cell:>{width}}" for cell, width in zip(line[1:], widths[1:])])

    out = [render(header), "-" * len(render(header))] + [render(line) for line in lines]
    timed = [row for row in rows if row["skipped"] is None]
    if timed:
        rounds = len(timed[0]["latencies_ms"])
        out.append(f"median and p90 over {rounds} interleaved rounds; valid tok/s = sum(valid_lens) "
                   f"/ median latency (padded tok/s in the JSON)")
        for seq in sorted({row["seq"] for row in timed}):
            row = next(r for r in timed if r["seq"] == seq)
            out.append(f"seq {seq}: {row['valid_tokens']} valid of {row['padded_tokens']} tokens "
                       f"({100 * row['valid_tokens'] / row['padded_tokens']:.0f}%)")
        out.append("max abs err: against an fp32 eager forward on the same weights; "
                   "* = valid positions only (padded outputs are zeros by design)")
    return "\n".join(out)


def format_markdown(record):
    """A record of the main job (``--json``) as markdown: a caption naming the machine, the
    run and the command, then a table of its rows (the README's performance table)."""
    env, config = record["environment"], record["config"]
    model = config["encoder"]
    caption = (
        f"Measured on **{env['device_name']}** ({env['device']}, {env['torch_num_threads']} threads), "
        f"{record['date']}: torch {env['torch']}, triton {env['triton']}, CUDA {env['cuda']}. "
        f"Preset {config['preset']} (H {model['num_hiddens']}, {model['num_layers']} layers, "
        f"{model['num_heads']} heads, FFN {model['ffn_num_hiddens']}), batch {config['batch']}, "
        f"lengths uniform in [ceil({config['min_len_frac']} L), L], {config['dtype']}, {config['mode']}; "
        f"{config['repeats']} interleaved rounds.\nCommand: `{' '.join(record['command'])}`")
    lines = ["| method | L | median ms | p90 ms | valid tok/s | vs eager | max abs err vs fp32 eager |",
             "|---|---|---|---|---|---|---|"]
    for row in record["rows"]:
        if row["skipped"] is not None:
            lines.append(f"| {row['method']} | {row['seq']} | skipped: {row['skipped']} | | | | |")
            continue
        speedup = row["speedup_vs_eager"]
        error = f"{row['max_abs_err']:.1e}" + (" (valid positions)" if row["error_positions"] == "valid" else "")
        lines.append(f"| {row['method']} | {row['seq']} | {row['median_ms']:.1f} | {row['p90_ms']:.1f} | "
                     f"{row['valid_tokens_per_s']:,.0f} | "
                     f"{'–' if speedup is None else f'{speedup:.2f}×'} | {error} |")
    valid = {row["seq"]: row for row in record["rows"]}
    footnote = "Valid tokens: " + ", ".join(
        f"L {seq}: {row['valid_tokens']} of {row['padded_tokens']}" for seq, row in sorted(valid.items()))
    return "\n\n".join([caption, "\n".join(lines), footnote])


README_BEGIN = "<!-- begin generated table: python -m bert_fast.bench --table-from RECORD ... --readme README.md -->"
README_END = "<!-- end generated table -->"


def replace_generated_table(text, markdown):
    """``text`` with what lies between README_BEGIN and README_END replaced by ``markdown``."""
    begin, end = text.find(README_BEGIN), text.find(README_END)
    if begin < 0 or end < begin:
        raise ValueError(f"no place for the table: the file needs the lines {README_BEGIN} and "
                         f"{README_END}, in that order")
    return f"{text[:begin + len(README_BEGIN)]}\n\n{markdown}\n\n{text[end:]}"


def _cpu_name():
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "cpu"


def environment_info(device):
    """What a recorded result must carry about the machine and the software."""
    try:
        import triton
        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    return dict(
        device=str(device),
        device_name=(torch.cuda.get_device_name(device) if device.type == "cuda" else _cpu_name()),
        cpu_count=os.cpu_count(), torch_num_threads=torch.get_num_threads(),
        torch=torch.__version__, triton=triton_version, cuda=torch.version.cuda,
        python=platform.python_version(), platform=platform.platform(),
        auto_backend=backend_for("auto", device),
        extension=extension.loaded_from() if extension.load() else None)


def make_record(rows, *, preset, config, batch, seqs, min_len_frac, dtype, seed, repeats, warmup,
                device, argv=None):
    """A self-describing result: environment, command line, date, configuration and rows."""
    return dict(
        environment=environment_info(device),
        command=list(sys.orig_argv if argv is None else argv),
        date=datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        config=dict(preset=preset, encoder=config, batch=batch, seqs=list(seqs),
                    min_len_frac=min_len_frac, dtype=dtype, seed=seed, repeats=repeats,
                    warmup=warmup, mode="eval, torch.inference_mode()"),
        rows=rows)


def write_json(record, path):
    Path(path).write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")


def load_json(path):
    return json.loads(Path(path).read_text(encoding="utf-8"))


def _figure_class():
    try:
        from matplotlib.figure import Figure
    except ImportError as error:
        raise ImportError("plotting needs matplotlib: pip install matplotlib "
                          "(or pip install 'bert_fast[plot]')") from error
    return Figure


def plot_speedup(records, path, labels=None):
    """PNG of speedup vs eager against sequence length, one line per method (and per record).

    ``labels`` name the records in the legend when several are drawn together.
    """
    Figure = _figure_class()  # a Figure, not pyplot: no GUI backend, no global state
    fig = Figure(figsize=(7, 4.5), layout="constrained")
    ax = fig.subplots()
    ax.axhline(1.0, color="gray", linestyle="--", linewidth=1, label=BASELINE)
    seqs = set()
    for index, record in enumerate(records):
        suffix = f" ({labels[index]})" if labels and len(records) > 1 else ""
        rows = [row for row in record["rows"] if row["skipped"] is None and row["method"] != BASELINE]
        for method in dict.fromkeys(row["method"] for row in rows):
            points = sorted((row["seq"], row["speedup_vs_eager"]) for row in rows
                            if row["method"] == method)
            seqs.update(seq for seq, _ in points)
            ax.plot(*zip(*points), marker="o", label=method + suffix)
    ax.set_xscale("log", base=2)
    ax.set_xticks(sorted(seqs), [str(seq) for seq in sorted(seqs)])
    ax.minorticks_off()
    ax.set_ylim(bottom=0)
    ax.set_xlabel("sequence length")
    ax.set_ylabel("speedup vs eager (median latency)")
    described = {_describe(record) for record in records}
    ax.set_title(described.pop() if len(described) == 1 else "BERT encoder", fontsize=10)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.savefig(path, dpi=120)


def _describe(record):
    config = record["config"]
    return (f"BERT encoder, preset {config['preset']}, batch {config['batch']}, {config['dtype']}\n"
            f"{record['environment']['device_name']}")


def plot_from_json(paths, out_path):
    """Plot one or more saved ``--json`` results (or ``--suite`` records) into one PNG."""
    from . import bench_suite

    records = [load_json(path) for path in paths]
    labels = [Path(path).stem for path in paths]
    if any(bench_suite.is_suite_record(record) for record in records):
        bench_suite.plot_suite(records, out_path, labels=labels)
    else:
        plot_speedup(records, out_path, labels=labels)


def suite_requested(argv):
    """Whether the command line asks for the benchmark matrix, which has its own options."""
    probe = argparse.ArgumentParser(add_help=False)
    probe.add_argument("--suite")
    return probe.parse_known_args(argv)[0].suite is not None


def parse_args(argv=None):
    parser = argparse.ArgumentParser(
        prog="python -m bert_fast.bench",
        description="Time the reference BERT encoder (eager, torch.compile) against FastBERTEncoder "
                    "(exact and skip_padding) on the same weights and inputs, in eval mode.")
    parser.add_argument("--preset", choices=PRESETS, default="base",
                        help="model size (default: base, 12 layers H 768)")
    parser.add_argument("--batch", type=int, default=8, help="batch size (default: 8)")
    parser.add_argument("--seq", type=int, nargs="+",
                        help="sequence lengths (default: the preset's, see RUN_DEFAULTS; base: 128)")
    parser.add_argument("--min-len-frac", type=float, default=0.5,
                        help="valid_lens are drawn uniformly from [ceil(frac*seq), seq] (default: 0.5)")
    parser.add_argument("--dtype", choices=DTYPES, default="float32")
    parser.add_argument("--seed", type=int, default=0, help="seed of weights and inputs (default: 0)")
    parser.add_argument("--repeats", type=int,
                        help="timed rounds, each calls every method once (default: the preset's; "
                             "base: 10)")
    parser.add_argument("--warmup", type=int,
                        help="untimed calls per method before timing; the first one compiles and is "
                             "checked (default: the preset's; base: 1)")
    parser.add_argument("--no-compile", action="store_true", help="leave out torch.compile")
    parser.add_argument("--backends", nargs="+", default=["auto"], choices=BACKENDS,
                        help="FastBERTEncoder backends to time (default: auto); e.g. --backends auto cuda")
    parser.add_argument("--device", help="e.g. cpu, cuda, cuda:1 (default: cuda if available, else cpu)")
    parser.add_argument("--json", metavar="PATH", help="write the results (and environment) here")
    parser.add_argument("--plot", metavar="PATH", help="PNG of speedup vs eager against seq")
    parser.add_argument("--plot-from", metavar="JSON", nargs="+",
                        help="only plot these saved --json results (or --suite records) into --plot "
                             "PATH (no benchmark)")
    parser.add_argument("--suite", choices=["gpu"],
                        help="run the benchmark matrix instead (presets x dtypes x shapes x every peer; "
                             "bert_fast/bench_suite.py); its options: --suite gpu --help")
    parser.add_argument("--table-from", metavar="JSON", nargs="+",
                        help="only print these records (--json or --suite) as markdown tables (no "
                             "benchmark)")
    parser.add_argument("--readme", metavar="PATH",
                        help="with --table-from: write the tables into this file between its "
                             "generated-table markers instead of printing them")
    args = parser.parse_args(argv)
    if args.readme and not args.table_from:
        parser.error("--readme needs --table-from RECORD ...")
    if args.table_from:
        return args
    if args.plot_from and not args.plot:
        parser.error("--plot-from needs --plot PATH for the PNG")
    if args.plot:
        try:
            _figure_class()
        except ImportError as error:
            parser.error(str(error))  # before a long run, not after it
    if args.plot_from:
        return args
    defaults = RUN_DEFAULTS[args.preset]
    args.seq = args.seq or defaults["seqs"]
    args.repeats = args.repeats if args.repeats is not None else defaults["repeats"]
    args.warmup = args.warmup if args.warmup is not None else defaults["warmup"]
    max_len = PRESETS[args.preset]["max_len"]
    if any(not 1 <= seq <= max_len for seq in args.seq):
        parser.error(f"--seq must be in [1, {max_len}] (max_len of preset {args.preset})")
    if not 0.0 <= args.min_len_frac <= 1.0:
        parser.error("--min-len-frac must be in [0, 1]")
    if args.batch < 1 or args.repeats < 1 or args.warmup < 1:
        parser.error("--batch, --repeats and --warmup must be >= 1")
    return args


def main(argv=None):
    start = time.perf_counter()
    if suite_requested(sys.argv[1:] if argv is None else argv):
        from . import bench_suite

        bench_suite.main(sys.argv[1:] if argv is None else list(argv),
                         record_argv=None if argv is None else ["bert_fast.bench.main", *argv])
        return
    args = parse_args(argv)
    if args.table_from:
        from . import bench_suite

        try:
            markdown = bench_suite.table_from_files(args.table_from)
            if args.readme:
                readme = Path(args.readme)
                readme.write_text(replace_generated_table(readme.read_text(encoding="utf-8"), markdown),
                                  encoding="utf-8")
                print(f"wrote the tables of {', '.join(args.table_from)} into {args.readme}")
            else:
                print(markdown)
        except ValueError as error:     # not a record, or no markers: say so, no traceback
            sys.exit(f"python -m bert_fast.bench: error: {error}")
        return
    if args.plot_from:
        plot_from_json(args.plot_from, args.plot)
        print(f"wrote {args.plot}")
        return
    device = torch.device(args.device) if args.device else default_device()
    dtype = DTYPES[args.dtype]
    models = build_models(args.preset, dtype, device, seed=args.seed,
                          include_compile=not args.no_compile, backends=args.backends)
    config = models.config
    print(f"preset {args.preset} (H {config['num_hiddens']}, {config['num_layers']} layers, "
          f"{config['num_heads']} heads, FFN {config['ffn_num_hiddens']}), batch {args.batch}, "
          f"{args.dtype}, eval; {environment_info(device)['device_name']} "
          f"({device}, {torch.get_num_threads()} threads)", flush=True)
    progress = Progress()
    rows = run_benchmark(models, batch=args.batch, seqs=args.seq, min_len_frac=args.min_len_frac,
                         seed=args.seed, repeats=args.repeats, warmup=args.warmup, device=device,
                         progress=progress)
    print(format_table(rows))
    record = make_record(rows, preset=args.preset, config=config, batch=args.batch, seqs=args.seq,
                         min_len_frac=args.min_len_frac, dtype=args.dtype, seed=args.seed,
                         repeats=args.repeats, warmup=args.warmup, device=device,
                         argv=None if argv is None else ["bert_fast.bench.main", *argv])
    if args.json:
        write_json(record, args.json)
        print(f"wrote {args.json}")
    if args.plot:
        plot_speedup([record], args.plot)
        print(f"wrote {args.plot}")
    print(f"total wall time {time.perf_counter() - start:.1f} s")


if __name__ == "__main__":
    main()
