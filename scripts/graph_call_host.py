"""On the CPU: how much of a cuda_graphs=True call's host work comes before its replay is launched.

  python scripts/graph_call_host.py [--seq 16] [--rounds 30] [--hf]

The host bench's GPU path (12 layers, H 64, B1, check_inputs on, valid_lens 1-D; the triton
backend's launchers with kernels compiled for sm_90, the driver's launch counted, the replay
stubbed): the median µs from the call to its replay's launch and to its return, back to back
("warm") and each right after an eager reference forward ("cold", as the suite interleaves
methods). On a GPU only the work before the launch adds to a synchronised call's latency where
the rest is shorter than the replay. At the default L 16 (a bucket length) the value check's
read comes after the launch; at L 8 (padded to 16) it comes before it (keyless rows).
``--hf``: a Hugging Face BertModel (H 384, 12 heads, FFN 1536) after
``optimize(model, backend="triton", cuda_graphs=True)`` instead, the eager HF model as the
reference, no attention mask (HF models' graphs read no values)."""

import argparse
import statistics
import time

import torch

from bert_fast import cuda_graph, host_bench
from bert_fast.bench_common import make_inputs


class _StampedReplay:
    def __init__(self, stamps):
        self.stamps = stamps

    def replay(self):
        self.stamps.append(time.perf_counter())


class _StampedSteps(host_bench._ReplayStubbed):
    def __init__(self, stamps):
        self.stamps = stamps

    def capture(self, run, device, pool):
        return _StampedReplay(self.stamps), run()


def hf_models(seq):
    """(eager HF BertModel, its optimized copy with cuda_graphs, (input_ids, token_type_ids, None))."""
    import copy
    import transformers
    from bert_fast import optimize
    config = transformers.BertConfig(vocab_size=host_bench.VOCAB_SIZE, hidden_size=384, num_hidden_layers=12,
                                     num_attention_heads=12, intermediate_size=1536, max_position_embeddings=64)
    torch.manual_seed(0)
    reference = transformers.BertModel(config).eval()
    fast = optimize(copy.deepcopy(reference), backend="triton", cuda_graphs=True)
    ids = torch.randint(0, host_bench.VOCAB_SIZE, (1, seq))
    return reference, fast, (ids, torch.zeros_like(ids), None)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--hf", action="store_true", help="a Hugging Face BertModel instead")
    options = parser.parse_args()
    stamps = []
    cuda_graph._steps = _StampedSteps(stamps)
    if options.hf:
        reference, fast, inputs = hf_models(options.seq)
    else:
        config = host_bench.encoder_config(12, 64, 4, 256, options.seq, 0.0)
        models = host_bench.build_models(config, [], torch.device("cpu"), gpu_path=True)
        reference, fast = models[host_bench.BASELINE].eval(), models[host_bench.GPU_PATH].eval()
        inputs = tuple(make_inputs(1, options.seq, 0.5, host_bench.VOCAB_SIZE, 0, torch.device("cpu")))
        fast.cuda_graphs = True
    times = {kind: ([], []) for kind in ("warm", "cold")}
    with host_bench.gpu_launch_path(host_bench.gpu_path_arch()), torch.inference_mode():
        for _ in range(3):
            fast(*inputs)
        for _ in range(options.rounds):
            for kind, (to_launch, whole) in times.items():
                for _ in range(20):
                    (reference if kind == "cold" else fast)(*inputs)
                    stamps.clear()
                    start = time.perf_counter()
                    fast(*inputs)
                    end = time.perf_counter()
                    to_launch.append((stamps[0] - start) * 1e6)
                    whole.append((end - start) * 1e6)
    for kind, (to_launch, whole) in times.items():
        print(f"{kind}: {statistics.median(to_launch):.1f} us to the replay's launch, "
              f"{statistics.median(whole):.1f} us a call")


if __name__ == "__main__":
    main()
