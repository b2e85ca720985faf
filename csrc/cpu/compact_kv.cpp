// compact_kv on CPU: one task per (layer, request, K or V); within a task the accepted
// path is copied in increasing k. Node ids along a root path increase, so the source
// cache_lens + a[k] >= the destination cache_lens + k, and every source is read before
// any later step overwrites it: overlapping moves (e.g. [0, 2, 3]) are safe.
#include <ATen/Parallel.h>

#include <cstring>

#include "ops.h"

namespace specdec {

void compact_kv_cpu(at::Tensor& k_cache, at::Tensor& v_cache, const at::Tensor& block_table,
                    const at::Tensor& cache_lens, const at::Tensor& accepted_nodes,
                    const at::Tensor& num_accepted) {
  const int64_t L = k_cache.size(0), num_blocks = k_cache.size(1), block_size = k_cache.size(2);
  const int64_t row_bytes = k_cache.size(3) * k_cache.size(4) * k_cache.element_size();
  const int64_t B = block_table.size(0), max_blocks = block_table.size(1);
  const int64_t T = accepted_nodes.size(1);
  const int32_t* bt = block_table.data_ptr<int32_t>();
  const int32_t* cl = cache_lens.data_ptr<int32_t>();
  const int32_t* acc = accepted_nodes.data_ptr<int32_t>();
  const int32_t* na = num_accepted.data_ptr<int32_t>();
  char* caches[2] = {static_cast<char*>(k_cache.data_ptr()),
                     static_cast<char*>(v_cache.data_ptr())};

  auto slot = [&](int64_t b, int64_t pos) {  // physical row index within one layer
    return int64_t(bt[b * max_blocks + pos / block_size]) * block_size + pos % block_size;
  };
  at::parallel_for(0, 2 * L * B, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t which = t / (L * B), l = (t / B) % L, b = t % B;
      char* layer = caches[which] + l * num_blocks * block_size * row_bytes;
      const int64_t cache_len = cl[b];        // int64: cache_len + node may pass 2^31 - 1
      for (int64_t k = 1; k <= na[b]; ++k) {  // k = 0 is the root: already in place
        const int64_t src = slot(b, cache_len + acc[b * T + k]), dst = slot(b, cache_len + k);
        if (src != dst) std::memcpy(layer + dst * row_bytes, layer + src * row_bytes, row_bytes);
      }
    }
  });
}

}  // namespace specdec
