// build_tree_mask on CPU: one task per request; a node's row is its parent's row plus its own bit.
#include <ATen/Parallel.h>

#include <cstring>

#include "ops.h"

namespace specdec {

std::tuple<at::Tensor, at::Tensor> build_tree_mask_cpu(const at::Tensor& parents,
                                                       const at::Tensor& num_nodes) {
  const int64_t B = parents.size(0), T = parents.size(1), mask_words = (T + 63) / 64;
  at::Tensor mask = at::zeros({B, T, mask_words}, parents.options().dtype(at::kLong));
  at::Tensor depth = at::zeros({B, T}, parents.options().dtype(at::kInt));
  const int32_t* par = parents.data_ptr<int32_t>();
  const int32_t* nn = num_nodes.data_ptr<int32_t>();
  uint64_t* mk = reinterpret_cast<uint64_t*>(mask.data_ptr<int64_t>());
  int32_t* dp = depth.data_ptr<int32_t>();
  at::parallel_for(0, B, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      uint64_t* rows = mk + b * T * mask_words;
      for (int64_t i = 0; i < nn[b]; ++i) {
        const int32_t p = par[b * T + i];
        if (p >= 0) {  // parents precede children, so row p is final
          std::memcpy(rows + i * mask_words, rows + p * mask_words, mask_words * sizeof(uint64_t));
          dp[b * T + i] = dp[b * T + p] + 1;
        }
        rows[i * mask_words + i / 64] |= uint64_t(1) << (i % 64);
      }
    }
  });
  return {mask, depth};
}

}  // namespace specdec
