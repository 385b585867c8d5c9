"""column_sums, the second stage of the backward kernels that reduce over rows (add_layernorm's
d_weight/d_bias, bias_act's d_bias): the sums over the partial rows, in one launch, cast once.
Against fp64 sums: several row steps with a ragged last one, columns not a multiple of the
program's, one row, the output dtype, the partials' shape kept, the same bits on every call."""

import pytest
import torch

from bert_fast.ops.column_sums import _COLUMN_SUMS_BLOCKS, column_sums, joint_column_sums
from tests.helpers import assert_close, DEVICE, needs_kernels

pytestmark = needs_kernels

BLOCK_R, BLOCK_C = _COLUMN_SUMS_BLOCKS["BLOCK_R"], _COLUMN_SUMS_BLOCKS["BLOCK_C"]
# One ulp of the output dtype at most (relative), the fp32 sum's own rounding aside: a whole
# ulp, as Triton's interpreter truncates where a GPU rounds to nearest.
ULP = {torch.float32: 1e-6, torch.bfloat16: 2.0**-7, torch.float16: 2.0**-10}


@pytest.mark.parametrize("shape", [(1, 5), (BLOCK_R, BLOCK_C), (2 * BLOCK_R + 7, 3, 50), (300, 768)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_column_sums_match_fp64_sums(shape, dtype):
    partials = torch.randn(shape, device=DEVICE)
    partials[0] += 100.0         # a large first row: the sum must not lose the small ones after it
    out = column_sums(partials, dtype)
    expected = partials.double().sum(0)
    assert out.dtype == dtype and out.shape == partials.shape[1:]
    # fp32 accumulation of up to 300 values of ~1 (one ~100), then one rounding to dtype.
    assert_close(out.double(), expected, atol=1e-4, rtol=ULP[dtype], what=f"column sums {shape} {dtype}")
    assert torch.equal(column_sums(partials, dtype), out), "the same partials gave other sums"


def test_column_sums_read_only_their_rows():
    # Rows past the partials' end (a larger buffer's tail) must not be summed.
    buffer = torch.randn(BLOCK_R + 3, 40, device=DEVICE)
    partials = buffer[:BLOCK_R - 5]
    assert_close(column_sums(partials, torch.float32).double(), partials.double().sum(0), atol=1e-4,
                 what="column sums of a buffer's first rows")


@pytest.mark.parametrize("shapes", [[(7, 2, 40), (3, 100), (BLOCK_R + 9, 3, 40)], [(1, 5), (2 * BLOCK_R + 1, 33)],
                                    [(4, 48)], [(BLOCK_R + 3, 2, 40), (5, 33)]],
                         ids=["three", "two", "one", "widths-by-4-and-not"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_joint_column_sums_are_each_buffers_sums_in_turn(shapes, dtype):
    """The fused layer's backward sums its kernels' partial rows in one launch: buffers of
    different row counts and widths (not multiples of a program's columns, so a program's
    columns never straddle two buffers), their sums side by side, as column_sums gives each,
    bit for bit: also where one buffer's width is a multiple of 4 (16-byte loads on a GPU) and
    another's is not."""
    partials = [torch.randn(shape, device=DEVICE) for shape in shapes]
    out = joint_column_sums(partials, dtype)
    assert out.dtype == dtype and out.dim() == 1
    expected = torch.cat([p.double().sum(0).flatten() for p in partials])
    assert_close(out.double(), expected, atol=1e-4, rtol=ULP[dtype], what=f"joint column sums {shapes}")
    assert torch.equal(out, torch.cat([column_sums(p, dtype).flatten() for p in partials])), \
        "the same sums as one launch per buffer"


def test_joint_column_sums_take_one_to_three_buffers():
    partials = torch.zeros(2, 8, device=DEVICE)
    for count in (0, 4):
        with pytest.raises(ValueError, match="one to three buffers"):
            joint_column_sums([partials] * count, torch.float32)
