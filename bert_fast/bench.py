"""Side-by-side benchmark of the BERT encoder: ``python -m bert_fast.bench``.

Runs, on the same weights and the same inputs:

  eager              bert_fast.reference.BERTEncoder, eval mode (the baseline)
  compile            torch.compile(reference encoder), default mode
  torch_transformer  nn.TransformerEncoder's fused inference path, nested tensors (bert_fast.peers)
  hf_sdpa            HF BertModel, attn_implementation="sdpa" (where transformers is installed)
  fast               FastBERTEncoder (exact mode)
  fast_skip_padding  FastBERTEncoder(skip_padding=True)

Each row gives its speedup against eager and against the best peer: the fastest of the methods
that are not bert_fast's (eager, compile and PyTorch's own fast paths) at that length; and its
model TFLOP/s with their share of the hardware's peak, as the rate of one large square matmul
timed in the same run, its fastest of 20 calls (bench_suite.measure_matmul_peak).

Shared machines are noisy, so the methods are timed interleaved: every round calls each
method once (the order rotates from round to round), and the median and p90 come from the
same rounds for all methods. Every method's output is checked against an fp32 eager forward.
Each run prints a table and writes a record (JSON: environment, command, configuration and
every latency) to ``--json PATH``, by default benchmarks/results/<device>-<date>T<time>.json
under the working directory (bench_common.default_record_path), and prints where.

The command line also dispatches to the benchmark matrix, ``--suite gpu``
(bert_fast/bench_suite.py), and to the host-time benchmark, ``--suite host``
(bert_fast/host_bench.py), and reads records of any of them back: ``--table-from`` prints them as
markdown (``--readme`` writes them into a README), ``--plot-from`` draws them. What the
benchmarks share (models, inputs, timing, records, their tables and plots) is in
bert_fast/bench_common.py, also used by ``benchmarks/``.
"""

import argparse
import datetime
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch

from . import bench_suite, host_bench
from .backend import BACKENDS, resolve_backend
from .bench_common import (BASELINE, DTYPES, PRESETS, Progress, build_models, check_plot_path, device_option,
                           environment_info, first_call, make_inputs, max_error,
                           add_record_options, plot_from_json, plot_speedup, record_path_for, replace_generated_table,
                           matmul_peak_words, table_from_files, time_interleaved, write_json)

# Default lengths and rounds per preset. A forward of the small presets takes milliseconds, so
# more rounds are cheap and the first ones still carry start-up effects; base (about 1 s a
# forward on an idle 2-core CPU, 6 s a round of the 6 methods, plus 10-30 s to compile) keeps
# the default run near 1.5 minutes (77 s measured on an idle AMD EPYC 2-core VM, 2026-11-25).
RUN_DEFAULTS = {
    "demo": dict(seqs=[32, 128], repeats=30, warmup=3),
    "small": dict(seqs=[64, 128], repeats=30, warmup=3),
    "base": dict(seqs=[128], repeats=10, warmup=1),
    "large": dict(seqs=[128], repeats=5, warmup=1),
}


def count_steps(num_methods, num_seqs, warmup, repeats):
    """The progress steps of run_benchmark. A step is, per sequence length, one method's first
    call (it compiles and is checked) or one round (every method once): the untimed rounds
    after the first calls (warmup - 1), then the timed ones. A method skipped on its first call
    leaves the rounds, so the count is known before the run."""
    return num_seqs * (num_methods + warmup - 1 + repeats)


def run_benchmark(models, *, batch, seqs, min_len_frac, seed, repeats, warmup, device,
                  progress=None, matmul_peak_tflops=None):
    """Benchmark every method at every sequence length → list of row dicts (see _row).

    ``warmup`` counts the untimed calls per method before timing; the first one (which
    compiles) is also the one whose output is checked against the fp32 reference.
    ``progress`` (a Progress) is told each of the count_steps steps. ``matmul_peak_tflops``:
    the rate the rows' model TFLOP/s are set against (``% peak``; None: not given).
    """
    if warmup < 1 or repeats < 1:
        raise ValueError(f"warmup and repeats must be >= 1, got {warmup} and {repeats}")
    methods = list(models.methods.values())
    if progress:
        progress.total_steps = count_steps(len(methods), len(seqs), warmup, repeats)
    rows = []
    for seq in seqs:
        if any(method.compiled for method in methods):
            torch._dynamo.reset()      # each length compiled afresh, static (build_models)
        inputs = make_inputs(batch, seq, min_len_frac, models.config["vocab_size"], seed, device)
        reference_output = None
        first_calls = {}
        with torch.inference_mode():
            for method in methods:
                if progress:
                    progress.step(f"seq {seq} {method.name}: first call "
                                  f"({'compiling, ' if method.compiled else ''}checking)")
                output, seconds, skip_reason = first_call(method, inputs, device)
                if skip_reason is not None:
                    if progress:
                        progress.note(f"{method.name} skipped at seq {seq}: {skip_reason}")
                    first_calls[method.name] = (None, seconds, skip_reason)
                    continue
                if method.compiled and progress:
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

            def on_round(round_index, rounds):
                if progress:
                    what = (f"untimed round {round_index + warmup}/{warmup - 1}" if round_index < 0
                            else f"round {round_index + 1}/{rounds}")
                    progress.step(f"seq {seq}: {what} (each method once)")

            seconds = time_interleaved(timed, inputs, device, rounds=repeats,
                                       untimed_rounds=warmup - 1, on_round=on_round)
        medians = {name: float(np.median(times)) for name, times in seconds.items()}
        peers = [method.name for method in timed if not method.ours]
        best_peer = min(peers, key=medians.get) if peers else None
        for method in methods:
            error, first_seconds, skip_reason = first_calls[method.name]
            rows.append(_row(method, seq, inputs, error, first_seconds, skip_reason,
                             seconds.get(method.name), medians.get(BASELINE), best_peer,
                             medians.get(best_peer), bench_suite.encoder_flops(models.config, batch, seq),
                             matmul_peak_tflops))
    if progress:
        progress.close()
    return rows


def _row(method, seq, inputs, error, first_seconds, skip_reason, seconds, baseline_median, best_peer,
         best_peer_median, flops, matmul_peak_tflops):
    batch = inputs.tokens.shape[0]
    valid_tokens = int(inputs.valid_lens.sum())
    row = dict(method=method.name, seq=seq, batch=batch, valid_tokens=valid_tokens,
               padded_tokens=batch * seq, first_call_ms=1e3 * first_seconds, skipped=skip_reason)
    if skip_reason is not None:
        return row
    median, p90 = np.percentile(seconds, [50, 90])
    tflops = flops / median / 1e12
    row.update(
        latencies_ms=[1e3 * s for s in seconds], median_ms=1e3 * median, p90_ms=1e3 * p90,
        valid_tokens_per_s=valid_tokens / median, padded_tokens_per_s=batch * seq / median,
        speedup_vs_eager=(baseline_median / median) if baseline_median else None,
        ours=method.ours, best_peer=best_peer,
        speedup_vs_best_peer=(best_peer_median / median) if best_peer_median else None,
        model_tflops=tflops, pct_of_matmul_peak=100 * tflops / matmul_peak_tflops if matmul_peak_tflops else None,
        max_abs_err=error,
        error_positions="valid" if method.valid_positions_only else "all")
    return row


# The FLOPs a row's TFLOP/s counts (bench_suite.FLOP_FORMULA's inference part).
FLOPS_NOTE = ("model FLOPs of the padded batch (per layer 2*N*H*3H + 4*B*L^2*H + 2*N*H*H + 4*N*H*F, "
              "N = B*L tokens) / median latency, for every method: those that skip the padded tokens "
              "(skip_padding, torch_transformer's nested tensors) are credited with them too, so they "
              "can pass 100% of the peak")


def format_table(rows, matmul_peak=None):
    """Plain-text table of the rows, with footnotes on what the columns count; ``matmul_peak``:
    the record's (measure_matmul_peak's dict), which % peak is of."""
    header = ("method", "seq", "median ms", "p90 ms", "valid tok/s", "vs eager", "vs best peer", "TFLOP/s", "% peak",
              "max abs err")
    lines = []
    for row in rows:
        if row["skipped"] is not None:
            lines.append((row["method"], str(row["seq"]), f"skipped: {row['skipped']}"))
            continue
        error = f"{row['max_abs_err']:.2e}" + ("*" if row["error_positions"] == "valid" else "")
        speedups = (row["speedup_vs_eager"], row.get("speedup_vs_best_peer"))
        peak = row["pct_of_matmul_peak"]
        lines.append((row["method"], str(row["seq"]), f"{row['median_ms']:.1f}",
                      f"{row['p90_ms']:.1f}", f"{row['valid_tokens_per_s']:,.0f}",
                      *(f"{speedup:.2f}x" if speedup is not None else "-" for speedup in speedups),
                      f"{row['model_tflops']:.3g}", "-" if peak is None else f"{peak:.1f}", error))
    full = [line for line in lines if len(line) == len(header)] + [header]
    widths = [max(len(line[i]) for line in full) for i in range(len(header))]

    def render(line):
        if len(line) < len(header):  # a skipped row: the reason runs across the number columns
            return f"{line[0]:<{widths[0]}}  {line[1]:>{widths[1]}}  {line[2]}"
        return "  ".join([f"{line[0]:<{widths[0]}}"]
                         + [f"{cell:>{width}}" for cell, width in zip(line[1:], widths[1:])])

    out = [render(header), "-" * len(render(header))] + [render(line) for line in lines]
    timed = [row for row in rows if row["skipped"] is None]
    peak_words = ("the matmul peak, not measured" if matmul_peak is None else
                  f"a matmul timed in the same run: {matmul_peak_words(matmul_peak)}")
    if timed:
        rounds = len(timed[0]["latencies_ms"])
        out.append(f"median and p90 over {rounds} interleaved rounds; valid tok/s = valid tokens "
                   f"/ median latency")
        for seq in sorted({row["seq"] for row in timed}):
            row = next(r for r in timed if r["seq"] == seq)
            out.append(f"seq {seq}: {row['valid_tokens']} valid of {row['padded_tokens']} tokens "
                       f"({100 * row['valid_tokens'] / row['padded_tokens']:.0f}%); best peer "
                       f"{row.get('best_peer')}")
        out.append(f"TFLOP/s: {FLOPS_NOTE}; % peak: of {peak_words}")
        out.append("max abs err: against an fp32 eager forward on the same weights; "
                   "* = valid positions only (skip_padding's padded outputs are zeros by design; "
                   "the peers' padded outputs are not the book's)")
    return "\n".join(out)


def make_record(rows, *, preset, config, batch, seqs, min_len_frac, dtype, seed, repeats, warmup,
                device, argv=None, matmul_peak=None):
    """A self-describing result: environment, command line, date, configuration, the matmul
    peak of the run and rows."""
    return dict(
        environment=environment_info(device),
        command=list(sys.orig_argv if argv is None else argv),
        date=datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        config=dict(preset=preset, encoder=config, batch=batch, seqs=list(seqs),
                    min_len_frac=min_len_frac, dtype=dtype, seed=seed, repeats=repeats,
                    warmup=warmup, mode="eval, torch.inference_mode()", flops=FLOPS_NOTE),
        matmul_peak=matmul_peak,
        rows=rows)




def suite_requested(argv):
    """The suite the command line asks for ("gpu": the benchmark matrix, "host": the host-time
    benchmark; each has its own options), or None."""
    probe = argparse.ArgumentParser(add_help=False)
    probe.add_argument("--suite")
    suite = probe.parse_known_args(argv)[0].suite
    return suite if suite in ("gpu", "host") else None      # (another value: the main parser's error)


def _per_preset(key, fmt=str):
    """The default of a run setting per preset, in words: 'demo 30, small 30, base 10, large 5'."""
    return ", ".join(f"{preset} {fmt(defaults[key])}" for preset, defaults in RUN_DEFAULTS.items())


def _preset_sizes():
    return ", ".join(f"{name} ({size['num_layers']} layers, H {size['num_hiddens']})"
                     for name, size in PRESETS.items())


def build_parser():
    parser = argparse.ArgumentParser(
        prog="python -m bert_fast.bench",
        description="Time the reference BERT encoder (eager, and compiled with torch.compile) "
                    "and PyTorch's own fast paths (nn.TransformerEncoder, HF BertModel with SDPA) "
                    "against FastBERTEncoder (exact and skip_padding, per backend) on the same "
                    "weights and inputs, in eval mode, on the GPU if there is one, else on the "
                    "CPU; print a table and write a record of the run (JSON).",
        epilog="The default run (base, batch 8, L 128) takes about 1.5 minutes on an idle 2-core "
               "CPU, more on a busy one: mostly its 10 timed rounds (6 forwards each), then "
               "compiling the reference. Progress goes to stderr as numbered steps: per length, "
               "each method's first call, then each round.")
    parser.add_argument("--preset", choices=PRESETS, default="base",
                        help=f"model size: {_preset_sizes()} (default: base)")
    parser.add_argument("--batch", type=int, default=8, help="batch size (default: 8)")
    parser.add_argument("--seq", type=int, nargs="+", metavar="L",
                        help="sequence lengths, each timed on its own (default per preset: "
                             f"{_per_preset('seqs', lambda seqs: ' '.join(map(str, seqs)))})")
    parser.add_argument("--min-len-frac", type=float, default=0.5, metavar="FRAC",
                        help="valid lengths are drawn uniformly from [ceil(frac*L), L] (default: 0.5)")
    parser.add_argument("--dtype", choices=DTYPES, default="float32",
                        help="dtype of the weights and activations; errors are measured against "
                             "an fp32 eager forward either way (default: float32)")
    parser.add_argument("--seed", type=int, default=0, help="seed of weights and inputs (default: 0)")
    parser.add_argument("--repeats", type=int, metavar="N",
                        help="timed rounds per sequence length, each calling every method once "
                             f"(default per preset: {_per_preset('repeats')})")
    parser.add_argument("--warmup", type=int, metavar="N",
                        help="untimed calls per method and sequence length before timing; the "
                             "first one compiles and is checked against the fp32 reference "
                             f"(default per preset: {_per_preset('warmup')})")
    parser.add_argument("--no-compile", action="store_true",
                        help="leave out torch.compile of the reference (default: timed; compiling "
                             "base takes 10-30 s on a 2-core CPU)")
    parser.add_argument("--no-peers", action="store_true",
                        help="leave out PyTorch's own fast paths (nn.TransformerEncoder, HF BertModel "
                             "with SDPA; default: timed, HF where transformers is installed)")
    parser.add_argument("--backends", nargs="+", default=["auto"], choices=BACKENDS,
                        help="FastBERTEncoder backends to time, each as its own methods "
                             "fast[BACKEND] and fast_skip_padding[BACKEND] (default: auto, the "
                             "device's best, named fast and fast_skip_padding)")
    parser.add_argument("--device", help="e.g. cpu, cuda, cuda:1 (default: cuda if available, else cpu)")
    add_record_options(parser, contents="environment, command, configuration, every latency")
    parser.add_argument("--plot", metavar="PATH",
                        help="also draw speedup vs eager against sequence length into this PNG "
                             "(needs matplotlib)")
    parser.add_argument("--plot-from", metavar="JSON", nargs="+",
                        help="only plot these records (of this benchmark or of --suite gpu) into "
                             "--plot PATH (no benchmark)")
    parser.add_argument("--suite", choices=["gpu", "host"],
                        help="run another benchmark instead, with its own options: gpu, the "
                             "benchmark matrix (presets x dtypes x shapes x every peer; see "
                             "--suite gpu --help); host, the host time of a forward at negligible "
                             "arithmetic (see --suite host --help)")
    parser.add_argument("--table-from", metavar="JSON", nargs="+",
                        help="only print these records (of this benchmark or of --suite) as "
                             "markdown tables (no benchmark)")
    parser.add_argument("--readme", metavar="PATH",
                        help="with --table-from: write the tables into this file, into the block "
                             "of generated tables whose begin marker names these records (or its "
                             "only block, if that marker names RECORD ...), instead of printing them")
    return parser


def _refuse_run_options(parser, args, mode, allowed):
    """``mode`` runs no benchmark: an option of a run given with it is a mistake, not ignored."""
    given = [action.option_strings[0] for action in parser._actions if action.option_strings
             and action.dest not in (*allowed, "help") and getattr(args, action.dest) != action.default]
    if given:
        parser.error(f"{mode} runs no benchmark; it does not take {', '.join(given)}")


def parse_args(argv=None):
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.readme and not args.table_from:
        parser.error("--readme needs --table-from RECORD ...")
    if args.table_from:
        if args.plot or args.plot_from:
            parser.error("--table-from prints tables only; draw records with --plot-from RECORD ... --plot PATH")
        _refuse_run_options(parser, args, "--table-from", allowed=("table_from", "readme"))
        return args
    if args.plot_from and not args.plot:
        parser.error("--plot-from needs --plot PATH for the PNG")
    if args.plot:
        check_plot_path(parser, args.plot)
    if args.plot_from:
        _refuse_run_options(parser, args, "--plot-from", allowed=("plot_from", "plot"))
        return args
    args.device = device_option(parser, args.device)
    for backend in args.backends:
        try:
            resolve_backend(backend)
        except ValueError as error:
            parser.error(str(error))
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
    suite = suite_requested(sys.argv[1:] if argv is None else argv)
    if suite is not None:
        run_suite = host_bench.main if suite == "host" else bench_suite.main
        run_suite(sys.argv[1:] if argv is None else list(argv),
                  record_argv=None if argv is None else ["bert_fast.bench.main", *argv])
        return
    args = parse_args(argv)
    if args.table_from:
        try:
            markdown = table_from_files(args.table_from)
            if args.readme:
                readme = Path(args.readme)
                text = replace_generated_table(readme.read_text(encoding="utf-8"), markdown,
                                               args.table_from, base_dir=readme.parent)
                readme.write_text(text, encoding="utf-8")
                print(f"wrote the tables of {', '.join(args.table_from)} into {args.readme}")
            else:
                print(markdown)
        except ValueError as error:     # not a record, or no markers: say so, no traceback
            sys.exit(f"python -m bert_fast.bench: error: {error}")
        except KeyError as error:
            sys.exit(f"python -m bert_fast.bench: error: a record of {', '.join(args.table_from)} lacks the "
                     f"field {error} (written by another version or edited?)")
        except BrokenPipeError:         # the reader (e.g. | head) stopped reading: nothing to say
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            sys.exit(1)
        except OSError as error:        # the README not there, not writable
            sys.exit(f"python -m bert_fast.bench: error: cannot update {args.readme}: {error.strerror or error}")
        return
    if args.plot_from:
        try:
            plot_from_json(args.plot_from, args.plot)
        except ValueError as error:
            sys.exit(f"python -m bert_fast.bench: error: {error}")
        except KeyError as error:
            sys.exit(f"python -m bert_fast.bench: error: a record of {', '.join(args.plot_from)} lacks the "
                     f"field {error} (written by another version or edited?)")
        print(f"wrote {args.plot}")
        return
    device = args.device
    record_path = None if args.no_record else record_path_for(args.json, device)
    dtype = DTYPES[args.dtype]
    models = build_models(args.preset, dtype, device, seed=args.seed,
                          include_compile=not args.no_compile, backends=args.backends,
                          include_peers=not args.no_peers)
    config = models.config
    print(f"preset {args.preset} (H {config['num_hiddens']}, {config['num_layers']} layers, "
          f"{config['num_heads']} heads, FFN {config['ffn_num_hiddens']}), batch {args.batch}, "
          f"{args.dtype}, eval; {environment_info(device)['device_name']} "
          f"({device}, {torch.get_num_threads()} threads)", flush=True)
    # The rate the rows' TFLOP/s are set against: one square matmul in the run's dtype, timed
    # before the methods' rounds (on a 2-core CPU ~0.2 s at 1024³ fp32).
    matmul_peak = bench_suite.measure_matmul_peak(args.dtype, device, bench_suite.default_matmul_size(device, args.dtype))
    progress = Progress()
    rows = run_benchmark(models, batch=args.batch, seqs=args.seq, min_len_frac=args.min_len_frac,
                         seed=args.seed, repeats=args.repeats, warmup=args.warmup, device=device,
                         progress=progress, matmul_peak_tflops=matmul_peak["tflops"])
    print(format_table(rows, matmul_peak))
    record = make_record(rows, preset=args.preset, config=config, batch=args.batch, seqs=args.seq,
                         min_len_frac=args.min_len_frac, dtype=args.dtype, seed=args.seed,
                         repeats=args.repeats, warmup=args.warmup, device=device,
                         argv=None if argv is None else ["bert_fast.bench.main", *argv], matmul_peak=matmul_peak)
    if record_path is not None:
        write_json(record, record_path)
        print(f"wrote {record_path}")
    if args.plot:
        plot_speedup([record], args.plot)
        print(f"wrote {args.plot}")
    print(f"total wall time {time.perf_counter() - start:.1f} s")


if __name__ == "__main__":
    main()
