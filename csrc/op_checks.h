// The input checks every backend of the ext_* ops shares (the C++ CPU ops and the CUDA glue):
// shapes, dtypes and arguments that do not depend on where the tensors live, with the messages
// of the Python twins' checks. What does depend on the backend stays in its file: the dtypes it
// supports, which device the inputs must be on, the id ranges (read on the CPU only), the CUDA H
// limit, and the dtype of mean / rstd.
//
// ATen / c10 headers only: the CPU-only build includes this file too.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>
#include <c10/util/StringUtil.h>

#include <optional>
#include <string>
#include <utility>

namespace bert_fast {

inline std::string shape_str(const at::Tensor& t) {
  return c10::str(t.sizes());
}

inline bool is_index_dtype(at::ScalarType dtype) {
  return dtype == at::kInt || dtype == at::kLong;
}

// ----------------------------------------------------------------------------------------
// embedding_sum

// _check_indices of embedding.py: dtypes, the padded (B, L) / packed (N,) forms, shapes.
inline void check_indices(const at::Tensor& tokens, const at::Tensor& segments,
                          const std::optional<at::Tensor>& positions) {
  TORCH_CHECK_TYPE(is_index_dtype(tokens.scalar_type()),
                   "tokens must be an int32 or int64 tensor, got ", tokens.scalar_type());
  TORCH_CHECK_TYPE(is_index_dtype(segments.scalar_type()),
                   "segments must be an int32 or int64 tensor, got ", segments.scalar_type());
  if (positions.has_value()) {
    TORCH_CHECK_TYPE(is_index_dtype(positions->scalar_type()),
                     "positions must be an int32 or int64 tensor, got ", positions->scalar_type());
  }
  TORCH_CHECK_VALUE(tokens.dim() == 1 || tokens.dim() == 2,
                    "tokens must be (B, L) (padded) or (N,) (packed), got shape ", shape_str(tokens));
  TORCH_CHECK_VALUE(segments.sizes() == tokens.sizes(), "segments must have the shape of tokens ",
                    shape_str(tokens), ", got ", shape_str(segments));
  TORCH_CHECK_VALUE(!(tokens.dim() == 1 && !positions.has_value()),
                    "packed (1-D) tokens need positions (N,) saying which position row each reads");
  TORCH_CHECK_VALUE(!(tokens.dim() == 2 && positions.has_value()),
                    "positions are only for packed (1-D) tokens; padded (B, L) tokens read "
                    "position j at column j");
  if (positions.has_value()) {
    TORCH_CHECK_VALUE(positions->sizes() == tokens.sizes(), "positions must have the shape of tokens ",
                      shape_str(tokens), ", got ", shape_str(*positions));
  }
}

inline void check_max_len(const at::Tensor& tokens, int64_t max_len) {
  TORCH_CHECK_VALUE(!(tokens.dim() == 2 && tokens.size(1) > max_len), "sequence length ",
                    tokens.size(1), " exceeds the position table's max_len ", max_len);
}

// The forward's tables: (rows, H), (rows, H), (1, max_len, H), one H >= 1, one dtype.
inline void check_tables(const at::Tensor& token_weight, const at::Tensor& segment_weight,
                         const at::Tensor& pos_weight) {
  TORCH_CHECK_VALUE(token_weight.dim() == 2 && segment_weight.dim() == 2,
                    "token_weight and segment_weight must be 2-D (rows, H), got shapes ",
                    shape_str(token_weight), " and ", shape_str(segment_weight));
  TORCH_CHECK_VALUE(pos_weight.dim() == 3 && pos_weight.size(0) == 1,
                    "pos_weight must be (1, max_len, H), got shape ", shape_str(pos_weight));
  const int64_t hidden = token_weight.size(1);
  TORCH_CHECK_VALUE(hidden >= 1, "the tables need H >= 1 features, got H = 0");
  TORCH_CHECK_VALUE(segment_weight.size(1) == hidden && pos_weight.size(2) == hidden,
                    "all tables need the same H: token ", hidden, ", segment ", segment_weight.size(1),
                    ", position ", pos_weight.size(2));
  TORCH_CHECK_TYPE(token_weight.scalar_type() == segment_weight.scalar_type() &&
                       token_weight.scalar_type() == pos_weight.scalar_type(),
                   "all tables need one dtype, got token ", token_weight.scalar_type(), ", segment ",
                   segment_weight.scalar_type(), ", position ", pos_weight.scalar_type());
}

// The backward's grad_out (tokens.shape + (H,), H >= 1) and table sizes (checked ids first).
inline void check_embedding_grad(const at::Tensor& grad_out, const at::Tensor& tokens, int64_t n_tokens,
                                 int64_t n_segments, int64_t max_len) {
  TORCH_CHECK_VALUE(grad_out.dim() == tokens.dim() + 1 && grad_out.sizes().slice(0, tokens.dim()) == tokens.sizes(),
                    "grad_out must be tokens.shape + (H,) = ", shape_str(tokens), " + (H,), got ",
                    shape_str(grad_out));
  TORCH_CHECK_VALUE(grad_out.size(-1) >= 1, "grad_out needs H >= 1 features, got H = 0");
  TORCH_CHECK_VALUE(n_tokens >= 1, "n_tokens (rows of that table) must be >= 1, got ", n_tokens);
  TORCH_CHECK_VALUE(n_segments >= 1, "n_segments (rows of that table) must be >= 1, got ", n_segments);
  TORCH_CHECK_VALUE(max_len >= 1, "max_len (rows of that table) must be >= 1, got ", max_len);
  check_max_len(tokens, max_len);
}

// ----------------------------------------------------------------------------------------
// add_layernorm

// The shapes of _check_fwd_inputs of add_layernorm.py: x (..., H) with H >= 1, residual like x,
// weight and bias (H,) or absent.
inline void check_layernorm_shapes(const at::Tensor& x, const at::Tensor& residual,
                                   const std::optional<at::Tensor>& weight, const std::optional<at::Tensor>& bias) {
  TORCH_CHECK_VALUE(x.dim() >= 1 && x.size(-1) >= 1, "x must have shape (..., H) with H >= 1, got ",
                    shape_str(x));
  const int64_t hidden = x.size(-1);
  TORCH_CHECK_VALUE(residual.sizes() == x.sizes(), "residual must have the shape of x ", shape_str(x),
                    ", got ", shape_str(residual));
  for (const auto& [name, t] : {std::pair{"weight", &weight}, std::pair{"bias", &bias}}) {
    if (t->has_value()) {
      TORCH_CHECK_VALUE((*t)->dim() == 1 && (*t)->size(0) == hidden, name, " must have shape (", hidden,
                        ",) or be None, got ", shape_str(**t));
    }
  }
}

inline void check_on_device_of_x(const char* name, const at::Tensor& t, const at::Tensor& x) {
  TORCH_CHECK_VALUE(t.device() == x.device(), name, " must be on the device of x (", x.device(), "), got ",
                    t.device());
}

// residual, weight and bias (those given) have the dtype and device of x.
inline void check_like_x(const at::Tensor& x, const at::Tensor& residual, const std::optional<at::Tensor>& weight,
                         const std::optional<at::Tensor>& bias) {
  const std::optional<at::Tensor> residual_opt = residual;
  for (const auto& [name, t] : {std::pair{"residual", &residual_opt}, std::pair{"weight", &weight},
                                std::pair{"bias", &bias}}) {
    if (!t->has_value()) continue;
    TORCH_CHECK_TYPE((*t)->scalar_type() == x.scalar_type(), name, " must have the dtype of x (", x.scalar_type(),
                     "), got ", (*t)->scalar_type());
    check_on_device_of_x(name, **t, x);
  }
}

inline void check_dropout_p(double dropout_p) {
  TORCH_CHECK_VALUE(dropout_p >= 0.0 && dropout_p <= 1.0, "dropout_p must be in [0, 1], got ", dropout_p);
}

// check_seed of bert_fast/ops/_philox.py: the seed is read only when there is dropout.
inline void check_seed(const std::optional<at::Tensor>& seed, double dropout_p, const at::Device& device) {
  if (dropout_p <= 0.0) return;
  TORCH_CHECK_VALUE(seed.has_value() && seed->defined(), "dropout_p = ", dropout_p,
                    " needs a seed: a one-element int64 tensor (bert_fast.ops._philox.dropout_seed)");
  TORCH_CHECK_VALUE(seed->scalar_type() == at::kLong && seed->numel() == 1,
                    "seed must be a one-element int64 tensor, got ", seed->scalar_type(), " of shape ",
                    shape_str(*seed));
  TORCH_CHECK_VALUE(seed->device() == device, "seed must be on the inputs' device (", device, "), got ",
                    seed->device());
}

// The backward's grad_out: the shape, dtype and device of x.
inline void check_grad_like_x(const at::Tensor& grad_out, const at::Tensor& x) {
  TORCH_CHECK_VALUE(grad_out.sizes() == x.sizes() && grad_out.scalar_type() == x.scalar_type(),
                    "grad_out must match x: shape ", shape_str(x), " and dtype ", x.scalar_type(), ", got ",
                    shape_str(grad_out), " and ", grad_out.scalar_type());
  check_on_device_of_x("grad_out", grad_out, x);
}

}  // namespace bert_fast
