// tree_verify on CPU: flash-decoding style tree attention over a paged KV cache.
//
// One task per (request b, KV head h, block of up to kRowBlock query rows), or per (task,
// segment) when those cannot occupy the threads (see tree_verify_typed); the threads take
// the tasks dearest first, each the next when free. The query rows of a block share KV
// head h (GQA, group_size = Hq / Hkv; row m is tree node m / group_size, query head
// h * group_size + m % group_size) and are processed together, so each K / V row is read
// from the cache once per block: once per KV head for a tree, a few times for a prefill
// chunk, whose hundreds of rows would otherwise be one task per KV head (3 tasks on 2
// threads for the default model) with buffers past the L2. The vector lanes run over query
// rows: the queries are staged once per task transposed ([D, rows]), the scores of a tile are kept
// transposed ([keys, rows]) and so is the output ([D, rows]). Then both products broadcast
// single K / V elements from their natural row-major layout -- S^T[n, :] += K[n, d] * Q^T[d, :]
// and O^T[d, :] += V[n, d] * P^T[n, :] -- and the online softmax (running max and sum per
// row, in base 2: scores are scaled by sm_scale * log2(e)) needs no horizontal reduction.
// Keys are staged tile by tile (kTile positions, resolved through the block table) into
// small thread-local buffers, converted to float; a row panel that sees no key of a tile (a
// prefill chunk's early rows against its later tiles) skips it. Prefix positions (< cache_lens[b])
// are visible to every row; tree positions only where the row's tree_mask bit is set (tree_mask
// rows are mask_words = ceil(T / 64) 64-bit words). The keys are taken in segments of
// kSegment positions, each a fresh online softmax whose (O, max, sum) is folded into the
// row's result in order: the same bits whether the segments ran in one task or in parallel
// tasks, whatever the batch, the thread count, the row blocks or the tree's size.
//
// The float loops use vectors of LANES float lanes (vec.h), compiled for AVX-512 (LANES = 16),
// for AVX2 + FMA (LANES = 8) and for the baseline ISA (LANES = 4, SSE2 on x86-64). bfloat16
// inputs on a CPU with AVX512-BF16 take a fourth build that multiplies bf16 pairs with
// vdpbf16ps (float accumulation; the probabilities are rounded to bf16 for P V, as flash
// attention kernels do); so does the few-rows kernel (a plain step's and a small tree's <= 8
// rows per KV head: lanes over head dims) for head dims a multiple of 32, reading the cache's
// bf16 rows in place. On a CPU with AMX-BF16 the panel kernel's two products run on AMX tiles
// instead (a fifth build, "AMX build" below; the few-rows kernel stays on vdpbf16ps). The
// best build the CPU runs is picked at run time (pick_attend); the dtype with
// SPECDEC_DISPATCH_FLOAT_DTYPE (dispatch.h).
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <immintrin.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <new>
#include <type_traits>
#include <utility>
#include <vector>

#include "dispatch.h"
#include "isa.h"
#include "numeric_constants.h"
#include "ops.h"
#include "vec.h"

// Let a * b + c become one FMA instruction in the AVX2 build (ISO C++ mode disables
// contraction by default); it only changes rounding, within the op's tolerance.
#pragma GCC optimize("fp-contract=fast")

namespace specdec {
namespace {

// The micro-kernels work on 2 * LANES query rows at a time (LANES float lanes, vec.h).
// Keys (scores) or head dims (output) per micro-kernel call: 2 * kCols<LANES> accumulators
// (+ 3 operands) fill but do not overflow the 32 zmm or 16 ymm / xmm registers.
template <int LANES>
constexpr int kCols = LANES == 16 ? 8 : 4;
constexpr int kMaxLanes = 16;  // the widest LANES (AVX-512): row buffers are padded by it
constexpr int kMaxCols = 8;    // the largest kCols: head dims are padded to it
constexpr int kMaxPanel = 2 * kMaxLanes;  // rows are padded to it
constexpr int64_t kTile = 64;  // key positions staged at a time (even, a multiple of kMaxCols)
// Query rows per task at most (a multiple of kMaxPanel): see row_tasks.
constexpr int64_t kRowBlock = 128;
// Keys are taken in segments of kSegment positions (fixed, from position 0): each from a
// fresh online softmax, folded into the row's result in order (fold_segment). A split over
// threads is a segment: the same bits whichever way the segments are run (see
// tree_verify_typed).
constexpr int64_t kSegment = 256;
constexpr int64_t kMinSplitSegments = 4;                // fewest segments worth a task each
constexpr int64_t kPartialsBudget = int64_t(64) << 20;  // bytes of segment partials, at most
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// 2^x for x <= 0 (a score minus its row max), ~1 ulp; exactly 0 below -126 and for -inf.
template <int LANES>
SPECDEC_INLINE typename Simd<LANES>::f exp2_nonpos(typename Simd<LANES>::f x) {
  using vfloat = typename Simd<LANES>::f;
  const vfloat lo = splat<LANES>(-126.f);
  const vfloat xc = x < lo ? lo : x;
  // Adding 1.5 * 2^23 rounds to an integer k, which then sits in the low mantissa bits.
  const vfloat round = splat<LANES>(12582912.f);
  const vfloat shifted = xc + round;
  const vfloat k = shifted - round;
  const vfloat f = xc - k;  // in [-0.5, 0.5]
  // Taylor series of 2^f = e^(f ln 2) to degree 7: truncation error < 1e-8 on [-0.5, 0.5].
  vfloat p = splat<LANES>(1.525273380405984e-05f);
  p = p * f + 1.5403530393381606e-04f;
  p = p * f + 1.3333558146428443e-03f;
  p = p * f + 9.618129107628477e-03f;
  p = p * f + 5.550410866482158e-02f;
  p = p * f + 2.402265069591007e-01f;
  p = p * f + 6.931471805599453e-01f;
  p = p * f + 1.f;
  typename Simd<LANES>::i32 kbits;
  __builtin_memcpy(&kbits, &shifted, sizeof(kbits));
  // 2^k as a float (0x4B400000 = round)
  const typename Simd<LANES>::i32 bits = (kbits - 0x4B400000 + 127) << 23;
  vfloat scale;
  __builtin_memcpy(&scale, &bits, sizeof(scale));
  return x < lo ? vfloat{} : p * scale;
}

// The inputs of one call, with the index arithmetic of the paged layout. q and the caches
// are read through their strides (in elements; the last dimension is contiguous), so any
// view works: NHD or HND pages, one half of a joint KV tensor, a token pool (block size 1).
template <typename scalar_t>
struct Problem {
  const scalar_t* q;           // [B, T, Hq, D], strides q_stride
  const scalar_t* k;           // [num_blocks, block_size, Hkv, D], strides k_stride
  const scalar_t* v;           // [num_blocks, block_size, Hkv, D], strides v_stride
  const int32_t* block_table;  // [B, max_blocks]
  const int32_t* cache_lens;   // [B]
  const int32_t* num_nodes;    // [B]
  const uint64_t* tree_mask;   // [B, T, mask_words]
  int64_t T, Hq, Hkv, D;
  int64_t group_size;   // query heads per KV head: Hq / Hkv
  int64_t block_size;   // positions per cache block
  int block_shift;      // log2(block_size) when a power of two, else -1
  int64_t max_blocks;   // block table entries per request
  int64_t mask_words;   // 64-bit words per tree_mask row: ceil(T / 64)
  float scale;          // sm_scale * log2(e)
  int64_t Dp;           // D padded to kMaxCols
  int64_t Mp;           // the row stride of a task's buffers: the most rows of any task,
                        // T * group_size padded to kMaxPanel, at most kRowBlock (row_tasks)
  int64_t q_stride[3];  // q strides of b, t, head
  int64_t k_stride[3];  // k_cache strides of block, row in block, head
  int64_t v_stride[3];  // v_cache strides of block, row in block, head

  int64_t rows(int64_t b) const { return int64_t(num_nodes[b]) * group_size; }
  int64_t length(int64_t b) const { return int64_t(cache_lens[b]) + num_nodes[b]; }
  // Offset of (logical position pos of request b, KV head h) in a cache with these strides.
  // (A power-of-two block size takes a shift and a mask: a 64-bit division per K / V row was
  // most of the few-rows kernels' time.)
  int64_t kv_offset(const int64_t* stride, int64_t b, int64_t pos, int64_t h) const {
    const int64_t entry = block_shift >= 0 ? pos >> block_shift : pos / block_size;
    const int64_t blk = block_table[b * max_blocks + entry];
    return blk * stride[0] + in_block(pos) * stride[1] + h * stride[2];
  }
  // Position pos's row within its cache block.
  int64_t in_block(int64_t pos) const {
    return block_shift >= 0 ? pos & (block_size - 1) : pos % block_size;
  }
  // The K and V rows of positions [p, p + n) of (b, h) into k_rows / v_rows: one block
  // table lookup per block, the rows within it a row stride apart.
  void tile_rows(int64_t b, int64_t h, int64_t p, int64_t n, const scalar_t** k_rows,
                 const scalar_t** v_rows) const {
    for (int64_t j = 0; j < n;) {
      const int64_t run = std::min(n - j, block_size - in_block(p + j));
      const scalar_t* k_first = k_row(b, p + j, h);
      const scalar_t* v_first = v_row(b, p + j, h);
      for (int64_t i = 0; i < run; ++i) {
        k_rows[j + i] = k_first + i * k_stride[1];
        v_rows[j + i] = v_first + i * v_stride[1];
      }
      j += run;
    }
  }
  const scalar_t* k_row(int64_t b, int64_t pos, int64_t h) const {
    return k + kv_offset(k_stride, b, pos, h);
  }
  const scalar_t* v_row(int64_t b, int64_t pos, int64_t h) const {
    return v + kv_offset(v_stride, b, pos, h);
  }
  // Query row m (tree node m / group_size, head h * group_size + m % group_size) in q.
  const scalar_t* q_row(int64_t b, int64_t h, int64_t m) const {
    return q + b * q_stride[0] + (m / group_size) * q_stride[1] +
           (h * group_size + m % group_size) * q_stride[2];
  }
  // Offset of query row m in the (contiguous) output.
  int64_t out_offset(int64_t b, int64_t h, int64_t m) const {
    return ((b * T + m / group_size) * Hq + h * group_size + m % group_size) * D;
  }
  // [p0, p1): the key positions of segment s of request b (tile aligned, possibly empty).
  std::pair<int64_t, int64_t> segment_range(int64_t b, int64_t s) const {
    const int64_t len = length(b);
    const int64_t p0 = std::min(s * kSegment, len);
    return {p0, std::min(p0 + kSegment, len)};
  }
};

// The query rows [m0, m1) of request b that share KV head h: one task's rows (a row block,
// see tree_verify_typed). Kernels index their workspace by row - m0.
struct Rows {
  int64_t b, h, m0, m1;
  int64_t count() const { return m1 - m0; }
};

// Thread-local scratch of a thread's tasks, 64-byte aligned, zero-initialised. The
// row-indexed buffers have a stride of Mp (set_rows: a call's rows per task, padded; at most
// kRowBlock), so a small tree's rows stay contiguous; the staged tiles come after the row
// buffers' largest extent, at the same place whatever the row stride (their padding columns
// are never written, so they stay zero from call to call). Head-dim-indexed buffers have a stride
// of Dp. The bf16 buffers serve the AVX512-BF16 build.
struct Workspace {
  std::unique_ptr<uint8_t[]> mem;
  uint8_t* rows_base;  // where the row-indexed buffers start
  float *qt, *ot, *s, *kt, *vt, *mx, *l, *alpha;
  uint32_t *qp, *kp, *vp, *pp;  // bf16 pairs (low half first)
  int64_t Dp;
  template <typename T>
  static T* take(uint8_t*& cursor, int64_t n) {
    T* p = reinterpret_cast<T*>(cursor);
    cursor += (n * int64_t(sizeof(T)) + 63) / 64 * 64;
    return p;
  }
  explicit Workspace(int64_t Dp) : Dp(Dp) {
    const int64_t Mp = kRowBlock;
    const int64_t row_bytes =
        4 * (2 * Dp * Mp + kTile * Mp + 3 * Mp + Dp / 2 * Mp + kTile / 2 * Mp);
    const int64_t bytes = row_bytes + 4 * (2 * kTile * Dp + kMaxLanes * kTile) +
                          4 * (kTile * Dp / 2 + kTile / 2 * Dp) + 13 * 64 + 64;
    mem.reset(new uint8_t[bytes]());
    rows_base = mem.get() + (64 - reinterpret_cast<uintptr_t>(mem.get()) % 64) % 64;
    uint8_t* cursor = rows_base + (row_bytes + 8 * 64 + 63) / 64 * 64;
    kt = take<float>(cursor, kTile * (Dp + kMaxLanes));  // [kTile, Dp] ([Dw, kTile]: attend_few)
    vt = take<float>(cursor, kTile * Dp);                // [kTile, Dp] V tile
    kp = take<uint32_t>(cursor, kTile * Dp / 2);         // [kTile, Dp / 2] (k[n, 2i], k[n, 2i + 1])
    vp = take<uint32_t>(cursor, kTile / 2 * Dp);         // [kTile / 2, Dp] (v[2j, d], v[2j + 1, d])
    set_rows(Mp);
  }
  void set_rows(int64_t Mp) {  // Mp <= kRowBlock
    uint8_t* cursor = rows_base;
    qt = take<float>(cursor, Dp * Mp);            // [Dp, Mp] queries, transposed
    ot = take<float>(cursor, Dp * Mp);            // [Dp, Mp] unnormalised output, transposed
    s = take<float>(cursor, kTile * Mp);          // [kTile, Mp] scores, then probabilities
    mx = take<float>(cursor, Mp);                 // [Mp] running max (base 2)
    l = take<float>(cursor, Mp);                  // [Mp] running sum
    alpha = take<float>(cursor, Mp);              // [Mp] rescale of o for the current tile
    qp = take<uint32_t>(cursor, Dp / 2 * Mp);     // [Dp / 2, Mp] (q[m, 2i], q[m, 2i + 1])
    pp = take<uint32_t>(cursor, kTile / 2 * Mp);  // [kTile / 2, Mp] (p[2j, m], p[2j + 1, m])
  }
};

// s[n, 0:2W] = scale * sum_d kt[n, d] * qt[d, 0:2W] for the kCols keys n of one block.
template <int LANES>
SPECDEC_INLINE void score_block(const float* qt, const float* kt, int64_t D, int64_t Dp, int64_t Mp,
                                float scale, float* s) {
  using vfloat = typename Simd<LANES>::f;
  constexpr int C = kCols<LANES>;
  vfloat acc[C][2] = {};
  for (int64_t d = 0; d < D; ++d) {
    const vfloat q0 = load<LANES>(qt + d * Mp), q1 = load<LANES>(qt + d * Mp + LANES);
    for (int c = 0; c < C; ++c) {  // a scalar operand: broadcast by the FMA itself
      acc[c][0] = q0 * kt[c * Dp + d] + acc[c][0];
      acc[c][1] = q1 * kt[c * Dp + d] + acc[c][1];
    }
  }
  for (int c = 0; c < C; ++c) {
    store(s + c * Mp, acc[c][0] * scale);
    store(s + c * Mp + LANES, acc[c][1] * scale);
  }
}

// ot[d, 0:2W] = alpha[0:2W] * ot[d, 0:2W] + sum_n vt[n, d] * p[n, 0:2W] for kCols head dims d.
template <int LANES>
SPECDEC_INLINE void update_block(const float* p, const float* vt, int64_t nt, int64_t Dp,
                                 int64_t Mp, const float* alpha, float* ot) {
  using vfloat = typename Simd<LANES>::f;
  constexpr int C = kCols<LANES>;
  const vfloat a0 = load<LANES>(alpha), a1 = load<LANES>(alpha + LANES);
  vfloat acc[C][2];
  for (int c = 0; c < C; ++c) {
    acc[c][0] = load<LANES>(ot + c * Mp) * a0;
    acc[c][1] = load<LANES>(ot + c * Mp + LANES) * a1;
  }
  for (int64_t n = 0; n < nt; ++n) {
    const vfloat p0 = load<LANES>(p + n * Mp), p1 = load<LANES>(p + n * Mp + LANES);
    for (int c = 0; c < C; ++c) {
      acc[c][0] = p0 * vt[n * Dp + c] + acc[c][0];
      acc[c][1] = p1 * vt[n * Dp + c] + acc[c][1];
    }
  }
  for (int c = 0; c < C; ++c) {
    store(ot + c * Mp, acc[c][0]);
    store(ot + c * Mp + LANES, acc[c][1]);
  }
}

// Stages positions [p, p + nt) of (b, h) of the cache `src` (k or v, with its strides) into
// dst [kTile, Dp] as float.
template <typename scalar_t>
SPECDEC_INLINE void stage_rows(const Problem<scalar_t>& P, const scalar_t* src,
                               const int64_t* stride, float* dst, int64_t b, int64_t h, int64_t p,
                               int64_t nt) {
  for (int64_t j = 0; j < nt; ++j) {
    const scalar_t* row = src + P.kv_offset(stride, b, p + j, h);
    for (int64_t d = 0; d < P.D; ++d) dst[j * P.Dp + d] = static_cast<float>(row[d]);
  }
}

// Asks for the K and V rows of positions [p, p + nt) of (b, h) to be brought into the L2
// cache while the previous tile computes: rows of consecutive positions are a row stride
// apart (Hkv * D elements or more), which the hardware prefetchers do not follow. Into the
// L2, not the L1: a prefetch into the L1 holds one of its few fill buffers until the line
// arrives, and a tile's hundreds of them stalled the loads of the tile being computed
// (32 float32 decodes over vLLM's layout, 2 threads: 1.12-1.18x CPU_ATTN's time with L1
// prefetches, 1.05-1.07x with L2 ones; docs/benchmarks.md "Trees inside vLLM").
template <typename scalar_t>
SPECDEC_INLINE void prefetch_rows(const scalar_t* const* k_rows, const scalar_t* const* v_rows,
                                  int64_t nt, int64_t D) {
  const int64_t bytes = D * int64_t(sizeof(scalar_t));
  for (int64_t j = 0; j < nt; ++j) {
    const char* k = reinterpret_cast<const char*>(k_rows[j]);
    const char* v = reinterpret_cast<const char*>(v_rows[j]);
    for (int64_t i = 0; i < bytes; i += 64) {
      __builtin_prefetch(k + i, 0, 2);
      __builtin_prefetch(v + i, 0, 2);
    }
  }
}

template <typename scalar_t>
SPECDEC_INLINE void prefetch_rows(const Problem<scalar_t>& P, int64_t b, int64_t h, int64_t p,
                                  int64_t nt) {
  const scalar_t* k_rows[kTile];
  const scalar_t* v_rows[kTile];
  P.tile_rows(b, h, p, nt, k_rows, v_rows);
  prefetch_rows(k_rows, v_rows, nt, P.D);
}

// The few-rows kernels' K and V row pointers of the key tiles of one (b, h) task, a tile
// ahead: fetch() resolves a tile's rows (tile_rows) and prefetches them, and the tile fetched
// before it becomes current_k() / current_v(): each tile's pointers resolved once, not once
// for the prefetch and again for the compute.
template <typename scalar_t>
struct TileRowPipeline {
  const scalar_t* k[2][kTile];
  const scalar_t* v[2][kTile];
  int newest = 1;  // the slot fetch() filled last; the other one holds the current tile

  SPECDEC_INLINE void fetch(const Problem<scalar_t>& P, int64_t b, int64_t h, int64_t p,
                            int64_t nt) {
    newest ^= 1;
    P.tile_rows(b, h, p, nt, k[newest], v[newest]);
    prefetch_rows(k[newest], v[newest], nt, P.D);
  }
  const scalar_t* const* current_k() const { return k[newest ^ 1]; }
  const scalar_t* const* current_v() const { return v[newest ^ 1]; }
};

// Hides the tree columns of the tile [p, p + nt) a row of r from `first` on may not see (its
// tree_mask bit is clear); s is [kTile, Mp] (row m at column m - r.m0), already scaled.
template <typename scalar_t>
SPECDEC_INLINE void mask_tile(const Problem<scalar_t>& P, float* s, const Rows& r, int64_t p,
                              int64_t nt, int64_t first) {
  const int64_t b = r.b, c = P.cache_lens[b], M = r.m1, m0 = r.m0 + first;
  const int64_t j0 = std::max<int64_t>(0, c - p);  // first tree column of the tile
  if (j0 >= nt) return;
  // The tile's tree columns [j0, nt) are nodes n0 .. n0 + nt - j0 - 1 (at most kTile = 64):
  // one word of visibility bits per node, and only its clear bits are visited (a chain's
  // rows past the tile see all of it).
  static_assert(kTile <= 64);
  const int64_t n0 = p + j0 - c, width = nt - j0;
  const uint64_t all = width == 64 ? ~uint64_t(0) : (uint64_t(1) << width) - 1;
  for (int64_t node = m0 / P.group_size; node * P.group_size < M; ++node) {
    const uint64_t* bits = P.tree_mask + (b * P.T + node) * P.mask_words;
    const int64_t w = n0 / 64, shift = n0 % 64;
    uint64_t seen = bits[w] >> shift;
    if (shift && w + 1 < P.mask_words) seen |= bits[w + 1] << (64 - shift);
    for (uint64_t hidden = ~seen & all; hidden; hidden &= hidden - 1) {
      const int64_t j = j0 + __builtin_ctzll(hidden);
      const int64_t end = std::min((node + 1) * P.group_size, M);
      for (int64_t m = std::max(m0, node * P.group_size); m < end; ++m) {
        s[j * P.Mp + m - r.m0] = kNegInf;
      }
    }
  }
}

// The first query row of request b that may see a key of the tile [p, p + nt): 0 when the
// tile holds prefix positions (visible to every row), else the first row of the first node
// whose tree_mask row has a bit among the tile's tree columns (rows(b) when none has).
template <typename scalar_t>
SPECDEC_INLINE int64_t first_visible_row(const Problem<scalar_t>& P, int64_t b, int64_t p,
                                         int64_t nt) {
  const int64_t c = P.cache_lens[b];
  if (p < c) return 0;
  const int64_t n0 = p - c, n1 = n0 + nt;  // the tile's tree columns [n0, n1)
  for (int64_t node = 0; node < P.num_nodes[b]; ++node) {
    const uint64_t* bits = P.tree_mask + (b * P.T + node) * P.mask_words;
    for (int64_t w = n0 / 64; w <= (n1 - 1) / 64; ++w) {
      const int64_t lo = std::max<int64_t>(n0 - w * 64, 0), hi = std::min<int64_t>(n1 - w * 64, 64);
      const uint64_t span = hi - lo == 64 ? ~uint64_t(0) : ((uint64_t(1) << (hi - lo)) - 1) << lo;
      if (bits[w] & span) return node * P.group_size;
    }
  }
  return P.rows(b);
}

// The first row panel (of `panel` rows, from r's first row) of r's Mr padded rows that may
// see a key of the tile [p, p + nt): the panels before it see none and are skipped, which
// leaves their (o, max, sum) as a tile of invisible keys would (alpha 1, probabilities 0).
template <typename scalar_t>
SPECDEC_INLINE int64_t first_visible_panel(const Problem<scalar_t>& P, const Rows& r, int64_t p,
                                           int64_t nt, int64_t Mr, int64_t panel) {
  const int64_t first = std::clamp<int64_t>(first_visible_row(P, r.b, p, nt) - r.m0, 0, Mr);
  return first / panel * panel;
}

// Online softmax over one tile for rows [0, Mr): turns the scores s[0:nt, :] into
// probabilities relative to the updated running max, and records in alpha how much o must
// be rescaled. A row that has seen no key yet (max -inf) keeps o = 0, l = 0.
// SCALED: the scores are not scaled yet, and are multiplied by `scale` (> 0) as they are read
// (the AMX build's tiles store unscaled sums).
template <int LANES, bool SCALED = false>
SPECDEC_INLINE void softmax_tile(float* s, int64_t Mp, int64_t Mr, int64_t nt, float* mx, float* l,
                                 float* alpha, float scale = 1.f) {
  using vfloat = typename Simd<LANES>::f;
  const auto score = [&](int64_t n, int64_t r) {
    const vfloat x = load<LANES>(s + n * Mp + r);
    if constexpr (SCALED) return x * scale;
    return x;
  };
  for (int64_t r = 0; r < Mr; r += LANES) {
    const vfloat m_old = load<LANES>(mx + r);
    vfloat m_new = m_old;
    for (int64_t n = 0; n < nt; ++n) m_new = vmax(m_new, score(n, r));
    // Subtracting 0 instead of -inf keeps invisible scores at exp2(-inf) = 0, not NaN.
    const vfloat sub = m_new == splat<LANES>(kNegInf) ? vfloat{} : m_new;
    vfloat sum = {};
    for (int64_t n = 0; n < nt; ++n) {
      const vfloat e = exp2_nonpos<LANES>(score(n, r) - sub);
      store(s + n * Mp + r, e);
      sum += e;
    }
    const vfloat a = exp2_nonpos<LANES>(m_old - sub);  // 0 when the running max was -inf
    store(alpha + r, a);
    store(l + r, load<LANES>(l + r) * a + sum);
    store(mx + r, m_new);
  }
}

// Resets o^T and the running max and sum of rows [0, Mr).
SPECDEC_INLINE void reset_rows(Workspace& ws, int64_t Mp, int64_t Dp, int64_t Mr) {
  for (int64_t d = 0; d < Dp; ++d) std::fill_n(ws.ot + d * Mp, Mr, 0.f);
  std::fill(ws.mx, ws.mx + Mr, kNegInf);
  std::fill(ws.l, ws.l + Mr, 0.f);
}

// One stage of an in-register transpose of LANES x LANES floats: rows i and i + S swap their
// off-diagonal blocks of S lanes (all stages, S = LANES / 2 ... 1, transpose the square).
template <int LANES, int S, bool UPPER, size_t... J>
SPECDEC_INLINE typename Simd<LANES>::f swap_blocks(typename Simd<LANES>::f a,
                                                   typename Simd<LANES>::f b,
                                                   std::index_sequence<J...>) {
  if constexpr (UPPER) {
    return __builtin_shufflevector(a, b, ((J & S) ? LANES + J - S : J)...);
  } else {
    return __builtin_shufflevector(a, b, ((J & S) ? LANES + J : J + S)...);
  }
}

template <int LANES, int S = LANES / 2>
SPECDEC_INLINE void transpose_square(typename Simd<LANES>::f* v) {
  if constexpr (S >= 1) {
    for (int i = 0; i < LANES; ++i) {
      if (i & S) continue;
      const auto a = v[i], b = v[i | S];
      v[i] = swap_blocks<LANES, S, true>(a, b, std::make_index_sequence<LANES>());
      v[i | S] = swap_blocks<LANES, S, false>(a, b, std::make_index_sequence<LANES>());
    }
    transpose_square<LANES, S / 2>(v);
  }
}

// Stages the M query rows of r transposed, qt [D, Mp] as float, rows [M, Mr) zero:
// float32 head dims of whole vectors LANES x LANES through registers (a scalar transposed
// store per element touched a cache line each: a fifth of a prefill's attention time).
template <int LANES, typename scalar_t>
SPECDEC_INLINE void stage_queries_transposed(const Problem<scalar_t>& P, float* qt, const Rows& r,
                                             int64_t Mr) {
  using vfloat = typename Simd<LANES>::f;
  const int64_t D = P.D, Mp = P.Mp, M = r.count();
  const auto q_row = [&](int64_t m) { return P.q_row(r.b, r.h, r.m0 + m); };
  if constexpr (std::is_same_v<scalar_t, float>) {
    if (D % LANES == 0) {
      for (int64_t m0 = 0; m0 < Mr; m0 += LANES) {
        const float* src[LANES];
        for (int i = 0; i < LANES; ++i) src[i] = m0 + i < M ? q_row(m0 + i) : nullptr;
        for (int64_t d0 = 0; d0 < D; d0 += LANES) {
          vfloat v[LANES];
          for (int i = 0; i < LANES; ++i) v[i] = src[i] ? load<LANES>(src[i] + d0) : vfloat{};
          transpose_square<LANES>(v);
          for (int i = 0; i < LANES; ++i) store(qt + (d0 + i) * Mp + m0, v[i]);
        }
      }
      return;
    }
  }
  for (int64_t m = 0; m < Mr; ++m) {  // padding rows: zero queries, harmless scores
    const scalar_t* src = m < M ? q_row(m) : nullptr;
    for (int64_t d = 0; d < D; ++d) qt[d * Mp + m] = src ? static_cast<float>(src[d]) : 0.f;
  }
}

// Runs the positions of split s for the rows of r in float; leaves unnormalised o^T, mx and l
// in ws.
template <int LANES, typename scalar_t>
SPECDEC_INLINE void attend(const Problem<scalar_t>& P, Workspace& ws, const Rows& r, int64_t s) {
  constexpr int C = kCols<LANES>;
  const int64_t b = r.b, h = r.h, M = r.count();
  const int64_t Mr = (M + 2 * LANES - 1) / (2 * LANES) * (2 * LANES);
  const int64_t D = P.D, Dp = P.Dp, Mp = P.Mp;
  stage_queries_transposed<LANES>(P, ws.qt, r, Mr);
  reset_rows(ws, Mp, Dp, Mr);
  const auto [p0, p1] = P.segment_range(b, s);
  for (int64_t p = p0; p < p1; p += kTile) {
    const int64_t nt = std::min(kTile, p1 - p), nk = (nt + C - 1) / C * C;
    stage_rows(P, P.k, P.k_stride, ws.kt, b, h, p, nt);  // keys [nt, nk): stale, unused
    stage_rows(P, P.v, P.v_stride, ws.vt, b, h, p, nt);
    prefetch_rows(P, b, h, p + kTile, std::min(kTile, p1 - p - nt));
    // a prefill chunk's early rows see none of its later tiles
    const int64_t r0 = first_visible_panel(P, r, p, nt, Mr, 2 * LANES);
    for (int64_t i = r0; i < Mr; i += 2 * LANES) {
      for (int64_t j = 0; j < nk; j += C) {
        score_block<LANES>(ws.qt + i, ws.kt + j * Dp, D, Dp, Mp, P.scale, ws.s + j * Mp + i);
      }
    }
    mask_tile(P, ws.s, r, p, nt, r0);
    softmax_tile<LANES>(ws.s + r0, Mp, Mr - r0, nt, ws.mx + r0, ws.l + r0, ws.alpha + r0);
    for (int64_t i = r0; i < Mr; i += 2 * LANES) {
      for (int64_t d = 0; d < Dp; d += C) {
        update_block<LANES>(ws.s + i, ws.vt + d, nt, Dp, Mp, ws.alpha + i, ws.ot + d * Mp + i);
      }
    }
  }
}

// ---------------------------------------------------------------- few query rows
// A plain decode step asks only group_size rows per KV head (T = 1: typically 1-8), which
// fill 1-8 of the 2 * LANES lanes of the row-panel kernels above. For at most kFewRows rows
// the lanes run over keys instead (scores: the K tile staged transposed) and over head dims
// (output: each V row added to every row's output with its probability broadcast, up to 3
// rows' outputs held in registers while the tile's V rows stream by; float32 K / V rows are
// read in place, not copied). Each
// score, probability, sum and output element is computed as the panel kernels compute it
// (the same operations in the same order, lane for lane), so a row gets the same bits
// whichever kernel its row count picks: a node's attention in a tree verify is bitwise the
// plain step's (tests/ops/test_tree_verify.py::test_node_output_is_the_plain_steps). The
// (o^T, max, sum) left in ws feed the same segment fold and write_rows. bfloat16 on an
// AVX512-BF16 CPU takes the vdpbf16ps kernels instead (below; the panels there too): faster,
// but their sums of bf16 pairs round by row count and key position, so there a tree node's
// bf16 attention is not bitwise the plain step's (float32 and float16 are). The price of the
// panels' arithmetic (Zen 3, bf16, 9 query / 3 KV heads, 2 threads, against the
// earlier few-rows kernel's lanes over head dims with a horizontal sum per score): at batch 1
// the same or faster (0.75-1.05x), at batch 8 with 3 rows per KV head up to 1.5x (the
// transposition of the K tile is amortised over 3 rows only; compute-bound there).
constexpr int64_t kFewRows = 8;
constexpr int64_t kFewMaxD = 256;  // larger head dims take the panel kernels

// Calls block(std::integral_constant<int, MB>{}, m) for each block [m, m + MB) of the rows
// [0, M), m stepping by MAX_MB and MB = min(M - m, MAX_MB) a compile-time constant: the
// few-rows loops hold MB rows' accumulators in registers. block must be always-inline (a
// lambda marked SPECDEC_INLINE_LAMBDA): GCC gives a lambda no target attribute, so only
// inlined into the enclosing kernel do the SIMD helpers inside it get the kernel's ISA.
template <int MB, typename Block>
SPECDEC_INLINE void call_row_block(int64_t rows, int64_t m, const Block& block) {
  if constexpr (MB > 1) {
    if (rows < MB) return call_row_block<MB - 1>(rows, m, block);
  }
  block(std::integral_constant<int, MB>{}, m);
}

template <int MAX_MB, typename Block>
SPECDEC_INLINE void for_row_blocks(int64_t M, const Block& block) {
  for (int64_t m = 0; m < M; m += MAX_MB) {
    call_row_block<MAX_MB>(std::min<int64_t>(M - m, MAX_MB), m, block);
  }
}

// Sums of the G rows of sc (kTile apart) over keys [0, nt), each in key order from 0 (the
// panels' order: softmax_tile), the rows' chains interleaved so that their adds overlap.
template <int G>
SPECDEC_INLINE void few_rows_sums(const float* sc, int64_t nt, float* sums) {
  float acc[G] = {};
  for (int64_t j = 0; j < nt; ++j) {
    for (int g = 0; g < G; ++g) acc[g] += sc[g * kTile + j];
  }
  for (int g = 0; g < G; ++g) sums[g] = acc[g];
}

// The tree mask and the online softmax of one key tile for the M (<= kFewRows) rows of the
// few-rows kernels: sc [M, kTile] scores (base 2, scaled) -> probabilities relative to the
// updated running max mx; l updated; alpha[m]: how much row m's output must be rescaled.
// The sum of a row's probabilities is a chain of adds in key order, as the panels' (lanes
// over rows) is; the maximum takes any order (it is exact).
template <int LANES, typename scalar_t>
SPECDEC_INLINE void few_rows_softmax(const Problem<scalar_t>& P, float* sc, int64_t M, int64_t b,
                                     int64_t p, int64_t nt, float* mx, float* l, float* alpha) {
  using vfloat = typename Simd<LANES>::f;
  const int64_t c = P.cache_lens[b];
  float sub[kFewRows];
  for (int64_t m = 0; m < M; ++m) {
    float* sm = sc + m * kTile;
    const uint64_t* bits = P.tree_mask + (b * P.T + m / P.group_size) * P.mask_words;
    for (int64_t j = std::max<int64_t>(0, c - p); j < nt; ++j) {  // tree columns
      const int64_t node = p + j - c;
      if (!((bits[node / 64] >> (node % 64)) & 1)) sm[j] = kNegInf;
    }
    vfloat vm = splat<LANES>(mx[m]);
    int64_t j = 0;
    for (; j + LANES <= nt; j += LANES) vm = vmax(vm, load<LANES>(sm + j));
    float m_new = vm[0];
    for (int i = 1; i < LANES; ++i) m_new = std::max(m_new, vm[i]);
    for (; j < nt; ++j) m_new = std::max(m_new, sm[j]);
    // Subtracting 0 instead of -inf keeps invisible scores at exp2(-inf) = 0, not NaN.
    sub[m] = m_new == kNegInf ? 0.f : m_new;
    for (j = 0; j < nt; j += LANES) {  // sc rows are kTile long: whole vectors
      store(sm + j, exp2_nonpos<LANES>(load<LANES>(sm + j) - sub[m]));
    }
    alpha[m] = exp2_nonpos<LANES>(splat<LANES>(mx[m] - sub[m]))[0];
    mx[m] = m_new;
  }
  float sum[kFewRows];
  for_row_blocks<4>(M, [&](auto rows, int64_t m) SPECDEC_INLINE_LAMBDA {
    few_rows_sums<decltype(rows)::value>(sc + m * kTile, nt, sum + m);
  });
  for (int64_t m = 0; m < M; ++m) l[m] = l[m] * alpha[m] + sum[m];
}

// Stages the K rows of positions [p, p + nt) of (b, h) transposed, kt [Dw, kTile] as float
// (head dims past D and keys past nt zero): LANES rows converted to float front to back (the
// conversion vectorises), then transposed LANES x LANES in registers.
template <int LANES, typename scalar_t>
SPECDEC_INLINE void stage_keys_transposed(const Problem<scalar_t>& P, float* kt,
                                          const scalar_t* const* k_rows, int64_t nt, int64_t Dw) {
  using vfloat = typename Simd<LANES>::f;
  if constexpr (std::is_same_v<scalar_t, float>) {
    if (P.D == Dw) {  // float rows of whole vectors: transposed straight from the cache
      for (int64_t j0 = 0; j0 < nt; j0 += LANES) {
        const float* src[LANES];
        for (int i = 0; i < LANES; ++i) src[i] = j0 + i < nt ? k_rows[j0 + i] : nullptr;
        for (int64_t d0 = 0; d0 < Dw; d0 += LANES) {
          vfloat v[LANES];
          for (int i = 0; i < LANES; ++i) v[i] = src[i] ? load<LANES>(src[i] + d0) : vfloat{};
          transpose_square<LANES>(v);
          for (int i = 0; i < LANES; ++i) store(kt + (d0 + i) * kTile + j0, v[i]);
        }
      }
      return;
    }
  }
  alignas(64) float rows[LANES * (kFewMaxD + kMaxLanes)];  // [LANES, Dw]
  for (int64_t j0 = 0; j0 < nt; j0 += LANES) {
    for (int i = 0; i < LANES; ++i) {
      float* dst = rows + i * Dw;
      int64_t d = 0;
      if (j0 + i < nt) {
        const scalar_t* src = k_rows[j0 + i];
        for (; d < P.D; ++d) dst[d] = static_cast<float>(src[d]);
      }
      for (; d < Dw; ++d) dst[d] = 0.f;
    }
    for (int64_t d0 = 0; d0 < Dw; d0 += LANES) {
      vfloat v[LANES];
      for (int i = 0; i < LANES; ++i) v[i] = load<LANES>(rows + i * Dw + d0);
      transpose_square<LANES>(v);
      for (int i = 0; i < LANES; ++i) store(kt + (d0 + i) * kTile + j0, v[i]);
    }
  }
}

// The few-rows kernels' V rows of positions [p, p + nt) of (b, h) as float: float32 rows in
// place (no copy), other dtypes converted into buf [kTile, D].
template <int LANES, typename scalar_t>
SPECDEC_INLINE void stage_values(const Problem<scalar_t>& P, const float** rows, float* buf,
                                 const scalar_t* const* v_rows, int64_t nt) {
  for (int64_t j = 0; j < nt; ++j) {
    const scalar_t* src = v_rows[j];
    if constexpr (std::is_same_v<scalar_t, float>) {
      rows[j] = src;
    } else {
      float* dst = buf + j * P.D;
      for (int64_t d = 0; d < P.D; ++d) dst[d] = static_cast<float>(src[d]);
      rows[j] = dst;
    }
  }
}

// Rows per call of few_rows_update: MB rows x kFewVecs vectors of outputs, the V vector and
// the MB probabilities fit the 16 ymm registers of AVX2.
constexpr int64_t kFewRowBlock = 3;
template <int LANES>
constexpr int kFewVecs = LANES == 16 ? 8 : 4;

// o[m, :] += sum_j p[m, j] * v_j[:] for MB rows m (p rows kTile apart, o rows D apart) over
// the nt keys, D a multiple of LANES: per output element the same FMAs in the same order as
// the row-at-a-time loop (and the panels' update_block), kFewVecs vectors of every row held
// in registers while the keys stream by.
template <int LANES, int MB>
SPECDEC_INLINE void few_rows_update(const float* const* vrows, const float* p, int64_t nt,
                                    int64_t D, float* o) {
  using vfloat = typename Simd<LANES>::f;
  constexpr int V = kFewVecs<LANES>;
  for (int64_t d0 = 0; d0 < D; d0 += V * LANES) {
    const int nv = int(std::min<int64_t>(V, (D - d0) / LANES));
    vfloat acc[MB][V];
    for (int m = 0; m < MB; ++m) {
      for (int v = 0; v < V; ++v)
        acc[m][v] = v < nv ? load<LANES>(o + m * D + d0 + v * LANES) : vfloat{};
    }
    for (int64_t j = 0; j < nt; ++j) {
      const float* vr = vrows[j] + d0;
      for (int v = 0; v < V; ++v) {
        if (v >= nv) break;
        const vfloat x = load<LANES>(vr + v * LANES);
        for (int m = 0; m < MB; ++m) acc[m][v] = x * p[m * kTile + j] + acc[m][v];
      }
    }
    for (int m = 0; m < MB; ++m) {
      for (int v = 0; v < nv; ++v) store(o + m * D + d0 + v * LANES, acc[m][v]);
    }
  }
}

// sc[m, 0:kTile] = scale * sum_d q[m, d] * kt[d, 0:kTile] for MB rows m (q rows Dw apart,
// sc rows kTile apart): lanes over keys, each score a chain of FMAs over d in order, then
// scaled -- the panel kernels' arithmetic (score_block), so a row gets the same bits from
// either kernel. The MB rows' chains run together (each K vector loaded once for them), so
// that the FMAs' latency overlaps. A last, partial tile is scored whole (columns past nt:
// stale keys, never read back): fewer instructions than a loop over its key vectors alone
// (callgrind, contexts 70-1000).
template <int LANES, int MB>
SPECDEC_INLINE void few_rows_scores(const float* q, int64_t Dw, const float* kt, int64_t D,
                                    float scale, float* sc) {
  using vfloat = typename Simd<LANES>::f;
  constexpr int kKeyVecs = kTile / LANES;
  vfloat acc[MB][kKeyVecs] = {};
  for (int64_t d = 0; d < D; ++d) {
    for (int v = 0; v < kKeyVecs; ++v) {
      const vfloat k = load<LANES>(kt + d * kTile + v * LANES);
      // a scalar operand: broadcast by the FMA itself
      for (int m = 0; m < MB; ++m) acc[m][v] = q[m * Dw + d] * k + acc[m][v];
    }
  }
  for (int m = 0; m < MB; ++m) {
    for (int v = 0; v < kKeyVecs; ++v) store(sc + m * kTile + v * LANES, acc[m][v] * scale);
  }
}

// Rows per call of few_rows_scores: MB x kTile / LANES accumulators in the 32 zmm registers
// (AVX-512: 3 x 4); the AVX2 and SSE2 builds' 8 and 16 per row fill theirs already.
template <int LANES>
constexpr int64_t kFewScoreRows = LANES == 16 ? 3 : 1;

template <int LANES, typename scalar_t>
SPECDEC_INLINE void attend_few(const Problem<scalar_t>& P, Workspace& ws, const Rows& r,
                               int64_t s) {
  using vfloat = typename Simd<LANES>::f;
  // a request's rows whole (r.m0 = 0: tree_verify_typed), so row m is the mask's row m
  const int64_t b = r.b, h = r.h, M = r.count(), D = P.D, Mp = P.Mp;
  const int64_t Dw = (D + LANES - 1) / LANES * LANES;
  alignas(64) float q[kFewRows * (kFewMaxD + kMaxLanes)];  // [M, Dw], zero padded
  alignas(64) float o[kFewRows * (kFewMaxD + kMaxLanes)];  // [M, Dw] unnormalised output
  alignas(64) float row[kFewMaxD + kMaxLanes];             // one V row in float, zero padded
  alignas(64) float sc[kFewRows * kTile] = {};             // [M, kTile] scores, then probabilities
  float* kt = ws.kt;                                       // [Dw, kTile]: the K tile, transposed
  float mx[kFewRows], l[kFewRows];
  TileRowPipeline<scalar_t> tiles;
  for (int64_t m = 0; m < M; ++m) {
    const scalar_t* src = P.q_row(b, h, m);
    for (int64_t d = 0; d < Dw; ++d) {
      q[m * Dw + d] = d < D ? static_cast<float>(src[d]) : 0.f;
      o[m * Dw + d] = 0.f;
    }
    mx[m] = kNegInf;
    l[m] = 0.f;
  }
  for (int64_t d = D; d < Dw; ++d) row[d] = 0.f;
  const auto [p0, p1] = P.segment_range(b, s);
  tiles.fetch(P, b, h, p0, std::min(kTile, p1 - p0));  // the first tile too: attend_few_bf16
  for (int64_t p = p0; p < p1; p += kTile) {
    const int64_t nt = std::min(kTile, p1 - p);
    tiles.fetch(P, b, h, p + kTile, std::min(kTile, p1 - p - nt));
    const scalar_t* const* k_rows = tiles.current_k();
    const scalar_t* const* v_rows = tiles.current_v();
    stage_keys_transposed<LANES>(P, kt, k_rows, nt, Dw);
    for_row_blocks<kFewScoreRows<LANES>>(M, [&](auto rows, int64_t m) SPECDEC_INLINE_LAMBDA {
      few_rows_scores<LANES, decltype(rows)::value>(q + m * Dw, Dw, kt, D, P.scale, sc + m * kTile);
    });
    float alpha[kFewRows];
    few_rows_softmax<LANES>(P, sc, M, b, p, nt, mx, l, alpha);
    for (int64_t m = 0; m < M; ++m) {
      for (int64_t d = 0; d < Dw; d += LANES) {
        store(o + m * Dw + d, load<LANES>(o + m * Dw + d) * alpha[m]);
      }
    }
    if (D == Dw) {  // whole vectors: the outputs stay in registers over the tile's keys
      const float* vrows[kTile];
      stage_values<LANES>(P, vrows, ws.vt, v_rows, nt);
      for_row_blocks<kFewRowBlock>(M, [&](auto rows, int64_t m) SPECDEC_INLINE_LAMBDA {
        few_rows_update<LANES, decltype(rows)::value>(vrows, sc + m * kTile, nt, D, o + m * Dw);
      });
      continue;
    }
    for (int64_t j = 0; j < nt; ++j) {
      const scalar_t* vr = v_rows[j];
      for (int64_t d = 0; d < D; ++d) row[d] = static_cast<float>(vr[d]);
      for (int64_t m = 0; m < M; ++m) {
        const float pj = sc[m * kTile + j];
        for (int64_t d = 0; d < Dw; d += LANES) {
          store(o + m * Dw + d, load<LANES>(o + m * Dw + d) + load<LANES>(row + d) * pj);
        }
      }
    }
  }
  for (int64_t m = 0; m < M; ++m) {  // the panel kernels' layout: o^T [Dp, Mp]
    for (int64_t d = 0; d < D; ++d) ws.ot[d * Mp + m] = o[m * Dw + d];
    ws.mx[m] = mx[m];
    ws.l[m] = l[m];
  }
}

// ---------------------------------------------------------------- AVX512-BF16 build
// vdpbf16ps multiplies 16 pairs of bf16 and adds both products to 16 float lanes: with
// lanes over rows, the pairs run over head dims in S = Q K^T (q pairs staged once per
// task, K pairs read in place) and over key positions in O += P V (P rounded to bf16, V
// pairs interleaved when staged).
#define SPECDEC_BF16_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16")))

SPECDEC_BF16_TARGET SPECDEC_INLINE __m512 dot_pairs(__m512 acc, __m512i a, __m512i b) {
  return _mm512_dpbf16_ps(acc, (__m512bh)a, (__m512bh)b);
}

// s[n, 0:16V] = scale * sum_i kp[n, i] . qp[i, 0:16V] for the 8 keys n of one block
// (kp: bf16 pairs of a K tile row, row stride Dp / 2 pairs; Dh pairs per row); V = 2 row
// vectors (32 rows) or 1 (a last panel of 16).
template <int V>
SPECDEC_BF16_TARGET SPECDEC_INLINE void score_block_bf16(const uint32_t* qp, const uint32_t* kp,
                                                         int64_t Dh, int64_t Dp, int64_t Mp,
                                                         float scale, float* s) {
  __m512 acc[8][V];
  for (int c = 0; c < 8; ++c) {
    for (int u = 0; u < V; ++u) acc[c][u] = _mm512_setzero_ps();
  }
  for (int64_t i = 0; i < Dh; ++i) {
    __m512i q[V];
    for (int u = 0; u < V; ++u) q[u] = _mm512_loadu_si512(qp + i * Mp + 16 * u);
    for (int c = 0; c < 8; ++c) {
      const __m512i kv = _mm512_set1_epi32(kp[c * Dp / 2 + i]);
      for (int u = 0; u < V; ++u) acc[c][u] = dot_pairs(acc[c][u], kv, q[u]);
    }
  }
  const __m512 sc = _mm512_set1_ps(scale);
  for (int c = 0; c < 8; ++c) {
    for (int u = 0; u < V; ++u) _mm512_storeu_ps(s + c * Mp + 16 * u, _mm512_mul_ps(acc[c][u], sc));
  }
}

// ot[d, 0:16V] = alpha * ot[d, 0:16V] + sum_j vp[j, d] . pp[j, 0:16V] for 8 head dims d
// (over nj position pairs j).
template <int V>
SPECDEC_BF16_TARGET SPECDEC_INLINE void update_block_bf16(const uint32_t* pp, const uint32_t* vp,
                                                          int64_t nj, int64_t Dp, int64_t Mp,
                                                          const float* alpha, float* ot) {
  __m512 acc[8][V];
  for (int c = 0; c < 8; ++c) {
    for (int u = 0; u < V; ++u) {
      acc[c][u] =
          _mm512_mul_ps(_mm512_loadu_ps(ot + c * Mp + 16 * u), _mm512_loadu_ps(alpha + 16 * u));
    }
  }
  for (int64_t j = 0; j < nj; ++j) {
    __m512i p[V];
    for (int u = 0; u < V; ++u) p[u] = _mm512_loadu_si512(pp + j * Mp + 16 * u);
    for (int c = 0; c < 8; ++c) {
      const __m512i vv = _mm512_set1_epi32(vp[j * Dp + c]);
      for (int u = 0; u < V; ++u) acc[c][u] = dot_pairs(acc[c][u], vv, p[u]);
    }
  }
  for (int c = 0; c < 8; ++c) {
    for (int u = 0; u < V; ++u) _mm512_storeu_ps(ot + c * Mp + 16 * u, acc[c][u]);
  }
}

SPECDEC_INLINE uint16_t bits(c10::BFloat16 x) { return x.x; }

// pp[j, m] = (bf16(s[2j, m]), bf16(s[2j + 1, m])) for rows [0, Mr) and pairs [0, nj);
// the odd position past the end of a tile of odd length nt gets probability 0.
SPECDEC_BF16_TARGET SPECDEC_INLINE void pair_probs(const float* s, int64_t nt, int64_t Mp,
                                                   int64_t Mr, uint32_t* pp) {
  // Interleaves the 16 lows (elements 0..15) with the 16 highs (16..31).
  alignas(64) static const uint16_t kZip[32] = {0,  16, 1,  17, 2,  18, 3,  19, 4,  20, 5,
                                                21, 6,  22, 7,  23, 8,  24, 9,  25, 10, 26,
                                                11, 27, 12, 28, 13, 29, 14, 30, 15, 31};
  const __m512i zip = _mm512_load_si512(kZip);
  for (int64_t j = 0; 2 * j < nt; ++j) {
    for (int64_t r = 0; r < Mr; r += 16) {
      const __m512 lo = _mm512_loadu_ps(s + 2 * j * Mp + r);
      const __m512 hi =
          2 * j + 1 < nt ? _mm512_loadu_ps(s + (2 * j + 1) * Mp + r) : _mm512_setzero_ps();
      const __m512i halves = (__m512i)_mm512_cvtne2ps_pbh(hi, lo);  // lo in 0..15, hi in 16..31
      _mm512_storeu_si512(pp + j * Mp + r, _mm512_permutexvar_epi16(zip, halves));
    }
  }
}

// Stages the query rows of r as bf16 pairs, qp [Dp / 2, Mp]: qp[i, m] = (q[m, 2i], q[m, 2i + 1]);
// rows [M, Mr) and the odd head dim's partner zero.
SPECDEC_INLINE void stage_query_pairs(const Problem<c10::BFloat16>& P, uint32_t* qp, const Rows& r,
                                      int64_t Mr) {
  const int64_t M = r.count(), D = P.D, Dh = (D + 1) / 2, Mp = P.Mp;
  for (int64_t m = 0; m < Mr; ++m) {
    const c10::BFloat16* src = m < M ? P.q_row(r.b, r.h, r.m0 + m) : nullptr;
    for (int64_t i = 0; i < Dh; ++i) {
      const uint32_t lo = src ? bits(src[2 * i]) : 0;
      const uint32_t hi = src && 2 * i + 1 < D ? bits(src[2 * i + 1]) : 0;
      qp[i * Mp + m] = lo | hi << 16;
    }
  }
}

// attend() for bfloat16 with vdpbf16ps.
// Rows run in panels of 32 (two vectors), the last one 16 wide when that holds the rest: a
// small tree's 9-16 rows per KV head no longer pay for 32.
SPECDEC_BF16_TARGET void attend_avx512bf16(const Problem<c10::BFloat16>& P, Workspace& ws,
                                           const Rows& r, int64_t s) {
  const int64_t b = r.b, h = r.h, M = r.count(), Mr = (M + 15) / 16 * 16;
  const int64_t D = P.D, Dp = P.Dp, Dh = (D + 1) / 2, Mp = P.Mp;
  stage_query_pairs(P, ws.qp, r, Mr);
  reset_rows(ws, Mp, Dp, Mr);
  const auto [p0, p1] = P.segment_range(b, s);
  for (int64_t p = p0; p < p1; p += kTile) {
    const int64_t nt = std::min(kTile, p1 - p), nk = (nt + 7) / 8 * 8, nj = (nt + 1) / 2;
    for (int64_t j = 0; j < nt; ++j) {  // keys [nt, nk): stale, their scores unused
      std::memcpy(ws.kp + j * Dp / 2, P.k_row(b, p + j, h), D * sizeof(uint16_t));
    }
    for (int64_t j = 0; j < nj; ++j) {  // an odd tile's last pair gets a zero (finite) V row
      const c10::BFloat16* lo = P.v_row(b, p + 2 * j, h);
      const c10::BFloat16* hi = 2 * j + 1 < nt ? P.v_row(b, p + 2 * j + 1, h) : nullptr;
      for (int64_t d = 0; d < D; ++d) {
        ws.vp[j * Dp + d] = uint32_t(bits(lo[d])) | uint32_t(hi ? bits(hi[d]) : 0) << 16;
      }
    }
    prefetch_rows(P, b, h, p + kTile, std::min(kTile, p1 - p - nt));
    const int64_t r0 = first_visible_panel(P, r, p, nt, Mr, 32);
    for (int64_t i = r0; i < Mr; i += 32) {
      for (int64_t j = 0; j < nk; j += 8) {
        const uint32_t* kp = ws.kp + j * Dp / 2;
        if (Mr - i >= 32) {
          score_block_bf16<2>(ws.qp + i, kp, Dh, Dp, Mp, P.scale, ws.s + j * Mp + i);
        } else {
          score_block_bf16<1>(ws.qp + i, kp, Dh, Dp, Mp, P.scale, ws.s + j * Mp + i);
        }
      }
    }
    mask_tile(P, ws.s, r, p, nt, r0);
    softmax_tile<16>(ws.s + r0, Mp, Mr - r0, nt, ws.mx + r0, ws.l + r0, ws.alpha + r0);
    pair_probs(ws.s + r0, nt, Mp, Mr - r0, ws.pp + r0);
    for (int64_t i = r0; i < Mr; i += 32) {
      for (int64_t d = 0; d < Dp; d += 8) {
        if (Mr - i >= 32) {
          update_block_bf16<2>(ws.pp + i, ws.vp + d, nj, Dp, Mp, ws.alpha + i, ws.ot + d * Mp + i);
        } else {
          update_block_bf16<1>(ws.pp + i, ws.vp + d, nj, Dp, Mp, ws.alpha + i, ws.ot + d * Mp + i);
        }
      }
    }
  }
}

// r[j] = the sum of a[j]'s lanes for j < 16, as one vector: a transposing tree that adds the
// 256-bit halves of a[j] and a[j + 8], then the 128-bit blocks, then in-block pairs (31
// shuffles, where 16 horizontal sums take 64 and leave 16 scalars to store).
SPECDEC_BF16_TARGET SPECDEC_INLINE __m512 lane_sums16(const __m512* a) {
  __m512 b[8], c[4], d[2];
  for (int j = 0; j < 8; ++j) {  // blocks: key j, j, j + 8, j + 8
    b[j] = _mm512_add_ps(_mm512_shuffle_f32x4(a[j], a[j + 8], 0x44),
                         _mm512_shuffle_f32x4(a[j], a[j + 8], 0xEE));
  }
  for (int j = 0; j < 4; ++j) {  // blocks: key j, j + 8, j + 4, j + 12
    c[j] = _mm512_add_ps(_mm512_shuffle_f32x4(b[j], b[j + 4], 0x88),
                         _mm512_shuffle_f32x4(b[j], b[j + 4], 0xDD));
  }
  for (int j = 0; j < 2; ++j) {  // block k: 2 lanes of c[j]'s key, 2 of c[j + 2]'s
    d[j] = _mm512_add_ps(_mm512_shuffle_ps(c[j], c[j + 2], 0x44),
                         _mm512_shuffle_ps(c[j], c[j + 2], 0xEE));
  }
  // block k of e: the keys o + 0, o + 2, o + 1, o + 3 (o = 0, 8, 4, 12 for k = 0 .. 3)
  const __m512 e =
      _mm512_add_ps(_mm512_shuffle_ps(d[0], d[1], 0x88), _mm512_shuffle_ps(d[0], d[1], 0xDD));
  const __m512i order = _mm512_setr_epi32(0, 2, 1, 3, 8, 10, 9, 11, 4, 6, 5, 7, 12, 14, 13, 15);
  return _mm512_permutexvar_ps(order, e);
}

// The few-rows kernel's AVX512-BF16 build, for head dims a multiple of 32 (the cache's bf16
// rows are read in place, no conversion): a score is vdpbf16ps of the K row's pairs with the
// query row's (float sums of exact products), 16 keys' sums reduced together (lane_sums16)
// and scaled; a V row's 32 head dims are widened to float as two vectors, the even head dims
// (shifted up) and the odd ones (masked), and added to the ROWS rows' outputs, kept in
// registers across the tile, in that even / odd order (put back in place at the end). Same
// softmax and hand-off as attend_few.
template <int ROWS>
SPECDEC_BF16_TARGET void attend_few_bf16_rows(const Problem<c10::BFloat16>& P, Workspace& ws,
                                              const Rows& r, int64_t s) {
  const int64_t b = r.b, h = r.h, D = P.D, Mp = P.Mp, chunks = D / 32;
  __m512i q[ROWS][kFewMaxD / 32];               // the query rows' bf16 pairs
  alignas(64) float o[ROWS * kFewMaxD];         // [ROWS, D] unnormalised output, even / odd
  alignas(64) float sc[kFewRows * kTile] = {};  // [ROWS, kTile] scores, then probabilities
  alignas(64) static const uint16_t zero_row[kFewMaxD] = {};  // keys past a tile's end
  TileRowPipeline<c10::BFloat16> tiles;
  float mx[kFewRows], l[kFewRows], alpha[kFewRows];
  for (int m = 0; m < ROWS; ++m) {
    const auto* src = reinterpret_cast<const uint16_t*>(P.q_row(b, h, m));
    for (int64_t i = 0; i < chunks; ++i) q[m][i] = _mm512_loadu_si512(src + 32 * i);
    std::fill(o + m * D, o + (m + 1) * D, 0.f);
    mx[m] = kNegInf;
    l[m] = 0.f;
  }
  const __m512 scale = _mm512_set1_ps(P.scale);
  const __m512i high_halves = _mm512_set1_epi32(int32_t(0xFFFF0000u));
  const auto [p0, p1] = P.segment_range(b, s);
  // the first tile too (the loop prefetches each next one): at decode sizes a layer's K / V
  // rows are cold, and reading them on demand ran the 1-row task at ~4 GB/s
  tiles.fetch(P, b, h, p0, std::min(kTile, p1 - p0));
  for (int64_t p = p0; p < p1; p += kTile) {
    const int64_t nt = std::min(kTile, p1 - p);
    tiles.fetch(P, b, h, p + kTile, std::min(kTile, p1 - p - nt));
    const c10::BFloat16* const* k_rows = tiles.current_k();
    const c10::BFloat16* const* v_rows = tiles.current_v();
    for (int64_t j0 = 0; j0 < nt; j0 += 16) {
      const void* keys[16];
      for (int j = 0; j < 16; ++j) keys[j] = j0 + j < nt ? (const void*)k_rows[j0 + j] : zero_row;
      for (int m = 0; m < ROWS; ++m) {
        __m512 acc[16];
#pragma GCC unroll 16
        for (int j = 0; j < 16; ++j) {
          acc[j] = _mm512_setzero_ps();
          for (int64_t i = 0; i < chunks; ++i) {
            const __m512bh kv =
                (__m512bh)_mm512_loadu_si512(static_cast<const uint16_t*>(keys[j]) + 32 * i);
            acc[j] = _mm512_dpbf16_ps(acc[j], kv, (__m512bh)q[m][i]);
          }
        }
        _mm512_storeu_ps(sc + m * kTile + j0, _mm512_mul_ps(lane_sums16(acc), scale));
      }
    }
    few_rows_softmax<16>(P, sc, ROWS, b, p, nt, mx, l, alpha);
    for (int64_t d = 0; d < D; d += 32) {
      __m512 even[ROWS], odd[ROWS];
      for (int m = 0; m < ROWS; ++m) {
        const __m512 a = _mm512_set1_ps(alpha[m]);
        even[m] = _mm512_mul_ps(_mm512_loadu_ps(o + m * D + d), a);
        odd[m] = _mm512_mul_ps(_mm512_loadu_ps(o + m * D + d + 16), a);
      }
      for (int64_t j = 0; j < nt; ++j) {
        const __m512i x = _mm512_loadu_si512(v_rows[j] + d);
        const __m512 ve = _mm512_castsi512_ps(_mm512_slli_epi32(x, 16));
        const __m512 vo = _mm512_castsi512_ps(_mm512_and_si512(x, high_halves));
        for (int m = 0; m < ROWS; ++m) {
          const __m512 pj = _mm512_set1_ps(sc[m * kTile + j]);
          even[m] = _mm512_fmadd_ps(pj, ve, even[m]);
          odd[m] = _mm512_fmadd_ps(pj, vo, odd[m]);
        }
      }
      for (int m = 0; m < ROWS; ++m) {
        _mm512_storeu_ps(o + m * D + d, even[m]);
        _mm512_storeu_ps(o + m * D + d + 16, odd[m]);
      }
    }
  }
  for (int m = 0; m < ROWS; ++m) {  // the panel kernels' layout: o^T [Dp, Mp], dims in place
    for (int64_t d = 0; d < D; ++d) {
      ws.ot[d * Mp + m] = o[m * D + d / 32 * 32 + (d % 2) * 16 + d % 32 / 2];
    }
    ws.mx[m] = mx[m];
    ws.l[m] = l[m];
  }
}

// ---------------------------------------------------------------- AMX build
// AMX (Intel Sapphire Rapids and later) multiplies bf16 on tiles: TDPBF16PS C += A . B with C
// 16 x 16 floats, A 16 rows of 32 bf16, B 16 rows of 16 bf16 pairs (float accumulation). In
// the panel kernels' transposed layouts both products are tile products whose operands are
// staged once per tile of keys, or not at all:
//   S^T [keys, rows] = K [keys, D] . Q^T: A = 16 K rows, read in place from the cache when 16
//     positions share a block (else staged), B = the query pairs qp [D / 2, Mp] (staged once
//     per task, as for the vdpbf16ps build), C = 16 keys x 16 rows of s;
//   O^T [D, rows] += V^T [D, keys] . P^T: A = 16 rows of V^T (the tile's V staged transposed,
//     [Dp, kTile] bf16), B = the probability pairs pp [kTile / 2, Mp], C = 16 head dims x 16
//     rows of ot.
// Eight tile registers: a 2 x 2 block of C, two A and two B. Head dims a multiple of 32 (the
// tiles' inner dimension); others take the vdpbf16ps build. Mask, softmax, probabilities and
// fold are the vdpbf16ps build's; the tiles sum the bf16 products in their own order, so this
// build's last bits are its own (within bf16 tolerance of the reference, tests/ops).
#define SPECDEC_AMX_TARGET \
  __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16,amx-tile,amx-bf16")))

// The tile configuration (palette 1): every tile 16 rows of 64 bytes.
struct alignas(64) TileConfig {
  uint8_t palette, start_row, reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

// Loads TileConfig at the start of each task, and _tile_release ends it: other code on the
// thread (oneDNN's AMX kernels in torch) configures the tiles its own way between tasks.
SPECDEC_AMX_TARGET SPECDEC_INLINE void configure_tiles() {
  static const TileConfig config = [] {
    TileConfig c{};
    c.palette = 1;
    for (int t = 0; t < 8; ++t) {
      c.colsb[t] = 64;
      c.rows[t] = 16;
    }
    return c;
  }();
  _tile_loadconfig(&config);
}

// s[16 a + n, 16 c + m] = sum_d K_a[n, d] q[16 c + m, d] (unscaled) for NA blocks a of 16 keys
// (k[a]: their first row, rows k_bytes apart) and NC blocks c of 16 query rows (qp + 16 c).
template <int NA, int NC>
SPECDEC_AMX_TARGET SPECDEC_INLINE void score_tiles(const uint16_t* const* k, int64_t k_bytes,
                                                   const uint32_t* qp, int64_t Mp, int64_t D,
                                                   float* s) {
  const int64_t row_bytes = Mp * 4;
  _tile_zero(0);
  if constexpr (NC == 2) _tile_zero(1);
  if constexpr (NA == 2) _tile_zero(2);
  if constexpr (NA == 2 && NC == 2) _tile_zero(3);
  for (int64_t i = 0; i < D / 32; ++i) {
    _tile_loadd(4, k[0] + 32 * i, k_bytes);
    if constexpr (NA == 2) _tile_loadd(5, k[1] + 32 * i, k_bytes);
    _tile_loadd(6, qp + 16 * i * Mp, row_bytes);
    if constexpr (NC == 2) _tile_loadd(7, qp + 16 * i * Mp + 16, row_bytes);
    _tile_dpbf16ps(0, 4, 6);
    if constexpr (NC == 2) _tile_dpbf16ps(1, 4, 7);
    if constexpr (NA == 2) _tile_dpbf16ps(2, 5, 6);
    if constexpr (NA == 2 && NC == 2) _tile_dpbf16ps(3, 5, 7);
  }
  _tile_stored(0, s, row_bytes);
  if constexpr (NC == 2) _tile_stored(1, s + 16, row_bytes);
  if constexpr (NA == 2) _tile_stored(2, s + 16 * Mp, row_bytes);
  if constexpr (NA == 2 && NC == 2) _tile_stored(3, s + 16 * Mp + 16, row_bytes);
}

// ot[16 a + d, 16 c + m] += sum_n vt[16 a + d, n] p[n, 16 c + m] over `steps` x 32 keys for
// 2 blocks a of 16 head dims (vt: [Dp, kTile] bf16) and NC blocks c of 16 query rows (pp: the
// probability pairs [kTile / 2, Mp]).
template <int NC>
SPECDEC_AMX_TARGET SPECDEC_INLINE void update_tiles(const uint16_t* vt, const uint32_t* pp,
                                                    int64_t Mp, int64_t steps, float* ot) {
  const int64_t row_bytes = Mp * 4, vt_bytes = kTile * 2;
  _tile_loadd(0, ot, row_bytes);
  if constexpr (NC == 2) _tile_loadd(1, ot + 16, row_bytes);
  _tile_loadd(2, ot + 16 * Mp, row_bytes);
  if constexpr (NC == 2) _tile_loadd(3, ot + 16 * Mp + 16, row_bytes);
  for (int64_t i = 0; i < steps; ++i) {
    _tile_loadd(4, vt + 32 * i, vt_bytes);
    _tile_loadd(5, vt + 16 * kTile + 32 * i, vt_bytes);
    _tile_loadd(6, pp + 16 * i * Mp, row_bytes);
    if constexpr (NC == 2) _tile_loadd(7, pp + 16 * i * Mp + 16, row_bytes);
    _tile_dpbf16ps(0, 4, 6);
    if constexpr (NC == 2) _tile_dpbf16ps(1, 4, 7);
    _tile_dpbf16ps(2, 5, 6);
    if constexpr (NC == 2) _tile_dpbf16ps(3, 5, 7);
  }
  _tile_stored(0, ot, row_bytes);
  if constexpr (NC == 2) _tile_stored(1, ot + 16, row_bytes);
  _tile_stored(2, ot + 16 * Mp, row_bytes);
  if constexpr (NC == 2) _tile_stored(3, ot + 16 * Mp + 16, row_bytes);
}

// vt[d, j] = v[p + j, d] for the tile's nt positions, columns [nt, 32 * steps) zero (the
// last 32-key step's keys past the tile: their probabilities are stale, their V must be 0).
// Per 32 positions and 32 head dims: pairs of V rows are zipped into bf16 pairs (16 pairs of
// head dims per vector), and two 16 x 16 transposes of those 32-bit pairs give 32 rows of vt
// (a scalar transposed copy was a third of a prompt's AMX kernel time).
SPECDEC_AMX_TARGET SPECDEC_INLINE void stage_v_transposed(const Problem<c10::BFloat16>& P,
                                                          uint16_t* vt, int64_t b, int64_t h,
                                                          int64_t p, int64_t nt, int64_t steps) {
  using vfloat = typename Simd<16>::f;
  // (a[d], c[d]) for head dims d of the low (0..15) and high (16..31) half
  alignas(64) static const uint16_t kLow[32] = {0,  32, 1,  33, 2,  34, 3,  35, 4,  36, 5,
                                                37, 6,  38, 7,  39, 8,  40, 9,  41, 10, 42,
                                                11, 43, 12, 44, 13, 45, 14, 46, 15, 47};
  alignas(64) static const uint16_t kHigh[32] = {16, 48, 17, 49, 18, 50, 19, 51, 20, 52, 21,
                                                 53, 22, 54, 23, 55, 24, 56, 25, 57, 26, 58,
                                                 27, 59, 28, 60, 29, 61, 30, 62, 31, 63};
  const __m512i low = _mm512_load_si512(kLow), high = _mm512_load_si512(kHigh);
  for (int64_t j0 = 0; j0 < 32 * steps; j0 += 32) {
    const uint16_t* rows[32];
    for (int64_t j = 0; j < 32; ++j) {
      rows[j] =
          j0 + j < nt ? reinterpret_cast<const uint16_t*>(P.v_row(b, p + j0 + j, h)) : nullptr;
    }
    for (int64_t d0 = 0; d0 < P.D; d0 += 32) {
      vfloat x[16], y[16];  // [pair of positions][head dim]: dims d0 .. d0 + 15, + 16 .. + 31
      for (int i = 0; i < 16; ++i) {
        const uint16_t *ra = rows[2 * i], *rc = rows[2 * i + 1];
        const __m512i a = ra ? _mm512_loadu_si512(ra + d0) : _mm512_setzero_si512();
        const __m512i c = rc ? _mm512_loadu_si512(rc + d0) : _mm512_setzero_si512();
        x[i] = (vfloat)_mm512_permutex2var_epi16(a, low, c);
        y[i] = (vfloat)_mm512_permutex2var_epi16(a, high, c);
      }
      transpose_square<16>(x);
      transpose_square<16>(y);
      for (int i = 0; i < 16; ++i) {
        store(vt + (d0 + i) * kTile + j0, x[i]);
        store(vt + (d0 + 16 + i) * kTile + j0, y[i]);
      }
    }
  }
}

SPECDEC_AMX_TARGET void attend_amx_tiles(const Problem<c10::BFloat16>& P, Workspace& ws,
                                         const Rows& r, int64_t s) {
  const int64_t b = r.b, h = r.h, M = r.count(), Mr = (M + 15) / 16 * 16;
  const int64_t D = P.D, Dp = P.Dp, Mp = P.Mp;
  stage_query_pairs(P, ws.qp, r, Mr);
  reset_rows(ws, Mp, Dp, Mr);
  configure_tiles();
  auto* vt = reinterpret_cast<uint16_t*>(ws.vp);  // [Dp, kTile]: the V tile, transposed
  auto* kt = reinterpret_cast<uint16_t*>(ws.kp);  // [kTile, Dp]: the K tile, when staged
  // 16 positions from a multiple of 16 share a block when the block size is a multiple of 16:
  // the K tile is then read in place (rows past the tile's end are read, their scores unused)
  const bool k_in_place = P.block_size % 16 == 0;
  const int64_t k_bytes = k_in_place ? P.k_stride[1] * 2 : Dp * 2;
  const auto [p0, p1] = P.segment_range(b, s);
  for (int64_t p = p0; p < p1; p += kTile) {
    const int64_t nt = std::min(kTile, p1 - p), blocks = (nt + 15) / 16, steps = (nt + 31) / 32;
    const uint16_t* k_rows[kTile / 16];
    for (int64_t a = 0; a < blocks; ++a) {
      if (k_in_place) {
        k_rows[a] = reinterpret_cast<const uint16_t*>(P.k_row(b, p + 16 * a, h));
        continue;
      }
      for (int64_t j = 16 * a; j < std::min(nt, 16 * a + 16); ++j) {
        std::memcpy(kt + j * Dp, P.k_row(b, p + j, h), D * sizeof(uint16_t));
      }
      k_rows[a] = kt + 16 * a * Dp;
    }
    stage_v_transposed(P, vt, b, h, p, nt, steps);
    prefetch_rows(P, b, h, p + kTile, std::min(kTile, p1 - p - nt));
    const int64_t r0 = first_visible_panel(P, r, p, nt, Mr, 32);
    for (int64_t i = r0; i < Mr; i += 32) {
      const bool two_c = Mr - i >= 32;
      for (int64_t a = 0; a < blocks; a += 2) {
        float* out = ws.s + 16 * a * Mp + i;
        if (a + 1 < blocks) {
          two_c ? score_tiles<2, 2>(k_rows + a, k_bytes, ws.qp + i, Mp, D, out)
                : score_tiles<2, 1>(k_rows + a, k_bytes, ws.qp + i, Mp, D, out);
        } else {
          two_c ? score_tiles<1, 2>(k_rows + a, k_bytes, ws.qp + i, Mp, D, out)
                : score_tiles<1, 1>(k_rows + a, k_bytes, ws.qp + i, Mp, D, out);
        }
      }
    }
    mask_tile(P, ws.s, r, p, nt, r0);  // (-inf stays -inf when scaled)
    softmax_tile<16, true>(ws.s + r0, Mp, Mr - r0, nt, ws.mx + r0, ws.l + r0, ws.alpha + r0,
                           P.scale);
    pair_probs(ws.s + r0, nt, Mp, Mr - r0, ws.pp + r0);
    // The last step's pairs past the tile meet zero V columns, but 0 x NaN is NaN: their
    // memory may hold another call's floats (the buffers move with the row stride Mp).
    for (int64_t j = (nt + 1) / 2; j < 16 * steps; ++j) {
      std::fill(ws.pp + j * Mp + r0, ws.pp + j * Mp + Mr, 0u);
    }
    for (int64_t d = 0; d < D; ++d) {  // o *= alpha before the tiles add this tile's P V
      for (int64_t m = r0; m < Mr; m += 16) {
        float* o = ws.ot + d * Mp + m;
        _mm512_storeu_ps(o, _mm512_mul_ps(_mm512_loadu_ps(o), _mm512_loadu_ps(ws.alpha + m)));
      }
    }
    for (int64_t i = r0; i < Mr; i += 32) {
      for (int64_t a = 0; a < D / 16; a += 2) {
        float* out = ws.ot + 16 * a * Mp + i;
        if (Mr - i >= 32) {
          update_tiles<2>(vt + 16 * a * kTile, ws.pp + i, Mp, steps, out);
        } else {
          update_tiles<1>(vt + 16 * a * kTile, ws.pp + i, Mp, steps, out);
        }
      }
    }
  }
  _tile_release();
}

// The AMX build for head dims a multiple of 32, else the vdpbf16ps build.
void attend_amx(const Problem<c10::BFloat16>& P, Workspace& ws, const Rows& r, int64_t s) {
  if (P.D % 32 != 0) return attend_avx512bf16(P, ws, r, s);
  attend_amx_tiles(P, ws, r, s);
}

// ---------------------------------------------------------------- dispatch
template <typename scalar_t>
__attribute__((target("avx512f,avx512vl,avx512bw,avx2,fma,f16c"))) void attend_avx512(
    const Problem<scalar_t>& P, Workspace& ws, const Rows& r, int64_t s) {
  attend<16>(P, ws, r, s);
}

template <typename scalar_t>
__attribute__((target("avx2,fma,f16c"))) void attend_avx2(const Problem<scalar_t>& P, Workspace& ws,
                                                          const Rows& r, int64_t s) {
  attend<8>(P, ws, r, s);
}

template <typename scalar_t>
void attend_baseline(const Problem<scalar_t>& P, Workspace& ws, const Rows& r, int64_t s) {
  attend<4>(P, ws, r, s);
}

template <typename scalar_t>
__attribute__((target("avx512f,avx512vl,avx512bw,avx2,fma,f16c"))) void attend_few_avx512(
    const Problem<scalar_t>& P, Workspace& ws, const Rows& r, int64_t s) {
  attend_few<16>(P, ws, r, s);
}

template <typename scalar_t>
__attribute__((target("avx2,fma,f16c"))) void attend_few_avx2(const Problem<scalar_t>& P,
                                                              Workspace& ws, const Rows& r,
                                                              int64_t s) {
  attend_few<8>(P, ws, r, s);
}

template <typename scalar_t>
void attend_few_baseline(const Problem<scalar_t>& P, Workspace& ws, const Rows& r, int64_t s) {
  attend_few<4>(P, ws, r, s);
}

template <typename scalar_t>
using AttendFn = void (*)(const Problem<scalar_t>&, Workspace&, const Rows&, int64_t);

// attend_few_bf16_rows<1> .. <kFewRows>, by row count - 1.
template <size_t... I>
constexpr std::array<AttendFn<c10::BFloat16>, sizeof...(I)> few_bf16_by_rows(
    std::index_sequence<I...>) {
  return {&attend_few_bf16_rows<int(I) + 1>...};
}

// The AVX512-BF16 few-rows kernel for this task's row count; head dims that are not a
// multiple of 32 take the AVX-512 build.
void attend_few_bf16(const Problem<c10::BFloat16>& P, Workspace& ws, const Rows& r, int64_t s) {
  if (P.D % 32 != 0) return attend_few_avx512<c10::BFloat16>(P, ws, r, s);
  static constexpr auto kByRows = few_bf16_by_rows(std::make_index_sequence<kFewRows>());
  kByRows[std::min(r.count(), kFewRows) - 1](P, ws, r, s);
}

// The few-rows kernel for the widest build cpu_isa() allows.
template <typename scalar_t>
AttendFn<scalar_t> pick_attend_few() {
  const CpuIsa isa = cpu_isa();
  if constexpr (std::is_same_v<scalar_t, c10::BFloat16>) {
    if (isa >= CpuIsa::kAvx512Bf16) return &attend_few_bf16;
  }
  if (isa >= CpuIsa::kAvx512) return &attend_few_avx512<scalar_t>;
  if (isa >= CpuIsa::kAvx2) return &attend_few_avx2<scalar_t>;
  return &attend_few_baseline<scalar_t>;
}

// The widest build cpu_isa() allows for scalar_t (avx512 leaves out the bf16 dot products).
template <typename scalar_t>
AttendFn<scalar_t> pick_attend() {
  const CpuIsa isa = cpu_isa();
  if constexpr (std::is_same_v<scalar_t, c10::BFloat16>) {
    if (isa >= CpuIsa::kAmx) return &attend_amx;
    if (isa >= CpuIsa::kAvx512Bf16) return &attend_avx512bf16;
  }
  if (isa >= CpuIsa::kAvx512) return &attend_avx512<scalar_t>;
  if (isa >= CpuIsa::kAvx2) return &attend_avx2<scalar_t>;
  return &attend_baseline<scalar_t>;
}

// out[b, m / group_size, h * group_size + m % group_size, :] = ot[:, m] / l[m] for the M valid
// rows (rows without any visible key have l = 0 and o = 0 and stay zero).
template <typename scalar_t>
void write_rows(const Problem<scalar_t>& P, scalar_t* out, const Rows& r, const float* ot,
                const float* l) {
  for (int64_t i = 0; i < r.count(); ++i) {
    const float inv = l[i] > 0.f ? 1.f / l[i] : 0.f;
    scalar_t* dst = out + P.out_offset(r.b, r.h, r.m0 + i);
    for (int64_t d = 0; d < P.D; ++d) dst[d] = static_cast<scalar_t>(ot[d * P.Mp + i] * inv);
  }
}

// log2(block_size) when a power of two, else -1 (Problem::block_shift).
int block_shift(int64_t block_size) {
  return (block_size & (block_size - 1)) == 0 ? __builtin_ctzll(uint64_t(block_size)) : -1;
}

// Segment partials (o^T [D, Mp], max and sum [Mp] each, of the M rows of a task) and
// the one way they are combined: fold_segment, in segment order, from (0, -inf, 0).
struct Partial {
  float *o, *mx, *l;
};

// acc <- acc (+) seg for rows [0, M): the two online softmaxes rescaled to their common max.
// A side that saw no key (max -inf) weighs 0, so the first fold copies seg exactly (x 1)
// and a segment past a row's keys leaves it exactly as it was.
void fold_segment(Partial acc, const Partial& seg, int64_t M, int64_t D, int64_t Mp) {
  alignas(64) float w_acc[kMaxPanel], w_seg[kMaxPanel];
  for (int64_t m0 = 0; m0 < M; m0 += kMaxPanel) {
    const int64_t rows = std::min<int64_t>(kMaxPanel, M - m0);
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t m = m0 + r;
      const float mx = std::max(acc.mx[m], seg.mx[m]);
      w_acc[r] = acc.mx[m] == kNegInf ? 0.f : std::exp2(acc.mx[m] - mx);
      w_seg[r] = seg.mx[m] == kNegInf ? 0.f : std::exp2(seg.mx[m] - mx);
      acc.l[m] = acc.l[m] * w_acc[r] + seg.l[m] * w_seg[r];
      acc.mx[m] = mx;
    }
    for (int64_t d = 0; d < D; ++d) {
      float* ao = acc.o + d * Mp + m0;
      const float* so = seg.o + d * Mp + m0;
      for (int64_t r = 0; r < rows; ++r) ao[r] = ao[r] * w_acc[r] + so[r] * w_seg[r];
    }
  }
}

// A task's running result: zero output, max -inf, sum 0 (its M rows only; row stride Mp, at
// most kRowBlock).
struct Accumulator {
  std::vector<float> o, mx, l;
  int64_t D, Mp = kRowBlock;
  explicit Accumulator(int64_t D) : o(D * kRowBlock), mx(kRowBlock), l(kRowBlock), D(D) {}
  Partial reset(int64_t M) {
    for (int64_t d = 0; d < D; ++d) std::fill_n(o.data() + d * Mp, M, 0.f);
    std::fill_n(mx.data(), M, kNegInf);
    std::fill_n(l.data(), M, 0.f);
    return {o.data(), mx.data(), l.data()};
  }
};

// This thread's workspace and accumulator for P's shape, kept from call to call: allocating
// and zeroing ~200 KB per call and thread showed as page faults and memset, ~9% of a
// 512-token prompt's samples under perf (benchmarks/bench_vllm_attention.py times the op).
template <typename scalar_t>
std::pair<Workspace*, Accumulator*> thread_scratch(const Problem<scalar_t>& P) {
  thread_local std::unique_ptr<Workspace> ws;
  thread_local std::unique_ptr<Accumulator> acc;
  thread_local int64_t shape[2] = {-1, -1};  // Dp, D: the tile padding a shape leaves zero
  if (!ws || shape[0] != P.Dp || shape[1] != P.D) {
    ws = std::make_unique<Workspace>(P.Dp);
    acc = std::make_unique<Accumulator>(P.D);
    shape[0] = P.Dp;
    shape[1] = P.D;
  }
  ws->set_rows(P.Mp);
  acc->Mp = P.Mp;
  return {ws.get(), acc.get()};
}

// The tasks of a call: per request and KV head its rows whole when the few-rows kernel takes
// them, else in blocks of kRowBlock (a prefill chunk's hundreds of rows become several
// tasks, which keeps both threads of a batch-1 prompt busy and a task's buffers in L2), the
// dearest first (rows times the keys the last row sees): the tasks are taken in that order
// by whichever thread is free. The order does not change a row's bits.
template <typename scalar_t>
std::vector<Rows> row_tasks(const Problem<scalar_t>& P, int64_t B) {
  std::vector<std::pair<int64_t, Rows>> costed;
  for (int64_t b = 0; b < B; ++b) {
    const int64_t M = P.rows(b), block = M <= kFewRows ? M : kRowBlock;
    for (int64_t h = 0; h < P.Hkv; ++h) {
      for (int64_t m0 = 0; m0 < M; m0 += block) {
        const int64_t m1 = std::min(m0 + block, M);
        const int64_t keys = P.cache_lens[b] + (m1 - 1) / P.group_size + 1;
        costed.push_back({(m1 - m0) * keys, Rows{b, h, m0, m1}});
      }
    }
  }
  std::stable_sort(costed.begin(), costed.end(),
                   [](const auto& x, const auto& y) { return x.first > y.first; });
  std::vector<Rows> tasks;
  tasks.reserve(costed.size());
  for (const auto& c : costed) tasks.push_back(c.second);
  return tasks;
}

// Runs fn(task index) for [0, n) on the intra-op threads, each taking the next task when
// free (at::parallel_for hands out fixed ranges, which a causal prompt's unequal blocks
// would leave unbalanced).
template <typename F>
void for_each_task(int64_t n, const F& fn) {
  std::atomic<int64_t> next{0};
  const int64_t workers = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), n));
  at::parallel_for(0, workers, 1, [&](int64_t, int64_t) {
    for (int64_t t = next++; t < n; t = next++) fn(t);
  });
}

template <typename scalar_t>
void tree_verify_typed(const Problem<scalar_t>& P, int64_t B, scalar_t* out) {
  // Either kernel gives a row the same bits (see "few query rows"); with the segments at
  // fixed positions a node's attention in a tree verify is the plain step's, so greedy
  // speculation reproduces plain decoding bitwise where the rest of the model is row-invariant
  // (the bf16 tiles of the CPU decode path). Not where a 64-position tile or a segment
  // boundary falls between the positions the node's ancestors have in the tree and the ones
  // they get once accepted (the keys are then grouped differently: last bits), nor for bf16 on
  // AVX512-BF16 CPUs (their vdpbf16ps kernels).
  const auto attend_fn = pick_attend<scalar_t>();
  const auto attend_few_fn = P.D <= kFewMaxD ? pick_attend_few<scalar_t>() : attend_fn;
  const auto attend_segment = [&](Workspace& ws, const Rows& r, int64_t s) {
    (P.rows(r.b) <= kFewRows ? attend_few_fn : attend_fn)(P, ws, r, s);
    return Partial{ws.ot, ws.mx, ws.l};
  };
  const std::vector<Rows> tasks = row_tasks(P, B);
  const int64_t n = int64_t(tasks.size());
  const auto segments_of = [&](const Rows& r) { return (P.length(r.b) + kSegment - 1) / kSegment; };
  int64_t segments = 1;  // per task, at most
  for (const Rows& r : tasks) segments = std::max(segments, segments_of(r));
  // One task per row block when those occupy the threads (x4 for balance), the contexts are
  // short (a second parallel pass for the folds costs more than it balances) or the
  // partials would not fit the budget; else one per segment, the partials kept. Either way
  // the same folds in the same order: the same bits.
  const int64_t partial_floats = P.D * P.Mp + 2 * P.Mp;
  const bool split = segments >= kMinSplitSegments && n < 4 * at::get_num_threads() &&
                     n * segments * partial_floats * 4 <= kPartialsBudget;
  if (!split) {
    for_each_task(n, [&](int64_t t) {
      auto [ws, acc] = thread_scratch(P);
      const Rows& r = tasks[t];
      const Partial result = acc->reset(r.count());
      for (int64_t s = 0; s < segments_of(r); ++s) {
        fold_segment(result, attend_segment(*ws, r, s), r.count(), P.D, P.Mp);
      }
      write_rows(P, out, r, result.o, result.l);
    });
    return;
  }
  // uninitialised: every task writes the columns of its rows before the folds read them
  std::unique_ptr<float[]> partials(new float[n * segments * partial_floats]);
  const auto saved = [&](int64_t t) {  // task t = g * segments + s
    float* base = partials.get() + t * partial_floats;
    return Partial{base, base + P.D * P.Mp, base + P.D * P.Mp + P.Mp};
  };
  for_each_task(n * segments, [&](int64_t t) {
    const Rows& r = tasks[t / segments];
    const int64_t s = t % segments, M = r.count();
    if (s >= segments_of(r)) return;
    Workspace& ws = *thread_scratch(P).first;
    const Partial seg = attend_segment(ws, r, s);
    const Partial dst = saved(t);
    for (int64_t d = 0; d < P.D; ++d) std::copy_n(seg.o + d * P.Mp, M, dst.o + d * P.Mp);
    std::copy_n(seg.mx, M, dst.mx);
    std::copy_n(seg.l, M, dst.l);
  });
  for_each_task(n, [&](int64_t g) {
    Accumulator& acc = *thread_scratch(P).second;
    const Rows& r = tasks[g];
    const Partial result = acc.reset(r.count());
    for (int64_t s = 0; s < segments_of(r); ++s) {
      fold_segment(result, saved(g * segments + s), r.count(), P.D, P.Mp);
    }
    write_rows(P, out, r, result.o, result.l);
  });
}

template <typename scalar_t>
at::Tensor run(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
               const at::Tensor& block_table, const at::Tensor& cache_lens,
               const at::Tensor& num_nodes, const at::Tensor& tree_mask, double sm_scale) {
  const int64_t B = q.size(0), T = q.size(1), Hq = q.size(2), D = q.size(3);
  const int64_t Hkv = k_cache.size(2), group_size = Hq / Hkv;
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
                      group_size,
                      k_cache.size(1),
                      block_shift(k_cache.size(1)),
                      block_table.size(1),
                      tree_mask.size(2),
                      static_cast<float>(sm_scale * kLog2e),
                      (D + kMaxCols - 1) / kMaxCols * kMaxCols,
                      std::min((T * group_size + kMaxPanel - 1) / kMaxPanel * kMaxPanel, kRowBlock),
                      {q.stride(0), q.stride(1), q.stride(2)},
                      {k_cache.stride(0), k_cache.stride(1), k_cache.stride(2)},
                      {v_cache.stride(0), v_cache.stride(1), v_cache.stride(2)}};
  // Contiguous whatever q's strides (as the fake kernel says); padded rows are zero. Only
  // they are cleared: a prefill's whole padded batch is megabytes (profile_step --part vllm).
  at::Tensor out = at::empty(q.sizes(), q.options());
  scalar_t* out_ptr = out.data_ptr<scalar_t>();
  const int64_t node_elems = Hq * D;
  for (int64_t b = 0; b < B; ++b) {
    const int64_t n = std::clamp<int64_t>(P.num_nodes[b], 0, T);
    std::fill(out_ptr + (b * T + n) * node_elems, out_ptr + (b + 1) * T * node_elems, scalar_t(0));
  }
  tree_verify_typed(P, B, out_ptr);
  return out;
}

}  // namespace

at::Tensor tree_verify_cpu(const at::Tensor& q, const at::Tensor& k_cache,
                           const at::Tensor& v_cache, const at::Tensor& block_table,
                           const at::Tensor& cache_lens, const at::Tensor& num_nodes,
                           const at::Tensor& tree_mask, double sm_scale) {
  SPECDEC_DISPATCH_FLOAT_DTYPE(q.scalar_type(), scalar_t, {
    return run<scalar_t>(q, k_cache, v_cache, block_table, cache_lens, num_nodes, tree_mask,
                         sm_scale);
  });
}

}  // namespace specdec
