// CUDA kernels of ext_embedding_sum_fwd / ext_embedding_sum_bwd: the sum of the token, segment
// and position embeddings of each row, and its scatter-add backward. The math is that of
// _embedding_sum_fwd_cpu / _embedding_sum_bwd_cpu in bert_fast/ops/embedding.py; launch
// functions: kernels.h.
//
// Cost (R rows, H features, e bytes per element; memory-bound):
//   forward   reads 3 ids per row, R token rows (the one HBM stream), segment and position
//             rows (few distinct rows, L2 hits), writes R rows          -> ~2 R H e bytes.
//   backward  reads grad once (R H e) and adds it into fp32 tables with atomics: R H token
//             atomics at most (fewer, see below), R H / 128 segment atomics, R H position
//             atomics when the position table learns. The caller zeroes the buffers and casts
//             them back: V H (8 + e) bytes for the token table, often more than grad itself.
//
// Layout: a group of `lanes` threads (a warp, or 4-16 lanes for short rows) takes one row, lane
// l reading 16-byte packs l, l + lanes, ... (a warp reads 512 contiguous bytes per step).
// Forward: each group walks rows r = group, group + groups in grid, ...; it issues up to 4 packs
// of each table before storing, so each lane has 12 loads in flight.
// Backward: a block takes a tile of rows x (lanes packs of columns); each group walks 16
// consecutive rows of the tile. Two reductions before the atomics:
//   - segments: every row hits one of the 2 rows of the segment table, so unreduced atomics
//     on those 2 H addresses would serialise. Each thread sums its rows per segment (ids 0 and
//     1) in registers, the block adds its groups in shared memory (in group order), and one
//     atomic per (segment, column) leaves the block. Other in-range segment ids (tables with
//     more than 2 rows) are added with a direct atomic.
//   - tokens: consecutive rows with the same token (padding runs at the end of a sequence)
//     are summed in registers and added with one atomic per run.
// On sm_90+ the atomics move 4 floats at once (atomicAdd on float4) on the vector path.
//
// Ids out of range [0, n) are never dereferenced: in the forward that table contributes zeros
// to the row, in the backward the row adds nothing to that table. The module checks ranges
// before calling (a device-side check would need a host sync to report, and a device-side
// assert leaves the CUDA context unusable). The Triton kernels guard the same way.
#include "cuda_utils.cuh"
#include "kernels.h"

#include <algorithm>
#include <climits>
#include <cstdint>

namespace bert_fast {
namespace {

using cuda_utils::is_aligned;
using cuda_utils::kPack16;
using cuda_utils::load_floats;
using cuda_utils::store_floats;

constexpr int kFwdThreads = 256;
// Packs of each table a forward lane loads before it stores.
constexpr int kFwdUnroll = 4;
constexpr int kBwdThreads = 256;
// Rows a backward group walks: the longest token run one atomic carries.
constexpr int kBwdRowsPerGroup = 16;
// Rows whose loads a backward thread issues before it adds the first of them.
constexpr int kBwdPrefetchRows = 4;
// Segment ids summed in registers before the atomics (BERT has 2 segments).
constexpr int kReducedSegments = 2;

// Lanes per row: enough for one pack each, a power of two in [4, 32].
int lanes_for(int64_t n_packs) {
  int lanes = 4;
  while (lanes < 32 && lanes < n_packs) lanes *= 2;
  return lanes;
}

template <int N>
__device__ __forceinline__ void atomic_add_floats(float* dst, const float (&values)[N]) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  if constexpr (N % 4 == 0) {
    // The launcher takes the N > 1 path only with 16-byte aligned rows of the fp32 buffers.
#pragma unroll
    for (int q = 0; q < N / 4; ++q) {
      atomicAdd(reinterpret_cast<float4*>(dst) + q,
                make_float4(values[4 * q], values[4 * q + 1], values[4 * q + 2], values[4 * q + 3]));
    }
  } else
#endif
  {
#pragma unroll
    for (int k = 0; k < N; ++k) atomicAdd(dst + k, values[k]);
  }
}

template <typename T>
__device__ __forceinline__ const T* table_row(const T* table, int64_t id, int64_t n_rows, int64_t row_stride) {
  return id >= 0 && id < n_rows ? table + id * row_stride : nullptr;
}

template <typename T, int VEC>
__global__ void __launch_bounds__(kFwdThreads)
    embedding_sum_fwd_kernel(T* __restrict__ out, const int64_t* __restrict__ tokens,
                             const int64_t* __restrict__ segments, const int64_t* __restrict__ positions,
                             const T* __restrict__ token_weight, int64_t token_stride,
                             const T* __restrict__ segment_weight, int64_t segment_stride,
                             const T* __restrict__ pos_weight, int64_t pos_stride, int64_t rows, int64_t seq_len,
                             int hidden, int64_t n_tokens, int64_t n_segments, int64_t max_len, int lanes) {
  const int lane = threadIdx.x % lanes;
  const int64_t groups_per_block = blockDim.x / lanes;
  const int n_packs = hidden / VEC;
  for (int64_t row = blockIdx.x * groups_per_block + threadIdx.x / lanes; row < rows;
       row += static_cast<int64_t>(gridDim.x) * groups_per_block) {
    const T* token_row = table_row(token_weight, tokens[row], n_tokens, token_stride);
    const T* segment_row = table_row(segment_weight, segments[row], n_segments, segment_stride);
    const T* pos_row = table_row(pos_weight, positions ? positions[row] : row % seq_len, max_len, pos_stride);
    T* out_row = out + row * hidden;
    for (int first = lane; first < n_packs; first += kFwdUnroll * lanes) {
      float sum[kFwdUnroll][VEC];
#pragma unroll
      for (int u = 0; u < kFwdUnroll; ++u) {
        const int pack = first + u * lanes;
        if (pack >= n_packs) continue;
        float part[VEC];
        // (token + segment) + position, as the CPU twins add them.
        if (token_row) {
          load_floats<T, VEC>(token_row + pack * VEC, sum[u]);
        } else {
#pragma unroll
          for (int k = 0; k < VEC; ++k) sum[u][k] = 0.0f;
        }
        if (segment_row) {
          load_floats<T, VEC>(segment_row + pack * VEC, part);
#pragma unroll
          for (int k = 0; k < VEC; ++k) sum[u][k] += part[k];
        }
        if (pos_row) {
          load_floats<T, VEC>(pos_row + pack * VEC, part);
#pragma unroll
          for (int k = 0; k < VEC; ++k) sum[u][k] += part[k];
        }
      }
#pragma unroll
      for (int u = 0; u < kFwdUnroll; ++u) {
        const int pack = first + u * lanes;
        if (pack < n_packs) store_floats<T, VEC>(out_row + pack * VEC, sum[u]);
      }
    }
  }
}

template <typename T, int VEC>
__global__ void __launch_bounds__(kBwdThreads)
    embedding_sum_bwd_kernel(const T* __restrict__ grad, const int64_t* __restrict__ tokens,
                             const int64_t* __restrict__ segments, const int64_t* __restrict__ positions,
                             float* __restrict__ token_grad, float* __restrict__ segment_grad,
                             float* __restrict__ pos_grad, int64_t rows, int64_t seq_len, int hidden,
                             int64_t n_tokens, int64_t n_segments, int64_t max_len, int lanes) {
  const int lane = threadIdx.x % lanes;
  const int group = threadIdx.x / lanes;
  const int groups_per_block = blockDim.x / lanes;
  const int n_packs = hidden / VEC;
  const int pack = blockIdx.y * lanes + lane;
  const int64_t col = static_cast<int64_t>(pack) * VEC;
  const int64_t first_row =
      static_cast<int64_t>(blockIdx.x) * groups_per_block * kBwdRowsPerGroup + group * kBwdRowsPerGroup;
  const int64_t end_row = first_row + kBwdRowsPerGroup < rows ? first_row + kBwdRowsPerGroup : rows;

  float segment_sum[kReducedSegments][VEC];
#pragma unroll
  for (int s = 0; s < kReducedSegments; ++s) {
#pragma unroll
    for (int k = 0; k < VEC; ++k) segment_sum[s][k] = 0.0f;
  }

  if (pack < n_packs) {
    // The token of the rows summed in run_sum; -1 (never flushed: out of range) before the first.
    int64_t run_token = -1;
    float run_sum[VEC];
#pragma unroll
    for (int k = 0; k < VEC; ++k) run_sum[k] = 0.0f;
    for (int64_t chunk = first_row; chunk < end_row; chunk += kBwdPrefetchRows) {
      // Issue the loads of several rows before the atomics of the first.
      float g[kBwdPrefetchRows][VEC];
      int64_t token[kBwdPrefetchRows], segment[kBwdPrefetchRows], position[kBwdPrefetchRows];
#pragma unroll
      for (int u = 0; u < kBwdPrefetchRows; ++u) {
        const int64_t row = chunk + u;
        if (row >= end_row) break;
        load_floats<T, VEC>(grad + row * hidden + col, g[u]);
        token[u] = tokens[row];
        segment[u] = segments[row];
        position[u] = pos_grad == nullptr ? -1 : positions ? positions[row] : row % seq_len;
      }
#pragma unroll
      for (int u = 0; u < kBwdPrefetchRows; ++u) {
        if (chunk + u >= end_row) break;
        if (token[u] == run_token) {
#pragma unroll
          for (int k = 0; k < VEC; ++k) run_sum[k] += g[u][k];
        } else {
          if (run_token >= 0 && run_token < n_tokens) {
            atomic_add_floats<VEC>(token_grad + run_token * hidden + col, run_sum);
          }
          run_token = token[u];
#pragma unroll
          for (int k = 0; k < VEC; ++k) run_sum[k] = g[u][k];
        }
#pragma unroll
        for (int s = 0; s < kReducedSegments; ++s) {
#pragma unroll
          for (int k = 0; k < VEC; ++k) segment_sum[s][k] += segment[u] == s ? g[u][k] : 0.0f;
        }
        if (segment[u] >= kReducedSegments && segment[u] < n_segments) {
          atomic_add_floats<VEC>(segment_grad + segment[u] * hidden + col, g[u]);
        }
        // position is -1 when the position table gets no gradient.
        if (position[u] >= 0 && position[u] < max_len) {
          atomic_add_floats<VEC>(pos_grad + position[u] * hidden + col, g[u]);
        }
      }
    }
    if (run_token >= 0 && run_token < n_tokens) atomic_add_floats<VEC>(token_grad + run_token * hidden + col, run_sum);
  }

  // The groups of the block hold the same columns: add their segment sums in group order,
  // then one atomic per (segment, column), consecutive threads on consecutive columns.
  __shared__ float segment_shared[kReducedSegments][kBwdThreads * VEC];
#pragma unroll
  for (int s = 0; s < kReducedSegments; ++s) {
#pragma unroll
    for (int k = 0; k < VEC; ++k) segment_shared[s][threadIdx.x * VEC + k] = segment_sum[s][k];
  }
  __syncthreads();
  const int tile_width = lanes * VEC;   // columns of this block
  for (int out = threadIdx.x; out < kReducedSegments * tile_width; out += blockDim.x) {
    const int segment = out / tile_width;
    const int at = out % tile_width;    // = lane * VEC + k of the threads that hold it
    const int64_t column = static_cast<int64_t>(blockIdx.y) * tile_width + at;
    if (segment >= n_segments || column >= hidden) continue;
    float total = 0.0f;
    for (int g = 0; g < groups_per_block; ++g) total += segment_shared[segment][g * tile_width + at];
    atomicAdd(segment_grad + segment * hidden + column, total);
  }
}

struct FwdArgs {
  void* out;
  const int64_t* tokens;
  const int64_t* segments;
  const int64_t* positions;
  const void* token_weight;
  int64_t token_stride;
  const void* segment_weight;
  int64_t segment_stride;
  const void* pos_weight;
  int64_t pos_stride;
  int64_t rows;
  int64_t seq_len;
  int hidden;
  int64_t n_tokens;
  int64_t n_segments;
  int64_t max_len;
};

template <typename T, int VEC>
void run_fwd(const FwdArgs& a, cudaStream_t stream) {
  const int lanes = lanes_for(a.hidden / VEC);
  const int64_t rows_per_block = kFwdThreads / lanes;
  const int64_t blocks = std::min<int64_t>((a.rows + rows_per_block - 1) / rows_per_block, INT32_MAX);
  embedding_sum_fwd_kernel<T, VEC><<<static_cast<unsigned>(blocks), kFwdThreads, 0, stream>>>(
      static_cast<T*>(a.out), a.tokens, a.segments, a.positions, static_cast<const T*>(a.token_weight),
      a.token_stride, static_cast<const T*>(a.segment_weight), a.segment_stride,
      static_cast<const T*>(a.pos_weight), a.pos_stride, a.rows, a.seq_len, a.hidden, a.n_tokens, a.n_segments,
      a.max_len, lanes);
}

template <typename T>
void fwd_typed(const FwdArgs& a, cudaStream_t stream) {
  constexpr int kVec = kPack16<T>;
  const auto row_aligned = [](const void* table, int64_t stride) {
    return is_aligned(table, 16) && (stride * static_cast<int64_t>(sizeof(T))) % 16 == 0;
  };
  const bool packed = a.hidden % kVec == 0 && is_aligned(a.out, 16) && row_aligned(a.token_weight, a.token_stride) &&
                      row_aligned(a.segment_weight, a.segment_stride) && row_aligned(a.pos_weight, a.pos_stride);
  packed ? run_fwd<T, kVec>(a, stream) : run_fwd<T, 1>(a, stream);
}

struct BwdArgs {
  const void* grad;
  const int64_t* tokens;
  const int64_t* segments;
  const int64_t* positions;
  float* token_grad;
  float* segment_grad;
  float* pos_grad;
  int64_t rows;
  int64_t seq_len;
  int hidden;
  int64_t n_tokens;
  int64_t n_segments;
  int64_t max_len;
};

template <typename T, int VEC>
int run_bwd(const BwdArgs& a, cudaStream_t stream) {
  const int n_packs = a.hidden / VEC;
  const int lanes = lanes_for(n_packs);
  const int64_t rows_per_block = static_cast<int64_t>(kBwdThreads / lanes) * kBwdRowsPerGroup;
  const int64_t row_tiles = (a.rows + rows_per_block - 1) / rows_per_block;
  const int64_t column_tiles = (n_packs + lanes - 1) / lanes;
  if (row_tiles > INT32_MAX || column_tiles > 65535) return cudaErrorInvalidValue;
  const dim3 grid(static_cast<unsigned>(row_tiles), static_cast<unsigned>(column_tiles));
  embedding_sum_bwd_kernel<T, VEC><<<grid, kBwdThreads, 0, stream>>>(
      static_cast<const T*>(a.grad), a.tokens, a.segments, a.positions, a.token_grad, a.segment_grad, a.pos_grad,
      a.rows, a.seq_len, a.hidden, a.n_tokens, a.n_segments, a.max_len, lanes);
  return cudaSuccess;
}

template <typename T>
int bwd_typed(const BwdArgs& a, cudaStream_t stream) {
  constexpr int kVec = kPack16<T>;
  // The fp32 buffers' rows are 16-byte aligned too when hidden % kVec == 0 (kVec >= 4), which
  // the float4 atomics need.
  const bool packed = a.hidden % kVec == 0 && is_aligned(a.grad, 16) && is_aligned(a.token_grad, 16) &&
                      is_aligned(a.segment_grad, 16) && is_aligned(a.pos_grad, 16);
  return packed ? run_bwd<T, kVec>(a, stream) : run_bwd<T, 1>(a, stream);
}

}  // namespace

int launch_embedding_sum_fwd(DType dtype, void* out, const int64_t* tokens, const int64_t* segments,
                             const int64_t* positions, const void* token_weight, int64_t token_row_stride,
                             const void* segment_weight, int64_t segment_row_stride, const void* pos_weight,
                             int64_t pos_row_stride, int64_t rows, int64_t seq_len, int64_t hidden,
                             int64_t n_tokens, int64_t n_segments, int64_t max_len, cudaStream_t stream) {
  if (hidden < 1 || hidden > INT32_MAX || rows < 0 || (positions == nullptr && rows > 0 && seq_len < 1)) {
    return cudaErrorInvalidValue;
  }
  if (rows == 0) return cudaSuccess;
  const FwdArgs args{out,        tokens,         segments,         positions,           token_weight,
                     token_row_stride, segment_weight, segment_row_stride, pos_weight, pos_row_stride,
                     rows,       seq_len,        static_cast<int>(hidden), n_tokens, n_segments, max_len};
  switch (dtype) {
    case DType::Float32: fwd_typed<float>(args, stream); break;
    case DType::Float16: fwd_typed<__half>(args, stream); break;
    case DType::BFloat16: fwd_typed<__nv_bfloat16>(args, stream); break;
    default: return cudaErrorInvalidValue;
  }
  return cudaGetLastError();
}

int launch_embedding_sum_bwd(DType dtype, const void* grad, const int64_t* tokens, const int64_t* segments,
                             const int64_t* positions, float* token_grad, float* segment_grad, float* pos_grad,
                             int64_t rows, int64_t seq_len, int64_t hidden, int64_t n_tokens,
                             int64_t n_segments, int64_t max_len, cudaStream_t stream) {
  if (hidden < 1 || hidden > INT32_MAX || rows < 0 ||
      (positions == nullptr && pos_grad != nullptr && rows > 0 && seq_len < 1)) {
    return cudaErrorInvalidValue;
  }
  if (rows == 0) return cudaSuccess;
  const BwdArgs args{grad, tokens, segments, positions, token_grad, segment_grad, pos_grad, rows, seq_len,
                     static_cast<int>(hidden), n_tokens, n_segments, max_len};
  int error = cudaSuccess;
  switch (dtype) {
    case DType::Float32: error = bwd_typed<float>(args, stream); break;
    case DType::Float16: error = bwd_typed<__half>(args, stream); break;
    case DType::BFloat16: error = bwd_typed<__nv_bfloat16>(args, stream); break;
    default: return cudaErrorInvalidValue;
  }
  return error != cudaSuccess ? error : cudaGetLastError();
}

int kernel_image_status() {
  cudaFuncAttributes attributes;
  const cudaError_t status = cudaFuncGetAttributes(&attributes, embedding_sum_fwd_kernel<float, 1>);
  if (status != cudaSuccess) cudaGetLastError();   // a failed query must not fail the next launch check
  return status;
}

}  // namespace bert_fast
