// tree_verify on CPU: flash-decoding style tree attention over a paged KV cache.
//
// One task per (request b, KV head h, split s of the key positions). All M = num_nodes[b] *
// group query rows that share KV head h (GQA; row m is tree node m / group, query head
// h * group + m % group) are processed together, so each K / V row is read from the cache
// once per KV head. Keys are staged tile by tile (kTile positions, resolved through the
// block table) into small thread-local float buffers -- K transposed into panels of
// 2 * W keys, V row-major -- which also converts half / bfloat16 to float. Register-blocked
// micro-kernels compute the tile's scores S = Q K^T and the update O += P V; between them an
// online softmax keeps a running max and sum per row (in base 2: the scores are scaled by
// sm_scale * log2(e)). Prefix positions (< cache_lens[b]) are visible to every row; tree
// positions only where the row's tree_mask bit is set. When B * Hkv tasks cannot occupy
// the threads, the positions are split and the partial (O, max, sum) merged afterwards.
//
// The hot loops use GCC vector extensions of W floats, compiled for AVX-512 (W = 16), for
// AVX2 + FMA (W = 8) and for the baseline ISA (W = 4, SSE2 on x86-64); the best the CPU runs
// is picked at run time.
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <limits>
#include <string>
#include <vector>

#include "ops.h"

// Let a * b + c become one FMA instruction in the AVX2 build (ISO C++ mode disables
// contraction by default); it only changes rounding, within the op's tolerance.
#pragma GCC optimize("fp-contract=fast")
// Every vfloat helper is always_inline, so the vector ABI change warned about never applies.
#pragma GCC diagnostic ignored "-Wpsabi"

namespace specdec {
namespace {

// Vectors of W floats; the micro-kernels work on 2 * W columns (keys or head dims) at a time.
template <int W>
struct Simd {
  typedef float f __attribute__((vector_size(W * sizeof(float))));
  typedef int32_t i __attribute__((vector_size(W * sizeof(int32_t))));
};
constexpr int kMaxPanel = 32;           // 2 * the widest W (a multiple of every 2 * W)
constexpr int kRows = 4;                // query rows per micro-kernel call
constexpr int64_t kTile = 64;           // key positions staged at a time (a multiple of kMaxPanel)
constexpr int64_t kMinSplit = 256;      // fewest positions worth a split of their own
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

#define SPECDEC_INLINE __attribute__((always_inline)) inline

template <int W>
SPECDEC_INLINE typename Simd<W>::f splat(float x) {
  return typename Simd<W>::f{} + x;
}
template <int W>
SPECDEC_INLINE typename Simd<W>::f load(const float* p) {
  typename Simd<W>::f v;
  __builtin_memcpy(&v, p, sizeof(v));
  return v;
}
template <typename V>
SPECDEC_INLINE void store(float* p, V v) {
  __builtin_memcpy(p, &v, sizeof(v));
}
template <typename V>
SPECDEC_INLINE V vmax(V a, V b) {
  return a > b ? a : b;
}

// 2^x for x <= 0 (a score minus its row max), ~1 ulp; exactly 0 below -126 and for -inf.
template <int W>
SPECDEC_INLINE typename Simd<W>::f exp2_nonpos(typename Simd<W>::f x) {
  using vfloat = typename Simd<W>::f;
  const vfloat lo = splat<W>(-126.f);
  const vfloat xc = x < lo ? lo : x;
  // Adding 1.5 * 2^23 rounds to an integer k, which then sits in the low mantissa bits.
  const vfloat round = splat<W>(12582912.f);
  const vfloat shifted = xc + round;
  const vfloat k = shifted - round;
  const vfloat f = xc - k;  // in [-0.5, 0.5]
  // Taylor series of 2^f = e^(f ln 2) to degree 7: truncation error < 1e-8 on [-0.5, 0.5].
  vfloat p = splat<W>(1.525273380405984e-05f);
  p = p * f + 1.5403530393381606e-04f;
  p = p * f + 1.3333558146428443e-03f;
  p = p * f + 9.618129107628477e-03f;
  p = p * f + 5.550410866482158e-02f;
  p = p * f + 2.402265069591007e-01f;
  p = p * f + 6.931471805599453e-01f;
  p = p * f + 1.f;
  typename Simd<W>::i kbits;
  __builtin_memcpy(&kbits, &shifted, sizeof(kbits));
  const typename Simd<W>::i bits = (kbits - 0x4B400000 + 127) << 23;  // 2^k as a float (0x4B400000 = round)
  vfloat scale;
  __builtin_memcpy(&scale, &bits, sizeof(scale));
  return x < lo ? vfloat{} : p * scale;
}

template <int W>
SPECDEC_INLINE float hmax(typename Simd<W>::f v) {
  float m = v[0];
  for (int i = 1; i < W; ++i) m = std::max(m, v[i]);
  return m;
}
template <int W>
SPECDEC_INLINE float hsum(typename Simd<W>::f v) {
  float s = 0.f;
  for (int i = 0; i < W; ++i) s += v[i];
  return s;
}

// The inputs of one call, with the index arithmetic of the paged layout.
template <typename scalar_t>
struct Problem {
  const scalar_t* q;   // [B, T, Hq, D]
  const scalar_t* k;   // [num_blocks, block_size, Hkv, D]
  const scalar_t* v;   // [num_blocks, block_size, Hkv, D]
  const int32_t* block_table;  // [B, max_blocks]
  const int32_t* cache_lens;   // [B]
  const int32_t* num_nodes;    // [B]
  const uint64_t* tree_mask;   // [B, T, W]
  int64_t T, Hq, Hkv, D, Dp, group, block_size, max_blocks, W, splits;
  float scale;  // sm_scale * log2(e)

  int64_t rows(int64_t b) const { return int64_t(num_nodes[b]) * group; }
  int64_t length(int64_t b) const { return int64_t(cache_lens[b]) + num_nodes[b]; }
  // Offset of (logical position pos of request b, KV head h) in k / v.
  int64_t kv_offset(int64_t b, int64_t pos, int64_t h) const {
    const int64_t blk = block_table[b * max_blocks + pos / block_size];
    return ((blk * block_size + pos % block_size) * Hkv + h) * D;
  }
  // Offset of query row m (tree node m / group, head h * group + m % group) in q and out.
  int64_t q_offset(int64_t b, int64_t h, int64_t m) const {
    return ((b * T + m / group) * Hq + h * group + m % group) * D;
  }
  // [p0, p1): the key positions of split s of request b (tile aligned, possibly empty).
  std::pair<int64_t, int64_t> split_range(int64_t b, int64_t s) const {
    const int64_t len = length(b);
    const int64_t chunk = ((len + splits - 1) / splits + kTile - 1) / kTile * kTile;
    const int64_t p0 = std::min(s * chunk, len);
    return {p0, std::min(p0 + chunk, len)};
  }
};

// Thread-local scratch of one task; Mp = the most rows any task has, padded to kRows.
struct Workspace {
  std::vector<float> buf;
  float *q, *o, *s, *kt, *vb, *mx, *l, *alpha;
  Workspace(int64_t Mp, int64_t D, int64_t Dp)
      : buf(2 * Mp * Dp + Mp * kTile + kTile * D + kTile * Dp + 3 * Mp, 0.f) {
    q = buf.data();            // [Mp, Dp] queries as float
    o = q + Mp * Dp;           // [Mp, Dp] unnormalised output
    s = o + Mp * Dp;           // [Mp, kTile] scores, then probabilities
    kt = s + Mp * kTile;       // [kTile / (2 W), D, 2 W] K tile, transposed panels
    vb = kt + kTile * D;       // [kTile, Dp] V tile (columns >= D stay zero)
    mx = vb + kTile * Dp;      // [Mp] running max (base 2)
    l = mx + Mp;               // [Mp] running sum
    alpha = l + Mp;            // [Mp] rescale of o for the current tile
  }
};

// s[r, 0:2W] = scale * q[r, :] . kt[:, 0:2W] for kRows rows (kt: one [D, 2W] panel).
template <int W>
SPECDEC_INLINE void score_block(const float* q, int64_t ldq, const float* kt, int64_t D,
                                float scale, float* s, int64_t lds) {
  using vfloat = typename Simd<W>::f;
  vfloat acc[kRows][2] = {};
  for (int64_t d = 0; d < D; ++d) {
    const vfloat k0 = load<W>(kt + d * 2 * W), k1 = load<W>(kt + d * 2 * W + W);
    for (int r = 0; r < kRows; ++r) {
      const vfloat qv = splat<W>(q[r * ldq + d]);
      acc[r][0] = qv * k0 + acc[r][0];
      acc[r][1] = qv * k1 + acc[r][1];
    }
  }
  for (int r = 0; r < kRows; ++r) {
    store(s + r * lds, acc[r][0] * scale);
    store(s + r * lds + W, acc[r][1] * scale);
  }
}

// o[r, 0:2W] = alpha[r] * o[r, 0:2W] + sum_n p[r, n] * vb[n, 0:2W] for kRows rows.
template <int W>
SPECDEC_INLINE void update_block(const float* p, int64_t ldp, const float* vb, int64_t ldv,
                                 int64_t nt, const float* alpha, float* o, int64_t ldo) {
  using vfloat = typename Simd<W>::f;
  vfloat acc[kRows][2];
  for (int r = 0; r < kRows; ++r) {
    acc[r][0] = load<W>(o + r * ldo) * alpha[r];
    acc[r][1] = load<W>(o + r * ldo + W) * alpha[r];
  }
  for (int64_t n = 0; n < nt; ++n) {
    const vfloat v0 = load<W>(vb + n * ldv), v1 = load<W>(vb + n * ldv + W);
    for (int r = 0; r < kRows; ++r) {
      const vfloat pv = splat<W>(p[r * ldp + n]);
      acc[r][0] = pv * v0 + acc[r][0];
      acc[r][1] = pv * v1 + acc[r][1];
    }
  }
  for (int r = 0; r < kRows; ++r) {
    store(o + r * ldo, acc[r][0]);
    store(o + r * ldo + W, acc[r][1]);
  }
}

// Stages positions [p, p + nt) of (b, h) into ws.kt (panels of 2W keys) / ws.vb as float.
template <int W, typename scalar_t>
SPECDEC_INLINE void stage_tile(const Problem<scalar_t>& P, Workspace& ws, int64_t b, int64_t h,
                               int64_t p, int64_t nt) {
  for (int64_t j = 0; j < nt; ++j) {
    const int64_t off = P.kv_offset(b, p + j, h);
    const scalar_t* ks = P.k + off;
    const scalar_t* vs = P.v + off;
    float* kcol = ws.kt + (j / (2 * W)) * P.D * 2 * W + j % (2 * W);
    float* vrow = ws.vb + j * P.Dp;
    for (int64_t d = 0; d < P.D; ++d) kcol[d * 2 * W] = static_cast<float>(ks[d]);
    for (int64_t d = 0; d < P.D; ++d) vrow[d] = static_cast<float>(vs[d]);
  }
}

// Hides the tile columns a row may not see: tree nodes outside its mask, and the padding
// columns [nt, npad) of a partial tile.
template <typename scalar_t>
SPECDEC_INLINE void mask_tile(const Problem<scalar_t>& P, Workspace& ws, int64_t b, int64_t p,
                              int64_t nt, int64_t npad) {
  const int64_t c = P.cache_lens[b], M = P.rows(b);
  const int64_t j0 = std::max<int64_t>(0, c - p);  // first tree column of the tile
  for (int64_t m = 0; m < M; ++m) {
    float* row = ws.s + m * kTile;
    const uint64_t* bits = P.tree_mask + (b * P.T + m / P.group) * P.W;
    for (int64_t j = j0; j < nt; ++j) {
      const int64_t node = p + j - c;
      if (!((bits[node / 64] >> (node % 64)) & 1)) row[j] = kNegInf;
    }
    for (int64_t j = nt; j < npad; ++j) row[j] = kNegInf;
  }
}

// Online softmax over one tile: turns the scores of each valid row into probabilities
// relative to the updated running max, and records how much o must be rescaled.
template <int W>
SPECDEC_INLINE void softmax_tile(Workspace& ws, int64_t M, int64_t npad) {
  using vfloat = typename Simd<W>::f;
  for (int64_t m = 0; m < M; ++m) {
    float* row = ws.s + m * kTile;
    vfloat vm = splat<W>(kNegInf);
    for (int64_t j = 0; j < npad; j += W) vm = vmax(vm, load<W>(row + j));
    const float m_new = std::max(ws.mx[m], hmax<W>(vm));
    if (m_new == kNegInf) {  // nothing visible yet: o stays zero
      for (int64_t j = 0; j < npad; ++j) row[j] = 0.f;
      ws.alpha[m] = 1.f;
      continue;
    }
    const vfloat sub = splat<W>(m_new);
    vfloat vs = {};
    for (int64_t j = 0; j < npad; j += W) {
      const vfloat e = exp2_nonpos<W>(load<W>(row + j) - sub);
      store(row + j, e);
      vs += e;
    }
    ws.alpha[m] = std::exp2(ws.mx[m] - m_new);  // 0 when the running max was -inf
    ws.l[m] = ws.l[m] * ws.alpha[m] + hsum<W>(vs);
    ws.mx[m] = m_new;
  }
}

// Runs the positions of split s of (b, h); leaves unnormalised o, mx and l in ws.
template <int W, typename scalar_t>
SPECDEC_INLINE void attend(const Problem<scalar_t>& P, Workspace& ws, int64_t b, int64_t h,
                           int64_t s) {
  const int64_t M = P.rows(b), Mr = (M + kRows - 1) / kRows * kRows, D = P.D, Dp = P.Dp;
  for (int64_t m = 0; m < M; ++m) {
    const scalar_t* src = P.q + P.q_offset(b, h, m);
    for (int64_t d = 0; d < D; ++d) ws.q[m * Dp + d] = static_cast<float>(src[d]);
  }
  std::fill(ws.q + M * Dp, ws.q + Mr * Dp, 0.f);  // padding rows: scores 0, never softmaxed
  std::fill(ws.o, ws.o + Mr * Dp, 0.f);
  std::fill(ws.mx, ws.mx + Mr, kNegInf);
  std::fill(ws.l, ws.l + Mr, 0.f);
  std::fill(ws.alpha, ws.alpha + Mr, 1.f);  // rows >= M: zero queries, zero o, never rescaled
  const auto [p0, p1] = P.split_range(b, s);
  for (int64_t p = p0; p < p1; p += kTile) {
    const int64_t nt = std::min(kTile, p1 - p), npad = (nt + 2 * W - 1) / (2 * W) * (2 * W);
    stage_tile<W>(P, ws, b, h, p, nt);
    for (int64_t m = 0; m < Mr; m += kRows) {
      for (int64_t j = 0; j < npad; j += 2 * W) {
        score_block<W>(ws.q + m * Dp, Dp, ws.kt + j * D, D, P.scale, ws.s + m * kTile + j,
                       kTile);
      }
    }
    mask_tile(P, ws, b, p, nt, npad);
    softmax_tile<W>(ws, M, npad);
    for (int64_t m = 0; m < Mr; m += kRows) {
      for (int64_t d = 0; d < Dp; d += 2 * W) {
        update_block<W>(ws.s + m * kTile, kTile, ws.vb + d, Dp, nt, ws.alpha + m,
                        ws.o + m * Dp + d, Dp);
      }
    }
  }
}

template <typename scalar_t>
__attribute__((target("avx512f,avx512vl,avx512bw,avx2,fma,f16c"))) void attend_avx512(
    const Problem<scalar_t>& P, Workspace& ws, int64_t b, int64_t h, int64_t s) {
  attend<16>(P, ws, b, h, s);
}

template <typename scalar_t>
__attribute__((target("avx2,fma,f16c"))) void attend_avx2(const Problem<scalar_t>& P,
                                                          Workspace& ws, int64_t b, int64_t h,
                                                          int64_t s) {
  attend<8>(P, ws, b, h, s);
}

template <typename scalar_t>
void attend_baseline(const Problem<scalar_t>& P, Workspace& ws, int64_t b, int64_t h,
                     int64_t s) {
  attend<4>(P, ws, b, h, s);
}

// The widest build the CPU runs; SPECDEC_CPU_ISA=avx2|baseline caps it, so that the tests
// exercise every build on one machine.
template <typename scalar_t>
auto pick_attend() {
  static const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
                           __builtin_cpu_supports("f16c");
  static const bool avx512 = avx2 && __builtin_cpu_supports("avx512f") &&
                             __builtin_cpu_supports("avx512vl") &&
                             __builtin_cpu_supports("avx512bw");
  const char* env = std::getenv("SPECDEC_CPU_ISA");
  const std::string cap = env ? env : "";
  TORCH_CHECK(cap.empty() || cap == "avx512" || cap == "avx2" || cap == "baseline",
              "SPECDEC_CPU_ISA must be avx512, avx2 or baseline, got '", cap, "'");
  if (avx512 && (cap.empty() || cap == "avx512")) return &attend_avx512<scalar_t>;
  if (avx2 && cap != "baseline") return &attend_avx2<scalar_t>;
  return &attend_baseline<scalar_t>;
}

// out[b, m / group, h * group + m % group, :] = o[m, :] / l[m] for the M valid rows
// (rows without any visible key have l = 0 and o = 0 and stay zero).
template <typename scalar_t>
void write_rows(const Problem<scalar_t>& P, scalar_t* out, int64_t b, int64_t h, const float* o,
                const float* l) {
  for (int64_t m = 0; m < P.rows(b); ++m) {
    const float inv = l[m] > 0.f ? 1.f / l[m] : 0.f;
    scalar_t* dst = out + P.q_offset(b, h, m);
    for (int64_t d = 0; d < P.D; ++d) dst[d] = static_cast<scalar_t>(o[m * P.Dp + d] * inv);
  }
}

// Number of position splits per request: enough tasks for every thread (x4 for balance),
// but no split shorter than kMinSplit positions.
int64_t choose_splits(int64_t tasks, int64_t max_len) {
  const int64_t want = (4 * at::get_num_threads() + tasks - 1) / tasks;
  return std::max<int64_t>(1, std::min(want, max_len / kMinSplit));
}

template <typename scalar_t>
void tree_verify_typed(const Problem<scalar_t>& P, int64_t B, scalar_t* out) {
  const int64_t Mp = (P.T * P.group + kRows - 1) / kRows * kRows, Dp = P.Dp, S = P.splits;
  const auto attend_fn = pick_attend<scalar_t>();
  // Partial results of every (b, h, s) task when positions are split, merged below.
  std::vector<float> part_o, part_ml;
  if (S > 1) {
    part_o.resize(B * P.Hkv * S * Mp * Dp);
    part_ml.resize(B * P.Hkv * S * 2 * Mp);
  }
  at::parallel_for(0, B * P.Hkv * S, 1, [&](int64_t t0, int64_t t1) {
    Workspace ws(Mp, P.D, Dp);
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t b = t / (P.Hkv * S), h = (t / S) % P.Hkv, s = t % S;
      attend_fn(P, ws, b, h, s);
      if (S == 1) {
        write_rows(P, out, b, h, ws.o, ws.l);
        continue;
      }
      const int64_t M = P.rows(b);
      std::copy(ws.o, ws.o + M * Dp, part_o.data() + t * Mp * Dp);
      std::copy(ws.mx, ws.mx + M, part_ml.data() + t * 2 * Mp);
      std::copy(ws.l, ws.l + M, part_ml.data() + t * 2 * Mp + Mp);
    }
  });
  if (S == 1) return;
  at::parallel_for(0, B * P.Hkv, 1, [&](int64_t t0, int64_t t1) {
    std::vector<float> o(Mp * Dp), l(Mp);
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t b = t / P.Hkv, h = t % P.Hkv;
      for (int64_t m = 0; m < P.rows(b); ++m) {
        float mx = kNegInf;
        for (int64_t s = 0; s < S; ++s) mx = std::max(mx, part_ml[(t * S + s) * 2 * Mp + m]);
        std::fill(o.begin() + m * Dp, o.begin() + (m + 1) * Dp, 0.f);
        l[m] = 0.f;
        if (mx == kNegInf) continue;  // no visible key in any split
        for (int64_t s = 0; s < S; ++s) {
          const float* ml = part_ml.data() + (t * S + s) * 2 * Mp;
          if (ml[m] == kNegInf) continue;  // empty split: its o was never written
          const float w = std::exp2(ml[m] - mx);
          l[m] += w * ml[Mp + m];
          const float* po = part_o.data() + ((t * S + s) * Mp + m) * Dp;
          for (int64_t d = 0; d < P.D; ++d) o[m * Dp + d] += w * po[d];
        }
      }
      write_rows(P, out, b, h, o.data(), l.data());
    }
  });
}

template <typename scalar_t>
at::Tensor run(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
               const at::Tensor& block_table, const at::Tensor& cache_lens,
               const at::Tensor& num_nodes, const at::Tensor& tree_mask, double sm_scale) {
  const int64_t B = q.size(0), T = q.size(1), Hq = q.size(2), D = q.size(3);
  const int64_t Hkv = k_cache.size(2);
  Problem<scalar_t> P{q.data_ptr<scalar_t>(),
                      k_cache.data_ptr<scalar_t>(),
                      v_cache.data_ptr<scalar_t>(),
                      block_table.data_ptr<int32_t>(),
                      cache_lens.data_ptr<int32_t>(),
                      num_nodes.data_ptr<int32_t>(),
                      reinterpret_cast<const uint64_t*>(tree_mask.data_ptr<int64_t>()),
                      T,
                      Hq,
                      Hkv,
                      D,
                      (D + kMaxPanel - 1) / kMaxPanel * kMaxPanel,
                      Hq / Hkv,
                      k_cache.size(1),
                      block_table.size(1),
                      tree_mask.size(2),
                      1,
                      static_cast<float>(sm_scale * kLog2e)};
  int64_t max_len = 0;
  for (int64_t b = 0; b < B; ++b) max_len = std::max(max_len, P.length(b));
  P.splits = choose_splits(B * Hkv, max_len);
  at::Tensor out = at::zeros_like(q);  // padded rows stay zero
  tree_verify_typed(P, B, out.data_ptr<scalar_t>());
  return out;
}

}  // namespace

at::Tensor tree_verify_cpu(const at::Tensor& q, const at::Tensor& k_cache,
                           const at::Tensor& v_cache, const at::Tensor& block_table,
                           const at::Tensor& cache_lens, const at::Tensor& num_nodes,
                           const at::Tensor& tree_mask, double sm_scale) {
  switch (q.scalar_type()) {
    case at::kFloat:
      return run<float>(q, k_cache, v_cache, block_table, cache_lens, num_nodes, tree_mask,
                        sm_scale);
    case at::kHalf:
      return run<at::Half>(q, k_cache, v_cache, block_table, cache_lens, num_nodes, tree_mask,
                           sm_scale);
    case at::kBFloat16:
      return run<at::BFloat16>(q, k_cache, v_cache, block_table, cache_lens, num_nodes,
                               tree_mask, sm_scale);
    default:
      TORCH_CHECK(false, "tree_verify: unsupported dtype ", q.scalar_type());
  }
}

}  // namespace specdec
