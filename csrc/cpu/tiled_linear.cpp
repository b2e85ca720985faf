// tiled_linear on CPU: y = x @ W^T (+ bias) in bfloat16 for the few rows of a decode step,
// over a weight laid out once for it ("tiles", specdec_kernels.pack_linear_tiles):
//
//   weight_tiles[t, k2, j, p] = W[64 t + j, 2 k2 + p]    shape [ceil(N / 64), K / 2, 64, 2]
//
// (output rows past N are zero). Why: a decode step's linears are a stream over the weights
// (M = 1..8 rows against 100s of MB), and oneDNN's one-row bf16 product on a CPU without AMX
// streams them at a third of what a core can read (docs/cpu-decode-path.md: ~10 of
// ~30 GB/s). In this layout each 64-byte load holds 16 outputs x 2 inputs of one tile: one
// vdpbf16ps with a broadcast input pair of x adds both products to 16 float accumulators, so a
// tile of 64 outputs is 4 loads and 4 dot products per input pair and per row, with no
// horizontal reduction and the weight read once, front to back. Up to 6 rows share each load
// (24 accumulators; the portable AVX2 / SSE builds: 8 rows, see tile_rows_portable); more
// rows re-read the tile (by then in L2) per group.
//
// Numerics: float32 accumulation over the inputs in order (of each pair the odd input first,
// as vdpbf16ps adds them; a bf16 product is exact in float, so each add is one rounding),
// bias added in float32, one rounding to bf16 (nearest even). Every build (AVX512-BF16; the
// portable AVX-512, AVX2 and baseline ones: bf16 -> float by its bits, then adds of exact
// products) gives the same bits, but for denormals, which vdpbf16ps flushes to zero. A row's
// result does not depend on the other rows or the thread count. Not bitwise oneDNN's (another
// summation order): within float32 accumulation error of float64.
//
// Parallel over tiles (ATen's pool); a tile's rows are computed together so each task writes
// its own outputs.
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "isa.h"
#include "ops.h"
#include "vec.h"

namespace specdec {
namespace {

constexpr int64_t kTile = 64;            // outputs per tile
constexpr int kMaxRows = 8;              // rows that share one pass over a tile, at most
constexpr int64_t kTaskBytes = 1 << 18;  // weight bytes per parallel task, at least

// acc[r, 0:64] (float) of rows r < rows of x -> y[r, n0 : n0 + valid] in bf16 (+ bias).
SPECDEC_INLINE void store_tile(const float* acc, int rows, const c10::BFloat16* bias,
                               c10::BFloat16* y, int64_t ldy, int64_t n0, int64_t valid) {
  for (int r = 0; r < rows; ++r) {
    for (int64_t j = 0; j < valid; ++j) {
      const float v = acc[r * kTile + j] + (bias == nullptr ? 0.f : float(bias[n0 + j]));
      y[r * ldy + n0 + j] = c10::BFloat16(v);  // round to nearest even
    }
  }
}

// ---------------------------------------------------------------- AVX512-BF16 build
#define SPECDEC_BF16_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16")))

// acc[r, 0:64] = sum over k2 of tile[k2, 0:64, 0:2] . x_r[2 k2 : 2 k2 + 2] for ROWS rows
// (inputs: x's bf16 pairs as uint32, row stride ldx pairs).
template <int ROWS>
SPECDEC_BF16_TARGET void tile_rows_bf16(const uint32_t* tile, const void* inputs, int64_t ldx,
                                        int64_t num_pairs, float* acc_out) {
  const auto* x = static_cast<const uint32_t*>(inputs);
  __m512 acc[ROWS][4];
  for (int r = 0; r < ROWS; ++r) {
    for (int j = 0; j < 4; ++j) acc[r][j] = _mm512_setzero_ps();
  }
  for (int64_t k2 = 0; k2 < num_pairs; ++k2) {
    const uint32_t* w = tile + k2 * kTile;
    const __m512i w0 = _mm512_loadu_si512(w), w1 = _mm512_loadu_si512(w + 16);
    const __m512i w2 = _mm512_loadu_si512(w + 32), w3 = _mm512_loadu_si512(w + 48);
    for (int r = 0; r < ROWS; ++r) {
      const __m512bh xb = (__m512bh)_mm512_set1_epi32(static_cast<int>(x[r * ldx + k2]));
      acc[r][0] = _mm512_dpbf16_ps(acc[r][0], (__m512bh)w0, xb);
      acc[r][1] = _mm512_dpbf16_ps(acc[r][1], (__m512bh)w1, xb);
      acc[r][2] = _mm512_dpbf16_ps(acc[r][2], (__m512bh)w2, xb);
      acc[r][3] = _mm512_dpbf16_ps(acc[r][3], (__m512bh)w3, xb);
    }
  }
  for (int r = 0; r < ROWS; ++r) {
    for (int j = 0; j < 4; ++j) _mm512_storeu_ps(acc_out + r * kTile + 16 * j, acc[r][j]);
  }
}

// ---------------------------------------------------------------- portable builds
// The same sums by the bits of bf16: a pair (little-endian uint32) of the tile holds input
// 2 k2's weight in its low half and 2 k2 + 1's in its high half; either, moved to the high
// half, is that float. The inputs come widened to float once per call (widen_inputs), so a
// row's input is one broadcast load from memory, not a scalar conversion per pass.
//
// One pass over the tile's 64 outputs, front to back, for every row count, though ROWS x
// 64 / LANES accumulators outnumber the 16 registers of AVX2 and SSE (up to 8 rows: 64): the
// spilled accumulators live in L1, and a sequential read of each 256-byte tile row is what
// keeps the memory streaming. Measured on Zen 3 (docs/cpu-decode-path.md, random
// weights, 2 threads): a step's weights at 2 / 4 / 8 rows cost 1.0 / 1.1 / 1.8x one row in one
// pass, against 1.2 / 1.4 / 2.0x in passes over 32 outputs sized for the registers. Each
// tile row kPrefetchPairs ahead is prefetched: the hardware's prefetcher alone left a
// 576 x 576 product ~40% slower (it does not run ahead across 4 KB pages).
constexpr int64_t kPrefetchPairs = 32;  // 8 KB ahead

template <int ROWS, int LANES>
SPECDEC_INLINE void tile_rows_portable(const uint32_t* tile, const void* inputs, int64_t ldx,
                                       int64_t num_pairs, float* acc_out) {
  using F = typename Simd<LANES>::f;
  using U = typename Simd<LANES>::i32;
  constexpr int kVecs = kTile / LANES;
  const auto* x = static_cast<const float*>(inputs);  // [ROWS, 2 num_pairs], row stride ldx
  F acc[ROWS][kVecs];
  for (int r = 0; r < ROWS; ++r) {
    for (int j = 0; j < kVecs; ++j) acc[r][j] = F{};
  }
  for (int64_t k2 = 0; k2 < num_pairs; ++k2) {
    if (k2 + kPrefetchPairs < num_pairs) {
      const uint32_t* ahead = tile + (k2 + kPrefetchPairs) * kTile;
      for (int line = 0; line < kTile; line += 16) __builtin_prefetch(ahead + line);
    }
    F x_even[ROWS], x_odd[ROWS];
    for (int r = 0; r < ROWS; ++r) {
      x_odd[r] = splat<LANES>(x[r * ldx + 2 * k2 + 1]);
      x_even[r] = splat<LANES>(x[r * ldx + 2 * k2]);
    }
    // vdpbf16ps' order (the odd input, then the even one, each product exact in float, so a
    // fused multiply-add rounds as a multiply and an add): every build gives the same bits but
    // for denormals, which vdpbf16ps flushes
    for (int j = 0; j < kVecs; ++j) {
      U pairs;
      std::memcpy(&pairs, tile + k2 * kTile + LANES * j, sizeof(pairs));
      const U even_bits = pairs << 16, odd_bits = pairs & int32_t(0xFFFF0000u);
      F even, odd;
      std::memcpy(&even, &even_bits, sizeof(F));
      std::memcpy(&odd, &odd_bits, sizeof(F));
      for (int r = 0; r < ROWS; ++r) {
        acc[r][j] += odd * x_odd[r];
        acc[r][j] += even * x_even[r];
      }
    }
  }
  for (int r = 0; r < ROWS; ++r) {
    for (int j = 0; j < kVecs; ++j)
      std::memcpy(acc_out + r * kTile + LANES * j, &acc[r][j], sizeof(F));
  }
}

// 16 vector registers (AVX2, SSE): up to 8 rows share a pass (a 9th row costs a second pass
// over the tile, by then in L2).
constexpr int kMaxRows16 = 8;

template <int ROWS>
__attribute__((target("avx512f,avx512bw,avx512vl,avx2,fma,f16c"))) void tile_rows_avx512(
    const uint32_t* tile, const void* x, int64_t ldx, int64_t num_pairs, float* acc_out) {
  // 32 registers: 24 accumulators at 6 rows
  tile_rows_portable<ROWS, 16>(tile, x, ldx, num_pairs, acc_out);
}

template <int ROWS>
__attribute__((target("avx2,fma,f16c"))) void tile_rows_avx2(const uint32_t* tile, const void* x,
                                                             int64_t ldx, int64_t num_pairs,
                                                             float* acc_out) {
  tile_rows_portable<ROWS, 8>(tile, x, ldx, num_pairs, acc_out);
}

template <int ROWS>
void tile_rows_baseline(const uint32_t* tile, const void* x, int64_t ldx, int64_t num_pairs,
                        float* acc_out) {
  tile_rows_portable<ROWS, 4>(tile, x, ldx, num_pairs, acc_out);
}

// x [rows, K] bf16 -> its values as float (the bits moved to the high half), into out.
// (Through raw pointers: a memcpy into out[i] may alias the vector's own data pointer, which
// GCC then reloaded per element and left the loop scalar, ~4 ns an element.)
void widen_inputs(const c10::BFloat16* x, int64_t count, std::vector<float>& out) {
  out.resize(static_cast<size_t>(count));
  const auto* __restrict bits = reinterpret_cast<const uint16_t*>(x);
  float* __restrict wide = out.data();
  for (int64_t i = 0; i < count; ++i) {
    const uint32_t high = static_cast<uint32_t>(bits[i]) << 16;
    std::memcpy(&wide[i], &high, 4);
  }
}

// (tile, inputs, input row stride, input pairs, acc): inputs are bf16 pairs (uint32, the stride
// in pairs) for the AVX512-BF16 build, floats (widen_inputs, the stride in floats) otherwise.
using TileRowsFn = void (*)(const uint32_t*, const void*, int64_t, int64_t, float*);

// The widest build cpu_isa() allows: its kernels for 1..max_rows rows (one pass over a tile).
struct TileKernels {
  TileRowsFn fns[kMaxRows];
  int max_rows;
  bool pairs;  // true: the kernels take bf16 pairs; false: the inputs widened to float
};

TileKernels pick_kernels() {
  const CpuIsa isa = cpu_isa();
  if (isa >= CpuIsa::kAvx512Bf16) {
    return {{&tile_rows_bf16<1>, &tile_rows_bf16<2>, &tile_rows_bf16<3>, &tile_rows_bf16<4>,
             &tile_rows_bf16<5>, &tile_rows_bf16<6>},
            6,  // 24 of the 32 registers accumulate
            true};
  }
  if (isa >= CpuIsa::kAvx512) {
    return {{&tile_rows_avx512<1>, &tile_rows_avx512<2>, &tile_rows_avx512<3>, &tile_rows_avx512<4>,
             &tile_rows_avx512<5>, &tile_rows_avx512<6>},
            6,
            false};
  }
  if (isa >= CpuIsa::kAvx2) {
    return {{&tile_rows_avx2<1>, &tile_rows_avx2<2>, &tile_rows_avx2<3>, &tile_rows_avx2<4>,
             &tile_rows_avx2<5>, &tile_rows_avx2<6>, &tile_rows_avx2<7>, &tile_rows_avx2<8>},
            kMaxRows16,
            false};
  }
  return {{&tile_rows_baseline<1>, &tile_rows_baseline<2>, &tile_rows_baseline<3>,
           &tile_rows_baseline<4>, &tile_rows_baseline<5>, &tile_rows_baseline<6>,
           &tile_rows_baseline<7>, &tile_rows_baseline<8>},
          kMaxRows16,
          false};
}

}  // namespace

at::Tensor tiled_linear_cpu(const at::Tensor& x, const at::Tensor& weight_tiles,
                            int64_t out_features, const std::optional<at::Tensor>& bias) {
  const int64_t K = x.size(-1), rows = x.numel() / K;  // K >= 2 (check_tiled_linear)
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = out_features;
  at::Tensor y = at::empty(shape, x.options());
  if (rows == 0 || out_features == 0) return y;
  // (a contiguous x is laid out as its [rows, K] view already: no reshape through the
  // dispatcher, ~1 us a call)
  const at::Tensor xc = x.is_contiguous() ? x : x.reshape({-1, K}).contiguous();
  const at::Tensor bc = bias.has_value() ? bias->contiguous() : at::Tensor();
  const int64_t num_tiles = weight_tiles.size(0), num_pairs = K / 2;
  const auto* tiles = reinterpret_cast<const uint32_t*>(weight_tiles.data_ptr());
  const auto* bp = bias.has_value() ? bc.data_ptr<c10::BFloat16>() : nullptr;
  auto* yp = y.data_ptr<c10::BFloat16>();
  const TileKernels kernels = pick_kernels();
  const bool pairs = kernels.pairs;
  // the portable builds' inputs, widened once per call (a thread's buffer: no allocation in
  // the steady state; the pool's workers only read it)
  thread_local std::vector<float> widened;
  if (!pairs) widen_inputs(xc.data_ptr<c10::BFloat16>(), rows * K, widened);
  const void* inputs = pairs ? xc.data_ptr() : static_cast<const void*>(widened.data());
  const int64_t row_stride = pairs ? num_pairs : K;  // in the inputs' elements
  const int64_t tile_bytes = kTile * K * 2;
  const int64_t grain = std::max<int64_t>(1, kTaskBytes / std::max<int64_t>(tile_bytes, 1));
  at::parallel_for(0, num_tiles, grain, [&](int64_t t0, int64_t t1) {
    alignas(64) float acc[kMaxRows * kTile];
    for (int64_t t = t0; t < t1; ++t) {
      const uint32_t* tile = tiles + t * num_pairs * kTile;
      const int64_t n0 = t * kTile, valid = std::min<int64_t>(kTile, out_features - n0);
      for (int64_t r0 = 0; r0 < rows; r0 += kernels.max_rows) {
        const int group = static_cast<int>(std::min<int64_t>(kernels.max_rows, rows - r0));
        const void* group_inputs =
            pairs ? static_cast<const void*>(static_cast<const uint32_t*>(inputs) + r0 * num_pairs)
                  : static_cast<const void*>(static_cast<const float*>(inputs) + r0 * K);
        kernels.fns[group - 1](tile, group_inputs, row_stride, num_pairs, acc);
        store_tile(acc, group, bp, yp + r0 * out_features, out_features, n0, valid);
      }
    }
  });
  return y;
}

}  // namespace specdec
