// Stage two of a backward that reduces over rows in blocks (add_layernorm's d_weight and
// d_bias): the column sums of the blocks' fp32 partial rows, rounded once to the gradient's
// type, for up to two buffers in one launch. PyTorch's reduction of such a buffer (a few
// hundred rows of 768) took 11 us on an H100 (a B32 L128 training step, 2026-11-26), and a cast
// after it was one more launch per gradient.
//
// Device code on CUDA's built-ins and cuda_utils::from_float only, so that
// tests/test_csrc_emulated.py can run it on the CPU (one thread per CUDA thread): include it
// after cuda_utils.cuh.
#pragma once
#include <cstdint>

namespace bert_fast {

// A block sums kColumnSumLanes adjacent columns (128 contiguous bytes of each fp32 row) over
// every partial row: its kColumnSumSlices warps take rows slice, slice + kColumnSumSlices, ...,
// then the block adds the slices' sums in shared memory in slice order, so a column's sum is
// the same on every run. 16 slices keep a few hundred rows to a few dozen loads a thread.
constexpr int kColumnSumLanes = 32;
constexpr int kColumnSumSlices = 16;
constexpr int kColumnSumThreads = kColumnSumLanes * kColumnSumSlices;

// The (partial rows, output) pair of each blockIdx.y.
template <typename T>
struct ColumnSumParts {
  const float* partial[2];
  T* out[2];
};

// out[c] = sum over r < partial_rows of partial[r * hidden + c], for the pair of blockIdx.y;
// grid (ceil(hidden / kColumnSumLanes), pairs), kColumnSumThreads threads.
template <typename T>
__global__ void __launch_bounds__(kColumnSumThreads)
    column_sums_kernel(ColumnSumParts<T> parts, int64_t partial_rows, int hidden) {
  __shared__ float slice_sums[kColumnSumSlices][kColumnSumLanes];
  const int lane = static_cast<int>(threadIdx.x) % kColumnSumLanes;
  const int slice = static_cast<int>(threadIdx.x) / kColumnSumLanes;
  const int col = static_cast<int>(blockIdx.x) * kColumnSumLanes + lane;
  // A select, not parts.partial[blockIdx.y]: indexing the parameter by a register would copy
  // it to local memory (a 32-byte stack frame, ptxas sm_90).
  const bool second = blockIdx.y != 0;
  const float* partial = second ? parts.partial[1] : parts.partial[0];
  float sum = 0.0f;
  if (col < hidden) {
#pragma unroll 4
    for (int64_t row = slice; row < partial_rows; row += kColumnSumSlices) sum += partial[row * hidden + col];
  }
  slice_sums[slice][lane] = sum;
  __syncthreads();
  if (slice == 0 && col < hidden) {
    float total = 0.0f;
#pragma unroll
    for (int s = 0; s < kColumnSumSlices; ++s) total += slice_sums[s][lane];
    (second ? parts.out[1] : parts.out[0])[col] = cuda_utils::from_float<T>(total);
  }
}

}  // namespace bert_fast
