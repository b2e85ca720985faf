// The torch.ops.specdec contract: op schemas and their per-dispatch-key registrations.
//
// This file is the one place the op contract is written in C++ (docs/ops.md documents
// it for users). Every registered implementation runs the shared checks of checks.h
// and normalises index / parameter dtypes before handing contiguous tensors to the
// backend kernels declared in ops.h; q and the K/V caches go through as they are (the
// kernels read them through their strides: no copy).
#include "ops.h"

#include <torch/library.h>

#include "checks.h"
#include "cpu/isa.h"

namespace specdec {
namespace {

// ---- build_tree_mask ----
std::tuple<at::Tensor, at::Tensor> build_tree_mask_meta(const at::Tensor& parents,
                                                        const at::Tensor& num_nodes) {
  check_build_tree_mask(parents, num_nodes, false);
  const int64_t B = parents.size(0), T = parents.size(1);
  return {at::empty({B, T, (T + 63) / 64}, parents.options().dtype(at::kLong)),
          at::empty({B, T}, parents.options().dtype(at::kInt))};
}

template <auto Kernel>
std::tuple<at::Tensor, at::Tensor> build_tree_mask_impl(const at::Tensor& parents,
                                                        const at::Tensor& num_nodes) {
  check_build_tree_mask(parents, num_nodes, should_check_values(parents));
  return Kernel(as_index(parents), as_index(num_nodes));
}

// ---- tree_verify ----
at::Tensor tree_verify_meta(const at::Tensor& q, const at::Tensor& k_cache,
                            const at::Tensor& v_cache, const at::Tensor& block_table,
                            const at::Tensor& cache_lens, const at::Tensor& num_nodes,
                            const at::Tensor& tree_mask, double sm_scale) {
  check_tree_verify(q, k_cache, v_cache, block_table, cache_lens, num_nodes, tree_mask, sm_scale,
                    false);
  return at::empty(q.sizes(), q.options());
}

template <auto Kernel>
at::Tensor tree_verify_impl(const at::Tensor& q, const at::Tensor& k_cache,
                            const at::Tensor& v_cache, const at::Tensor& block_table,
                            const at::Tensor& cache_lens, const at::Tensor& num_nodes,
                            const at::Tensor& tree_mask, double sm_scale) {
  check_tree_verify(q, k_cache, v_cache, block_table, cache_lens, num_nodes, tree_mask, sm_scale,
                    should_check_values(q));
  return Kernel(q, k_cache, v_cache, as_index(block_table), as_index(cache_lens),
                as_index(num_nodes), tree_mask.contiguous(), sm_scale);
}

// ---- tree_rejection_sample ----
using SampleOut = std::tuple<at::Tensor, at::Tensor, at::Tensor>;

SampleOut tree_rejection_sample_meta(const at::Tensor& target_logits,
                                     const at::Tensor& draft_tokens, const at::Tensor& parents,
                                     const at::Tensor& num_nodes,
                                     const std::optional<at::Tensor>& draft_probs,
                                     const at::Tensor& temperature, const at::Tensor& top_k,
                                     const at::Tensor& top_p, const at::Tensor& uniforms) {
  check_tree_rejection_sample(target_logits, draft_tokens, parents, num_nodes, draft_probs,
                              temperature, top_k, top_p, uniforms, false);
  const int64_t B = target_logits.size(0), T = target_logits.size(1);
  const auto opts = target_logits.options().dtype(at::kInt);
  return {at::empty({B, T}, opts), at::empty({B}, opts), at::empty({B, T}, opts)};
}

template <auto Kernel>
SampleOut tree_rejection_sample_impl(const at::Tensor& target_logits,
                                     const at::Tensor& draft_tokens, const at::Tensor& parents,
                                     const at::Tensor& num_nodes,
                                     const std::optional<at::Tensor>& draft_probs,
                                     const at::Tensor& temperature, const at::Tensor& top_k,
                                     const at::Tensor& top_p, const at::Tensor& uniforms) {
  check_tree_rejection_sample(target_logits, draft_tokens, parents, num_nodes, draft_probs,
                              temperature, top_k, top_p, uniforms,
                              should_check_values(target_logits));
  std::optional<at::Tensor> dp;
  if (draft_probs.has_value()) dp = draft_probs->contiguous();
  return Kernel(target_logits.contiguous(), as_index(draft_tokens), as_index(parents),
                as_index(num_nodes), dp, as_float(temperature), as_index(top_k), as_float(top_p),
                as_float(uniforms));
}

// ---- compact_kv ----
void compact_kv_meta(at::Tensor& k_cache, at::Tensor& v_cache, const at::Tensor& block_table,
                     const at::Tensor& cache_lens, const at::Tensor& accepted_nodes,
                     const at::Tensor& num_accepted) {
  check_compact_kv(k_cache, v_cache, block_table, cache_lens, accepted_nodes, num_accepted, false);
}

template <auto Kernel>
void compact_kv_impl(at::Tensor& k_cache, at::Tensor& v_cache, const at::Tensor& block_table,
                     const at::Tensor& cache_lens, const at::Tensor& accepted_nodes,
                     const at::Tensor& num_accepted) {
  check_compact_kv(k_cache, v_cache, block_table, cache_lens, accepted_nodes, num_accepted,
                   should_check_values(k_cache));
  // A single-layer cache is the L = 1 case; the view aliases the caller's storage.
  at::Tensor k = k_cache.dim() == 4 ? k_cache.unsqueeze(0) : k_cache;
  at::Tensor v = v_cache.dim() == 4 ? v_cache.unsqueeze(0) : v_cache;
  Kernel(k, v, as_index(block_table), as_index(cache_lens), as_index(accepted_nodes),
         as_index(num_accepted));
}

// ---- layer ops of the CPU decode path (CPU kernels only; the meta kernels are their fakes) ----
at::Tensor rms_norm_meta(const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_rms_norm(x, std::nullopt, weight, eps);
  return at::empty(x.sizes(), x.options());
}

at::Tensor rms_norm_impl(const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_rms_norm(x, std::nullopt, weight, eps);
  return std::get<1>(rms_norm_cpu(x, std::nullopt, weight, eps));
}

std::tuple<at::Tensor, at::Tensor> add_rms_norm_meta(const at::Tensor& x,
                                                     const at::Tensor& residual,
                                                     const at::Tensor& weight, double eps) {
  check_rms_norm(x, residual, weight, eps);
  return {at::empty(x.sizes(), x.options()), at::empty(x.sizes(), x.options())};
}

std::tuple<at::Tensor, at::Tensor> add_rms_norm_impl(const at::Tensor& x,
                                                     const at::Tensor& residual,
                                                     const at::Tensor& weight, double eps) {
  check_rms_norm(x, residual, weight, eps);
  return rms_norm_cpu(x, residual, weight, eps);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> rope_qkv_meta(const at::Tensor& qkv,
                                                             const at::Tensor& cos,
                                                             const at::Tensor& sin,
                                                             int64_t num_q_heads,
                                                             int64_t num_kv_heads) {
  check_rope_qkv(qkv, cos, sin, num_q_heads, num_kv_heads);
  const int64_t B = qkv.size(0), T = qkv.size(1);
  const int64_t D = qkv.size(2) / (num_q_heads + 2 * num_kv_heads);
  return {at::empty({B, T, num_q_heads, D}, qkv.options()),
          at::empty({B, T, num_kv_heads, D}, qkv.options()),
          at::empty({B, T, num_kv_heads, D}, qkv.options())};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> rope_qkv_impl(const at::Tensor& qkv,
                                                             const at::Tensor& cos,
                                                             const at::Tensor& sin,
                                                             int64_t num_q_heads,
                                                             int64_t num_kv_heads) {
  check_rope_qkv(qkv, cos, sin, num_q_heads, num_kv_heads);
  return rope_qkv_cpu(qkv, cos, sin, num_q_heads, num_kv_heads);
}

at::Tensor silu_and_mul_meta(const at::Tensor& x) {
  check_silu_and_mul(x);
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() /= 2;
  return at::empty(shape, x.options());
}

at::Tensor silu_and_mul_impl(const at::Tensor& x) {
  check_silu_and_mul(x);
  return silu_and_mul_cpu(x);
}

// ---- tiled_linear: a bf16 product over a weight laid out for few rows (csrc/cpu/tiled_linear.cpp)
at::Tensor tiled_linear_meta(const at::Tensor& x, const at::Tensor& weight_tiles,
                             int64_t out_features, const std::optional<at::Tensor>& bias) {
  check_tiled_linear(x, weight_tiles, out_features, bias);
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = out_features;
  return at::empty(shape, x.options());
}

at::Tensor tiled_linear_impl(const at::Tensor& x, const at::Tensor& weight_tiles,
                             int64_t out_features, const std::optional<at::Tensor>& bias) {
  check_tiled_linear(x, weight_tiles, out_features, bias);
  return tiled_linear_cpu(x, weight_tiles, out_features, bias);
}

// ---- decode_layer: one decoder layer of a CPU decode / verify step (csrc/cpu/decode_layer.cpp)
at::Tensor decode_layer_meta(const at::Tensor& x,
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
  check_decode_layer(x, attention_norm_weight, ffn_norm_weight, eps, wqkv, wqkv_bias, wo, w13, w2,
                     prepacked, cos, sin, num_q_heads, num_kv_heads, k_cache, v_cache, rows, picked,
                     packed, block_table, cache_lens, num_nodes, tree_mask, sm_scale, start);
  return at::empty(x.sizes(), x.options());
}

at::Tensor decode_layer_impl(const at::Tensor& x,
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
  check_decode_layer(x, attention_norm_weight, ffn_norm_weight, eps, wqkv, wqkv_bias, wo, w13, w2,
                     prepacked, cos, sin, num_q_heads, num_kv_heads, k_cache, v_cache, rows, picked,
                     packed, block_table, cache_lens, num_nodes, tree_mask, sm_scale, start);
  return decode_layer_cpu(x, attention_norm_weight, ffn_norm_weight, eps, wqkv, wqkv_bias, wo, w13,
                          w2, prepacked, cos, sin, num_q_heads, num_kv_heads, k_cache, v_cache,
                          rows, picked, packed, as_index(block_table), as_index(cache_lens),
                          as_index(num_nodes), tree_mask.contiguous(), sm_scale, start);
}

// ---- decode_layers: a run of decoder layers of a CPU decode / verify step, one call
// (csrc/cpu/decode_layer.cpp)
at::Tensor decode_layers_meta(const at::Tensor& x, at::TensorList attention_norm_weights,
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
  check_decode_layers(x, attention_norm_weights, ffn_norm_weights, eps, wqkv, wqkv_bias, wo, w13,
                      w2, prepacked, cos, sin, num_q_heads, num_kv_heads, k_cache, v_cache,
                      first_layer, rows, picked, packed, block_table, cache_lens, num_nodes,
                      tree_mask, sm_scale);
  return at::empty(x.sizes(), x.options());
}

at::Tensor decode_layers_impl(const at::Tensor& x, at::TensorList attention_norm_weights,
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
  check_decode_layers(x, attention_norm_weights, ffn_norm_weights, eps, wqkv, wqkv_bias, wo, w13,
                      w2, prepacked, cos, sin, num_q_heads, num_kv_heads, k_cache, v_cache,
                      first_layer, rows, picked, packed, block_table, cache_lens, num_nodes,
                      tree_mask, sm_scale);
  return decode_layers_cpu(x, attention_norm_weights, ffn_norm_weights, eps, wqkv, wqkv_bias, wo,
                           w13, w2, prepacked, cos, sin, num_q_heads, num_kv_heads, k_cache,
                           v_cache, first_layer, rows, picked, packed, as_index(block_table),
                           as_index(cache_lens), as_index(num_nodes), tree_mask.contiguous(),
                           sm_scale);
}

// ---- _check_* : the same validation for backends that live outside C++ (Triton) ----
void check_build_tree_mask_op(const at::Tensor& parents, const at::Tensor& num_nodes) {
  check_build_tree_mask(parents, num_nodes, should_check_values(parents));
}

void check_tree_verify_op(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                          const at::Tensor& block_table, const at::Tensor& cache_lens,
                          const at::Tensor& num_nodes, const at::Tensor& tree_mask,
                          double sm_scale) {
  check_tree_verify(q, k_cache, v_cache, block_table, cache_lens, num_nodes, tree_mask, sm_scale,
                    should_check_values(q));
}

void check_tree_rejection_sample_op(const at::Tensor& target_logits, const at::Tensor& draft_tokens,
                                    const at::Tensor& parents, const at::Tensor& num_nodes,
                                    const std::optional<at::Tensor>& draft_probs,
                                    const at::Tensor& temperature, const at::Tensor& top_k,
                                    const at::Tensor& top_p, const at::Tensor& uniforms) {
  check_tree_rejection_sample(target_logits, draft_tokens, parents, num_nodes, draft_probs,
                              temperature, top_k, top_p, uniforms,
                              should_check_values(target_logits));
}

void check_compact_kv_op(const at::Tensor& k_cache, const at::Tensor& v_cache,
                         const at::Tensor& block_table, const at::Tensor& cache_lens,
                         const at::Tensor& accepted_nodes, const at::Tensor& num_accepted) {
  check_compact_kv(k_cache, v_cache, block_table, cache_lens, accepted_nodes, num_accepted,
                   should_check_values(k_cache));
}

}  // namespace

TORCH_LIBRARY(specdec, m) {
  m.def("build_tree_mask(Tensor parents, Tensor num_nodes) -> (Tensor tree_mask, Tensor depth)");
  m.def(
      "tree_verify(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_table, "
      "Tensor cache_lens, Tensor num_nodes, Tensor tree_mask, float sm_scale) -> Tensor");
  m.def(
      "tree_rejection_sample(Tensor target_logits, Tensor draft_tokens, Tensor parents, "
      "Tensor num_nodes, Tensor? draft_probs, Tensor temperature, Tensor top_k, Tensor top_p, "
      "Tensor uniforms) -> (Tensor accepted_nodes, Tensor num_accepted, Tensor output_tokens)");
  m.def(
      "compact_kv(Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor block_table, "
      "Tensor cache_lens, Tensor accepted_nodes, Tensor num_accepted) -> ()");

  // The CPU decode path's layer ops (docs/ops.md, "Layer ops").
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def(
      "add_rms_norm(Tensor x, Tensor residual, Tensor weight, float eps) -> "
      "(Tensor sum, Tensor normed)");
  m.def(
      "rope_qkv(Tensor qkv, Tensor cos, Tensor sin, int num_q_heads, int num_kv_heads) -> "
      "(Tensor q, Tensor k, Tensor v)");
  m.def("silu_and_mul(Tensor x) -> Tensor");
  m.def(
      "tiled_linear(Tensor x, Tensor weight_tiles, int out_features, Tensor? bias=None) -> "
      "Tensor");
  m.def(
      "decode_layer(Tensor x, Tensor? attention_norm_weight, Tensor ffn_norm_weight, float eps, "
      "Tensor wqkv, Tensor? wqkv_bias, Tensor wo, Tensor w13, Tensor w2, bool prepacked, "
      "Tensor cos, Tensor sin, int num_q_heads, int num_kv_heads, Tensor(a!) k_cache, "
      "Tensor(b!) v_cache, Tensor rows, Tensor? picked, bool packed, Tensor block_table, "
      "Tensor cache_lens, Tensor num_nodes, Tensor tree_mask, float sm_scale, int start=0) -> "
      "Tensor");
  m.def(
      "decode_layers(Tensor x, Tensor[] attention_norm_weights, Tensor[] ffn_norm_weights, "
      "float eps, Tensor[] wqkv, Tensor?[] wqkv_bias, Tensor[] wo, Tensor[] w13, Tensor[] w2, "
      "bool prepacked, Tensor cos, Tensor sin, int num_q_heads, int num_kv_heads, "
      "Tensor(a!) k_cache, Tensor(b!) v_cache, int first_layer, Tensor rows, Tensor? picked, "
      "bool packed, Tensor block_table, Tensor cache_lens, Tensor num_nodes, Tensor tree_mask, "
      "float sm_scale) -> Tensor");

  m.def("_check_build_tree_mask(Tensor parents, Tensor num_nodes) -> ()");
  m.def(
      "_check_tree_verify(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_table, "
      "Tensor cache_lens, Tensor num_nodes, Tensor tree_mask, float sm_scale) -> ()");
  m.def(
      "_check_tree_rejection_sample(Tensor target_logits, Tensor draft_tokens, Tensor parents, "
      "Tensor num_nodes, Tensor? draft_probs, Tensor temperature, Tensor top_k, Tensor top_p, "
      "Tensor uniforms) -> ()");
  m.def(
      "_check_compact_kv(Tensor k_cache, Tensor v_cache, Tensor block_table, "
      "Tensor cache_lens, Tensor accepted_nodes, Tensor num_accepted) -> ()");
}

TORCH_LIBRARY_IMPL(specdec, CompositeExplicitAutograd, m) {
  m.impl("_check_build_tree_mask", &check_build_tree_mask_op);
  m.impl("_check_tree_verify", &check_tree_verify_op);
  m.impl("_check_tree_rejection_sample", &check_tree_rejection_sample_op);
  m.impl("_check_compact_kv", &check_compact_kv_op);
}

TORCH_LIBRARY_IMPL(specdec, Meta, m) {
  m.impl("build_tree_mask", &build_tree_mask_meta);
  m.impl("tree_verify", &tree_verify_meta);
  m.impl("tree_rejection_sample", &tree_rejection_sample_meta);
  m.impl("compact_kv", &compact_kv_meta);
  m.impl("rms_norm", &rms_norm_meta);
  m.impl("add_rms_norm", &add_rms_norm_meta);
  m.impl("rope_qkv", &rope_qkv_meta);
  m.impl("silu_and_mul", &silu_and_mul_meta);
  m.impl("tiled_linear", &tiled_linear_meta);
  m.impl("decode_layer", &decode_layer_meta);
  m.impl("decode_layers", &decode_layers_meta);
}

TORCH_LIBRARY_IMPL(specdec, CPU, m) {
  m.impl("build_tree_mask", &build_tree_mask_impl<build_tree_mask_cpu>);
  m.impl("tree_verify", &tree_verify_impl<tree_verify_cpu>);
  m.impl("tree_rejection_sample", &tree_rejection_sample_impl<tree_rejection_sample_cpu>);
  m.impl("compact_kv", &compact_kv_impl<compact_kv_cpu>);
  m.impl("rms_norm", &rms_norm_impl);
  m.impl("add_rms_norm", &add_rms_norm_impl);
  m.impl("rope_qkv", &rope_qkv_impl);
  m.impl("silu_and_mul", &silu_and_mul_impl);
  m.impl("tiled_linear", &tiled_linear_impl);
  m.impl("decode_layer", &decode_layer_impl);
  m.impl("decode_layers", &decode_layers_impl);
}

// Prepacked weights are oneDNN tensors (dispatch key MkldnnCPU), which outrank CPU in the
// dispatch: decode_layer(s) with them lands here, and runs the same CPU implementation.
TORCH_LIBRARY_IMPL(specdec, MkldnnCPU, m) {
  m.impl("decode_layer", &decode_layer_impl);
  m.impl("decode_layers", &decode_layers_impl);
}

#ifdef SPECDEC_WITH_CUDA
TORCH_LIBRARY_IMPL(specdec, CUDA, m) {
  m.impl("build_tree_mask", &build_tree_mask_impl<build_tree_mask_cuda>);
  m.impl("tree_verify", &tree_verify_impl<tree_verify_cuda>);
  m.impl("tree_rejection_sample", &tree_rejection_sample_impl<tree_rejection_sample_cuda>);
  m.impl("compact_kv", &compact_kv_impl<compact_kv_cuda>);
}
#endif

// The loader passes specdec_kernels.envs.SPECDEC_VALIDATE and SPECDEC_CPU_ISA here right after
// loading the library: configuration reaches C++ explicitly, never through getenv.
void set_cpu_isa_op(c10::string_view name) { set_cpu_isa(std::string(name)); }

TORCH_LIBRARY_FRAGMENT(specdec, m) {
  m.def("_set_validate(bool enabled) -> ()", &set_validate);
  m.def("_set_cpu_isa(str isa) -> ()", &set_cpu_isa_op);
  m.def("_cpu_isa() -> str", &cpu_isa_name);
}

}  // namespace specdec
