"""csrc's stage-two kernel (column_sums.cuh: add_layernorm's d_weight / d_bias from the
backward's partial rows) run on the CPU, one std::thread per CUDA thread.

The kernel is device code; this machine has no GPU. The header uses only CUDA's built-ins
(threadIdx, blockIdx, __syncthreads, __shared__) and cuda_utils::from_float, so a small harness
compiled with the host compiler gives it those: each block's threads are real threads meeting
at a std::barrier for __syncthreads, blocks run one after another (so a function-static array
is the block's shared memory), and from_float is CUDA's own host conversion (round to nearest
even). The sums must equal, bit for bit, the kernel's order of fp32 additions done here in
NumPy, then one rounding to the output type. What the harness cannot show (the launch, the
memory system) the GPU tests show (tests/test_ext_cuda.py).
"""

import pathlib
import shutil
import subprocess

import numpy as np
import pytest
import torch

from tests.test_csrc_compile import _cuda_include_dir

CSRC = pathlib.Path(__file__).resolve().parent.parent / "csrc"
CXX = shutil.which("g++") or shutil.which("c++")
LANES, SLICES = 32, 16          # kColumnSumLanes, kColumnSumSlices in column_sums.cuh

pytestmark = pytest.mark.skipif(CXX is None or _cuda_include_dir() is None,
                                reason="needs a C++20 host compiler and CUDA's headers (cuda_bf16.h)")

HARNESS = r"""
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <barrier>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <thread>
#include <vector>

// CUDA's built-ins, for one thread per CUDA thread.
struct Index { unsigned x, y, z; };
thread_local Index threadIdx, blockIdx;
thread_local std::barrier<>* block_barrier;
inline void __syncthreads() { block_barrier->arrive_and_wait(); }
#undef __global__
#define __global__
#undef __launch_bounds__
#define __launch_bounds__(threads)
#undef __shared__
#define __shared__ static

namespace bert_fast {
namespace cuda_utils {
template <typename T> T from_float(float value);
template <> float from_float<float>(float value) { return value; }
template <> __half from_float<__half>(float value) { return __float2half_rn(value); }
template <> __nv_bfloat16 from_float<__nv_bfloat16>(float value) { return __float2bfloat16_rn(value); }
}  // namespace cuda_utils
}  // namespace bert_fast

#include "column_sums.cuh"

using namespace bert_fast;

template <typename T>
float as_float(T value) { return static_cast<float>(value); }
template <> float as_float<__half>(__half value) { return __half2float(value); }
template <> float as_float<__nv_bfloat16>(__nv_bfloat16 value) { return __bfloat162float(value); }

// argv: partials file (pairs x rows x hidden fp32), output file, rows, hidden, pairs.
template <typename T>
int run(const char* in_path, const char* out_path, int64_t rows, int hidden, int pairs) {
  std::vector<float> partial(static_cast<size_t>(pairs) * rows * hidden);
  FILE* in = std::fopen(in_path, "rb");
  if (!in || std::fread(partial.data(), sizeof(float), partial.size(), in) != partial.size()) return 2;
  std::fclose(in);
  std::vector<T> out(static_cast<size_t>(pairs) * hidden);
  ColumnSumParts<T> parts{};
  for (int p = 0; p < pairs; ++p) {
    parts.partial[p] = partial.data() + static_cast<size_t>(p) * rows * hidden;
    parts.out[p] = out.data() + static_cast<size_t>(p) * hidden;
  }
  const unsigned grid_x = (hidden + kColumnSumLanes - 1) / kColumnSumLanes;
  for (unsigned by = 0; by < static_cast<unsigned>(pairs); ++by) {
    for (unsigned bx = 0; bx < grid_x; ++bx) {
      std::barrier<> barrier(kColumnSumThreads);
      std::vector<std::thread> threads;
      for (unsigned t = 0; t < kColumnSumThreads; ++t) {
        threads.emplace_back([&, t] {
          threadIdx = {t, 0, 0};
          blockIdx = {bx, by, 0};
          block_barrier = &barrier;
          column_sums_kernel<T>(parts, rows, hidden);
        });
      }
      for (auto& thread : threads) thread.join();
    }
  }
  FILE* result = std::fopen(out_path, "wb");
  for (const T& value : out) {
    const float f = as_float(value);
    std::fwrite(&f, sizeof(float), 1, result);
  }
  std::fclose(result);
  return 0;
}

int main(int argc, char** argv) {
  if (argc != 7) return 1;
  const int64_t rows = std::atoll(argv[4]);
  const int hidden = std::atoi(argv[5]), pairs = std::atoi(argv[6]);
  switch (argv[1][0]) {
    case 'f': return run<float>(argv[2], argv[3], rows, hidden, pairs);
    case 'h': return run<__half>(argv[2], argv[3], rows, hidden, pairs);
    case 'b': return run<__nv_bfloat16>(argv[2], argv[3], rows, hidden, pairs);
    default: return 1;
  }
}
"""


def compile_harness(tmp_path_factory, name, source, *flags):
    """The host compiler's binary of ``source``, with csrc/ on the include path."""
    build = tmp_path_factory.mktemp(name)
    (build / f"{name}.cpp").write_text(source)
    binary = build / name
    result = subprocess.run([CXX, "-std=c++20", "-O1", *flags, "-I", str(CSRC), str(build / f"{name}.cpp"),
                             "-o", str(binary)], capture_output=True, text=True)
    assert result.returncode == 0, f"the harness did not compile:\n{result.stderr[-4000:]}"
    return binary


@pytest.fixture(scope="module")
def harness(tmp_path_factory):
    return compile_harness(tmp_path_factory, "csrc_emulated", HARNESS, "-pthread", "-I", _cuda_include_dir())


def kernel_order_sums(partials):
    """The kernel's sums in its order of fp32 additions: slice s adds rows s, s + SLICES, ...
    from 0.0f; the block then adds the SLICES sums in slice order."""
    pairs, rows, hidden = partials.shape
    slice_sums = np.zeros((SLICES, pairs, hidden), dtype=np.float32)
    for row in range(rows):
        slice_sums[row % SLICES] += partials[:, row]
    total = np.zeros((pairs, hidden), dtype=np.float32)
    for s in range(SLICES):
        total += slice_sums[s]
    return total


@pytest.mark.parametrize("dtype,code", [(torch.float32, "f"), (torch.float16, "h"), (torch.bfloat16, "b")])
@pytest.mark.parametrize("rows,hidden,pairs", [(1, 5, 1), (264, 768, 2), (2 * SLICES + 3, LANES + 7, 2),
                                               (7, 40, 1)])
def test_column_sums_kernel_adds_in_its_order_and_rounds_once(harness, tmp_path, dtype, code, rows, hidden, pairs):
    generator = torch.Generator().manual_seed(rows * 1000 + hidden)
    partials = torch.randn(pairs, rows, hidden, generator=generator) * 3
    partials[:, 0] += 50.0       # one large row: later small ones must still count
    values = partials.numpy()
    values.tofile(tmp_path / "partials.bin")
    result = subprocess.run([str(harness), code, str(tmp_path / "partials.bin"), str(tmp_path / "out.bin"),
                             str(rows), str(hidden), str(pairs)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    out = torch.from_numpy(np.fromfile(tmp_path / "out.bin", dtype=np.float32).reshape(pairs, hidden))
    expected = torch.from_numpy(kernel_order_sums(values)).to(dtype).float()
    assert torch.equal(out, expected), (f"max difference {(out - expected).abs().max().item():.3g} from the kernel's "
                                        f"own order of sums, rounded once to {dtype}")
    # And the sums are the sums (fp64), within fp32 accumulation and one rounding.
    reference = partials.double().sum(1)
    tolerance = {torch.float32: 1e-5, torch.float16: 2.0**-10, torch.bfloat16: 2.0**-7}[dtype]
    assert ((out.double() - reference).abs() <= 1e-4 + tolerance * reference.abs()).all()


# philox.h's dropped_sum: the CUDA add_layernorm kernels' dropout of one pack (16-byte packs of
# 4 or 8 columns, or single elements), plain C++ that the host compiler runs here. Its kept bits
# must be the Python twin's mask (bert_fast.ops._philox.row_keep), for every pack width.
PHILOX_HARNESS = r"""
#include <cstdint>
#include <cstdio>
#include <cstdlib>

#include "philox.h"

using namespace bert_fast;

// Writes rows x hidden bytes, 1 where dropped_sum<VEC> kept the element.
template <int VEC>
void run(uint64_t seed, int64_t rows, int64_t hidden, float dropout_p) {
  for (int64_t row = 0; row < rows; ++row) {
    for (int64_t col = 0; col < hidden; col += VEC) {
      float sum[VEC], x[VEC], residual[VEC];
      for (int k = 0; k < VEC; ++k) x[k] = 1.0f, residual[k] = 0.0f;
      uint32_t bits = 0;
      dropped_sum<VEC, true>(sum, x, residual, seed, row, col, hidden, dropout_p, 2.0f, &bits, 0);
      for (int k = 0; k < VEC; ++k) {
        const bool kept = (bits >> k) & 1u;
        if (kept != (sum[k] == 2.0f)) std::exit(3);       // the bit and the value agree
        std::putchar(kept ? 1 : 0);
      }
    }
  }
}

// argv: seed, rows, hidden, dropout_p, VEC (1, 4 or 8; hidden a multiple of it).
int main(int argc, char** argv) {
  if (argc != 6) return 1;
  const uint64_t seed = std::strtoull(argv[1], nullptr, 10);
  const int64_t rows = std::atoll(argv[2]), hidden = std::atoll(argv[3]);
  const float dropout_p = std::strtof(argv[4], nullptr);
  switch (std::atoi(argv[5])) {
    case 1: run<1>(seed, rows, hidden, dropout_p); return 0;
    case 4: run<4>(seed, rows, hidden, dropout_p); return 0;
    case 8: run<8>(seed, rows, hidden, dropout_p); return 0;
    default: return 1;
  }
}
"""


@pytest.fixture(scope="module")
def philox_harness(tmp_path_factory):
    return compile_harness(tmp_path_factory, "csrc_philox", PHILOX_HARNESS, "-Wall")


@pytest.mark.parametrize("seed", [1234, 2**40 + 7], ids=["seed_lo", "seed_hi"])
@pytest.mark.parametrize("hidden, vec", [(96, 8), (96, 4), (96, 1), (94, 1), (6, 1)])
def test_cuda_dropout_packs_draw_the_twins_mask(philox_harness, seed, hidden, vec):
    from bert_fast.ops._philox import row_keep
    rows, dropout_p = 5, 0.3
    result = subprocess.run([str(philox_harness), str(seed), str(rows), str(hidden), str(dropout_p), str(vec)],
                            capture_output=True, timeout=60)
    assert result.returncode == 0, f"exit {result.returncode} (3: a kept bit and its value disagree)"
    kept = torch.tensor(list(result.stdout), dtype=torch.bool).view(rows, hidden)
    expected = row_keep(torch.tensor([seed]), dropout_p, rows, hidden, "cpu")
    assert torch.equal(kept, expected), f"{(kept != expected).sum().item()} of {kept.numel()} mask bits differ"
