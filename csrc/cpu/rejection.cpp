#include "ops.h"
namespace specdec {
std::tuple<at::Tensor, at::Tensor, at::Tensor> tree_rejection_sample_cpu(
    const at::Tensor& target_logits, const at::Tensor& draft_tokens,
    const at::Tensor& parents, const at::Tensor& num_nodes,
    const std::optional<at::Tensor>& draft_probs, const at::Tensor& temperature,
    const at::Tensor& top_k, const at::Tensor& top_p, const at::Tensor& uniforms) {
  TORCH_CHECK(false, "tree_rejection_sample CPU kernel: TODO");
}
}  // namespace specdec
