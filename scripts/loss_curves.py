"""The loss curves of tests/test_loss_curve.py's GPU test, printed (every 10th step): the fp32
reference, the reference under bf16 autocast, then ``--runs`` runs of optimize() under bf16
autocast, each with its mean distance from the fp32 curve. Where each curve leaves the plateau
near 8.2 is what the 200-step form of the test came to measure (see AUTOCAST_STEPS there).

    PYTHONPATH=. python scripts/loss_curves.py --steps 200 --runs 2
"""
import argparse
import time

import torch

from bert_fast.bench_suite import SHAPES
from tests.test_loss_curve import autocast_against_fp32_curves


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--runs", type=int, default=2, help="runs of the reference and optimize() (default 2)")
    args = parser.parse_args(argv)
    print(torch.cuda.get_device_name(), f"torch {torch.__version__}; BERT-base B32 L128, {args.steps} steps", flush=True)
    for run in range(args.runs):
        start = time.perf_counter()
        curves = autocast_against_fp32_curves("base", SHAPES["train"], "cuda", steps=args.steps)
        print(f"run {run} ({time.perf_counter() - start:.0f} s)")
        for name, curve in zip(("fp32 reference", "bf16 reference", "bf16 optimize()"), curves):
            print(f"  {name}: distance {(curve - curves[0]).abs().mean():.4f}, every 10th step:",
                  " ".join(f"{v:.2f}" for v in curve[::10].tolist()), f"last {curve[-1]:.4f}", flush=True)


if __name__ == "__main__":
    main()
