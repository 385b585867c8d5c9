"""embedding_sum: token + segment + position embeddings in one call.

Padded form: ``tokens``/``segments`` are (B, L) and position j of every row reads
``pos_weight[0, j]``. Unpadded form (skip_padding): ``tokens``/``segments`` are (N,) packed
valid tokens and ``positions`` (N,) says which row of the position table each one reads.
Tables: ``token_weight`` (V, H), ``segment_weight`` (S, H) (S = 2 in BERT), ``pos_weight``
(1, max_len, H), one dtype; ids int32 or int64. The output is (..., H) in the tables' dtype,
summed in fp32. The module range-checks ids once per batch (check_inputs); below it, an id
outside its table is never read as an index counted from the end nor dereferenced (see
embedding_sum's docstring for what each backend does with one).

Cost model (R = B*L or N rows, e = bytes per element, i = bytes per id; memory-bound,
3 adds per element):
  forward   reads R ids of each kind (3 R i), R token rows (R H e: the one HBM stream that
            matters), segment and position rows (S + L distinct rows, served from L2), writes
            R H e  ->  ~2 R H e bytes.  BERT-base at R = 64K, fp16: ~200 MB, ~70 us at 3 TB/s.
  backward  (default) reads grad_out once (R H e) and adds it into fp32 buffers with atomics:
            R H atomics for the token table (plus R H for the position table in the unpadded
            form when learnable), R H / BLOCK_T for the segment table (rows are summed per
            segment inside the tile first: all R rows hit the same 2 table rows, and unreduced
            atomics on 2 H addresses would serialise). Plus zeroing the V H fp32 buffer and one
            cast pass: V H (8 + e) bytes, ~235 MB at V = 30522, H = 768, fp16 -- more than
            grad_out itself (100 MB at R = 64K): the atomic path's real price.
            The padded position gradient (learnable only) is a batch sum, no atomics: a second
            read of grad_out by a kernel that owns each position row.
  backward  (deterministic=True) per scattered table: torch.sort of the R ids (stable), then a
            pass that reads grad_out rows in sorted order (R H e, gathered) and writes each
            used table row once, plus 2 (R / 16) H fp32 run carries written and re-read.
            The token and segment tables (and unpadded positions) each read grad_out once:
            2-3 R H e in all, no atomics, no fp32 table buffer (zeroing V H e remains).

Triton layout: the forward gives each program BLOCK_T rows as one (BLOCK_T, BLOCK_H) tile,
BLOCK_H = next power of two >= H with the tail masked (~4096 elements per tile). The atomic
backward tiles H as well (BLOCK_H <= 256), so a tile holds more rows and each segment atomic
carries the sum of more of them.

Deterministic reduction (a table gradient with no atomics, bitwise repeatable on one device):
``order`` = stable sort of the ids, so rows with equal ids form runs whose inner order is fixed
(original row order). The sorted rows are cut into chunks of BLOCK_T = 16. Pass 1, a program
per (chunk, H block): the slots of a chunk holding one id are a contiguous piece of that id's
run, and each piece is summed as "the chunk's rows with my id" (a (BLOCK_T, BLOCK_T, BLOCK_H)
select-and-sum: exact, unlike differences of a prefix sum, and T adds per element are free in
a memory-bound kernel). A run that starts and ends in the chunk is stored straight into its
table row (one writer per row). The piece of the run that enters the chunk from an earlier one
goes to ``heads[chunk]``; the piece of the run that leaves it goes to ``tails[chunk]``. Pass 2,
a program per chunk: if the run leaving the chunk also started in it, this program owns that
run and stores ``tails[chunk] + heads[chunk+1] + ... + heads[last chunk of the run]`` (the
run's end comes from ``torch.searchsorted`` on the sorted ids; the heads are summed BLOCK_C at
a time, in chunk order). Every table row has one writer and every sum has an order fixed by
the block sizes (a function of H only, never autotuned), so two calls give the same bits. A
run of any length costs pass 2 only (length / BLOCK_T / BLOCK_C) loop steps, e.g. 128 for the
32K padding tokens of a half-padded 64K-token batch.
"""

import torch
from torch.library import triton_op
from torch.nn import functional as F

from .. import extension
from ..extension import require_extension
from ._autograd import (below_autograd, deferred_ops, forbid_double_backward, once_differentiable, records_grad,
                        thin_apply, use_registered_op)
from ._triton import (KERNEL_DTYPES, as_dtype, cdiv, compute_dtype, cpu_kernel, launch, next_power_of_2,
                      nothing_to_launch, require_triton, tl, triton, uses_triton, values_on_host)

INDEX_DTYPES = (torch.int32, torch.int64)


def _check_id_range(name, ids, n_rows):
    """IndexError naming the first id of ``ids`` outside [0, n_rows) (CPU ids)."""
    if ids.numel() == 0:
        return
    flat = ids.reshape(-1)
    low, high = torch.aminmax(flat)
    if low.item() < 0 or high.item() >= n_rows:     # .item(): ~3 us less than comparing tensors
        at = int(((flat < 0) | (flat >= n_rows)).nonzero()[0])
        raise IndexError(f"{name} id {int(flat[at])} at flat index {at} is out of range: the table "
                         f"has {n_rows} rows, so ids must be in [0, {n_rows})")


def _check_id_ranges(tokens, segments, positions, n_tokens, n_segments, max_len):
    """The CPU paths' range check (the C++ CPU op's message): ids are on the host, so a bad id
    is reported, never wrapped (a negative id is not a row counted from the end).

    Returns whether the ids were checked. They are not while torch.compile traces (a registered
    op's CPU implementation is traced too): the caller then guards its lookups and scatters."""
    if not values_on_host(tokens, segments, positions):
        return False
    _check_id_range("tokens", tokens, n_tokens)
    _check_id_range("segments", segments, n_segments)
    if positions is not None:
        _check_id_range("positions", positions, max_len)
    return True


def _guarded_lookup(ids, table, padding_idx=None):
    """``F.embedding(ids, table, padding_idx)`` where an id outside [0, rows) gives a zero row
    and no gradient: the Triton kernels' guard, written so Inductor can see every address is in
    range. Compiled, a plain lookup of such an id is Inductor's problem: torch 2.13 asserts (an
    abort on CUDA), torch 2.11 reads outside the table unchecked."""
    rows = table.shape[0]
    # Contiguous ids: the result then has F.embedding's layout (where() follows its inputs').
    ids = ids.contiguous()
    inside = ((ids >= 0) & (ids < rows)).unsqueeze(-1)
    return torch.where(inside, F.embedding(ids.clamp(0, rows - 1), table, padding_idx), 0)


def _positions(tokens, positions, pos_table):
    """The position ids of a compiled lookup: ``positions``, or 0..L-1 (read through
    _guarded_lookup, not sliced: AOTInductor runs a program without its shape guards by default,
    and a slice of a sequence longer than max_len read past the table, a crash)."""
    if positions is not None:
        return positions
    seqlen = tokens.shape[-1]
    # (No message: Dynamo cannot trace a message closure over a dynamic length.)
    torch._check(seqlen <= pos_table.shape[0])
    return torch.arange(seqlen, device=tokens.device)


def _guarded_index_add(grad_rows, ids, n_rows):
    """``zeros(n_rows, H).index_add_(0, ids, grad_rows)`` where the rows of ids outside
    [0, n_rows) add nothing (the Triton backward's guard; Inductor on torch 2.11 would write
    outside the buffer)."""
    ids = ids.reshape(-1)
    inside = ((ids >= 0) & (ids < n_rows)).unsqueeze(-1)
    return grad_rows.new_zeros(n_rows, grad_rows.shape[-1]).index_add_(
        0, ids.clamp(0, n_rows - 1), torch.where(inside, grad_rows, 0))


def _embedding_sum_torch(tokens, segments, token_weight, segment_weight, pos_weight, positions,
                         learn_pos_embedding):
    _check_id_ranges(tokens, segments, positions, token_weight.shape[0], segment_weight.shape[0],
                     pos_weight.shape[1])
    # The reference reads the position table through .data, so by default no gradient
    # reaches it; learn_pos_embedding=True is the explicit opt-in.
    pos_table = pos_weight[0] if learn_pos_embedding else pos_weight.detach()[0]
    if torch.compiler.is_compiling():
        # Ids are not readable while tracing (eager CPU calls raise above); the graph guards.
        # Fused by Inductor into the gathers: no extra pass.
        out = _guarded_lookup(tokens, token_weight) + _guarded_lookup(segments, segment_weight)
        return out + _guarded_lookup(_positions(tokens, positions, pos_table), pos_table)
    pos = pos_table[: tokens.shape[-1]] if positions is None else F.embedding(positions, pos_table)
    # Accumulate in place: the embedding lookups' backward does not need their outputs,
    # so this saves two full-size temporaries without touching autograd.
    out = F.embedding(tokens, token_weight)
    out.add_(F.embedding(segments, segment_weight))
    out.add_(pos)
    return out


@triton.jit
def _embedding_rows(rows, cols, token_ids_ptr, segment_ids_ptr, position_ids_ptr,
                    token_weight_ptr, segment_weight_ptr, pos_weight_ptr,
                    n_rows, seq_len, hidden, n_tokens, n_segments, max_len,
                    token_row_stride, token_col_stride, segment_row_stride,
                    segment_col_stride, pos_row_stride, pos_col_stride,
                    HAS_POSITIONS: tl.constexpr):
    """The (rows, cols) tile of token + segment + position rows, summed in fp32 (zeros outside
    the tile). Shared by this op's forward and embedding_layernorm's, which normalises the tile."""
    row_in = rows < n_rows
    mask = row_in[:, None] & (cols < hidden)[None, :]
    token_ids = tl.load(token_ids_ptr + rows, mask=row_in, other=0).to(tl.int64)
    segment_ids = tl.load(segment_ids_ptr + rows, mask=row_in, other=0).to(tl.int64)
    if HAS_POSITIONS:
        position_ids = tl.load(position_ids_ptr + rows, mask=row_in, other=0).to(tl.int64)
    else:
        position_ids = (rows % seq_len).to(tl.int64)
    # Ids out of [0, rows of the table) are never dereferenced: that table adds zeros to the
    # row (masked load, and the address itself is made row 0's so no pointer leaves the table).
    token_in = (token_ids >= 0) & (token_ids < n_tokens)
    segment_in = (segment_ids >= 0) & (segment_ids < n_segments)
    position_in = (position_ids >= 0) & (position_ids < max_len)
    token_ids = tl.where(token_in, token_ids, 0)
    segment_ids = tl.where(segment_in, segment_ids, 0)
    position_ids = tl.where(position_in, position_ids, 0)
    acc = tl.load(token_weight_ptr + token_ids[:, None] * token_row_stride
                  + cols[None, :] * token_col_stride, mask=mask & token_in[:, None],
                  other=0.0).to(tl.float32)
    acc += tl.load(segment_weight_ptr + segment_ids[:, None] * segment_row_stride
                   + cols[None, :] * segment_col_stride, mask=mask & segment_in[:, None],
                   other=0.0).to(tl.float32)
    acc += tl.load(pos_weight_ptr + position_ids[:, None] * pos_row_stride
                   + cols[None, :] * pos_col_stride, mask=mask & position_in[:, None],
                   other=0.0).to(tl.float32)
    return acc


@triton.jit
def _embedding_sum_fwd_kernel(out_ptr, token_ids_ptr, segment_ids_ptr, position_ids_ptr,
                              token_weight_ptr, segment_weight_ptr, pos_weight_ptr,
                              n_rows, seq_len, hidden, n_tokens, n_segments, max_len,
                              token_row_stride, token_col_stride, segment_row_stride,
                              segment_col_stride, pos_row_stride, pos_col_stride,
                              HAS_POSITIONS: tl.constexpr, BLOCK_T: tl.constexpr,
                              BLOCK_H: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.arange(0, BLOCK_H)
    acc = _embedding_rows(rows, cols, token_ids_ptr, segment_ids_ptr, position_ids_ptr,
                          token_weight_ptr, segment_weight_ptr, pos_weight_ptr,
                          n_rows, seq_len, hidden, n_tokens, n_segments, max_len,
                          token_row_stride, token_col_stride, segment_row_stride,
                          segment_col_stride, pos_row_stride, pos_col_stride, HAS_POSITIONS)
    mask = (rows < n_rows)[:, None] & (cols < hidden)[None, :]
    tl.store(out_ptr + rows.to(tl.int64)[:, None] * hidden + cols[None, :],
             acc.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _embedding_sum_bwd_kernel(grad_ptr, token_ids_ptr, segment_ids_ptr, position_ids_ptr,
                              token_grad_ptr, segment_grad_ptr, pos_grad_ptr,
                              n_rows, hidden, n_tokens, n_segments, max_len, grad_row_stride,
                              grad_col_stride, SCATTER_POSITIONS: tl.constexpr, BLOCK_T: tl.constexpr,
                              BLOCK_H: tl.constexpr):
    """Atomic scatter-add of grad rows into fp32 (rows, H) table buffers. A row whose id is out
    of [0, rows of that table) adds nothing to that table (no atomic leaves the buffer)."""
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    row_in = rows < n_rows
    col_in = cols < hidden
    mask = row_in[:, None] & col_in[None, :]
    grad = tl.load(grad_ptr + rows.to(tl.int64)[:, None] * grad_row_stride
                   + cols[None, :] * grad_col_stride, mask=mask, other=0.0).to(tl.float32)
    token_ids = tl.load(token_ids_ptr + rows, mask=row_in, other=0).to(tl.int64)
    token_in = (token_ids >= 0) & (token_ids < n_tokens)
    tl.atomic_add(token_grad_ptr + tl.where(token_in, token_ids, 0)[:, None] * hidden + cols[None, :],
                  grad, mask=mask & token_in[:, None], sem="relaxed")
    # Only ids 0 .. n_segments - 1 match a segment below: others add nothing.
    segment_ids = tl.load(segment_ids_ptr + rows, mask=row_in, other=-1)
    for segment in range(n_segments):
        piece = tl.sum(tl.where((segment_ids == segment)[:, None], grad, 0.0), axis=0)
        tl.atomic_add(segment_grad_ptr + segment * hidden + cols, piece, mask=col_in, sem="relaxed")
    if SCATTER_POSITIONS:
        position_ids = tl.load(position_ids_ptr + rows, mask=row_in, other=0).to(tl.int64)
        position_in = (position_ids >= 0) & (position_ids < max_len)
        tl.atomic_add(pos_grad_ptr + tl.where(position_in, position_ids, 0)[:, None] * hidden
                      + cols[None, :], grad, mask=mask & position_in[:, None], sem="relaxed")


@triton.jit
def _embedding_sum_bwd_pos_kernel(grad_ptr, pos_grad_ptr, batch, seq_len, hidden,
                                  grad_batch_stride, grad_row_stride, grad_col_stride,
                                  BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr):
    """Padded form: pos_grad[j] = sum over the batch of grad[b, j], one owner per row."""
    positions = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    mask = (positions < seq_len)[:, None] & (cols < hidden)[None, :]
    grad_ptrs = grad_ptr + positions[:, None] * grad_row_stride + cols[None, :] * grad_col_stride
    acc = tl.zeros([BLOCK_T, BLOCK_H], dtype=tl.float32)
    for _ in range(batch):
        acc += tl.load(grad_ptrs, mask=mask, other=0.0).to(tl.float32)
        grad_ptrs += grad_batch_stride
    tl.store(pos_grad_ptr + positions[:, None] * hidden + cols[None, :],
             acc.to(pos_grad_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _embedding_sum_bwd_chunk_kernel(grad_ptr, sorted_ids_ptr, order_ptr, table_grad_ptr,
                                    heads_ptr, tails_ptr, n_rows, hidden, n_table_rows,
                                    grad_row_stride, grad_col_stride,
                                    BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr):
    """Deterministic pass 1 over one chunk of BLOCK_T sorted rows (see the module docstring)."""
    chunk = tl.program_id(0)
    chunk_start = chunk * BLOCK_T
    slots = chunk_start + tl.arange(0, BLOCK_T)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    slot_in = slots < n_rows
    col_in = cols < hidden
    mask = slot_in[:, None] & col_in[None, :]
    # The launcher made every id >= 0 (out-of-range ids became n_table_rows, a run that is
    # summed but never stored), so -1 stands for "no row there".
    ids = tl.load(sorted_ids_ptr + slots, mask=slot_in, other=-1)
    next_ids = tl.load(sorted_ids_ptr + slots + 1, mask=slots + 1 < n_rows, other=-1)
    id_before = tl.load(sorted_ids_ptr + chunk_start - 1, mask=chunk > 0, other=-1)
    id_after = tl.load(sorted_ids_ptr + chunk_start + BLOCK_T, mask=chunk_start + BLOCK_T < n_rows,
                       other=-1)
    source_rows = tl.load(order_ptr + slots, mask=slot_in, other=0).to(tl.int64)
    grad = tl.load(grad_ptr + source_rows[:, None] * grad_row_stride
                   + cols[None, :] * grad_col_stride, mask=mask, other=0.0).to(tl.float32)
    # Sorted ids: the slots holding id k are one contiguous piece of k's run, so the piece's
    # sum is the sum over the chunk's slots with the same id (the other slots add exact zeros).
    same_piece = (ids[:, None] == ids[None, :]) & slot_in[None, :]
    sums = tl.sum(tl.where(same_piece[:, :, None], grad[None, :, :], 0.0), axis=1)
    # Store each piece once, from its last slot.
    piece_end = (mask & ((ids != next_ids) | (slots == n_rows - 1)
                         | (slots == chunk_start + BLOCK_T - 1))[:, None])
    started_here = (ids != id_before)[:, None]
    goes_on = (ids == id_after)[:, None]
    id_in = (ids >= 0) & (ids < n_table_rows)
    tl.store(table_grad_ptr + tl.where(id_in, ids, 0).to(tl.int64)[:, None] * hidden + cols[None, :],
             sums.to(table_grad_ptr.dtype.element_ty),
             mask=piece_end & started_here & ~goes_on & id_in[:, None])
    carry_offsets = tl.broadcast_to(chunk * hidden + cols[None, :], [BLOCK_T, BLOCK_H])
    tl.store(heads_ptr + carry_offsets, sums, mask=piece_end & ~started_here)
    tl.store(tails_ptr + carry_offsets, sums, mask=piece_end & started_here & goes_on)


@triton.jit
def _embedding_sum_bwd_carry_kernel(sorted_ids_ptr, run_ends_ptr, heads_ptr, tails_ptr,
                                    table_grad_ptr, hidden, n_table_rows, BLOCK_T: tl.constexpr,
                                    BLOCK_C: tl.constexpr, BLOCK_H: tl.constexpr):
    """Deterministic pass 2: the runs that cross a chunk boundary, one owner each."""
    chunk = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    col_in = cols < hidden
    chunk_end = (chunk + 1) * BLOCK_T
    run_id = tl.load(sorted_ids_ptr + chunk_end - 1)
    run_end = tl.load(run_ends_ptr + chunk)
    id_before_chunk = tl.load(sorted_ids_ptr + chunk * BLOCK_T - 1, mask=chunk > 0, other=-1)
    # The run of out-of-range ids (all mapped to n_table_rows) is never stored.
    if (run_end > chunk_end) & (id_before_chunk != run_id) & (run_id < n_table_rows):
        acc = tl.load(tails_ptr + chunk * hidden + cols, mask=col_in, other=0.0)
        last_chunk = (run_end - 1) // BLOCK_T
        for first in range(chunk + 1, last_chunk + 1, BLOCK_C):
            chunks = first + tl.arange(0, BLOCK_C)
            acc += tl.sum(tl.load(heads_ptr + chunks[:, None] * hidden + cols[None, :],
                                  mask=(chunks <= last_chunk)[:, None] & col_in[None, :],
                                  other=0.0), axis=0)
        tl.store(table_grad_ptr + run_id.to(tl.int64) * hidden + cols,
                 acc.to(table_grad_ptr.dtype.element_ty), mask=col_in)


def _fwd_blocks(hidden):
    """(BLOCK_T, BLOCK_H, num_warps): whole rows, ~4096 elements per tile (32 per thread)."""
    block_h = next_power_of_2(hidden)
    return max(1, 4096 // block_h), block_h, 4 if block_h <= 4096 else 8


def _bwd_blocks(hidden):
    """(BLOCK_T, BLOCK_H, num_warps) of the atomic and batch-sum kernels: H tiled by <= 256,
    4096 elements per tile."""
    block_h = min(next_power_of_2(hidden), 256)
    return 4096 // block_h, block_h, 4


def _chunk_blocks(hidden):
    """(BLOCK_T, BLOCK_H, num_warps) of the deterministic passes.

    The chunk kernel holds a (BLOCK_T, BLOCK_T, BLOCK_H) = 8192-element temporary (64 fp32 per
    thread at 4 warps). A function of H only: the summation order depends on it.
    """
    return 16, min(next_power_of_2(hidden), 32), 4


# Heads summed per step of the carry pass.
CARRY_BLOCK = 16


def _check_indices(tokens, segments, positions):
    for name, t in (("tokens", tokens), ("segments", segments), ("positions", positions)):
        if t is not None and t.dtype not in INDEX_DTYPES:
            raise TypeError(f"{name} must be an int32 or int64 tensor, got {t.dtype}")
    if tokens.dim() not in (1, 2):
        raise ValueError(f"tokens must be (B, L) (padded) or (N,) (packed), got shape {tuple(tokens.shape)}")
    if segments.shape != tokens.shape:
        raise ValueError(f"segments must have the shape of tokens {tuple(tokens.shape)}, got "
                         f"{tuple(segments.shape)}")
    if tokens.dim() == 1 and positions is None:
        raise ValueError("packed (1-D) tokens need positions (N,) saying which position row each reads")
    if tokens.dim() == 2 and positions is not None:
        raise ValueError("positions are only for packed (1-D) tokens; padded (B, L) tokens read "
                         "position j at column j")
    if positions is not None and positions.shape != tokens.shape:
        raise ValueError(f"positions must have the shape of tokens {tuple(tokens.shape)}, got "
                         f"{tuple(positions.shape)}")


def _check_max_len(tokens, max_len):
    if tokens.dim() == 2 and tokens.shape[1] > max_len:
        raise ValueError(f"sequence length {tokens.shape[1]} exceeds the position table's "
                         f"max_len {max_len}")


def _check_same_device(device, **tensors):
    for name, t in tensors.items():
        if t is not None and t.device != device:
            raise ValueError(f"{name} is on {t.device}, expected {device} like the other inputs")


def _check_fwd_inputs(tokens, segments, token_weight, segment_weight, pos_weight, positions):
    _check_indices(tokens, segments, positions)
    if token_weight.dim() != 2 or segment_weight.dim() != 2:
        raise ValueError(f"token_weight and segment_weight must be 2-D (rows, H), got shapes "
                         f"{tuple(token_weight.shape)} and {tuple(segment_weight.shape)}")
    if pos_weight.dim() != 3 or pos_weight.shape[0] != 1:
        raise ValueError(f"pos_weight must be (1, max_len, H), got shape {tuple(pos_weight.shape)}")
    hidden = token_weight.shape[1]
    if hidden == 0:
        raise ValueError("the tables need H >= 1 features, got H = 0")
    if segment_weight.shape[1] != hidden or pos_weight.shape[2] != hidden:
        raise ValueError(f"all tables need the same H: token {hidden}, segment "
                         f"{segment_weight.shape[1]}, position {pos_weight.shape[2]}")
    if not (token_weight.dtype == segment_weight.dtype == pos_weight.dtype):
        raise TypeError(f"all tables need one dtype, got token {token_weight.dtype}, segment "
                        f"{segment_weight.dtype}, position {pos_weight.dtype}")
    _check_max_len(tokens, pos_weight.shape[1])
    _check_same_device(token_weight.device, tokens=tokens, segments=segments, positions=positions,
                       segment_weight=segment_weight, pos_weight=pos_weight)


def _check_kernel_dtype(dtype):
    if dtype not in KERNEL_DTYPES:
        raise TypeError(f"the Triton embedding_sum takes float16, bfloat16 or float32 tables, got {dtype}")


def _flat_ids(ids):
    return ids.reshape(-1).contiguous()


def _embedding_sum_fwd_triton(tokens, segments, token_weight, segment_weight, pos_weight, positions):
    """Triton forward: tokens.shape + (H,) in the tables' dtype."""
    _check_fwd_inputs(tokens, segments, token_weight, segment_weight, pos_weight, positions)
    _check_kernel_dtype(token_weight.dtype)
    require_triton(tokens, segments, token_weight, segment_weight, pos_weight, positions)
    hidden = token_weight.shape[1]
    n_rows = tokens.numel()
    # tokens.shape + (H,), contiguous (the kernel writes rows of H): an output that is a view of
    # a 2-D buffer could not be edited in place under autograd.
    out = torch.empty((*tokens.shape, hidden), dtype=token_weight.dtype, device=token_weight.device)
    if not nothing_to_launch(n_rows):
        block_t, block_h, num_warps = _fwd_blocks(hidden)
        launch(_embedding_sum_fwd_kernel, out)[(cdiv(n_rows, block_t),)](
            out, _flat_ids(tokens), _flat_ids(segments),
            _flat_ids(positions) if positions is not None else None,
            token_weight, segment_weight, pos_weight, n_rows, tokens.shape[-1], hidden,
            token_weight.shape[0], segment_weight.shape[0], pos_weight.shape[1],
            token_weight.stride(0), token_weight.stride(1), segment_weight.stride(0),
            segment_weight.stride(1), pos_weight.stride(1), pos_weight.stride(2),
            HAS_POSITIONS=positions is not None, BLOCK_T=block_t, BLOCK_H=block_h,
            num_warps=num_warps)
    return out


def _check_bwd_inputs(grad_out, tokens, segments, positions, n_tokens, n_segments, max_len):
    _check_indices(tokens, segments, positions)
    if grad_out.dim() != tokens.dim() + 1 or grad_out.shape[:-1] != tokens.shape:
        raise ValueError(f"grad_out must be tokens.shape + (H,) = {tuple(tokens.shape)} + (H,), got "
                         f"{tuple(grad_out.shape)}")
    if grad_out.shape[-1] == 0:
        raise ValueError("grad_out needs H >= 1 features, got H = 0")
    for name, n in (("n_tokens", n_tokens), ("n_segments", n_segments), ("max_len", max_len)):
        if n < 1:
            raise ValueError(f"{name} (rows of that table) must be >= 1, got {n}")
    _check_max_len(tokens, max_len)
    _check_same_device(grad_out.device, tokens=tokens, segments=segments, positions=positions)


def _sorted_row_sum(grad_rows, ids, n_table_rows, out_dtype):
    """(n_table_rows, H) table gradient: the grad rows summed per id, with no atomics."""
    n_rows, hidden = grad_rows.shape
    block_t, block_h, num_warps = _chunk_blocks(hidden)
    table_grad = torch.zeros((n_table_rows, hidden), dtype=out_dtype, device=grad_rows.device)
    if nothing_to_launch(n_rows):
        return table_grad
    # Ids out of [0, n_table_rows) become n_table_rows: one run, sorted last, that the kernels
    # never store (no sync to find them; an elementwise pass over R ids beside the sort).
    ids = torch.where((ids >= 0) & (ids < n_table_rows), ids, n_table_rows)
    # Stable: equal ids keep their row order, so each run is summed in the same order every call.
    sorted_ids, order = torch.sort(ids, stable=True)
    n_chunks = cdiv(n_rows, block_t)
    # Every head or tail that pass 2 reads was written by pass 1: no zeroing needed.
    heads = torch.empty((n_chunks, hidden), dtype=torch.float32, device=grad_rows.device)
    tails = torch.empty_like(heads)
    h_blocks = cdiv(hidden, block_h)
    launch(_embedding_sum_bwd_chunk_kernel, table_grad)[(n_chunks, h_blocks)](
        grad_rows, sorted_ids, order, table_grad, heads, tails, n_rows, hidden, n_table_rows,
        grad_rows.stride(0), grad_rows.stride(1), BLOCK_T=block_t, BLOCK_H=block_h,
        num_warps=num_warps)
    if not nothing_to_launch(n_chunks - 1):
        # The end of the run holding each chunk's last row (pass 2 reads the full chunks'). The
        # rows by arange, not a strided slice: under torch.compile with skip_padding's unbacked
        # row count, torch 2.11 gives a slice's length a new size symbol, which an op's fake
        # kernel may not leave behind.
        last_rows = (torch.arange(n_chunks, device=ids.device) * block_t + (block_t - 1)).clamp(max=n_rows - 1)
        run_ends = torch.searchsorted(sorted_ids, sorted_ids[last_rows], right=True)
        launch(_embedding_sum_bwd_carry_kernel, table_grad)[(torch.sym_max(n_chunks - 1, 0), h_blocks)](
            sorted_ids, run_ends, heads, tails, table_grad, hidden, n_table_rows,
            BLOCK_T=block_t, BLOCK_C=CARRY_BLOCK, BLOCK_H=block_h, num_warps=num_warps)
    return table_grad


def _embedding_sum_bwd_triton(grad_out, tokens, segments, positions, n_tokens, n_segments, max_len,
                              learn_pos_embedding, deterministic):
    """Triton backward: (token_grad (n_tokens, H), segment_grad (n_segments, H), pos_grad).

    pos_grad is (1, max_len, H) when learn_pos_embedding, else an empty (0,) tensor. All in
    grad_out's dtype (the tables' dtype). deterministic: no atomics, bitwise repeatable.
    """
    _check_bwd_inputs(grad_out, tokens, segments, positions, n_tokens, n_segments, max_len)
    _check_kernel_dtype(grad_out.dtype)
    require_triton(grad_out, tokens, segments, positions)
    dtype, device, hidden = grad_out.dtype, grad_out.device, grad_out.shape[-1]
    grad_rows = grad_out.reshape(-1, hidden)
    n_rows = grad_rows.shape[0]
    token_ids, segment_ids = _flat_ids(tokens), _flat_ids(segments)
    position_ids = _flat_ids(positions) if positions is not None else None
    scatter_positions = learn_pos_embedding and positions is not None
    block_t, block_h, num_warps = _bwd_blocks(hidden)
    h_blocks = cdiv(hidden, block_h)

    if deterministic:
        token_grad = _sorted_row_sum(grad_rows, token_ids, n_tokens, dtype)
        segment_grad = _sorted_row_sum(grad_rows, segment_ids, n_segments, dtype)
        if scatter_positions:
            pos_rows = _sorted_row_sum(grad_rows, position_ids, max_len, dtype)
    else:
        fp32_zeros = lambda rows: torch.zeros((rows, hidden), dtype=torch.float32, device=device)
        token_acc, segment_acc = fp32_zeros(n_tokens), fp32_zeros(n_segments)
        pos_acc = fp32_zeros(max_len) if scatter_positions else None
        if not nothing_to_launch(n_rows):
            launch(_embedding_sum_bwd_kernel, grad_rows)[(cdiv(n_rows, block_t), h_blocks)](
                grad_rows, token_ids, segment_ids, position_ids, token_acc, segment_acc, pos_acc,
                n_rows, hidden, n_tokens, n_segments, max_len, grad_rows.stride(0), grad_rows.stride(1),
                SCATTER_POSITIONS=scatter_positions, BLOCK_T=block_t, BLOCK_H=block_h,
                num_warps=num_warps)
        token_grad, segment_grad = token_acc.to(dtype), segment_acc.to(dtype)
        if scatter_positions:
            pos_rows = pos_acc.to(dtype)

    if not learn_pos_embedding:
        return token_grad, segment_grad, torch.empty(0, dtype=dtype, device=device)
    if positions is not None:
        return token_grad, segment_grad, pos_rows.view(1, max_len, hidden)
    batch, seq_len = tokens.shape
    pos_grad = torch.zeros((1, max_len, hidden), dtype=dtype, device=device)
    if not nothing_to_launch(n_rows):
        launch(_embedding_sum_bwd_pos_kernel, pos_grad)[(cdiv(seq_len, block_t), h_blocks)](
            grad_out, pos_grad, batch, seq_len, hidden,
            grad_out.stride(0), grad_out.stride(1), grad_out.stride(2),
            BLOCK_T=block_t, BLOCK_H=block_h, num_warps=num_warps)
    return token_grad, segment_grad, pos_grad


def _embedding_sum_fwd_cpu(tokens, segments, token_weight, segment_weight, pos_weight, positions):
    """The CPU kernel: three lookups summed in fp32 (fp64 tables: fp64). F.embedding, not
    indexing: a negative id is an error, never a row counted from the end."""
    _check_fwd_inputs(tokens, segments, token_weight, segment_weight, pos_weight, positions)
    checked = _check_id_ranges(tokens, segments, positions, token_weight.shape[0], segment_weight.shape[0],
                               pos_weight.shape[1])
    lookup = F.embedding if checked else _guarded_lookup
    dtype = token_weight.dtype
    acc = compute_dtype(dtype)
    pos = pos_weight[0, : tokens.shape[-1]] if positions is None else lookup(positions, pos_weight[0])
    # A fresh contiguous tensor of tokens.shape + (H,) whatever the ids' strides; summed in place.
    out = as_dtype(lookup(tokens, token_weight), acc)
    out.add_(as_dtype(lookup(segments, segment_weight), acc)).add_(as_dtype(pos, acc))
    return as_dtype(out, dtype)


def _embedding_sum_bwd_cpu(grad_out, tokens, segments, positions, n_tokens, n_segments, max_len,
                           learn_pos_embedding, deterministic):
    # index_add_ on the CPU is deterministic, so `deterministic` changes nothing here.
    _check_bwd_inputs(grad_out, tokens, segments, positions, n_tokens, n_segments, max_len)
    checked = _check_id_ranges(tokens, segments, positions, n_tokens, n_segments, max_len)
    dtype, hidden = grad_out.dtype, grad_out.shape[-1]
    acc = compute_dtype(dtype)
    grad_rows = as_dtype(grad_out.reshape(-1, hidden), acc)

    def scatter(ids, rows):
        if not checked:
            return as_dtype(_guarded_index_add(grad_rows, ids, rows), dtype)
        return as_dtype(grad_rows.new_zeros(rows, hidden).index_add_(0, ids.reshape(-1), grad_rows), dtype)

    token_grad, segment_grad = scatter(tokens, n_tokens), scatter(segments, n_segments)
    if not learn_pos_embedding:
        pos_grad = grad_out.new_empty(0)
    elif positions is not None:
        pos_grad = scatter(positions, max_len).view(1, max_len, hidden)
    else:
        pos_grad = grad_out.new_zeros(1, max_len, hidden)
        pos_grad[0, : tokens.shape[1]] = as_dtype(as_dtype(grad_out, acc).sum(0), dtype)
    return token_grad, segment_grad, pos_grad


def _embedding_sum_fwd(tokens, segments, token_weight, segment_weight, pos_weight, positions):
    """The launcher for the tables' device: the Triton kernel, or the CPU kernel."""
    if cpu_kernel(token_weight):
        return _embedding_sum_fwd_cpu(tokens, segments, token_weight, segment_weight, pos_weight, positions)
    return _embedding_sum_fwd_triton(tokens, segments, token_weight, segment_weight, pos_weight, positions)


def _embedding_sum_bwd(grad_out, tokens, segments, positions, n_tokens, n_segments, max_len,
                       learn_pos_embedding, deterministic):
    if cpu_kernel(grad_out):
        return _embedding_sum_bwd_cpu(grad_out, tokens, segments, positions, n_tokens, n_segments,
                                      max_len, learn_pos_embedding, deterministic)
    return _embedding_sum_bwd_triton(grad_out, tokens, segments, positions, n_tokens, n_segments,
                                     max_len, learn_pos_embedding, deterministic)


def _embedding_sum_fwd_op(tokens: torch.Tensor, segments: torch.Tensor, token_weight: torch.Tensor,
                          segment_weight: torch.Tensor, pos_weight: torch.Tensor,
                          positions: torch.Tensor | None, deterministic: bool) -> torch.Tensor:
    """token_weight[tokens] + segment_weight[segments] + pos_weight[0, position].

    ``deterministic`` only reaches the backward (the forward has no reduction).
    """
    return _embedding_sum_fwd(tokens, segments, token_weight, segment_weight, pos_weight, positions)


def _embedding_sum_bwd_op(grad_out: torch.Tensor, tokens: torch.Tensor, segments: torch.Tensor,
                          positions: torch.Tensor | None, n_tokens: int, n_segments: int, max_len: int,
                          learn_pos_embedding: bool, deterministic: bool
                          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(token_grad, segment_grad, pos_grad); pos_grad is empty unless learn_pos_embedding."""
    return _embedding_sum_bwd(grad_out, tokens, segments, positions, n_tokens, n_segments, max_len,
                              learn_pos_embedding, deterministic)


def _setup_context(ctx, inputs, output):
    tokens, segments, token_weight, segment_weight, pos_weight, positions, deterministic = inputs
    ctx.save_for_backward(tokens, segments, positions)
    ctx.table_rows = (token_weight.shape[0], segment_weight.shape[0], pos_weight.shape[1])
    ctx.deterministic = deterministic


def _table_grads(ctx, backward_op, grad_out, needed):
    """(token_grad, segment_grad, pos_grad), None for the tables that need none (``needed``:
    ctx.needs_input_grad of the three tables). The position gradient is computed only when that
    table requires grad: embedding_sum passes it detached unless learn_pos_embedding."""
    tokens, segments, positions = ctx.saved_tensors
    token_needed, segment_needed, pos_needed = needed
    token_grad, segment_grad, pos_grad = backward_op(grad_out, tokens, segments, positions, *ctx.table_rows,
                                                     pos_needed)
    return (token_grad if token_needed else None, segment_grad if segment_needed else None,
            pos_grad if pos_needed else None)


def _backward(ctx, grad_out):
    def backward_op(*args):
        return embedding_sum_bwd(*args, ctx.deterministic)
    return (None, None, *_table_grads(ctx, backward_op, grad_out, ctx.needs_input_grad[2:5]), None, None)


def _register_ops():
    """The registered ops, embedding_sum_fwd and embedding_sum_bwd (at first use: deferred_ops)."""
    global embedding_sum_fwd, embedding_sum_bwd
    embedding_sum_fwd = triton_op("bert_fast::embedding_sum_fwd", mutates_args=())(_embedding_sum_fwd_op)
    embedding_sum_bwd = triton_op("bert_fast::embedding_sum_bwd", mutates_args=())(_embedding_sum_bwd_op)
    embedding_sum_fwd.register_autograd(_backward, setup_context=_setup_context)
    forbid_double_backward("bert_fast::embedding_sum_bwd", "embedding_sum")


__getattr__ = deferred_ops(__name__, _register_ops, "embedding_sum_fwd", "embedding_sum_bwd")


# ----------------------------------------------------------------------------------------------
# The compiled extension's op (backend="cuda"; csrc/embedding_sum_cpu.cpp, csrc/embedding_sum.cu):
# its schema is in csrc/registration.cpp, its fake kernels and autograd here.
# ----------------------------------------------------------------------------------------------

def _ext_fwd_fake(tokens, segments, token_weight, segment_weight, pos_weight, positions):
    _check_fwd_inputs(tokens, segments, token_weight, segment_weight, pos_weight, positions)
    return token_weight.new_empty(*tokens.shape, token_weight.shape[1])


def _ext_bwd_fake(grad_out, tokens, segments, positions, n_tokens, n_segments, max_len, learn_pos_embedding):
    _check_bwd_inputs(grad_out, tokens, segments, positions, n_tokens, n_segments, max_len)
    hidden = grad_out.shape[-1]
    pos_grad = grad_out.new_empty(1, max_len, hidden) if learn_pos_embedding else grad_out.new_empty(0)
    return grad_out.new_empty(n_tokens, hidden), grad_out.new_empty(n_segments, hidden), pos_grad


def _ext_setup_context(ctx, inputs, output):
    _setup_context(ctx, (*inputs, False), output)


def _ext_backward(ctx, grad_out):
    return (None, None, *_table_grads(ctx, torch.ops.bert_fast.ext_embedding_sum_bwd, grad_out,
                                      ctx.needs_input_grad[2:5]), None)


def register_extension_ops():
    """Fake kernels and autograd of the extension's op; bert_fast.extension calls this once."""
    torch.library.register_fake("bert_fast::ext_embedding_sum_fwd", _ext_fwd_fake)
    torch.library.register_fake("bert_fast::ext_embedding_sum_bwd", _ext_bwd_fake)
    torch.library.register_autograd("bert_fast::ext_embedding_sum_fwd", _ext_backward,
                                    setup_context=_ext_setup_context)
    forbid_double_backward("bert_fast::ext_embedding_sum_bwd", "embedding_sum")


class _EmbeddingSum(torch.autograd.Function):
    """The eager embedding_sum under autograd: the launchers (Triton or CPU kernel, or the
    extension's), no custom-op dispatch. ``backward_op`` takes the ext op's arguments."""

    @staticmethod
    def forward(ctx, forward_op, backward_op, tokens, segments, token_weight, segment_weight, pos_weight,
                positions):
        ctx.save_for_backward(tokens, segments, positions)
        ctx.table_rows = (token_weight.shape[0], segment_weight.shape[0], pos_weight.shape[1])
        ctx.backward_op = backward_op
        return forward_op(tokens, segments, token_weight, segment_weight, pos_weight, positions)

    @staticmethod
    @once_differentiable("embedding_sum", "bert_fast::embedding_sum_bwd")
    def backward(ctx, grad_out):
        return (None,) * 4 + _table_grads(ctx, ctx.backward_op, grad_out, ctx.needs_input_grad[4:7]) + (None,)


def _ext_fwd(*args):
    return below_autograd(extension.OP_ENTRIES["ext_embedding_sum_fwd"], *args)


def _ext_bwd(*args):
    return below_autograd(extension.OP_ENTRIES["ext_embedding_sum_bwd"], *args)


def _triton_bwd(*args):
    return _embedding_sum_bwd(*args, False)


def _triton_bwd_deterministic(*args):
    return _embedding_sum_bwd(*args, True)


def embedding_sum(tokens, segments, token_weight, segment_weight, pos_weight, *,
                  positions=None, learn_pos_embedding=False, backend="torch", deterministic=False):
    """``token_weight[tokens] + segment_weight[segments] + pos_weight[0, position]``.

    Padded (B, L) tokens read position j at column j; packed (N,) tokens need ``positions``.
    No gradient reaches ``pos_weight`` unless ``learn_pos_embedding`` (the reference's quirk).
    backend="torch": F.embedding lookups. backend="triton": the fused kernel (Triton on CUDA,
    PyTorch on the CPU); ``deterministic=True`` makes its backward use a sort-based reduction
    instead of atomics, so two runs give the same bits. backend="cuda": the compiled extension's
    kernels (CUDA, or C++ on the CPU); its CUDA backward uses atomics, so there
    ``deterministic=True`` runs the triton kernels instead. (The torch backend ignores
    ``deterministic``: it follows torch.use_deterministic_algorithms.) Eager calls go straight
    to the launchers (through _EmbeddingSum when autograd records); under torch.compile the
    registered ops.

    Ids outside their table (< 0 or >= its rows; reachable with check_inputs=False or under
    torch.compile, where the module's value checks do not run): no backend wraps a negative id
    or reads or writes outside a table.
      - On the CPU (every backend: F.embedding for torch, the PyTorch CPU kernels for triton,
        the C++ op for cuda), forward and backward raise IndexError naming the ids, the first
        bad id, its flat index and the range [0, rows). The ids are on the host, so this costs
        no sync. Compiled, the cuda backend's registered op (opaque to Inductor) does the same.
      - Compiled, the torch backend (CPU and CUDA) and the triton backend's CPU kernel (which
        torch.compile traces into, as every triton_op): guarded lookups and scatters, as the
        Triton kernels below (the ids cannot be read while tracing), on every torch version.
      - The Triton kernels (CUDA) guard: an out-of-range id's table adds zeros to that row in
        the forward (a masked load, from a clamped address), and that row adds nothing to that
        table's gradient in the backward (masked atomics; the deterministic reduction maps such
        ids to one past the table and never stores that run). The interpreter runs the same
        code, so CPU tests see the GPU's result.
      - The extension's CUDA kernels guard the same way (zeros forward, nothing scattered).
      - torch on CUDA: F.embedding's device-side assert (PyTorch's behaviour).
    The GPU kernels guard rather than raise: reporting needs the ids on the host (a sync per
    call), and a device-side assert leaves the CUDA context unusable for the rest of the
    process. A row with an out-of-range id is wrong, but nothing else is touched.
    """
    if not uses_triton(backend):
        return _embedding_sum_torch(tokens, segments, token_weight, segment_weight, pos_weight,
                                    positions, learn_pos_embedding)
    if not learn_pos_embedding:
        pos_weight = pos_weight.detach()
    extension = backend == "cuda" and not (deterministic and token_weight.device.type == "cuda")
    if extension:
        require_extension(token_weight)
    tables = (token_weight, segment_weight, pos_weight)
    if use_registered_op():
        if extension:
            return torch.ops.bert_fast.ext_embedding_sum_fwd(tokens, segments, *tables, positions)
        return embedding_sum_fwd(tokens, segments, *tables, positions, bool(deterministic))
    forward = _ext_fwd if extension else _embedding_sum_fwd
    if records_grad(*tables):
        backward = _ext_bwd if extension else _triton_bwd_deterministic if deterministic else _triton_bwd
        return thin_apply(_EmbeddingSum, forward, backward, tokens, segments, *tables, positions)
    return forward(tokens, segments, *tables, positions)
