"""Where a forward's GPU time goes: the kernels of one FastBERTEncoder forward (BERT-base, bf16,
the suite's shapes and inputs), and how long the same forward takes replayed in a CUDA graph.

  python scripts/profile_kernels.py [--shapes latency dense long] [--backends auto triton] [--train]

Per shape and backend: the torch profiler's CUDA kernels of 10 eager forwards (check_inputs
off, so no host read), summed per kernel name and divided by 10, then the replay time of
capture_encoder's graph (CUDA events around 50 replays, one sync) beside the kernels' sum: what
the graph adds between kernels. --train: the kernels of a training step's forward+backward
instead (train mode, dropout 0.1, a fixed output gradient; no graph). A GPU-only tool for
scripts/gpu_session.sh's `profile` and `profile-train` steps.

Besides the backends, ``auto:extension-addnorm-bwd`` and ``auto:triton-addnorm-bwd``: backend
auto with the fused layer's add-norm backward set to the extension's or Triton's
(ops.encoder_layer.EXTENSION_ADDNORM_BACKWARD on or off; plain ``auto`` runs the default), to
measure which of the two a training step should run.
"""

import argparse
import contextlib
import importlib

import torch

from bert_fast import FastBERTEncoder, capture_encoder
from bert_fast.bench_common import encoder_config, make_inputs
from bert_fast.bench_suite import SHAPES
from bert_fast.kernel_bench import _fwd_bwd, kernel_breakdown

FORWARDS, REPLAYS = 10, 50


def kernel_times(model, inputs, train):
    """{kernel name: (calls, µs)} per forward (per forward+backward with ``train``)."""
    if train:
        step = _fwd_bwd(lambda: model(*inputs), list(model.parameters()))
        for _ in range(3):
            step()
        return kernel_breakdown(step, FORWARDS)
    with torch.inference_mode():
        for _ in range(3):
            model(*inputs)
        return kernel_breakdown(lambda: model(*inputs), FORWARDS)


ADDNORM_BACKWARDS = {"extension-addnorm-bwd": True, "triton-addnorm-bwd": False}


@contextlib.contextmanager
def variant(name):
    """Within: the backend variant ``name`` names (see the module docstring); the backend itself."""
    layer = importlib.import_module("bert_fast.ops.encoder_layer")
    backend, _, option = name.partition(":")
    if option not in ("", *ADDNORM_BACKWARDS):
        raise ValueError(f"unknown variant {name!r}")
    previous = layer.EXTENSION_ADDNORM_BACKWARD
    layer.EXTENSION_ADDNORM_BACKWARD = ADDNORM_BACKWARDS.get(option, previous)
    try:
        yield backend
    finally:
        layer.EXTENSION_ADDNORM_BACKWARD = previous


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
    parser.add_argument("--shapes", nargs="+", choices=SHAPES, help="default: latency dense long; train with --train")
    parser.add_argument("--backends", nargs="+", default=["auto"])
    parser.add_argument("--top", type=int, default=12)
    parser.add_argument("--train", action="store_true", help="a training step's kernels instead (no graph)")
    options = parser.parse_args()
    shapes = options.shapes or (["train"] if options.train else ["latency", "dense", "long"])
    config = encoder_config("base")
    what = "forward+backward, train mode" if options.train else "forward, eval"
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; BERT-base bf16, {what}, check_inputs off")
    for shape_name in shapes:
        shape = SHAPES[shape_name]
        inputs = make_inputs(shape.batch, shape.seq, shape.min_len_frac, config["vocab_size"], 0, torch.device("cuda"))
        for backend in options.backends:
            try:
                with variant(backend) as plain_backend:
                    torch.manual_seed(0)
                    model = FastBERTEncoder(**config, backend=plain_backend, check_inputs=False)
                    model = model.cuda().to(torch.bfloat16)
                    model.train(options.train)
                    times = kernel_times(model, tuple(inputs), options.train)
                    graph = None if options.train else replay_ms(model, tuple(inputs))
            except Exception as error:       # report it, and go on with the next shape
                print(f"\n## {shape_name}, backend {backend}: failed: {type(error).__name__}: {error}")
                continue
            total = sum(us for _, us in times.values())
            calls = sum(n for n, _ in times.values())
            replay = ("" if graph is None else f"; graph replay {graph:.3f} ms ({graph * 1e3 - total:.0f} µs beside "
                      f"the kernels, {(graph * 1e3 - total) / calls:.2f} µs a kernel)")
            print(f"\n## {shape_name} B{shape.batch} L{shape.seq}, backend {backend}: {calls:.0f} kernels, "
                  f"{total / 1e3:.3f} ms of kernel time per call{replay}")
            print("| kernel | launches / call | µs / call | µs / launch | share |\n|---|---|---|---|---|")
            for name, (n, us) in list(times.items())[:options.top]:
                print(f"| {name[:90]} | {n:.0f} | {us:.1f} | {us / n:.2f} | {us / total:.1%} |")


if __name__ == "__main__":
    main()
