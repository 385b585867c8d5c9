"""Training with the fast path tracks the reference's loss curve (issue 13).

200 AdamW steps of pretraining (MLM + NSP heads, the book's loss) on a small BERTModel, from the
same initial weights on the same batches: the reference, and ``bert_fast.optimize`` of a copy
on every backend. Dropout is 0 so both runs are deterministic and comparable step by step; the
fast path's forward and backward differ from the reference's only by rounding (fp32), which
training may amplify but must not turn into a different curve.

On a GPU the same at BERT-base under bf16 autocast (the suite's train batch, B32 L128), where
rounding is no longer small: the fast path's curve must stay as close to the fp32 reference's
as the reference's own under the same autocast (STYLE.md's rule: at most twice its distance,
plus bf16's floor), over the steps before the curves leave their plateau (AUTOCAST_STEPS).
"""

import copy

import pytest
import torch

import bert_fast
from bert_fast.backend import available_backends
from bert_fast.bench_suite import SHAPES, Shape, bert_model_config, make_train_batch
from bert_fast.reference import BERTModel, pretraining_loss
from tests.helpers import BF16_OK, FLOOR

STEPS = 200
H, VOCAB = 32, 64
CONFIG = dict(vocab_size=VOCAB, num_hiddens=H, norm_shape=[H], ffn_num_input=H, ffn_num_hiddens=64,
              num_heads=2, num_layers=2, dropout=0.0, max_len=32, key_size=H, query_size=H, value_size=H,
              hid_in_features=H, mlm_in_features=H, nsp_in_features=H)
# fp32 over 200 steps (loss 4.2 -> 0.13): the measured gap was at most 1e-6 on every backend
# (torch 2.13, CPU); 1e-4 leaves room for other BLAS builds' rounding.
TOLERANCE = 1e-4


def loss_curve(model, batches, lr=2e-3, autocast=None, steps=STEPS):
    """Losses of ``steps`` AdamW steps; ``autocast``: the forward under torch.autocast in that dtype."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    model.train()
    device_type = next(model.parameters()).device.type
    losses = []
    for step in range(steps):
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast(device_type, dtype=autocast, enabled=autocast is not None):
            loss = pretraining_loss(model, *batches[step % len(batches)])[0]
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return torch.tensor(losses)


@pytest.fixture(scope="module")
def reference_run():
    torch.manual_seed(0)
    model = BERTModel(**CONFIG)
    batches = [make_train_batch(Shape("train", 8, 16, 0.5), VOCAB, seed, "cpu") for seed in range(4)]
    initial = copy.deepcopy(model)
    return initial, batches, loss_curve(model, batches)


@pytest.mark.parametrize("backend", [b for b in available_backends() if b != "auto"])
def test_fast_training_tracks_the_reference_loss_curve(reference_run, backend):
    initial, batches, expected = reference_run
    model = bert_fast.optimize(copy.deepcopy(initial), backend=backend)
    assert isinstance(model.encoder, bert_fast.FastBERTEncoder)
    losses = loss_curve(model, batches)
    assert expected[-20:].mean() < 0.6 * expected[:20].mean(), "the reference did not learn: no curve to track"
    gap = (losses - expected).abs()
    assert gap.max() <= TOLERANCE, (f"step {int(gap.argmax())}: loss {losses[gap.argmax()]:.6f} vs reference "
                                    f"{expected[gap.argmax()]:.6f} (max gap {gap.max():.2e} > {TOLERANCE})")


# The GPU test trains 100 steps. Every BERT-base curve falls from 11.2 to a plateau near 8.2 and
# leaves it later, at a step that rounding alone moves by tens of steps. On an H200 (2026-11-28,
# benchmarks/results/*T0610-loss-curves.log) the fp32 and bf16 references left it near steps
# 115-140, and four runs of optimize() near steps 130-190 (one of them with the column sums
# kernel before 7b1da0a; the runs are not bitwise repeatable: the token table's gradient adds
# with atomics, as index_add_ does on CUDA), ending at losses from 0.52 to 7.79 against the fp32
# run's 1.18. Up to step 110 every curve was within 0.06 of the fp32 one. Over 200 steps the
# distance measures when the exit came, not the rounding: that form of this test failed there
# (optimize() 0.99, the bf16 reference 0.29; the reference's own distance was 0.14 in another
# process), after three passes on H100s. scripts/loss_curves.py prints such curves.
AUTOCAST_STEPS = 100


def autocast_against_fp32_curves(preset, shape, device, steps=AUTOCAST_STEPS):
    """(fp32 reference, reference under bf16 autocast, optimize() under bf16 autocast) loss curves
    of one preset from the same fp32 weights on the same 4 batches, dropout 0, AdamW at the
    suite's learning rate. Autocast, not bf16 weights: with bf16 weights AdamW's small updates
    round away and both bf16 curves leave the fp32 one far behind (BERT-small on the CPU: a mean
    distance of 1.6 over 200 steps), which would let any curve near theirs pass."""
    config = dict(bert_model_config(preset), dropout=0.0)
    torch.manual_seed(0)
    initial = BERTModel(**config).to(device)
    batches = [make_train_batch(shape, config["vocab_size"], seed, device) for seed in range(4)]

    def curve(fast, autocast):
        model = copy.deepcopy(initial)
        return loss_curve(bert_fast.optimize(model) if fast else model, batches, lr=1e-4, autocast=autocast,
                          steps=steps)
    return curve(False, None), curve(False, torch.bfloat16), curve(True, torch.bfloat16)


@pytest.mark.skipif(not BF16_OK, reason="needs a CUDA GPU with bf16 (compute capability 8.0 or later)")
def test_gpu_bert_base_under_autocast_tracks_the_fp32_curve_as_the_reference_does():
    truth, eager, fast = autocast_against_fp32_curves("base", SHAPES["train"], "cuda")
    assert truth[-10:].mean() < 0.8 * truth[:10].mean(), "the fp32 reference did not learn: no curve to track"
    eager_gap, fast_gap = (eager - truth).abs().mean(), (fast - truth).abs().mean()
    assert fast_gap <= 2 * eager_gap + FLOOR[torch.bfloat16], (
        f"mean distance from the fp32 curve under bf16 autocast over the first {AUTOCAST_STEPS} steps: "
        f"optimize() {fast_gap:.4f}, the reference {eager_gap:.4f} (last losses {fast[-1]:.4f}, {eager[-1]:.4f}, "
        f"fp32 {truth[-1]:.4f})")
