// compact_kv on CPU: one task per (layer, request, K or V); within a task the accepted
// path is copied in increasing k. Node ids along a root path increase, so the source
// cache_lens + a[k] >= the destination cache_lens + k, and every source is read before
// any later step overwrites it: overlapping moves (e.g. [0, 2, 3]) are safe.
//
// The caches are written through their strides (checks.cpp: last dimension contiguous,
// no overlap within or between K and V): one memcpy of the Hkv * D row when the heads of a
// row are adjacent (NHD pages), else one of D elements per head (HND pages).
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstring>

#include "ops.h"

namespace specdec {
namespace {

// One cache's layout, in bytes: strides of layer, block, row in block and head.
struct Layout {
  char* data;
  int64_t layer, block, row, head;
  explicit Layout(const at::Tensor& t)
      : data(static_cast<char*>(t.data_ptr())),
        layer(t.stride(0) * t.element_size()),
        block(t.stride(1) * t.element_size()),
        row(t.stride(2) * t.element_size()),
        head(t.stride(3) * t.element_size()) {}
};

// Copies n bytes of one head (D elements, typically 128-512 bytes): 64-byte chunks of known
// size compile to vector moves, without the call of a memcpy per head (the HND path makes
// Hkv of them per row).
inline void copy_head(char* dst, const char* src, int64_t n) {
  if (n % 64 != 0) {
    std::memcpy(dst, src, n);
    return;
  }
  for (int64_t i = 0; i < n; i += 64) __builtin_memcpy(dst + i, src + i, 64);
}

}  // namespace

void compact_kv_cpu(at::Tensor& k_cache, at::Tensor& v_cache, const at::Tensor& block_table,
                    const at::Tensor& cache_lens, const at::Tensor& accepted_nodes,
                    const at::Tensor& num_accepted) {
  const int64_t L = k_cache.size(0), block_size = k_cache.size(2), Hkv = k_cache.size(3);
  const int64_t head_bytes = k_cache.size(4) * k_cache.element_size();
  const int64_t B = block_table.size(0), max_blocks = block_table.size(1);
  const int64_t T = accepted_nodes.size(1);
  const int32_t* bt = block_table.data_ptr<int32_t>();
  const int32_t* cl = cache_lens.data_ptr<int32_t>();
  const int32_t* acc = accepted_nodes.data_ptr<int32_t>();
  const int32_t* na = num_accepted.data_ptr<int32_t>();
  const Layout caches[2] = {Layout(k_cache), Layout(v_cache)};

  at::parallel_for(0, 2 * L * B, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t which = t / (L * B), l = (t / B) % L, b = t % B;
      const Layout& c = caches[which];
      char* layer = c.data + l * c.layer;
      // Heads adjacent (or a single head): the whole row is one contiguous run.
      const bool whole_row = Hkv == 1 || c.head == head_bytes;
      const auto row = [&](int64_t pos) {  // byte offset of logical position pos in the layer
        return int64_t(bt[b * max_blocks + pos / block_size]) * c.block +
               (pos % block_size) * c.row;
      };
      const int64_t cache_len = cl[b];  // int64: cache_len + node may pass 2^31 - 1
      // Positions in chunks of kChunk: their offsets are computed once (two divisions
      // each); with heads apart (HND) the chunk is then copied head by head, so that the
      // rows of consecutive positions (D elements apart within a block) are written one
      // after the other. Per head the order stays increasing in k: overlapping moves are safe
      // (heads never share memory: checks.cpp).
      constexpr int64_t kChunk = 64;
      int64_t src[kChunk], dst[kChunk];
      for (int64_t k0 = 1; k0 <= na[b]; k0 += kChunk) {  // k = 0 is the root: in place
        const int64_t n = std::min(kChunk, na[b] - k0 + 1);
        for (int64_t i = 0; i < n; ++i) {
          src[i] = row(cache_len + acc[b * T + k0 + i]);
          dst[i] = row(cache_len + k0 + i);
        }
        if (whole_row) {
          for (int64_t i = 0; i < n; ++i) {
            if (src[i] != dst[i]) std::memcpy(layer + dst[i], layer + src[i], Hkv * head_bytes);
          }
          continue;
        }
        for (int64_t h = 0; h < Hkv; ++h) {
          char* plane = layer + h * c.head;
          for (int64_t i = 0; i < n; ++i) {
            if (src[i] != dst[i]) copy_head(plane + dst[i], plane + src[i], head_bytes);
          }
        }
      }
    }
  });
}

}  // namespace specdec
