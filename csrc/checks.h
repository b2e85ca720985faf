// Input validation shared by every backend (CPU, CUDA, Triton via the _check_* ops).
//
// Each check_<op> verifies ranks, shapes, dtypes and devices (never reads data,
// so it also runs under the Meta / fake kernels). When `values` is true it also
// reads the small index tensors (and, for the CPU kernels, logits are checked
// while they are read) to reject trees, paths and block tables that would make a
// kernel read or write out of bounds. Values are checked on CPU tensors always;
// on CUDA only when SPECDEC_VALIDATE=1, because reading them needs a host sync
// (GPU kernels bound every index they dereference, so unchecked bad values give
// wrong numbers, never an out-of-bounds access).
#pragma once

#include <torch/types.h>

#include <optional>

namespace specdec {

// Largest |sm_scale| tree_verify accepts. Scores are q.k * sm_scale * log2(e) in float32: a
// larger scale overflows them to inf (and the softmax to NaN) for ordinary q and k, while the
// float64 reference stays finite. With |sm_scale| <= 2^16 the scores stay finite whenever
// |q.k| < 2^111 (about 2.6e33).
constexpr double kMaxSmScale = 65536.0;

// True when data-dependent checks should run for tensors on `t`'s device.
bool should_check_values(const at::Tensor& t);
// Turns the CUDA value checks on or off for the whole process (SPECDEC_VALIDATE).
void set_validate(bool enabled);

// Contiguous int32 copy (or the tensor itself) of an integer index tensor.
at::Tensor as_index(const at::Tensor& t);
// Contiguous float32 copy (or the tensor itself) of a float parameter tensor.
at::Tensor as_float(const at::Tensor& t);

void check_build_tree_mask(const at::Tensor& parents, const at::Tensor& num_nodes, bool values);

void check_tree_verify(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                       const at::Tensor& block_table, const at::Tensor& cache_lens,
                       const at::Tensor& num_nodes, const at::Tensor& tree_mask, double sm_scale,
                       bool values);

void check_tree_rejection_sample(const at::Tensor& target_logits, const at::Tensor& draft_tokens,
                                 const at::Tensor& parents, const at::Tensor& num_nodes,
                                 const std::optional<at::Tensor>& draft_probs,
                                 const at::Tensor& temperature, const at::Tensor& top_k,
                                 const at::Tensor& top_p, const at::Tensor& uniforms, bool values);

void check_compact_kv(const at::Tensor& k_cache, const at::Tensor& v_cache,
                      const at::Tensor& block_table, const at::Tensor& cache_lens,
                      const at::Tensor& accepted_nodes, const at::Tensor& num_accepted,
                      bool values);

// The layer ops of the CPU decode path (rms_norm, add_rms_norm, rope_qkv, silu_and_mul).
void check_rms_norm(const at::Tensor& x, const std::optional<at::Tensor>& residual,
                    const at::Tensor& weight, double eps);

void check_rope_qkv(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin,
                    int64_t num_q_heads, int64_t num_kv_heads);

void check_silu_and_mul(const at::Tensor& x);

// A linear weight's layout, as decode_layer takes it: pack_linear_tiles' tiles are 4-D
// [ceil(out / 64), in / 2, 64, 2]; plain and oneDNN-prepacked weights are 2-D [out, in].
inline bool is_weight_tiles(const at::Tensor& w) { return !w.is_mkldnn() && w.dim() == 4; }
// in_features of a linear weight in any of those layouts (exact in each).
inline int64_t weight_in_features(const at::Tensor& w) {
  return is_weight_tiles(w) ? 2 * w.size(1) : w.size(1);
}

// tiled_linear: x [..., K] bf16, weight_tiles the tiles of an [out_features, K] weight
// (pack_linear_tiles), bias [out_features] bf16.
void check_tiled_linear(const at::Tensor& x, const at::Tensor& weight_tiles, int64_t out_features,
                        const std::optional<at::Tensor>& bias);

// Everything decode_layer reads, checked before it writes its K/V: the layer's own arguments,
// its attention's (check_tree_verify on a stand-in for the q it will compute; x's tokens nodes
// start..start+M-1 of the trees) and, when values are checked, rows within the cache and
// picked within the tokens.
void check_decode_layer(const at::Tensor& x, const std::optional<at::Tensor>& attention_norm_weight,
                        const at::Tensor& ffn_norm_weight, double eps, const at::Tensor& wqkv,
                        const std::optional<at::Tensor>& wqkv_bias, const at::Tensor& wo,
                        const at::Tensor& w13, const at::Tensor& w2, bool prepacked,
                        const at::Tensor& cos, const at::Tensor& sin, int64_t num_q_heads,
                        int64_t num_kv_heads, const at::Tensor& k_cache, const at::Tensor& v_cache,
                        const at::Tensor& rows, const std::optional<at::Tensor>& picked,
                        bool packed, const at::Tensor& block_table, const at::Tensor& cache_lens,
                        const at::Tensor& num_nodes, const at::Tensor& tree_mask, double sm_scale,
                        int64_t start);

// decode_layers: decode_layer's checks for a run of layers, the step's (x, cos / sin, rows, the
// attention's index tensors: values read once) and each layer's weights; k_cache / v_cache
// [num_layers, num_blocks, block_size, Hkv, D] hold layers first_layer .. + len(wqkv) - 1.
void check_decode_layers(const at::Tensor& x, at::TensorList attention_norm_weights,
                         at::TensorList ffn_norm_weights, double eps, at::TensorList wqkv,
                         const c10::List<std::optional<at::Tensor>>& wqkv_bias, at::TensorList wo,
                         at::TensorList w13, at::TensorList w2, bool prepacked,
                         const at::Tensor& cos, const at::Tensor& sin, int64_t num_q_heads,
                         int64_t num_kv_heads, const at::Tensor& k_cache, const at::Tensor& v_cache,
                         int64_t first_layer, const at::Tensor& rows,
                         const std::optional<at::Tensor>& picked, bool packed,
                         const at::Tensor& block_table, const at::Tensor& cache_lens,
                         const at::Tensor& num_nodes, const at::Tensor& tree_mask, double sm_scale);

}  // namespace specdec
