// CUDA kernels of ext_add_layernorm_fwd / ext_add_layernorm_bwd: LayerNorm(residual + dropout(x))
// over rows of `hidden` elements, fp32 statistics. The math is that of _add_layernorm_fwd_cpu /
// _add_layernorm_bwd_cpu in bert_fast/ops/add_layernorm.py; launch functions: kernels.h.
//
// Cost (s = bytes per element; memory-bound, ~10 flops per element):
//   forward   reads x, residual; writes out, 8 B of statistics per row        -> 3 s B/element
//   backward  reads grad, x, residual; writes d_residual (and d_x with dropout) -> 4 s (5 s)
//             plus (blocks, hidden) fp32 partial d_weight/d_bias rows, summed by stage two.
// Each element is read once per pass: a row stays in registers between the mean, the variance
// and the normalisation (forward), or between the two row sums and the final formula (backward).
//
// Layout: the threads of a row ("group") take 16-byte packs in turn: pack p of the row goes to
// lane p % group, so a warp reads 512 contiguous bytes per step. For hidden <= 1024 a group is a
// warp (16 lanes for hidden <= 128) and a block holds several rows, so the row sums are warp
// shuffles only; larger rows get a block each (16 elements per thread, <= 512 threads) and sum
// through shared memory. Every thread holds at most 32 elements (the backward's dropout mask is
// one 32-bit word per thread).
//
// Dropout: element (r, c) takes word c % 4 of the Philox call with counter r * ceil(hidden / 4)
// + c / 4 (philox.h). The backward draws the same bits again instead of reading a saved mask:
// 10 Philox rounds per four elements cost less than a mask's traffic would. The seed is read on
// the device, so no host synchronisation.
//
// d_weight / d_bias: the backward grid is one wave (as many blocks as are resident on the GPU
// at once, from the occupancy of the chosen kernel); each block walks row groups g = block,
// block + blocks, ... and keeps its column sums in registers; at the end it writes one fp32 row
// of partial sums (the row groups of a block are first added in shared memory, in group order).
// Stage two (column_sums.cuh) sums the (blocks, hidden) partials of both, a few hundred rows
// each, and rounds the sums to T: one launch after the kernel (PyTorch's sum and cast per
// gradient were four).
#include "cuda_utils.cuh"
#include "column_sums.cuh"
#include "kernels.h"
#include "philox.h"

#include <algorithm>
#include <climits>
#include <cstdint>

namespace bert_fast {
namespace {

using cuda_utils::block_sum;
using cuda_utils::group_sum;
using cuda_utils::is_aligned;
using cuda_utils::kPack16;
using cuda_utils::load_floats;
using cuda_utils::store_floats;

// Threads per block when a group (<= 32 lanes) holds a row: forward 8 rows of 32 lanes; the
// backward, with ~4x the registers per thread, 4, so that more than one block fits on an SM.
constexpr int kFwdRowsBlockThreads = 256;
constexpr int kBwdRowsBlockThreads = 128;
// A block per row: up to 512 threads of 16 elements.
constexpr int kRowBlockMaxThreads = 512;
constexpr int kRowBlockElements = 16;
// The widest row a group of <= 32 lanes takes (32 lanes x 32 elements): the size of the
// backward's shared d_weight / d_bias rows.
constexpr int kGroupMaxHidden = 1024;

// Which threads own a row. LANES > 0: an aligned group of LANES lanes of a warp, blockDim.x /
// LANES rows per block. LANES == 0: the whole block.
template <int LANES>
struct RowGroup {
  __device__ __forceinline__ int lane() const { return LANES > 0 ? threadIdx.x % LANES : threadIdx.x; }
  __device__ __forceinline__ int size() const { return LANES > 0 ? LANES : blockDim.x; }
  __device__ __forceinline__ int index() const { return LANES > 0 ? threadIdx.x / LANES : 0; }
  __device__ __forceinline__ int per_block() const { return LANES > 0 ? blockDim.x / LANES : 1; }
};

// The group's sum of N values (every thread of the group gets the same bits).
template <int LANES, int N>
__device__ __forceinline__ void row_sum(float (&values)[N], float* scratch) {
  if constexpr (LANES > 0) {
    group_sum<LANES, N>(values);
  } else {
    block_sum<N>(values, scratch);
  }
}

template <typename T, int VEC, int LANES, int ELEMS, bool DROPOUT>
__global__ void __launch_bounds__(LANES > 0 ? kFwdRowsBlockThreads : kRowBlockMaxThreads)
    add_layernorm_fwd_kernel(T* __restrict__ out, float* __restrict__ mean_out, float* __restrict__ rstd_out,
                             const T* __restrict__ x, const T* __restrict__ residual,
                             const T* __restrict__ weight, const T* __restrict__ bias, int64_t rows,
                             int hidden, float eps, const int64_t* __restrict__ seed_ptr, float dropout_p,
                             float keep_scale) {
  constexpr int kPacks = ELEMS / VEC;
  static_assert(ELEMS % VEC == 0, "a thread holds whole packs");
  const RowGroup<LANES> group;
  const int lane = group.lane(), group_size = group.size();
  const int n_packs = hidden / VEC;
  const int64_t rows_per_block = group.per_block();
  __shared__ float scratch[32];
  uint64_t seed = 0;
  if constexpr (DROPOUT) seed = static_cast<uint64_t>(*seed_ptr);

  // The loop bounds are the same for every thread of the block (shuffles and __syncthreads
  // need all of them); a group past the last row computes on zeros and stores nothing.
  for (int64_t first_row = blockIdx.x * rows_per_block; first_row < rows;
       first_row += static_cast<int64_t>(gridDim.x) * rows_per_block) {
    const int64_t row = first_row + group.index();
    const bool row_in = row < rows;
    const int64_t row_start = row * hidden;

    float s[kPacks][VEC];
    float total[1] = {0.0f};
#pragma unroll
    for (int i = 0; i < kPacks; ++i) {
      const int pack = lane + i * group_size;
      if (row_in && pack < n_packs) {
        float xv[VEC], rv[VEC];
        load_floats<T, VEC>(x + row_start + pack * VEC, xv);
        load_floats<T, VEC>(residual + row_start + pack * VEC, rv);
        dropped_sum<VEC, DROPOUT>(s[i], xv, rv, seed, row, static_cast<int64_t>(pack) * VEC, hidden, dropout_p,
                                  keep_scale, nullptr, 0);
#pragma unroll
        for (int k = 0; k < VEC; ++k) total[0] += s[i][k];
      } else {
#pragma unroll
        for (int k = 0; k < VEC; ++k) s[i][k] = 0.0f;
      }
    }
    row_sum<LANES, 1>(total, scratch);
    const float mean = total[0] / hidden;

    // Two-pass variance from the registers: no cancellation of E[s^2] - mean^2.
    float squares[1] = {0.0f};
#pragma unroll
    for (int i = 0; i < kPacks; ++i) {
      const int pack = lane + i * group_size;
      if (row_in && pack < n_packs) {
#pragma unroll
        for (int k = 0; k < VEC; ++k) {
          s[i][k] -= mean;
          squares[0] += s[i][k] * s[i][k];
        }
      }
    }
    row_sum<LANES, 1>(squares, scratch);
    const float rstd = rsqrtf(squares[0] / hidden + eps);

#pragma unroll
    for (int i = 0; i < kPacks; ++i) {
      const int pack = lane + i * group_size;
      if (row_in && pack < n_packs) {
        float y[VEC];
#pragma unroll
        for (int k = 0; k < VEC; ++k) y[k] = s[i][k] * rstd;
        if (weight != nullptr) {
          float w[VEC];
          load_floats<T, VEC>(weight + pack * VEC, w);
#pragma unroll
          for (int k = 0; k < VEC; ++k) y[k] *= w[k];
        }
        if (bias != nullptr) {
          float b[VEC];
          load_floats<T, VEC>(bias + pack * VEC, b);
#pragma unroll
          for (int k = 0; k < VEC; ++k) y[k] += b[k];
        }
        store_floats<T, VEC>(out + row_start + pack * VEC, y);
      }
    }
    if (row_in && lane == 0) {
      mean_out[row] = mean;
      rstd_out[row] = rstd;
    }
  }
}

template <typename T, int VEC, int LANES, int ELEMS, bool DROPOUT>
__global__ void __launch_bounds__(LANES > 0 ? kBwdRowsBlockThreads : kRowBlockMaxThreads)
    add_layernorm_bwd_kernel(T* __restrict__ d_residual, T* __restrict__ d_x, float* __restrict__ d_weight_partial,
                             float* __restrict__ d_bias_partial, const T* __restrict__ grad,
                             const T* __restrict__ x, const T* __restrict__ residual,
                             const T* __restrict__ weight, const float* __restrict__ mean,
                             const float* __restrict__ rstd, int64_t rows, int hidden,
                             const int64_t* __restrict__ seed_ptr, float dropout_p, float keep_scale) {
  constexpr int kPacks = ELEMS / VEC;
  static_assert(ELEMS % VEC == 0, "a thread holds whole packs");
  static_assert(ELEMS <= 32, "the keep mask is one 32-bit word per thread");
  static_assert(LANES == 0 || LANES * ELEMS <= kGroupMaxHidden, "the shared partial rows hold kGroupMaxHidden");
  const RowGroup<LANES> group;
  const int lane = group.lane(), group_size = group.size();
  const int n_packs = hidden / VEC;
  const int64_t rows_per_block = group.per_block();
  __shared__ float scratch[32 * 2];
  uint64_t seed = 0;
  if constexpr (DROPOUT) seed = static_cast<uint64_t>(*seed_ptr);

  float d_weight_acc[kPacks][VEC], d_bias_acc[kPacks][VEC];
#pragma unroll
  for (int i = 0; i < kPacks; ++i) {
#pragma unroll
    for (int k = 0; k < VEC; ++k) d_weight_acc[i][k] = d_bias_acc[i][k] = 0.0f;
  }

  for (int64_t first_row = blockIdx.x * rows_per_block; first_row < rows;
       first_row += static_cast<int64_t>(gridDim.x) * rows_per_block) {
    const int64_t row = first_row + group.index();
    const bool row_in = row < rows;
    const int64_t row_start = row * hidden;
    const float row_mean = row_in ? mean[row] : 0.0f;
    const float row_rstd = row_in ? rstd[row] : 0.0f;

    float x_hat[kPacks][VEC], d_x_hat[kPacks][VEC];
    uint32_t keep_bits = 0;
    // sum(d_x_hat) and sum(d_x_hat * x_hat) over the row.
    float sums[2] = {0.0f, 0.0f};
#pragma unroll
    for (int i = 0; i < kPacks; ++i) {
      const int pack = lane + i * group_size;
      if (row_in && pack < n_packs) {
        const int64_t at = row_start + pack * VEC;
        float dy[VEC], xv[VEC], rv[VEC];
        load_floats<T, VEC>(grad + at, dy);
        load_floats<T, VEC>(x + at, xv);
        load_floats<T, VEC>(residual + at, rv);
        float w[VEC];
        if (weight != nullptr) {
          load_floats<T, VEC>(weight + pack * VEC, w);
        } else {
#pragma unroll
          for (int k = 0; k < VEC; ++k) w[k] = 1.0f;
        }
        float s[VEC];
        dropped_sum<VEC, DROPOUT>(s, xv, rv, seed, row, static_cast<int64_t>(pack) * VEC, hidden, dropout_p,
                                  keep_scale, &keep_bits, i * VEC);
#pragma unroll
        for (int k = 0; k < VEC; ++k) {
          x_hat[i][k] = (s[k] - row_mean) * row_rstd;
          d_x_hat[i][k] = dy[k] * w[k];
          sums[0] += d_x_hat[i][k];
          sums[1] += d_x_hat[i][k] * x_hat[i][k];
          d_weight_acc[i][k] += dy[k] * x_hat[i][k];
          d_bias_acc[i][k] += dy[k];
        }
      } else {
#pragma unroll
        for (int k = 0; k < VEC; ++k) x_hat[i][k] = d_x_hat[i][k] = 0.0f;
      }
    }
    row_sum<LANES, 2>(sums, scratch);
    const float mean_d_x_hat = sums[0] / hidden;
    const float mean_d_x_hat_x_hat = sums[1] / hidden;

#pragma unroll
    for (int i = 0; i < kPacks; ++i) {
      const int pack = lane + i * group_size;
      if (row_in && pack < n_packs) {
        const int64_t at = row_start + pack * VEC;
        float d_sum[VEC];
#pragma unroll
        for (int k = 0; k < VEC; ++k) {
          d_sum[k] = (d_x_hat[i][k] - mean_d_x_hat - x_hat[i][k] * mean_d_x_hat_x_hat) * row_rstd;
        }
        store_floats<T, VEC>(d_residual + at, d_sum);
        if constexpr (DROPOUT) {
          float d_dropped[VEC];
#pragma unroll
          for (int k = 0; k < VEC; ++k) {
            d_dropped[k] = (keep_bits >> (i * VEC + k)) & 1u ? d_sum[k] * keep_scale : 0.0f;
          }
          store_floats<T, VEC>(d_x + at, d_dropped);
        }
      }
    }
  }

  // One partial row per block. Both pointers are null or not for the whole grid, so the
  // __syncthreads below are reached by every thread or by none.
  if (d_weight_partial == nullptr && d_bias_partial == nullptr) return;
  float* const d_weight_row = d_weight_partial ? d_weight_partial + static_cast<int64_t>(blockIdx.x) * hidden : nullptr;
  float* const d_bias_row = d_bias_partial ? d_bias_partial + static_cast<int64_t>(blockIdx.x) * hidden : nullptr;
  if constexpr (LANES > 0) {
    // Several groups hold the same columns: add them in shared memory, group 0 first, then
    // write the row with consecutive threads on consecutive columns.
    __shared__ float d_weight_shared[kGroupMaxHidden];
    __shared__ float d_bias_shared[kGroupMaxHidden];
    const int n_groups = group.per_block();
    for (int g = 0; g < n_groups; ++g) {
      if (group.index() == g) {
#pragma unroll
        for (int i = 0; i < kPacks; ++i) {
          const int pack = lane + i * group_size;
          if (pack < n_packs) {
#pragma unroll
            for (int k = 0; k < VEC; ++k) {
              const int col = pack * VEC + k;
              d_weight_shared[col] = g == 0 ? d_weight_acc[i][k] : d_weight_shared[col] + d_weight_acc[i][k];
              d_bias_shared[col] = g == 0 ? d_bias_acc[i][k] : d_bias_shared[col] + d_bias_acc[i][k];
            }
          }
        }
      }
      __syncthreads();
    }
    for (int col = threadIdx.x; col < hidden; col += blockDim.x) {
      if (d_weight_row) d_weight_row[col] = d_weight_shared[col];
      if (d_bias_row) d_bias_row[col] = d_bias_shared[col];
    }
  } else {
#pragma unroll
    for (int i = 0; i < kPacks; ++i) {
      const int pack = lane + i * group_size;
      if (pack < n_packs) {
#pragma unroll
        for (int k = 0; k < VEC; ++k) {
          if (d_weight_row) d_weight_row[pack * VEC + k] = d_weight_acc[i][k];
          if (d_bias_row) d_bias_row[pack * VEC + k] = d_bias_acc[i][k];
        }
      }
    }
  }
}

// Threads per row and elements per thread for a row of `hidden` elements (lanes == 0: a block
// per row of `block_threads` threads). Depends on hidden only, so the vector and scalar paths
// split a row the same way.
struct Layout {
  int lanes;
  int elements;
  int block_threads;
};

Layout choose_layout(int hidden, bool backward) {
  const int rows_block = backward ? kBwdRowsBlockThreads : kFwdRowsBlockThreads;
  if (hidden <= 128) return {16, 8, rows_block};
  if (hidden <= 256) return {32, 8, rows_block};
  if (hidden <= 512) return {32, 16, rows_block};
  if (hidden <= 768) return {32, 24, rows_block};
  if (hidden <= 1024) return {32, 32, rows_block};
  const int threads = (hidden + kRowBlockElements - 1) / kRowBlockElements;
  return {0, kRowBlockElements, (threads + 31) / 32 * 32};
}

// 1 / (1 - p) from the double p, rounded once to fp32; p itself is compared in fp32. Both as
// the Python launchers pass them to the Triton kernels.
float keep_scale_of(double dropout_p) { return dropout_p < 1.0 ? static_cast<float>(1.0 / (1.0 - dropout_p)) : 0.0f; }

struct FwdArgs {
  void* out;
  float* mean;
  float* rstd;
  const void* x;
  const void* residual;
  const void* weight;
  const void* bias;
  int64_t rows;
  int hidden;
  float eps;
  const int64_t* seed;
  double dropout_p;
};

template <typename T, int VEC, int LANES, int ELEMS, bool DROPOUT>
void run_fwd(const FwdArgs& a, const Layout& layout, cudaStream_t stream) {
  const int64_t rows_per_block = LANES > 0 ? layout.block_threads / LANES : 1;
  const int64_t blocks = std::min<int64_t>((a.rows + rows_per_block - 1) / rows_per_block, INT32_MAX);
  add_layernorm_fwd_kernel<T, VEC, LANES, ELEMS, DROPOUT>
      <<<static_cast<unsigned>(blocks), layout.block_threads, 0, stream>>>(
          static_cast<T*>(a.out), a.mean, a.rstd, static_cast<const T*>(a.x), static_cast<const T*>(a.residual),
          static_cast<const T*>(a.weight), static_cast<const T*>(a.bias), a.rows, a.hidden, a.eps, a.seed,
          static_cast<float>(a.dropout_p), keep_scale_of(a.dropout_p));
}

template <typename T, int VEC, bool DROPOUT>
void fwd_with_layout(const FwdArgs& a, const Layout& layout, cudaStream_t stream) {
  switch (layout.lanes * 100 + layout.elements) {
    case 1608: return run_fwd<T, VEC, 16, 8, DROPOUT>(a, layout, stream);
    case 3208: return run_fwd<T, VEC, 32, 8, DROPOUT>(a, layout, stream);
    case 3216: return run_fwd<T, VEC, 32, 16, DROPOUT>(a, layout, stream);
    case 3224: return run_fwd<T, VEC, 32, 24, DROPOUT>(a, layout, stream);
    case 3232: return run_fwd<T, VEC, 32, 32, DROPOUT>(a, layout, stream);
    default: return run_fwd<T, VEC, 0, kRowBlockElements, DROPOUT>(a, layout, stream);
  }
}

template <typename T>
void fwd_typed(const FwdArgs& a, cudaStream_t stream) {
  constexpr int kVec = kPack16<T>;
  const Layout layout = choose_layout(a.hidden, /*backward=*/false);
  const bool packed = a.hidden % kVec == 0 && is_aligned(a.out, 16) && is_aligned(a.x, 16) &&
                      is_aligned(a.residual, 16) && is_aligned(a.weight, 16) && is_aligned(a.bias, 16);
  const bool dropout = a.dropout_p > 0.0;
  if (packed) {
    dropout ? fwd_with_layout<T, kVec, true>(a, layout, stream) : fwd_with_layout<T, kVec, false>(a, layout, stream);
  } else {
    dropout ? fwd_with_layout<T, 1, true>(a, layout, stream) : fwd_with_layout<T, 1, false>(a, layout, stream);
  }
}

struct BwdArgs {
  void* d_residual;
  void* d_x;
  void* d_weight;
  void* d_bias;
  float* d_weight_partial;
  float* d_bias_partial;
  int64_t partial_rows;
  const void* grad;
  const void* x;
  const void* residual;
  const void* weight;
  const float* mean;
  const float* rstd;
  int64_t rows;
  int hidden;
  const int64_t* seed;
  double dropout_p;
};

// The backward kernel for a layout, as a pointer: launched by run_bwd, and asked how many
// blocks fit on an SM by add_layernorm_bwd_partial_rows.
template <typename T, int VEC, bool DROPOUT>
const void* bwd_kernel_for(const Layout& layout) {
  switch (layout.lanes * 100 + layout.elements) {
    case 1608: return reinterpret_cast<const void*>(&add_layernorm_bwd_kernel<T, VEC, 16, 8, DROPOUT>);
    case 3208: return reinterpret_cast<const void*>(&add_layernorm_bwd_kernel<T, VEC, 32, 8, DROPOUT>);
    case 3216: return reinterpret_cast<const void*>(&add_layernorm_bwd_kernel<T, VEC, 32, 16, DROPOUT>);
    case 3224: return reinterpret_cast<const void*>(&add_layernorm_bwd_kernel<T, VEC, 32, 24, DROPOUT>);
    case 3232: return reinterpret_cast<const void*>(&add_layernorm_bwd_kernel<T, VEC, 32, 32, DROPOUT>);
    default: return reinterpret_cast<const void*>(&add_layernorm_bwd_kernel<T, VEC, 0, kRowBlockElements, DROPOUT>);
  }
}

template <typename T, int VEC>
const void* bwd_kernel_for(const Layout& layout, bool dropout) {
  return dropout ? bwd_kernel_for<T, VEC, true>(layout) : bwd_kernel_for<T, VEC, false>(layout);
}

// All variants share one signature, so the launch goes through the pointer.
template <typename T, int VEC>
cudaError_t run_bwd(const BwdArgs& a, const Layout& layout, cudaStream_t stream) {
  T* d_residual = static_cast<T*>(a.d_residual);
  T* d_x = static_cast<T*>(a.d_x);
  float* d_weight_partial = a.d_weight_partial;
  float* d_bias_partial = a.d_bias_partial;
  const T* grad = static_cast<const T*>(a.grad);
  const T* x = static_cast<const T*>(a.x);
  const T* residual = static_cast<const T*>(a.residual);
  const T* weight = static_cast<const T*>(a.weight);
  const float* mean = a.mean;
  const float* rstd = a.rstd;
  int64_t rows = a.rows;
  int hidden = a.hidden;
  const int64_t* seed = a.seed;
  float dropout_p = static_cast<float>(a.dropout_p);
  float keep_scale = keep_scale_of(a.dropout_p);
  void* args[] = {&d_residual, &d_x,      &d_weight_partial, &d_bias_partial, &grad, &x,         &residual,
                  &weight,     &mean,     &rstd,             &rows,           &hidden, &seed,    &dropout_p,
                  &keep_scale};
  return cudaLaunchKernel(bwd_kernel_for<T, VEC>(layout, a.dropout_p > 0.0),
                          dim3(static_cast<unsigned>(a.partial_rows)), dim3(layout.block_threads), args, 0, stream);
}

// d_weight / d_bias (hidden elements of T each; null: not wanted) from their partial rows.
template <typename T>
cudaError_t column_sums_typed(const BwdArgs& a, cudaStream_t stream) {
  ColumnSumParts<T> parts{};
  unsigned pairs = 0;
  if (a.d_weight != nullptr) {
    parts.partial[pairs] = a.d_weight_partial;
    parts.out[pairs++] = static_cast<T*>(a.d_weight);
  }
  if (a.d_bias != nullptr) {
    parts.partial[pairs] = a.d_bias_partial;
    parts.out[pairs++] = static_cast<T*>(a.d_bias);
  }
  if (pairs == 0) return cudaSuccess;
  const dim3 grid(static_cast<unsigned>((a.hidden + kColumnSumLanes - 1) / kColumnSumLanes), pairs);
  column_sums_kernel<T><<<grid, kColumnSumThreads, 0, stream>>>(parts, a.partial_rows, a.hidden);
  return cudaGetLastError();
}

// The backward kernel, then stage two.
template <typename T>
cudaError_t bwd_typed(const BwdArgs& a, cudaStream_t stream) {
  constexpr int kVec = kPack16<T>;
  const Layout layout = choose_layout(a.hidden, /*backward=*/true);
  const bool packed = a.hidden % kVec == 0 && is_aligned(a.d_residual, 16) && is_aligned(a.d_x, 16) &&
                      is_aligned(a.grad, 16) && is_aligned(a.x, 16) && is_aligned(a.residual, 16) &&
                      is_aligned(a.weight, 16);
  const cudaError_t error = packed ? run_bwd<T, kVec>(a, layout, stream) : run_bwd<T, 1>(a, layout, stream);
  return error != cudaSuccess ? error : column_sums_typed<T>(a, stream);
}

// The rows of the partial d_weight / d_bias buffers: the blocks of one full wave of the
// packed kernel (register use sets how many fit on an SM; more blocks would only queue
// behind the first wave and add partial rows), never more than there are row groups.
template <typename T>
cudaError_t partial_rows_typed(int64_t rows, int hidden, bool dropout, int device, int64_t* partial_rows) {
  const Layout layout = choose_layout(hidden, /*backward=*/true);
  const int64_t rows_per_block = layout.lanes > 0 ? layout.block_threads / layout.lanes : 1;
  int sm_count = 0, blocks_per_sm = 0;
  cudaError_t error = cudaDeviceGetAttribute(&sm_count, cudaDevAttrMultiProcessorCount, device);
  if (error != cudaSuccess) return error;
  error = cudaOccupancyMaxActiveBlocksPerMultiprocessor(
      &blocks_per_sm, bwd_kernel_for<T, kPack16<T>>(layout, dropout), layout.block_threads, 0);
  if (error != cudaSuccess) return error;
  const int64_t wave = static_cast<int64_t>(std::max(1, sm_count)) * std::max(1, blocks_per_sm);
  *partial_rows = std::max<int64_t>(1, std::min((rows + rows_per_block - 1) / rows_per_block, wave));
  return cudaSuccess;
}

bool valid_hidden(int64_t hidden) { return hidden >= 1 && hidden <= kAddLayerNormMaxHidden; }

}  // namespace

int launch_add_layernorm_fwd(DType dtype, void* out, float* mean, float* rstd, const void* x,
                             const void* residual, const void* weight, const void* bias, int64_t rows,
                             int64_t hidden, float eps, const int64_t* seed, double dropout_p,
                             cudaStream_t stream) {
  if (!valid_hidden(hidden) || rows < 0 || !(dropout_p >= 0.0 && dropout_p <= 1.0) ||
      (dropout_p > 0.0 && seed == nullptr)) {
    return cudaErrorInvalidValue;
  }
  if (rows == 0) return cudaSuccess;
  const FwdArgs args{out, mean, rstd, x, residual, weight, bias, rows, static_cast<int>(hidden), eps, seed, dropout_p};
  switch (dtype) {
    case DType::Float32: fwd_typed<float>(args, stream); break;
    case DType::Float16: fwd_typed<__half>(args, stream); break;
    case DType::BFloat16: fwd_typed<__nv_bfloat16>(args, stream); break;
    default: return cudaErrorInvalidValue;
  }
  return cudaGetLastError();
}

int add_layernorm_bwd_partial_rows(DType dtype, int64_t rows, int64_t hidden, double dropout_p, int device,
                                   int64_t* partial_rows) {
  if (!valid_hidden(hidden) || rows < 0 || partial_rows == nullptr) return cudaErrorInvalidValue;
  const bool dropout = dropout_p > 0.0;
  switch (dtype) {
    case DType::Float32: return partial_rows_typed<float>(rows, static_cast<int>(hidden), dropout, device, partial_rows);
    case DType::Float16: return partial_rows_typed<__half>(rows, static_cast<int>(hidden), dropout, device, partial_rows);
    case DType::BFloat16:
      return partial_rows_typed<__nv_bfloat16>(rows, static_cast<int>(hidden), dropout, device, partial_rows);
    default: return cudaErrorInvalidValue;
  }
}

int launch_add_layernorm_bwd(DType dtype, void* d_residual, void* d_x, void* d_weight, void* d_bias,
                             float* d_weight_partial, float* d_bias_partial, int64_t partial_rows, const void* grad,
                             const void* x, const void* residual, const void* weight, const float* mean,
                             const float* rstd, int64_t rows, int64_t hidden, const int64_t* seed, double dropout_p,
                             cudaStream_t stream) {
  const bool dropout = dropout_p > 0.0;
  if (!valid_hidden(hidden) || rows < 0 || partial_rows < 1 || partial_rows > INT32_MAX ||
      !(dropout_p >= 0.0 && dropout_p <= 1.0) || (dropout && (seed == nullptr || d_x == nullptr)) ||
      (d_weight == nullptr) != (d_weight_partial == nullptr) || (d_bias == nullptr) != (d_bias_partial == nullptr)) {
    return cudaErrorInvalidValue;
  }
  if (rows == 0) {
    // No rows: the sums are zeros (all-zero bits in every type here).
    const size_t bytes = static_cast<size_t>(hidden) * (dtype == DType::Float32 ? 4 : 2);
    if (d_weight) {
      const cudaError_t error = cudaMemsetAsync(d_weight, 0, bytes, stream);
      if (error != cudaSuccess) return error;
    }
    if (d_bias) return cudaMemsetAsync(d_bias, 0, bytes, stream);
    return cudaSuccess;
  }
  const BwdArgs args{d_residual, dropout ? d_x : nullptr, d_weight, d_bias, d_weight_partial, d_bias_partial,
                     partial_rows, grad, x, residual, weight, mean, rstd, rows, static_cast<int>(hidden), seed,
                     dropout_p};
  switch (dtype) {
    case DType::Float32: return bwd_typed<float>(args, stream);
    case DType::Float16: return bwd_typed<__half>(args, stream);
    case DType::BFloat16: return bwd_typed<__nv_bfloat16>(args, stream);
    default: return cudaErrorInvalidValue;
  }
}

}  // namespace bert_fast
