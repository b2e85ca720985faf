// One Llama decoder layer of a decode / verify step on the CPU, in one call:
//
//   h = rms_norm(x) -> qkv = h @ wqkv (+ bias) -> rope_qkv -> K/V into the cache rows
//     -> tree_verify over the paged cache -> attn = out @ wo
//     -> (x + attn, rms_norm(x + attn)) -> silu_and_mul(. @ w13) @ w2 -> x + attn + that
//
// Why: at decode sizes (1-64 rows) the eager block is ~12 Python-level calls (modules, the
// weight-packing checks, views, the cache write's index ops), measured at ~190 us of a ~1.2 ms
// bf16 layer on this project's CPU: more than the layer's elementwise arithmetic. Here the
// same kernels run back to back from C++ (the specdec layer ops and tree_verify, ATen's
// index_copy_ / add, and oneDNN's prepacked linear through the dispatcher), so the result is
// bitwise the eager block's (TransformerBlock.forward with the layer ops and PackedLinear):
// the same ops on the same inputs in the same order.
//
// The linears take plain [out, in] weights through at::linear, or when `prepacked` each
// either oneDNN's prepacked weight (mkldnn._reorder_linear_weight) or tiles
// (pack_linear_tiles, through tiled_linear_cpu), as PackedLinear picks them.
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/record_function.h>

#include "checks.h"
#include "ops.h"

namespace specdec {
namespace {

// x @ weight^T (+ bias) -> [..., out_features], the weight in any of its layouts: tiles
// (4-D), or mkldnn::_linear_pointwise(X, W, B, attr, scalars, algorithm), oneDNN's linear over a
// weight reordered once by mkldnn::_reorder_linear_weight (what PackedLinear calls from Python).
at::Tensor linear(const at::Tensor& x, const at::Tensor& weight,
                  const std::optional<at::Tensor>& bias, bool prepacked, int64_t out_features) {
  if (!prepacked) return at::linear(x, weight, bias);
  if (is_weight_tiles(weight)) {
    // called directly (no dispatch), named for the profiler as oneDNN's call is by its op
    RECORD_FUNCTION("specdec::tiled_linear", std::vector<c10::IValue>());
    return tiled_linear_cpu(x, weight, out_features, bias);
  }
  static const auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("mkldnn::_linear_pointwise", "")
          .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&,
                            c10::string_view, c10::List<std::optional<c10::Scalar>>,
                            std::optional<c10::string_view>)>();
  const at::Tensor y = op.call(x.reshape({-1, x.size(-1)}), weight, bias, "none",
                               c10::List<std::optional<c10::Scalar>>(), c10::string_view(""));
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = y.size(-1);
  return y.view(shape);
}

}  // namespace

at::Tensor decode_layer_cpu(const at::Tensor& x, const at::Tensor& attention_norm_weight,
                            const at::Tensor& ffn_norm_weight, double eps, const at::Tensor& wqkv,
                            const std::optional<at::Tensor>& wqkv_bias, const at::Tensor& wo,
                            const at::Tensor& w13, const at::Tensor& w2, bool prepacked,
                            const at::Tensor& cos, const at::Tensor& sin, int64_t num_q_heads,
                            int64_t num_kv_heads, at::Tensor& k_cache, at::Tensor& v_cache,
                            const at::Tensor& rows, const std::optional<at::Tensor>& picked,
                            bool packed, const at::Tensor& block_table,
                            const at::Tensor& cache_lens, const at::Tensor& num_nodes,
                            const at::Tensor& tree_mask, double sm_scale) {
  const int64_t B = x.size(0), M = x.size(1);
  const at::Tensor h = std::get<1>(rms_norm_cpu(x, std::nullopt, attention_norm_weight, eps));
  const int64_t D = cos.size(-1), dim = x.size(-1);
  const int64_t hidden = weight_in_features(w2);
  const at::Tensor qkv =
      linear(h, wqkv, wqkv_bias, prepacked, (num_q_heads + 2 * num_kv_heads) * D);
  auto [q, k, v] = rope_qkv_cpu(qkv, cos, sin, num_q_heads, num_kv_heads);

  // K/V of the new tokens into their cache rows (PagedKVCache.write_rows).
  at::Tensor k_rows = k.reshape({-1, num_kv_heads, D});
  at::Tensor v_rows = v.reshape({-1, num_kv_heads, D});
  if (picked.has_value() && !packed) {
    k_rows = k_rows.index_select(0, *picked);
    v_rows = v_rows.index_select(0, *picked);
  }
  k_cache.view({-1, num_kv_heads, D}).index_copy_(0, rows, k_rows.to(k_cache.scalar_type()));
  v_cache.view({-1, num_kv_heads, D}).index_copy_(0, rows, v_rows.to(v_cache.scalar_type()));

  at::Tensor out;
  if (packed) {  // x holds the real nodes only: queries laid out as the padded trees
    const int64_t tree_batch = tree_mask.size(0), T = tree_mask.size(1);
    const at::Tensor q_tree =
        at::zeros({tree_batch * T, num_q_heads, D}, q.options()).index_copy_(0, *picked, q[0]);
    out = tree_verify_cpu(q_tree.view({tree_batch, T, num_q_heads, D}), k_cache, v_cache,
                          block_table, cache_lens, num_nodes, tree_mask, sm_scale)
              .reshape({tree_batch * T, num_q_heads, D})
              .index_select(0, *picked)
              .unsqueeze(0);
  } else {
    out = tree_verify_cpu(q, k_cache, v_cache, block_table, cache_lens, num_nodes, tree_mask,
                          sm_scale);
  }
  const at::Tensor attn = linear(out.reshape({B, M, -1}), wo, std::nullopt, prepacked, dim);
  auto [sum, normed] = rms_norm_cpu(x, attn, ffn_norm_weight, eps);
  const at::Tensor gate_up = linear(normed, w13, std::nullopt, prepacked, 2 * hidden);
  return at::add(sum, linear(silu_and_mul_cpu(gate_up), w2, std::nullopt, prepacked, dim));
}

}  // namespace specdec
