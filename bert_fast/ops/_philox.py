"""The dropout masks of the fused ops, and the seed they are drawn from.

One definition for every backend (csrc/philox.h states it in C++): add_layernorm's element
(r, c) of rows of H columns is kept iff

    uniform(word c % 4 of Philox4x32-10, key = seed, counter = (n_lo, n_hi, 0, 0)) >= p,
    n = r * ceil(H / 4) + c // 4

with ``uniform`` the map of ``triton.language.rand``: one Philox call draws four consecutive
columns (until 2026-11-27 each element took word 0 of its own call, counter r * H + c; the
integer work of those calls cost as much time as the op's memory traffic). The Triton kernels
call ``tl.randint4x`` / ``tl.philox``; the CPU twins here compute the same bits with int64
tensor arithmetic, so a kernel's dropout can be compared with its twin bit for bit, and the
C++/CUDA ops with both.

The attention weights' masks (Triton's kernels and their CPU twin; no C++ op drops attention
weights) take four keys from one Philox call, a quarter of the integer work a weight, the
largest cost of the attention kernels with dropout: weight (i, j) of head ``bh`` in rows of
``L`` keys is kept iff uniform(word ``j % 4`` of Philox4x32-10, key = seed, counter =
(i * ceil(L / 4) + j // 4, bh, 0, 0)) >= p (attention._dropout_keep).

The seed is a one-element int64 tensor on the inputs' device, drawn with ``torch.randint``
from that device's default generator: no host round trip, so the ops keep working under CUDA
graphs and ``torch.compile(fullgraph=True)``, and ``torch.manual_seed`` repeats a run.
"""

import torch

from ._autograd import deferred_ops
from ._triton import tl, triton

_MASK32 = 0xFFFFFFFF
_ROUND_A, _ROUND_B = 0xD2511F53, 0xCD9E8D57
_KEY_A, _KEY_B = 0x9E3779B9, 0xBB67AE85
# tl.rand's scale: the largest float such that (2**31 - 1) * scale < 1.
_UNIFORM_SCALE = 4.6566127342e-10


def keep_scale(dropout_p):
    """1 / (1 - p), the kept values' scale, from the double p on the host (rounded once to the
    kernels' fp32; p itself is compared in fp32); p == 1 drops everything (scale 0). In a
    kernel, 1 / (1 - p) of p in fp32 is inf for every p within 3e-8 of 1 (p rounds to 1.0):
    0 * inf made the attention output NaN."""
    return 1.0 / (1.0 - dropout_p) if dropout_p < 1.0 else 0.0


def dropout_seed(dropout_p, device):
    """The seed tensor for one dropout draw, or None when there is no dropout."""
    if dropout_p <= 0.0:
        return None
    return torch.randint(2**31 - 1, (1,), dtype=torch.int64, device=device)


def _mul_hi_lo(constant, x):
    """High and low 32 bits of constant * x for uint32 values held in int64 (no overflow:
    the product is formed from 16-bit halves of x). In place on the fresh tensors: the CPU
    twins' dropout is mostly this function (85% of a small CPU training step's time), and the
    allocations were most of its cost (2.6x slower for the same ops out of place)."""
    low_part = (x & 0xFFFF).mul_(constant)          # < 2**48
    high_part = (x >> 16).mul_(constant)            # < 2**48
    hi = (low_part >> 16).add_(high_part).bitwise_right_shift_(16)
    lo = (high_part & 0xFFFF).bitwise_left_shift_(16).add_(low_part).bitwise_and_(_MASK32)
    return hi, lo


def philox_words(seed, c0, c1):
    """The four words of Philox4x32-10 for counters (c0, c1, 0, 0): uint32 values in int64
    tensors, ``tl.philox(seed, c0, c1, 0, 0)`` with 32-bit counters.

    ``seed``: one-element int64 tensor; ``c0``, ``c1``: int64 tensors of uint32 values
    (broadcastable).

    Once bert_fast's ops are registered (a torch.compile or trace has used them) this runs as
    the op ``bert_fast::philox_words``: a traced CPU twin then holds one node a draw where the
    tensor arithmetic below was ~360 (a one-layer encoder's training graph with dropout: 1140
    nodes, its first forward and backward 73 s with Inductor on the CI machine's CPU, 36 s so)."""
    if _philox_words_op is not None:
        return _philox_words_op(seed, c0, c1)
    return _philox_words(seed, c0, c1)


def _philox_words(seed, c0, c1):
    seed = seed.reshape(()).to(torch.int64)
    k0, k1 = seed & _MASK32, (seed >> 32) & _MASK32
    c0, c1 = torch.broadcast_tensors(c0, c1)
    c2 = c3 = torch.zeros_like(c0)
    for _ in range(10):
        hi_b, lo_b = _mul_hi_lo(_ROUND_B, c2)
        hi_a, lo_a = _mul_hi_lo(_ROUND_A, c0)
        # hi_b and hi_a are fresh tensors (never the caller's c0, c1): xor'ed in place.
        c0, c1, c2, c3 = hi_b.bitwise_xor_(c1).bitwise_xor_(k0), lo_b, hi_a.bitwise_xor_(c3).bitwise_xor_(k1), lo_a
        k0, k1 = (k0 + _KEY_A) & _MASK32, (k1 + _KEY_B) & _MASK32
    return c0, c1, c2, c3


_philox_words_op = None


def _register_ops():
    """bert_fast::philox_words (at the ops' registration: deferred_ops)."""
    global _philox_words_op

    @torch.library.custom_op("bert_fast::philox_words", mutates_args=())
    def op(seed: torch.Tensor, c0: torch.Tensor, c1: torch.Tensor
           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        # Contiguous, as the fake kernel says (a transposed counter would give transposed words).
        return tuple(word.contiguous() for word in _philox_words(seed, c0, c1))

    @op.register_fake
    def _(seed, c0, c1):
        shape = torch.broadcast_shapes(c0.shape, c1.shape)
        return tuple(c0.new_empty(shape, dtype=torch.int64) for _ in range(4))

    _philox_words_op = op


deferred_ops(__name__, _register_ops)


def philox_uniform(bits):
    """``tl.uint_to_uniform_float`` of uint32 bits (int64 tensor) -> float32 in [0, 1)."""
    # As int32, negative values v map to ~v = -v - 1; for the uint32 value u that is 2**32 - 1 - u.
    folded = torch.where(bits >= 2**31, _MASK32 - bits, bits)
    return folded.to(torch.float32) * torch.tensor(_UNIFORM_SCALE, dtype=torch.float32, device=bits.device)


def row_keep(seed, dropout_p, rows, hidden, device):
    """add_layernorm's boolean keep mask (rows, hidden): element (r, c) from word c % 4 of the
    Philox call with 64-bit counter r * ceil(hidden / 4) + c // 4 (split into its halves, as
    ``tl.randint4x(seed, counter)`` does for an int64 counter)."""
    groups = (hidden + 3) // 4
    counters = torch.arange(rows * groups, dtype=torch.int64, device=device).view(rows, groups)
    words = philox_words(seed, counters & _MASK32, counters >> 32)
    # (rows, groups, 4): a group's four words side by side are its four columns in order.
    uniform = philox_uniform(torch.stack(words, -1)).view(rows, groups * 4)[:, :hidden]
    return uniform >= torch.tensor(dropout_p, dtype=torch.float32)


def check_seed(seed, dropout_p, device):
    """A dropout op's seed: a one-element int64 tensor on ``device`` when dropout_p > 0."""
    if dropout_p <= 0.0:
        return
    if seed is None:
        raise ValueError(f"dropout_p = {dropout_p} needs a seed: a one-element int64 tensor "
                         f"(bert_fast.ops._philox.dropout_seed)")
    if not isinstance(seed, torch.Tensor) or seed.dtype != torch.int64 or seed.numel() != 1:
        got = f"{seed.dtype} of shape {tuple(seed.shape)}" if isinstance(seed, torch.Tensor) else repr(seed)
        raise ValueError(f"seed must be a one-element int64 tensor, got {got}")
    if seed.device != device:
        raise ValueError(f"seed must be on the inputs' device ({device}), got {seed.device}")


@triton.jit
def interleaved_keep(w0, w1, w2, w3, dropout_p, ROWS: tl.constexpr, COLS: tl.constexpr):
    """The kernels' keep mask (ROWS, COLS) from the four Philox words of (ROWS, COLS / 4)
    groups: word k of a group is its column 4 * group + k (both rules above)."""
    k0 = (tl.uint_to_uniform_float(w0) >= dropout_p).to(tl.int8)
    k1 = (tl.uint_to_uniform_float(w1) >= dropout_p).to(tl.int8)
    k2 = (tl.uint_to_uniform_float(w2) >= dropout_p).to(tl.int8)
    k3 = (tl.uint_to_uniform_float(w3) >= dropout_p).to(tl.int8)
    # (ROWS, COLS / 4, 2, 2) holding [k0, k1; k2, k3] per group: row-major, the columns in order.
    keep = tl.join(tl.join(k0, k2), tl.join(k1, k3))
    return tl.reshape(keep, (ROWS, COLS)) != 0
