// The dropout mask every bert_fast backend draws: Triton (tl.rand), the PyTorch CPU twins
// (bert_fast/ops/_philox.py), the C++ CPU ops and the CUDA kernels give the same bits for
// the same seed, so a backend can be checked against another with dropout on.
//
//   bits  = word 0 of Philox4x32-10 with key (seed_lo, seed_hi) and counter
//           (offset_lo, offset_hi, 0, 0)                       -- triton.language.randint
//   u     = int32(bits) < 0 ? ~int32(bits) : int32(bits), times 4.6566127342e-10f
//                                                             -- triton.language.rand, in [0, 1)
//   keep  = u >= p (fp32 compare); kept values are scaled by 1 / (1 - p)
//
// add_layernorm uses offset = row * hidden + column (row over the flattened leading dims).
// Plain C++ that nvcc also compiles for the device: only <cstdint>.
#pragma once
#include <cstdint>

#if defined(__CUDACC__)
#define BERT_FAST_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define BERT_FAST_HOST_DEVICE inline
#endif

namespace bert_fast {

BERT_FAST_HOST_DEVICE uint32_t philox_bits(uint64_t seed, uint64_t offset) {
  uint32_t c0 = static_cast<uint32_t>(offset), c1 = static_cast<uint32_t>(offset >> 32);
  uint32_t c2 = 0, c3 = 0;
  uint32_t k0 = static_cast<uint32_t>(seed), k1 = static_cast<uint32_t>(seed >> 32);
  for (int round = 0; round < 10; ++round) {
    const uint64_t product_b = static_cast<uint64_t>(0xCD9E8D57u) * c2;
    const uint64_t product_a = static_cast<uint64_t>(0xD2511F53u) * c0;
    const uint32_t next_c0 = static_cast<uint32_t>(product_b >> 32) ^ c1 ^ k0;
    const uint32_t next_c2 = static_cast<uint32_t>(product_a >> 32) ^ c3 ^ k1;
    c1 = static_cast<uint32_t>(product_b);
    c3 = static_cast<uint32_t>(product_a);
    c0 = next_c0;
    c2 = next_c2;
    k0 += 0x9E3779B9u;
    k1 += 0xBB67AE85u;
  }
  return c0;
}

BERT_FAST_HOST_DEVICE float philox_uniform(uint32_t bits) {
  int32_t x = static_cast<int32_t>(bits);
  x = x < 0 ? ~x : x;
  return static_cast<float>(x) * 4.6566127342e-10f;
}

BERT_FAST_HOST_DEVICE bool dropout_keep(uint64_t seed, uint64_t offset, float dropout_p) {
  return philox_uniform(philox_bits(seed, offset)) >= dropout_p;
}

}  // namespace bert_fast
