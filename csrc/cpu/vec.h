// Vectors of the CPU kernels: GCC vector extensions of LANES lanes (a template parameter), and the
// helpers every kernel uses on them. A kernel instantiates its loops for several LANES and compiles
// each instantiation for one ISA with a target attribute (see isa.h), so everything here is
// always_inline: it takes the target (and vector width) of the function it is inlined into.
#pragma once

#include <cstdint>
#include <type_traits>

// Every helper is always_inline, so the vector ABI change warned about (passing a vector
// wider than the baseline ISA's registers by value) never applies.
#pragma GCC diagnostic ignored "-Wpsabi"

#define SPECDEC_INLINE __attribute__((always_inline)) inline
// The same for a lambda (after its parameter list), which takes no `inline`.
#define SPECDEC_INLINE_LAMBDA __attribute__((always_inline))

namespace specdec {
// Internal linkage, as when every kernel file defined its own copy: the including file's
// pragmas and target attributes shape these helpers, so no two files may share one.
namespace {

// Vector types of LANES lanes (a power of two).
template <int LANES>
struct Simd {
  typedef float f __attribute__((vector_size(LANES * sizeof(float))));
  typedef double d __attribute__((vector_size(LANES * sizeof(double))));
  typedef int32_t i32 __attribute__((vector_size(LANES * sizeof(int32_t))));
  typedef uint64_t u64 __attribute__((vector_size(LANES * sizeof(uint64_t))));
};

// The vector of LANES lanes of float or double.
template <int LANES, typename T>
using vec_t =
    std::conditional_t<std::is_same_v<T, double>, typename Simd<LANES>::d, typename Simd<LANES>::f>;

// Every lane x.
template <int LANES, typename T>
SPECDEC_INLINE vec_t<LANES, T> splat(T x) {
  static_assert(std::is_same_v<T, float> || std::is_same_v<T, double>);
  return vec_t<LANES, T>{} + x;
}

// LANES elements from p (unaligned).
template <int LANES, typename T>
SPECDEC_INLINE vec_t<LANES, T> load(const T* p) {
  static_assert(std::is_same_v<T, float> || std::is_same_v<T, double>);
  vec_t<LANES, T> v;
  __builtin_memcpy(&v, p, sizeof(v));
  return v;
}

// LANES bfloat16 values at p (their bits) as floats: a bf16 is the high half of a float.
template <int LANES>
SPECDEC_INLINE typename Simd<LANES>::f widen_bf16(const uint16_t* p) {
  typedef uint16_t u16 __attribute__((vector_size(LANES * sizeof(uint16_t))));
  u16 half;
  __builtin_memcpy(&half, p, sizeof(half));
  const typename Simd<LANES>::i32 bits = __builtin_convertvector(half, typename Simd<LANES>::i32)
                                         << 16;
  typename Simd<LANES>::f v;
  __builtin_memcpy(&v, &bits, sizeof(v));
  return v;
}

// Every lane of v to p (unaligned).
template <typename T, typename V>
SPECDEC_INLINE void store(T* p, V v) {
  static_assert(sizeof(v) % sizeof(T) == 0);
  __builtin_memcpy(p, &v, sizeof(v));
}

// Lanes [0, m) of v to p.
template <typename T, typename V>
SPECDEC_INLINE void store_part(T* p, V v, int64_t m) {
  for (int64_t j = 0; j < m; ++j) p[j] = v[j];
}

template <typename V>
SPECDEC_INLINE V vmax(V a, V b) {
  return a > b ? a : b;
}

// Sum of the lanes of v, lane 0 first.
template <int LANES, typename V>
SPECDEC_INLINE auto hsum(V v) {
  std::remove_cv_t<std::remove_reference_t<decltype(v[0])>> s = 0;
  for (int j = 0; j < LANES; ++j) s += v[j];
  return s;
}

}  // namespace
}  // namespace specdec
