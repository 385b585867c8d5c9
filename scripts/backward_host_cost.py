"""Why a backward costs the host more on CUDA than on the CPU:

  python scripts/backward_host_cost.py [--ops 2000] [--rounds 7]

On the GPU machines a backward costs the host more, against its forward, than on the CPU
machines: in an H100's BERT-base pretraining step (2026-11-28, scripts/profile_train_step.py)
the backward took 1.9x the host time of the forward and loss for the reference (34.9 against
18.6 ms) and 3.1x for optimize() (24.9 against 8.1); the same step at H 64 on a CPU VM
(2026-11-29, fp32, optimize() on the GPU path) 0.9x and 1.3x. The eager training step is
host-bound on the GPU, so that backward is what keeps it near 1.4x the reference. On the GPU
autograd runs the backward on its own thread per device; on the CPU in the calling thread. This times the same small CUDA
ops (an 8x64 @ 64x64 mm, an empty_like, an add, a view; on CUDA also one of our Triton kernels
through the eager launcher) and the same pure-Python loop

  in the main thread,
  inside a backward (a Function whose backward runs them), autograd's device thread,
  inside a backward with torch.autograd.set_multithreading_enabled(False) (the calling thread),

host µs per op (the GPU synchronised only around each timed block), and then the host
benchmark's encoder forward+backward (12 layers, H 64, B1 L8) of the reference and of
FastBERTEncoder on triton and cuda with the engine's threads on and off. If the per-op cost
inside the backward is well above the main thread's, the cost is the thread's (GIL hand-offs,
thread-local state, a colder cache), not our code. A GPU tool for scripts/gpu_session.sh's
`backward-host-cost` step; on the CPU (a smoke test) both paths run in the calling thread.

The H200's first run (2026-11-29, benchmarks/results/nvidia-h200-2026-11-29T2207-backward-host-cost.log)
read an mm 15.7 µs in a backward against 10.7 in the main thread, and as much with the
engine's threads off, so the thread alone did not explain it; yet the encoder's
forward+backward took 37% less host time with the threads off (one block each, in that
order). So two more places, each with what a backward differs in: the main thread under
torch.no_grad() (a backward runs with grad mode off) and a plain Python thread (a thread
other than the one that made the tensors), and the encoder's two settings alternate, call
by call.
"""

import argparse
import statistics
import threading
import time

import torch

from bert_fast.backend import available_backends
from bert_fast.bench_common import make_inputs, synchronize
from bert_fast.host_bench import SHAPE, VOCAB_SIZE, build_models, encoder_config, forward_backward_seconds


def workloads(device, ops):
    a = torch.randn(8, 64, device=device)
    b = torch.randn(64, 64, device=device)

    def mm():
        for _ in range(ops):
            torch.mm(a, b)

    def empty_like():
        for _ in range(ops):
            torch.empty_like(a)

    def add():
        for _ in range(ops):
            a.add(a)

    def view():
        for _ in range(ops):
            a.view(64, 8)

    def python():
        total = 0
        for i in range(ops * 20):
            total += i
        return total

    cases = {"mm": mm, "empty_like": empty_like, "add": add, "view (no allocation, no launch)": view,
             "Python loop (20 adds an op)": python}
    if device.type == "cuda":
        from bert_fast.ops.column_sums import column_sums
        partials = torch.randn(4, 64, device=device)

        def triton_launch():
            for _ in range(ops):
                column_sums(partials, torch.float32)

        # One of our Triton kernels through the eager launcher, with its output's allocation:
        # against empty_like, what a launch of ours costs the host.
        cases["column_sums (an empty + our Triton launch)"] = triton_launch
    return cases


class _RunInBackward(torch.autograd.Function):
    """Identity whose backward runs ``work`` and records how long it took."""

    @staticmethod
    def forward(ctx, x, work, seconds):
        ctx.work, ctx.seconds = work, seconds
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        start = time.perf_counter()
        ctx.work()
        ctx.seconds.append(time.perf_counter() - start)
        return grad, None, None


def time_in_main(work, device):
    synchronize(device)
    start = time.perf_counter()
    work()
    seconds = time.perf_counter() - start
    synchronize(device)
    return seconds


def time_in_main_no_grad(work, device):
    with torch.no_grad():
        return time_in_main(work, device)


def time_in_thread(work, device):
    """``work`` timed in a new Python thread (the caller waits for it)."""
    seconds = []
    thread = threading.Thread(target=lambda: seconds.append(time_in_main(work, device)))
    thread.start()
    thread.join()
    return seconds[0]


def time_in_backward(work, device, threads):
    x = torch.zeros(4, device=device, requires_grad=True)
    seconds = []
    with torch.autograd.set_multithreading_enabled(threads):
        out = _RunInBackward.apply(x, work, seconds)
        synchronize(device)
        out.sum().backward()
    synchronize(device)
    return seconds[0]


def encoder_backward_ms(model, inputs, device, rounds):
    """{threads: median host ms of a forward+backward} (host_bench's timing) with autograd's
    engine threads on and off, alternating call by call, after 3 untimed calls of each."""
    samples = {True: [], False: []}
    for call in range(rounds * 5 + 3):
        for threads in ((True, False) if call % 2 else (False, True)):
            with torch.autograd.set_multithreading_enabled(threads):
                samples[threads] += forward_backward_seconds(model, inputs, device, 1)
    return {threads: 1e3 * statistics.median(times[3:]) for threads, times in samples.items()}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--ops", type=int, default=2000, help="ops a timed block (default: %(default)s)")
    parser.add_argument("--rounds", type=int, default=7, help="timed blocks a case, median (default: %(default)s)")
    options = parser.parse_args()
    device = torch.device(options.device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"{name}, torch {torch.__version__}; host µs an op, median of {options.rounds} blocks of "
          f"{options.ops} ops")
    print("| op | main thread | main thread, no_grad | another Python thread | in a backward "
          "| in a backward, engine threads off |\n|---|---|---|---|---|---|")
    for op, work in workloads(device, options.ops).items():
        work()          # warm-up: cuBLAS handles, the caching allocator
        places = (lambda: time_in_main(work, device), lambda: time_in_main_no_grad(work, device),
                  lambda: time_in_thread(work, device), lambda: time_in_backward(work, device, True),
                  lambda: time_in_backward(work, device, False))
        samples = [[] for _ in places]
        for _ in range(options.rounds):      # the places in turn, round by round
            for place, times in zip(places, samples):
                times.append(place())
        print(f"| {op} | " + " | ".join(f"{1e6 * statistics.median(times) / options.ops:.2f}"
                                        for times in samples) + " |")

    config = encoder_config(SHAPE["num_layers"], SHAPE["num_hiddens"], SHAPE["num_heads"],
                            SHAPE["ffn_num_hiddens"], SHAPE["seq"], 0.0)
    backends = [b for b in ("triton", "cuda") if b in available_backends()] if device.type == "cuda" else ["triton"]
    models = build_models(config, backends, device)
    inputs = tuple(make_inputs(SHAPE["batch"], SHAPE["seq"], 0.5, VOCAB_SIZE, 0, device))
    print(f"\nThe host benchmark's encoder (12 layers, H 64, B{SHAPE['batch']} L{SHAPE['seq']}), train mode: "
          "host ms a forward+backward, median; the two settings alternate call by call")
    print("| method | engine threads on | off |\n|---|---|---|")
    for method, model in models.items():
        model.train()
        ms = encoder_backward_ms(model, inputs, device, options.rounds)
        print(f"| {method} | {ms[True]:.2f} | {ms[False]:.2f} |")


if __name__ == "__main__":
    main()
