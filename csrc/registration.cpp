// The schemas of the compiled extension's ops (torch.ops.bert_fast.ext_*), in one place.
// CPU kernels: embedding_sum_cpu.cpp, add_layernorm_cpu.cpp. CUDA kernels: *.cu, bound to
// the dispatcher in cuda_ops.cpp. Fake (meta) kernels and autograd: bert_fast/ops/*.py.
//
// The ops mirror the Triton ops of bert_fast/ops (same arguments, same outputs, same empty
// tensors for gradients not asked for), so a backend can be swapped per op:
//
//   ext_embedding_sum_fwd  token_weight[tokens] + segment_weight[segments] + pos_weight[0, pos]
//       tokens/segments (B, L) with pos = column (positions None), or packed (N,) with
//       positions (N,); ids int32 or int64; tables (V, H), (S, H), (1, max_len, H) of one
//       float dtype. Output tokens.shape + (H,), the tables' dtype, summed in fp32.
//   ext_embedding_sum_bwd  -> (token_grad (n_tokens, H), segment_grad (n_segments, H),
//       pos_grad (1, max_len, H), or an empty tensor unless learn_pos_embedding), grad_out's dtype.
//   ext_add_layernorm_fwd  LayerNorm(residual + dropout(x)) over the last dim
//       -> (out like x, mean (rows,), rstd (rows,)); statistics fp32 (fp64 for fp64 inputs).
//       seed: int64 tensor of one element on x's device, read only when dropout_p > 0
//       (mask: philox.h, four columns a Philox call).
//   ext_add_layernorm_bwd  -> (d_residual like x, d_x like x or empty when dropout_p == 0
//       (it equals d_residual), d_weight (H,) or empty when weight is None, d_bias (H,) or
//       empty unless has_bias).
#include <Python.h>
#include <torch/library.h>

TORCH_LIBRARY(bert_fast, m) {
  m.def("ext_embedding_sum_fwd(Tensor tokens, Tensor segments, Tensor token_weight, "
        "Tensor segment_weight, Tensor pos_weight, Tensor? positions) -> Tensor");
  m.def("ext_embedding_sum_bwd(Tensor grad_out, Tensor tokens, Tensor segments, Tensor? positions, "
        "int n_tokens, int n_segments, int max_len, bool learn_pos_embedding) -> (Tensor, Tensor, Tensor)");
  m.def("ext_add_layernorm_fwd(Tensor x, Tensor residual, Tensor? weight, Tensor? bias, float eps, "
        "Tensor? seed, float dropout_p) -> (Tensor, Tensor, Tensor)");
  m.def("ext_add_layernorm_bwd(Tensor grad_out, Tensor x, Tensor residual, Tensor? weight, Tensor mean, "
        "Tensor rstd, Tensor? seed, float dropout_p, bool has_bias) -> (Tensor, Tensor, Tensor, Tensor)");
}

// `import bert_fast._C` loads the library (and with it the registrations above); the module
// itself is empty. torch.utils.cpp_extension.load(..., is_python_module=False) ignores this.
extern "C" PyObject* PyInit__C(void) {
  static struct PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1, nullptr};
  return PyModule_Create(&module_def);
}
