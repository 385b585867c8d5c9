"""Fixtures of the encoder benchmarks: per shape, the methods on shared weights, one batch of
inputs and the fp32 eager output they are checked against (built once per session)."""

from typing import NamedTuple

import pytest
import torch

from bert_fast.bench import BenchModels, EncoderInputs, build_models, default_device, make_inputs
from bert_fast.bench_suite import default_backends


class BenchShape(NamedTuple):
    preset: str
    batch: int
    seq: int
    min_len_frac: float = 0.5

    @property
    def id(self):
        return f"{self.preset}-b{self.batch}-l{self.seq}"


# Small enough that the whole suite, torch.compile included, runs in about a minute on a
# 2-core CPU; the CLI (python -m bert_fast.bench) is the tool for model-sized numbers.
BENCH_SHAPES = [BenchShape("small", batch=4, seq=64), BenchShape("demo", batch=4, seq=32)]




class BenchCase(NamedTuple):
    shape: BenchShape
    device: torch.device
    models: BenchModels
    inputs: EncoderInputs
    reference_output: torch.Tensor


@pytest.fixture(scope="session", params=BENCH_SHAPES, ids=lambda shape: shape.id)
def bench_case(request):
    shape = request.param
    device = default_device()
    models = build_models(shape.preset, torch.float32, device, seed=0, backends=default_backends(device))
    inputs = make_inputs(shape.batch, shape.seq, shape.min_len_frac, models.config["vocab_size"],
                         seed=0, device=device)
    with torch.inference_mode():
        reference_output = models.reference(*inputs)
    return BenchCase(shape, device, models, inputs, reference_output)
