// tree_verify on CUDA: flash-decoding over the paged prefix plus the draft tree.
//
// Request b's keys are the logical positions [0, ctx_end), ctx_end = min(cache_lens + n,
// max_blocks * block_size): positions < cache_lens are the prefix (every row attends them),
// position cache_lens + j is tree node j (row i attends it iff bit j of tree_mask[b, i] is
// set). Rows i >= n and rows with no key are zero, as in reference.tree_verify.
//
// Work split: one CTA per (split, kv head h [x row tile], request b). The CTA holds all query
// rows that share KV head h (row r = t * group_size + g <-> node t, query head
// h * group_size + g, group_size = Hq / Hkv: rows_per_head = T * group_size rows; at most
// kRowsPerCta of them per CTA, more rows take more row tiles) so each K/V tile
// loaded into shared memory serves the whole GQA group. A split covers a fixed range of
// chunk positions; the number of splits depends on shapes only (never on cache_lens
// values), so the launch is CUDA-graph safe. With more than one split, each split writes
// its normalised partial output and log-sum-exp to a float scratch and a merge kernel
// combines them; with one split the main kernel writes the output directly.
//
// Inside a CTA, warp w owns rows w, w + 8, w + 16, ... Per key tile of 32 positions:
//   scores: lane = key; the lane's K row is read from shared memory, the warp's Q rows are
//           broadcast reads, so one K load serves all the warp's rows;
//   softmax: online (running max m, running sum l) in the log2 domain, per row, with warp
//           reductions over the 32 keys of the tile;
//   P @ V:  lane = output columns lane, lane + 32, ...; probabilities broadcast from shared.
// q and the caches are read through their strides (int64, in elements; the last dimension is
// contiguous: checks.cpp), so NHD and HND pages, halves of a joint KV tensor, token pools
// (block size 1) and q sliced out of a fused QKV output need no copy. The output is contiguous.
// Accumulation is fp32 for every input dtype. Head dims up to 256 are padded to the next
// of 32 / 64 / 128 / 256 (DP, the template parameter, from SPECDEC_DISPATCH_HEAD_DIM) with
// zeros.
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
constexpr int kRowsPerWarp = 8;
constexpr int kRowsPerCta = kWarps * kRowsPerWarp;
constexpr int kKeyTile = kWarpSize;  // one key per lane in the score phase
constexpr int kMinSplitKeys = 256;   // a split covers at least this many positions

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
  int rows_alloc;              // rows of Q / P in shared memory: min(rows_per_head, kRowsPerCta)
  int max_positions;           // positions a block table row maps: max_blocks * block_size
  int chunk;                   // positions per split (a multiple of kKeyTile)
  int num_splits;
  int64_t q_sb, q_st, q_sh;  // q strides of request, node, head (elements)
  int64_t k_sb, k_sr, k_sh;  // k_cache strides of block, row in block, head
  int64_t v_sb, v_sr, v_sh;  // v_cache strides of block, row in block, head
  bool vec_ok;  // K / V rows can be read with 16-byte loads (D, strides, pointers aligned)
};

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

template <typename scalar_t, int DP>
__global__ void __launch_bounds__(kThreads, DP <= 128 ? 2 : 1)
    tree_verify_kernel(const VerifyParams<scalar_t> p) {
  constexpr int kCols = DP / kWarpSize;  // output columns per lane
  extern __shared__ float4 smem4[];
  float* Qs = reinterpret_cast<float*>(smem4);  // [rows_alloc][DP]
  float* Ps = Qs + p.rows_alloc * DP;           // [rows_alloc][kKeyTile]
  float* Vs = Ps + p.rows_alloc * kKeyTile;     // [kKeyTile][DP]
  float* Ks = Vs + kKeyTile * DP;               // [kKeyTile][DP + 1]

  const int split = blockIdx.x, h = blockIdx.y % p.Hkv, row0 = (blockIdx.y / p.Hkv) * kRowsPerCta;
  const int b = blockIdx.z;
  const int warp = threadIdx.x / kWarpSize, lane = threadIdx.x % kWarpSize;

  const int n = min(max(p.num_nodes[b], 0), p.T);
  const int c = p.cache_lens[b];
  const int64_t tree_end = int64_t(c) + n;  // 64-bit: c may be anything when unvalidated
  const int ctx_end = tree_end <= 0                 ? 0
                      : tree_end >= p.max_positions ? p.max_positions
                                                    : int(tree_end);
  const int kbeg = split * p.chunk;  // max_positions < 2^30 (host check): no int overflow here
  const int kend = min(kbeg + p.chunk, ctx_end);

  // Rows are ordered by node t, so rows with t < n are a prefix:
  // [0, min(rows_per_head, n * group_size)).
  const int rows_cta = min(p.rows_per_head - row0, kRowsPerCta);
  const int rows_live = min(p.rows_per_head, n * p.group_size) - row0;  // may be <= 0
  // Slots i < nrows of this warp (local rows warp + kWarps * i) are live rows.
  const int nrows =
      rows_live > warp ? min(kRowsPerWarp, (rows_live - warp + kWarps - 1) / kWarps) : 0;

  for (int idx = threadIdx.x; idx < rows_cta * DP; idx += kThreads) {
    const int rl = idx / DP, d = idx % DP, r = row0 + rl;
    const int t = r / p.group_size, hq = h * p.group_size + r % p.group_size;
    float x = 0.f;
    if (d < p.D && t < n)
      x = to_float(p.q[int64_t(b) * p.q_sb + int64_t(t) * p.q_st + int64_t(hq) * p.q_sh + d]) *
          p.scale_log2;
    Qs[rl * DP + d] = x;
  }

  float m[kRowsPerWarp], l[kRowsPerWarp], acc[kRowsPerWarp][kCols];
#pragma unroll
  for (int i = 0; i < kRowsPerWarp; ++i) {
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
    float s[kRowsPerWarp];
#pragma unroll
    for (int i = 0; i < kRowsPerWarp; ++i) s[i] = 0.f;
#pragma unroll 4
    for (int d = 0; d < DP; d += 4) {
      const float* kr = Ks + lane * (DP + 1) + d;
      const float k0 = kr[0], k1 = kr[1], k2 = kr[2], k3 = kr[3];
#pragma unroll
      for (int i = 0; i < kRowsPerWarp; ++i) {
        if (i < nrows) {
          const float4 qv = *reinterpret_cast<const float4*>(Qs + (warp + kWarps * i) * DP + d);
          s[i] += qv.x * k0 + qv.y * k1 + qv.z * k2 + qv.w * k3;
        }
      }
    }

    // Mask, online softmax update, probabilities to shared memory.
    const int pos = p0 + lane;
#pragma unroll
    for (int i = 0; i < kRowsPerWarp; ++i) {
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
      float4 pv[kRowsPerWarp];
#pragma unroll
      for (int i = 0; i < kRowsPerWarp; ++i) {
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
          for (int i = 0; i < kRowsPerWarp; ++i) {
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
  for (int i = 0; i < kRowsPerWarp; ++i) {
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

template <typename scalar_t, int DP>
void launch(VerifyParams<scalar_t> p, dim3 grid, cudaStream_t stream) {
  const int smem = smem_floats<DP>(p.rows_alloc) * int(sizeof(float));
  const int max_smem = at::cuda::getCurrentDeviceProperties()->sharedMemPerBlockOptin;
  TORCH_CHECK(smem <= max_smem, "tree_verify (CUDA): needs ", smem,
              " bytes of shared memory per block, the device allows ", max_smem);
  auto kernel = tree_verify_kernel<scalar_t, DP>;
  C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  kernel<<<grid, kThreads, smem, stream>>>(p);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
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
  const int64_t group_size = Hq / Hkv, rows_per_head = T * group_size;
  TORCH_CHECK(D <= 256, "tree_verify (CUDA): head dim D must be <= 256, got ", D);
  const int64_t row_tiles = ceil_div(rows_per_head, kRowsPerCta);
  TORCH_CHECK(B <= 65535 && Hkv * row_tiles <= 65535, "tree_verify (CUDA): grid too large (B = ", B,
              ", Hkv = ", Hkv, ", T * Hq / Hkv = ", rows_per_head, ")");
  TORCH_CHECK(max_positions < (int64_t(1) << 30) && num_blocks < (int64_t(1) << 31) &&
                  B * T * Hq < (int64_t(1) << 31),
              "tree_verify (CUDA): sizes too large");

  at::Tensor out = at::empty(q.sizes(), q.options());  // contiguous, whatever q's strides
  const int64_t chunk = choose_chunk(std::max<int64_t>(max_positions, 1), B * Hkv * row_tiles);
  const int64_t num_splits = ceil_div(std::max<int64_t>(max_positions, 1), chunk);
  at::Tensor part_out, part_lse;
  if (num_splits > 1) {  // scratch sized from shapes only: graph safe
    part_out = at::empty({num_splits, B, T, Hq, D}, q.options().dtype(at::kFloat));
    part_lse = at::empty({num_splits, B, T, Hq}, q.options().dtype(at::kFloat));
  }
  const dim3 grid(unsigned(num_splits), unsigned(Hkv * row_tiles), unsigned(B));
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
    p.part_out = num_splits > 1 ? part_out.data_ptr<float>() : nullptr;
    p.part_lse = num_splits > 1 ? part_lse.data_ptr<float>() : nullptr;
    p.scale_log2 = float(sm_scale) * kLog2e;
    p.B = int(B), p.T = int(T), p.Hq = int(Hq), p.Hkv = int(Hkv), p.D = int(D);
    p.group_size = int(group_size);
    p.num_blocks = int(num_blocks), p.block_size = int(block_size), p.max_blocks = int(max_blocks);
    p.mask_words = int((T + 63) / 64);
    p.rows_per_head = int(rows_per_head);
    p.rows_alloc = int(std::min<int64_t>(rows_per_head, kRowsPerCta));
    p.max_positions = int(max_positions);
    p.chunk = int(chunk), p.num_splits = int(num_splits);
    p.q_sb = q.stride(0), p.q_st = q.stride(1), p.q_sh = q.stride(2);
    p.k_sb = k_cache.stride(0), p.k_sr = k_cache.stride(1), p.k_sh = k_cache.stride(2);
    p.v_sb = v_cache.stride(0), p.v_sr = v_cache.stride(1), p.v_sh = v_cache.stride(2);
    p.vec_ok = D % kVec == 0 && aligned(k_cache) && aligned(v_cache);
    SPECDEC_DISPATCH_HEAD_DIM(D, DP, { launch<scalar_t, DP>(p, grid, stream); });
    if (num_splits > 1) {
      const int64_t rows = B * T * Hq;
      const int threads = int(std::min<int64_t>(256, ceil_div(D, kWarpSize) * kWarpSize));
      merge_splits_kernel<scalar_t><<<unsigned(rows), threads, 0, stream>>>(
          part_out.data_ptr<float>(), part_lse.data_ptr<float>(), out.data_ptr<scalar_t>(), rows,
          int(num_splits), int(D));
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    }
  });
  return out;
}

}  // namespace specdec
