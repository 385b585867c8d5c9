"""Where a forward's GPU time goes: the kernels of one FastBERTEncoder forward (BERT-base, bf16,
the suite's shapes and inputs), and how long the same forward takes replayed in a CUDA graph.

  python scripts/profile_kernels.py [--shapes latency dense long] [--backends auto triton]

Per shape and backend: the torch profiler's CUDA kernels of 10 eager forwards (check_inputs
off, so no host read), summed per kernel name and divided by 10, then the replay time of
capture_encoder's graph (CUDA events around 50 replays, one sync) beside the kernels' sum: what
the graph adds between kernels. A GPU-only tool for scripts/gpu_session.sh's `profile` step.
"""

import argparse
import collections

import torch
from torch.profiler import ProfilerActivity, profile

from bert_fast import FastBERTEncoder, capture_encoder
from bert_fast.bench_common import encoder_config, make_inputs
from bert_fast.bench_suite import SHAPES

FORWARDS, REPLAYS = 10, 50


def kernel_times(model, inputs):
    """{kernel name: (calls, µs)} per forward, from the profiler's device events."""
    with torch.inference_mode():
        for _ in range(3):
            model(*inputs)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(FORWARDS):
                model(*inputs)
            torch.cuda.synchronize()
    totals = collections.defaultdict(lambda: [0, 0.0])
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            totals[event.name][0] += 1
            totals[event.name][1] += event.device_time
    return {name: (calls / FORWARDS, us / FORWARDS) for name, (calls, us) in totals.items()}


def replay_ms(model, inputs):
    graphed = capture_encoder(model, *inputs, clone_output=False)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(5):
        graphed(*inputs)
    start.record()
    for _ in range(REPLAYS):
        graphed(*inputs)
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / REPLAYS


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="+", choices=SHAPES, default=["latency", "dense", "long"])
    parser.add_argument("--backends", nargs="+", default=["auto"])
    parser.add_argument("--top", type=int, default=12)
    options = parser.parse_args()
    config = encoder_config("base")
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; BERT-base bf16, eval, check_inputs off")
    for shape_name in options.shapes:
        shape = SHAPES[shape_name]
        inputs = make_inputs(shape.batch, shape.seq, shape.min_len_frac, config["vocab_size"], 0, torch.device("cuda"))
        for backend in options.backends:
            torch.manual_seed(0)
            model = FastBERTEncoder(**config, backend=backend, check_inputs=False).cuda().to(torch.bfloat16).eval()
            try:
                times = kernel_times(model, tuple(inputs))
                graph = replay_ms(model, tuple(inputs))
            except Exception as error:       # report it, and go on with the next shape
                print(f"\n## {shape_name}, backend {backend}: failed: {type(error).__name__}: {error}")
                continue
            total = sum(us for _, us in times.values())
            calls = sum(n for n, _ in times.values())
            print(f"\n## {shape_name} B{shape.batch} L{shape.seq}, backend {backend}: {calls:.0f} kernels, "
                  f"{total / 1e3:.3f} ms of kernel time per forward; graph replay {graph:.3f} ms "
                  f"({graph * 1e3 - total:.0f} µs beside the kernels, {(graph * 1e3 - total) / calls:.2f} µs a kernel)")
            print("| kernel | calls / forward | µs / forward | µs / call | share |\n|---|---|---|---|---|")
            for name, (n, us) in sorted(times.items(), key=lambda item: -item[1][1])[:options.top]:
                print(f"| {name[:90]} | {n:.0f} | {us:.1f} | {us / n:.2f} | {us / total:.1%} |")


if __name__ == "__main__":
    main()
