"""Per-kernel GPU numbers: ``python -m bert_fast.kernel_bench [--json PATH]`` (CUDA only;
``--ops``, ``--tokens N ...`` choose what runs, ``--kernels`` lists each row's kernels).

Times each op's forward and forward+backward, for our Triton backend next to the PyTorch path
on the same inputs, and reports what fraction of the machine they reach:
  attention      TFLOP/s (dense-equivalent 4 B h L^2 d forward, 2.5x that backward, the
                 FlashAttention convention), next to SDPA with a boolean key mask and SDPA
                 without a mask (its flash kernel) on the same shapes;
  memory-bound   GB/s from the bytes the op must move, next to the device-to-device copy
                 bandwidth measured the same way in the same run; add_layernorm and
                 embedding_sum also on the compiled extension's CUDA kernels (backend "cuda")
                 when it is built.
Shapes follow the work item: attention at head dim 64, L 128 and 512, B 16, lengths averaging
60% of L; add_layernorm, bias_act and embedding_sum at BERT-base and -large sizes.

How times are taken (also written to the JSON's "timing" field). One call of these ops costs
more host time (Python, autograd, the launcher) than GPU time, so timing single calls, as
``triton.testing.do_bench`` does, measures the launch path. Each row therefore has two numbers:
  GPU ms per call  WARMUP_CALLS eager calls on a side stream (Triton compiles and autotunes,
                   cuBLAS initialises: none of that may be captured), then CALLS_PER_GRAPH
                   back-to-back calls captured in one CUDA graph on that stream; the graph is
                   replayed once untimed, then REPLAYS times between CUDA events; each replay
                   gives its time / CALLS_PER_GRAPH; the row has the median and the 20th and
                   80th percentiles. A fwd+bwd call sets the leaves' grads to None itself, so
                   the reset is captured too. No L2 flush between calls: an op whose working
                   set fits in L2 can read faster than the copy bandwidth.
  host us per call HOST_CALLS back-to-back eager calls timed with time.perf_counter from an
                   idle GPU to the last enqueue (before the synchronize), median of HOST_ROUNDS
                   rounds; HOST_CALLS is small enough that the launch queue never fills, so
                   this is the time the caller's thread spends per call.
TFLOP/s, GB/s and % of copy come from the GPU time. A method whose capture (or replay) raises
is timed with ``triton.testing.do_bench`` instead; its row says so in "note" and its figures
then include the launch. A method that fails even eagerly gets a row with "error" and no
figures; the run goes on.
"""

import argparse
import collections
import datetime
import json
import statistics
import sys
import time

import torch
from torch.nn import functional as F

from . import extension, ops
from .cuda_graph import end_failed_capture, gc_disabled
from .ops._triton import interpreting

WARMUP_CALLS = 3
CALLS_PER_GRAPH = 50
REPLAYS = 20
HOST_CALLS = 10
HOST_ROUNDS = 7
# --kernels: each row also lists its kernels (kernel_breakdown).
BREAKDOWN = False


def timing_description():
    """How the run took its times, with the counts in effect (the JSON's "timing" field)."""
    return dict(
        gpu=(f"GPU ms per call: {WARMUP_CALLS} eager warmup calls on a side stream, then "
             f"{CALLS_PER_GRAPH} back-to-back calls captured in one CUDA graph on that stream, "
             f"replayed once untimed and {REPLAYS} times between CUDA events; each replay's time / "
             f"{CALLS_PER_GRAPH}; median (ms) and 20th/80th percentiles (ms_p20, ms_p80). fwd+bwd calls "
             f"set the leaves' grads to None inside the graph. No L2 flush between calls."),
        host=(f"host us per call: {HOST_CALLS} back-to-back eager calls timed with time.perf_counter "
              f"from an idle GPU to the last enqueue (before synchronize), median of {HOST_ROUNDS} rounds."),
        derived="TFLOP/s, GB/s and frac_of_copy from the GPU ms; the copy bandwidth is timed the same way.",
        fallback=("timed_by 'do_bench': the capture or replay raised (see the row's note); ms is then "
                  "triton.testing.do_bench around single calls and includes the launch."),
        warmup_calls=WARMUP_CALLS, calls_per_graph=CALLS_PER_GRAPH, replays=REPLAYS,
        host_calls=HOST_CALLS, host_rounds=HOST_ROUNDS, l2_flush=False)


# ---- row arithmetic -------------------------------------------------------------------------

def gbps(nbytes, ms):
    """GB/s (1e9 bytes per second) for moving nbytes in ms milliseconds."""
    return nbytes / (ms * 1e-3) / 1e9


def tflops(flops, ms):
    """TFLOP/s (1e12 per second) for flops operations in ms milliseconds."""
    return flops / (ms * 1e-3) / 1e12


def _percentiles(times_ms):
    """(median, 20th, 80th percentile) of per-call times."""
    if len(times_ms) == 1:
        return times_ms[0], times_ms[0], times_ms[0]
    deciles = statistics.quantiles(times_ms, n=10, method="inclusive")
    return statistics.median(times_ms), deciles[1], deciles[7]


def with_figures(row, *, flops=None, nbytes=None, copy_gbps=None):
    """The row with tflops (from flops) or gbps and frac_of_copy (from nbytes) added, computed
    from its GPU ms; None where the method produced no time."""
    ms = row.get("ms")
    if flops is not None:
        row["tflops"] = None if ms is None else tflops(flops, ms)
    if nbytes is not None:
        row["bytes"] = nbytes
        row["gbps"] = None if ms is None else gbps(nbytes, ms)
        row["frac_of_copy"] = None if ms is None or not copy_gbps else row["gbps"] / copy_gbps
    return row


# ---- timing ---------------------------------------------------------------------------------

def _sync():
    torch.cuda.synchronize()


def _graph_ms(fn, calls, replays):
    """Per-call GPU ms of ``fn`` from CUDA-graph replays: a list with one value per replay.

    Raises whatever the warmup, the capture or a replay raises (e.g. fn synchronises with the
    host, which a capture cannot record)."""
    _sync()                                        # inputs made on other streams are ready
    stream = torch.cuda.Stream()
    pool = torch.cuda.graph_pool_handle()
    # Our own stream context around torch.cuda.graph's: when capture_end raises, graph's
    # __exit__ never restores the caller's stream, this context still does.
    with torch.cuda.stream(stream):
        for _ in range(WARMUP_CALLS):
            fn()
        _sync()
        graph = torch.cuda.CUDAGraph()
        try:
            with gc_disabled(), torch.cuda.graph(graph, pool=pool, stream=stream):
                for _ in range(calls):
                    fn()
        except Exception:
            end_failed_capture(torch.device("cuda", torch.cuda.current_device()), pool)
            raise
        graph.replay()                             # the first launch uploads the graph
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                  for _ in range(replays)]
        for start, end in events:
            start.record()
            graph.replay()
            end.record()
        _sync()
    return [start.elapsed_time(end) / calls for start, end in events]


def _do_bench_ms(fn):
    """(median, 20th, 80th percentile) ms of single calls, from triton.testing.do_bench."""
    from triton.testing import do_bench
    return tuple(do_bench(fn, quantiles=[0.5, 0.2, 0.8]))


def _host_us_per_call(fn, calls=None, rounds=None):
    """Microseconds the calling thread spends enqueuing one call (median over rounds)."""
    calls, rounds = calls or HOST_CALLS, rounds or HOST_ROUNDS
    per_call = []
    for _ in range(rounds):
        _sync()
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        per_call.append((time.perf_counter() - start) / calls * 1e6)
    _sync()
    return statistics.median(per_call)


def _one_line(error, limit=300):
    """'Type: first line of the message'."""
    text = (f"{type(error).__name__}: {error}".strip().splitlines() or [type(error).__name__])[0]
    return text if len(text) <= limit else text[:limit] + "..."


def _capture_failure(error):
    """The capture error as one line, its first cause first: on an invalidated capture the
    operation that broke it raises, then capture_end raises again while that is handled."""
    chain = [error]
    while chain[-1].__context__ is not None and chain[-1].__context__ not in chain and len(chain) < 8:
        chain.append(chain[-1].__context__)
    if len(chain) == 1:
        return _one_line(error)
    return f"{_one_line(chain[-1])}; then {_one_line(error)}"


def measure(fn):
    """Timing fields for one method: GPU ms per call (ms, ms_p20, ms_p80), host_us per call,
    timed_by ("cuda graph" or "do_bench"), and note or error when something failed.

    Never raises for a failing method: one that cannot be captured falls back to do_bench
    (with a note); one that cannot run at all gets an error and no times."""
    result = dict(ms=None, ms_p20=None, ms_p80=None, host_us=None, timed_by=None)
    try:
        fn()
        _sync()
    except Exception as error:                     # the method itself fails: nothing to time
        result["error"] = f"failed eagerly: {_one_line(error)}"
        return result
    try:
        times = _percentiles(_graph_ms(fn, CALLS_PER_GRAPH, REPLAYS))
        result["timed_by"] = "cuda graph"
    except Exception as capture_error:
        result["note"] = (f"not capturable in a CUDA graph ({_capture_failure(capture_error)}); GPU ms from "
                          f"triton.testing.do_bench around single calls, launch included")
        try:
            times = _do_bench_ms(fn)
            result["timed_by"] = "do_bench"
        except Exception as error:
            result["error"] = f"do_bench failed too: {_one_line(error)}"
            return result
    result["ms"], result["ms_p20"], result["ms_p80"] = times
    try:
        result["host_us"] = _host_us_per_call(fn)
    except Exception as error:
        result["error"] = f"host timing failed: {_one_line(error)}"
    if BREAKDOWN:
        try:
            result["kernels"] = kernel_breakdown(fn)
        except Exception as error:
            result["note"] = f"{result.get('note', '')}; no kernel breakdown: {_one_line(error)}".lstrip("; ")
    return result


def kernel_breakdown(fn, calls=10):
    """{kernel name: (launches, device us)} per call of ``fn``, most time first: the torch
    profiler's CUDA events of ``calls`` eager calls. Says which kernel a GPU time comes from."""
    from torch.profiler import ProfilerActivity, profile
    _sync()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        _sync()
    totals = collections.defaultdict(lambda: [0, 0.0])
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            totals[event.name][0] += 1
            totals[event.name][1] += event.device_time
    per_call = {name: (n / calls, us / calls) for name, (n, us) in totals.items()}
    return dict(sorted(per_call.items(), key=lambda item: -item[1][1]))


def _fwd_bwd(forward, inputs):
    """A callable running forward and backward (a fixed output gradient) on fresh graphs; the
    grads are reset to None inside it, so a captured call captures the reset too."""
    out = forward()
    grad = torch.randn_like(out)

    def step():
        for t in inputs:
            t.grad = None
        forward().backward(grad)
    return step


# ---- the rows -------------------------------------------------------------------------------

def copy_bandwidth(device, nbytes=256 * 2**20):
    """(GB/s, timing fields) of a device-to-device copy of nbytes (read + write counted)."""
    x = torch.empty(nbytes, dtype=torch.uint8, device=device)
    y = torch.empty_like(x)
    timing = with_figures(measure(lambda: y.copy_(x)), nbytes=2 * nbytes)
    return timing["gbps"], timing


def attention_rows(device, dtype, batch=16, head_dim=64, num_heads=12, seqlens=(128, 512), mean_frac=0.6):
    rows = []
    hidden = head_dim * num_heads
    for seqlen in seqlens:
        generator = torch.Generator().manual_seed(0)
        # Lengths uniform in [0.2 L, L]: average 0.6 L.
        valid_lens = torch.randint(int(0.2 * seqlen), seqlen + 1, (batch,), generator=generator).to(device)
        qkv = torch.randn(batch, seqlen, 3 * hidden, device=device, dtype=dtype, requires_grad=True)
        dense_flops = 4 * batch * num_heads * seqlen**2 * head_dim
        mask = (torch.arange(seqlen, device=device)[None, :] < valid_lens[:, None])[:, None, None, :]

        def heads(x):
            return x.unflatten(-1, (num_heads, head_dim)).transpose(1, 2)

        def sdpa(attn_mask):
            def run():
                q, k, v = (heads(t) for t in qkv.chunk(3, dim=-1))
                return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask)
            return run

        methods = {
            "triton": lambda: ops.packed_self_attention(qkv, num_heads, valid_lens, backend="triton"),
            "torch (ours: SDPA + exact -1e6 rule)": lambda: ops.packed_self_attention(qkv, num_heads, valid_lens),
            "sdpa bool mask": sdpa(mask),
            "sdpa no mask (flash)": sdpa(None),
        }
        for name, forward in methods.items():
            for direction, flops in (("fwd", dense_flops), ("fwd+bwd", 3.5 * dense_flops)):
                row = dict(op="attention", method=name, direction=direction, batch=batch,
                           seqlen=seqlen, head_dim=head_dim, num_heads=num_heads,
                           mean_valid_frac=float(valid_lens.float().mean() / seqlen))
                row.update(_measure_method(forward, [qkv], direction))
                rows.append(with_figures(row, flops=flops))
    return rows


def _measure_method(forward, leaves, direction):
    """measure() of forward alone or of a fwd+bwd step; building the step runs forward once,
    so a forward that fails is reported in the row, not raised."""
    if direction == "fwd":
        return measure(forward)
    try:
        step = _fwd_bwd(forward, leaves)
    except Exception as error:
        return dict(ms=None, ms_p20=None, ms_p80=None, host_us=None, timed_by=None,
                    error=f"failed eagerly: {_one_line(error)}")
    return measure(step)


MEMORY_BOUND_OPS = ("add_layernorm", "bias_act relu", "embedding_sum")
OP_CHOICES = ("attention", "add_layernorm", "bias_act", "embedding_sum")


def memory_bound_rows(device, dtype, copy_gbps, tokens=16 * 512, sizes=((768, 3072), (1024, 4096)),
                      only=MEMORY_BOUND_OPS):
    """Rows for the memory-bound ops in ``only``, at each (hidden, ffn) of ``sizes``; ``tokens``
    rows (embedding_sum: sequences of min(tokens, 512))."""
    seq = min(tokens, 512)
    rows = []
    e = torch.finfo(dtype).bits // 8
    # The compiled extension's CUDA ops too, where they are built (backend "cuda").
    with_ext = extension.load() and extension.has_cuda_kernels()
    backends = ("triton", "torch") + (("cuda",) if with_ext else ())
    for hidden, ffn in sizes:
        x = torch.randn(tokens, hidden, device=device, dtype=dtype, requires_grad=True)
        residual = torch.randn_like(x, requires_grad=True)
        weight = torch.ones(hidden, device=device, dtype=dtype, requires_grad=True)
        bias = torch.zeros(hidden, device=device, dtype=dtype, requires_grad=True)
        h = torch.randn(tokens, ffn, device=device, dtype=dtype, requires_grad=True)
        ffn_bias = torch.zeros(ffn, device=device, dtype=dtype, requires_grad=True)
        token_w = torch.randn(30522, hidden, device=device, dtype=dtype, requires_grad=True)
        segment_w = torch.randn(2, hidden, device=device, dtype=dtype, requires_grad=True)
        pos_w = torch.randn(1, 512, hidden, device=device, dtype=dtype)
        ids = torch.randint(0, 30522, (tokens // seq, seq), device=device)
        segs = torch.randint(0, 2, (tokens // seq, seq), device=device)
        cases = {
            # op: (forward per backend, leaves, bytes it must move fwd, fwd+bwd)
            "add_layernorm": (
                {b: (lambda b=b: ops.add_layernorm(x, residual, weight, bias, backend=b)) for b in backends},
                [x, residual, weight, bias], 3 * tokens * hidden * e, 7 * tokens * hidden * e),
            "bias_act relu": (
                {"triton": lambda: ops.bias_act(h, ffn_bias, "relu"), "torch": lambda: F.relu(h + ffn_bias)},
                [h, ffn_bias], 2 * tokens * ffn * e, 5 * tokens * ffn * e),
            "embedding_sum": (
                {b: (lambda b=b: ops.embedding_sum(ids, segs, token_w, segment_w, pos_w, backend=b))
                 for b in backends},
                # The backward writes the whole token-table gradient (30522 x H, dense), not
                # only the rows of the ids: counted, or its GB/s would be 2-60x too low.
                [token_w, segment_w], 2 * tokens * hidden * e, 4 * tokens * hidden * e + token_w.numel() * e),
        }
        for op, (forwards, leaves, bytes_fwd, bytes_both) in cases.items():
            if op not in only:
                continue
            for backend, forward in forwards.items():
                for direction, nbytes in (("fwd", bytes_fwd), ("fwd+bwd", bytes_both)):
                    row = dict(op=op, method=backend, direction=direction, tokens=tokens,
                               hidden=ffn if op.startswith("bias_act") else hidden)
                    row.update(_measure_method(forward, leaves, direction))
                    rows.append(with_figures(row, nbytes=nbytes, copy_gbps=copy_gbps))
    return rows


# ---- the command line -----------------------------------------------------------------------

def format_row(row):
    if row.get("tflops") is not None:
        figure = f"{row['tflops']:7.1f} TFLOP/s"
    elif row.get("gbps") is not None:
        share = "" if row.get("frac_of_copy") is None else f" ({100 * row['frac_of_copy']:.0f}% of copy)"
        figure = f"{row['gbps']:7.0f} GB/s{share}"
    else:
        figure = ""
    shape = (f"B{row['batch']} L{row['seqlen']} hd{row['head_dim']}" if row["op"] == "attention"
             else f"{row['tokens']}x{row['hidden']}")
    gpu = "       - ms GPU" if row["ms"] is None else f"{row['ms']:8.4f} ms GPU"
    host = "      - us host" if row["host_us"] is None else f"{row['host_us']:7.1f} us host"
    line = f"{row['op']:<14} {row['direction']:<8} {shape:<16} {row['method']:<38} {gpu} {host}  {figure}"
    for key in ("note", "error"):
        if row.get(key):
            line += f"\n{'':16}{key}: {row[key]}"
    for name, (launches, us) in (row.get("kernels") or {}).items():
        line += f"\n{'':16}{us:8.1f} us {launches:4.1f}x  {name[:100]}"
    return line


def parse_args(argv=None):
    parser = argparse.ArgumentParser(prog="python -m bert_fast.kernel_bench",
                                     description=__doc__.split("\n\n")[0].replace("\n", " "))
    parser.add_argument("--dtype", choices=("bfloat16", "float16"), default="bfloat16")
    parser.add_argument("--json", metavar="PATH", help="also write the rows and run details to PATH")
    parser.add_argument("--ops", nargs="+", choices=OP_CHOICES, default=list(OP_CHOICES),
                        help="which ops to time (default: all)")
    parser.add_argument("--kernels", action="store_true",
                        help="also list each row's kernels with their GPU time per call (torch profiler)")
    parser.add_argument("--tokens", nargs="+", type=int, default=[16 * 512], metavar="N",
                        help="rows of the memory-bound ops, each a run of its own (default 8192): "
                             "a few hundred is a forward at batch 1, where a kernel's latency, not "
                             "its bandwidth, sets the time; at most 512 or a multiple of 512")
    args = parser.parse_args(argv)
    for n in args.tokens:
        if n < 1 or (n > 512 and n % 512):
            parser.error(f"--tokens {n}: give a count in [1, 512] or a multiple of 512 "
                         "(embedding_sum runs it as sequences of up to 512 tokens)")
    return args


def unavailable_reason():
    """Why this process cannot take kernel timings, or None when it can."""
    if not torch.cuda.is_available():
        return ("kernel_bench needs a CUDA GPU: it times compiled kernels in CUDA graphs, and on the "
                "CPU Triton kernels only run in the interpreter, which says nothing about speed")
    if interpreting():
        return ("kernel_bench times compiled Triton kernels, but TRITON_INTERPRET=1 is set: "
                "unset it and run again")
    return None


def main(argv=None):
    args = parse_args(argv)
    reason = unavailable_reason()
    if reason:
        sys.exit(reason)
    import triton
    device, dtype = torch.device("cuda"), getattr(torch, args.dtype)
    global BREAKDOWN
    BREAKDOWN = args.kernels
    copy_gbps, copy_timing = copy_bandwidth(device)
    if copy_gbps is None:
        sys.exit(f"kernel_bench could not time a device copy: {copy_timing.get('error')}")
    name = torch.cuda.get_device_name(device)
    print(f"{name}; torch {torch.__version__}, triton {triton.__version__}, {args.dtype}; "
          f"device copy bandwidth {copy_gbps:.0f} GB/s")
    if copy_timing.get("note"):
        print(f"copy bandwidth: {copy_timing['note']}")
    print(f"GPU ms: {CALLS_PER_GRAPH} calls in one CUDA graph, median of {REPLAYS} replays; "
          f"host us: {HOST_CALLS} back-to-back eager calls, median of {HOST_ROUNDS} rounds", flush=True)
    rows = []

    def report(new_rows):       # printed as they come: a run cut short still shows what it timed
        for row in new_rows:
            print(format_row(row), flush=True)
        rows.extend(new_rows)

    if "attention" in args.ops:
        report(attention_rows(device, dtype))
    only = [op for op in MEMORY_BOUND_OPS if op.split()[0] in args.ops]
    for tokens in args.tokens if only else ():
        report(memory_bound_rows(device, dtype, copy_gbps, tokens=tokens, only=only))
    if args.json:
        from .bench_common import bert_fast_version
        record = dict(device=name, torch=torch.__version__, triton=triton.__version__, bert_fast=bert_fast_version(),
                      cuda=torch.version.cuda, dtype=args.dtype, command=list(sys.orig_argv),
                      l2_cache_bytes=getattr(torch.cuda.get_device_properties(device), "L2_cache_size", None),
                      timing=timing_description(), copy_gbps=copy_gbps, copy=copy_timing,
                      date=datetime.datetime.now().astimezone().isoformat(timespec="seconds"), rows=rows)
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(record, f, indent=2)
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
