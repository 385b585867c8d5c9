"""Where a whole pretraining step's GPU time goes, and how much of the step's wall time it is:

  python scripts/profile_train_step.py [--preset base] [--dtype bfloat16] [--steps 5]

The suite's train shape (BERTModel with the MLM and NSP heads, B32 L128, its batch and fused
AdamW, dropout 0.1, bf16): the eager reference and the model after bert_fast.optimize() (backend
auto). Per step: the wall time (host timer, synchronised), the kernels' time, and the kernels
split by the operator that launched them: the vocabulary-sized ops (an input with a dimension
of vocab_size: the MLM head's projection to the vocabulary and its cross-entropy, forward and
backward), the optimizer (AdamW's fused kernels), and the rest (the encoder, the heads' small
layers, the NSP head). For issue 13's item 4 (the MLM head's share) and for how far the eager
step is from its kernels (host-bound where the wall time is well above the kernels' sum). Then,
without the profiler, the host's time in each phase of the step (zero_grad, forward and loss,
backward, optimizer step) and the GPU's wait after it: which phase to cut where host-bound;
then the same with torch.autograd.set_multithreading_enabled(False) (the backward in the
calling thread, not autograd's device thread).
For optimize(), last, how much of the backward's host time is spent inside the fused encoder
layers' backward (our Python, its launches and GEMM calls; timed by wrapping the functions,
which sees the autograd engine's device thread, where cProfile would not) and in which of its
parts; the rest is the autograd engine's own work, AccumulateGrad and the heads' backward.

A GPU tool for scripts/gpu_session.sh's `profile-train-step`; with --device cpu (a smoke test)
the operators' CPU time stands in for the kernels'.
"""

import argparse
import copy
import importlib
import statistics
import time

import torch
from torch.profiler import ProfilerActivity, profile

from bert_fast import optimize
from bert_fast.bench_suite import SHAPES, TrainStep, bert_model_config, make_train_batch, quick_shape
from bert_fast.reference import BERTModel


def classify(event, vocab_size):
    """Which part of the step an operator belongs to."""
    if "adam" in event.name.lower():
        return "optimizer"
    if any(vocab_size in shape for shape in (event.input_shapes or []) if isinstance(shape, (list, tuple))):
        return "vocab-sized ops"
    return "encoder and the rest"


def profile_step(step, batch, steps, device, vocab_size):
    """(wall ms a step, {part: ms a step}) over ``steps`` profiled steps."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    walls = []
    with profile(activities=activities, record_shapes=True) as prof:
        for _ in range(steps):
            sync()
            start = time.perf_counter()
            step(*batch)
            sync()
            walls.append(1e3 * (time.perf_counter() - start))
    parts, device_us = {}, 0.0
    for event in prof.events():
        if event.device_type != torch.autograd.DeviceType.CPU:
            device_us += event.device_time_total           # a kernel, memcpy or memset
            continue
        # Kernels an operator launched itself (not its children's): each kernel counted once.
        us = event.self_device_time_total if device.type == "cuda" else event.self_cpu_time_total
        if us:
            part = classify(event, vocab_size)
            parts[part] = parts.get(part, 0.0) + us / 1e3 / steps
    if device.type == "cuda":
        # Device work no operator claims (a launch outside every profiled CPU event), if any.
        parts["not attributed"] = max(0.0, device_us / 1e3 / steps - sum(parts.values()))
    return statistics.median(walls), parts


def host_phases(step, batch, steps, device):
    """{threads: {phase: median host ms a step}} for unprofiled steps with autograd's engine
    threads on (True) and off, the two alternating step by step (the H200's first run of this,
    2026-11-29, timed them in two blocks and read the backward 35% slower with them off, where
    the host benchmark's encoder read 37% faster). The TrainStep's own phases are timed
    without synchronising between them: what the host spends issuing each (the time it blocks
    on a full launch queue included), then "wait", how long the GPU still ran after the host
    had issued the step (near 0: host-bound; the host's phases are then the step's time).
    Off, the backward runs in the calling thread, not autograd's device thread (on the CPU it
    always does): whether that thread is what makes a GPU's backward cost its host ~3x the
    forward (scripts/backward_host_cost.py times it op by op)."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    names = ("zero_grad", "forward+loss", "backward", "optimizer step", "wait", "wall")
    times = {threads: {phase: [] for phase in names} for threads in (True, False)}
    for index in range(2 * steps):
        threads = index % 4 in (0, 3)            # on, off, off, on, ...: each follows each as often
        with torch.autograd.set_multithreading_enabled(threads):
            sync()
            t0 = time.perf_counter()
            step.optimizer.zero_grad(set_to_none=True)
            t1 = time.perf_counter()
            loss = step.loss(*batch)
            t2 = time.perf_counter()
            loss.backward()
            t3 = time.perf_counter()
            step.optimizer.step()
            t4 = time.perf_counter()
            sync()
            t5 = time.perf_counter()
        for phase, seconds in zip(names, (t1 - t0, t2 - t1, t3 - t2, t4 - t3, t5 - t4, t5 - t0)):
            times[threads][phase].append(1e3 * seconds)
    return {threads: {phase: statistics.median(values) for phase, values in phases.items()}
            for threads, phases in times.items()}


def backward_parts(step, batch, steps):
    """{part: (host ms a step, calls a step)} inside the fused layers' backward over ``steps``
    steps, and the backward phase's own median ms: each part's function wrapped with a timer
    while they run."""
    layer = importlib.import_module("bert_fast.ops.encoder_layer")
    parts = {"fused layers' backward, in all": (layer._EncoderLayer, "backward"),
             "add-norm backward (2 a layer)": (layer, "_layernorm_backward"),
             "attention backward": (layer, "_attention_backward"),
             "bias/activation backward": (layer, "_bias_act_bwd_triton"),
             "joint column sums": (layer._DeferredSums, "finish"),
             "GEMMs with a residual (2 a layer)": (layer, "_add_product")}
    spent, calls = dict.fromkeys(parts, 0.0), dict.fromkeys(parts, 0)

    def timed(part, function):
        def wrapper(*args, **kwargs):
            start = time.perf_counter()
            try:
                return function(*args, **kwargs)
            finally:
                spent[part] += time.perf_counter() - start
                calls[part] += 1
        return wrapper

    originals = [(owner, name, vars(owner)[name]) for owner, name in parts.values()]
    backward_ms = []
    try:
        for part, (owner, name) in parts.items():
            function = getattr(owner, name)
            wrapped = timed(part, function)
            setattr(owner, name, staticmethod(wrapped) if isinstance(vars(owner)[name], staticmethod) else wrapped)
        for _ in range(steps):
            step.optimizer.zero_grad(set_to_none=True)
            loss = step.loss(*batch)
            start = time.perf_counter()
            loss.backward()
            backward_ms.append(1e3 * (time.perf_counter() - start))
            step.optimizer.step()
    finally:
        for owner, name, original in originals:
            setattr(owner, name, original)
    return ({part: (1e3 * seconds / steps, calls[part] / steps) for part, seconds in spent.items()},
            statistics.median(backward_ms))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="base")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--quick", action="store_true", help="the suite's quick train shape (smoke tests)")
    parser.add_argument("--backend", choices=["torch", "triton", "cuda"], help="optimize()'s (default: auto)")
    options = parser.parse_args()
    device, dtype = torch.device(options.device), getattr(torch, options.dtype)
    shape = quick_shape(SHAPES["train"]) if options.quick else SHAPES["train"]
    config = bert_model_config(options.preset)
    torch.manual_seed(0)
    base = BERTModel(**config)
    batch = make_train_batch(shape, config["vocab_size"], 0, device)
    name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    print(f"{name}, torch {torch.__version__}; {options.preset} {options.dtype}, a pretraining step "
          f"(MLM + NSP, fused AdamW where CUDA, dropout 0.1), B{shape.batch} L{shape.seq}, {options.steps} "
          f"profiled steps after 3; device time by the operator that launched it")
    for method, build in (("eager reference", lambda m: m), (f"optimize() ({options.backend or 'auto'})",
                                                                lambda m: optimize(m, backend=options.backend))):
        model = build(copy.deepcopy(base).to(device=device, dtype=dtype)).train()
        step = TrainStep(model, device)
        for _ in range(3):
            step(*batch)
        wall, parts = profile_step(step, batch, options.steps, device, config["vocab_size"])
        total = sum(parts.values())
        print(f"\n## {method}: wall {wall:.2f} ms a step, kernels {total:.2f} ms ({100 * total / wall:.0f}% of wall)")
        print("| part | ms a step | share of kernels |\n|---|---|---|")
        for part, ms in sorted(parts.items(), key=lambda item: -item[1]):
            print(f"| {part} | {ms:.3f} | {100 * ms / total:.1f}% |")
        steps = max(options.steps, 10)
        for threads, phases in host_phases(step, batch, steps, device).items():
            print(f"\nThe host's phases, unprofiled (median of {steps} steps"
                  + ("" if threads else "; autograd's engine threads off")
                  + "; the two settings alternate): " + ", ".join(f"{phase} {ms:.2f} ms" for phase, ms in phases.items()))
        if method.startswith("optimize"):
            parts, backward_ms = backward_parts(step, batch, max(options.steps, 10))
            print(f"\nThe backward's host time: median {backward_ms:.2f} ms a step", end="")
            if next(iter(parts.values()))[1]:
                print("; timers around functions, mean ms a step (the parts are inside the first row):")
                print("| part | calls a step | host ms a step |\n|---|---|---|")
                for part, (ms, count) in parts.items():
                    print(f"| {part} | {count:g} | {ms:.2f} |")
            else:
                print("; the fused encoder layer did not run (its backend's per-op path)")
        del model, step


if __name__ == "__main__":
    main()
