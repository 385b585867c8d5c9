// The CUDA kernels bound to the dispatcher (schemas: registration.cpp): tensors to pointers,
// input checks, output allocation, the current stream. The kernels themselves are plain C++
// launch functions (kernels.h) in .cu files that include no torch headers.
//
// The checks mirror _check_fwd_inputs / _check_bwd_inputs of bert_fast/ops/embedding.py and
// add_layernorm.py (ValueError for shapes, values and devices, TypeError for dtypes); those that
// do not depend on the device are shared with the C++ CPU ops (op_checks.h). Unlike the CPU
// ops, ids are not range-checked here: that would need a host synchronisation; the module
// checks them once per batch, and the kernels never dereference an out-of-range id (see
// kernels.h).
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <cuda_runtime_api.h>

#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "kernels.h"
#include "op_checks.h"

namespace bert_fast {
namespace {

bool is_kernel_dtype(at::ScalarType dtype) {
  return dtype == at::kFloat || dtype == at::kHalf || dtype == at::kBFloat16;
}

DType kernel_dtype(at::ScalarType dtype) {
  switch (dtype) {
    case at::kHalf: return DType::Float16;
    case at::kBFloat16: return DType::BFloat16;
    default: return DType::Float32;   // callers checked is_kernel_dtype
  }
}

// The launchers answer cudaErrorInvalidValue for sizes past what their grids can cover (e.g.
// the embedding backward's 65535 column tiles: H above ~2M); said as the caller's ValueError,
// with the sizes. Any other error is CUDA's.
void check_launch(int error, const char* op, int64_t rows, int64_t hidden) {
  TORCH_CHECK_VALUE(error != cudaErrorInvalidValue, "the CUDA ", op, " kernel cannot run ", rows,
                    " rows of H = ", hidden, " (past its launch limits); use backend='torch'");
  C10_CUDA_CHECK(static_cast<cudaError_t>(error));
}

void check_on_device(const char* name, const at::Tensor& t, const at::Device& device) {
  TORCH_CHECK_VALUE(t.device() == device, name, " is on ", t.device(), ", expected ", device,
                    " like the other inputs");
}

// The ids flattened to contiguous int64 (a no-op for contiguous int64 ids).
at::Tensor flat_ids(const at::Tensor& ids) { return ids.reshape(-1).to(at::kLong).contiguous(); }

// A table read through its row stride: a copy only if its last dim is strided.
at::Tensor unit_column_stride(const at::Tensor& table) { return table.stride(-1) == 1 ? table : table.contiguous(); }

const int64_t* ids_ptr(const at::Tensor& ids) { return ids.defined() ? ids.const_data_ptr<int64_t>() : nullptr; }

// ----------------------------------------------------------------------------------------
// embedding_sum

void check_ids_on(const at::Device& device, const at::Tensor& tokens, const at::Tensor& segments,
                  const std::optional<at::Tensor>& positions) {
  check_on_device("tokens", tokens, device);
  check_on_device("segments", segments, device);
  if (positions.has_value()) check_on_device("positions", *positions, device);
}

at::Tensor embedding_sum_fwd_cuda(const at::Tensor& tokens, const at::Tensor& segments, const at::Tensor& token_weight,
                                  const at::Tensor& segment_weight, const at::Tensor& pos_weight,
                                  const std::optional<at::Tensor>& positions) {
  check_indices(tokens, segments, positions);
  check_tables(token_weight, segment_weight, pos_weight);
  const int64_t hidden = token_weight.size(1);
  TORCH_CHECK_TYPE(is_kernel_dtype(token_weight.scalar_type()),
                   "the CUDA embedding_sum takes float16, bfloat16 or float32 tables, got ", token_weight.scalar_type());
  const int64_t max_len = pos_weight.size(1);
  check_max_len(tokens, max_len);
  const at::Device device = token_weight.device();
  TORCH_CHECK_VALUE(device.is_cuda(), "token_weight is on ", device, ", expected a CUDA device (this is the CUDA kernel)");
  check_on_device("segment_weight", segment_weight, device);
  check_on_device("pos_weight", pos_weight, device);
  check_ids_on(device, tokens, segments, positions);

  const c10::cuda::CUDAGuard guard(device);
  const at::Tensor token_ids = flat_ids(tokens);
  const at::Tensor segment_ids = flat_ids(segments);
  const at::Tensor position_ids = positions.has_value() ? flat_ids(*positions) : at::Tensor();
  const at::Tensor token_table = unit_column_stride(token_weight);
  const at::Tensor segment_table = unit_column_stride(segment_weight);
  const at::Tensor pos_table = unit_column_stride(pos_weight);

  std::vector<int64_t> out_shape(tokens.sizes().begin(), tokens.sizes().end());
  out_shape.push_back(hidden);
  at::Tensor out = at::empty(out_shape, token_weight.options().memory_format(at::MemoryFormat::Contiguous));
  const int64_t rows = token_ids.numel();
  if (rows == 0) return out;
  check_launch(launch_embedding_sum_fwd(
      kernel_dtype(token_weight.scalar_type()), out.mutable_data_ptr(), ids_ptr(token_ids), ids_ptr(segment_ids),
      ids_ptr(position_ids), token_table.const_data_ptr(), token_table.stride(0), segment_table.const_data_ptr(),
      segment_table.stride(0), pos_table.const_data_ptr(), pos_table.stride(1), rows, tokens.size(-1), hidden,
      token_table.size(0), segment_table.size(0), max_len, c10::cuda::getCurrentCUDAStream()),
      "embedding_sum", rows, hidden);
  return out;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> embedding_sum_bwd_cuda(
    const at::Tensor& grad_out, const at::Tensor& tokens, const at::Tensor& segments,
    const std::optional<at::Tensor>& positions, int64_t n_tokens, int64_t n_segments, int64_t max_len,
    bool learn_pos_embedding) {
  check_indices(tokens, segments, positions);
  check_embedding_grad(grad_out, tokens, n_tokens, n_segments, max_len);
  const int64_t hidden = grad_out.size(-1);
  TORCH_CHECK_TYPE(is_kernel_dtype(grad_out.scalar_type()),
                   "the CUDA embedding_sum takes float16, bfloat16 or float32 gradients, got ", grad_out.scalar_type());
  const at::Device device = grad_out.device();
  TORCH_CHECK_VALUE(device.is_cuda(), "grad_out is on ", device, ", expected a CUDA device (this is the CUDA kernel)");
  check_ids_on(device, tokens, segments, positions);

  const c10::cuda::CUDAGuard guard(device);
  const at::Tensor token_ids = flat_ids(tokens);
  const at::Tensor segment_ids = flat_ids(segments);
  const at::Tensor position_ids = positions.has_value() ? flat_ids(*positions) : at::Tensor();
  const at::Tensor grad = grad_out.contiguous();
  const auto fp32 = grad_out.options().dtype(at::kFloat);
  // Atomics add into these, so they start at zero. The padded form scatters into the
  // (max_len, H) position buffer too: row r reads position r % L, so rows >= L stay zero.
  at::Tensor token_acc = at::zeros({n_tokens, hidden}, fp32);
  at::Tensor segment_acc = at::zeros({n_segments, hidden}, fp32);
  at::Tensor pos_acc = learn_pos_embedding ? at::zeros({max_len, hidden}, fp32) : at::Tensor();
  const int64_t rows = token_ids.numel();
  if (rows > 0) {
    check_launch(launch_embedding_sum_bwd(
        kernel_dtype(grad.scalar_type()), grad.const_data_ptr(), ids_ptr(token_ids), ids_ptr(segment_ids),
        ids_ptr(position_ids), token_acc.mutable_data_ptr<float>(), segment_acc.mutable_data_ptr<float>(),
        pos_acc.defined() ? pos_acc.mutable_data_ptr<float>() : nullptr, rows, tokens.size(-1), hidden, n_tokens,
        n_segments, max_len, c10::cuda::getCurrentCUDAStream()), "embedding_sum backward", rows, hidden);
  }
  const at::ScalarType dtype = grad_out.scalar_type();
  // .to is a no-op for fp32, where the accumulators already are the outputs.
  at::Tensor pos_grad = learn_pos_embedding ? pos_acc.to(dtype).view({1, max_len, hidden})
                                            : at::empty({0}, grad_out.options());
  return {token_acc.to(dtype), segment_acc.to(dtype), pos_grad};
}

// ----------------------------------------------------------------------------------------
// add_layernorm

// _check_fwd_inputs of add_layernorm.py.
void check_fwd_inputs(const at::Tensor& x, const at::Tensor& residual, const std::optional<at::Tensor>& weight,
                      const std::optional<at::Tensor>& bias, const std::optional<at::Tensor>& seed, double dropout_p) {
  check_layernorm_shapes(x, residual, weight, bias);
  const int64_t hidden = x.size(-1);
  TORCH_CHECK_VALUE(hidden <= kAddLayerNormMaxHidden, "the CUDA add_layernorm supports H <= ", kAddLayerNormMaxHidden,
                    ", got H = ", hidden, "; use backend='torch'");
  TORCH_CHECK_TYPE(is_kernel_dtype(x.scalar_type()), "the CUDA add_layernorm takes float16, bfloat16 or float32, got ",
                   x.scalar_type());
  TORCH_CHECK_VALUE(x.is_cuda(), "x is on ", x.device(), ", expected a CUDA device (this is the CUDA kernel)");
  check_like_x(x, residual, weight, bias);
  check_dropout_p(dropout_p);
  check_seed(seed, dropout_p, x.device());
}

// The rows of t as a contiguous (rows, H) tensor (a view when t already is).
at::Tensor as_rows(const at::Tensor& t, int64_t hidden) { return t.reshape({-1, hidden}).contiguous(); }

const void* optional_ptr(const std::optional<at::Tensor>& t) { return t.has_value() ? t->const_data_ptr() : nullptr; }

std::tuple<at::Tensor, at::Tensor, at::Tensor> add_layernorm_fwd_cuda(
    const at::Tensor& x, const at::Tensor& residual, const std::optional<at::Tensor>& weight,
    const std::optional<at::Tensor>& bias, double eps, const std::optional<at::Tensor>& seed, double dropout_p) {
  check_fwd_inputs(x, residual, weight, bias, seed, dropout_p);
  const c10::cuda::CUDAGuard guard(x.device());
  const int64_t hidden = x.size(-1);
  const at::Tensor x2 = as_rows(x, hidden);
  const at::Tensor residual2 = as_rows(residual, hidden);
  const std::optional<at::Tensor> weight1 = weight.has_value() ? std::optional(weight->contiguous()) : std::nullopt;
  const std::optional<at::Tensor> bias1 = bias.has_value() ? std::optional(bias->contiguous()) : std::nullopt;
  const int64_t rows = x2.size(0);
  // x's shape, contiguous (the kernel's (rows, H) layout): not a view of a (rows, H) tensor,
  // which, returned from the autograd Function, could not be modified in place.
  at::Tensor out = at::empty(x.sizes(), x.options().memory_format(at::MemoryFormat::Contiguous));
  const auto fp32 = x.options().dtype(at::kFloat);
  at::Tensor mean = at::empty({rows}, fp32);
  at::Tensor rstd = at::empty({rows}, fp32);
  if (rows > 0) {
    const bool dropout = dropout_p > 0.0;
    check_launch(launch_add_layernorm_fwd(
        kernel_dtype(x.scalar_type()), out.mutable_data_ptr(), mean.mutable_data_ptr<float>(),
        rstd.mutable_data_ptr<float>(), x2.const_data_ptr(), residual2.const_data_ptr(), optional_ptr(weight1),
        optional_ptr(bias1), rows, hidden, static_cast<float>(eps),
        dropout ? seed->const_data_ptr<int64_t>() : nullptr, dropout_p, c10::cuda::getCurrentCUDAStream()),
        "add_layernorm", rows, hidden);
  }
  return {out, mean, rstd};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> add_layernorm_bwd_cuda(
    const at::Tensor& grad_out, const at::Tensor& x, const at::Tensor& residual,
    const std::optional<at::Tensor>& weight, const at::Tensor& mean, const at::Tensor& rstd,
    const std::optional<at::Tensor>& seed, double dropout_p, bool has_bias) {
  check_fwd_inputs(x, residual, weight, std::nullopt, seed, dropout_p);
  check_grad_like_x(grad_out, x);
  const int64_t hidden = x.size(-1);
  const int64_t rows = x.numel() / hidden;
  for (const auto& [name, t] : {std::pair{"mean", &mean}, std::pair{"rstd", &rstd}}) {
    TORCH_CHECK_VALUE(t->dim() == 1 && t->size(0) == rows && t->scalar_type() == at::kFloat, name,
                      " must be the forward's float32 (", rows, ",) tensor, got ", t->scalar_type(), " ",
                      shape_str(*t));
    check_on_device_of_x(name, *t, x);
  }

  const c10::cuda::CUDAGuard guard(x.device());
  const at::Tensor grad2 = as_rows(grad_out, hidden);
  const at::Tensor x2 = as_rows(x, hidden);
  const at::Tensor residual2 = as_rows(residual, hidden);
  const at::Tensor mean1 = mean.contiguous();
  const at::Tensor rstd1 = rstd.contiguous();
  const std::optional<at::Tensor> weight1 = weight.has_value() ? std::optional(weight->contiguous()) : std::nullopt;
  const bool dropout = dropout_p > 0.0;
  const auto options = x.options().memory_format(at::MemoryFormat::Contiguous);
  const auto fp32 = options.dtype(at::kFloat);

  at::Tensor d_residual = at::empty(x.sizes(), options);
  at::Tensor d_x = dropout ? at::empty(x.sizes(), options) : at::empty({0}, options);
  at::Tensor d_weight = at::empty({0}, options);
  at::Tensor d_bias = at::empty({0}, options);
  if (rows == 0) {
    if (weight.has_value()) d_weight = at::zeros({hidden}, options);
    if (has_bias) d_bias = at::zeros({hidden}, options);
  } else {
    int64_t partial_rows = 0;
    check_launch(add_layernorm_bwd_partial_rows(kernel_dtype(x.scalar_type()), rows, hidden, dropout_p,
                                                x.device().index(), &partial_rows),
                                                "add_layernorm backward", rows, hidden);
    // Scratch for the kernel's partial rows, d_weight's then d_bias's (every block writes its
    // rows, so no zeroing); the launch sums them into d_weight / d_bias.
    const bool has_weight = weight.has_value();
    const int64_t parts = static_cast<int64_t>(has_weight) + static_cast<int64_t>(has_bias);
    at::Tensor partials = parts > 0 ? at::empty({parts * partial_rows, hidden}, fp32) : at::Tensor();
    float* d_weight_partial = has_weight ? partials.mutable_data_ptr<float>() : nullptr;
    float* d_bias_partial = has_bias ? partials.mutable_data_ptr<float>() + (parts - 1) * partial_rows * hidden : nullptr;
    if (has_weight) d_weight = at::empty({hidden}, options);
    if (has_bias) d_bias = at::empty({hidden}, options);
    check_launch(launch_add_layernorm_bwd(
        kernel_dtype(x.scalar_type()), d_residual.mutable_data_ptr(), dropout ? d_x.mutable_data_ptr() : nullptr,
        has_weight ? d_weight.mutable_data_ptr() : nullptr, has_bias ? d_bias.mutable_data_ptr() : nullptr,
        d_weight_partial, d_bias_partial, partial_rows,
        grad2.const_data_ptr(), x2.const_data_ptr(), residual2.const_data_ptr(), optional_ptr(weight1),
        mean1.const_data_ptr<float>(), rstd1.const_data_ptr<float>(), rows, hidden,
        dropout ? seed->const_data_ptr<int64_t>() : nullptr, dropout_p, c10::cuda::getCurrentCUDAStream()),
        "add_layernorm backward", rows, hidden);
  }
  return {d_residual, d_x, d_weight, d_bias};
}

// ----------------------------------------------------------------------------------------
// Whether GPU `device` can run these kernels: "" if it can, else why not. The backend "auto"
// asks once per GPU before it chooses them (bert_fast/backend.py). Answers, never throws: on
// the H200 (torch 2.11) a ValueError thrown from this op, which takes no tensor, crashed the
// process instead of reaching Python.

std::string kernel_image_problem(int64_t device) {
  const int64_t count = c10::cuda::device_count();
  if (device < 0 || device >= count) {
    return "no CUDA device " + std::to_string(device) + " (" + std::to_string(count) + " visible)";
  }
  c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device));
  const int status = kernel_image_status();
  return status == 0 ? std::string() : std::string(cudaGetErrorString(static_cast<cudaError_t>(status)));
}

}  // namespace
}  // namespace bert_fast

// Takes no tensor, so no dispatch key: one kernel for every caller, defined with its schema.
TORCH_LIBRARY_FRAGMENT(bert_fast, m) {
  m.def("ext_cuda_kernel_image_problem(int device) -> str", &bert_fast::kernel_image_problem);
}

TORCH_LIBRARY_IMPL(bert_fast, CUDA, m) {
  m.impl("ext_embedding_sum_fwd", &bert_fast::embedding_sum_fwd_cuda);
  m.impl("ext_embedding_sum_bwd", &bert_fast::embedding_sum_bwd_cuda);
  m.impl("ext_add_layernorm_fwd", &bert_fast::add_layernorm_fwd_cuda);
  m.impl("ext_add_layernorm_bwd", &bert_fast::add_layernorm_bwd_cuda);
}
