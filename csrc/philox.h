// The dropout mask every bert_fast backend draws: Triton (tl.randint4x), the PyTorch CPU twins
// (bert_fast/ops/_philox.py), the C++ CPU ops and the CUDA kernels give the same bits for
// the same seed, so a backend can be checked against another with dropout on.
//
// add_layernorm's element (r, c) of rows of `hidden`: with groups = ceil(hidden / 4),
//   words = Philox4x32-10 with key (seed_lo, seed_hi) and counter
//           (n_lo, n_hi, 0, 0), n = r * groups + c / 4              -- triton.language.randint4x
//   bits  = words[c % 4]: one Philox call draws four consecutive columns (a quarter of the
//           integer work of a call per element, which cost as much as the op's memory traffic)
//   u     = int32(bits) < 0 ? ~int32(bits) : int32(bits), times 4.6566127342e-10f
//                                                             -- triton.language.rand, in [0, 1)
//   keep  = u >= p (fp32 compare); kept values are scaled by 1 / (1 - p)
//
// Plain C++ that nvcc also compiles for the device: only <cstdint>.
#pragma once
#include <cstdint>

#if defined(__CUDACC__)
#define BERT_FAST_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define BERT_FAST_HOST_DEVICE inline
#endif

namespace bert_fast {

// The four words of Philox4x32-10, key (seed_lo, seed_hi), counter (n_lo, n_hi, 0, 0).
BERT_FAST_HOST_DEVICE void philox4(uint64_t seed, uint64_t n, uint32_t (&words)[4]) {
  uint32_t c0 = static_cast<uint32_t>(n), c1 = static_cast<uint32_t>(n >> 32);
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
  words[0] = c0;
  words[1] = c1;
  words[2] = c2;
  words[3] = c3;
}

BERT_FAST_HOST_DEVICE float philox_uniform(uint32_t bits) {
  int32_t x = static_cast<int32_t>(bits);
  x = x < 0 ? ~x : x;
  return static_cast<float>(x) * 4.6566127342e-10f;
}

// The Philox counter of the four columns c, c + 1, c + 2, c + 3 (c a multiple of 4) of row r.
BERT_FAST_HOST_DEVICE uint64_t dropout_counter(int64_t row, int64_t col, int64_t hidden) {
  return static_cast<uint64_t>(row) * static_cast<uint64_t>((hidden + 3) / 4) + static_cast<uint64_t>(col / 4);
}

// keep[k] for the four columns of a group of row r, its first column c a multiple of 4.
BERT_FAST_HOST_DEVICE void dropout_keep4(uint64_t seed, int64_t row, int64_t col, int64_t hidden, float dropout_p,
                                         bool (&keep)[4]) {
  uint32_t words[4];
  philox4(seed, dropout_counter(row, col, hidden), words);
  for (int k = 0; k < 4; ++k) keep[k] = philox_uniform(words[k]) >= dropout_p;
}

// keep of element (row, col) alone: its group's draw, word col % 4.
BERT_FAST_HOST_DEVICE bool dropout_keep(uint64_t seed, int64_t row, int64_t col, int64_t hidden, float dropout_p) {
  bool keep[4];
  dropout_keep4(seed, row, col - col % 4, hidden, dropout_p, keep);
  return keep[col % 4];
}

// residual + dropout(x) for the pack of VEC columns of row `row` starting at column `col` (a
// multiple of VEC; the CUDA add_layernorm kernels' 16-byte packs, or single elements); sets bit
// (bit0 + k) of *keep_bits for each kept element. A pack of 4 or 8 columns takes its mask from
// one or two Philox calls; VEC 1 (rows not 16-byte aligned) draws its element's group and keeps
// one word. Here, not in the .cu file, so the host can run it against the twins (tests).
template <int VEC, bool DROPOUT>
BERT_FAST_HOST_DEVICE void dropped_sum(float (&sum)[VEC], const float (&x)[VEC], const float (&residual)[VEC],
                                       uint64_t seed, int64_t row, int64_t col, int64_t hidden, float dropout_p,
                                       float keep_scale, uint32_t* keep_bits, int bit0) {
  bool keep[VEC];
  if constexpr (DROPOUT) {
    if constexpr (VEC % 4 == 0) {
      for (int g = 0; g < VEC / 4; ++g) {
        bool group[4];
        dropout_keep4(seed, row, col + 4 * g, hidden, dropout_p, group);
        for (int k = 0; k < 4; ++k) keep[4 * g + k] = group[k];
      }
    } else {
      for (int k = 0; k < VEC; ++k) keep[k] = dropout_keep(seed, row, col + k, hidden, dropout_p);
    }
  }
  for (int k = 0; k < VEC; ++k) {
    float value = x[k];
    if constexpr (DROPOUT) {
      value = keep[k] ? value * keep_scale : 0.0f;
      if (keep_bits != nullptr) *keep_bits |= static_cast<uint32_t>(keep[k]) << (bit0 + k);
    }
    sum[k] = residual[k] + value;
  }
}

}  // namespace bert_fast
