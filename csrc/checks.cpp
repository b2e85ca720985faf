#include "checks.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <string>
#include <utility>
#include <vector>

namespace specdec {
namespace {

constexpr int64_t kInt32Max = std::numeric_limits<int32_t>::max();

bool is_index_dtype(const at::Tensor& t) {
  return t.scalar_type() == at::kInt || t.scalar_type() == at::kLong;
}

bool is_attn_dtype(at::ScalarType s) {
  return s == at::kFloat || s == at::kHalf || s == at::kBFloat16;
}

void check_index(const at::Tensor& t, const char* name, int64_t dim) {
  TORCH_CHECK(is_index_dtype(t), name, " must be an int32 or int64 tensor, got ", t.scalar_type());
  TORCH_CHECK(t.dim() == dim, name, " must have ", dim, " dimensions, got shape ", t.sizes());
}

void check_float_param(const at::Tensor& t, const char* name, int64_t dim) {
  TORCH_CHECK(at::isFloatingType(t.scalar_type()), name, " must be a floating point tensor, got ",
              t.scalar_type());
  TORCH_CHECK(t.dim() == dim, name, " must have ", dim, " dimensions, got shape ", t.sizes());
}

void check_size(const at::Tensor& t, const char* name, int64_t dim, int64_t expected,
                const char* what) {
  TORCH_CHECK(t.size(dim) == expected, name, ".size(", dim, ") must equal ", what, " (", expected,
              "), got ", t.size(dim), " (shape ", t.sizes(), ")");
}

void check_same_device(const at::Tensor& ref, const at::Tensor& t, const char* ref_name,
                       const char* name) {
  TORCH_CHECK(t.device() == ref.device(), name, " must be on the same device as ", ref_name, " (",
              ref.device(), "), got ", t.device());
}

// The values of a (small) index tensor as int64 on the host, for value checks: contiguous CPU
// int32 / int64 tensors are read in place (decode_layer checks the step's index tensors in
// every layer: a copy each was ~10 us per layer), others through a CPU int64 copy. The values
// are checked here, in int64, before the kernels narrow them to int32 (as_index): a value that
// does not fit int32 is rejected by name instead of wrapping around to a valid-looking one.
class HostIndex {
 public:
  explicit HostIndex(const at::Tensor& t) {
    if (t.device().is_cpu() && t.is_contiguous() && t.scalar_type() == at::kInt) {
      i32_ = t.data_ptr<int32_t>();
    } else if (t.device().is_cpu() && t.is_contiguous() && t.scalar_type() == at::kLong) {
      i64_ = t.data_ptr<int64_t>();
    } else {
      copy_ = t.to(at::kCPU).to(at::kLong).contiguous();
      i64_ = copy_.data_ptr<int64_t>();
    }
  }
  // Element i of the values in row-major order.
  int64_t operator[](int64_t i) const { return i32_ != nullptr ? i32_[i] : i64_[i]; }

 private:
  at::Tensor copy_;
  const int32_t* i32_ = nullptr;
  const int64_t* i64_ = nullptr;
};
at::Tensor host_float(const at::Tensor& t) { return t.to(at::kCPU).to(at::kFloat).contiguous(); }

// The kernels keep positions (cache_lens + node) in int32: every position an op touches
// must be at most kMaxPosition.
void check_position(int64_t cache_len, int64_t end, int64_t b, const char* end_what) {
  TORCH_CHECK(cache_len >= 0, "cache_lens[", b, "] = ", cache_len, " must be >= 0");
  TORCH_CHECK(end - 1 <= kInt32Max, end_what, " of request ", b, " reaches position ", end - 1,
              ", beyond the largest supported position 2^31 - 1 = ", kInt32Max, " (cache_lens[", b,
              "] = ", cache_len, ")");
}

// Every value of a 1-D int64 index tensor lies in [0, limit). Used before a kernel that writes
// through the indices: ATen's index_copy_ bounds them too, but only after writing the rows
// before a bad one.
void check_index_range(const at::Tensor& t, const char* name, int64_t limit, const char* what) {
  if (t.numel() == 0) return;
  const HostIndex values(t);
  int64_t min = values[0], max = values[0];
  for (int64_t i = 1; i < t.numel(); ++i) {
    min = std::min(min, values[i]);
    max = std::max(max, values[i]);
  }
  TORCH_CHECK(min >= 0 && max < limit, name, " must lie in [0, ", what, " = ", limit,
              "), got values in [", min, ", ", max, "]");
}

// num_nodes in [1, T], parents[b, 0] == -1, 0 <= parents[b, i] < i for 1 <= i < num_nodes[b].
void check_tree_values(const at::Tensor& parents, const at::Tensor& num_nodes) {
  const HostIndex pp(parents), np(num_nodes);
  const int64_t B = parents.size(0), T = parents.size(1);
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK(np[b] >= 1 && np[b] <= T, "num_nodes[", b, "] = ", np[b],
                " is out of range [1, T = ", T, "]");
    TORCH_CHECK(pp[b * T] == -1, "parents[", b, ", 0] must be -1 (node 0 is the root), got ",
                pp[b * T]);
    for (int64_t i = 1; i < np[b]; ++i) {
      const int64_t par = pp[b * T + i];
      TORCH_CHECK(par >= 0 && par < i, "parents[", b, ", ", i, "] = ", par,
                  " must satisfy 0 <= parent < ", i,
                  " (nodes in topological order, parent before child)");
    }
  }
}

// Every logical block that positions [0, end_b) of request b touch is a valid block id.
void check_block_table_values(const at::Tensor& block_table, const std::vector<int64_t>& ep,
                              int64_t num_blocks, int64_t block_size, const char* end_what) {
  const HostIndex btp(block_table);
  const int64_t B = block_table.size(0), max_blocks = block_table.size(1);
  for (int64_t b = 0; b < B; ++b) {
    const int64_t used = (ep[b] + block_size - 1) / block_size;
    TORCH_CHECK(used <= max_blocks, end_what, " of request ", b, " reaches position ", ep[b],
                ", beyond the ", max_blocks * block_size, " positions its block_table row owns (",
                max_blocks, " blocks of ", block_size, ")");
    for (int64_t j = 0; j < used; ++j) {
      const int64_t blk = btp[b * max_blocks + j];
      TORCH_CHECK(blk >= 0 && blk < num_blocks, "block_table[", b, ", ", j, "] = ", blk,
                  " is out of range [0, num_blocks = ", num_blocks, ")");
    }
  }
}

// K / V caches and q are read (and compact_kv's caches written) through their strides: any
// view whose last dimension is contiguous works (NHD or HND pages, halves of a joint KV
// tensor, a token pool as block size 1). Strides must be >= 0: the kernels compute int64
// offsets as sum(index * stride) and bound them with the sizes only.
void check_layout(const at::Tensor& t, const char* name) {
  for (int64_t d = 0; d < t.dim(); ++d) {
    TORCH_CHECK(t.stride(d) >= 0, name, " must not have negative strides, got strides ",
                t.strides(), " (shape ", t.sizes(), ")");
  }
  TORCH_CHECK(t.stride(-1) == 1 || t.size(-1) == 1, name,
              " must have a contiguous last dimension (stride 1), got strides ", t.strides(),
              " (shape ", t.sizes(), ")");
}

// The dimensions of t that move through memory (size > 1, stride > 0), largest stride first.
std::vector<std::pair<int64_t, int64_t>> moving_dims(const at::Tensor& t) {
  std::vector<std::pair<int64_t, int64_t>> dims;  // (size, stride)
  for (int64_t d = 0; d < t.dim(); ++d) {
    if (t.size(d) > 1 && t.stride(d) > 0) dims.emplace_back(t.size(d), t.stride(d));
  }
  std::sort(dims.begin(), dims.end(), [](auto a, auto b) { return a.second > b.second; });
  return dims;
}

// True when an element at offset x of a tensor with these dims (sorted by moving_dims) and
// an element at offset x + delta exist: delta = sum z_d * stride_d with |z_d| < size_d.
// Depth-first over the dims: with the larger strides fixed, only the z that leave a
// remainder the smaller ones can still reach are tried (one or two for nested layouts;
// more than 64 candidates count as reachable, a conservative answer).
bool offset_reachable(const std::vector<std::pair<int64_t, int64_t>>& dims, size_t i,
                      int64_t delta) {
  if (i == dims.size()) return delta == 0;
  int64_t rest = 0;  // the largest |offset| the dims after i can add
  for (size_t j = i + 1; j < dims.size(); ++j) rest += (dims[j].first - 1) * dims[j].second;
  const auto [n, s] = dims[i];
  const auto floor_div = [](int64_t a, int64_t b) { return a / b - (a % b != 0 && a < 0); };
  const int64_t lo = std::max(-(n - 1), -floor_div(rest - delta, s));
  const int64_t hi = std::min(n - 1, floor_div(delta + rest, s));
  if (hi - lo > 64) return true;
  for (int64_t z = lo; z <= hi; ++z) {
    if (offset_reachable(dims, i + 1, delta - z * s)) return true;
  }
  return false;
}

// compact_kv writes through k_cache and v_cache: no element may be reachable by two indices
// (a moved row would overwrite another row of the same cache), and K and V must not share
// an element (moving K would clobber V). Views into one joint KV tensor ([2, num_blocks,
// ...][0] and [1], or [num_blocks, 2, ...][:, 0] and [:, 1]) pass: their elements interleave
// but never coincide.
void check_no_overlap(const at::Tensor& k, const at::Tensor& v) {
  for (const auto& [t, name] :
       {std::pair<const at::Tensor&, const char*>{k, "k_cache"}, {v, "v_cache"}}) {
    for (int64_t d = 0; d < t.dim(); ++d) {
      TORCH_CHECK(t.size(d) == 1 || t.stride(d) != 0, name,
                  " must not overlap itself (a stride-0 dimension of size > 1), got strides ",
                  t.strides(), " (shape ", t.sizes(), ")");
    }
    // Non-overlap, sufficient: sorted by stride, each stride exceeds the span of the smaller.
    const auto dims = moving_dims(t);
    int64_t span = 0;
    for (auto it = dims.rbegin(); it != dims.rend(); ++it) {
      TORCH_CHECK(it->second > span, name,
                  " must not overlap itself: its strides must nest (each larger than the span "
                  "of the smaller ones), got strides ",
                  t.strides(), " (shape ", t.sizes(), ")");
      span += (it->first - 1) * it->second;
    }
  }
  if (!k.has_storage() || !v.has_storage() || !k.storage().is_alias_of(v.storage())) return;
  int64_t k_span = 1, v_span = 1;  // elements from the first to one past the last
  for (int64_t d = 0; d < k.dim(); ++d) {
    k_span += (k.size(d) - 1) * k.stride(d);
    v_span += (v.size(d) - 1) * v.stride(d);
  }
  const int64_t k0 = k.storage_offset(), v0 = v.storage_offset();
  if (k0 + k_span <= v0 || v0 + v_span <= k0) return;  // disjoint ranges
  TORCH_CHECK(k.strides() == v.strides() && !offset_reachable(moving_dims(k), 0, v0 - k0),
              "k_cache and v_cache overlap in memory (moving K would overwrite V): k_cache "
              "strides ",
              k.strides(), " at offset ", k0, ", v_cache strides ", v.strides(), " at offset ", v0);
}

}  // namespace

// Process-wide SPECDEC_VALIDATE: set by the Python loader (specdec_kernels.envs) through
// torch.ops.specdec._set_validate, so the C++ and Triton backends read one value.
static std::atomic<bool> g_validate{false};

void set_validate(bool enabled) { g_validate.store(enabled, std::memory_order_relaxed); }

bool should_check_values(const at::Tensor& t) {
  if (t.device().is_cpu()) return true;
  return g_validate.load(std::memory_order_relaxed);
}

at::Tensor as_index(const at::Tensor& t) {
  // Saturate instead of wrapping: on devices whose values are not checked (CUDA without
  // SPECDEC_VALIDATE) an int64 value past int32 becomes an out-of-range value that the
  // kernels' bounds reject, never a valid-looking one (2^32 would wrap to 0). A device op,
  // so it needs no host sync and is CUDA-graph safe.
  if (t.scalar_type() == at::kLong) {
    return t.clamp(std::numeric_limits<int32_t>::min(), kInt32Max).to(at::kInt).contiguous();
  }
  return t.to(at::kInt).contiguous();
}
at::Tensor as_float(const at::Tensor& t) { return t.to(at::kFloat).contiguous(); }

void check_build_tree_mask(const at::Tensor& parents, const at::Tensor& num_nodes, bool values) {
  check_index(parents, "parents", 2);
  check_index(num_nodes, "num_nodes", 1);
  check_same_device(parents, num_nodes, "parents", "num_nodes");
  TORCH_CHECK(parents.size(1) >= 1, "parents must have at least one node (T >= 1), got shape ",
              parents.sizes());
  check_size(num_nodes, "num_nodes", 0, parents.size(0), "the batch size B of parents");
  if (values) check_tree_values(parents, num_nodes);
}

void check_tree_verify(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                       const at::Tensor& block_table, const at::Tensor& cache_lens,
                       const at::Tensor& num_nodes, const at::Tensor& tree_mask, double sm_scale,
                       bool values) {
  TORCH_CHECK(q.dim() == 4, "q must be [B, T, Hq, D], got shape ", q.sizes());
  TORCH_CHECK(is_attn_dtype(q.scalar_type()), "q must be float32, float16 or bfloat16, got ",
              q.scalar_type());
  TORCH_CHECK(k_cache.dim() == 4, "k_cache must be [num_blocks, block_size, Hkv, D], got shape ",
              k_cache.sizes());
  TORCH_CHECK(k_cache.scalar_type() == q.scalar_type(), "k_cache dtype (", k_cache.scalar_type(),
              ") must match q dtype (", q.scalar_type(), ")");
  TORCH_CHECK(v_cache.scalar_type() == q.scalar_type(), "v_cache dtype (", v_cache.scalar_type(),
              ") must match q dtype (", q.scalar_type(), ")");
  TORCH_CHECK(v_cache.sizes() == k_cache.sizes(), "v_cache shape ", v_cache.sizes(),
              " must equal k_cache shape ", k_cache.sizes());
  check_layout(q, "q");
  check_layout(k_cache, "k_cache");
  check_layout(v_cache, "v_cache");
  const int64_t B = q.size(0), T = q.size(1), Hq = q.size(2), D = q.size(3);
  const int64_t Hkv = k_cache.size(2);
  TORCH_CHECK(B >= 1 && T >= 1, "q must have B >= 1 and T >= 1, got shape ", q.sizes());
  TORCH_CHECK(D >= 1, "q head dim D must be >= 1, got shape ", q.sizes());
  check_size(k_cache, "k_cache", 3, D, "the head dim D of q");
  TORCH_CHECK(Hkv >= 1 && Hq % Hkv == 0, "the number of query heads Hq (", Hq,
              ") must be a multiple of the number of KV heads Hkv (", Hkv, ")");
  TORCH_CHECK(k_cache.size(0) >= 1 && k_cache.size(1) >= 1,
              "k_cache must have num_blocks >= 1 and block_size >= 1, got shape ", k_cache.sizes());
  check_index(block_table, "block_table", 2);
  check_index(cache_lens, "cache_lens", 1);
  check_index(num_nodes, "num_nodes", 1);
  check_size(block_table, "block_table", 0, B, "the batch size B of q");
  check_size(cache_lens, "cache_lens", 0, B, "the batch size B of q");
  check_size(num_nodes, "num_nodes", 0, B, "the batch size B of q");
  TORCH_CHECK(tree_mask.scalar_type() == at::kLong, "tree_mask must be int64, got ",
              tree_mask.scalar_type());
  TORCH_CHECK(tree_mask.dim() == 3, "tree_mask must be [B, T, ceil(T/64)], got shape ",
              tree_mask.sizes());
  check_size(tree_mask, "tree_mask", 0, B, "the batch size B of q");
  check_size(tree_mask, "tree_mask", 1, T, "the tree size T of q");
  check_size(tree_mask, "tree_mask", 2, (T + 63) / 64, "ceil(T / 64)");
  TORCH_CHECK(std::isfinite(sm_scale) && std::fabs(sm_scale) <= kMaxSmScale,
              "sm_scale must be finite with |sm_scale| <= ", kMaxSmScale,
              " (scores are scaled in float32), got ", sm_scale);
  for (const auto& [t, name] : {std::pair<const at::Tensor&, const char*>{k_cache, "k_cache"},
                                {v_cache, "v_cache"},
                                {block_table, "block_table"},
                                {cache_lens, "cache_lens"},
                                {num_nodes, "num_nodes"},
                                {tree_mask, "tree_mask"}}) {
    check_same_device(q, t, "q", name);
  }
  if (!values) return;
  const HostIndex n(num_nodes), c(cache_lens);
  std::vector<int64_t> ends(B);
  for (int64_t b = 0; b < B; ++b) {
    const int64_t nb = n[b], cb = c[b];
    TORCH_CHECK(nb >= 1 && nb <= T, "num_nodes[", b, "] = ", nb, " is out of range [1, T = ", T,
                "]");
    check_position(cb, cb + nb, b, "cache_lens + num_nodes");
    ends[b] = cb + nb;
  }
  check_block_table_values(block_table, ends, k_cache.size(0), k_cache.size(1),
                           "cache_lens + num_nodes");
}

void check_tree_rejection_sample(const at::Tensor& target_logits, const at::Tensor& draft_tokens,
                                 const at::Tensor& parents, const at::Tensor& num_nodes,
                                 const std::optional<at::Tensor>& draft_probs,
                                 const at::Tensor& temperature, const at::Tensor& top_k,
                                 const at::Tensor& top_p, const at::Tensor& uniforms, bool values) {
  TORCH_CHECK(target_logits.dim() == 3, "target_logits must be [B, T, V], got shape ",
              target_logits.sizes());
  TORCH_CHECK(is_attn_dtype(target_logits.scalar_type()),
              "target_logits must be float32, float16 or bfloat16, got ",
              target_logits.scalar_type());
  const int64_t B = target_logits.size(0), T = target_logits.size(1), V = target_logits.size(2);
  TORCH_CHECK(B >= 1 && T >= 1 && V >= 1, "target_logits must have B, T, V >= 1, got shape ",
              target_logits.sizes());
  TORCH_CHECK(V < (int64_t(1) << 31), "vocabulary size V must fit in int32, got ", V);
  check_index(draft_tokens, "draft_tokens", 2);
  check_size(draft_tokens, "draft_tokens", 0, B, "the batch size B of target_logits");
  check_size(draft_tokens, "draft_tokens", 1, T, "the tree size T of target_logits");
  check_build_tree_mask(parents, num_nodes, false);
  check_size(parents, "parents", 0, B, "the batch size B of target_logits");
  check_size(parents, "parents", 1, T, "the tree size T of target_logits");
  if (draft_probs.has_value()) {
    const at::Tensor& dp = *draft_probs;
    TORCH_CHECK(dp.dim() == 3, "draft_probs must be [B, T, V], got shape ", dp.sizes());
    TORCH_CHECK(at::isFloatingType(dp.scalar_type()),
                "draft_probs must be a floating point tensor, got ", dp.scalar_type());
    TORCH_CHECK(dp.sizes() == target_logits.sizes(), "draft_probs shape ", dp.sizes(),
                " must equal target_logits shape ", target_logits.sizes());
    check_same_device(target_logits, dp, "target_logits", "draft_probs");
  }
  check_float_param(temperature, "temperature", 1);
  check_index(top_k, "top_k", 1);
  check_float_param(top_p, "top_p", 1);
  check_float_param(uniforms, "uniforms", 2);
  check_size(temperature, "temperature", 0, B, "the batch size B of target_logits");
  check_size(top_k, "top_k", 0, B, "the batch size B of target_logits");
  check_size(top_p, "top_p", 0, B, "the batch size B of target_logits");
  check_size(uniforms, "uniforms", 0, B, "the batch size B of target_logits");
  check_size(uniforms, "uniforms", 1, T + 1, "T + 1");
  for (const auto& [t, name] :
       {std::pair<const at::Tensor&, const char*>{draft_tokens, "draft_tokens"},
        {parents, "parents"},
        {num_nodes, "num_nodes"},
        {temperature, "temperature"},
        {top_k, "top_k"},
        {top_p, "top_p"},
        {uniforms, "uniforms"}}) {
    check_same_device(target_logits, t, "target_logits", name);
  }
  if (!values) return;
  check_tree_values(parents, num_nodes);
  const HostIndex tok(draft_tokens), n(num_nodes);
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t i = 1; i < n[b]; ++i) {
      const int64_t x = tok[b * T + i];
      TORCH_CHECK(x >= 0 && x < V, "draft_tokens[", b, ", ", i, "] = ", x,
                  " is out of range [0, V = ", V, ")");
    }
  }
  const at::Tensor temp = host_float(temperature), tp = host_float(top_p);
  const HostIndex tk(top_k);
  for (int64_t b = 0; b < B; ++b) {
    const float t = temp.data_ptr<float>()[b], p = tp.data_ptr<float>()[b];
    TORCH_CHECK(std::isfinite(t) && t >= 0.f, "temperature[", b, "] = ", t,
                " must be finite and >= 0 (0 means greedy)");
    const int64_t k = tk[b];
    TORCH_CHECK(k >= 0 && k <= kInt32Max, "top_k[", b, "] = ", k,
                " must be in [0, 2^31 - 1] (0 disables top-k)");
    TORCH_CHECK(p > 0.f && p <= 1.f, "top_p[", b, "] = ", p,
                " must be in (0, 1] (1 disables top-p)");
  }
  const at::Tensor u = uniforms.to(at::kCPU).to(at::kDouble).contiguous();
  const double* up = u.data_ptr<double>();
  for (int64_t i = 0; i < u.numel(); ++i) {
    TORCH_CHECK(up[i] >= 0.0 && up[i] < 1.0, "uniforms[", i / (T + 1), ", ", i % (T + 1),
                "] = ", up[i], " must be in [0, 1)");
  }
}

void check_compact_kv(const at::Tensor& k_cache, const at::Tensor& v_cache,
                      const at::Tensor& block_table, const at::Tensor& cache_lens,
                      const at::Tensor& accepted_nodes, const at::Tensor& num_accepted,
                      bool values) {
  TORCH_CHECK(k_cache.dim() == 4 || k_cache.dim() == 5,
              "k_cache must be [num_blocks, block_size, Hkv, D] or "
              "[L, num_blocks, block_size, Hkv, D], got shape ",
              k_cache.sizes());
  TORCH_CHECK(v_cache.sizes() == k_cache.sizes(), "v_cache shape ", v_cache.sizes(),
              " must equal k_cache shape ", k_cache.sizes());
  TORCH_CHECK(v_cache.scalar_type() == k_cache.scalar_type(), "v_cache dtype (",
              v_cache.scalar_type(), ") must match k_cache dtype (", k_cache.scalar_type(), ")");
  check_layout(k_cache, "k_cache");
  check_layout(v_cache, "v_cache");
  TORCH_CHECK(!k_cache.is_same(v_cache), "k_cache and v_cache must be different tensors");
  check_no_overlap(k_cache, v_cache);
  {
    const int64_t nd = k_cache.dim();
    TORCH_CHECK(k_cache.size(nd - 4) >= 1 && k_cache.size(nd - 3) >= 1,
                "k_cache must have num_blocks >= 1 and block_size >= 1, got shape ",
                k_cache.sizes());
  }
  check_index(block_table, "block_table", 2);
  check_index(cache_lens, "cache_lens", 1);
  check_index(accepted_nodes, "accepted_nodes", 2);
  check_index(num_accepted, "num_accepted", 1);
  const int64_t B = block_table.size(0), T = accepted_nodes.size(1);
  TORCH_CHECK(T >= 1, "accepted_nodes must have at least one column, got shape ",
              accepted_nodes.sizes());
  check_size(cache_lens, "cache_lens", 0, B, "the batch size B of block_table");
  check_size(accepted_nodes, "accepted_nodes", 0, B, "the batch size B of block_table");
  check_size(num_accepted, "num_accepted", 0, B, "the batch size B of block_table");
  for (const auto& [t, name] : {std::pair<const at::Tensor&, const char*>{v_cache, "v_cache"},
                                {block_table, "block_table"},
                                {cache_lens, "cache_lens"},
                                {accepted_nodes, "accepted_nodes"},
                                {num_accepted, "num_accepted"}}) {
    check_same_device(k_cache, t, "k_cache", name);
  }
  if (!values) return;
  const HostIndex a(accepted_nodes), na(num_accepted), c(cache_lens);
  std::vector<int64_t> ends(B);
  for (int64_t b = 0; b < B; ++b) {
    const int64_t nb = na[b], cb = c[b];
    const auto ap = [&](int64_t k) { return a[b * T + k]; };
    TORCH_CHECK(nb >= 0 && nb < T, "num_accepted[", b, "] = ", nb,
                " is out of range [0, T - 1 = ", T - 1, "]");
    TORCH_CHECK(ap(0) == 0, "accepted_nodes[", b, ", 0] must be 0 (the root), got ", ap(0));
    for (int64_t k = 1; k <= nb; ++k) {
      TORCH_CHECK(ap(k) > ap(k - 1) && ap(k) < T, "accepted_nodes[", b, ", ", k, "] = ", ap(k),
                  " is not a valid root path: node ids must increase along the path and stay "
                  "below T = ",
                  T);
    }
    check_position(cb, cb + ap(nb) + 1, b, "cache_lens + accepted_nodes");
    ends[b] = cb + ap(nb) + 1;
  }
  const int64_t nd = k_cache.dim();
  check_block_table_values(block_table, ends, k_cache.size(nd - 4), k_cache.size(nd - 3),
                           "cache_lens + accepted_nodes");
}

// ---- layer ops (CPU decode path) ----
namespace {

void check_activation(const at::Tensor& t, const char* name) {
  TORCH_CHECK(is_attn_dtype(t.scalar_type()), name, " must be float32, float16 or bfloat16, got ",
              t.scalar_type());
  TORCH_CHECK(t.dim() >= 1, name, " must have at least one dimension, got shape ", t.sizes());
}

void check_same_dtype(const at::Tensor& t, const at::Tensor& ref, const char* name,
                      const char* ref_name) {
  TORCH_CHECK(t.scalar_type() == ref.scalar_type(), name, " must have the dtype of ", ref_name,
              " (", ref.scalar_type(), "), got ", t.scalar_type());
}

}  // namespace

void check_rms_norm(const at::Tensor& x, const std::optional<at::Tensor>& residual,
                    const at::Tensor& weight, double eps) {
  check_activation(x, "x");
  check_activation(weight, "weight");
  check_same_dtype(weight, x, "weight", "x");
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == x.size(-1),
              "weight must have shape [x.size(-1)] = [", x.size(-1), "], got ", weight.sizes());
  if (residual.has_value()) {
    check_activation(*residual, "residual");
    check_same_dtype(*residual, x, "residual", "x");
    TORCH_CHECK(residual->sizes() == x.sizes(), "residual must have the shape of x (", x.sizes(),
                "), got ", residual->sizes());
  }
  TORCH_CHECK(std::isfinite(eps) && eps >= 0, "eps must be finite and >= 0, got ", eps);
}

void check_rope_qkv(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin,
                    int64_t num_q_heads, int64_t num_kv_heads) {
  check_activation(qkv, "qkv");
  TORCH_CHECK(qkv.dim() == 3,
              "qkv must be [B, T, (num_q_heads + 2 * num_kv_heads) * D], got shape ", qkv.sizes());
  TORCH_CHECK(num_q_heads >= 1 && num_kv_heads >= 1,
              "num_q_heads and num_kv_heads must be >= 1, got ", num_q_heads, " and ",
              num_kv_heads);
  const int64_t heads = num_q_heads + 2 * num_kv_heads;
  TORCH_CHECK(qkv.size(2) % heads == 0 && (qkv.size(2) / heads) % 2 == 0,
              "qkv.size(2) = ", qkv.size(2), " must be (num_q_heads + 2 * num_kv_heads) = ", heads,
              " times an even head dim");
  const int64_t D = qkv.size(2) / heads;
  for (const auto& [t, name] : {std::pair{cos, "cos"}, std::pair{sin, "sin"}}) {
    check_activation(t, name);
    check_same_dtype(t, qkv, name, "qkv");
    TORCH_CHECK(t.dim() == 4 && t.size(0) == qkv.size(0) && t.size(1) == qkv.size(1) &&
                    t.size(2) == 1 && t.size(3) == D,
                name, " must have shape [B, T, 1, D] = [", qkv.size(0), ", ", qkv.size(1), ", 1, ",
                D, "], got ", t.sizes());
  }
}

void check_silu_and_mul(const at::Tensor& x) {
  check_activation(x, "x");
  TORCH_CHECK(x.size(-1) % 2 == 0, "x.size(-1) must be even ([..., 2 * H]: gate then up), got ",
              x.size(-1));
}

namespace {

// A linear weight's tiles (pack_linear_tiles) for a logical [out_features, in_features] weight.
void check_weight_tiles(const at::Tensor& w, const char* name, int64_t out_features,
                        int64_t in_features) {
  TORCH_CHECK(w.scalar_type() == at::kBFloat16, name, " (tiles) must be bfloat16, got ",
              w.scalar_type());
  TORCH_CHECK(out_features >= 0, "out_features must be >= 0, got ", out_features);
  TORCH_CHECK(in_features >= 2 && in_features % 2 == 0, name,
              " (tiles) needs an even in_features >= 2, got ", in_features);
  const int64_t num_tiles = (out_features + 63) / 64;
  TORCH_CHECK(w.dim() == 4 && w.size(0) == num_tiles && w.size(1) == in_features / 2 &&
                  w.size(2) == 64 && w.size(3) == 2,
              name, " must be the tiles of a [", out_features, ", ", in_features,
              "] weight (pack_linear_tiles): shape [ceil(out_features / 64), in_features / 2, 64, "
              "2] = [",
              num_tiles, ", ", in_features / 2, ", 64, 2], got ", w.sizes());
  TORCH_CHECK(w.is_contiguous(), name,
              " (tiles) must be contiguous, as pack_linear_tiles makes it");
}

// A decode_layer weight of logical shape [out_features, in_features]: tiles, or plain / oneDNN
// (whose sizes are the logical shape).
void check_linear_weight(const at::Tensor& w, const char* name, int64_t out_features,
                         int64_t in_features) {
  if (is_weight_tiles(w)) {
    check_weight_tiles(w, name, out_features, in_features);
    return;
  }
  TORCH_CHECK(w.dim() == 2 && w.size(0) == out_features && w.size(1) == in_features, name,
              " must have shape [out_features, in_features] = [", out_features, ", ", in_features,
              "], got ", w.sizes());
}

}  // namespace

void check_tiled_linear(const at::Tensor& x, const at::Tensor& weight_tiles, int64_t out_features,
                        const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.scalar_type() == at::kBFloat16, "x must be bfloat16, got ", x.scalar_type());
  TORCH_CHECK(x.dim() >= 1, "x must be [..., in_features], got a 0-d tensor");
  check_same_device(x, weight_tiles, "x", "weight_tiles");
  check_weight_tiles(weight_tiles, "weight_tiles", out_features, x.size(-1));
  if (bias.has_value()) {
    check_same_device(x, *bias, "x", "bias");
    TORCH_CHECK(bias->scalar_type() == at::kBFloat16, "bias must be bfloat16, got ",
                bias->scalar_type());
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == out_features,
                "bias must have shape [out_features] = [", out_features, "], got ", bias->sizes());
  }
}

namespace {

// The names of one layer's weight arguments: decode_layer's own, or for layer i of
// decode_layers the list entries ("wqkv[3]").
struct LayerWeightNames {
  std::string attention_norm_weight, ffn_norm_weight, wqkv, wqkv_bias, wo, w13, w2;
};

LayerWeightNames layer_weight_names(int64_t layer) {
  if (layer < 0) {
    return {"attention_norm_weight", "ffn_norm_weight", "wqkv", "wqkv_bias", "wo", "w13", "w2"};
  }
  const std::string at = "[" + std::to_string(layer) + "]";
  return {"attention_norm_weights" + at,
          "ffn_norm_weights" + at,
          "wqkv" + at,
          "wqkv_bias" + at,
          "wo" + at,
          "w13" + at,
          "w2" + at};
}

// x, eps, the heads and cos / sin of a step; returns the head dim (from cos: rope rotates
// pairs; every weight's shape follows from it, dim and the MLP's hidden size, whatever the
// weights' layouts, as tiles pad their output rows).
int64_t check_decode_inputs(const at::Tensor& x, double eps, const at::Tensor& cos,
                            const at::Tensor& sin, int64_t num_q_heads, int64_t num_kv_heads) {
  check_activation(x, "x");
  TORCH_CHECK(x.dim() == 3 && x.size(0) >= 1 && x.size(1) >= 1,
              "x must be [B, M, dim] with B, M >= 1, got shape ", x.sizes());
  TORCH_CHECK(std::isfinite(eps) && eps >= 0, "eps must be finite and >= 0, got ", eps);
  TORCH_CHECK(num_q_heads >= 1 && num_kv_heads >= 1 && num_q_heads % num_kv_heads == 0,
              "num_q_heads must be a positive multiple of num_kv_heads >= 1, got ", num_q_heads,
              " and ", num_kv_heads);
  for (const auto& [t, name] :
       {std::pair<const at::Tensor&, const char*>{cos, "cos"}, {sin, "sin"}}) {
    check_same_dtype(t, x, name, "x");
    TORCH_CHECK(t.dim() == 4 && t.size(0) == x.size(0) && t.size(1) == x.size(1) &&
                    t.size(2) == 1 && t.size(3) == cos.size(-1) && t.size(3) >= 2 &&
                    t.size(3) % 2 == 0,
                name, " must have shape [B, M, 1, D] = [", x.size(0), ", ", x.size(1),
                ", 1, D] with D the (even) head dim, got ", t.sizes());
  }
  return cos.size(3);
}

// One layer's norm weights and linears (layer < 0: decode_layer's, else decode_layers' entry).
void check_layer_weights(const at::Tensor& x, int64_t head_dim, int64_t num_q_heads,
                         int64_t num_kv_heads, bool prepacked,
                         const std::optional<at::Tensor>& attention_norm_weight,
                         const at::Tensor& ffn_norm_weight, const at::Tensor& wqkv,
                         const std::optional<at::Tensor>& wqkv_bias, const at::Tensor& wo,
                         const at::Tensor& w13, const at::Tensor& w2, int64_t layer) {
  const LayerWeightNames names = layer_weight_names(layer);
  const int64_t dim = x.size(2), D = head_dim;
  const auto check_norm = [&](const at::Tensor& w, const std::string& name) {
    check_same_dtype(w, x, name.c_str(), "x");
    TORCH_CHECK(w.dim() == 1 && w.size(0) == dim, name, " must have shape [dim] = [", dim,
                "], got ", w.sizes());
  };
  // no input norm: an EAGLE-1/2 head's layer
  if (attention_norm_weight.has_value()) {
    check_norm(*attention_norm_weight, names.attention_norm_weight);
  }
  check_norm(ffn_norm_weight, names.ffn_norm_weight);
  const int64_t heads = num_q_heads + 2 * num_kv_heads;
  for (const auto& [w, name] : {std::pair<const at::Tensor&, const std::string&>{wqkv, names.wqkv},
                                {wo, names.wo},
                                {w13, names.w13},
                                {w2, names.w2}}) {
    check_same_dtype(w, x, name.c_str(), "x");
    if (prepacked) {
      TORCH_CHECK(w.is_mkldnn() || w.dim() == 4, name,
                  " must be prepacked (mkldnn._reorder_linear_weight, or pack_linear_tiles) "
                  "when prepacked, got a plain weight of shape ",
                  w.sizes());
    } else {
      TORCH_CHECK(!w.is_mkldnn() && w.dim() == 2, name,
                  " must be a plain strided [out_features, in_features] weight when prepacked is "
                  "false, got ",
                  w.is_mkldnn() ? "a oneDNN-prepacked one" : "shape ", w.sizes());
    }
  }
  check_linear_weight(wqkv, names.wqkv.c_str(), heads * D, dim);
  if (wqkv_bias.has_value()) {
    check_same_dtype(*wqkv_bias, x, names.wqkv_bias.c_str(), "x");
    TORCH_CHECK(wqkv_bias->dim() == 1 && wqkv_bias->size(0) == heads * D, names.wqkv_bias,
                " must have shape [(num_q_heads + 2 * num_kv_heads) * D] = [", heads * D, "], got ",
                wqkv_bias->sizes());
  }
  check_linear_weight(wo, names.wo.c_str(), dim, num_q_heads * D);
  // The MLP's hidden size: half w13's out_features, or w2's in_features when w13 is tiles
  // (which pad their output rows; a mismatch is then reported as w13's).
  const bool w13_tiles = is_weight_tiles(w13);
  if (!w13_tiles) {
    TORCH_CHECK(w13.dim() == 2 && w13.size(0) % 2 == 0 && w13.size(0) >= 2, names.w13,
                " must have shape [2 * hidden_dim, dim] (gate then up), got ", w13.sizes());
  }
  const int64_t hidden = w13_tiles ? weight_in_features(w2) : w13.size(0) / 2;
  check_linear_weight(w13, names.w13.c_str(), 2 * hidden, dim);
  check_linear_weight(w2, names.w2.c_str(), dim, hidden);
}

// The step's tokens, cache rows and attention over one layer's cache [num_blocks, block_size,
// Hkv, D]: check_tree_verify on a stand-in (no data) for the q the layer will compute and,
// when values are checked, rows within the cache and picked within the tokens.
void check_decode_attention(const at::Tensor& x, int64_t head_dim, int64_t num_q_heads,
                            int64_t num_kv_heads, const at::Tensor& k_cache,
                            const at::Tensor& v_cache, const at::Tensor& rows,
                            const std::optional<at::Tensor>& picked, bool packed,
                            const at::Tensor& block_table, const at::Tensor& cache_lens,
                            const at::Tensor& num_nodes, const at::Tensor& tree_mask,
                            double sm_scale, int64_t start) {
  const int64_t D = head_dim;
  TORCH_CHECK(rows.scalar_type() == at::kLong && rows.dim() == 1,
              "rows must be a 1-D int64 tensor of cache rows, got ", rows.scalar_type(), " ",
              rows.sizes());
  if (picked.has_value()) {
    TORCH_CHECK(picked->scalar_type() == at::kLong && picked->dim() == 1,
                "picked must be a 1-D int64 tensor, got ", picked->scalar_type(), " ",
                picked->sizes());
    TORCH_CHECK(picked->size(0) == rows.size(0), "picked must have one entry per row of rows (",
                rows.size(0), "), got ", picked->size(0));
  }
  if (packed) {
    TORCH_CHECK(picked.has_value(), "packed needs picked (the tree slot of every token of x)");
    TORCH_CHECK(x.size(0) == 1 && x.size(1) == rows.size(0),
                "packed: x must be [1, N, dim] with N = rows.size(0) = ", rows.size(0), ", got ",
                x.sizes());
  } else if (!picked.has_value()) {
    TORCH_CHECK(rows.size(0) == x.size(0) * x.size(1),
                "rows must have one entry per token of x (B * M = ", x.size(0) * x.size(1),
                "), got ", rows.size(0));
  }
  TORCH_CHECK(tree_mask.dim() == 3, "tree_mask must be [B, T, ceil(T/64)], got shape ",
              tree_mask.sizes());
  // x's tokens are nodes start..start+M-1 of the trees (packed: every real node, start 0)
  TORCH_CHECK(start >= 0 && start <= tree_mask.size(1) - (packed ? tree_mask.size(1) : x.size(1)),
              "start must leave x's M = ", x.size(1),
              " tokens within the trees' T = ", tree_mask.size(1), " nodes",
              packed ? " (packed: start 0)" : "", ", got ", start);
  const int64_t batch = packed ? tree_mask.size(0) : x.size(0);
  const at::Tensor q = at::empty({batch, tree_mask.size(1), num_q_heads, D}, x.options());
  const bool check_values = should_check_values(x);
  check_tree_verify(q, k_cache, v_cache, block_table, cache_lens, num_nodes, tree_mask, sm_scale,
                    check_values);
  TORCH_CHECK(k_cache.size(2) == num_kv_heads, "k_cache must hold num_kv_heads = ", num_kv_heads,
              " heads, got shape ", k_cache.sizes());
  if (!check_values) return;
  check_index_range(rows, "rows", k_cache.size(0) * k_cache.size(1), "num_blocks * block_size");
  if (picked.has_value()) {
    if (packed) {
      check_index_range(*picked, "picked", tree_mask.size(0) * tree_mask.size(1), "B * T");
    } else {
      check_index_range(*picked, "picked", x.size(0) * x.size(1), "B * M");
    }
  }
}

}  // namespace

void check_decode_layer(const at::Tensor& x, const std::optional<at::Tensor>& attention_norm_weight,
                        const at::Tensor& ffn_norm_weight, double eps, const at::Tensor& wqkv,
                        const std::optional<at::Tensor>& wqkv_bias, const at::Tensor& wo,
                        const at::Tensor& w13, const at::Tensor& w2, bool prepacked,
                        const at::Tensor& cos, const at::Tensor& sin, int64_t num_q_heads,
                        int64_t num_kv_heads, const at::Tensor& k_cache, const at::Tensor& v_cache,
                        const at::Tensor& rows, const std::optional<at::Tensor>& picked,
                        bool packed, const at::Tensor& block_table, const at::Tensor& cache_lens,
                        const at::Tensor& num_nodes, const at::Tensor& tree_mask, double sm_scale,
                        int64_t start) {
  const int64_t D = check_decode_inputs(x, eps, cos, sin, num_q_heads, num_kv_heads);
  check_layer_weights(x, D, num_q_heads, num_kv_heads, prepacked, attention_norm_weight,
                      ffn_norm_weight, wqkv, wqkv_bias, wo, w13, w2, /*layer=*/-1);
  check_decode_attention(x, D, num_q_heads, num_kv_heads, k_cache, v_cache, rows, picked, packed,
                         block_table, cache_lens, num_nodes, tree_mask, sm_scale, start);
}

void check_decode_layers(const at::Tensor& x, at::TensorList attention_norm_weights,
                         at::TensorList ffn_norm_weights, double eps, at::TensorList wqkv,
                         const c10::List<std::optional<at::Tensor>>& wqkv_bias, at::TensorList wo,
                         at::TensorList w13, at::TensorList w2, bool prepacked,
                         const at::Tensor& cos, const at::Tensor& sin, int64_t num_q_heads,
                         int64_t num_kv_heads, const at::Tensor& k_cache, const at::Tensor& v_cache,
                         int64_t first_layer, const at::Tensor& rows,
                         const std::optional<at::Tensor>& picked, bool packed,
                         const at::Tensor& block_table, const at::Tensor& cache_lens,
                         const at::Tensor& num_nodes, const at::Tensor& tree_mask,
                         double sm_scale) {
  const int64_t num_layers = static_cast<int64_t>(wqkv.size());
  TORCH_CHECK(num_layers >= 1, "wqkv must hold at least one layer's weight, got none");
  for (const auto& [size, name] :
       {std::pair<size_t, const char*>{attention_norm_weights.size(), "attention_norm_weights"},
        {ffn_norm_weights.size(), "ffn_norm_weights"},
        {wqkv_bias.size(), "wqkv_bias"},
        {wo.size(), "wo"},
        {w13.size(), "w13"},
        {w2.size(), "w2"}}) {
    TORCH_CHECK(static_cast<int64_t>(size) == num_layers, name,
                " must hold one entry per layer (len(wqkv) = ", num_layers, "), got ", size);
  }
  TORCH_CHECK(k_cache.dim() == 5 && v_cache.dim() == 5,
              "k_cache and v_cache must be [num_layers, num_blocks, block_size, Hkv, D], got "
              "shapes ",
              k_cache.sizes(), " and ", v_cache.sizes());
  TORCH_CHECK(first_layer >= 0 && first_layer <= k_cache.size(0) - num_layers,
              "first_layer must be in [0, k_cache.size(0) - len(wqkv)] = [0, ",
              k_cache.size(0) - num_layers, "], got ", first_layer);
  TORCH_CHECK(v_cache.size(0) == k_cache.size(0), "v_cache must hold as many layers as k_cache (",
              k_cache.size(0), "), got ", v_cache.size(0));
  const int64_t D = check_decode_inputs(x, eps, cos, sin, num_q_heads, num_kv_heads);
  for (int64_t i = 0; i < num_layers; ++i) {
    check_layer_weights(x, D, num_q_heads, num_kv_heads, prepacked, attention_norm_weights[i],
                        ffn_norm_weights[i], wqkv[i], wqkv_bias.get(i), wo[i], w13[i], w2[i], i);
  }
  // One layer's cache stands for all: the layers of one tensor share shape, dtype and strides.
  check_decode_attention(x, D, num_q_heads, num_kv_heads, k_cache.select(0, first_layer),
                         v_cache.select(0, first_layer), rows, picked, packed, block_table,
                         cache_lens, num_nodes, tree_mask, sm_scale, /*start=*/0);
}

}  // namespace specdec
