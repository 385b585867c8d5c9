"""What the benchmarks share: ``python -m bert_fast.bench`` (bench.py, the main job),
its ``--suite gpu`` (bench_suite.py, the GPU matrix), and any other benchmark its command line
dispatches to. They import from here, and bench.py imports the benchmarks it dispatches to:
no benchmark imports another.

  sizes and dtypes     PRESETS (docs/REFERENCE.md's sizes), DTYPES, BASELINE ("eager")
  models and inputs    encoder_config, build_models (eager, compile and FastBERTEncoder on the
                       same weights), fast_encoder_sharing, make_inputs, max_error
  timing               first_call, time_interleaved (rounds with a rotating order), synchronize,
                       Progress (the status line on stderr, numbered steps)
  records              environment_info (what every record carries), default_record_path (where
                       a run writes its record unless told), write_json, load_json
  reading records      format_markdown / table_from_files (``--table-from``) for every record
                       kind, replace_generated_table (``--readme``: the README block
                       whose marker names the records), plot_from_json
                       (``--plot-from``), plot_speedup, plot_suite
"""

import copy
import datetime
import itertools
import json
import math
import os
import platform
import re
import shlex
import subprocess
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, NamedTuple, Optional

import torch

from . import extension, ops, peers
from .backend import backend_for
from .modules import FastBERTEncoder
from .reference import BERTEncoder

# Sizes from docs/REFERENCE.md ("Sizes people use").
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
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
METHOD_NAMES = ("eager", "compile", "fast", "fast_skip_padding")   # build_models' methods
# PyTorch's own fast paths, with the reference's weights (bert_fast.peers): build_models'
# methods with include_peers.
PEER_NAMES = ("torch_transformer", "hf_sdpa")
BASELINE = "eager"
# The "kind" of a record of ``--suite gpu``. Main-job records (``--json``) carry no kind.
SUITE_RECORD_KIND = "bert_fast.bench --suite gpu"
HOST_RECORD_KIND = "bert_fast.bench --suite host"


# --------------------------------------------------------------------------- models and inputs

def encoder_config(preset):
    """BERTEncoder keyword arguments of a preset (dropout is set but everything runs in eval)."""
    hidden = PRESETS[preset]["num_hiddens"]
    return dict(PRESETS[preset], norm_shape=[hidden], ffn_num_input=hidden, dropout=0.1,
                key_size=hidden, query_size=hidden, value_size=hidden)


def default_device():
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def device_option(parser, name):
    """--device's torch.device (default_device() for None), or parser.error where it names no
    device this machine has (before the run, not as a traceback inside it)."""
    if name is None:
        return default_device()
    try:
        device = torch.device(name)
    except (RuntimeError, ValueError):
        parser.error(f"--device {name!r} is not a device name (e.g. cpu, cuda, cuda:1)")
    if device.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            parser.error(f"--device {name}: this PyTorch sees no CUDA GPU (torch {torch.__version__}); "
                         f"use --device cpu")
        if device.index is not None and device.index >= count:
            parser.error(f"--device {name}: there are {count} CUDA devices")
    elif device.type != "cpu":
        parser.error(f"--device {name}: the benchmarks run on cpu or cuda")
    return device


def check_plot_path(parser, path):
    """matplotlib present and the PNG's folder there: checked before a long run, not after it."""
    try:
        figure_class()
    except ImportError as error:
        parser.error(str(error))
    folder = Path(path).parent
    if not folder.is_dir():
        parser.error(f"--plot {path}: the folder {folder} does not exist")


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
    # A failure on the first call (compilation, a peer's limits) skips the method instead of
    # ending the run.
    may_fail: bool = False
    # Compiled by torch.compile: its first call at each length compiles (not timed).
    compiled: bool = False
    # bert_fast's; the others (the reference, compiled or not, and the peers) are what it is
    # measured against ("vs best peer": the fastest of them).
    ours: bool = False


class BenchModels(NamedTuple):
    methods: dict              # name -> Method, in METHOD_NAMES order
    reference: torch.nn.Module  # fp32 eager encoder with the same weights
    config: dict               # encoder_config(preset)


def fast_encoder_sharing(eager, config, **options):
    """A FastBERTEncoder in eval mode on ``eager``'s tensors: built on the meta device and
    given them with ``load_state_dict(assign=True)``, so no second init and, but for the Q/K/V
    projections (packed into one buffer of its own, FastMultiHeadAttention.pack_qkv_), no copy."""
    with torch.device("meta"):
        fast = FastBERTEncoder(**config, **options)
    fast.load_state_dict(eager.state_dict(), strict=True, assign=True)
    return fast.eval()


def build_models(preset, dtype, device, *, seed=0, include_compile=True, backends=("auto",),
                 include_peers=False):
    """The benchmarked methods of one preset, all on the same weights, in eval mode.

    ``backends``: the FastBERTEncoder backends to time; methods of a backend other than "auto"
    are named with it, e.g. "fast[cuda]". ``include_peers``: also PyTorch's own fast paths
    (PEER_NAMES, see peer_method).

    The reference is initialised on the CPU with ``seed`` (the same weights on every device),
    then moved. The fast encoders share the eager encoder's tensors (fast_encoder_sharing).
    """
    config = encoder_config(preset)
    torch.manual_seed(seed)
    reference = BERTEncoder(**config).eval().to(device)
    eager = reference if dtype == torch.float32 else copy.deepcopy(reference).to(dtype)
    methods = {"eager": Method("eager", eager)}
    if include_compile:
        # Static shapes, as the suite compiles: with automatic dynamic shapes the second length
        # would compile a symbolic-length graph that every later length reuses (other work
        # than the first length's). run_benchmark resets Dynamo per length (no recompile limit).
        methods["compile"] = Method("compile", torch.compile(eager, dynamic=False), may_fail=True, compiled=True)
    for name in PEER_NAMES if include_peers else ():
        methods[name] = peer_method(name, eager)
    for backend in backends:
        for name, skip_padding in (("fast", False), ("fast_skip_padding", True)):
            name = name if backend == "auto" else f"{name}[{backend}]"
            fast = fast_encoder_sharing(eager, config, skip_padding=skip_padding, backend=backend)
            methods[name] = Method(name, fast, valid_positions_only=skip_padding, ours=True)
    return BenchModels(methods, reference, config)


def build_peer(name, encoder):
    """(module, None) for the peer ``name`` of PEER_NAMES on a copy of ``encoder``'s weights, or
    (None, why) where it cannot be built: "torch_transformer", nn.TransformerEncoder (its fused
    inference path, nested tensors for the padding); "hf_sdpa", HF BertModel with SDPA
    attention (None without transformers)."""
    build = {"torch_transformer": peers.transformer_encoder_peer,
             "hf_sdpa": lambda encoder: peers.hf_bert_peer(encoder, attn_implementation="sdpa")}[name]
    try:
        module = build(encoder)
    except Exception as error:
        return None, f"could not be built: {failure_reason(error)}"
    return (module.eval(), None) if module is not None else (None, peers.hf_unavailable_reason())


def peer_method(name, encoder):
    """build_peer's peer as a Method, compared on valid positions only (the peers define padded
    rows otherwise); one that cannot be built fails on its first call with the reason, which
    the run reports as a skipped row."""
    module, why = build_peer(name, encoder)
    if module is None:
        def unavailable(*inputs):
            raise RuntimeError(why)
        module = unavailable
    return Method(name, module, valid_positions_only=True, may_fail=True)


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


# --------------------------------------------------------------------------- timing

def first_call(method, inputs, device):
    """Call a method once (the call that compiles) → (output, seconds, skip_reason).

    A failure of a ``may_fail`` method gives ``(None, seconds, one-line reason)``, its whole
    traceback on stderr (the one line is all a table cell holds; a failure seen on a lent GPU
    must be diagnosable from the log); any other failure propagates.
    """
    start = time.perf_counter()
    try:
        output = method.forward(*inputs)
        synchronize(device)
    except Exception as error:
        if not method.may_fail:
            raise
        print(f"bench: {method.name} failed on its first call:", file=sys.stderr)
        traceback.print_exception(error, file=sys.stderr)
        return None, time.perf_counter() - start, failure_reason(error)
    return output, time.perf_counter() - start, None


def failure_reason(error):
    """One line naming an exception, short enough for a table cell."""
    first_line = (str(error).strip().splitlines() or [""])[0]
    return f"{type(error).__name__}: {first_line}"[:200]


def _rotated(items, shift):
    shift %= len(items)
    return items[shift:] + items[:shift]


def time_interleaved(methods, inputs, device, *, rounds, untimed_rounds=0, on_call=None,
                     on_round=None):
    """Seconds per call of each method over ``rounds`` rounds, each calling every method once.

    Rotating the order spreads drift of the machine (other jobs, clocks, caches) over all
    methods instead of charging it to whichever runs last. ``on_round(round, rounds)`` is told
    before each round and ``on_call(name, round, rounds)`` before each call; untimed rounds are
    numbered ``-untimed_rounds .. -1``.
    """
    seconds = {method.name: [] for method in methods}
    for round_index in range(-untimed_rounds, rounds):
        if on_round is not None:
            on_round(round_index, rounds)
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

    Two kinds of status: ``step`` numbers the steps of a run whose count is known in advance
    ("[k/N] ..."; ``total_steps`` is N) and shows every one of them, so the counter reads 1, 2,
    ... N in a log too; ``update`` is a free-form status. When stderr is not a terminal (a log
    file, CI) a rewritten line would pile up into one long line, so each step becomes an
    ordinary line, and updates too, at most one every ``log_interval_s``.
    """

    def __init__(self, stream=None, log_interval_s=10.0, total_steps=None):
        # Looked up per instance, not bound at import: a test's captured stderr is seen.
        self.stream = sys.stderr if stream is None else stream
        self.interactive = self.stream.isatty()
        self.log_interval_s = log_interval_s
        self.last_logged = -math.inf
        self.width = 0
        self.total_steps = total_steps
        self.steps_done = 0

    def step(self, message):
        """Start the next numbered step: '[k/N] message'."""
        self.steps_done += 1
        line = f"[{self.steps_done}/{self.total_steps}] {message}"
        if self.interactive:
            self._rewrite(line)
        else:
            self._write(line + "\n")

    def update(self, message):
        if self.interactive:
            self._rewrite(message)
        elif time.monotonic() - self.last_logged >= self.log_interval_s:
            self.last_logged = time.monotonic()
            self._write(message + "\n")

    def _rewrite(self, message):
        self._write("\r" + message.ljust(self.width))
        self.width = len(message)

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


# --------------------------------------------------------------------------- environment and records

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
    transformers = sys.modules.get("transformers")
    return dict(
        device=str(device),
        device_name=(torch.cuda.get_device_name(device) if device.type == "cuda" else _cpu_name()),
        cpu_count=os.cpu_count(), torch_num_threads=torch.get_num_threads(),
        torch=torch.__version__, triton=triton_version, cuda=torch.version.cuda,
        python=platform.python_version(), platform=platform.platform(),
        auto_backend=backend_for("auto", device),
        extension=extension.loaded_from() if extension.load() else None,
        bert_fast=bert_fast_version(),
        transformers=getattr(transformers, "__version__", None))


def bert_fast_version():
    """The package version and, in a git checkout, the commit ("0.1.0 at 1a2b3c4", "+changes"
    when the work tree differs from it): what code a record measured."""
    from . import __version__
    root = Path(__file__).resolve().parent.parent
    if not (root / ".git").exists():        # an installed copy (or another repository above it)
        return __version__
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True,
                                text=True, timeout=10, check=True).stdout.strip()
        changed = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                                 capture_output=True, text=True, timeout=10, check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return __version__
    return f"{__version__} at {commit}{' +changes' if changed else ''}"


def _code_versions(env):
    """", bert_fast ..., transformers ..." for a caption, where the record has them (records
    before 2026-11-27 do not)."""
    return "".join(f", {name} {env[name]}" for name in ("bert_fast", "transformers") if env.get(name))


# Records go under the working directory: run from a checkout's root (as the README does) they
# join the checkout's records; run from elsewhere they land where the user is, not inside an
# installed package, which may be read-only and is no place for data.
RESULTS_FOLDER = Path("benchmarks", "results")


def device_slug(device):
    """'nvidia-h100-80gb-hbm3', or 'cpu-2core' (the existing CPU records' naming)."""
    name = (torch.cuda.get_device_name(device) if device.type == "cuda"
            else f"cpu-{os.cpu_count()}core")
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


def default_record_path(device, suffix="", now=None, folder=RESULTS_FOLDER):
    """folder/<device>-<date>T<hhmm>[-suffix].json, e.g. cpu-2core-2026-11-23T0912.json;
    -2, -3 ... are appended rather than overwrite a record."""
    now = datetime.datetime.now() if now is None else now
    stem = f"{device_slug(device)}-{now:%Y-%m-%dT%H%M}" + (f"-{suffix}" if suffix else "")
    path, number = Path(folder, f"{stem}.json"), 2
    while path.exists():
        path, number = Path(folder, f"{stem}-{number}.json"), number + 1
    return path


def add_record_options(parser, suffix="", contents=""):
    """--json PATH | --no-record, for a benchmark whose records default_record_path names with
    ``suffix``; ``contents``: what the record holds or how it is written, for --json's help."""
    name = f"<device>-<date>T<time>{'-' + suffix if suffix else ''}.json"
    record = parser.add_mutually_exclusive_group()
    record.add_argument("--json", metavar="PATH",
                        help=f"write the record{' (' + contents + ')' if contents else ''} here (default: "
                             f"benchmarks/results/{name} under the current directory, named when the run "
                             f"starts; the folder is made if missing, and -2, -3 ... are appended rather "
                             f"than overwrite a record; a PATH given here is written as given, "
                             f"replacing a file there)")
    record.add_argument("--no-record", action="store_true",
                        help="write no record (default: write one, see --json)")


def record_path_for(json_option, device, suffix=""):
    """Where a run writes its record: ``--json``'s path, else default_record_path. Its folder is
    made now, so a place that cannot be written ends the command before the run, not after it."""
    path = Path(json_option) if json_option else default_record_path(device, suffix)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        writable = os.access(path.parent, os.W_OK)
    except OSError:
        writable = False
    if not writable:
        sys.exit(f"python -m bert_fast.bench: error: cannot write a record into {path.parent}; "
                 f"give --json PATH or --no-record")
    return path


def write_json(record, path):
    Path(path).write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")


def load_json(path):
    return json.loads(Path(path).read_text(encoding="utf-8"))


def load_record(path):
    """A benchmark record read from ``path``; ValueError naming the file where it cannot be
    read or is no JSON object (the CLIs print it without a traceback)."""
    try:
        record = load_json(path)
    except OSError as error:
        raise ValueError(f"cannot read {path}: {error.strerror or error}") from error
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ValueError(f"{path} is not a JSON record ({error})") from error
    if not isinstance(record, dict):
        raise ValueError(f"{path} is not a benchmark record (a JSON object)")
    return record


def is_suite_record(record):
    return record.get("kind") == SUITE_RECORD_KIND


def is_main_record(record):
    """A record of the main job (``python -m bert_fast.bench --json``)."""
    return not is_suite_record(record) and "encoder" in record.get("config", {})


def is_host_record(record):
    return record.get("kind") == HOST_RECORD_KIND


# --------------------------------------------------------------------------- markdown tables

def main_record_markdown(record):
    """A record of the main job (``--json``) as markdown: a caption naming the machine, the
    run and the command, then a table of its rows (the README's performance table)."""
    env, config = record["environment"], record["config"]
    model = config["encoder"]
    caption = (
        f"Measured on **{env['device_name']}** ({env['device']}, {env['torch_num_threads']} threads), "
        f"{record['date']}: torch {env['torch']}, triton {env['triton']}, CUDA {env['cuda']}{_code_versions(env)}. "
        f"Preset {config['preset']} (H {model['num_hiddens']}, {model['num_layers']} layers, "
        f"{model['num_heads']} heads, FFN {model['ffn_num_hiddens']}), batch {config['batch']}, "
        f"lengths uniform in [ceil({config['min_len_frac']} L), L], {config['dtype']}, {config['mode']}; "
        f"{config['repeats']} interleaved rounds.\nCommand: `{shlex.join(record['command'])}`")
    # Records since 2026-11-29 hold each row's model TFLOP/s and the run's matmul peak.
    peak = record.get("matmul_peak")
    rates = peak is not None
    if rates:
        caption += f"\nMatmul peak in the same run: {matmul_peak_words(peak)}."
    columns = ["method", "L", "median ms", "p90 ms", "valid tok/s", "vs eager", "vs best peer",
               *(["TFLOP/s", "% peak"] if rates else []), "max abs err vs fp32 eager"]
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for row in record["rows"]:
        if row["skipped"] is not None:
            lines.append(f"| {row['method']} | {row['seq']} | skipped: {row['skipped']} |" + " |" * (len(columns) - 3))
            continue
        # (records from before peers were timed have no best peer)
        speedups = (row["speedup_vs_eager"], row.get("speedup_vs_best_peer"))
        error = f"{row['max_abs_err']:.1e}" + (" (valid positions)" if row["error_positions"] == "valid" else "")
        name = f"**{row['method']}**" if row.get("ours") else row["method"]
        rate = (f" | {row['model_tflops']:.3g} | {_optional(row['pct_of_matmul_peak'], '{:.1f}')}" if rates else "")
        lines.append(f"| {name} | {row['seq']} | {row['median_ms']:.1f} | {row['p90_ms']:.1f} | "
                     f"{row['valid_tokens_per_s']:,.0f} | "
                     + " | ".join("–" if speedup is None else f"{speedup:.2f}×" for speedup in speedups)
                     + f"{rate} | {error} |")
    valid = {row["seq"]: row for row in record["rows"] if row["skipped"] is None}
    footnote = "Valid tokens: " + ", ".join(
        f"L {seq}: {row['valid_tokens']} of {row['padded_tokens']}" + (
            f", best peer {row['best_peer']}" if row.get("best_peer") else "") for seq, row in sorted(valid.items()))
    if any(row.get("ours") for row in record["rows"]):
        footnote += ". Bold: bert_fast's methods; the best peer is the fastest of the others."
    if rates:
        footnote += ("" if footnote.endswith(".") else ".") + f" TFLOP/s: {config['flops']}; % peak: of the matmul peak above."
    return "\n\n".join([caption, "\n".join(lines), footnote])


TABLE_HEADER = ("method", "median ms", "p90 ms", "valid tok/s", "padded tok/s", "vs eager",
                "vs best peer", "TFLOP/s", "% peak", "error", "peak MiB")


def _si(value):
    for scale, unit in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(value) >= scale:
            return f"{value / scale:.2f}{unit}"
    return f"{value:.0f}"


def _optional(value, fmt):
    return "–" if value is None else fmt.format(value)


def _markdown_cells(row):
    name = f"**{row['method']}**" if row["ours"] else row["method"]
    if row["skipped"] is not None:
        reason = row["skipped"].replace("|", "\\|")
        return [name, f"skipped: {reason}"] + [""] * (len(TABLE_HEADER) - 2)
    error = _optional(row["error"], "{:.1e}")
    if row["training"] and row["error"] is not None:
        error = "Δloss " + error
    return [name, f"{row['median_ms']:.3f}", f"{row['p90_ms']:.3f}", _si(row["valid_tokens_per_s"]),
            _si(row["padded_tokens_per_s"]), _optional(row["speedup_vs_eager"], "{:.2f}×"),
            _optional(row["speedup_vs_best_peer"], "{:.2f}×"), f"{row['model_tflops']:.3g}",
            f"{row['pct_of_matmul_peak']:.1f}", error, _optional(row["peak_memory_mib"], "{:,.0f}")]


def _markdown_table(rows):
    lines = ["| " + " | ".join(TABLE_HEADER) + " |", "|" + "---|" * len(TABLE_HEADER)]
    lines += ["| " + " | ".join(_markdown_cells(row)) + " |" for row in rows]
    return "\n".join(lines)


def _group_heading(rows):
    first = rows[0]
    what = ("training step (fwd + bwd + AdamW)" if first["training"] else "inference") + \
        f", B{first['batch']} L{first['seq']}"
    share = 100 * first["valid_tokens"] / first["padded_tokens"]
    best = next((row for row in rows if row.get("best_peer")), None)
    best_text = f"; best peer: {best['best_peer']}" if best else "; no peer ran"
    return (f"**{first['preset']} · {first['dtype']} · {first['shape']}**: {what}, "
            f"{first['valid_tokens']} of {first['padded_tokens']} tokens valid ({share:.0f}%){best_text}")


def matmul_peak_words(peak):
    """How a record's matmul peak reads in a caption: 'float32 0.25 TFLOP/s (1024³, fastest of 20 calls)'."""
    how = f", fastest of {peak['calls']} calls" if "fastest_ms" in peak else ", median of 10 calls"
    return f"{peak['dtype']} {peak['tflops']:.3g} TFLOP/s ({peak['n']}³{how})"


def _caption(record):
    env = record["environment"]
    peaks = ", ".join(matmul_peak_words(peak) for peak in record["matmul_peaks"])
    return (f"Measured on **{env['device_name']}** ({env['device']}), {record['date']}: torch {env['torch']}, "
            f"triton {env['triton']}, CUDA {env['cuda']}{_code_versions(env)}, auto backend {env['auto_backend']}, "
            f"extension {env['extension']}. Matmul peak in the same run: {peaks}.\n"
            f"Command: `{shlex.join(record['command'])}`")


def _footnotes(record):
    config = record["config"]
    return "\n".join([
        "Bold: bert_fast's methods. tok/s = tokens / median latency (valid: the sequences' lengths; "
        "padded: B × L). vs best peer: against the fastest method that is not bert_fast's.",
        f"TFLOP/s: {config['flop_formula']} % peak: of the matmul peak above.",
        f"Error: {config['error']}. Peak MiB: torch.cuda.max_memory_allocated over one call.",
        f"Timing: {config['timing']}. Training precision: {config['precision']}."])


def group_key(row):
    return row["preset"], row["dtype"], row["shape"]


def groups(rows):
    """The rows per (preset, dtype, shape), in the order the groups first appear."""
    by_key = {}
    for row in rows:
        by_key.setdefault(group_key(row), []).append(row)
    return list(by_key.values())


def group_markdown(group):
    return _group_heading(group) + "\n\n" + _markdown_table(group)


def suite_record_markdown(record):
    """A suite record as markdown: a caption naming the machine, a table per group, footnotes."""
    parts = [_caption(record)]
    if record.get("complete") is False:     # (records before 2026-11-27 do not say)
        config = record["config"]
        parts.append(f"**Incomplete run**: the record was written before the run ended and holds only the "
                     f"groups below, of presets {config['presets']} × dtypes {config['dtypes']} × shapes "
                     f"{[shape['name'] for shape in config['shapes']]}.")
    return "\n\n".join([*parts, *(group_markdown(group) for group in groups(record["rows"])), _footnotes(record)])


def _host_model(config):
    """The caption's words for a host record's model: nothing for the book's encoder (records
    before --model have no such key)."""
    if config.get("model", "book") == "book":
        return ""
    return (f"Hugging Face BertModel (the reference: its own forward, attention "
            f"{config.get('hf_attention')!r}; the fast rows: copies after bert_fast.optimize), ")


def _checkpointing(setting):
    return "" if setting == "off" else f", HF's gradient checkpointing ({setting}) on every model"


def host_record_markdown(record):
    """A record of ``--suite host`` as markdown: a caption naming the machine and the shape, and
    per mode a table of host microseconds per call against the reference."""
    env, config = record["environment"], record["config"]
    caption = (
        f"Measured on **{env['device_name']}** ({env['device']}, {env['torch_num_threads']} threads), "
        f"{record['date']}: torch {env['torch']}, triton {env['triton']}, CUDA {env['cuda']}{_code_versions(env)}, extension "
        f"{env['extension']}. {_host_model(config)}{config['num_layers']} layers, H {config['num_hiddens']}, "
        f"{config['num_heads']} heads, FFN {config['ffn_num_hiddens']}, B {config['batch']}, "
        f"L {config['seq']}, dropout {config['dropout']}, check_inputs {config['check_inputs']}"
        f"{', skip_padding' if config.get('skip_padding') else ''}"
        f"{_checkpointing(config.get('checkpointing', 'off'))}"
        f"{', under autocast ' + config['autocast'] if config.get('autocast') else ''}; "
        f"{config['rounds']} interleaved rounds of {config['calls_per_round']} calls.\n"
        f"Command: `{shlex.join(record['command'])}`")
    parts = [caption]
    for mode in dict.fromkeys(row["mode"] for row in record["rows"]):
        lines = [f"**{mode}**", "",
                 "| method | median µs | p10 µs | p90 µs | vs reference | vs fast[torch] | ATen ops / layer "
                 "| launches / layer |", "|---|---|---|---|---|---|---|---|"]
        for row in (r for r in record["rows"] if r["mode"] == mode):
            lines.append(f"| {row['method']} | {row['median_us']:.0f} | {row['p10_us']:.0f} | {row['p90_us']:.0f} "
                         f"| {row['vs_reference']:.2f}× | {_optional(row['vs_torch_backend'], '{:.2f}×')} "
                         f"| {row['aten_ops_per_layer']:.1f} | {_optional(row['launches_per_layer'], '{:.1f}')} |")
        parts.append("\n".join(lines))
    parts.append("vs reference, vs fast[torch]: this row's host time divided by theirs (below 1× is "
                 "faster; the other benchmarks' ratios are speedups, above 1× faster). "
                 f"Timing: {config['timing']}.")
    return "\n\n".join(parts)


def format_markdown(records):
    """Markdown of records of any kind, in order (``--table-from``)."""
    parts = []
    for record in records:
        if is_suite_record(record):
            parts.append(suite_record_markdown(record))
        elif is_main_record(record):
            parts.append(main_record_markdown(record))
        elif is_host_record(record):
            parts.append(host_record_markdown(record))
        else:
            raise ValueError("--table-from reads records of `python -m bert_fast.bench --json`, "
                             "`--suite gpu` or `--suite host`; this file is none of them")
    return "\n\n".join(parts)


def table_from_files(paths):
    parts = []
    for path in paths:
        record = load_record(path)
        try:
            parts.append(format_markdown([record]))
        except ValueError as error:     # not a record of ours: name the file
            raise ValueError(f"{path}: {error}") from error
    return "\n\n".join(parts)


# --------------------------------------------------------------------------- README

# A README holds any number of blocks of generated tables. Each block's begin marker is the
# command that fills it, so it names its records; ``--readme`` replaces only the block that
# names the records it was given.
README_END = "<!-- end generated table -->"
_README_BEGIN_PATTERN = re.compile(r"<!-- begin generated table: (.*?) -->")
_ANY_RECORDS = ("RECORD", "...")


def readme_begin_marker(record_paths, readme="README.md"):
    """The line that opens the block of the tables of ``record_paths`` (paths as seen from the
    README's folder)."""
    return (f"<!-- begin generated table: python -m bert_fast.bench --table-from "
            f"{' '.join(str(path) for path in record_paths)} --readme {readme} -->")


# The marker of a README's only block, filled by whatever records (the form before blocks
# named their records).
README_BEGIN = readme_begin_marker(_ANY_RECORDS)


class GeneratedBlock(NamedTuple):
    begin: int                 # where its begin marker starts
    tables: int                # where that marker ends (the tables start)
    end: int                   # where its end marker starts
    records: Optional[tuple]   # the record paths its marker names; None: README_BEGIN's "RECORD ..."


def generated_blocks(text):
    """The blocks of generated tables in ``text``, in order."""
    blocks = []
    for match in _README_BEGIN_PATTERN.finditer(text):
        end = text.find(README_END, match.end())
        following = _README_BEGIN_PATTERN.search(text, match.end())
        if end < 0 or (following is not None and following.start() < end):
            raise ValueError(f"the block opened by {match.group(0)} has no {README_END} before "
                             f"the next block or the end of the file")
        blocks.append(GeneratedBlock(match.start(), match.end(), end, _marker_records(match.group(1))))
    return blocks


def _marker_records(command):
    words = shlex.split(command)
    if "--table-from" not in words:
        return ()
    after = words[words.index("--table-from") + 1:]
    records = tuple(itertools.takewhile(lambda word: not word.startswith("--"), after))
    return None if records == _ANY_RECORDS else records


def replace_generated_table(text, markdown, record_paths=None, base_dir="."):
    """``text`` with the tables of the block(s) whose begin marker names ``record_paths`` (in
    that order) replaced by ``markdown``; failing that, of its only block if that one's marker
    is README_BEGIN. A marker's paths are relative to ``base_dir`` (the README's folder),
    ``record_paths`` to the working directory."""
    blocks = generated_blocks(text)
    chosen = []
    if record_paths is not None:
        wanted = [Path(path).resolve() for path in record_paths]
        chosen = [block for block in blocks if block.records is not None
                  and [Path(base_dir, path).resolve() for path in block.records] == wanted]
    if not chosen and len(blocks) == 1 and blocks[0].records is None:
        chosen = blocks
    if not chosen:
        # The marker's paths as seen from the README's folder, where a marker is read.
        begin = README_BEGIN if record_paths is None else readme_begin_marker(
            [os.path.relpath(Path(path).resolve(), Path(base_dir).resolve()) for path in record_paths])
        named = "; ".join(" ".join(block.records) for block in blocks if block.records)
        raise ValueError(f"no place for the tables: the file needs the lines {begin} and "
                         f"{README_END}, in that order"
                         + (f" (its blocks are for: {named})" if named else ""))
    for block in reversed(chosen):     # from the last: the earlier offsets stay valid
        text = f"{text[:block.tables]}\n\n{markdown}\n\n{text[block.end:]}"
    return text


# --------------------------------------------------------------------------- plots

def figure_class():
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
    Figure = figure_class()  # a Figure, not pyplot: no GUI backend, no global state
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
    records = [load_record(path) for path in paths]
    kinds = {"suite" if is_suite_record(record) else "main" if is_main_record(record) else None
             for record in records}
    for path, record in zip(paths, records):
        if not (is_suite_record(record) or is_main_record(record)):
            raise ValueError(f"{path}: --plot-from draws records of `python -m bert_fast.bench --json` "
                             f"or `--suite gpu` (host and kernel records have no plot)")
    if len(kinds) > 1:
        raise ValueError("--plot-from draws records of one kind at a time (main job or --suite gpu), "
                         "not both in one PNG")
    labels = [Path(path).stem for path in paths]
    if kinds == {"suite"}:
        plot_suite(records, out_path, labels=labels)
    else:
        plot_speedup(records, out_path, labels=labels)


def plot_suite(records, path, labels=None):
    """PNG: per record, preset and dtype, speedup vs eager of every method on every shape."""
    for record in records:
        if not is_suite_record(record):
            raise ValueError("plot_suite draws --suite records only; plot other records separately")
    panels = [(index, preset, dtype) for index, record in enumerate(records)
              for preset, dtype in dict.fromkeys((row["preset"], row["dtype"]) for row in record["rows"])]
    Figure = figure_class()
    fig = Figure(figsize=(10, 3.8 * len(panels)), layout="constrained")
    axes = fig.subplots(len(panels), 1, squeeze=False)[:, 0]
    for ax, (index, preset, dtype) in zip(axes, panels):
        rows = [row for row in records[index]["rows"] if row["preset"] == preset
                and row["dtype"] == dtype and row["skipped"] is None and row["speedup_vs_eager"]]
        _bars(ax, rows)
        label = f" ({labels[index]})" if labels and len(records) > 1 else ""
        ax.set_title(f"{preset} · {dtype} · {records[index]['environment']['device_name']}{label}",
                     fontsize=10)
    fig.savefig(path, dpi=120)


def _bars(ax, rows):
    """Grouped bars: a group per shape holding only that shape's methods (training has its own
    methods), one colour per method across the groups."""
    shapes = list(dict.fromkeys(row["shape"] for row in rows))
    methods = list(dict.fromkeys(row["method"] for row in rows))
    colors = {m: f"C{i}" if len(methods) <= 10 else _tab20(i) for i, m in enumerate(methods)}
    per_shape = {shape: [row for row in rows if row["shape"] == shape] for shape in shapes}
    width = 0.85 / max(len(group) for group in per_shape.values())
    labelled = set()
    for x, shape in enumerate(shapes):
        group = per_shape[shape]
        for offset, row in enumerate(group):
            method = row["method"]
            ax.bar(x + (offset - (len(group) - 1) / 2) * width, row["speedup_vs_eager"], width,
                   color=colors[method], label=None if method in labelled else method)
            labelled.add(method)
    ax.axhline(1.0, color="gray", linestyle="--", linewidth=1)
    ax.set_xticks(range(len(shapes)), shapes)
    ax.set_ylabel("speedup vs eager (median)")
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend(fontsize=7, ncols=3)


def _tab20(index):
    from matplotlib import colormaps
    return colormaps["tab20"](index % 20)


