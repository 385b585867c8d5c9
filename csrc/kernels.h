// The CUDA kernels' launch functions: plain C++ (pointers, sizes, a stream), so the .cu files
// need only CUDA's own headers and compile with `nvcc -c`, and the PyTorch glue (cuda_ops.cpp)
// needs no CUDA code. Including this header needs neither torch nor CUDA headers.
//
// Every launcher enqueues its kernels on `stream` and returns a cudaError_t value (0 = success;
// cudaErrorInvalidValue for arguments it cannot take). Nothing synchronises with the host.
// Shared rules:
//   - `rows` may be 0 (nothing is launched) or any positive count.
//   - Row-major data: row r of an (rows, hidden) tensor starts at element r * hidden, except
//     the embedding tables, which are read through a row stride (in elements).
//   - 16-byte vector loads/stores are used when hidden and every pointer allow them; any other
//     alignment (a storage offset of one element, hidden = 100 in fp16) takes the scalar path.
//   - Sums and statistics are fp32 whatever the element type.
#pragma once
#include <cstdint>

// The runtime's stream handle, declared as cuda_runtime_api.h declares it (a repeated typedef
// of the same type is fine in C++).
struct CUstream_st;
typedef struct CUstream_st* cudaStream_t;

namespace bert_fast {

enum class DType { Float32, Float16, BFloat16 };

// add_layernorm's largest hidden size: a row lives in registers (16 values per thread on at
// most 512 threads). The same bound as the Triton kernels' MAX_HIDDEN.
constexpr int64_t kAddLayerNormMaxHidden = 8192;

// out[r] = token_weight[tokens[r]] + segment_weight[segments[r]] + pos_weight[position(r)],
// summed in fp32 in that order and rounded once. position(r) = positions[r], or r % seq_len
// when positions is null (the padded (B, L) form flattened to rows = B * L).
// Ids must be in range (the module checks them once per batch); an id out of its table's
// range [0, n) is not read: that table contributes zeros to the row, so a bad id gives a wrong
// row, never a fault.
int launch_embedding_sum_fwd(DType dtype, void* out, const int64_t* tokens, const int64_t* segments,
                             const int64_t* positions, const void* token_weight, int64_t token_row_stride,
                             const void* segment_weight, int64_t segment_row_stride, const void* pos_weight,
                             int64_t pos_row_stride, int64_t rows, int64_t seq_len, int64_t hidden,
                             int64_t n_tokens, int64_t n_segments, int64_t max_len, cudaStream_t stream);

// Adds grad row r into token_grad[tokens[r]], segment_grad[segments[r]] and, when pos_grad is
// not null, pos_grad[position(r)] (position(r) as in the forward). The fp32 (n, hidden)
// buffers must be zeroed by the caller; the sums use atomics, so their order (and the last
// bits) can change between calls. Out-of-range ids add nothing.
int launch_embedding_sum_bwd(DType dtype, const void* grad, const int64_t* tokens, const int64_t* segments,
                             const int64_t* positions, float* token_grad, float* segment_grad, float* pos_grad,
                             int64_t rows, int64_t seq_len, int64_t hidden, int64_t n_tokens,
                             int64_t n_segments, int64_t max_len, cudaStream_t stream);

// out = LayerNorm(residual + dropout(x)) row by row, with mean and rstd (fp32, one per row).
// weight and bias may be null (no scale / no shift). Dropout runs when dropout_p > 0: the seed
// is read on the device from `seed` (one int64), element (r, c) is kept iff
// philox.h's dropout_keep(seed, r, c, hidden, dropout_p), kept values are scaled by
// 1 / (1 - dropout_p) (computed in double, rounded to fp32; p is compared in fp32, as the
// Triton kernels get them). hidden must be in [1, kAddLayerNormMaxHidden].
int launch_add_layernorm_fwd(DType dtype, void* out, float* mean, float* rstd, const void* x,
                             const void* residual, const void* weight, const void* bias, int64_t rows,
                             int64_t hidden, float eps, const int64_t* seed, double dropout_p,
                             cudaStream_t stream);

// How many blocks the backward runs on `device` (a CUDA device index), which is the number of
// rows of its fp32 partial d_weight / d_bias buffers (*partial_rows, hidden): one wave of
// blocks (as many as fit on the GPU at once), fewer for few rows, at least 1.
int add_layernorm_bwd_partial_rows(DType dtype, int64_t rows, int64_t hidden, double dropout_p, int device,
                                   int64_t* partial_rows);

// The backward of launch_add_layernorm_fwd, from the forward's mean/rstd (the sum is
// recomputed, with the forward's dropout mask). Writes d_residual (rows, hidden); d_x only
// when dropout_p > 0 (d_x = d_residual * keep / (1 - p)); otherwise d_x may be null.
// d_weight / d_bias (hidden elements of dtype; may be null: not wanted) each need a scratch
// buffer, d_weight_partial / d_bias_partial (partial_rows, hidden) fp32 (null exactly when the
// gradient is): the kernel writes one fp32 row of column sums per block there, then a second
// launch sums the rows in a fixed order and rounds once to dtype. partial_rows: from
// add_layernorm_bwd_partial_rows, or any other count >= 1 (the blocks stride over the rows).
int launch_add_layernorm_bwd(DType dtype, void* d_residual, void* d_x, void* d_weight, void* d_bias,
                             float* d_weight_partial, float* d_bias_partial, int64_t partial_rows, const void* grad,
                             const void* x, const void* residual, const void* weight, const float* mean,
                             const float* rstd, int64_t rows, int64_t hidden, const int64_t* seed, double dropout_p,
                             cudaStream_t stream);

// 0 (cudaSuccess) when the current GPU can run this build's kernels: they hold machine code
// for its architecture, or PTX its driver compiles. Else the runtime's error, e.g.
// cudaErrorNoKernelImageForDevice for a GPU the extension was not built for (setup.py's
// BERT_FAST_CUDA_ARCHS). Every .cu file is compiled for the same architectures, so one kernel
// answers for all. Launches nothing and leaves no error behind for the next launch check.
int kernel_image_status();

}  // namespace bert_fast
