"""stage_inputs: a call's inputs into a CUDA graph's static buffers, with what the host must know.

Before each replay of an automatic graph (bert_fast.cuda_graph) the call's tokens, segments
and valid_lens are written into the graph's static (B_b, L_b) buffers, zero-padded, and the
host may have to read a few facts about them: whether the ids are in range (``check_inputs``),
how many tokens are valid (skip_padding picks its graph by that count), whether some row sees
no key (then an exact call keeps its L). Done with PyTorch ops that is 3-4 copies plus up to
12 small ops and a host read per fact read (two with check_inputs and skip_padding): on a GPU
host each op is a kernel launch, and on the H200 of 2026-11-26
(benchmarks/results/nvidia-h200-2026-11-26-*) the automatic graph's call took 0.45 ms more
than the bare replay at B1 L128, mostly such host work.

On CUDA with Triton it is one kernel: a single program walks the (B_b, L_b) buffers in
BLOCK_B x BLOCK_L tiles, writes every element (the inputs where they are, zeros around them,
None segments as zeros, None lengths as ``full_length`` for the real rows), and reduces the
facts into one int64 vector, ``STATS``, that the host reads with one sync when it needs any
of them, or never. One program: the buffers hold at most a few hundred thousand ids, a few
microseconds of one SM (an estimate: not timed on a GPU yet), and no second launch to combine
partial results. Elsewhere (the CPU, the stubbed graphs of the tests, CUDA without Triton, a
device where the kernel failed) ``input_stats`` computes the same vector with PyTorch ops
from buffers the caller filled.

Lengths follow the attention's rule: key j is visible iff float32(j) < valid_len, compared
in the promoted dtype of float32 and the lengths' (float64 lengths in float64, integers and
fp16/bf16 in float32). fp16/bf16 lengths are stored in a float32 buffer (exact; clamping at L
in fp16/bf16 could round L). With ``clamp`` lengths above L become L, so padded keys stay
masked (NaN stays NaN).
"""

import warnings

import torch

from ._triton import as_dtype, cpu_kernel, HAS_TRITON, launch, tl, triton

# What the stats vector holds, in order: the smallest and largest token id and segment id of
# the call (its (B, L) inputs, not the padding), the number of NaN lengths, the number of valid
# tokens (1-D lengths only; 0 otherwise), and the number of rows (1-D lengths) or query
# positions (2-D) whose length is not > 0 (they see no key). With an attention mask (a bool
# buffer: Hugging Face models) the valid tokens are the attended positions and the keyless
# count is of rows that attend to none.
STATS = ("token_min", "token_max", "segment_min", "segment_max", "nan_lengths", "valid_tokens", "keyless")
BLOCK_B, BLOCK_L = 16, 128       # the tile a loop step handles


# The sizes are not specialised on (Triton would compile a variant for a size of 1 and for
# multiples of 16), nor is the tile: the kernel compiles once per kind of input (dtypes, which
# inputs are None, 1-D or 2-D lengths, clamping), not per graph bucket.
@triton.jit(do_not_specialize=["batch", "seqlen", "padded_batch", "padded_seqlen", "full_length", "id_limit",
                               "segment_limit"])
def _stage_inputs_kernel(ids, ids_stride_b, ids_stride_l, segments, segments_stride_b, segments_stride_l,
                         lengths, lengths_stride_b, lengths_stride_l,
                         id_buffer, segment_buffer, length_buffer, stats,
                         batch, seqlen, padded_batch, padded_seqlen, full_length, id_limit, segment_limit,
                         HAS_SEGMENTS: tl.constexpr, LENGTHS: tl.constexpr, MASK: tl.constexpr,
                         CLAMP: tl.constexpr, GUARD_IDS: tl.constexpr, BLOCK_B: tl.constexpr,
                         BLOCK_L: tl.constexpr):
    # LENGTHS: 0 none (full_length for the real rows), 1 one per row, 2 one per query; MASK: the
    # lengths are an attention mask (B, L) and the buffer bool (nonzero = attend; none: all).
    # GUARD_IDS: ids are written clamped into [0, id_limit), segments into [0, segment_limit)
    # (the stats keep the given ones).
    big = tl.full((), 9223372036854775807, tl.int64)      # int64's largest
    token_min, token_max = big, -big
    segment_min, segment_max = big, -big
    nan_lengths = tl.zeros((), tl.int64)
    valid_tokens = tl.zeros((), tl.int64)
    keyless = tl.zeros((), tl.int64)
    length_type = length_buffer.dtype.element_ty
    for row0 in range(0, padded_batch, BLOCK_B):
        rows = row0 + tl.arange(0, BLOCK_B)
        real_row = rows < batch
        buffer_row = rows < padded_batch
        if MASK:
            row_attended = tl.zeros((BLOCK_B,), tl.int32)
        elif LENGTHS == 1:
            row_length = tl.load(lengths + rows * lengths_stride_b, mask=real_row, other=0).to(length_type)
            if CLAMP:
                row_length = tl.where(row_length > seqlen, seqlen, row_length)
            tl.store(length_buffer + rows, row_length, mask=buffer_row)
            nan_lengths += tl.sum((real_row & (row_length != row_length)).to(tl.int64))
            keyless += tl.sum((real_row & ~(row_length > 0)).to(tl.int64))
        elif LENGTHS == 0:
            tl.store(length_buffer + rows, tl.where(real_row, full_length, 0).to(length_type), mask=buffer_row)
        for col0 in range(0, padded_seqlen, BLOCK_L):
            cols = col0 + tl.arange(0, BLOCK_L)
            real = real_row[:, None] & (cols < seqlen)[None, :]
            in_buffer = buffer_row[:, None] & (cols < padded_seqlen)[None, :]
            slots = rows[:, None] * padded_seqlen + cols[None, :]
            token = tl.load(ids + rows[:, None] * ids_stride_b + cols[None, :] * ids_stride_l, mask=real, other=0)
            if GUARD_IDS:
                tl.store(id_buffer + slots, tl.minimum(tl.maximum(token, 0), id_limit - 1), mask=in_buffer)
            else:
                tl.store(id_buffer + slots, token, mask=in_buffer)
            token = token.to(tl.int64)
            token_min = tl.minimum(token_min, tl.min(tl.where(real, token, big)))
            token_max = tl.maximum(token_max, tl.max(tl.where(real, token, -big)))
            if HAS_SEGMENTS:
                segment = tl.load(segments + rows[:, None] * segments_stride_b + cols[None, :] * segments_stride_l,
                                  mask=real, other=0)
                if GUARD_IDS:
                    tl.store(segment_buffer + slots, tl.minimum(tl.maximum(segment, 0), segment_limit - 1),
                             mask=in_buffer)
                else:
                    tl.store(segment_buffer + slots, segment, mask=in_buffer)
                segment = segment.to(tl.int64)
                segment_min = tl.minimum(segment_min, tl.min(tl.where(real, segment, big)))
                segment_max = tl.maximum(segment_max, tl.max(tl.where(real, segment, -big)))
            else:
                tl.store(segment_buffer + slots, tl.zeros((BLOCK_B, BLOCK_L), segment_buffer.dtype.element_ty),
                         mask=in_buffer)
            if MASK:
                attend = real
                if LENGTHS == 2:
                    attend = attend & (tl.load(lengths + rows[:, None] * lengths_stride_b
                                               + cols[None, :] * lengths_stride_l, mask=real, other=0) != 0)
                tl.store(length_buffer + slots, attend, mask=in_buffer)
                valid_tokens += tl.sum(attend.to(tl.int64))
                row_attended += tl.sum(attend.to(tl.int32), axis=1)
            elif LENGTHS == 0:
                valid_tokens += tl.sum(real.to(tl.int64))
            elif LENGTHS == 1:
                visible = cols.to(tl.float32)[None, :] < row_length[:, None]
                valid_tokens += tl.sum((real & visible).to(tl.int64))
            elif LENGTHS == 2:
                length = tl.load(lengths + rows[:, None] * lengths_stride_b + cols[None, :] * lengths_stride_l,
                                 mask=real, other=0).to(length_type)
                if CLAMP:
                    length = tl.where(length > seqlen, seqlen, length)
                tl.store(length_buffer + slots, length, mask=in_buffer)
                nan_lengths += tl.sum((real & (length != length)).to(tl.int64))
                keyless += tl.sum((real & ~(length > 0)).to(tl.int64))
        if MASK:
            keyless += tl.sum((real_row & (row_attended == 0)).to(tl.int64))
    if not HAS_SEGMENTS:
        segment_min, segment_max = tl.zeros((), tl.int64), tl.zeros((), tl.int64)
    tl.store(stats + 0, token_min)
    tl.store(stats + 1, token_max)
    tl.store(stats + 2, segment_min)
    tl.store(stats + 3, segment_max)
    tl.store(stats + 4, nan_lengths)
    tl.store(stats + 5, valid_tokens)
    tl.store(stats + 6, keyless)


# Devices where the kernel failed to launch (e.g. a GPU that this Triton cannot compile for):
# their calls stage with PyTorch ops from then on.
_FAILED_DEVICES = set()


def uses_kernel(ids):
    """Whether stage_inputs can run for these inputs (CUDA with Triton; CPU tensors only where
    the launchers take them: the interpreter tests, the host benchmark's GPU path)."""
    return HAS_TRITON and not cpu_kernel(ids) and (not _FAILED_DEVICES or ids.device not in _FAILED_DEVICES)


def kernel_failed(device, error):
    """Stage with PyTorch ops on ``device`` from now on, with one warning saying why."""
    _FAILED_DEVICES.add(device)
    warnings.warn(f"bert_fast: the CUDA-graph input staging kernel failed on {device} ({type(error).__name__}: "
                  f"{str(error).strip().splitlines()[0] if str(error).strip() else ''}); staging with PyTorch ops "
                  f"there instead (a few more launches per graph replay)", RuntimeWarning, stacklevel=2)


def _strides(t):
    return (t.stride(0), t.stride(1) if t.dim() == 2 else 0)


def stage_inputs(inputs, buffers, stats, *, full_length, clamp, id_limits=None):
    """Write ``inputs`` (ids (B, L), segments (B, L) or None, lengths None, (B,) or (B, L))
    into ``buffers`` (ids and segments (B_b, L_b), lengths (B_b,) or (B_b, L_b), contiguous,
    B_b >= B, L_b >= L), and the STATS of the call into ``stats`` (7 int64): one launch. A bool
    lengths buffer (B_b, L_b) takes an attention mask (nonzero = attend; None: every token).
    ``id_limits`` (the token and segment tables' rows): ids are written clamped into them, so a
    replay that runs before the host has read the stats reads no table out of range."""
    ids, segments, lengths = inputs
    id_buffer, segment_buffer, length_buffer = buffers
    batch, seqlen = ids.shape
    padded_batch, padded_seqlen = id_buffer.shape
    mode = 0 if lengths is None else lengths.dim()
    launch(_stage_inputs_kernel, ids)[(1,)](
        ids, *_strides(ids),
        ids if segments is None else segments, *_strides(ids if segments is None else segments),
        ids if lengths is None else lengths, *(_strides(lengths) if lengths is not None else (0, 0)),
        id_buffer, segment_buffer, length_buffer, stats,
        batch, seqlen, padded_batch, padded_seqlen, int(full_length),    # (an HF mask's default is True)
        *(id_limits or (0, 0)),
        HAS_SEGMENTS=segments is not None, LENGTHS=mode, MASK=length_buffer.dtype == torch.bool, CLAMP=bool(clamp),
        GUARD_IDS=id_limits is not None, BLOCK_B=BLOCK_B, BLOCK_L=BLOCK_L, num_warps=8)
    return stats


def input_stats(buffers, batch, seqlen, *, has_segments, has_lengths, values=True, tokens=True, keyless=True):
    """The STATS of a call whose inputs fill the top-left (batch, seqlen) corner of ``buffers``,
    with PyTorch ops (what the kernel computes, for the other devices): the id ranges and the
    NaN count if ``values``, the valid-token count if ``tokens``, the keyless count if
    ``keyless``; zeros for the rest."""
    id_buffer, segment_buffer, length_buffer = buffers
    zero = id_buffer.new_zeros((), dtype=torch.int64)
    stats = [zero] * len(STATS)
    region = None
    if has_lengths:
        region = length_buffer[:batch] if length_buffer.dim() == 1 else length_buffer[:batch, :seqlen]
    if values:
        stats[0:2] = torch.aminmax(id_buffer[:batch, :seqlen])
        if has_segments:
            stats[2:4] = torch.aminmax(segment_buffer[:batch, :seqlen])
        if region is not None and region.is_floating_point():
            stats[4] = region.isnan().sum()
    if region is not None and region.dtype == torch.bool:      # an attention mask
        if tokens:
            stats[5] = region.sum()
        if keyless:
            stats[6] = (~region.any(dim=1)).sum()
        return torch.stack([as_dtype(s, torch.int64) for s in stats])
    if tokens:
        if region is None:
            stats[5] = id_buffer.new_full((), batch * seqlen, dtype=torch.int64)
        elif region.dim() == 1:
            positions = torch.arange(seqlen, dtype=torch.float32, device=region.device)
            stats[5] = (positions < region[:, None]).sum()
    if keyless and region is not None:
        stats[6] = (~(region > 0)).sum()
    return torch.stack([as_dtype(s, torch.int64) for s in stats])


def guard_ids(buffers, batch, seqlen, id_limits):
    """What stage_inputs' ``id_limits`` does, with PyTorch ops on buffers the caller filled
    (after input_stats read them): ids clamped into the tables' rows."""
    for buffer, limit in zip(buffers[:2], id_limits):
        buffer[:batch, :seqlen].clamp_(0, limit - 1)
