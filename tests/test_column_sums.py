"""column_sums, the second stage of the backward kernels that reduce over rows (add_layernorm's
d_weight/d_bias, bias_act's d_bias): the sums over the partial rows, in one launch, cast once.
Against fp64 sums: several row steps with a ragged last one, columns not a multiple of the
program's, one row, the output dtype, the partials' shape kept, the same bits on every call."""

import pytest
import torch

from bert_fast.ops.column_sums import _COLUMN_SUMS_BLOCKS, column_sums
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
