// tree_rejection_sample on CUDA: one fused launch, one CTA per request walking its tree
// exactly as reference.tree_rejection_sample does, consuming the same uniforms.
//
// The residual r of the current node lives in a float scratch row resid[b, :V]; every
// pass over V uses the same thread <-> element mapping (t = tid, tid + blockDim, ...) so a
// thread reads back only what it wrote, and the block reductions (fixed order, common.cuh)
// make every run bitwise reproducible. Per node u the processed target distribution
// p_u (reference.process_logits) is built without sorting:
//   greedy (temperature <= 0):  one-hot on the argmax, ties to the lowest id;
//   otherwise weights w_t = exp((l_t - max l) / temperature), with
//   top-k: keep t iff #{s : l_s > l_t} < k,
//   top-p: keep t iff the weight strictly above w_t is < top_p * (total kept weight),
// both tie-inclusive like the reference. Each threshold is found by bisection over the
// 32-bit order-preserving key of the values (threshold_key): 32 counting passes, exact,
// no sort. Top-p masses are summed in 2^-32 fixed point so those sums are exact integers.
// r is kept unnormalised (the acceptance test and the inverse CDF are scale invariant).
// The kernel is instantiated per (target_logits, draft_probs) dtype pair of float32 /
// float16 / bfloat16 (SPECDEC_DISPATCH_FLOAT_DTYPE); draft_probs of another floating dtype
// are converted to float32 first.
//
// Rows the CPU kernel and the reference reject (NaN, +inf or only -inf logits in a row the walk
// visits): the kernel records the first such node of request b in bad_node[b] (-1: none; a
// fill, so the launch stays CUDA-graph capturable) and the host raises the CPU kernel's error
// when values are checked (should_check_values: SPECDEC_VALIDATE=1 on CUDA, since reading
// bad_node is a host sync), as the Triton kernel does. Otherwise the documented fallback
// applies: NaN logits count as -inf; a row whose maximum is +inf puts equal weight on its +inf
// entries; a row with no finite or +inf entry (all -inf or NaN) is uniform over V before
// top-k / top-p (greedy: token 0). Out-of-range draft tokens are always rejected; num_nodes is
// clamped to [1, T] and a walk never records more than T nodes, so malformed trees give wrong
// samples, never out-of-bounds accesses.
// Element loops over V run on int64 counters: V may be up to 2^31 - 1 (checks.cpp), and an int
// counter would overflow on its last step (t + kThreads) past INT_MAX.
#include <climits>
#include <cmath>

#include "checks.h"
#include "cuda/common.cuh"
#include "dispatch.h"
#include "numeric_constants.h"
#include "ops.h"

namespace specdec {
namespace cuda {
namespace {

constexpr int kThreads = 512;
constexpr int kWarps = kThreads / kWarpSize;
constexpr int kScanItems = 4;  // consecutive elements per thread in the inverse-CDF scan
constexpr float kMassScale = 4294967296.f;  // 2^32 fixed-point units per unit of weight

// logit_t, prob_t: the dtypes of target_logits and draft_probs (float, c10::Half or
// c10::BFloat16; prob_t is float when there are no draft probabilities).
template <typename logit_t, typename prob_t>
struct SampleParams {
  const logit_t* logits;        // [B, T, V]
  const prob_t* draft_probs;    // [B, T, V] or nullptr (point-mass drafts)
  const int32_t* draft_tokens;  // [B, T]
  const int32_t* parents;       // [B, T]
  const int32_t* num_nodes;     // [B]
  const int32_t* top_k;         // [B]
  const float* temperature;     // [B]
  const float* top_p;           // [B]
  const float* uniforms;        // [B, T + 1]
  float* resid;                 // [B, V] scratch
  int32_t* accepted_nodes;      // [B, T]
  int32_t* num_accepted;        // [B]
  int32_t* output_tokens;       // [B, T]
  int32_t* bad_node;            // [B]: first visited node whose logits row is bad (pre-filled -1)
  int T, V;
};

struct ArgMax {
  float value;
  int index;
};
// Found by warp_reduce through argument-dependent lookup.
__device__ __forceinline__ ArgMax shfl_xor(ArgMax a, int offset) {
  return {__shfl_xor_sync(kFullMask, a.value, offset), __shfl_xor_sync(kFullMask, a.index, offset)};
}
struct ArgMaxOp {  // larger value wins, ties go to the lower index (symmetric, so warp-safe)
  __device__ __forceinline__ ArgMax operator()(ArgMax a, ArgMax b) const {
    if (a.value != b.value) return a.value > b.value ? a : b;
    return a.index < b.index ? a : b;
  }
};

// NaN or +inf: a logit that makes its row bad (with only -inf entries the other way to be).
__device__ __forceinline__ bool nan_or_pos_inf(float x) {
  const uint32_t bits = __float_as_uint(x);
  return (bits & 0x7fffffffu) > 0x7f800000u || bits == 0x7f800000u;
}

// NaN -> -inf and -0 -> +0, so that equal logits have equal keys below.
__device__ __forceinline__ float sanitize(float x) {
  uint32_t bits = __float_as_uint(x);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return -INFINITY;
  if ((bits & 0x7fffffffu) == 0u) bits = 0u;
  return __uint_as_float(bits);
}

// Order-preserving key: for sanitised floats, a < b <=> key(a) < key(b).
__device__ __forceinline__ uint32_t order_key(float x) {
  const uint32_t bits = __float_as_uint(x);
  return (bits & 0x80000000u) ? ~bits : (bits | 0x80000000u);
}

__device__ __forceinline__ uint64_t mass_units(float w) {  // w in [0, 1]
  return static_cast<uint64_t>(w * kMassScale);
}

// Unnormalised softmax weight of logit l given the row maximum m; see the fallback above.
__device__ __forceinline__ float softmax_weight(float l, float m, float scale_log2) {
  if (m == INFINITY) return l == INFINITY ? 1.f : 0.f;
  if (m == -INFINITY) return 1.f;
  const float d = l - m;                          // <= 0; -inf for -inf logits
  return d == 0.f ? 1.f : exp2f(d * scale_log2);  // d == 0 first: scale may be +inf
}

__device__ __forceinline__ float block_sum(float v, uint64_t* red) {
  return block_reduce(v, Sum(), reinterpret_cast<float*>(red));
}

// Smallest key K with  sum_{t : key(t) > K} weight(t) < limit  (limit >= 1). That sum is
// non-increasing in K and 0 at K = 2^32 - 1, so 32 bisection steps find K, and then
// {t : key(t) >= K} is exactly {t : sum of the weights with keys above key(t) < limit}.
// key_weight(t, key, weight) gives element t's key and integer weight.
template <typename KeyWeight>
__device__ uint32_t threshold_key(int V, uint64_t limit, KeyWeight key_weight, uint64_t* red) {
  uint32_t lo = 0u, hi = 0xffffffffu;
  while (lo < hi) {
    const uint32_t mid = lo + (hi - lo) / 2;
    uint64_t above = 0;
    for (int64_t t = threadIdx.x; t < V; t += kThreads) {
      uint32_t key;
      uint64_t weight;
      key_weight(t, key, weight);
      if (key > mid) above += weight;
    }
    if (block_reduce(above, Sum(), red) < limit) {
      hi = mid;
    } else {
      lo = mid + 1;
    }
  }
  return lo;
}

// r <- the processed target distribution p_u of node u (unnormalised); returns sum(r) > 0.
// bad_row <- whether the row has a NaN or +inf entry or only -inf entries (the same in every
// thread; the distribution is then the fallback of the header).
template <typename logit_t, typename prob_t>
__device__ float target_dist(const SampleParams<logit_t, prob_t>& p, int b, int u, float* r,
                             uint64_t* red, bool& bad_row) {
  __syncthreads();  // every thread is done reading the previous residual
  const int V = p.V;
  const int64_t row = (int64_t(b) * p.T + u) * V;
  const auto raw_logit = [&](int64_t t) { return to_float(p.logits[row + t]); };
  const auto logit = [&](int64_t t) { return sanitize(raw_logit(t)); };
  const float temperature = p.temperature[b];
  int nonfinite = 0;           // this thread saw a NaN or +inf logit
  if (!(temperature > 0.f)) {  // greedy
    ArgMax best{-INFINITY, INT_MAX};
    for (int64_t t = threadIdx.x; t < V; t += kThreads) {
      const float x = raw_logit(t);
      nonfinite |= nan_or_pos_inf(x);
      best = ArgMaxOp()(best, ArgMax{sanitize(x), int(t)});
    }
    best = block_reduce(best, ArgMaxOp(), reinterpret_cast<ArgMax*>(red));
    bad_row = block_reduce(nonfinite, MaxInt(), reinterpret_cast<int*>(red)) != 0 ||
              best.value == -INFINITY;
    for (int64_t t = threadIdx.x; t < V; t += kThreads) r[t] = t == best.index ? 1.f : 0.f;
    __syncthreads();
    return 1.f;
  }

  float m = -INFINITY;
  for (int64_t t = threadIdx.x; t < V; t += kThreads) {
    const float x = raw_logit(t);
    nonfinite |= nan_or_pos_inf(x);
    m = fmaxf(m, sanitize(x));
  }
  m = block_reduce(m, Max(), reinterpret_cast<float*>(red));
  bad_row = block_reduce(nonfinite, MaxInt(), reinterpret_cast<int*>(red)) != 0 || m == -INFINITY;

  const int top_k = p.top_k[b];
  uint32_t min_key_k = 0u;  // top-k off: every key passes
  if (top_k > 0 && top_k < V) {
    min_key_k = threshold_key(
        V, uint64_t(top_k),
        [&](int64_t t, uint32_t& key, uint64_t& weight) {
          key = order_key(logit(t));
          weight = 1;
        },
        red);
  }
  const float scale_log2 = kLog2e / temperature;
  float sum = 0.f;
  uint64_t mass = 0;
  for (int64_t t = threadIdx.x; t < V; t += kThreads) {
    const float l = logit(t);
    const float w = order_key(l) >= min_key_k ? softmax_weight(l, m, scale_log2) : 0.f;
    r[t] = w;
    sum += w;
    mass += mass_units(w);
  }
  const float top_p = p.top_p[b];
  if (!(top_p < 1.f)) return block_sum(sum, red);  // top-p off

  const uint64_t total = block_reduce(mass, Sum(), red);
  const uint64_t limit =
      std::max<uint64_t>(1, static_cast<uint64_t>(ceil(double(fmaxf(top_p, 0.f)) * double(total))));
  const uint32_t min_key_p = threshold_key(
      V, limit,
      [&](int64_t t, uint32_t& key, uint64_t& weight) {
        const float w = r[t];
        key = order_key(w);
        weight = mass_units(w);
      },
      red);
  sum = 0.f;
  for (int64_t t = threadIdx.x; t < V; t += kThreads) {
    float w = r[t];
    if (order_key(w) < min_key_p) r[t] = w = 0.f;
    sum += w;
  }
  return block_sum(sum, red);
}

// Residual update after rejecting draft token x at node u; returns the new sum(r).
template <typename logit_t, typename prob_t>
__device__ float reject(const SampleParams<logit_t, prob_t>& p, int b, int u, int x, float R,
                        float* r, uint64_t* red) {
  __syncthreads();  // every thread has read r[x] for the acceptance test
  float sum = 0.f;
  if (p.draft_probs == nullptr) {  // point mass: r(x) <- 0
    if (threadIdx.x == 0 && x >= 0 && x < p.V) r[x] = 0.f;
    __syncthreads();
    for (int64_t t = threadIdx.x; t < p.V; t += kThreads) sum += r[t];
  } else {  // r <- max(r / sum(r) - q_u, 0)
    const int64_t row = (int64_t(b) * p.T + u) * p.V;
    for (int64_t t = threadIdx.x; t < p.V; t += kThreads) {
      const float w = fmaxf(r[t] / R - to_float(p.draft_probs[row + t]), 0.f);
      r[t] = w;
      sum += w;
    }
  }
  return block_sum(sum, red);
}

// Exclusive prefix sum of one value per thread, in thread order; total = the block's sum.
__device__ float block_exclusive_scan(float v, float* smem, float& total) {
  const int lane = threadIdx.x % kWarpSize, warp = threadIdx.x / kWarpSize;
  float incl = v;
#pragma unroll
  for (int offset = 1; offset < kWarpSize; offset *= 2) {
    const float y = __shfl_up_sync(kFullMask, incl, offset);
    if (lane >= offset) incl += y;
  }
  float excl = __shfl_up_sync(kFullMask, incl, 1);
  if (lane == 0) excl = 0.f;
  __syncthreads();  // smem may still be read by a previous reduction
  if (lane == kWarpSize - 1) smem[warp] = incl;
  __syncthreads();
  float offset = 0.f;
  total = 0.f;
  for (int w = 0; w < kWarps; ++w) {  // same order in every thread
    if (w == warp) offset = total;
    total += smem[w];
  }
  return offset + excl;
}

// Inverse CDF of r at u: the first t with cumsum(r)[t] > u * sum(r), scanned in chunks of
// kThreads * kScanItems elements; if rounding leaves no such t, the last t with r[t] > 0
// (the reference's rule). r must be fully written (target_dist / reject end in a barrier).
template <typename logit_t, typename prob_t>
__device__ int sample(const SampleParams<logit_t, prob_t>& p, float R, float u, const float* r,
                      uint64_t* red) {
  const float target = u * R;
  float running = 0.f;
  for (int64_t base = 0; base < p.V; base += int64_t(kThreads) * kScanItems) {
    const int64_t i0 = base + int64_t(threadIdx.x) * kScanItems;
    float vals[kScanItems], s = 0.f;
#pragma unroll
    for (int j = 0; j < kScanItems; ++j) {
      vals[j] = i0 + j < p.V ? r[i0 + j] : 0.f;
      s += vals[j];
    }
    float chunk_total;
    float cum = running + block_exclusive_scan(s, reinterpret_cast<float*>(red), chunk_total);
    int hit = INT_MAX;
#pragma unroll
    for (int j = 0; j < kScanItems; ++j) {
      cum += vals[j];
      if (hit == INT_MAX && vals[j] > 0.f && cum > target) hit = int(i0 + j);
    }
    hit = block_reduce(hit, Min(), reinterpret_cast<int*>(red));
    if (hit != INT_MAX) return hit;
    running += chunk_total;
  }
  int last = -1;
  for (int64_t t = threadIdx.x; t < p.V; t += kThreads) {
    if (r[t] > 0.f) last = int(t);
  }
  last = block_reduce(last, MaxInt(), reinterpret_cast<int*>(red));
  return last >= 0 ? last : 0;
}

template <typename logit_t, typename prob_t>
__global__ void __launch_bounds__(kThreads)
    tree_rejection_sample_kernel(const SampleParams<logit_t, prob_t> p) {
  __shared__ uint64_t red[kWarps];  // reduction scratch (also viewed as float / int / ArgMax)
  const int b = blockIdx.x, T = p.T;
  float* r = p.resid + int64_t(b) * p.V;
  const int32_t* parents = p.parents + int64_t(b) * T;
  const int32_t* tokens = p.draft_tokens + int64_t(b) * T;
  const float* uniforms = p.uniforms + int64_t(b) * (T + 1);
  int32_t* path = p.accepted_nodes + int64_t(b) * T;
  int32_t* out = p.output_tokens + int64_t(b) * T;
  const int n = min(max(p.num_nodes[b], 1), T);

  for (int i = threadIdx.x; i < T; i += kThreads) path[i] = out[i] = -1;
  __syncthreads();  // padding first, then thread 0 writes the path over it
  if (threadIdx.x == 0) path[0] = 0;

  // All threads take every branch below together: each decision depends only on values
  // that block reductions broadcast or on the same global reads in every thread.
  int u = 0, len = 1;
  bool bad_row = false;
  float R = target_dist(p, b, u, r, red, bad_row);
  int first_bad = bad_row ? u : -1;  // the first visited node whose row is bad
  while (len < T) {
    int next = -1;
    for (int c = 1; c < n; ++c) {  // children of u in index order
      if (parents[c] != u) continue;
      const int x = tokens[c];
      const bool valid = x >= 0 && x < p.V;
      float q_x = 1.f;
      if (p.draft_probs != nullptr) {
        q_x = valid ? to_float(p.draft_probs[(int64_t(b) * T + u) * p.V + x]) : 0.f;
      }
      const float r_x = valid ? r[x] : 0.f;
      if (valid && double(uniforms[c]) * double(q_x) * double(R) < double(r_x)) {
        next = c;
        break;
      }
      R = reject(p, b, u, x, R, r, red);
      // r lost all mass: reset to p_u (row u was checked when the walk reached u)
      if (!(R > 0.f)) R = target_dist(p, b, u, r, red, bad_row);
    }
    if (next < 0) break;
    u = next;
    if (threadIdx.x == 0) {
      path[len] = u;
      out[len - 1] = tokens[u];
    }
    ++len;
    R = target_dist(p, b, u, r, red, bad_row);
    if (bad_row && first_bad < 0) first_bad = u;
  }
  const int bonus = sample(p, R, uniforms[T], r, red);
  if (threadIdx.x == 0) {
    out[len - 1] = bonus;
    p.num_accepted[b] = len - 1;
    if (first_bad >= 0) p.bad_node[b] = first_bad;
  }
}

}  // namespace
}  // namespace cuda

std::tuple<at::Tensor, at::Tensor, at::Tensor> tree_rejection_sample_cuda(
    const at::Tensor& target_logits, const at::Tensor& draft_tokens, const at::Tensor& parents,
    const at::Tensor& num_nodes, const std::optional<at::Tensor>& draft_probs,
    const at::Tensor& temperature, const at::Tensor& top_k, const at::Tensor& top_p,
    const at::Tensor& uniforms) {
  using namespace cuda;
  const at::cuda::OptionalCUDAGuard guard(target_logits.device());
  const int64_t B = target_logits.size(0), T = target_logits.size(1), V = target_logits.size(2);
  TORCH_CHECK(T < (int64_t(1) << 30), "tree_rejection_sample (CUDA): T = ", T, " is too large");
  TORCH_CHECK(B < (int64_t(1) << 31),
              "tree_rejection_sample (CUDA): the batch size B of target_logits must be < 2^31, "
              "got ",
              B);
  const auto iopts = target_logits.options().dtype(at::kInt);
  at::Tensor accepted_nodes = at::empty({B, T}, iopts);
  at::Tensor num_accepted = at::empty({B}, iopts);
  at::Tensor output_tokens = at::empty({B, T}, iopts);
  at::Tensor bad_node = at::full({B}, -1, iopts);  // a fill: no sync, capturable
  at::Tensor resid = at::empty({B, V}, target_logits.options().dtype(at::kFloat));
  at::Tensor dp;
  if (draft_probs.has_value()) {
    dp = *draft_probs;
    const auto st = dp.scalar_type();
    if (st != at::kFloat && st != at::kHalf && st != at::kBFloat16) dp = dp.to(at::kFloat);
    dp = dp.contiguous();
  }
  SPECDEC_DISPATCH_FLOAT_DTYPE(target_logits.scalar_type(), logit_t, {
    SPECDEC_DISPATCH_FLOAT_DTYPE(dp.defined() ? dp.scalar_type() : at::kFloat, prob_t, {
      SampleParams<logit_t, prob_t> p{};
      p.logits = static_cast<const logit_t*>(target_logits.data_ptr());
      p.draft_probs = dp.defined() ? static_cast<const prob_t*>(dp.data_ptr()) : nullptr;
      p.draft_tokens = draft_tokens.data_ptr<int32_t>();
      p.parents = parents.data_ptr<int32_t>();
      p.num_nodes = num_nodes.data_ptr<int32_t>();
      p.top_k = top_k.data_ptr<int32_t>();
      p.temperature = temperature.data_ptr<float>();
      p.top_p = top_p.data_ptr<float>();
      p.uniforms = uniforms.data_ptr<float>();
      p.resid = resid.data_ptr<float>();
      p.accepted_nodes = accepted_nodes.data_ptr<int32_t>();
      p.num_accepted = num_accepted.data_ptr<int32_t>();
      p.output_tokens = output_tokens.data_ptr<int32_t>();
      p.bad_node = bad_node.data_ptr<int32_t>();
      p.T = int(T);
      p.V = int(V);
      tree_rejection_sample_kernel<logit_t, prob_t>
          <<<unsigned(B), kThreads, 0, at::cuda::getCurrentCUDAStream()>>>(p);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    });
  });
  if (should_check_values(target_logits)) {  // SPECDEC_VALIDATE=1: the host sync is allowed
    const at::Tensor bad = bad_node.cpu();
    const int32_t* node = bad.data_ptr<int32_t>();
    for (int64_t b = 0; b < B; ++b) {
      // The CPU kernel's message (csrc/cpu/rejection.cpp, check_row), so both raise alike.
      TORCH_CHECK(node[b] < 0, "target_logits[", b, ", ", node[b],
                  "] has NaN, +inf or only -inf entries (a row the rejection walk visits must "
                  "have a finite maximum)");
    }
  }
  return {accepted_nodes, num_accepted, output_tokens};
}

}  // namespace specdec
