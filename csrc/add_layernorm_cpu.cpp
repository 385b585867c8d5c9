// C++ CPU kernels of ext_add_layernorm_fwd / ext_add_layernorm_bwd (schemas and semantics:
// registration.cpp): LayerNorm(residual + dropout(x)) over the last dim H, the drop-in
// replacements of the PyTorch CPU twins in bert_fast/ops/add_layernorm.py, with the dropout
// mask of philox.h (four columns a Philox call), so they match the Triton and CUDA kernels.
//
// Rows are split across threads. Each row is loaded once into an fp32 (fp64 for fp64 inputs)
// scratch row, and its statistics are two passes over that row (mean, then the population
// variance of the centred values, like torch.var_mean(correction=0)).
// The sums over H use a fixed number of independent lanes (lane_sum below): the compiler
// turns them into vector adds without -ffast-math, and the summation order is fixed by the
// source, not by the ISA or thread count.
// Backward: d_weight / d_bias are sums over rows. Rows are cut into chunks whose size depends
// on the row count only; each chunk writes one fp32 partial row, and the partial rows are added
// in chunk order: the result does not depend on the number of threads.
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <optional>
#include <tuple>
#include <vector>

#include "op_checks.h"
#include "philox.h"

namespace bert_fast {
namespace {

// Elements each thread takes at least (rows x H), so small inputs stay on one thread.
constexpr int64_t kGrainElements = 16384;
// Backward reduction: at most this many partial rows, and at least kMinChunkRows rows each.
constexpr int64_t kMaxChunks = 256;
constexpr int64_t kMinChunkRows = 8;

// Independent partial sums, one per lane, added at the end: vectorisable and reproducible.
template <typename acc_t>
constexpr int kLanes = 32 / sizeof(acc_t);

template <typename acc_t>
acc_t add_lanes(const acc_t (&lanes)[kLanes<acc_t>]) {
  acc_t total = 0;
  for (int lane = 0; lane < kLanes<acc_t>; ++lane) total += lanes[lane];
  return total;
}

template <typename acc_t>
acc_t lane_sum(const acc_t* values, int64_t n) {
  acc_t lanes[kLanes<acc_t>] = {};
  int64_t i = 0;
  for (; i + kLanes<acc_t> <= n; i += kLanes<acc_t>)
    for (int lane = 0; lane < kLanes<acc_t>; ++lane) lanes[lane] += values[i + lane];
  acc_t total = add_lanes(lanes);
  for (; i < n; ++i) total += values[i];
  return total;
}

// Sum of (values - mean)^2.
template <typename acc_t>
acc_t lane_centered_square_sum(const acc_t* values, acc_t mean, int64_t n) {
  acc_t lanes[kLanes<acc_t>] = {};
  int64_t i = 0;
  for (; i + kLanes<acc_t> <= n; i += kLanes<acc_t>)
    for (int lane = 0; lane < kLanes<acc_t>; ++lane) {
      const acc_t centered = values[i + lane] - mean;
      lanes[lane] += centered * centered;
    }
  acc_t total = add_lanes(lanes);
  for (; i < n; ++i) total += (values[i] - mean) * (values[i] - mean);
  return total;
}

// Sums of a and of a * b.
template <typename acc_t>
void lane_sum_and_dot(const acc_t* a, const acc_t* b, int64_t n, acc_t& sum_a, acc_t& sum_ab) {
  acc_t lanes_a[kLanes<acc_t>] = {}, lanes_ab[kLanes<acc_t>] = {};
  int64_t i = 0;
  for (; i + kLanes<acc_t> <= n; i += kLanes<acc_t>)
    for (int lane = 0; lane < kLanes<acc_t>; ++lane) {
      lanes_a[lane] += a[i + lane];
      lanes_ab[lane] += a[i + lane] * b[i + lane];
    }
  sum_a = add_lanes(lanes_a);
  sum_ab = add_lanes(lanes_ab);
  for (; i < n; ++i) {
    sum_a += a[i];
    sum_ab += a[i] * b[i];
  }
}

// What was kept of x is scaled by 1 / (1 - p); p == 1 drops everything (scale 0), like the
// Python twins' _keep_scale.
double keep_scale(double dropout_p) {
  return dropout_p < 1.0 ? 1.0 / (1.0 - dropout_p) : 0.0;
}

// keep[col] = the factor element (row, col) of x is multiplied by: the keep scale where philox.h
// keeps it, 0 where it drops it. One Philox call a group of four columns (the last group's
// columns past the row's end drawn and left out). A loop of its own, so the compiler
// vectorises the Philox rounds.
template <typename acc_t>
void dropout_factors(uint64_t seed, int64_t row, float dropout_p, acc_t scale, acc_t* __restrict__ keep,
                     int64_t hidden) {
  for (int64_t col = 0; col < hidden; col += 4) {
    bool group[4];
    dropout_keep4(seed, row, col, hidden, dropout_p, group);
    for (int64_t k = 0; k < 4 && col + k < hidden; ++k) keep[col + k] = group[k] ? scale : acc_t(0);
  }
}

// One row of residual + dropout(x) in the accumulation type; with dropout, keep receives the
// row's dropout factors (for the backward's d_x).
template <typename scalar_t, typename acc_t>
void load_dropped_sum(const scalar_t* __restrict__ x_row, const scalar_t* __restrict__ residual_row, int64_t row,
                      int64_t hidden, bool has_dropout, uint64_t seed, float dropout_p, acc_t scale,
                      acc_t* __restrict__ sum, acc_t* __restrict__ keep) {
  if (!has_dropout) {
    for (int64_t col = 0; col < hidden; ++col)
      sum[col] = static_cast<acc_t>(residual_row[col]) + static_cast<acc_t>(x_row[col]);
    return;
  }
  dropout_factors(seed, row, dropout_p, scale, keep, hidden);
  // A select, not x * 0, so a dropped inf or nan in x leaves no nan (like the Triton kernel).
  for (int64_t col = 0; col < hidden; ++col) {
    const acc_t scaled_x = static_cast<acc_t>(x_row[col]) * scale;
    sum[col] = static_cast<acc_t>(residual_row[col]) + (keep[col] != acc_t(0) ? scaled_x : acc_t(0));
  }
}

// out = (sum - mean) * rstd * weight + bias, with weight 1 and bias 0 when absent.
template <typename scalar_t, typename acc_t>
void normalize_row(const acc_t* __restrict__ sum, acc_t mean, acc_t rstd, const acc_t* __restrict__ weight,
                   const acc_t* __restrict__ bias, scalar_t* __restrict__ out_row, int64_t hidden) {
  for (int64_t col = 0; col < hidden; ++col)
    out_row[col] = static_cast<scalar_t>((sum[col] - mean) * rstd * weight[col] + bias[col]);
}

// In place: sum -> x_hat; also dy in acc_t and d_x_hat = dy * weight.
template <typename scalar_t, typename acc_t>
void x_hat_and_d_x_hat(const scalar_t* __restrict__ grad_row, acc_t mean, acc_t rstd,
                       const acc_t* __restrict__ weight, acc_t* __restrict__ x_hat, acc_t* __restrict__ dy,
                       acc_t* __restrict__ d_x_hat, int64_t hidden) {
  for (int64_t col = 0; col < hidden; ++col) {
    x_hat[col] = (x_hat[col] - mean) * rstd;
    dy[col] = static_cast<acc_t>(grad_row[col]);
    d_x_hat[col] = dy[col] * weight[col];
  }
}

template <typename acc_t>
void accumulate_product(const acc_t* __restrict__ a, const acc_t* __restrict__ b, acc_t* __restrict__ total,
                        int64_t hidden) {
  for (int64_t col = 0; col < hidden; ++col) total[col] += a[col] * b[col];
}

template <typename acc_t>
void accumulate(const acc_t* __restrict__ a, acc_t* __restrict__ total, int64_t hidden) {
  for (int64_t col = 0; col < hidden; ++col) total[col] += a[col];
}

// d_sum = rstd * (d_x_hat - mean(d_x_hat) - x_hat * mean(d_x_hat * x_hat)), stored as
// d_residual and, with dropout, times keep (0 or the keep scale) as d_x.
template <typename scalar_t, typename acc_t>
void store_d_sum(const acc_t* __restrict__ x_hat, const acc_t* __restrict__ d_x_hat, acc_t rstd,
                 acc_t mean_d_x_hat, acc_t mean_d_x_hat_x_hat, const acc_t* __restrict__ keep,
                 scalar_t* __restrict__ d_residual_row, scalar_t* __restrict__ d_x_row, int64_t hidden) {
  if (d_x_row == nullptr) {
    for (int64_t col = 0; col < hidden; ++col)
      d_residual_row[col] =
          static_cast<scalar_t>((d_x_hat[col] - mean_d_x_hat - x_hat[col] * mean_d_x_hat_x_hat) * rstd);
    return;
  }
  for (int64_t col = 0; col < hidden; ++col) {
    const acc_t d_sum = (d_x_hat[col] - mean_d_x_hat - x_hat[col] * mean_d_x_hat_x_hat) * rstd;
    d_residual_row[col] = static_cast<scalar_t>(d_sum);
    d_x_row[col] = static_cast<scalar_t>(d_sum * keep[col]);
  }
}

template <typename scalar_t, typename acc_t>
void convert_row(const scalar_t* __restrict__ values, acc_t* __restrict__ converted, int64_t hidden) {
  for (int64_t col = 0; col < hidden; ++col) converted[col] = static_cast<acc_t>(values[col]);
}

// _check_fwd_inputs of add_layernorm.py (without the Triton H limit), for x on the CPU.
void check_inputs(const at::Tensor& x, const at::Tensor& residual, const std::optional<at::Tensor>& weight,
                  const std::optional<at::Tensor>& bias, double dropout_p) {
  check_layernorm_shapes(x, residual, weight, bias);
  const at::ScalarType dtype = x.scalar_type();
  TORCH_CHECK_TYPE(dtype == at::kFloat || dtype == at::kDouble || dtype == at::kHalf || dtype == at::kBFloat16,
                   "the C++ add_layernorm takes float32, float64, float16 or bfloat16, got ", dtype);
  TORCH_CHECK_VALUE(x.device().is_cpu(), "x is on ", x.device(), ", expected cpu (this is the CPU kernel)");
  check_like_x(x, residual, weight, bias);
  check_dropout_p(dropout_p);
}

// The seed as philox.h takes it (the bits of the int64), checked only when dropout is on.
uint64_t read_seed(const std::optional<at::Tensor>& seed, double dropout_p) {
  check_seed(seed, dropout_p, at::Device(at::kCPU));
  if (dropout_p <= 0.0) return 0;
  return static_cast<uint64_t>(*seed->const_data_ptr<int64_t>());
}

at::ScalarType stats_dtype(at::ScalarType dtype) {
  return dtype == at::kDouble ? at::kDouble : at::kFloat;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> add_layernorm_fwd_cpu(
    const at::Tensor& x, const at::Tensor& residual, const std::optional<at::Tensor>& weight,
    const std::optional<at::Tensor>& bias, double eps, const std::optional<at::Tensor>& seed, double dropout_p) {
  check_inputs(x, residual, weight, bias, dropout_p);
  const uint64_t seed_bits = read_seed(seed, dropout_p);
  const int64_t hidden = x.size(-1);
  const int64_t n_rows = x.numel() / hidden;
  const at::Tensor x_rows = x.contiguous(), residual_rows = residual.contiguous();
  const at::Tensor weight_vec = weight.has_value() ? weight->contiguous() : at::Tensor();
  const at::Tensor bias_vec = bias.has_value() ? bias->contiguous() : at::Tensor();
  at::Tensor out = at::empty(x.sizes(), x.options().memory_format(at::MemoryFormat::Contiguous));
  const auto stats_options = x.options().dtype(stats_dtype(x.scalar_type()));
  at::Tensor mean = at::empty({n_rows}, stats_options);
  at::Tensor rstd = at::empty({n_rows}, stats_options);
  if (n_rows == 0) return {out, mean, rstd};
  const bool has_dropout = dropout_p > 0.0;

  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "ext_add_layernorm_fwd", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    const scalar_t* x_data = x_rows.const_data_ptr<scalar_t>();
    const scalar_t* residual_data = residual_rows.const_data_ptr<scalar_t>();
    const scalar_t* weight_data = weight_vec.defined() ? weight_vec.const_data_ptr<scalar_t>() : nullptr;
    const scalar_t* bias_data = bias_vec.defined() ? bias_vec.const_data_ptr<scalar_t>() : nullptr;
    scalar_t* out_data = out.mutable_data_ptr<scalar_t>();
    acc_t* mean_data = mean.mutable_data_ptr<acc_t>();
    acc_t* rstd_data = rstd.mutable_data_ptr<acc_t>();
    const acc_t scale = static_cast<acc_t>(keep_scale(dropout_p));
    const acc_t eps_acc = static_cast<acc_t>(eps);
    const float p = static_cast<float>(dropout_p);
    const int64_t grain = std::max<int64_t>(1, kGrainElements / hidden);
    at::parallel_for(0, n_rows, grain, [&](int64_t begin, int64_t end) {
      std::vector<acc_t> sum(hidden), keep(has_dropout ? hidden : 0);
      // The affine parameters in the accumulation type, converted once per thread.
      std::vector<acc_t> w(hidden, acc_t(1)), b(hidden, acc_t(0));
      if (weight_data) convert_row(weight_data, w.data(), hidden);
      if (bias_data) convert_row(bias_data, b.data(), hidden);
      for (int64_t row = begin; row < end; ++row) {
        acc_t* s = sum.data();
        load_dropped_sum(x_data + row * hidden, residual_data + row * hidden, row, hidden, has_dropout, seed_bits,
                         p, scale, s, keep.data());
        const acc_t row_mean = lane_sum(s, hidden) / static_cast<acc_t>(hidden);
        const acc_t var = lane_centered_square_sum(s, row_mean, hidden) / static_cast<acc_t>(hidden);
        const acc_t row_rstd = acc_t(1) / std::sqrt(var + eps_acc);
        mean_data[row] = row_mean;
        rstd_data[row] = row_rstd;
        normalize_row(s, row_mean, row_rstd, w.data(), b.data(), out_data + row * hidden, hidden);
      }
    });
  });
  return {out, mean, rstd};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> add_layernorm_bwd_cpu(
    const at::Tensor& grad_out, const at::Tensor& x, const at::Tensor& residual,
    const std::optional<at::Tensor>& weight, const at::Tensor& mean, const at::Tensor& rstd,
    const std::optional<at::Tensor>& seed, double dropout_p, bool has_bias) {
  check_inputs(x, residual, weight, std::nullopt, dropout_p);
  check_grad_like_x(grad_out, x);
  const int64_t hidden = x.size(-1);
  const int64_t n_rows = x.numel() / hidden;
  const at::ScalarType stats = stats_dtype(x.scalar_type());
  for (const auto& [name, t] : {std::pair{"mean", &mean}, std::pair{"rstd", &rstd}}) {
    TORCH_CHECK_VALUE(t->dim() == 1 && t->size(0) == n_rows && t->scalar_type() == stats, name,
                      " must be the forward's ",
                      stats, " (", n_rows, ",) tensor, got ", t->scalar_type(), " ", shape_str(*t));
    check_on_device_of_x(name, *t, x);
  }
  const uint64_t seed_bits = read_seed(seed, dropout_p);
  const bool has_dropout = dropout_p > 0.0;
  const bool has_weight = weight.has_value();
  const at::Tensor grad_rows = grad_out.contiguous(), x_rows = x.contiguous(), residual_rows = residual.contiguous();
  const at::Tensor weight_vec = has_weight ? weight->contiguous() : at::Tensor();
  const at::Tensor mean_vec = mean.contiguous(), rstd_vec = rstd.contiguous();
  const auto options = x.options().memory_format(at::MemoryFormat::Contiguous);
  at::Tensor d_residual = at::empty(x.sizes(), options);
  at::Tensor d_x = has_dropout ? at::empty(x.sizes(), options) : at::empty({0}, options);
  at::Tensor d_weight = at::empty({has_weight ? hidden : 0}, options);
  at::Tensor d_bias = at::empty({has_bias ? hidden : 0}, options);

  // Fixed chunking (a function of n_rows only) for the row sums of d_weight and d_bias.
  const int64_t chunk_rows = std::max(kMinChunkRows, (n_rows + kMaxChunks - 1) / kMaxChunks);
  const int64_t n_chunks = (n_rows + chunk_rows - 1) / chunk_rows;
  const auto stats_options = x.options().dtype(stats);
  at::Tensor d_weight_partial = at::empty({has_weight ? n_chunks : 0, hidden}, stats_options);
  at::Tensor d_bias_partial = at::empty({has_bias ? n_chunks : 0, hidden}, stats_options);

  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "ext_add_layernorm_bwd", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    const scalar_t* grad_data = grad_rows.const_data_ptr<scalar_t>();
    const scalar_t* x_data = x_rows.const_data_ptr<scalar_t>();
    const scalar_t* residual_data = residual_rows.const_data_ptr<scalar_t>();
    const scalar_t* weight_data = has_weight ? weight_vec.const_data_ptr<scalar_t>() : nullptr;
    const acc_t* mean_data = mean_vec.const_data_ptr<acc_t>();
    const acc_t* rstd_data = rstd_vec.const_data_ptr<acc_t>();
    scalar_t* d_residual_data = d_residual.mutable_data_ptr<scalar_t>();
    scalar_t* d_x_data = has_dropout ? d_x.mutable_data_ptr<scalar_t>() : nullptr;
    acc_t* d_weight_partial_data = has_weight ? d_weight_partial.mutable_data_ptr<acc_t>() : nullptr;
    acc_t* d_bias_partial_data = has_bias ? d_bias_partial.mutable_data_ptr<acc_t>() : nullptr;
    const acc_t scale = static_cast<acc_t>(keep_scale(dropout_p));
    const float p = static_cast<float>(dropout_p);
    const acc_t inv_hidden = acc_t(1) / static_cast<acc_t>(hidden);
    const int64_t chunk_grain = std::max<int64_t>(1, kGrainElements / (chunk_rows * hidden));

    at::parallel_for(0, n_chunks, chunk_grain, [&](int64_t chunk_begin, int64_t chunk_end) {
      std::vector<acc_t> x_hat(hidden), d_x_hat(hidden), dy(hidden), keep(has_dropout ? hidden : 0);
      std::vector<acc_t> w(hidden, acc_t(1));
      if (weight_data) convert_row(weight_data, w.data(), hidden);
      for (int64_t chunk = chunk_begin; chunk < chunk_end; ++chunk) {
        acc_t* d_weight_acc = d_weight_partial_data ? d_weight_partial_data + chunk * hidden : nullptr;
        acc_t* d_bias_acc = d_bias_partial_data ? d_bias_partial_data + chunk * hidden : nullptr;
        if (d_weight_acc) std::fill(d_weight_acc, d_weight_acc + hidden, acc_t(0));
        if (d_bias_acc) std::fill(d_bias_acc, d_bias_acc + hidden, acc_t(0));
        const int64_t row_end = std::min(n_rows, (chunk + 1) * chunk_rows);
        for (int64_t row = chunk * chunk_rows; row < row_end; ++row) {
          // x_hat holds the recomputed residual + dropout(x) until it is normalised in place.
          load_dropped_sum(x_data + row * hidden, residual_data + row * hidden, row, hidden, has_dropout, seed_bits,
                           p, scale, x_hat.data(), keep.data());
          const acc_t row_mean = mean_data[row], row_rstd = rstd_data[row];
          x_hat_and_d_x_hat(grad_data + row * hidden, row_mean, row_rstd, w.data(), x_hat.data(), dy.data(),
                            d_x_hat.data(), hidden);
          if (d_weight_acc) accumulate_product(dy.data(), x_hat.data(), d_weight_acc, hidden);
          if (d_bias_acc) accumulate(dy.data(), d_bias_acc, hidden);
          acc_t sum_d_x_hat, sum_d_x_hat_x_hat;
          lane_sum_and_dot(d_x_hat.data(), x_hat.data(), hidden, sum_d_x_hat, sum_d_x_hat_x_hat);
          store_d_sum(x_hat.data(), d_x_hat.data(), row_rstd, sum_d_x_hat * inv_hidden, sum_d_x_hat_x_hat * inv_hidden,
                      keep.data(), d_residual_data + row * hidden, d_x_data ? d_x_data + row * hidden : nullptr,
                      hidden);
        }
      }
    });

    // The partial rows added in chunk order; columns split across threads.
    auto reduce_chunks = [&](const acc_t* partial, scalar_t* result) {
      at::parallel_for(0, hidden, 1024, [&](int64_t col_begin, int64_t col_end) {
        std::vector<acc_t> total(col_end - col_begin, acc_t(0));
        for (int64_t chunk = 0; chunk < n_chunks; ++chunk)
          accumulate(partial + chunk * hidden + col_begin, total.data(), col_end - col_begin);
        for (int64_t col = col_begin; col < col_end; ++col) result[col] = static_cast<scalar_t>(total[col - col_begin]);
      });
    };
    if (has_weight) reduce_chunks(d_weight_partial_data, d_weight.mutable_data_ptr<scalar_t>());
    if (has_bias) reduce_chunks(d_bias_partial_data, d_bias.mutable_data_ptr<scalar_t>());
  });
  return {d_residual, d_x, d_weight, d_bias};
}

}  // namespace
}  // namespace bert_fast

TORCH_LIBRARY_IMPL(bert_fast, CPU, m) {
  m.impl("ext_add_layernorm_fwd", &bert_fast::add_layernorm_fwd_cpu);
  m.impl("ext_add_layernorm_bwd", &bert_fast::add_layernorm_bwd_cpu);
}
