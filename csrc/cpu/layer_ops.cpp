// Layer ops of the CPU decode path: the elementwise pieces of a Llama block between its
// matmuls (RMSNorm, residual add + RMSNorm, RoPE of the fused q/k/v projection, SwiGLU), each
// one pass over its rows. At decode sizes (a few rows of a few hundred elements) the eager
// model's 5-15 small ATen ops per piece cost their dispatch, not their arithmetic.
//
// Numerics follow the eager model (specdec_kernels.reference, transformers op for op) in the
// input dtype: every intermediate the eager model rounds to the dtype is rounded here too, in
// the same order (round to nearest even, as c10 does), with float arithmetic in between. What
// may differ from ATen by an ulp of float: exp (a Cody-Waite reduction and a degree-6
// polynomial, < 2 ulp, where ATen uses Sleef), 1 / sqrt, and the order of the sum of squares
// (16 fixed partial sums, the same in every build). Rows are independent: a row's result never
// depends on how many rows the call has.
//
// The loops are plain element loops that GCC vectorizes (-O3) for the ISA of the function they
// are inlined into: each op has an AVX-512, an AVX2 and a baseline build (the target
// attributes below), picked at run time by cpu_isa() as the other CPU kernels are (isa.h).
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "dispatch.h"
#include "isa.h"
#include "ops.h"
#include "vec.h"

// Keep a * b + c as two roundings, as ATen's separate mul and add ops do. No FP traps: with
// them (GCC's default -ftrapping-math) a comparison reached on one branch of another (exp's
// clamps) may not be speculated, which left the loops around them scalar ("control flow in
// loop": SwiGLU ~12 ns an element on Zen 3). No value changes.
#pragma GCC optimize("fp-contract=off", "no-trapping-math")

namespace specdec {
namespace {

// Rows per parallel task: a row is ~1 us of work, a task launch a few us.
constexpr int64_t kRowGrain = 32;
// Partial sums of the sum of squares (one vector of AVX-512, two of AVX2): fixed, so every
// build sums in the same order.
constexpr int kLanes = 16;

// Element access in float for each dtype. bfloat16 by its bits (vectorizable; round to
// nearest even and the quiet NaN exactly as c10::BFloat16), float16 through c10::Half.
template <typename scalar_t>
SPECDEC_INLINE float load_elem(const scalar_t* p, int64_t i) {
  if constexpr (std::is_same_v<scalar_t, c10::BFloat16>) {
    uint16_t h;
    std::memcpy(&h, p + i, 2);
    const uint32_t bits = uint32_t(h) << 16;
    float f;
    std::memcpy(&f, &bits, 4);
    return f;
  } else {
    return static_cast<float>(p[i]);
  }
}

template <typename scalar_t>
SPECDEC_INLINE void store_elem(scalar_t* p, int64_t i, float x) {
  if constexpr (std::is_same_v<scalar_t, c10::BFloat16>) {
    uint32_t bits;
    std::memcpy(&bits, &x, 4);
    const uint32_t rounded = (bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16;
    const uint16_t h = x != x ? uint16_t(0x7FC0) : uint16_t(rounded);
    std::memcpy(p + i, &h, 2);
  } else {
    p[i] = static_cast<scalar_t>(x);
  }
}

// x rounded to scalar_t and back: what an ATen op on scalar_t tensors stores.
template <typename scalar_t>
SPECDEC_INLINE float round_to(float x) {
  scalar_t r;
  store_elem(&r, 0, x);
  return load_elem(&r, 0);
}

// e^x: k = round(x / ln 2), r = x - k ln 2 in two parts (Cody-Waite), e^r by its Taylor
// polynomial to degree 6 (|r| <= ln 2 / 2: error < 1 ulp), times 2^k from the exponent bits.
// inf above 88.72 (as expf), 0 below -87.3 (expf gives denormals there).
SPECDEC_INLINE float exp_float(float x) {
  const float xc = x > 88.f ? 88.f : (x < -87.f ? -87.f : x);
  const float round = 12582912.f;  // 1.5 * 2^23: adding it rounds to an integer
  const float k = (xc * 1.44269504088896341f + round) - round;
  float r = xc - k * 0.693145751953125f;
  r = r - k * 1.428606765330187045e-06f;
  float p = 1.f / 720.f;
  p = p * r + 1.f / 120.f;
  p = p * r + 1.f / 24.f;
  p = p * r + 1.f / 6.f;
  p = p * r + 0.5f;
  p = p * r + 1.f;
  p = p * r + 1.f;
  const int32_t bits = (static_cast<int32_t>(k) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, 4);
  const float e = p * scale;
  return x > 88.72283935546875f ? INFINITY : (x < -87.f ? 0.f : e);
}

template <typename scalar_t>
SPECDEC_INLINE void rms_norm_rows(const scalar_t* x, const scalar_t* residual,
                                  const scalar_t* weight, scalar_t* sum_out, scalar_t* out,
                                  int64_t r0, int64_t r1, int64_t dim, float eps, float* h) {
  for (int64_t r = r0; r < r1; ++r) {
    const scalar_t* xr = x + r * dim;
    if (residual != nullptr) {  // h = x + residual, rounded (and stored) as ATen's add
      const scalar_t* rr = residual + r * dim;
      scalar_t* sr = sum_out + r * dim;
      for (int64_t d = 0; d < dim; ++d) {
        h[d] = round_to<scalar_t>(load_elem(xr, d) + load_elem(rr, d));
        store_elem(sr, d, h[d]);
      }
    } else {
      for (int64_t d = 0; d < dim; ++d) h[d] = load_elem(xr, d);
    }
    float part[kLanes] = {};
    const int64_t body = dim / kLanes * kLanes;
    for (int64_t d = 0; d < body; d += kLanes) {
      for (int j = 0; j < kLanes; ++j) part[j] += h[d + j] * h[d + j];
    }
    for (int64_t d = body; d < dim; ++d) part[d - body] += h[d] * h[d];
    float sum_sq = 0.f;
    for (int j = 0; j < kLanes; ++j) sum_sq += part[j];
    const float inv = 1.f / std::sqrt(sum_sq / static_cast<float>(dim) + eps);
    scalar_t* o = out + r * dim;
    for (int64_t d = 0; d < dim; ++d) {
      store_elem(o, d, load_elem(weight, d) * round_to<scalar_t>(h[d] * inv));
    }
  }
}

// One head of D elements: dst = src * cos + rotate_half(src) * sin, rounded per op.
template <typename scalar_t>
SPECDEC_INLINE void rotate(const scalar_t* src, const scalar_t* cos, const scalar_t* sin, int64_t D,
                           scalar_t* dst) {
  const int64_t half = D / 2;
  for (int64_t d = 0; d < half; ++d) {  // rotate_half = [-x2, x1]
    const float a = round_to<scalar_t>(load_elem(src, d) * load_elem(cos, d));
    const float b = round_to<scalar_t>(-load_elem(src, d + half) * load_elem(sin, d));
    store_elem(dst, d, a + b);
  }
  for (int64_t d = half; d < D; ++d) {
    const float a = round_to<scalar_t>(load_elem(src, d) * load_elem(cos, d));
    const float b = round_to<scalar_t>(load_elem(src, d - half) * load_elem(sin, d));
    store_elem(dst, d, a + b);
  }
}

template <typename scalar_t>
SPECDEC_INLINE void rope_qkv_rows(const scalar_t* qkv, const scalar_t* cos, const scalar_t* sin,
                                  scalar_t* q, scalar_t* k, scalar_t* v, int64_t r0, int64_t r1,
                                  int64_t Hq, int64_t Hkv, int64_t D) {
  const int64_t width = (Hq + 2 * Hkv) * D;
  for (int64_t r = r0; r < r1; ++r) {
    const scalar_t* src = qkv + r * width;
    const scalar_t *c = cos + r * D, *s = sin + r * D;
    for (int64_t h = 0; h < Hq; ++h) rotate(src + h * D, c, s, D, q + (r * Hq + h) * D);
    for (int64_t h = 0; h < Hkv; ++h) rotate(src + (Hq + h) * D, c, s, D, k + (r * Hkv + h) * D);
    std::memcpy(v + r * Hkv * D, src + (Hq + Hkv) * D, Hkv * D * sizeof(scalar_t));
  }
}

// out = silu(gate) * up, gate = x[..., :H], up = x[..., H:], rounded per op.
template <typename scalar_t>
SPECDEC_INLINE void silu_and_mul_rows(const scalar_t* x, scalar_t* out, int64_t r0, int64_t r1,
                                      int64_t H) {
  for (int64_t r = r0; r < r1; ++r) {
    const scalar_t *gate = x + r * 2 * H, *up = gate + H;
    scalar_t* o = out + r * H;
    for (int64_t j = 0; j < H; ++j) {
      const float g = load_elem(gate, j);
      const float silu = round_to<scalar_t>(g / (1.f + exp_float(-g)));
      store_elem(o, j, silu * load_elem(up, j));
    }
  }
}

// out = a + b, rounded as ATen's add of two tensors of the dtype.
template <typename scalar_t>
SPECDEC_INLINE void add_rows(const scalar_t* a, const scalar_t* b, scalar_t* out, int64_t n) {
  for (int64_t i = 0; i < n; ++i) store_elem(out, i, load_elem(a, i) + load_elem(b, i));
}

// ---------------------------------------------------------------- builds and dispatch
// Each op's row loop compiled for AVX-512, AVX2 and the baseline ISA.
#define SPECDEC_LAYER_OP_BUILDS(name, params, args)                                              \
  template <typename scalar_t>                                                                   \
  __attribute__((target("avx512f,avx512bw,avx512vl,avx2,fma,f16c"))) void name##_avx512 params { \
    name<scalar_t> args;                                                                         \
  }                                                                                              \
  template <typename scalar_t>                                                                   \
  __attribute__((target("avx2,fma,f16c"))) void name##_avx2 params {                             \
    name<scalar_t> args;                                                                         \
  }                                                                                              \
  template <typename scalar_t>                                                                   \
  void name##_baseline params {                                                                  \
    name<scalar_t> args;                                                                         \
  }                                                                                              \
  template <typename scalar_t>                                                                   \
  auto pick_##name() {                                                                           \
    const CpuIsa isa = cpu_isa();                                                                \
    if (isa >= CpuIsa::kAvx512) return &name##_avx512<scalar_t>;                                 \
    if (isa >= CpuIsa::kAvx2) return &name##_avx2<scalar_t>;                                     \
    return &name##_baseline<scalar_t>;                                                           \
  }

SPECDEC_LAYER_OP_BUILDS(rms_norm_rows,
                        (const scalar_t* x, const scalar_t* residual, const scalar_t* weight,
                         scalar_t* sum_out, scalar_t* out, int64_t r0, int64_t r1, int64_t dim,
                         float eps, float* h),
                        (x, residual, weight, sum_out, out, r0, r1, dim, eps, h))
SPECDEC_LAYER_OP_BUILDS(rope_qkv_rows,
                        (const scalar_t* qkv, const scalar_t* cos, const scalar_t* sin, scalar_t* q,
                         scalar_t* k, scalar_t* v, int64_t r0, int64_t r1, int64_t Hq, int64_t Hkv,
                         int64_t D),
                        (qkv, cos, sin, q, k, v, r0, r1, Hq, Hkv, D))
SPECDEC_LAYER_OP_BUILDS(silu_and_mul_rows,
                        (const scalar_t* x, scalar_t* out, int64_t r0, int64_t r1, int64_t H),
                        (x, out, r0, r1, H))
SPECDEC_LAYER_OP_BUILDS(add_rows, (const scalar_t* a, const scalar_t* b, scalar_t* out, int64_t n),
                        (a, b, out, n))
#undef SPECDEC_LAYER_OP_BUILDS

}  // namespace

std::tuple<at::Tensor, at::Tensor> rms_norm_cpu(const at::Tensor& x,
                                                const std::optional<at::Tensor>& residual,
                                                const at::Tensor& weight, double eps) {
  const at::Tensor xc = x.contiguous(), wc = weight.contiguous();
  const at::Tensor rc = residual.has_value() ? residual->contiguous() : at::Tensor();
  at::Tensor out = at::empty(x.sizes(), x.options());
  at::Tensor sum = residual.has_value() ? at::empty(x.sizes(), x.options()) : at::Tensor();
  const int64_t dim = x.size(-1), rows = dim == 0 ? 0 : x.numel() / dim;
  SPECDEC_DISPATCH_FLOAT_DTYPE(x.scalar_type(), scalar_t, {
    const auto fn = pick_rms_norm_rows<scalar_t>();
    const scalar_t* res = residual.has_value() ? rc.data_ptr<scalar_t>() : nullptr;
    scalar_t* sum_out = residual.has_value() ? sum.data_ptr<scalar_t>() : nullptr;
    at::parallel_for(0, rows, kRowGrain, [&](int64_t r0, int64_t r1) {
      std::vector<float> h(dim);
      fn(xc.data_ptr<scalar_t>(), res, wc.data_ptr<scalar_t>(), sum_out, out.data_ptr<scalar_t>(),
         r0, r1, dim, static_cast<float>(eps), h.data());
    });
  });
  return {sum, out};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> rope_qkv_cpu(const at::Tensor& qkv,
                                                            const at::Tensor& cos,
                                                            const at::Tensor& sin,
                                                            int64_t num_q_heads,
                                                            int64_t num_kv_heads) {
  const int64_t B = qkv.size(0), T = qkv.size(1);
  const int64_t D = qkv.size(2) / (num_q_heads + 2 * num_kv_heads);
  const at::Tensor x = qkv.contiguous(), c = cos.contiguous(), s = sin.contiguous();
  at::Tensor q = at::empty({B, T, num_q_heads, D}, qkv.options());
  at::Tensor k = at::empty({B, T, num_kv_heads, D}, qkv.options());
  at::Tensor v = at::empty({B, T, num_kv_heads, D}, qkv.options());
  SPECDEC_DISPATCH_FLOAT_DTYPE(qkv.scalar_type(), scalar_t, {
    const auto fn = pick_rope_qkv_rows<scalar_t>();
    at::parallel_for(0, B * T, kRowGrain, [&](int64_t r0, int64_t r1) {
      fn(x.data_ptr<scalar_t>(), c.data_ptr<scalar_t>(), s.data_ptr<scalar_t>(),
         q.data_ptr<scalar_t>(), k.data_ptr<scalar_t>(), v.data_ptr<scalar_t>(), r0, r1,
         num_q_heads, num_kv_heads, D);
    });
  });
  return {q, k, v};
}

at::Tensor silu_and_mul_cpu(const at::Tensor& x) {
  const int64_t H = x.size(-1) / 2, rows = H == 0 ? 0 : x.numel() / (2 * H);
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = H;
  const at::Tensor xc = x.contiguous();
  at::Tensor out = at::empty(shape, x.options());
  SPECDEC_DISPATCH_FLOAT_DTYPE(x.scalar_type(), scalar_t, {
    const auto fn = pick_silu_and_mul_rows<scalar_t>();
    at::parallel_for(0, rows, kRowGrain, [&](int64_t r0, int64_t r1) {
      fn(xc.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(), r0, r1, H);
    });
  });
  return out;
}

at::Tensor add_cpu(const at::Tensor& a, const at::Tensor& b) {
  const at::Tensor ac = a.contiguous(), bc = b.contiguous();
  at::Tensor out = at::empty(a.sizes(), a.options());
  const int64_t n = a.numel();
  SPECDEC_DISPATCH_FLOAT_DTYPE(a.scalar_type(), scalar_t, {
    const auto fn = pick_add_rows<scalar_t>();
    // a decode step's residual: a few thousand elements, one task
    at::parallel_for(0, n, int64_t{1} << 16, [&](int64_t i0, int64_t i1) {
      fn(ac.data_ptr<scalar_t>() + i0, bc.data_ptr<scalar_t>() + i0, out.data_ptr<scalar_t>() + i0,
         i1 - i0);
    });
  });
  return out;
}

}  // namespace specdec
