"""stage_inputs (bert_fast/ops/graph_inputs.py): the kernel that writes a call's inputs into a
CUDA graph's static buffers and reduces what the host reads, against the same done with
PyTorch ops (input_stats on buffers filled by hand). Triton's interpreter on CPU, CUDA when
present."""

import math

import pytest
import torch

from bert_fast.ops import graph_inputs
from bert_fast.ops.graph_inputs import STATS, guard_ids, input_stats, stage_inputs
from tests.helpers import DEVICE, needs_kernels


def expected(inputs, buffers_shape, length_dtype, *, full_length, clamp, id_limits=None):
    """Buffers filled with PyTorch ops as the kernel must fill them, and their input_stats (of
    the ids given, before ``id_limits`` guard them)."""
    ids, segments, lengths = inputs
    batch, seqlen = ids.shape
    padded_batch, padded_seqlen = buffers_shape
    id_buffer = ids.new_zeros(buffers_shape)
    segment_buffer = torch.zeros(buffers_shape, dtype=(ids if segments is None else segments).dtype, device=ids.device)
    id_buffer[:batch, :seqlen] = ids
    if segments is not None:
        segment_buffer[:batch, :seqlen] = segments
    if lengths is None or lengths.dim() == 1:
        length_buffer = torch.zeros(padded_batch, dtype=length_dtype, device=ids.device)
        region = length_buffer[:batch]
    else:
        length_buffer = torch.zeros(buffers_shape, dtype=length_dtype, device=ids.device)
        region = length_buffer[:batch, :seqlen]
    if lengths is None:
        region.fill_(full_length)
    else:
        region.copy_(lengths)
        if clamp:
            region.clamp_(max=seqlen)
    buffers = (id_buffer, segment_buffer, length_buffer)
    stats = input_stats(buffers, batch, seqlen, has_segments=segments is not None, has_lengths=lengths is not None)
    if id_limits is not None:
        guard_ids(buffers, batch, seqlen, id_limits)
    return buffers, stats


def length_case(case, batch, seqlen, device):
    """valid_lens of one form: None, 1-D or 2-D, integer or float, with NaN, negative values
    and values above L where the form allows them."""
    values = [seqlen + 3, 0, -1.5, 2.5, float("nan"), seqlen, 1]
    row = [values[i % len(values)] for i in range(batch)]
    if case == "none":
        return None
    if case == "int64":
        return torch.tensor([int(v) if not math.isnan(v) else 2 for v in row], device=device)
    if case == "int32_noncontiguous":
        return torch.tensor([[int(v) if not math.isnan(v) else 2, 9] for v in row], dtype=torch.int32,
                            device=device)[:, 0]
    if case == "float32":
        return torch.tensor(row, dtype=torch.float32, device=device)
    if case == "float16":
        return torch.tensor(row, dtype=torch.float32, device=device).half()
    if case == "float64":
        return torch.tensor(row, dtype=torch.float64, device=device) + 0.25
    if case == "2d_float":
        grid = torch.arange(batch * seqlen, dtype=torch.float32, device=device).reshape(batch, seqlen) % 7 - 2
        grid[0, 0] = float("nan")
        return grid
    if case == "2d_int64_transposed":
        return (torch.arange(batch * seqlen, device=device).reshape(seqlen, batch) % 5 - 1).t()
    raise ValueError(case)


def buffer_dtype(lengths):
    if lengths is None:
        return torch.int64
    return torch.float32 if lengths.dtype in (torch.float16, torch.bfloat16) else lengths.dtype


@needs_kernels
@pytest.mark.parametrize("lengths_case", ["none", "int64", "int32_noncontiguous", "float32", "float16", "float64",
                                          "2d_float", "2d_int64_transposed"])
@pytest.mark.parametrize("shape, buffers_shape", [((3, 5), (4, 16)), ((1, 16), (1, 16)), ((5, 19), (8, 32))])
@pytest.mark.parametrize("clamp", [True, False])
def test_stage_inputs_matches_torch(lengths_case, shape, buffers_shape, clamp, monkeypatch):
    # A 2 x 8 tile: the small cases walk several row and column tiles.
    monkeypatch.setattr(graph_inputs, "BLOCK_B", 2)
    monkeypatch.setattr(graph_inputs, "BLOCK_L", 8)
    torch.manual_seed(0)
    batch, seqlen = shape
    ids = torch.randint(-2, 50, (seqlen, batch), device=DEVICE).t()          # non-contiguous, out-of-range ids
    segments = torch.randint(0, 3, shape, dtype=torch.int32, device=DEVICE) if lengths_case != "none" else None
    lengths = length_case(lengths_case, batch, seqlen, DEVICE)
    if lengths is not None and lengths.dim() == 2:
        lengths_shape = buffers_shape
    else:
        lengths_shape = buffers_shape[:1]
    length_dtype = buffer_dtype(lengths)
    buffers = (torch.full(buffers_shape, 7, dtype=ids.dtype, device=DEVICE),       # stale values to overwrite
               torch.full(buffers_shape, 7, dtype=(ids if segments is None else segments).dtype, device=DEVICE),
               torch.full(lengths_shape, 7, dtype=length_dtype, device=DEVICE))
    stats = torch.full((len(STATS),), -5, dtype=torch.int64, device=DEVICE)
    inputs = (ids, segments, lengths)
    # Half the cases guard the ids (token table of 40 rows, 2 segments): ids -2..49 and
    # segments 0..2 fall on both sides.
    id_limits = (40, 2) if clamp else None
    out = stage_inputs(inputs, buffers, stats, full_length=seqlen, clamp=clamp, id_limits=id_limits)
    want_buffers, want_stats = expected(inputs, buffers_shape, length_dtype, full_length=seqlen, clamp=clamp,
                                        id_limits=id_limits)
    assert out is stats
    for name, got, want in zip(("ids", "segments", "lengths"), buffers, want_buffers):
        assert got.dtype == want.dtype
        assert torch.equal(got.isnan(), want.isnan()) if got.is_floating_point() else True, name
        assert torch.equal(torch.nan_to_num(got, nan=-99.0), torch.nan_to_num(want, nan=-99.0)), name
    assert dict(zip(STATS, stats.tolist())) == dict(zip(STATS, want_stats.tolist()))


def test_guard_ids_clamps_ids_into_the_tables():
    """guard_ids on values worked out by hand: only the (batch, seqlen) corner is touched."""
    ids = torch.tensor([[4, -1, 10], [9, 3, 12]])
    segments = torch.tensor([[0, 2, 1], [-3, 1, 5]], dtype=torch.int32)
    guard_ids((ids, segments, None), 1, 3, (10, 2))
    assert ids.tolist() == [[4, 0, 9], [9, 3, 12]]
    assert segments.tolist() == [[0, 1, 1], [-3, 1, 5]]


def test_input_stats_counts():
    """input_stats itself, on values worked out by hand."""
    ids = torch.tensor([[4, 9, 0], [2, 0, 0]])
    segments = torch.tensor([[0, 1, 1], [1, 0, 0]])
    lengths = torch.tensor([2.5, float("nan"), 0.0])           # row 2 is padding (batch 2)
    stats = input_stats((ids, segments, lengths), 2, 3, has_segments=True, has_lengths=True)
    assert dict(zip(STATS, stats.tolist())) == dict(token_min=0, token_max=9, segment_min=0, segment_max=1,
                                                    nan_lengths=1, valid_tokens=3, keyless=1)
    stats = input_stats((ids, segments, lengths), 2, 2, has_segments=False, has_lengths=False)
    assert dict(zip(STATS, stats.tolist())) == dict(token_min=0, token_max=9, segment_min=0, segment_max=0,
                                                    nan_lengths=0, valid_tokens=4, keyless=0)


@needs_kernels
@pytest.mark.parametrize("mask_case", ["none", "int64", "bool", "float32_transposed"])
@pytest.mark.parametrize("shape, buffers_shape", [((3, 5), (4, 16)), ((5, 19), (8, 32))])
def test_stage_inputs_takes_attention_masks(mask_case, shape, buffers_shape, monkeypatch):
    """A bool lengths buffer: an HF attention mask (nonzero = attend), rows that attend to
    nothing counted as keyless, None as every real token attended."""
    monkeypatch.setattr(graph_inputs, "BLOCK_B", 2)
    monkeypatch.setattr(graph_inputs, "BLOCK_L", 8)
    torch.manual_seed(0)
    batch, seqlen = shape
    ids = torch.randint(0, 50, shape, device=DEVICE)
    segments = torch.randint(0, 2, shape, device=DEVICE)
    if mask_case == "none":
        mask = None
    else:
        mask = (torch.rand(shape, device=DEVICE) < 0.6).long()
        mask[1] = 0                                          # a row that attends to nothing
        if mask_case == "bool":
            mask = mask.bool()
        elif mask_case == "float32_transposed":
            mask = (mask.float() * 0.5).t().contiguous().t()
    buffers = (torch.full(buffers_shape, 7, device=DEVICE), torch.full(buffers_shape, 7, device=DEVICE),
               torch.ones(buffers_shape, dtype=torch.bool, device=DEVICE))
    stats = torch.zeros(len(STATS), dtype=torch.int64, device=DEVICE)
    stage_inputs((ids, segments, mask), buffers, stats, full_length=0, clamp=False)

    want_mask = torch.zeros(buffers_shape, dtype=torch.bool, device=DEVICE)
    want_mask[:batch, :seqlen] = True if mask is None else mask != 0
    assert torch.equal(buffers[2], want_mask)
    assert torch.equal(buffers[0][:batch, :seqlen], ids) and int(buffers[0].sum()) == int(ids.sum())
    want = input_stats((buffers[0], buffers[1], want_mask), batch, seqlen, has_segments=True,
                       has_lengths=mask is not None)
    got = dict(zip(STATS, stats.tolist()))
    assert got == dict(zip(STATS, want.tolist()))
    assert got["valid_tokens"] == (batch * seqlen if mask is None else int((mask != 0).sum()))
    assert got["keyless"] == (0 if mask is None else int((~(mask != 0).any(dim=1)).sum()))
