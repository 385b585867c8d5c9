// Device helpers shared by the .cu files: element <-> fp32 conversion, 16-byte packs, sums
// across the threads of a row, alignment tests. CUDA's own headers only.
//
// Conversions go through the intrinsics, never through __half's implicit conversions or
// operators: PyTorch builds .cu files with __CUDA_NO_HALF_CONVERSIONS__ and friends defined.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "kernels.h"

namespace bert_fast {
namespace cuda_utils {

template <typename T>
__device__ __forceinline__ float to_float(T value);
template <>
__device__ __forceinline__ float to_float<float>(float value) { return value; }
template <>
__device__ __forceinline__ float to_float<__half>(__half value) { return __half2float(value); }
template <>
__device__ __forceinline__ float to_float<__nv_bfloat16>(__nv_bfloat16 value) { return __bfloat162float(value); }

// Round to nearest even, as PyTorch's and Triton's casts do.
template <typename T>
__device__ __forceinline__ T from_float(float value);
template <>
__device__ __forceinline__ float from_float<float>(float value) { return value; }
template <>
__device__ __forceinline__ __half from_float<__half>(float value) { return __float2half_rn(value); }
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float value) {
  return __float2bfloat16_rn(value);
}

// An element's bits in the low bits of a 32-bit word, and back.
template <typename T>
__device__ __forceinline__ uint32_t bits_of(T value);
template <>
__device__ __forceinline__ uint32_t bits_of<float>(float value) { return __float_as_uint(value); }
template <>
__device__ __forceinline__ uint32_t bits_of<__half>(__half value) { return __half_as_ushort(value); }
template <>
__device__ __forceinline__ uint32_t bits_of<__nv_bfloat16>(__nv_bfloat16 value) { return __bfloat16_as_ushort(value); }

template <typename T>
__device__ __forceinline__ T from_bits(uint32_t bits);
template <>
__device__ __forceinline__ float from_bits<float>(uint32_t bits) { return __uint_as_float(bits); }
template <>
__device__ __forceinline__ __half from_bits<__half>(uint32_t bits) {
  return __ushort_as_half(static_cast<unsigned short>(bits));
}
template <>
__device__ __forceinline__ __nv_bfloat16 from_bits<__nv_bfloat16>(uint32_t bits) {
  return __ushort_as_bfloat16(static_cast<unsigned short>(bits));
}

// One 16-byte access. The load is __ldg on a uint4: the read-only path (.nc; every kernel here
// only reads its inputs), and a load the compiler knows can fault. It was an asm statement,
// which the compiler may treat as free of side effects and so run where the source does not:
// nvcc 13 hoisted the bias load of add_layernorm's forward above its `bias != nullptr` test
// and out of the row loop, and a call without bias read address 0x3000 (an illegal address on
// an H100, compute-sanitizer, 2026-11-26). The store stays in PTX: plain C++ (a uint4 or
// aligned-struct copy) is not enough, inside a grid-stride loop nvcc 13 was seen splitting such
// a store into four 4-byte stores. It has no "memory" clobber: no kernel here reads back what
// it stores, so letting the compiler move loads around it is safe. Generic pointers to device
// memory are valid global addresses.
__device__ __forceinline__ uint4 load_global_16(const void* src) { return __ldg(static_cast<const uint4*>(src)); }

__device__ __forceinline__ void store_global_16(void* dst, uint4 v) {
  asm volatile("st.global.v4.u32 [%0], {%1, %2, %3, %4};" ::"l"(dst), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w));
}

// N elements as fp32: N = 1, or one 16-byte pack (N = 16 / sizeof(T)), which needs a 16-byte
// aligned address (the launchers check that before picking N > 1).
template <typename T, int N>
__device__ __forceinline__ void load_floats(const T* __restrict__ src, float (&dst)[N]) {
  static_assert(N == 1 || N * sizeof(T) == 16, "one element or one 16-byte pack");
  if constexpr (N == 1) {
    dst[0] = to_float(src[0]);
  } else {
    constexpr int kPerWord = 4 / sizeof(T);
    const uint4 pack = load_global_16(src);
    const uint32_t words[4] = {pack.x, pack.y, pack.z, pack.w};
#pragma unroll
    for (int k = 0; k < N; ++k) {
      const uint32_t word = words[k / kPerWord];
      const uint32_t bits = kPerWord == 1 ? word : (word >> (16 * (k % kPerWord))) & 0xffffu;
      dst[k] = to_float(from_bits<T>(bits));
    }
  }
}

template <typename T, int N>
__device__ __forceinline__ void store_floats(T* __restrict__ dst, const float (&src)[N]) {
  static_assert(N == 1 || N * sizeof(T) == 16, "one element or one 16-byte pack");
  if constexpr (N == 1) {
    dst[0] = from_float<T>(src[0]);
  } else {
    constexpr int kPerWord = 4 / sizeof(T);
    uint32_t words[4] = {0u, 0u, 0u, 0u};
#pragma unroll
    for (int k = 0; k < N; ++k) {
      words[k / kPerWord] |= bits_of(from_float<T>(src[k])) << (16 * (k % kPerWord));
    }
    store_global_16(dst, make_uint4(words[0], words[1], words[2], words[3]));
  }
}

// Elements per 16-byte pack.
template <typename T>
constexpr int kPack16 = 16 / static_cast<int>(sizeof(T));

// Sums each of N values over an aligned group of LANES (a power of two <= 32) threads of one
// warp; every lane of the group gets the same bits. All 32 lanes of the warp must call it.
template <int LANES, int N>
__device__ __forceinline__ void group_sum(float (&values)[N]) {
#pragma unroll
  for (int offset = LANES / 2; offset > 0; offset /= 2) {
#pragma unroll
    for (int k = 0; k < N; ++k) values[k] += __shfl_xor_sync(0xffffffffu, values[k], offset);
  }
}

// Sums each of N values over the whole block (blockDim.x a multiple of 32, at most 1024);
// every thread gets the same bits (each sums the warps' partials in warp order).
// `scratch` holds 32 * N floats; all threads must call it (it synchronises twice).
template <int N>
__device__ __forceinline__ void block_sum(float (&values)[N], float* scratch) {
  group_sum<32, N>(values);
  const int warp = threadIdx.x / 32;
  if (threadIdx.x % 32 == 0) {
#pragma unroll
    for (int k = 0; k < N; ++k) scratch[warp * N + k] = values[k];
  }
  __syncthreads();
  const int n_warps = blockDim.x / 32;
#pragma unroll
  for (int k = 0; k < N; ++k) values[k] = 0.0f;
  for (int w = 0; w < n_warps; ++w) {
#pragma unroll
    for (int k = 0; k < N; ++k) values[k] += scratch[w * N + k];
  }
  // The next call overwrites scratch.
  __syncthreads();
}

inline bool is_aligned(const void* pointer, uintptr_t bytes) {
  return reinterpret_cast<uintptr_t>(pointer) % bytes == 0;
}

}  // namespace cuda_utils
}  // namespace bert_fast
