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
// index_copy_, and oneDNN's prepacked linear through the dispatcher; the last residual add
// as a plain loop rounded as ATen's add), so the result is bitwise the eager block's
// (TransformerBlock.forward with the layer ops and PackedLinear): the same arithmetic on the
// same inputs in the same order.
//
// decode_layers runs a run of layers (a verify step's 30 blocks) in one call: the Python loop
// over the blocks and each block's dispatch and step checks (~40 us a layer) go.
//
// The linears take plain [out, in] weights through at::linear, or when `prepacked` each
// either oneDNN's prepacked weight (mkldnn._reorder_linear_weight) or tiles
// (pack_linear_tiles, through tiled_linear_cpu), as PackedLinear picks them.
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/record_function.h>

#include <cstring>

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

// cache [num_blocks, block_size, Hkv, D] row rows[i] = src[i] (src [N, Hkv, D]):
// PagedKVCache.write_rows' index_copy_, as plain row copies when the dtypes match and both are
// contiguous (index_copy_'s TensorIterator set-up was ~6 us per call, two calls per layer, for a
// few hundred bytes). Every row is bounds-checked first, so nothing is written on a bad one.
void write_cache_rows(at::Tensor& cache, const at::Tensor& rows, const at::Tensor& src) {
  const int64_t num_kv_heads = src.size(1), D = src.size(2);
  at::Tensor flat = cache.view({-1, num_kv_heads, D});
  if (src.scalar_type() != cache.scalar_type() || !src.is_contiguous() || !cache.is_contiguous() ||
      rows.scalar_type() != at::kLong || !rows.is_contiguous()) {
    flat.index_copy_(0, rows, src.to(cache.scalar_type()));
    return;
  }
  const int64_t n = rows.size(0), num_rows = flat.size(0);
  TORCH_CHECK(src.size(0) == n, "write_cache_rows: ", n, " rows for ", src.size(0), " tokens");
  const int64_t* row = rows.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i) {
    TORCH_CHECK(row[i] >= 0 && row[i] < num_rows, "rows[", i, "] = ", row[i],
                " is outside the cache's ", num_rows, " rows");
  }
  const int64_t row_bytes = num_kv_heads * D * static_cast<int64_t>(src.element_size());
  const char* from = static_cast<const char*>(src.data_ptr());
  char* to = static_cast<char*>(flat.data_ptr());
  for (int64_t i = 0; i < n; ++i)
    std::memcpy(to + row[i] * row_bytes, from + i * row_bytes, row_bytes);
}

}  // namespace

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
                            const at::Tensor& tree_mask, double sm_scale, int64_t start) {
  const int64_t B = x.size(0), M = x.size(1);
  // no input norm: an EAGLE-1/2 head's layer (its attention_norm is the identity)
  const at::Tensor h = attention_norm_weight.has_value()
                           ? std::get<1>(rms_norm_cpu(x, std::nullopt, *attention_norm_weight, eps))
                           : x;
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
  write_cache_rows(k_cache, rows, k_rows);
  write_cache_rows(v_cache, rows, v_rows);

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
  } else if (M != tree_mask.size(1)) {  // nodes start..start+M-1 (a head's draft level)
    const int64_t T = tree_mask.size(1);
    at::Tensor q_tree = at::zeros({B, T, num_q_heads, D}, q.options());
    q_tree.narrow(1, start, M).copy_(q);
    out = tree_verify_cpu(q_tree, k_cache, v_cache, block_table, cache_lens, num_nodes, tree_mask,
                          sm_scale)
              .narrow(1, start, M);
  } else {
    out = tree_verify_cpu(q, k_cache, v_cache, block_table, cache_lens, num_nodes, tree_mask,
                          sm_scale);
  }
  const at::Tensor attn = linear(out.reshape({B, M, -1}), wo, std::nullopt, prepacked, dim);
  auto [sum, normed] = rms_norm_cpu(x, attn, ffn_norm_weight, eps);
  const at::Tensor gate_up = linear(normed, w13, std::nullopt, prepacked, 2 * hidden);
  // the residual as a plain loop: at::add's TensorIterator set-up is ~1-2 us a layer
  return add_cpu(sum, linear(silu_and_mul_cpu(gate_up), w2, std::nullopt, prepacked, dim));
}

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
                             double sm_scale) {
  at::Tensor h = x;
  for (size_t i = 0; i < wqkv.size(); ++i) {
    at::Tensor k_layer = k_cache.select(0, first_layer + static_cast<int64_t>(i));
    at::Tensor v_layer = v_cache.select(0, first_layer + static_cast<int64_t>(i));
    h = decode_layer_cpu(h, attention_norm_weights[i], ffn_norm_weights[i], eps, wqkv[i],
                         wqkv_bias.get(i), wo[i], w13[i], w2[i], prepacked, cos, sin, num_q_heads,
                         num_kv_heads, k_layer, v_layer, rows, picked, packed, block_table,
                         cache_lens, num_nodes, tree_mask, sm_scale, /*start=*/0);
  }
  return h;
}

}  // namespace specdec
