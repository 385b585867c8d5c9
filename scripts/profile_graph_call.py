"""Where the host time of a cuda_graphs=True call goes, beside its replay:

  python scripts/profile_graph_call.py [--shape latency] [--calls 200]

On the H100 (2026-11-26) BERT-base bf16 at B1 L128 replays in 0.434 ms, capture_encoder's
call takes 0.497 ms and FastBERTEncoder(cuda_graphs=True)'s 0.777 ms, timed as the suite times
(synchronize before and after each call). The same call on the CPU VM, replay stubbed, is
~70-80 µs of host work. This prints, for the automatic graphs with check_inputs on (users'
default) and off, and for capture_encoder: the median µs a call timed that way, the median µs a
call back to back (one synchronize per 20 calls, so host work may overlap the replays), the
median µs a call timed that way right after an eager reference forward (untimed; the suite runs
its other methods between two calls of one: on the CPU VM, replay stubbed, the automatic graph's
host work went from ~70-90 µs a call to ~230-420 µs after one, caches and predictors cold), for
the automatic graphs the median µs from a synchronised call's start to its replay's launch (the
host work the GPU waits for; the module-tree check and the id-range read come after the launch
since the evening of 2026-11-26: scripts/graph_call_host.py measures the split on a CPU), and the
Python functions taking the most host time over ``--calls`` calls (cProfile; time inside torch's
C++ calls, such as a host read's wait, shows under the calling builtin). A GPU tool for
scripts/gpu_session.sh's `profile-graph-call` step; it changes nothing.
"""

import argparse
import cProfile
import io
import pstats
import statistics
import time

import torch

from bert_fast import cuda_graph
from bert_fast.bench_common import encoder_config, fast_encoder_sharing, make_inputs
from bert_fast.bench_suite import SHAPES
from bert_fast.cuda_graph import capture_encoder
from bert_fast.reference import BERTEncoder


def per_call_us(call, calls, synchronize_each, between=None):
    """Median µs of a call over rounds of 20: each call synchronised, or the round's 20 back to
    back; ``between`` (synchronised calls only): run untimed before each call, as the suite's
    interleaved rounds run the other methods between two calls of one."""
    samples = []
    for _ in range(max(1, calls // 20)):
        torch.cuda.synchronize()
        if between is not None:
            for _ in range(20):
                between()
                torch.cuda.synchronize()
                start = time.perf_counter()
                call()
                torch.cuda.synchronize()
                samples.append((time.perf_counter() - start) * 1e6)
        elif synchronize_each:
            for _ in range(20):
                start = time.perf_counter()
                call()
                torch.cuda.synchronize()
                samples.append((time.perf_counter() - start) * 1e6)
        else:
            start = time.perf_counter()
            for _ in range(20):
                call()
            torch.cuda.synchronize()
            samples.append((time.perf_counter() - start) * 1e6 / 20)
    return statistics.median(samples)


class _StampedGraph:
    """A captured graph whose replay notes when it was launched."""

    def __init__(self, graph, stamps):
        self.graph, self.stamps = graph, stamps

    def replay(self):
        self.stamps.append(time.perf_counter())
        self.graph.replay()


class _StampingSteps(cuda_graph._CudaGraphSteps):
    """The automatic graphs' device steps, their graphs stamped (_StampedGraph)."""

    def __init__(self, stamps):
        self.stamps = stamps

    def capture(self, run, device, pool):
        graph, output = super().capture(run, device, pool)
        return _StampedGraph(graph, self.stamps), output


def to_launch_us(call, calls, stamps, between=None):
    """Median µs from a synchronised call's start to its replay's launch (the host work that
    no GPU work overlaps); ``between`` as in per_call_us."""
    samples = []
    for _ in range(calls):
        if between is not None:
            between()
        torch.cuda.synchronize()
        stamps.clear()
        start = time.perf_counter()
        call()
        torch.cuda.synchronize()
        if stamps:
            samples.append((stamps[0] - start) * 1e6)
    return statistics.median(samples) if samples else float("nan")


def top_functions(call, calls, lines):
    profile = cProfile.Profile()
    torch.cuda.synchronize()
    profile.enable()
    for _ in range(calls):
        call()
    torch.cuda.synchronize()
    profile.disable()
    text = io.StringIO()
    pstats.Stats(profile, stream=text).sort_stats("tottime").print_stats(lines)
    return text.getvalue()


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=SHAPES, default="latency")
    parser.add_argument("--preset", default="base")
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--lines", type=int, default=25, help="functions listed per method")
    parser.add_argument("--device", default="cuda", help=argparse.SUPPRESS)   # a CPU smoke test, replays stubbed
    options = parser.parse_args()
    device = torch.device(options.device)
    shape = SHAPES[options.shape]
    config = encoder_config(options.preset)
    torch.manual_seed(0)
    eager = BERTEncoder(**config).to(device=device, dtype=torch.bfloat16).eval()
    inputs = tuple(make_inputs(shape.batch, shape.seq, shape.min_len_frac, config["vocab_size"], 0, device))
    methods = {}
    stamps = []
    cuda_graph._steps = _StampingSteps(stamps)
    for check in (True, False):
        encoder = fast_encoder_sharing(eager, config, backend="auto", cuda_graphs=True, check_inputs=check)
        methods[f"cuda_graphs=True, check_inputs={check}"] = lambda encoder=encoder: encoder(*inputs)
    graphed = capture_encoder(fast_encoder_sharing(eager, config, backend="auto", check_inputs=False), *inputs,
                              clone_output=False)
    methods["capture_encoder (check_inputs=False, clone_output=False)"] = lambda: graphed(*inputs)
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; {options.preset} bf16 "
          f"{options.shape} B{shape.batch} L{shape.seq}")
    with torch.inference_mode():
        for name, call in methods.items():
            for _ in range(3):
                call()                     # captures, warmup
            each = per_call_us(call, options.calls, synchronize_each=True)
            back_to_back = per_call_us(call, options.calls, synchronize_each=False)
            after_eager = per_call_us(call, options.calls, synchronize_each=True, between=lambda: eager(*inputs))
            print(f"\n## {name}: {each:.0f} µs a call synchronised, {back_to_back:.0f} µs back to back, "
                  f"{after_eager:.0f} µs synchronised after an eager reference forward")
            if name.startswith("cuda_graphs"):
                print(f"from the call to its replay's launch: {to_launch_us(call, options.calls, stamps):.0f} µs "
                      f"synchronised, {to_launch_us(call, options.calls, stamps, lambda: eager(*inputs)):.0f} µs "
                      f"after an eager reference forward")
            print(top_functions(call, options.calls, options.lines))


if __name__ == "__main__":
    main()
