#include "ops.h"
namespace specdec {
at::Tensor tree_verify_cpu(const at::Tensor& q, const at::Tensor& k_cache,
                           const at::Tensor& v_cache, const at::Tensor& block_table,
                           const at::Tensor& cache_lens, const at::Tensor& num_nodes,
                           const at::Tensor& tree_mask, double sm_scale) {
  TORCH_CHECK(false, "tree_verify CPU kernel: TODO");
}
}  // namespace specdec
