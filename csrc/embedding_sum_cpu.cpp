// C++ CPU kernels of ext_embedding_sum_fwd / ext_embedding_sum_bwd (schemas and semantics:
// registration.cpp). They compute what the PyTorch CPU twins in bert_fast/ops/embedding.py
// compute, and check their inputs the same way, plus the id ranges (cheap on the CPU, and
// an out-of-range id would otherwise read or write outside a table).
//
// Forward: rows (one per token) split across threads; each row is three table rows added in
// the accumulation type (fp32, fp64 for fp64 tables) and stored in the tables' dtype.
// Backward: each thread owns a block of hidden columns and walks all rows in order, so every
// table-gradient element has one writer and one summation order (row order), whatever the
// thread count: deterministic, no atomics.
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/util/irange.h>
#include <torch/library.h>

#include <algorithm>
#include <optional>
#include <tuple>
#include <vector>

#include "op_checks.h"

namespace bert_fast {
namespace {

// Elements each thread takes at least (forward rows x H), so small inputs stay on one thread.
constexpr int64_t kGrainElements = 32768;
// Hidden columns per backward work item: 16 fp32 = one 64-byte cache line of the accumulators.
constexpr int64_t kColumnBlock = 16;

bool is_table_dtype(at::ScalarType dtype) {
  return dtype == at::kFloat || dtype == at::kDouble || dtype == at::kHalf || dtype == at::kBFloat16;
}

void check_on_cpu(const char* name, const at::Tensor& t) {
  TORCH_CHECK_VALUE(t.device().is_cpu(), name, " is on ", t.device(),
                    ", expected cpu like the other inputs (this is the CPU kernel)");
}

// The ids flattened to a contiguous int64 vector: one dtype for the loops, and the copy is
// N ids against N x H table elements.
at::Tensor flat_ids(const at::Tensor& ids) {
  return ids.reshape(-1).to(at::kLong).contiguous();
}

// An out-of-range id would read or write outside its table: report the first one.
void check_id_range(const char* name, const at::Tensor& ids, int64_t n_rows) {
  const int64_t* data = ids.const_data_ptr<int64_t>();
  for (const auto i : c10::irange(ids.numel())) {
    TORCH_CHECK_INDEX(data[i] >= 0 && data[i] < n_rows, name, " id ", data[i], " at flat index ", i,
                      " is out of range: the table has ", n_rows, " rows, so ids must be in [0, ",
                      n_rows, ")");
  }
}

// The three id tensors on the CPU, flattened to int64 and range-checked against their tables
// (positions undefined in the padded form).
struct FlatIds {
  at::Tensor tokens, segments, positions;
};

FlatIds checked_flat_ids(const at::Tensor& tokens, const at::Tensor& segments,
                         const std::optional<at::Tensor>& positions, int64_t n_tokens, int64_t n_segments,
                         int64_t max_len) {
  check_on_cpu("tokens", tokens);
  check_on_cpu("segments", segments);
  if (positions.has_value()) check_on_cpu("positions", *positions);
  FlatIds ids{flat_ids(tokens), flat_ids(segments), positions.has_value() ? flat_ids(*positions) : at::Tensor()};
  check_id_range("tokens", ids.tokens, n_tokens);
  check_id_range("segments", ids.segments, n_segments);
  if (ids.positions.defined()) check_id_range("positions", ids.positions, max_len);
  return ids;
}

// A table with unit stride along H, read through its row stride (a copy only if it has none).
at::Tensor unit_column_stride(const at::Tensor& table) {
  return table.stride(-1) == 1 ? table : table.contiguous();
}

// out = (token + segment) + position, the twin's order, in acc_t.
template <typename scalar_t>
void sum_table_rows(const scalar_t* __restrict__ token_row, const scalar_t* __restrict__ segment_row,
                    const scalar_t* __restrict__ pos_row, scalar_t* __restrict__ out_row, int64_t hidden) {
  using acc_t = at::opmath_type<scalar_t>;
  for (int64_t col = 0; col < hidden; ++col) {
    const acc_t sum = static_cast<acc_t>(token_row[col]) + static_cast<acc_t>(segment_row[col]) +
                      static_cast<acc_t>(pos_row[col]);
    out_row[col] = static_cast<scalar_t>(sum);
  }
}

template <typename scalar_t, typename acc_t>
void accumulate_row(const scalar_t* __restrict__ grad_row, acc_t* __restrict__ sum_row, int64_t width) {
  for (int64_t col = 0; col < width; ++col) sum_row[col] += static_cast<acc_t>(grad_row[col]);
}

at::Tensor embedding_sum_fwd_cpu(const at::Tensor& tokens, const at::Tensor& segments,
                                 const at::Tensor& token_weight, const at::Tensor& segment_weight,
                                 const at::Tensor& pos_weight, const std::optional<at::Tensor>& positions) {
  check_indices(tokens, segments, positions);
  check_tables(token_weight, segment_weight, pos_weight);
  const int64_t hidden = token_weight.size(1);
  TORCH_CHECK_TYPE(is_table_dtype(token_weight.scalar_type()),
                   "the C++ embedding_sum takes float32, float64, float16 or bfloat16 tables, got ",
                   token_weight.scalar_type());
  const int64_t max_len = pos_weight.size(1);
  check_max_len(tokens, max_len);
  check_on_cpu("token_weight", token_weight);
  check_on_cpu("segment_weight", segment_weight);
  check_on_cpu("pos_weight", pos_weight);
  // Named references, not structured bindings: the kernels' lambdas capture them.
  const FlatIds ids = checked_flat_ids(tokens, segments, positions, token_weight.size(0), segment_weight.size(0), max_len);
  const at::Tensor &token_ids = ids.tokens, &segment_ids = ids.segments, &position_ids = ids.positions;

  const at::Tensor token_table = unit_column_stride(token_weight);
  const at::Tensor segment_table = unit_column_stride(segment_weight);
  const at::Tensor pos_table = unit_column_stride(pos_weight);
  const int64_t n_rows = token_ids.numel();
  const int64_t seq_len = tokens.size(-1);
  std::vector<int64_t> out_shape(tokens.sizes().begin(), tokens.sizes().end());
  out_shape.push_back(hidden);
  at::Tensor out = at::empty(out_shape, token_weight.options().memory_format(at::MemoryFormat::Contiguous));
  if (n_rows == 0) return out;

  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, token_weight.scalar_type(), "ext_embedding_sum_fwd", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    const scalar_t* token_data = token_table.const_data_ptr<scalar_t>();
    const scalar_t* segment_data = segment_table.const_data_ptr<scalar_t>();
    const scalar_t* pos_data = pos_table.const_data_ptr<scalar_t>();
    const int64_t token_stride = token_table.stride(0);
    const int64_t segment_stride = segment_table.stride(0);
    const int64_t pos_stride = pos_table.stride(1);
    const int64_t* token_id = token_ids.const_data_ptr<int64_t>();
    const int64_t* segment_id = segment_ids.const_data_ptr<int64_t>();
    const int64_t* position_id = position_ids.defined() ? position_ids.const_data_ptr<int64_t>() : nullptr;
    scalar_t* out_data = out.mutable_data_ptr<scalar_t>();
    const int64_t grain = std::max<int64_t>(1, kGrainElements / hidden);
    at::parallel_for(0, n_rows, grain, [&](int64_t begin, int64_t end) {
      for (int64_t row = begin; row < end; ++row) {
        const scalar_t* token_row = token_data + token_id[row] * token_stride;
        const scalar_t* segment_row = segment_data + segment_id[row] * segment_stride;
        const int64_t position = position_id ? position_id[row] : row % seq_len;
        const scalar_t* pos_row = pos_data + position * pos_stride;
        sum_table_rows(token_row, segment_row, pos_row, out_data + row * hidden, hidden);
      }
    });
  });
  return out;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> embedding_sum_bwd_cpu(
    const at::Tensor& grad_out, const at::Tensor& tokens, const at::Tensor& segments,
    const std::optional<at::Tensor>& positions, int64_t n_tokens, int64_t n_segments, int64_t max_len,
    bool learn_pos_embedding) {
  check_indices(tokens, segments, positions);
  check_embedding_grad(grad_out, tokens, n_tokens, n_segments, max_len);
  const int64_t hidden = grad_out.size(-1);
  TORCH_CHECK_TYPE(is_table_dtype(grad_out.scalar_type()),
                   "the C++ embedding_sum takes float32, float64, float16 or bfloat16 gradients, got ",
                   grad_out.scalar_type());
  check_on_cpu("grad_out", grad_out);
  // Named references, not structured bindings: the kernels' lambdas capture them.
  const FlatIds ids = checked_flat_ids(tokens, segments, positions, n_tokens, n_segments, max_len);
  const at::Tensor &token_ids = ids.tokens, &segment_ids = ids.segments, &position_ids = ids.positions;

  const at::ScalarType dtype = grad_out.scalar_type();
  const at::ScalarType acc_dtype = dtype == at::kDouble ? at::kDouble : at::kFloat;
  const auto acc_options = grad_out.options().dtype(acc_dtype);
  // Padded and packed forms alike scatter into a (max_len, H) position buffer: padded row
  // r reads position r % L, so the batch sum lands in rows < L and the rest stay zero.
  at::Tensor token_acc = at::zeros({n_tokens, hidden}, acc_options);
  at::Tensor segment_acc = at::zeros({n_segments, hidden}, acc_options);
  at::Tensor pos_acc = learn_pos_embedding ? at::zeros({max_len, hidden}, acc_options) : at::Tensor();
  const at::Tensor grad = grad_out.contiguous();
  const int64_t n_rows = token_ids.numel();
  const int64_t seq_len = tokens.size(-1);

  if (n_rows > 0) {
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, dtype, "ext_embedding_sum_bwd", [&] {
      using acc_t = at::opmath_type<scalar_t>;
      const scalar_t* grad_data = grad.const_data_ptr<scalar_t>();
      const int64_t* token_id = token_ids.const_data_ptr<int64_t>();
      const int64_t* segment_id = segment_ids.const_data_ptr<int64_t>();
      const int64_t* position_id = position_ids.defined() ? position_ids.const_data_ptr<int64_t>() : nullptr;
      acc_t* token_sum = token_acc.mutable_data_ptr<acc_t>();
      acc_t* segment_sum = segment_acc.mutable_data_ptr<acc_t>();
      acc_t* pos_sum = pos_acc.defined() ? pos_acc.mutable_data_ptr<acc_t>() : nullptr;
      const int64_t n_blocks = (hidden + kColumnBlock - 1) / kColumnBlock;
      at::parallel_for(0, n_blocks, 1, [&](int64_t block_begin, int64_t block_end) {
        const int64_t col_begin = block_begin * kColumnBlock;
        const int64_t col_end = std::min(hidden, block_end * kColumnBlock);
        const int64_t width = col_end - col_begin;
        for (int64_t row = 0; row < n_rows; ++row) {
          const scalar_t* grad_row = grad_data + row * hidden + col_begin;
          accumulate_row(grad_row, token_sum + token_id[row] * hidden + col_begin, width);
          accumulate_row(grad_row, segment_sum + segment_id[row] * hidden + col_begin, width);
          if (pos_sum) {
            const int64_t position = position_id ? position_id[row] : row % seq_len;
            accumulate_row(grad_row, pos_sum + position * hidden + col_begin, width);
          }
        }
      });
    });
  }
  // .to is a no-op for fp32 / fp64, where the accumulators already are the outputs.
  at::Tensor pos_grad = learn_pos_embedding ? pos_acc.to(dtype).view({1, max_len, hidden})
                                            : at::empty({0}, grad_out.options());
  return {token_acc.to(dtype), segment_acc.to(dtype), pos_grad};
}

}  // namespace
}  // namespace bert_fast

TORCH_LIBRARY_IMPL(bert_fast, CPU, m) {
  m.impl("ext_embedding_sum_fwd", &bert_fast::embedding_sum_fwd_cpu);
  m.impl("ext_embedding_sum_bwd", &bert_fast::embedding_sum_bwd_cpu);
}
