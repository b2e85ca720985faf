// compact_kv on CUDA: one launch for every layer, K and V, and request.
//
// CTA (b, layer, K-or-V) moves the accepted path of request b in that layer's cache (requests
// on gridDim.x; layers on gridDim.y, at most 65535 of them, so a CTA loops over the layers
// layer, layer + gridDim.y, ... and any L works);
// its threads split a cache row (Hkv * D elements) into fixed columns, and each thread
// copies its columns for k = 0, 1, ..., num_accepted in increasing order. Node ids along a
// root path increase, so source cache_lens + a[k] >= destination cache_lens + k and no
// source is ever an earlier step's destination: a thread always reads a value before
// anything overwrites it, and threads never touch each other's columns, so overlapping
// moves (e.g. path [0, 2, 3]) are safe without any barrier.
// Every position and block id is bounds-checked; a step that would leave the cache is skipped.
// The caches are addressed through their strides (layer, block, row in block, head; the last
// dimension contiguous, K and V not overlapping: checks.cpp), so NHD and HND pages, halves of
// a joint KV tensor and token pools (block size 1) move in place; with adjacent heads
// (head stride = D) the row is one contiguous run, as before.
#include "cuda/common.cuh"
#include "dispatch.h"
#include "ops.h"

namespace specdec {
namespace cuda {
namespace {

constexpr int64_t kMaxGridY = 65535;  // gridDim.y limit: more layers are looped over

// Strides of one cache, in bytes before launch() and in units after:
// layer, block, row in block, head.
struct Strides {
  int64_t layer, block, row, head;
};

struct CompactParams {
  void* k;
  void* v;
  const int32_t* block_table;     // [B, max_blocks]
  const int32_t* cache_lens;      // [B]
  const int32_t* accepted_nodes;  // [B, T]
  const int32_t* num_accepted;    // [B]
  Strides ks, vs;                 // strides of k and v
  int head_units;                 // units per head (D elements)
  int row_units;                  // units per cache row (one position: Hkv * D elements)
  int num_blocks, block_size;     // cache blocks, positions per block
  int max_blocks;                 // block table entries per request
  int T;
  int64_t L;  // layers
};

// Offset (in units, within one layer) of logical position pos of request b, or -1 if unmapped.
__device__ __forceinline__ int64_t physical_row(const CompactParams& p, const Strides& s, int b,
                                                int64_t pos) {
  if (pos < 0 || pos >= int64_t(p.max_blocks) * p.block_size) return -1;
  const int blk = p.block_table[int64_t(b) * p.max_blocks + pos / p.block_size];
  if (blk < 0 || blk >= p.num_blocks) return -1;
  return int64_t(blk) * s.block + (pos % p.block_size) * s.row;
}

// Unit: the widest load/store the row size and the cache alignment allow (uint4 = 16 bytes,
// picked by SPECDEC_DISPATCH_VEC_BYTES).
template <typename Unit>
__global__ void compact_kv_kernel(const CompactParams p) {
  const int b = blockIdx.x;
  const Strides& s = blockIdx.z == 0 ? p.ks : p.vs;
  const int m = min(max(p.num_accepted[b], 0), p.T - 1);
  const int64_t c = p.cache_lens[b];
  // The same moves in every layer this CTA covers, each on that layer's cache.
  for (int64_t layer = blockIdx.y; layer < p.L; layer += gridDim.y) {
    Unit* cache = static_cast<Unit*>(blockIdx.z == 0 ? p.k : p.v) + layer * s.layer;
    for (int k = 0; k <= m; ++k) {
      const int a = p.accepted_nodes[int64_t(b) * p.T + k];
      if (a == k) continue;  // already in place (the root always is)
      const int64_t src = physical_row(p, s, b, c + a), dst = physical_row(p, s, b, c + k);
      if (src < 0 || dst < 0) continue;
      const Unit* from = cache + src;
      Unit* to = cache + dst;
      for (int e = threadIdx.x; e < p.row_units; e += blockDim.x) {
        const int64_t off = int64_t(e / p.head_units) * s.head + e % p.head_units;
        to[off] = from[off];
      }
    }
  }
}

template <typename Unit>
void launch(const CompactParams& base, int64_t head_bytes, int64_t Hkv, int64_t B) {
  CompactParams p = base;
  p.head_units = int(head_bytes / sizeof(Unit));
  p.row_units = int(Hkv * p.head_units);
  for (Strides* s : {&p.ks, &p.vs}) {  // bytes -> units (the unit divides every stride)
    s->layer /= int64_t(sizeof(Unit));
    s->block /= int64_t(sizeof(Unit));
    s->row /= int64_t(sizeof(Unit));
    s->head /= int64_t(sizeof(Unit));
  }
  const int threads = int(std::min<int64_t>(256, ceil_div(p.row_units, kWarpSize) * kWarpSize));
  const dim3 grid(unsigned(B), unsigned(std::min<int64_t>(p.L, kMaxGridY)), 2);
  compact_kv_kernel<Unit><<<grid, threads, 0, at::cuda::getCurrentCUDAStream()>>>(p);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

Strides strides_bytes(const at::Tensor& t) {  // t: [L, num_blocks, block_size, Hkv, D]
  const int64_t e = t.element_size();
  return {t.stride(0) * e, t.stride(1) * e, t.stride(2) * e, t.stride(3) * e};
}

}  // namespace
}  // namespace cuda

void compact_kv_cuda(at::Tensor& k_cache, at::Tensor& v_cache, const at::Tensor& block_table,
                     const at::Tensor& cache_lens, const at::Tensor& accepted_nodes,
                     const at::Tensor& num_accepted) {
  const at::cuda::OptionalCUDAGuard guard(k_cache.device());
  const int64_t L = k_cache.size(0), num_blocks = k_cache.size(1), block_size = k_cache.size(2);
  const int64_t Hkv = k_cache.size(3), head_bytes = k_cache.size(4) * k_cache.element_size();
  const int64_t row_bytes = Hkv * head_bytes;
  const int64_t B = block_table.size(0), max_blocks = block_table.size(1);
  const int64_t T = accepted_nodes.size(1);
  // An empty batch, cache or row (B, L, Hkv or D = 0) moves nothing: no launch, whose grid
  // dimension would be 0.
  if (B == 0 || L == 0 || row_bytes == 0) return;
  TORCH_CHECK(B < (int64_t(1) << 31),
              "compact_kv (CUDA): the batch size B of block_table must be < 2^31, got ", B);
  TORCH_CHECK(row_bytes < (int64_t(1) << 31) && num_blocks < (int64_t(1) << 31) &&
                  block_size < (int64_t(1) << 31) && max_blocks < (int64_t(1) << 31),
              "compact_kv (CUDA): cache dimensions too large");

  cuda::CompactParams p{k_cache.data_ptr(),
                        v_cache.data_ptr(),
                        block_table.data_ptr<int32_t>(),
                        cache_lens.data_ptr<int32_t>(),
                        accepted_nodes.data_ptr<int32_t>(),
                        num_accepted.data_ptr<int32_t>(),
                        cuda::strides_bytes(k_cache),
                        cuda::strides_bytes(v_cache),
                        0,
                        0,
                        int(num_blocks),
                        int(block_size),
                        int(max_blocks),
                        int(T),
                        L};
  // The widest unit that divides the head size, every stride and the alignment of both caches.
  uintptr_t align = reinterpret_cast<uintptr_t>(k_cache.data_ptr()) |
                    reinterpret_cast<uintptr_t>(v_cache.data_ptr()) | uintptr_t(head_bytes);
  for (const cuda::Strides& s : {p.ks, p.vs}) {
    align |= uintptr_t(s.layer) | uintptr_t(s.block) | uintptr_t(s.row) | uintptr_t(s.head);
  }
  SPECDEC_DISPATCH_VEC_BYTES(align, Unit, { cuda::launch<Unit>(p, head_bytes, Hkv, B); });
}

}  // namespace specdec
