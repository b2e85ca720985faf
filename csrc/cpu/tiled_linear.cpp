// tiled_linear on CPU: y = x @ W^T (+ bias) in bfloat16 for the few rows of a decode step,
// over a weight laid out once for it ("tiles", specdec_kernels.pack_linear_tiles):
//
//   weight_tiles[t, k2, j, p] = W[64 t + j, 2 k2 + p]    shape [ceil(N / 64), K / 2, 64, 2]
//
// (output rows past N are zero). Why: a decode step's linears are a stream over the weights
// (M = 1..8 rows against 100s of MB), and oneDNN's one-row bf16 product on a CPU without AMX
// streams them at a third of what a core can read (benchmarks/RESULTS.md, session 9: ~10 of
// ~30 GB/s). In this layout each 64-byte load holds 16 outputs x 2 inputs of one tile: one
// vdpbf16ps with a broadcast input pair of x adds both products to 16 float accumulators, so a
// tile of 64 outputs is 4 loads and 4 dot products per input pair and per row, with no
// horizontal reduction and the weight read once, front to back. Up to 6 rows share each load
// (24 accumulators); more rows re-read the tile (by then in L2) per group of 6.
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
constexpr int kMaxRows = 6;              // rows that share one pass over a tile
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
// (x: bf16 pairs as uint32, row stride ldx pairs).
template <int ROWS>
SPECDEC_BF16_TARGET void tile_rows_bf16(const uint32_t* tile, const uint32_t* x, int64_t ldx,
                                        int64_t num_pairs, float* acc_out) {
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
// The same sums by the bits of bf16: a pair (little-endian uint32) holds input 2 k2 in its low
// half and 2 k2 + 1 in its high half; either, moved to the high half, is that float.
template <int ROWS>
SPECDEC_INLINE void tile_rows_portable(const uint32_t* tile, const uint32_t* x, int64_t ldx,
                                       int64_t num_pairs, float* acc_out) {
  using F = Simd<16>::f;
  using U = Simd<16>::i32;
  F acc[ROWS][4] = {};
  for (int64_t k2 = 0; k2 < num_pairs; ++k2) {
    float x_even[ROWS], x_odd[ROWS];
    for (int r = 0; r < ROWS; ++r) {
      const uint32_t pair = x[r * ldx + k2], even = pair << 16, odd = pair & 0xFFFF0000u;
      std::memcpy(&x_even[r], &even, 4);
      std::memcpy(&x_odd[r], &odd, 4);
    }
    for (int j = 0; j < 4; ++j) {
      U pairs;
      std::memcpy(&pairs, tile + k2 * kTile + 16 * j, sizeof(pairs));
      const U even_bits = pairs << 16, odd_bits = pairs & int32_t(0xFFFF0000u);
      F even, odd;
      std::memcpy(&even, &even_bits, sizeof(even));
      std::memcpy(&odd, &odd_bits, sizeof(odd));
      // vdpbf16ps' order (the odd input, then the even one, each product exact in float):
      // every build gives the same bits but for denormals, which vdpbf16ps flushes
      for (int r = 0; r < ROWS; ++r) {
        acc[r][j] += odd * x_odd[r];
        acc[r][j] += even * x_even[r];
      }
    }
  }
  for (int r = 0; r < ROWS; ++r) {
    for (int j = 0; j < 4; ++j) std::memcpy(acc_out + r * kTile + 16 * j, &acc[r][j], 64);
  }
}

template <int ROWS>
__attribute__((target("avx512f,avx512bw,avx512vl,avx2,fma,f16c"))) void tile_rows_avx512(
    const uint32_t* tile, const uint32_t* x, int64_t ldx, int64_t num_pairs, float* acc_out) {
  tile_rows_portable<ROWS>(tile, x, ldx, num_pairs, acc_out);
}

template <int ROWS>
__attribute__((target("avx2,fma,f16c"))) void tile_rows_avx2(const uint32_t* tile,
                                                             const uint32_t* x, int64_t ldx,
                                                             int64_t num_pairs, float* acc_out) {
  tile_rows_portable<ROWS>(tile, x, ldx, num_pairs, acc_out);
}

template <int ROWS>
void tile_rows_baseline(const uint32_t* tile, const uint32_t* x, int64_t ldx, int64_t num_pairs,
                        float* acc_out) {
  tile_rows_portable<ROWS>(tile, x, ldx, num_pairs, acc_out);
}

using TileRowsFn = void (*)(const uint32_t*, const uint32_t*, int64_t, int64_t, float*);

// The kernels for 1..kMaxRows rows of the widest build cpu_isa() allows.
void pick_kernels(TileRowsFn (&fns)[kMaxRows]) {
  const CpuIsa isa = cpu_isa();
  if (isa >= CpuIsa::kAvx512Bf16) {
    fns[0] = &tile_rows_bf16<1>, fns[1] = &tile_rows_bf16<2>;
    fns[2] = &tile_rows_bf16<3>, fns[3] = &tile_rows_bf16<4>;
    fns[4] = &tile_rows_bf16<5>, fns[5] = &tile_rows_bf16<6>;
  } else if (isa >= CpuIsa::kAvx512) {
    fns[0] = &tile_rows_avx512<1>, fns[1] = &tile_rows_avx512<2>;
    fns[2] = &tile_rows_avx512<3>, fns[3] = &tile_rows_avx512<4>;
    fns[4] = &tile_rows_avx512<5>, fns[5] = &tile_rows_avx512<6>;
  } else if (isa >= CpuIsa::kAvx2) {
    fns[0] = &tile_rows_avx2<1>, fns[1] = &tile_rows_avx2<2>;
    fns[2] = &tile_rows_avx2<3>, fns[3] = &tile_rows_avx2<4>;
    fns[4] = &tile_rows_avx2<5>, fns[5] = &tile_rows_avx2<6>;
  } else {
    fns[0] = &tile_rows_baseline<1>, fns[1] = &tile_rows_baseline<2>;
    fns[2] = &tile_rows_baseline<3>, fns[3] = &tile_rows_baseline<4>;
    fns[4] = &tile_rows_baseline<5>, fns[5] = &tile_rows_baseline<6>;
  }
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
  const auto* xp = reinterpret_cast<const uint32_t*>(xc.data_ptr());
  const auto* bp = bias.has_value() ? bc.data_ptr<c10::BFloat16>() : nullptr;
  auto* yp = y.data_ptr<c10::BFloat16>();
  TileRowsFn fns[kMaxRows];
  pick_kernels(fns);
  const int64_t tile_bytes = kTile * K * 2;
  const int64_t grain = std::max<int64_t>(1, kTaskBytes / std::max<int64_t>(tile_bytes, 1));
  at::parallel_for(0, num_tiles, grain, [&](int64_t t0, int64_t t1) {
    alignas(64) float acc[kMaxRows * kTile];
    for (int64_t t = t0; t < t1; ++t) {
      const uint32_t* tile = tiles + t * num_pairs * kTile;
      const int64_t n0 = t * kTile, valid = std::min<int64_t>(kTile, out_features - n0);
      for (int64_t r0 = 0; r0 < rows; r0 += kMaxRows) {
        const int group = static_cast<int>(std::min<int64_t>(kMaxRows, rows - r0));
        fns[group - 1](tile, xp + r0 * num_pairs, num_pairs, num_pairs, acc);
        store_tile(acc, group, bp, yp + r0 * out_features, out_features, n0, valid);
      }
    }
  });
  return y;
}

}  // namespace specdec
