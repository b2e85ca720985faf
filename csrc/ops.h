// Kernel entry points of the specdec ops, one set per backend.
//
// The schemas live in ops.cpp (the only place the contract is written in C++);
// every entry point below is called from there after the shared input checks of
// checks.h have passed, so kernels may assume well-formed inputs:
//   * index tensors (parents, num_nodes, cache_lens, block_table, top_k,
//     draft_tokens, accepted_nodes, num_accepted) are contiguous int32,
//   * float parameters (temperature, top_p, uniforms) are contiguous float32,
//   * logits / draft_probs are contiguous,
//   * q and the K/V caches are views with a contiguous last dimension and non-negative
//     strides (check_layout); the kernels read (compact_kv: write) them through their
//     strides, and compact_kv's K and V do not overlap in memory. tree_verify's output is
//     a new contiguous [B, T, Hq, D] tensor.
#pragma once

#include <torch/types.h>

#include <optional>
#include <tuple>

namespace specdec {

// ---- CPU (csrc/cpu/*.cpp) ----
std::tuple<at::Tensor, at::Tensor> build_tree_mask_cpu(const at::Tensor& parents,
                                                       const at::Tensor& num_nodes);

at::Tensor tree_verify_cpu(const at::Tensor& q, const at::Tensor& k_cache,
                           const at::Tensor& v_cache, const at::Tensor& block_table,
                           const at::Tensor& cache_lens, const at::Tensor& num_nodes,
                           const at::Tensor& tree_mask, double sm_scale);

std::tuple<at::Tensor, at::Tensor, at::Tensor> tree_rejection_sample_cpu(
    const at::Tensor& target_logits, const at::Tensor& draft_tokens, const at::Tensor& parents,
    const at::Tensor& num_nodes, const std::optional<at::Tensor>& draft_probs,
    const at::Tensor& temperature, const at::Tensor& top_k, const at::Tensor& top_p,
    const at::Tensor& uniforms);

// k_cache / v_cache are always [L, num_blocks, block_size, Hkv, D] here.
void compact_kv_cpu(at::Tensor& k_cache, at::Tensor& v_cache, const at::Tensor& block_table,
                    const at::Tensor& cache_lens, const at::Tensor& accepted_nodes,
                    const at::Tensor& num_accepted);

// ---- CPU decode-path layer ops (csrc/cpu/layer_ops.cpp; CPU only) ----
// -> (x + residual, or undefined without residual; rms_norm of it). Inputs any strides.
std::tuple<at::Tensor, at::Tensor> rms_norm_cpu(const at::Tensor& x,
                                                const std::optional<at::Tensor>& residual,
                                                const at::Tensor& weight, double eps);

std::tuple<at::Tensor, at::Tensor, at::Tensor> rope_qkv_cpu(const at::Tensor& qkv,
                                                            const at::Tensor& cos,
                                                            const at::Tensor& sin,
                                                            int64_t num_q_heads,
                                                            int64_t num_kv_heads);

at::Tensor silu_and_mul_cpu(const at::Tensor& x);
// a + b (same shape and dtype), rounded as ATen's add; the decode layer's residual.
at::Tensor add_cpu(const at::Tensor& a, const at::Tensor& b);

// x [..., K] (bf16) @ the weight [out_features, K] laid out as tiles [ceil(out_features / 64),
// K / 2, 64, 2] (+ bias) -> [..., out_features] bf16 (csrc/cpu/tiled_linear.cpp).
at::Tensor tiled_linear_cpu(const at::Tensor& x, const at::Tensor& weight_tiles,
                            int64_t out_features, const std::optional<at::Tensor>& bias);

// One decoder layer of a decode / verify step (csrc/cpu/decode_layer.cpp); the index tensors
// as tree_verify_cpu takes them. Writes the new tokens' K/V into k_cache / v_cache at rows.
at::Tensor decode_layer_cpu(const at::Tensor& x,
                            const std::optional<at::Tensor>& attention_norm_weight,
                            const at::Tensor& ffn_norm_weight, double eps, const at::Tensor& wqkv,
                            const std::optional<at::Tensor>& wqkv_bias, const at::Tensor& wo,
                            const at::Tensor& w13, const at::Tensor& w2, bool prepacked,
                            const at::Tensor& cos, const at::Tensor& sin, int64_t num_q_heads,
                            int64_t num_kv_heads, at::Tensor& k_cache, at::Tensor& v_cache,
                            const at::Tensor& rows, const std::optional<at::Tensor>& picked,
                            bool packed, const at::Tensor& block_table,
                            const at::Tensor& cache_lens, const at::Tensor& num_nodes,
                            const at::Tensor& tree_mask, double sm_scale, int64_t start);

// decode_layer_cpu for layers first_layer .. first_layer + len(wqkv) - 1 in turn, layer i's
// K/V into k_cache[first_layer + i] / v_cache[...] ([num_layers, num_blocks, block_size, Hkv,
// D]); the index tensors as tree_verify_cpu takes them.
at::Tensor decode_layers_cpu(const at::Tensor& x, at::TensorList attention_norm_weights,
                             at::TensorList ffn_norm_weights, double eps, at::TensorList wqkv,
                             const c10::List<std::optional<at::Tensor>>& wqkv_bias,
                             at::TensorList wo, at::TensorList w13, at::TensorList w2,
                             bool prepacked, const at::Tensor& cos, const at::Tensor& sin,
                             int64_t num_q_heads, int64_t num_kv_heads, at::Tensor& k_cache,
                             at::Tensor& v_cache, int64_t first_layer, const at::Tensor& rows,
                             const std::optional<at::Tensor>& picked, bool packed,
                             const at::Tensor& block_table, const at::Tensor& cache_lens,
                             const at::Tensor& num_nodes, const at::Tensor& tree_mask,
                             double sm_scale);

#ifdef SPECDEC_WITH_CUDA
// ---- CUDA (csrc/cuda/*.cu), same contracts ----
std::tuple<at::Tensor, at::Tensor> build_tree_mask_cuda(const at::Tensor& parents,
                                                        const at::Tensor& num_nodes);

at::Tensor tree_verify_cuda(const at::Tensor& q, const at::Tensor& k_cache,
                            const at::Tensor& v_cache, const at::Tensor& block_table,
                            const at::Tensor& cache_lens, const at::Tensor& num_nodes,
                            const at::Tensor& tree_mask, double sm_scale);

std::tuple<at::Tensor, at::Tensor, at::Tensor> tree_rejection_sample_cuda(
    const at::Tensor& target_logits, const at::Tensor& draft_tokens, const at::Tensor& parents,
    const at::Tensor& num_nodes, const std::optional<at::Tensor>& draft_probs,
    const at::Tensor& temperature, const at::Tensor& top_k, const at::Tensor& top_p,
    const at::Tensor& uniforms);

void compact_kv_cuda(at::Tensor& k_cache, at::Tensor& v_cache, const at::Tensor& block_table,
                     const at::Tensor& cache_lens, const at::Tensor& accepted_nodes,
                     const at::Tensor& num_accepted);
#endif

}  // namespace specdec
