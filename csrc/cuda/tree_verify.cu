// tree_verify on CUDA: flash-decoding over the paged prefix plus the draft tree.
//
// Request b's keys are the logical positions [0, ctx_end), ctx_end = min(cache_lens + n,
// max_blocks * block_size): positions < cache_lens are the prefix (every row attends them),
// position cache_lens + j is tree node j (row i attends it iff bit j of tree_mask[b, i] is
// set). Rows i >= n and rows with no key are zero, as in reference.tree_verify.
//
// Work split: one CTA per (request b, kv head h, row tile; flattened into blockIdx.x, whose
// limit is 2^31 - 1, so no batch size or head count runs into the 65535 of gridDim.y / z) and
// split (blockIdx.y; at most ~2 per SM). The CTA holds the query rows that share KV head h (row
// r = t * group_size + g <-> node t, query head h * group_size + g, group_size = Hq / Hkv:
// rows_per_head = T * group_size rows; at most kWarps * ROWS_PER_WARP of them per CTA, more rows
// take more row tiles) so each K/V tile loaded into shared memory serves the whole GQA group.
// A split covers a fixed range of chunk positions; the number of splits depends on shapes only
// (never on cache_lens values), so the launch is CUDA-graph safe. With more than one split,
// each split writes its normalised partial output and log-sum-exp to a float scratch and a
// merge kernel combines them; with one split the main kernel writes the output directly.
//
// Inside a CTA, warp w owns rows w, w + 8, w + 16, ... (ROWS_PER_WARP of them). Per key tile
// of 32 positions:
//   scores: lane = key; the lane's K row is read from shared memory, the warp's Q rows are
//           broadcast reads, so one K load serves all the warp's rows;
//   softmax: online (running max m, running sum l) in the log2 domain, per row, with warp
//           reductions over the 32 keys of the tile;
//   P @ V:  lane = output columns lane, lane + 32, ...; probabilities broadcast from shared.
// q and the caches are read through their strides (int64, in elements; the last dimension is
// contiguous: checks.cpp), so NHD and HND pages, halves of a joint KV tensor, token pools
// (block size 1) and q sliced out of a fused QKV output need no copy. The output is contiguous.
// Accumulation is fp32 for every input dtype. Head dims up to 512 are padded to the next
// of 32 / 64 / 128 / 256 / 512 (DP, the template parameter, from SPECDEC_DISPATCH_HEAD_DIM)
// with zeros. Shared memory grows with DP * rows per CTA, so DP <= 256 keeps 8 rows per warp
// (64 rows, <= 136 KB) while DP = 512 takes 4 (32 rows, 196 KB: H100 / H200) or, on devices
// whose opt-in limit is smaller (A100: 163 KB), 2 (16 rows, 162 KB); the register file per
// thread (ROWS_PER_WARP * DP / 32 accumulators) stays at the DP = 256 kernel's 64.
// Head dims past 512 (which checks.cpp, the CPU kernel and the reference accept) take
// tree_verify_wide_kernel: one CTA per query row, K / V straight from global memory, the
// running output in an fp32 scratch row: slower (no K/V reuse across the GQA group), but any D.
// An empty output (Hq = 0: q [B, T, 0, D] passes the checks) launches nothing.
#include <cmath>

#include "cuda/common.cuh"
#include "dispatch.h"
#include "numeric_constants.h"
#include "ops.h"

namespace specdec {
namespace cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / kWarpSize;
constexpr int kRowsPerWarp = 8;        // rows per warp of the DP <= 256 kernels
constexpr int kWideRowsPerWarp = 4;    // DP = 512, when the device's shared memory allows it
constexpr int kNarrowRowsPerWarp = 2;  // DP = 512 otherwise (A100's 163 KB opt-in)
constexpr int kMaxTiledHeadDim = 512;  // larger head dims take tree_verify_wide_kernel
constexpr int kKeyTile = kWarpSize;    // one key per lane in the score phase
constexpr int kMinSplitKeys = 256;     // a split covers at least this many positions

template <typename scalar_t>
struct VerifyParams {
  const scalar_t* q;           // [B, T, Hq, D], strides q_sb, q_st, q_sh, 1
  const scalar_t* k;           // [num_blocks, block_size, Hkv, D], strides k_sb, k_sr, k_sh, 1
  const scalar_t* v;           // [num_blocks, block_size, Hkv, D], strides v_sb, v_sr, v_sh, 1
  const int32_t* block_table;  // [B, max_blocks]
  const int32_t* cache_lens;   // [B]
  const int32_t* num_nodes;    // [B]
  const uint64_t* tree_mask;   // [B, T, mask_words]
  scalar_t* out;               // [B, T, Hq, D]: written when num_splits == 1
  float* part_out;             // [num_splits, B, T, Hq, D]: written when num_splits > 1
  float* part_lse;             // [num_splits, B, T, Hq] (log2 domain; -inf = no key)
  float scale_log2;            // sm_scale * log2(e)
  int B, T, Hq, Hkv, D;
  int group_size;              // query heads per KV head: Hq / Hkv
  int num_blocks, block_size;  // cache blocks, positions per block
  int max_blocks;              // block table entries per request
  int mask_words;              // 64-bit words per tree_mask row: ceil(T / 64)
  int rows_per_head;           // query rows per (request, kv head): T * group_size
  int row_tiles;               // CTAs per (request, kv head): ceil(rows_per_head / rows_per_cta)
  int rows_alloc;              // rows of Q / P in shared memory: min(rows_per_head, rows_per_cta)
  int max_positions;           // positions a block table row maps: max_blocks * block_size
  int chunk;                   // positions per split (a multiple of kKeyTile)
  int num_splits;
  int64_t q_sb, q_st, q_sh;  // q strides of request, node, head (elements)
  int64_t k_sb, k_sr, k_sh;  // k_cache strides of block, row in block, head
  int64_t v_sb, v_sr, v_sh;  // v_cache strides of block, row in block, head
  bool vec_ok;  // K / V rows can be read with 16-byte loads (D, strides, pointers aligned)
};

// The end of request b's keys, cache_lens + num_nodes, within [0, max_positions]: 64-bit, as
// unvalidated cache_lens may be anything; max_positions < 2^30 (host check), so a split's
// start split * chunk and end stay in int.
template <typename scalar_t>
__device__ __forceinline__ int context_end(const VerifyParams<scalar_t>& p, int c, int n) {
  const int64_t tree_end = int64_t(c) + n;
  return tree_end <= 0 ? 0 : tree_end >= p.max_positions ? p.max_positions : int(tree_end);
}

template <int DP>
__host__ __device__ constexpr int smem_floats(int rows) {
  return rows * DP               // Q rows (pre-scaled by scale_log2)
         + rows * kKeyTile       // P (probabilities of the current key tile)
         + kKeyTile * DP         // V tile
         + kKeyTile * (DP + 1);  // K tile, padded so lane kk reading row kk hits bank kk
}

// K / V tile of positions [p0, p0 + kKeyTile) of request b, head h -> shared (fp32, zero
// padded past D and past kend). Block ids are clamped like the reference's gather.
template <typename scalar_t, int DP>
__device__ __forceinline__ void load_kv_tile(const VerifyParams<scalar_t>& p, int b, int h, int p0,
                                             int kend, float* Ks, float* Vs) {
  constexpr int kVec = 16 / sizeof(scalar_t);
  constexpr int kChunks = DP / kVec;  // 16-byte chunks per padded row
  for (int idx = threadIdx.x; idx < kKeyTile * kChunks; idx += kThreads) {
    const int kk = idx / kChunks, d0 = (idx % kChunks) * kVec;
    const int pos = p0 + kk;
    float kv[kVec], vv[kVec];
#pragma unroll
    for (int e = 0; e < kVec; ++e) kv[e] = vv[e] = 0.f;
    if (pos < kend) {
      const int entry = p.block_table[int64_t(b) * p.max_blocks + pos / p.block_size];
      const int blk = min(max(entry, 0), p.num_blocks - 1);
      const int64_t r = pos % p.block_size;
      const int64_t kbase = int64_t(blk) * p.k_sb + r * p.k_sr + int64_t(h) * p.k_sh + d0;
      const int64_t vbase = int64_t(blk) * p.v_sb + r * p.v_sr + int64_t(h) * p.v_sh + d0;
      if (p.vec_ok) {  // D % kVec == 0, so a chunk starting below D ends within the row
        if (d0 < p.D) {
          alignas(16) scalar_t kt[kVec], vt[kVec];
          *reinterpret_cast<uint4*>(kt) = *reinterpret_cast<const uint4*>(p.k + kbase);
          *reinterpret_cast<uint4*>(vt) = *reinterpret_cast<const uint4*>(p.v + vbase);
#pragma unroll
          for (int e = 0; e < kVec; ++e) {
            kv[e] = to_float(kt[e]);
            vv[e] = to_float(vt[e]);
          }
        }
      } else {
#pragma unroll
        for (int e = 0; e < kVec; ++e) {
          if (d0 + e < p.D) {
            kv[e] = to_float(p.k[kbase + e]);
            vv[e] = to_float(p.v[vbase + e]);
          }
        }
      }
    }
#pragma unroll
    for (int e = 0; e < kVec; ++e) {
      Ks[kk * (DP + 1) + d0 + e] = kv[e];
      Vs[kk * DP + d0 + e] = vv[e];
    }
  }
}

template <typename scalar_t, int DP, int ROWS_PER_WARP>
__global__ void __launch_bounds__(kThreads, DP <= 128 ? 2 : 1)
    tree_verify_kernel(const VerifyParams<scalar_t> p) {
  constexpr int kCols = DP / kWarpSize;  // output columns per lane
  constexpr int kRowsPerCta = kWarps * ROWS_PER_WARP;
  extern __shared__ float4 smem4[];
  float* Qs = reinterpret_cast<float*>(smem4);  // [rows_alloc][DP]
  float* Ps = Qs + p.rows_alloc * DP;           // [rows_alloc][kKeyTile]
  float* Vs = Ps + p.rows_alloc * kKeyTile;     // [kKeyTile][DP]
  float* Ks = Vs + kKeyTile * DP;               // [kKeyTile][DP + 1]

  // blockIdx.x = (b * Hkv + h) * row_tiles + tile < B * T * Hq < 2^31 (host check): int math.
  const int cta = blockIdx.x, split = blockIdx.y;
  const int row0 = (cta % p.row_tiles) * kRowsPerCta, h = (cta / p.row_tiles) % p.Hkv;
  const int b = cta / (p.row_tiles * p.Hkv);
  const int warp = threadIdx.x / kWarpSize, lane = threadIdx.x % kWarpSize;

  const int n = min(max(p.num_nodes[b], 0), p.T);
  const int c = p.cache_lens[b];
  const int kbeg = split * p.chunk, kend = min(kbeg + p.chunk, context_end(p, c, n));

  // Rows are ordered by node t, so rows with t < n are a prefix:
  // [0, min(rows_per_head, n * group_size)).
  const int rows_cta = min(p.rows_per_head - row0, kRowsPerCta);
  const int rows_live = min(p.rows_per_head, n * p.group_size) - row0;  // may be <= 0
  // Slots i < nrows of this warp (local rows warp + kWarps * i) are live rows.
  const int nrows =
      rows_live > warp ? min(ROWS_PER_WARP, (rows_live - warp + kWarps - 1) / kWarps) : 0;

  for (int idx = threadIdx.x; idx < rows_cta * DP; idx += kThreads) {
    const int rl = idx / DP, d = idx % DP, r = row0 + rl;
    const int t = r / p.group_size, hq = h * p.group_size + r % p.group_size;
    float x = 0.f;
    if (d < p.D && t < n)
      x = to_float(p.q[int64_t(b) * p.q_sb + int64_t(t) * p.q_st + int64_t(hq) * p.q_sh + d]) *
          p.scale_log2;
    Qs[rl * DP + d] = x;
  }

  float m[ROWS_PER_WARP], l[ROWS_PER_WARP], acc[ROWS_PER_WARP][kCols];
#pragma unroll
  for (int i = 0; i < ROWS_PER_WARP; ++i) {
    m[i] = -INFINITY;
    l[i] = 0.f;
#pragma unroll
    for (int j = 0; j < kCols; ++j) acc[i][j] = 0.f;
  }

  for (int p0 = kbeg; p0 < kend; p0 += kKeyTile) {
    __syncthreads();  // the previous tile's K / V are no longer read (and Q is stored)
    load_kv_tile<scalar_t, DP>(p, b, h, p0, kend, Ks, Vs);
    __syncthreads();

    // Scores of key `pos` (this lane) against the warp's rows.
    float s[ROWS_PER_WARP];
#pragma unroll
    for (int i = 0; i < ROWS_PER_WARP; ++i) s[i] = 0.f;
#pragma unroll 4
    for (int d = 0; d < DP; d += 4) {
      const float* kr = Ks + lane * (DP + 1) + d;
      const float k0 = kr[0], k1 = kr[1], k2 = kr[2], k3 = kr[3];
#pragma unroll
      for (int i = 0; i < ROWS_PER_WARP; ++i) {
        if (i < nrows) {
          const float4 qv = *reinterpret_cast<const float4*>(Qs + (warp + kWarps * i) * DP + d);
          s[i] += qv.x * k0 + qv.y * k1 + qv.z * k2 + qv.w * k3;
        }
      }
    }

    // Mask, online softmax update, probabilities to shared memory.
    const int pos = p0 + lane;
#pragma unroll
    for (int i = 0; i < ROWS_PER_WARP; ++i) {
      if (i < nrows) {
        const int t = (row0 + warp + kWarps * i) / p.group_size;
        bool ok = pos < kend;
        if (ok && pos >= c) {  // tree node j = pos - c, 0 <= j < n since pos < kend <= c + n
          const int j = pos - c;
          const uint64_t word = p.tree_mask[(int64_t(b) * p.T + t) * p.mask_words + j / 64];
          ok = (word >> (j % 64)) & 1u;
        }
        const float x = ok ? s[i] : -INFINITY;
        const float m_new = fmaxf(m[i], warp_reduce(x, Max()));
        float alpha = 1.f, prob = 0.f;
        if (m_new != -INFINITY) {       // else no key so far: nothing to rescale, nothing to add
          alpha = exp2f(m[i] - m_new);  // exp2(-inf) = 0 on the first key
          prob = exp2f(x - m_new);
        }
        l[i] = l[i] * alpha + warp_reduce(prob, Sum());
        m[i] = m_new;
#pragma unroll
        for (int j = 0; j < kCols; ++j) acc[i][j] *= alpha;
        Ps[(warp + kWarps * i) * kKeyTile + lane] = prob;
      }
    }
    __syncwarp();  // each warp reads back only its own rows of Ps

    // acc[i][j] += sum_kk P[row i][kk] * V[kk][lane + 32 j]
    for (int kk = 0; kk < kKeyTile; kk += 4) {
      float4 pv[ROWS_PER_WARP];
#pragma unroll
      for (int i = 0; i < ROWS_PER_WARP; ++i) {
        pv[i] = i < nrows
                    ? *reinterpret_cast<const float4*>(Ps + (warp + kWarps * i) * kKeyTile + kk)
                    : make_float4(0.f, 0.f, 0.f, 0.f);
      }
#pragma unroll
      for (int e = 0; e < 4; ++e) {
#pragma unroll
        for (int j = 0; j < kCols; ++j) {
          const float vv = Vs[(kk + e) * DP + lane + kWarpSize * j];
#pragma unroll
          for (int i = 0; i < ROWS_PER_WARP; ++i) {
            if (i < nrows) {
              const float pe = e == 0 ? pv[i].x : e == 1 ? pv[i].y : e == 2 ? pv[i].z : pv[i].w;
              acc[i][j] += pe * vv;
            }
          }
        }
      }
    }
  }

  // Epilogue: every row of the tile is written (dead rows as zeros / lse = -inf).
  const int64_t rows_total = int64_t(p.B) * p.T * p.Hq;
#pragma unroll
  for (int i = 0; i < ROWS_PER_WARP; ++i) {
    const int rl = warp + kWarps * i;
    if (rl < rows_cta) {
      const int r = row0 + rl, t = r / p.group_size, hq = h * p.group_size + r % p.group_size;
      const bool has_key = i < nrows && l[i] > 0.f;
      const float inv_l = has_key ? 1.f / l[i] : 0.f;
      const int64_t orow = (int64_t(b) * p.T + t) * p.Hq + hq;
      if (p.num_splits == 1) {
#pragma unroll
        for (int j = 0; j < kCols; ++j) {
          const int d = lane + kWarpSize * j;
          if (d < p.D) p.out[orow * p.D + d] = static_cast<scalar_t>(acc[i][j] * inv_l);
        }
      } else {
        const int64_t prow = split * rows_total + orow;
#pragma unroll
        for (int j = 0; j < kCols; ++j) {
          const int d = lane + kWarpSize * j;
          if (d < p.D) p.part_out[prow * p.D + d] = acc[i][j] * inv_l;
        }
        if (lane == 0) p.part_lse[prow] = has_key ? m[i] + log2f(l[i]) : -INFINITY;
      }
    }
  }
}

// Head dims past kMaxTiledHeadDim (see the header): one CTA per (query row, split), the row's
// q and its keys' K / V rows read from global memory (L1 / L2), the split's running output kept
// in its fp32 row of part_out (this CTA's alone: each thread updates only its own columns, so
// no barrier guards it). Writes the normalised partial output and log-sum-exp like the tiled
// kernel's splits, also with one split; merge_splits_kernel then writes out.
template <typename scalar_t>
__global__ void __launch_bounds__(kThreads)
    tree_verify_wide_kernel(const VerifyParams<scalar_t> p) {
  __shared__ float scores[kKeyTile];      // the tile's scores (log2 domain; -inf = masked)
  __shared__ int64_t v_offset[kKeyTile];  // the tile's V rows (read only for unmasked keys)
  const int64_t rows_total = int64_t(p.B) * p.T * p.Hq;
  // blockIdx.x = (b * T + t) * Hq + hq < B * T * Hq < 2^31 (host check): int math.
  const int row = blockIdx.x, split = blockIdx.y;
  const int hq = row % p.Hq, t = (row / p.Hq) % p.T, b = row / (p.Hq * p.T);
  const int h = hq / p.group_size;
  const int warp = threadIdx.x / kWarpSize, lane = threadIdx.x % kWarpSize;

  const int n = min(max(p.num_nodes[b], 0), p.T);
  const int c = p.cache_lens[b];
  const int kbeg = split * p.chunk;  // rows t >= n attend nothing
  const int kend = t < n ? min(kbeg + p.chunk, context_end(p, c, n)) : kbeg;

  const scalar_t* qr = p.q + int64_t(b) * p.q_sb + int64_t(t) * p.q_st + int64_t(hq) * p.q_sh;
  float* acc = p.part_out + (int64_t(split) * rows_total + row) * p.D;
  for (int d = threadIdx.x; d < p.D; d += kThreads) acc[d] = 0.f;
  float m = -INFINITY, l = 0.f;  // running max and sum: the same in every thread

  for (int p0 = kbeg; p0 < kend; p0 += kKeyTile) {
    // Scores: warp w takes keys w, w + kWarps, ... of the tile. `ok` is uniform in the warp, so
    // the warp reduction sees every lane.
    for (int kk = warp; kk < kKeyTile; kk += kWarps) {
      const int pos = p0 + kk;
      bool ok = pos < kend;
      if (ok && pos >= c) {  // tree node j = pos - c, 0 <= j < n since pos < kend <= c + n
        const int j = pos - c;
        const uint64_t word = p.tree_mask[(int64_t(b) * p.T + t) * p.mask_words + j / 64];
        ok = (word >> (j % 64)) & 1u;
      }
      float score = -INFINITY;
      if (ok) {  // block ids clamped like the reference's gather
        const int entry = p.block_table[int64_t(b) * p.max_blocks + pos / p.block_size];
        const int64_t blk = min(max(entry, 0), p.num_blocks - 1);
        const int64_t r = pos % p.block_size;
        const scalar_t* kr = p.k + blk * p.k_sb + r * p.k_sr + int64_t(h) * p.k_sh;
        float dot = 0.f;
        for (int d = lane; d < p.D; d += kWarpSize) dot += to_float(qr[d]) * to_float(kr[d]);
        score = warp_reduce(dot, Sum()) * p.scale_log2;
        if (lane == 0) v_offset[kk] = blk * p.v_sb + r * p.v_sr + int64_t(h) * p.v_sh;
      }
      if (lane == 0) scores[kk] = score;
    }
    __syncthreads();

    // Online softmax update (every thread reads the same scores in the same order), then
    // acc[d] = acc[d] * alpha + sum_kk prob[kk] * V[kk][d] for this thread's columns d.
    float tile_max = -INFINITY;
#pragma unroll
    for (int kk = 0; kk < kKeyTile; ++kk) tile_max = fmaxf(tile_max, scores[kk]);
    const float m_new = fmaxf(m, tile_max);
    if (m_new != -INFINITY) {  // else no key so far: nothing to rescale, nothing to add
      const float alpha = exp2f(m - m_new);  // exp2(-inf) = 0 on the first key
      float prob[kKeyTile], tile_sum = 0.f;
#pragma unroll
      for (int kk = 0; kk < kKeyTile; ++kk) {
        prob[kk] = exp2f(scores[kk] - m_new);  // 0 for masked keys
        tile_sum += prob[kk];
      }
      l = l * alpha + tile_sum;
      m = m_new;
      for (int d = threadIdx.x; d < p.D; d += kThreads) {
        float o = acc[d] * alpha;
#pragma unroll
        for (int kk = 0; kk < kKeyTile; ++kk) {
          if (prob[kk] > 0.f) o += prob[kk] * to_float(p.v[v_offset[kk] + d]);
        }
        acc[d] = o;
      }
    }
    __syncthreads();  // scores / v_offset are rewritten by the next tile
  }

  const bool has_key = l > 0.f;
  const float inv_l = has_key ? 1.f / l : 0.f;
  for (int d = threadIdx.x; d < p.D; d += kThreads) acc[d] *= inv_l;
  if (threadIdx.x == 0) {
    p.part_lse[int64_t(split) * rows_total + row] = has_key ? m + log2f(l) : -INFINITY;
  }
}

// out[row] = sum_s 2^(lse_s - M) * part_out[s, row] / sum_s 2^(lse_s - M), M = max_s lse_s;
// rows with no key in any split (M = -inf) are zero. One CTA per output row [B * T * Hq].
template <typename scalar_t>
__global__ void merge_splits_kernel(const float* __restrict__ part_out,
                                    const float* __restrict__ part_lse, scalar_t* __restrict__ out,
                                    int64_t rows, int num_splits, int D) {
  const int64_t row = blockIdx.x;
  float M = -INFINITY;
  for (int s = 0; s < num_splits; ++s) M = fmaxf(M, part_lse[s * rows + row]);
  for (int d = threadIdx.x; d < D; d += blockDim.x) {
    float o = 0.f;
    if (M != -INFINITY) {
      float num = 0.f, den = 0.f;
      for (int s = 0; s < num_splits; ++s) {
        const float lse = part_lse[s * rows + row];
        if (lse != -INFINITY) {  // a split without keys wrote no meaningful partial
          const float w = exp2f(lse - M);
          den += w;
          num += w * part_out[(s * rows + row) * D + d];
        }
      }
      o = num / den;
    }
    out[row * D + d] = static_cast<scalar_t>(o);
  }
}

// Splits: enough CTAs for ~2 waves when the (request, head, row tile) grid alone is small,
// each split covering >= kMinSplitKeys positions. Uses shapes and the SM count only.
int64_t choose_chunk(int64_t max_positions, int64_t base_ctas) {
  const int64_t sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
  int64_t splits = base_ctas < 2 * sms ? ceil_div(2 * sms, base_ctas) : 1;
  splits = std::max<int64_t>(1, std::min(splits, ceil_div(max_positions, kMinSplitKeys)));
  const int64_t per_split = ceil_div(max_positions, splits);
  return std::max<int64_t>(kKeyTile, ceil_div(per_split, kKeyTile) * kKeyTile);
}

// Rows per warp of the tiled kernel for head dim D <= kMaxTiledHeadDim (see the header): 8 up
// to DP = 256; for DP = 512 the wider tile when the device's opt-in shared memory holds it for
// this problem's rows, else the narrow one (which fits A100's 163 KB).
int rows_per_warp_for(int64_t D, int64_t rows_per_head) {
  if (D <= 256) return kRowsPerWarp;
  const int64_t rows = std::min<int64_t>(rows_per_head, kWarps * kWideRowsPerWarp);
  const int64_t bytes = int64_t(smem_floats<kMaxTiledHeadDim>(int(rows))) * int64_t(sizeof(float));
  const int64_t max_smem = at::cuda::getCurrentDeviceProperties()->sharedMemPerBlockOptin;
  return bytes <= max_smem ? kWideRowsPerWarp : kNarrowRowsPerWarp;
}

template <typename scalar_t, int DP, int ROWS_PER_WARP>
void launch(const VerifyParams<scalar_t>& p, dim3 grid, cudaStream_t stream) {
  const int smem = smem_floats<DP>(p.rows_alloc) * int(sizeof(float));
  const int max_smem = at::cuda::getCurrentDeviceProperties()->sharedMemPerBlockOptin;
  TORCH_CHECK(smem <= max_smem, "tree_verify (CUDA): needs ", smem,
              " bytes of shared memory per block, the device allows ", max_smem);
  auto kernel = tree_verify_kernel<scalar_t, DP, ROWS_PER_WARP>;
  C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  kernel<<<grid, kThreads, smem, stream>>>(p);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// The tiled kernel for padded head dim DP with the rows per warp the host picked
// (rows_per_warp_for). A template, so `if constexpr` instantiates only the kernels DP uses.
template <typename scalar_t, int DP>
void launch_tiled(const VerifyParams<scalar_t>& p, int rows_per_warp, dim3 grid,
                  cudaStream_t stream) {
  if constexpr (DP <= 256) {
    launch<scalar_t, DP, kRowsPerWarp>(p, grid, stream);
  } else if (rows_per_warp == kWideRowsPerWarp) {
    launch<scalar_t, DP, kWideRowsPerWarp>(p, grid, stream);
  } else {
    launch<scalar_t, DP, kNarrowRowsPerWarp>(p, grid, stream);
  }
}

}  // namespace
}  // namespace cuda

at::Tensor tree_verify_cuda(const at::Tensor& q, const at::Tensor& k_cache,
                            const at::Tensor& v_cache, const at::Tensor& block_table,
                            const at::Tensor& cache_lens, const at::Tensor& num_nodes,
                            const at::Tensor& tree_mask, double sm_scale) {
  using namespace cuda;
  const at::cuda::OptionalCUDAGuard guard(q.device());
  const int64_t B = q.size(0), T = q.size(1), Hq = q.size(2), D = q.size(3);
  const int64_t num_blocks = k_cache.size(0), block_size = k_cache.size(1), Hkv = k_cache.size(2);
  const int64_t max_blocks = block_table.size(1), max_positions = max_blocks * block_size;
  const int64_t rows_total = B * T * Hq;
  TORCH_CHECK(max_positions < (int64_t(1) << 30),
              "tree_verify (CUDA): block_table.size(1) * block_size (the positions a block "
              "table row maps) must be < 2^30, got ",
              max_positions);
  TORCH_CHECK(num_blocks < (int64_t(1) << 31),
              "tree_verify (CUDA): k_cache's num_blocks must be < 2^31, got ", num_blocks);
  TORCH_CHECK(rows_total < (int64_t(1) << 31),
              "tree_verify (CUDA): q's B * T * Hq (query rows) must be < 2^31, got ", rows_total);

  at::Tensor out = at::empty(q.sizes(), q.options());  // contiguous, whatever q's strides
  // Hq = 0 passes the checks (0 is a multiple of Hkv) and, as on CPU, gives an empty output;
  // group_size = 0 would make the grid empty and choose_chunk divide by zero.
  if (out.numel() == 0) return out;
  const int64_t group_size = Hq / Hkv, rows_per_head = T * group_size;

  const bool wide = D > kMaxTiledHeadDim;
  const int rows_per_warp = wide ? 1 : rows_per_warp_for(D, rows_per_head);
  const int64_t rows_per_cta = int64_t(kWarps) * rows_per_warp;
  const int64_t row_tiles = ceil_div(rows_per_head, rows_per_cta);
  // CTAs per split, on gridDim.x: one per (request, kv head, row tile) or, for the wide kernel,
  // one per query row. Both are <= B * T * Hq < 2^31 (row_tiles <= rows_per_head).
  const int64_t base_ctas = wide ? rows_total : B * Hkv * row_tiles;
  const int64_t chunk = choose_chunk(std::max<int64_t>(max_positions, 1), base_ctas);
  const int64_t num_splits = ceil_div(std::max<int64_t>(max_positions, 1), chunk);
  // choose_chunk asks for at most ~2 splits per SM: far below gridDim.y's limit of 65535.
  TORCH_INTERNAL_ASSERT(num_splits <= 65535, "tree_verify (CUDA): ", num_splits, " splits");
  const bool use_scratch = num_splits > 1 || wide;  // the wide kernel always merges
  at::Tensor part_out, part_lse;
  if (use_scratch) {  // scratch sized from shapes only: graph safe
    part_out = at::empty({num_splits, B, T, Hq, D}, q.options().dtype(at::kFloat));
    part_lse = at::empty({num_splits, B, T, Hq}, q.options().dtype(at::kFloat));
  }
  const dim3 grid(static_cast<unsigned>(base_ctas), static_cast<unsigned>(num_splits));
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();

  SPECDEC_DISPATCH_FLOAT_DTYPE(q.scalar_type(), scalar_t, {
    constexpr int kVec = 16 / sizeof(scalar_t);
    // 16-byte loads need every row start aligned: the pointer and each stride.
    const auto aligned = [](const at::Tensor& t) {
      return reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0 && t.stride(0) % kVec == 0 &&
             t.stride(1) % kVec == 0 && t.stride(2) % kVec == 0;
    };
    VerifyParams<scalar_t> p{};
    p.q = q.data_ptr<scalar_t>();
    p.k = k_cache.data_ptr<scalar_t>();
    p.v = v_cache.data_ptr<scalar_t>();
    p.block_table = block_table.data_ptr<int32_t>();
    p.cache_lens = cache_lens.data_ptr<int32_t>();
    p.num_nodes = num_nodes.data_ptr<int32_t>();
    p.tree_mask = reinterpret_cast<const uint64_t*>(tree_mask.data_ptr<int64_t>());
    p.out = out.data_ptr<scalar_t>();
    p.part_out = use_scratch ? part_out.data_ptr<float>() : nullptr;
    p.part_lse = use_scratch ? part_lse.data_ptr<float>() : nullptr;
    p.scale_log2 = float(sm_scale) * kLog2e;
    p.B = int(B), p.T = int(T), p.Hq = int(Hq), p.Hkv = int(Hkv), p.D = int(D);
    p.group_size = int(group_size);
    p.num_blocks = int(num_blocks), p.block_size = int(block_size), p.max_blocks = int(max_blocks);
    p.mask_words = int((T + 63) / 64);
    p.rows_per_head = int(rows_per_head);
    p.row_tiles = int(row_tiles);
    p.rows_alloc = int(std::min<int64_t>(rows_per_head, rows_per_cta));
    p.max_positions = int(max_positions);
    p.chunk = int(chunk), p.num_splits = int(num_splits);
    p.q_sb = q.stride(0), p.q_st = q.stride(1), p.q_sh = q.stride(2);
    p.k_sb = k_cache.stride(0), p.k_sr = k_cache.stride(1), p.k_sh = k_cache.stride(2);
    p.v_sb = v_cache.stride(0), p.v_sr = v_cache.stride(1), p.v_sh = v_cache.stride(2);
    p.vec_ok = D % kVec == 0 && aligned(k_cache) && aligned(v_cache);
    if (wide) {
      tree_verify_wide_kernel<scalar_t><<<grid, kThreads, 0, stream>>>(p);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    } else {
      SPECDEC_DISPATCH_HEAD_DIM(D, DP,
                                { launch_tiled<scalar_t, DP>(p, rows_per_warp, grid, stream); });
    }
    if (use_scratch) {
      const int threads = int(std::min<int64_t>(256, ceil_div(D, kWarpSize) * kWarpSize));
      merge_splits_kernel<scalar_t><<<unsigned(rows_total), threads, 0, stream>>>(
          part_out.data_ptr<float>(), part_lse.data_ptr<float>(), out.data_ptr<scalar_t>(),
          rows_total, int(num_splits), int(D));
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    }
  });
  return out;
}

}  // namespace specdec
