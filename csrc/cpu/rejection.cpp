// tree_rejection_sample on CPU: one task per request walks its draft tree from the root,
// following the rule of reference.tree_rejection_sample, and processes only the target rows
// the walk visits.
//
// A processed row is kept sparse: its support (the top-k / top-p survivors, token ids in
// ascending order) with unnormalised float64 probabilities, and the residual aligned with it.
// Neither filter sorts the vocabulary: the k-th largest logit comes from a size-k heap (or
// nth_element for large k); the top-p threshold from a log-scale histogram of the mass,
// then a weighted quickselect inside the one bucket where the cut falls. Greedy rows
// (temperature 0) only need their argmax. Logits are read as float32; probabilities are
// computed and accumulated in float64 (a float32 exp would move them by ~1e-6 relative, and
// the decisions with them), so the accept / reject decisions and the sampled token agree
// with the float64 reference unless a uniform falls within ~1e-15 of a decision boundary.
#include <ATen/Dispatch_v2.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <memory>
#include <numeric>

#include "ops.h"

namespace specdec {
namespace {

constexpr double kNegInf = -std::numeric_limits<double>::infinity();
// Largest top_k selected with a heap (one pass over the row, O(V log k) worst case); larger
// k use nth_element on a copy of the row (O(V)).
constexpr int64_t kMaxHeapTopK = 1024;
// A residual sum obtained by subtraction is recomputed when it shrinks below this fraction
// of its previous value, before the cancellation costs more than ~10 bits of precision.
constexpr double kCancellation = 1.0 / 1024;
// Top-p histogram: 128 buckets per octave over 32 octaves below probability 1.
constexpr int kBucketShift = 52 - 7;
constexpr int64_t kBuckets = 32 << 7;
constexpr uint64_t kOneBits = 0x3FF0000000000000ull;  // the bits of 1.0

// Per-task buffers of V entries: the current row's support (token ids, probabilities) and its
// residual. The residual buffer and tmp are scratch while a row is being processed.
struct Scratch {
  explicit Scratch(int64_t V)
      : tok(new int32_t[V]), p(new double[V]), r(new double[V]), tmp(new double[V]),
        hist(new double[kBuckets]) {}
  std::unique_ptr<int32_t[]> tok;
  std::unique_ptr<double[]> p, r, tmp;
  std::unique_ptr<double[]> hist;  // [kBuckets], top-p mass histogram
};

// Sampling parameters of one request.
struct Params {
  double temperature;
  int64_t top_k;
  double top_p;
};

// Draft probabilities [B, T, V] of any floating dtype, read in place.
struct DraftProbs {
  const void* data = nullptr;  // nullptr: point-mass drafts
  at::ScalarType dtype = at::kFloat;
  int64_t V = 0;
};

#define SPECDEC_DRAFT_DTYPES AT_EXPAND(AT_FLOATING_TYPES), at::kHalf, at::kBFloat16, \
                             AT_EXPAND(AT_FLOAT8_TYPES)

// q(x) of draft row `row` (= b * T + node).
double draft_prob(const DraftProbs& dp, int64_t row, int32_t x) {
  double q = 0.0;
  AT_DISPATCH_V2(dp.dtype, "tree_rejection_sample", AT_WRAP([&] {
    q = static_cast<double>(static_cast<const scalar_t*>(dp.data)[row * dp.V + x]);
  }), SPECDEC_DRAFT_DTYPES);
  return q;
}

// r <- max(r / rsum - q, 0) over the support (r is 0 elsewhere and stays 0: q >= 0);
// returns the new sum. NaN propagates as in torch.clamp, so a NaN draft row triggers the reset.
double subtract_draft(const DraftProbs& dp, int64_t row, const int32_t* tok, double* r,
                      int64_t n, double rsum) {
  double sum = 0.0;
  AT_DISPATCH_V2(dp.dtype, "tree_rejection_sample", AT_WRAP([&] {
    const scalar_t* q = static_cast<const scalar_t*>(dp.data) + row * dp.V;
    for (int64_t i = 0; i < n; ++i) {
      const double v = r[i] / rsum - static_cast<double>(q[tok[i]]);
      r[i] = v < 0.0 ? 0.0 : v;
      sum += r[i];
    }
  }), SPECDEC_DRAFT_DTYPES);
  return sum;
}

void check_row(bool ok, int64_t b, int64_t node) {
  TORCH_CHECK(ok, "target_logits[", b, ", ", node,
              "] has NaN, +inf or only -inf entries (a row the rejection walk visits must have "
              "a finite maximum)");
}

// First index of the largest logit; throws on a NaN / +inf / all -inf row.
template <typename scalar_t>
int32_t argmax_checked(const scalar_t* row, int64_t V, int64_t b, int64_t node) {
  float best = -std::numeric_limits<float>::infinity();
  int32_t arg = 0;
  bool nan = false;
  for (int64_t t = 0; t < V; ++t) {
    const float x = static_cast<float>(row[t]);
    nan |= x != x;
    if (x > best) {
      best = x;
      arg = static_cast<int32_t>(t);
    }
  }
  check_row(!nan && std::isfinite(best), b, node);
  return arg;
}

// Max logit of a row, and its top-k cut: the k-th largest logit (duplicates counted) when
// 0 < k < V, else -inf. Throws on a NaN / +inf / all -inf row. scratch holds >= V doubles.
template <typename scalar_t>
std::pair<double, double> max_and_cut(const scalar_t* row, int64_t V, int64_t k, double* scratch,
                                      int64_t b, int64_t node) {
  bool nan = false;
  double max = kNegInf, cut = kNegInf;
  if (k <= 0 || k >= V) {
    for (int64_t t = 0; t < V; ++t) {
      const double x = static_cast<float>(row[t]);
      nan |= x != x;
      max = x > max ? x : max;
    }
  } else if (k > kMaxHeapTopK) {
    for (int64_t t = 0; t < V; ++t) {
      scratch[t] = static_cast<float>(row[t]);
      nan |= scratch[t] != scratch[t];
    }
    if (!nan) {  // nth_element needs a strict weak order
      std::nth_element(scratch, scratch + k - 1, scratch + V, std::greater<double>());
      cut = scratch[k - 1];
      max = *std::max_element(scratch, scratch + k);
    }
  } else {
    // Min-heap of the k largest logits so far: almost every logit fails the first comparison.
    double* heap = scratch;
    for (int64_t t = 0; t < k; ++t) {
      heap[t] = static_cast<float>(row[t]);
      nan |= heap[t] != heap[t];
    }
    std::make_heap(heap, heap + k, std::greater<double>());
    for (int64_t t = k; t < V; ++t) {
      const double x = static_cast<float>(row[t]);
      nan |= x != x;
      if (x > heap[0]) {
        std::pop_heap(heap, heap + k, std::greater<double>());
        heap[k - 1] = x;
        std::push_heap(heap, heap + k, std::greater<double>());
      }
    }
    cut = heap[0];
    max = *std::max_element(heap, heap + k);
  }
  check_row(!nan && std::isfinite(max), b, node);
  return {max, cut};
}

// Log-scale bucket of a probability in (0, 1]: 128 buckets per factor of 2
// below 1 (the bit pattern of a positive double is monotone in its value), the last bucket
// holding everything smaller, zeros included.
int64_t bucket_of(double v) {
  uint64_t bits;
  std::memcpy(&bits, &v, sizeof(bits));
  const int64_t k = static_cast<int64_t>(kOneBits >> kBucketShift) -
                    static_cast<int64_t>(bits >> kBucketShift);
  return std::clamp<int64_t>(k, 0, kBuckets - 1);
}

// Weighted quickselect over candidates in[0, n) that all lie below `above` worth of larger
// values: the smallest candidate whose strictly larger values (candidates or not) hold less
// than `mass`, or -inf if none. Each round splits the candidates around a random pivot x,
// without branches, into those > x (written from the front of `out`) and those < x (from
// its back); the values equal to x only count. out / spare hold >= n doubles each.
double select_cut(const double* in, int64_t n, double above, double mass, double* out,
                  double* spare) {
  double tau = kNegInf;
  uint64_t rng = 0x9E3779B97F4A7C15ull ^ static_cast<uint64_t>(n);
  while (n > 0) {
    rng ^= rng << 13, rng ^= rng >> 7, rng ^= rng << 17;
    const double x = in[rng % static_cast<uint64_t>(n)];
    int64_t n_gt = 0, n_lt = 0;
    double mass_gt = 0.0;
    for (int64_t i = 0; i < n; ++i) {
      // n_gt + n_lt <= i: neither store overwrites a value already placed
      const double v = in[i];
      out[n_gt] = v;
      out[n - 1 - n_lt] = v;
      n_gt += v > x;
      n_lt += v < x;
      mass_gt += v > x ? v : 0.0;
    }
    if (above + mass_gt >= mass) {  // x is cut: the answer is among the larger values
      in = out;
      n = n_gt;
    } else {  // x is kept: try the smaller values
      tau = x;
      above += mass_gt + x * static_cast<double>(n - n_gt - n_lt);
      if (above >= mass) break;
      in = out + n - n_lt;
      n = n_lt;
    }
    std::swap(out, spare);
  }
  return tau;
}

// The top-p cut of probabilities p[0, n) in (0, 1]: the smallest value tau whose strictly
// larger values hold less than `mass` (so the kept set {p >= tau} keeps ties, as the
// reference does). A log-scale histogram of the mass finds the bucket where the cumulative
// mass from the top reaches `mass`; only that bucket's values go through select_cut.
double top_p_threshold(const double* p, int64_t n, double mass, Scratch& s) {
  double* hist = s.hist.get();
  std::fill(hist, hist + kBuckets, 0.0);
  for (int64_t i = 0; i < n; ++i) hist[bucket_of(p[i])] += p[i];
  double above = 0.0;  // every value of the buckets before j is above every value of bucket j
  int64_t j = 0;
  for (; j < kBuckets - 1 && above + hist[j] < mass; ++j) above += hist[j];
  double* cand = s.r.get();
  int64_t m = 0;
  for (int64_t i = 0; i < n; ++i) {
    cand[m] = p[i];
    m += bucket_of(p[i]) == j;
  }
  return select_cut(cand, m, above, mass, s.tmp.get(), cand);
}

// Support of one row of the processed distribution (reference.process_logits, unnormalised):
// writes s.tok / s.p [0, n), returns n and sets sum.
template <typename scalar_t>
int64_t process_row(const scalar_t* row, int64_t V, const Params& prm, int64_t b, int64_t node,
                    Scratch& s, double& sum) {
  const auto [max, cut] = max_and_cut(row, V, prm.top_k, s.r.get(), b, node);
  // softmax(logits / temperature) restricted to the top-k survivors (all tokens if off)
  const double zmax = max / prm.temperature;
  int32_t* tok = s.tok.get();
  double* p = s.p.get();
  int64_t n = 0;
  sum = 0.0;
  for (int64_t t = 0; t < V; ++t) {
    const double x = static_cast<float>(row[t]);
    if (x >= cut) {
      tok[n] = static_cast<int32_t>(t);
      p[n] = std::exp(x / prm.temperature - zmax);
      sum += p[n++];
    }
  }
  if (prm.top_p < 1.0) {
    const double tau = top_p_threshold(p, n, prm.top_p * sum, s);
    int64_t kept = 0;
    sum = 0.0;
    for (int64_t i = 0; i < n; ++i) {
      if (p[i] >= tau) {
        tok[kept] = tok[i];
        p[kept] = p[i];
        sum += p[kept++];
      }
    }
    n = kept;
  }
  return n;
}

// Inverse CDF in token order: the first token whose cumulative mass exceeds u * total.
int32_t sample(const int32_t* tok, const double* r, int64_t n, double u) {
  double total = 0.0;
  for (int64_t i = 0; i < n; ++i) total += r[i];
  const double target = u * total;
  double cum = 0.0;
  for (int64_t i = 0; i < n; ++i) {
    cum += r[i];
    if (cum > target) return tok[i];
  }
  for (int64_t i = n - 1; i >= 0; --i) {  // u * total rounded up to the total
    if (r[i] > 0.0) return tok[i];
  }
  return tok[n - 1];
}

// One request's inputs and outputs.
struct Request {
  int64_t b, T, V;
  const int32_t* draft;    // [T]
  const int32_t* parents;  // [T]
  int32_t num_nodes;
  const float* uniforms;  // [T + 1]
  Params prm;
  int32_t* accepted;  // [T], pre-filled with -1
  int32_t* tokens;    // [T], pre-filled with -1
  int32_t* num_accepted;
};

// Next child of u after `after` in index order, or -1.
int64_t next_child(const Request& rq, int64_t u, int64_t after) {
  for (int64_t c = std::max(after, u) + 1; c < rq.num_nodes; ++c) {
    if (rq.parents[c] == u) return c;
  }
  return -1;
}

// Greedy: the processed rows are one-hot, so the rule accepts the first child whose token is
// the argmax and emits the argmax as the bonus token (given draft probabilities <= 1).
template <typename scalar_t>
void walk_greedy(const scalar_t* logits, const Request& rq) {
  int64_t u = 0, k = 0;
  rq.accepted[0] = 0;
  while (true) {
    const int32_t a = argmax_checked(logits + u * rq.V, rq.V, rq.b, u);
    int64_t c = next_child(rq, u, -1);
    while (c >= 0 && rq.draft[c] != a) c = next_child(rq, u, c);
    rq.tokens[k] = a;
    if (c < 0) break;
    u = c;
    rq.accepted[++k] = static_cast<int32_t>(c);
  }
  *rq.num_accepted = static_cast<int32_t>(k);
}

template <typename scalar_t>
void walk_sampled(const scalar_t* logits, const DraftProbs& dp, const Request& rq, Scratch& s) {
  const int32_t* tok = s.tok.get();
  const double* p = s.p.get();
  double* r = s.r.get();
  int64_t u = 0, k = 0;
  rq.accepted[0] = 0;
  double psum = 0.0;
  int64_t n = process_row(logits, rq.V, rq.prm, rq.b, 0, s, psum);
  std::copy(p, p + n, r);
  double rsum = psum;
  while (true) {
    int64_t next = -1;
    for (int64_t c = next_child(rq, u, -1); c >= 0; c = next_child(rq, u, c)) {
      const int32_t x = rq.draft[c];
      const int64_t i = std::lower_bound(tok, tok + n, x) - tok;
      const bool in_support = i < n && tok[i] == x;
      const double rx = in_support ? r[i] : 0.0;
      const double qx = dp.data ? draft_prob(dp, rq.b * rq.T + u, x) : 1.0;
      if (static_cast<double>(rq.uniforms[c]) * qx * rsum < rx) {
        next = c;
        break;
      }
      if (dp.data) {
        rsum = subtract_draft(dp, rq.b * rq.T + u, tok, r, n, rsum);
      } else if (in_support) {
        r[i] = 0.0;
        const double left = rsum - rx;
        rsum = left < rsum * kCancellation ? std::accumulate(r, r + n, 0.0) : left;
      }
      if (!(rsum > 0.0)) {  // inconsistent draft probabilities emptied the residual
        std::copy(p, p + n, r);
        rsum = psum;
      }
    }
    if (next < 0) break;
    u = next;
    rq.accepted[++k] = static_cast<int32_t>(u);
    rq.tokens[k - 1] = rq.draft[u];
    n = process_row(logits + u * rq.V, rq.V, rq.prm, rq.b, u, s, psum);
    std::copy(p, p + n, r);
    rsum = psum;
  }
  rq.tokens[k] = sample(tok, r, n, static_cast<double>(rq.uniforms[rq.T]));
  *rq.num_accepted = static_cast<int32_t>(k);
}

}  // namespace

std::tuple<at::Tensor, at::Tensor, at::Tensor> tree_rejection_sample_cpu(
    const at::Tensor& target_logits, const at::Tensor& draft_tokens,
    const at::Tensor& parents, const at::Tensor& num_nodes,
    const std::optional<at::Tensor>& draft_probs, const at::Tensor& temperature,
    const at::Tensor& top_k, const at::Tensor& top_p, const at::Tensor& uniforms) {
  const int64_t B = target_logits.size(0), T = target_logits.size(1), V = target_logits.size(2);
  const auto opts = target_logits.options().dtype(at::kInt);
  at::Tensor accepted = at::full({B, T}, -1, opts);
  at::Tensor num_accepted = at::empty({B}, opts);
  at::Tensor tokens = at::full({B, T}, -1, opts);
  DraftProbs dp;
  if (draft_probs.has_value()) dp = {draft_probs->data_ptr(), draft_probs->scalar_type(), V};
  const int32_t* draft = draft_tokens.data_ptr<int32_t>();
  const int32_t* par = parents.data_ptr<int32_t>();
  const int32_t* nn = num_nodes.data_ptr<int32_t>();
  const float* temp = temperature.data_ptr<float>();
  const int32_t* tk = top_k.data_ptr<int32_t>();
  const float* tp = top_p.data_ptr<float>();
  const float* uni = uniforms.data_ptr<float>();
  int32_t* acc = accepted.data_ptr<int32_t>();
  int32_t* na = num_accepted.data_ptr<int32_t>();
  int32_t* out = tokens.data_ptr<int32_t>();
  AT_DISPATCH_V2(target_logits.scalar_type(), "tree_rejection_sample_cpu", AT_WRAP([&] {
    const scalar_t* logits = target_logits.data_ptr<scalar_t>();
    at::parallel_for(0, B, 1, [&](int64_t b0, int64_t b1) {
      std::unique_ptr<Scratch> s;  // only sampled requests need it
      for (int64_t b = b0; b < b1; ++b) {
        const Request rq{b, T, V, draft + b * T, par + b * T, nn[b], uni + b * (T + 1),
                         Params{temp[b], tk[b], tp[b]}, acc + b * T, out + b * T, na + b};
        const scalar_t* rows = logits + b * T * V;
        if (temp[b] == 0.f) {
          walk_greedy(rows, rq);
          continue;
        }
        if (!s) s = std::make_unique<Scratch>(V);
        walk_sampled(rows, dp, rq, *s);
      }
    });
  }), at::kFloat, at::kHalf, at::kBFloat16);
  return {accepted, num_accepted, tokens};
}

}  // namespace specdec
