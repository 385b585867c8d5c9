"""Host time of a Hugging Face BertModel's forward+backward with HF's gradient checkpointing, off,
non-reentrant and reentrant: HF's own model, bert_fast.optimize()'s on the torch backend, its
triton backend's GPU path (bert_fast.host_bench.gpu_launch_path: CPU tensors through the GPU's
eager path, Triton's launches counted), and that GPU path with the fused layers' own
checkpointing off (bert_fast.hf._recomputes_itself patched to False: HF's
torch.utils.checkpoint around each fused layer, what optimize() did before it), all in one
process, in interleaved rounds:

  python scripts/hf_checkpointing_host.py [--rounds 12] [--calls 8]

The host benchmark's shape (12 layers, H 64, 4 heads, FFN 256, B1 L8, dropout 0). Prints the
median of the rounds' medians per row, and its ratio to HF's own with the same checkpointing.
"""

import argparse
import contextlib
import copy
import statistics
import sys
import time
import warnings

import torch

from bert_fast import hf, host_bench, optimize
from bert_fast.bench_common import environment_info, make_inputs
from bert_fast.peers import valid_position_mask

ROWS = (("HF", None), ("fast[torch]", "torch"), (host_bench.GPU_PATH, "triton"),
        (f"{host_bench.GPU_PATH}, torch's checkpoint", "triton"))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=12, help="rounds, the first two untimed (default: 12)")
    parser.add_argument("--calls", type=int, default=8, help="calls per row and round (default: 8)")
    options = parser.parse_args(argv)
    from transformers import BertModel
    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    config = host_bench.encoder_config(12, 64, 4, 256, 8, 0.0)
    tokens, segments, valid_lens = make_inputs(1, 8, 0.5, host_bench.VOCAB_SIZE, 0, torch.device("cpu"))
    mask = valid_position_mask(valid_lens, tokens).long()
    torch.manual_seed(0)
    reference = BertModel(host_bench.hf_config(config))
    models = {}
    for setting in ("off", "non-reentrant", "reentrant"):
        for name, backend in ROWS:
            model = copy.deepcopy(reference) if backend is None else optimize(copy.deepcopy(reference), backend=backend)
            model.train()
            if setting != "off":
                host_bench.checkpoint_layers(model, setting == "reentrant")
            models[setting, name] = model
    native = hf._recomputes_itself

    def timed(key):
        model = models[key]
        hf._recomputes_itself = (lambda layer: False) if "torch's" in key[1] else native
        samples = []
        try:
            with host_bench.gpu_launch_path(host_bench.gpu_path_arch()) if host_bench.GPU_PATH in key[1] else \
                    contextlib.nullcontext():
                for _ in range(options.calls):
                    model.zero_grad(set_to_none=True)
                    start = time.perf_counter()
                    model(input_ids=tokens, token_type_ids=segments, attention_mask=mask).last_hidden_state.sum().backward()
                    samples.append(time.perf_counter() - start)
        finally:
            hf._recomputes_itself = native
        return statistics.median(samples)

    keys, medians = list(models), {key: [] for key in models}
    for round_ in range(options.rounds):
        for key in keys[round_ % len(keys):] + keys[:round_ % len(keys)]:
            median = timed(key)
            if round_ >= 2:
                medians[key].append(median)
    env = environment_info(torch.device("cpu"))
    print(f"{env['device_name']}, torch {env['torch']}, triton {env['triton']}, transformers "
          f"{sys.modules['transformers'].__version__}; {options.rounds - 2} timed rounds of {options.calls} calls")
    print("| checkpointing | method | median µs | vs HF's |\n|---|---|---|---|")
    for (setting, name), values in medians.items():
        hf_own = statistics.median(medians[setting, "HF"])
        print(f"| {setting} | {name} | {statistics.median(values) * 1e6:.0f} | "
              f"{statistics.median(values) / hf_own:.2f}× |")


if __name__ == "__main__":
    main()
