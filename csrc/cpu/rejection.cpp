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
// with the float64 reference unless a uniform falls within ~1e-15 of a decision boundary
// (scaled by |logit / temperature|: the logits are multiplied by 1 / temperature).
//
// The per-token loops (row max, softmax, draft subtraction, sums, the sampling scan) run on
// GCC vectors of LANES doubles (vec.h) with a vectorised float64 exp (<= 1.05 ulp), compiled for
// AVX-512 (LANES = 8), AVX2 + FMA (LANES = 4) and the baseline ISA (LANES = 2); the best build the
// CPU runs is picked at run time (pick_walk), the logit and draft dtypes with the
// SPECDEC_DISPATCH_* macros (dispatch.h). Rows without a top-k / top-p filter keep every
// token (a dense support: no token ids). The residual starts as the row's probabilities
// themselves and is written only when a rejection changes it.
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <memory>
#include <type_traits>

#include "dispatch.h"
#include "isa.h"
#include "ops.h"
#include "vec.h"

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
// residual. The residual buffer and tmp are scratch while a row is being processed; tmp
// holds the block sums of the final sampling scan.
struct Scratch {
  explicit Scratch(int64_t V)
      : tok(new int32_t[V]),
        p(new double[V]),
        r(new double[V]),
        tmp(new double[V]),
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

// Draft probabilities [B, T, V] of any floating dtype (SPECDEC_DISPATCH_PROB_DTYPE), read
// in place.
struct DraftProbs {
  const void* data = nullptr;  // nullptr: point-mass drafts
  at::ScalarType dtype = at::kFloat;
  int64_t V = 0;
};

// L logits at p as floats: float32 as they are, bfloat16 widened lane by lane in a vector (a
// scalar conversion per element made a bf16 argmax 3x slower than a float32 one, with half
// the bytes to read), float16 one by one.
template <int L, typename scalar_t>
SPECDEC_INLINE typename Simd<L>::f load_logits(const scalar_t* p) {
  if constexpr (std::is_same_v<scalar_t, float>) {
    return load<L>(p);
  } else if constexpr (std::is_same_v<scalar_t, c10::BFloat16>) {
    return widen_bf16<L>(reinterpret_cast<const uint16_t*>(p));
  } else {
    typename Simd<L>::f v;
    for (int j = 0; j < L; ++j) v[j] = static_cast<float>(p[j]);
    return v;
  }
}

// ---------------------------------------------------------------- vectors of LANES doubles
// LANES values of p as doubles (logits go through float, as the scalar code reads them).
template <int LANES, typename T>
SPECDEC_INLINE typename Simd<LANES>::d load_f64(const T* p) {
  if constexpr (std::is_same_v<T, double>) {
    return load<LANES>(p);
  } else {
    return __builtin_convertvector(load_logits<LANES>(p), typename Simd<LANES>::d);
  }
}
// Lanes [0, m) from p, the others `fill`.
template <int LANES, typename T>
SPECDEC_INLINE typename Simd<LANES>::d load_part(const T* p, int64_t m, double fill) {
  typename Simd<LANES>::d v = splat<LANES>(fill);
  for (int64_t j = 0; j < m; ++j) v[j] = static_cast<float>(p[j]);
  return v;
}
template <int LANES>
SPECDEC_INLINE typename Simd<LANES>::d load_part(const double* p, int64_t m, double fill) {
  typename Simd<LANES>::d v = splat<LANES>(fill);
  for (int64_t j = 0; j < m; ++j) v[j] = p[j];
  return v;
}

// exp(x) in float64 within 1.05 ulp: Cody-Waite reduction x = k ln2 + r, |r| <= ln2 / 2 (ln2
// split in a 32-bit head, so that k * head is exact, and a tail), exp(r) = 1 + r + r^2 Q(r)
// with Q the degree-9 Chebyshev fit of (exp(r) - 1 - r) / r^2 (|error| * r^2 < 2e-17), then
// 2^k applied as two exact power-of-two factors, so that subnormal results are rounded once
// and x <= -745.2 (-inf included) gives 0. kTiny = false: only for x in [-708, 709], where
// 2^k is normal and one factor does.
template <int LANES, bool kTiny>
SPECDEC_INLINE typename Simd<LANES>::d vexp(typename Simd<LANES>::d x) {
  using vd = typename Simd<LANES>::d;
  using vu = typename Simd<LANES>::u64;
  const vd lo = splat<LANES>(-1100.0);  // exp underflows to 0 well above; keeps inf - inf away
  const vd xc = x < lo ? lo : x;
  // Adding 1.5 * 2^52 rounds to an integer k, which then sits in the low mantissa bits.
  const vd round = splat<LANES>(6755399441055744.0);
  const vd shifted = xc * 1.4426950408889634 + round;
  const vd k = shifted - round;
  const vd r = (xc - k * 6.93147180369123816490e-01) - k * 1.90821492927058770002e-10;
  vd q = splat<LANES>(2.5100375929185925e-08);
  q = q * r + 2.762007600563138e-07;
  q = q * r + 2.7557268480106926e-06;
  q = q * r + 2.480152132210459e-05;
  q = q * r + 0.00019841269863040675;
  q = q * r + 0.001388888891719689;
  q = q * r + 0.008333333333330065;
  q = q * r + 0.041666666666624164;
  q = q * r + 0.16666666666666669;
  q = q * r + 0.5000000000000001;
  const vd e = (r + r * r * q) + 1.0;  // the small part first: one rounding at the end
  vu kb;
  __builtin_memcpy(&kb, &shifted, sizeof(kb));
  kb = kb - 0x4338000000000000ull;  // k (0x4338... = the bits of `round`)
  if constexpr (!kTiny) {           // 2^k is normal: one factor
    const vu bits = (kb + 1023) << 52;
    vd scale;
    __builtin_memcpy(&scale, &bits, sizeof(scale));
    return e * scale;
  }
  // k + 2048 in [461, 3072] (x in [-1100, 709.8]) split into halves k1 + k2, each a normal
  // power of two (biased exponents k1 + 1023, k2 + 1023 in [1, 2046]).
  kb += 2048;
  const vu h = kb >> 1;
  const vu b1 = (h + (1023 - 1024)) << 52;
  const vu b2 = (kb - h + (1023 - 1024)) << 52;
  vd s1, s2;
  __builtin_memcpy(&s1, &b1, sizeof(s1));
  __builtin_memcpy(&s2, &b2, sizeof(s2));
  return e * s1 * s2;
}

// Sum of v[0, n).
template <int LANES>
SPECDEC_INLINE double sum_of(const double* v, int64_t n) {
  typename Simd<LANES>::d acc{};
  int64_t i = 0;
  for (; i + LANES <= n; i += LANES) acc += load<LANES>(v + i);
  return hsum<LANES>(acc + load_part<LANES>(v + i, n - i, 0.0));
}

// ---------------------------------------------------------------- one row
void check_row(bool ok, int64_t b, int64_t node) {
  TORCH_CHECK(ok, "target_logits[", b, ", ", node,
              "] has NaN, +inf or only -inf entries (a row the rejection walk visits must have "
              "a finite maximum)");
}

// First index of the largest logit; throws on a NaN / +inf / all -inf row. Vectors of
// 2 LANES floats, each lane keeping its first largest value and its index; the lanes' tie
// goes to the smallest index, so the result is the scalar scan's.
template <int LANES, typename scalar_t>
SPECDEC_INLINE int32_t argmax_checked(const scalar_t* row, int64_t V, int64_t b, int64_t node) {
  constexpr int L = 2 * LANES;
  using vf = typename Simd<L>::f;
  using vi = typename Simd<L>::i32;
  const vf neg_inf = vf{} - std::numeric_limits<float>::infinity();
  vf best = neg_inf;
  vi arg{}, index{}, nan{};
  for (int j = 0; j < L; ++j) index[j] = j;
  for (int64_t t = 0; t < V; t += L) {  // V < 2^31 (checks.cpp): t fits int32
    vf x = neg_inf;                     // a partial vector is padded with -inf, never taken
    if (t + L <= V) {
      x = load_logits<L>(row + t);
    } else {
      for (int64_t j = 0; j < std::min<int64_t>(L, V - t); ++j)
        x[j] = static_cast<float>(row[t + j]);
    }
    nan |= x != x;
    const vi larger = x > best;
    best = larger ? x : best;
    arg = larger ? index : arg;
    index += L;
  }
  float hi = best[0];
  int32_t a = arg[0];
  bool any_nan = nan[0] != 0;
  for (int j = 1; j < L; ++j) {
    if (best[j] > hi || (best[j] == hi && arg[j] < a)) {
      hi = best[j];
      a = arg[j];
    }
    any_nan |= nan[j] != 0;
  }
  check_row(!any_nan && std::isfinite(hi), b, node);
  return a;
}

// (min, max) logit of a row; throws on a NaN / +inf / all -inf row. Vectors of 2 LANES floats.
template <int LANES, typename scalar_t>
SPECDEC_INLINE std::pair<double, double> row_range(const scalar_t* row, int64_t V, int64_t b,
                                                   int64_t node) {
  constexpr int L = 2 * LANES;
  using vf = typename Simd<L>::f;
  vf min = vf{} + static_cast<float>(row[0]), max = min;
  typename Simd<L>::i32 nan{};
  for (int64_t t = 0; t < V; t += L) {
    vf x = min;  // a partial vector is padded with values already seen
    if (t + L <= V) {
      x = load_logits<L>(row + t);
    } else {
      for (int64_t j = 0; j < std::min<int64_t>(L, V - t); ++j)
        x[j] = static_cast<float>(row[t + j]);
    }
    nan |= x != x;
    max = x > max ? x : max;
    min = x < min ? x : min;
  }
  float lo = min[0], hi = max[0];
  bool any_nan = false;
  for (int j = 0; j < L; ++j) {
    lo = min[j] < lo ? min[j] : lo;
    hi = max[j] > hi ? max[j] : hi;
    any_nan |= nan[j] != 0;
  }
  check_row(!any_nan && std::isfinite(hi), b, node);
  return {lo, hi};
}

// The top-k cut of a row: the k-th largest logit (duplicates counted), 0 < k < V. Throws on a
// NaN / +inf / all -inf row. scratch holds >= V doubles. Returns (max, cut).
template <typename scalar_t>
std::pair<double, double> max_and_cut(const scalar_t* row, int64_t V, int64_t k, double* scratch,
                                      int64_t b, int64_t node) {
  bool nan = false;
  double max = kNegInf, cut = kNegInf;
  if (k > kMaxHeapTopK) {
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

// out[i] = exp(in[i] / temperature - max / temperature) for i < n (in may alias out); returns
// their sum. The logits are multiplied by 1 / temperature: within 1 ulp of the reference's
// division (a relative change of |logit / temperature| * 1.1e-16 in a probability), and the
// max logit still gives exp(0) = 1 exactly. kTiny: some exponent may fall below -708.
template <int LANES, bool kTiny, typename T>
SPECDEC_INLINE double softmax_terms(const T* in, int64_t n, double inv, double zmax, double* out) {
  using vd = typename Simd<LANES>::d;
  vd acc{};
  int64_t i = 0;
  for (; i + LANES <= n; i += LANES) {
    const vd e = vexp<LANES, kTiny>(load_f64<LANES>(in + i) * inv - zmax);
    store(out + i, e);
    acc += e;
  }
  if (i == n) return hsum<LANES>(acc);
  const vd e =
      vexp<LANES, kTiny>(load_part<LANES>(in + i, n - i, in[i]) * inv - zmax);  // pad: in[i]
  store_part(out + i, e, n - i);
  double sum = hsum<LANES>(acc);
  for (int64_t j = 0; j < n - i; ++j) sum += e[j];
  return sum;
}

// softmax_terms for logits in [min, max].
template <int LANES, typename T>
SPECDEC_INLINE double softmax_terms(const T* in, int64_t n, double temperature, double min,
                                    double max, double* out) {
  const double inv = 1.0 / temperature, zmax = max * inv;
  return min * inv - zmax >= -708.0 ? softmax_terms<LANES, false>(in, n, inv, zmax, out)
                                    : softmax_terms<LANES, true>(in, n, inv, zmax, out);
}

// Log-scale bucket of a probability in (0, 1]: 128 buckets per factor of 2
// below 1 (the bit pattern of a positive double is monotone in its value), the last bucket
// holding everything smaller, zeros included.
int64_t bucket_of(double v) {
  uint64_t bits;
  std::memcpy(&bits, &v, sizeof(bits));
  const int64_t k =
      static_cast<int64_t>(kOneBits >> kBucketShift) - static_cast<int64_t>(bits >> kBucketShift);
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

// The support of a processed row (reference.process_logits, unnormalised): probabilities
// s.p[0, n) of the tokens s.tok[0, n), or of tokens 0 .. n - 1 when dense.
struct Row {
  int64_t n;
  double sum;
  bool dense;
  // Position of token x in the support, or -1.
  int64_t find(const int32_t* tok, int32_t x) const {
    if (dense) return x;
    const int64_t i = std::lower_bound(tok, tok + n, x) - tok;
    return i < n && tok[i] == x ? i : -1;
  }
};

template <int LANES, typename scalar_t>
SPECDEC_INLINE Row process_row(const scalar_t* logits, int64_t V, const Params& prm, int64_t b,
                               int64_t node, Scratch& s) {
  int32_t* tok = s.tok.get();
  double* p = s.p.get();
  Row row{V, 0.0, true};
  if (0 < prm.top_k && prm.top_k < V) {
    const auto [max, cut] = max_and_cut(logits, V, prm.top_k, s.r.get(), b, node);
    int64_t n = 0;
    for (int64_t t = 0; t < V; ++t) {  // the survivors' logits, without branches
      const double x = static_cast<float>(logits[t]);
      tok[n] = static_cast<int32_t>(t);
      p[n] = x;
      n += x >= cut;
    }
    row = {n, softmax_terms<LANES>(p, n, prm.temperature, kNegInf, max, p), false};
  } else {
    const auto [min, max] = row_range<LANES>(logits, V, b, node);
    row.sum = softmax_terms<LANES>(logits, V, prm.temperature, min, max, p);
  }
  if (prm.top_p < 1.0) {
    const double tau = top_p_threshold(p, row.n, prm.top_p * row.sum, s);
    int64_t kept = 0;
    double sum = 0.0;
    for (int64_t i = 0; i < row.n; ++i) {
      if (p[i] >= tau) {
        tok[kept] = row.dense ? static_cast<int32_t>(i) : tok[i];
        p[kept] = p[i];
        sum += p[kept++];
      }
    }
    row = {kept, sum, false};
  }
  return row;
}

// ---------------------------------------------------------------- residual updates
// q(x) of draft row `row` (= b * T + node).
double draft_prob(const DraftProbs& dp, int64_t row, int32_t x) {
  double q = 0.0;
  SPECDEC_DISPATCH_PROB_DTYPE(dp.dtype, scalar_t, {
    q = static_cast<double>(static_cast<const scalar_t*>(dp.data)[row * dp.V + x]);
  });
  return q;
}

// dst <- max(src / rsum - q, 0) over the support (the residual is 0 elsewhere and stays 0:
// q >= 0); returns the new sum. NaN propagates as in torch.clamp, so a NaN draft row
// triggers the reset. Scalar, for the draft dtypes without a vector build.
double subtract_draft_any(const DraftProbs& dp, int64_t row, const int32_t* tok, bool dense,
                          const double* src, double* dst, int64_t n, double rsum) {
  double sum = 0.0;
  SPECDEC_DISPATCH_PROB_DTYPE(dp.dtype, scalar_t, {
    const scalar_t* q = static_cast<const scalar_t*>(dp.data) + row * dp.V;
    for (int64_t i = 0; i < n; ++i) {
      const double v = src[i] / rsum - static_cast<double>(q[dense ? i : tok[i]]);
      dst[i] = v < 0.0 ? 0.0 : v;
      sum += dst[i];
    }
  });
  return sum;
}

// q of support entries [i, i + m), m <= LANES; lanes from m on are 0.
template <int LANES, typename Q>
SPECDEC_INLINE typename Simd<LANES>::d draft_part(const Q* q, const int32_t* tok, bool dense,
                                                  int64_t i, int64_t m) {
  if (dense) return m == LANES ? load_f64<LANES>(q + i) : load_part<LANES>(q + i, m, 0.0);
  typename Simd<LANES>::d v{};
  for (int64_t j = 0; j < m; ++j) v[j] = static_cast<double>(q[tok[i + j]]);
  return v;
}

// subtract_draft_any for float / double draft rows q [V], on vectors.
template <int LANES, typename Q>
SPECDEC_INLINE double subtract_draft_vec(const Q* q, const int32_t* tok, bool dense,
                                         const double* src, double* dst, int64_t n, double rsum) {
  using vd = typename Simd<LANES>::d;
  const double inv = 1.0 / rsum;
  vd acc{};
  int64_t i = 0;
  for (; i + LANES <= n; i += LANES) {
    vd v = load<LANES>(src + i) * inv - draft_part<LANES>(q, tok, dense, i, LANES);
    v = v < 0.0 ? vd{} : v;
    store(dst + i, v);
    acc += v;
  }
  vd v = load_part<LANES>(src + i, n - i, 0.0) * inv - draft_part<LANES>(q, tok, dense, i, n - i);
  v = v < 0.0 ? vd{} : v;
  store_part(dst + i, v, n - i);
  return hsum<LANES>(acc + v);
}

template <int LANES>
SPECDEC_INLINE double subtract_draft(const DraftProbs& dp, int64_t row, const int32_t* tok,
                                     bool dense, const double* src, double* dst, int64_t n,
                                     double rsum) {
  if (dp.dtype == at::kFloat) {
    return subtract_draft_vec<LANES>(static_cast<const float*>(dp.data) + row * dp.V, tok, dense,
                                     src, dst, n, rsum);
  }
  if (dp.dtype == at::kDouble) {
    return subtract_draft_vec<LANES>(static_cast<const double*>(dp.data) + row * dp.V, tok, dense,
                                     src, dst, n, rsum);
  }
  return subtract_draft_any(dp, row, tok, dense, src, dst, n, rsum);
}

// Inverse CDF in support order: the first entry whose cumulative mass exceeds u * total.
// The mass advances by the vector sums of blocks of kScanBlock entries (the total is their
// sum in the same order) and only the block where it crosses the target is scanned one by
// one. block_sums holds >= n / kScanBlock + 1 doubles.
constexpr int64_t kScanBlock = 256;

template <int LANES>
SPECDEC_INLINE int64_t sample_index(const double* r, int64_t n, double u, double* block_sums) {
  const int64_t blocks = (n + kScanBlock - 1) / kScanBlock;
  double total = 0.0;
  for (int64_t j = 0; j < blocks; ++j) {
    block_sums[j] = sum_of<LANES>(r + j * kScanBlock, std::min(kScanBlock, n - j * kScanBlock));
    total += block_sums[j];
  }
  const double target = u * total;
  double cum = 0.0;
  for (int64_t j = 0; j < blocks; ++j) {
    const double next = cum + block_sums[j];
    if (next > target) {
      double c = cum;
      for (int64_t i = j * kScanBlock; i < std::min(n, (j + 1) * kScanBlock); ++i) {
        c += r[i];
        if (c > target) return i;
      }
    }
    cum = next;
  }
  for (int64_t i = n - 1; i >= 0; --i) {  // u * total rounded up to the total
    if (r[i] > 0.0) return i;
  }
  return n - 1;
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
template <int LANES, typename scalar_t>
SPECDEC_INLINE void walk_greedy(const scalar_t* logits, const Request& rq) {
  int64_t u = 0, k = 0;
  rq.accepted[0] = 0;
  while (true) {
    const int32_t a = argmax_checked<LANES>(logits + u * rq.V, rq.V, rq.b, u);
    int64_t c = next_child(rq, u, -1);
    while (c >= 0 && rq.draft[c] != a) c = next_child(rq, u, c);
    rq.tokens[k] = a;
    if (c < 0) break;
    u = c;
    rq.accepted[++k] = static_cast<int32_t>(c);
  }
  *rq.num_accepted = static_cast<int32_t>(k);
}

template <int LANES, typename scalar_t>
SPECDEC_INLINE void walk_sampled(const scalar_t* logits, const DraftProbs& dp, const Request& rq,
                                 Scratch& s) {
  const int32_t* tok = s.tok.get();
  const double* p = s.p.get();
  double* rbuf = s.r.get();
  int64_t u = 0, k = 0;
  rq.accepted[0] = 0;
  Row row = process_row<LANES>(logits, rq.V, rq.prm, rq.b, 0, s);
  const double* r = p;  // the residual: p until a rejection writes rbuf
  double rsum = row.sum;
  while (true) {
    int64_t next = -1;
    for (int64_t c = next_child(rq, u, -1); c >= 0; c = next_child(rq, u, c)) {
      const int32_t x = rq.draft[c];
      const int64_t i = row.find(tok, x);
      const double rx = i >= 0 ? r[i] : 0.0;
      const double qx = dp.data ? draft_prob(dp, rq.b * rq.T + u, x) : 1.0;
      if (static_cast<double>(rq.uniforms[c]) * qx * rsum < rx) {
        next = c;
        break;
      }
      if (dp.data) {
        rsum = subtract_draft<LANES>(dp, rq.b * rq.T + u, tok, row.dense, r, rbuf, row.n, rsum);
        r = rbuf;
      } else if (i >= 0) {
        if (r == p) std::copy(p, p + row.n, rbuf);
        r = rbuf;
        rbuf[i] = 0.0;
        const double left = rsum - rx;
        rsum = left < rsum * kCancellation ? sum_of<LANES>(rbuf, row.n) : left;
      }
      if (!(rsum > 0.0)) {  // inconsistent draft probabilities emptied the residual
        r = p;
        rsum = row.sum;
      }
    }
    if (next < 0) break;
    u = next;
    rq.accepted[++k] = static_cast<int32_t>(u);
    rq.tokens[k - 1] = rq.draft[u];
    row = process_row<LANES>(logits + u * rq.V, rq.V, rq.prm, rq.b, u, s);
    r = p;
    rsum = row.sum;
  }
  const int64_t i =
      sample_index<LANES>(r, row.n, static_cast<double>(rq.uniforms[rq.T]), s.tmp.get());
  rq.tokens[k] = static_cast<int32_t>(row.dense ? i : tok[i]);
  *rq.num_accepted = static_cast<int32_t>(k);
}

// ---------------------------------------------------------------- dispatch
// One request's walk: greedy (temperature 0) or sampled; the scratch of the sampled walk is
// made on the first sampled request of a task.
template <int LANES, typename scalar_t>
SPECDEC_INLINE void walk(const scalar_t* logits, const DraftProbs& dp, const Request& rq,
                         std::unique_ptr<Scratch>& s) {
  if (rq.prm.temperature == 0.0) {
    walk_greedy<LANES>(logits, rq);
    return;
  }
  if (!s) s = std::make_unique<Scratch>(rq.V);
  walk_sampled<LANES>(logits, dp, rq, *s);
}

template <typename scalar_t>
__attribute__((target("avx512f,avx512vl,avx512bw,avx512dq,avx2,fma,f16c"))) void walk_avx512(
    const scalar_t* logits, const DraftProbs& dp, const Request& rq, std::unique_ptr<Scratch>& s) {
  walk<8>(logits, dp, rq, s);
}

template <typename scalar_t>
__attribute__((target("avx2,fma,f16c"))) void walk_avx2(const scalar_t* logits,
                                                        const DraftProbs& dp, const Request& rq,
                                                        std::unique_ptr<Scratch>& s) {
  walk<4>(logits, dp, rq, s);
}

template <typename scalar_t>
void walk_baseline(const scalar_t* logits, const DraftProbs& dp, const Request& rq,
                   std::unique_ptr<Scratch>& s) {
  walk<2>(logits, dp, rq, s);
}

template <typename scalar_t>
using WalkFn = void (*)(const scalar_t*, const DraftProbs&, const Request&,
                        std::unique_ptr<Scratch>&);

// The widest build cpu_isa() allows (avx512bf16 means avx512 here).
template <typename scalar_t>
WalkFn<scalar_t> pick_walk() {
  const CpuIsa isa = cpu_isa();
  if (isa >= CpuIsa::kAvx512) return &walk_avx512<scalar_t>;
  if (isa >= CpuIsa::kAvx2) return &walk_avx2<scalar_t>;
  return &walk_baseline<scalar_t>;
}

}  // namespace

std::tuple<at::Tensor, at::Tensor, at::Tensor> tree_rejection_sample_cpu(
    const at::Tensor& target_logits, const at::Tensor& draft_tokens, const at::Tensor& parents,
    const at::Tensor& num_nodes, const std::optional<at::Tensor>& draft_probs,
    const at::Tensor& temperature, const at::Tensor& top_k, const at::Tensor& top_p,
    const at::Tensor& uniforms) {
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
  SPECDEC_DISPATCH_FLOAT_DTYPE(target_logits.scalar_type(), scalar_t, {
    const scalar_t* logits = target_logits.data_ptr<scalar_t>();
    const WalkFn<scalar_t> walk_request = pick_walk<scalar_t>();
    at::parallel_for(0, B, 1, [&](int64_t b0, int64_t b1) {
      std::unique_ptr<Scratch> s;  // only sampled requests need it (walk)
      for (int64_t b = b0; b < b1; ++b) {
        const Request rq{b,
                         T,
                         V,
                         draft + b * T,
                         par + b * T,
                         nn[b],
                         uni + b * (T + 1),
                         Params{temp[b], tk[b], tp[b]},
                         acc + b * T,
                         out + b * T,
                         na + b};
        walk_request(logits + b * T * V, dp, rq, s);
      }
    });
  });
  return {accepted, num_accepted, tokens};
}

}  // namespace specdec
