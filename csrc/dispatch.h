// Runtime value -> compile-time type or constant, for the CPU and CUDA kernels, in the style
// of FlashInfer's DISPATCH_* macros:
//
//   SPECDEC_DISPATCH_FLOAT_DTYPE(q.scalar_type(), scalar_t, {
//     SPECDEC_DISPATCH_HEAD_DIM(D, HEAD_DIM_PADDED, { launch<scalar_t, HEAD_DIM_PADDED>(...); });
//   });
//
// The last argument is a block of statements, run with the second argument bound to the
// type (`using scalar_t = ...`) or constant (`constexpr int HEAD_DIM_PADDED = ...`) the value
// selects. It is a plain block, not a lambda: a `return` in it returns from the enclosing
// function, and dispatches nest. A value without a case throws (NotImplementedError for a
// dtype, as AT_DISPATCH does); the op checks (checks.cpp) normally rule such values out first.
//
// Only c10 headers: usable from .cpp and .cu files alike. SPECDEC_DISPATCH_VEC_BYTES names
// CUDA's uint4 / uint2, so it expands only in CUDA code.
#pragma once

#include <c10/core/ScalarType.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Exception.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Float8_e4m3fnuz.h>
#include <c10/util/Float8_e5m2.h>
#include <c10/util/Float8_e5m2fnuz.h>
#include <c10/util/Float8_e8m0fnu.h>
#include <c10/util/Half.h>

#include <cstdint>

#define SPECDEC_PRIVATE_TYPE_CASE(ENUM, TYPE, NAME, ...) \
  case c10::ScalarType::ENUM: {                          \
    using NAME = TYPE;                                   \
    __VA_ARGS__                                          \
    break;                                               \
  }

#define SPECDEC_PRIVATE_TYPE_DEFAULT(st) \
  default:                               \
    TORCH_CHECK_NOT_IMPLEMENTED(false, "specdec: ", __func__, " has no kernel for dtype ", st);

// The attention / logit dtypes: float32, float16, bfloat16 -> float, c10::Half, c10::BFloat16.
#define SPECDEC_DISPATCH_FLOAT_DTYPE(scalar_type, scalar_t, ...)              \
  switch (const c10::ScalarType specdec_dispatch_st = (scalar_type)) {        \
    SPECDEC_PRIVATE_TYPE_CASE(Float, float, scalar_t, __VA_ARGS__)            \
    SPECDEC_PRIVATE_TYPE_CASE(Half, c10::Half, scalar_t, __VA_ARGS__)         \
    SPECDEC_PRIVATE_TYPE_CASE(BFloat16, c10::BFloat16, scalar_t, __VA_ARGS__) \
    SPECDEC_PRIVATE_TYPE_DEFAULT(specdec_dispatch_st)                         \
  }

// Probability dtypes (draft_probs on CPU, read in place): the float dtypes above plus float64
// and the float8 formats.
#define SPECDEC_DISPATCH_PROB_DTYPE(scalar_type, scalar_t, ...)                             \
  switch (const c10::ScalarType specdec_dispatch_st = (scalar_type)) {                      \
    SPECDEC_PRIVATE_TYPE_CASE(Float, float, scalar_t, __VA_ARGS__)                          \
    SPECDEC_PRIVATE_TYPE_CASE(Double, double, scalar_t, __VA_ARGS__)                        \
    SPECDEC_PRIVATE_TYPE_CASE(Half, c10::Half, scalar_t, __VA_ARGS__)                       \
    SPECDEC_PRIVATE_TYPE_CASE(BFloat16, c10::BFloat16, scalar_t, __VA_ARGS__)               \
    SPECDEC_PRIVATE_TYPE_CASE(Float8_e5m2, c10::Float8_e5m2, scalar_t, __VA_ARGS__)         \
    SPECDEC_PRIVATE_TYPE_CASE(Float8_e5m2fnuz, c10::Float8_e5m2fnuz, scalar_t, __VA_ARGS__) \
    SPECDEC_PRIVATE_TYPE_CASE(Float8_e4m3fn, c10::Float8_e4m3fn, scalar_t, __VA_ARGS__)     \
    SPECDEC_PRIVATE_TYPE_CASE(Float8_e4m3fnuz, c10::Float8_e4m3fnuz, scalar_t, __VA_ARGS__) \
    SPECDEC_PRIVATE_TYPE_CASE(Float8_e8m0fnu, c10::Float8_e8m0fnu, scalar_t, __VA_ARGS__)   \
    SPECDEC_PRIVATE_TYPE_DEFAULT(specdec_dispatch_st)                                       \
  }

#define SPECDEC_PRIVATE_INT_CASE(COND, NAME, VALUE, ...) \
  if (COND) {                                            \
    constexpr int NAME = VALUE;                          \
    __VA_ARGS__                                          \
  }

// The padded head dim PADDED takes the head dims in (PADDED / 2, PADDED] (32: all up to 32).
#define SPECDEC_PRIVATE_HEAD_DIM_CASE(PADDED, NAME, ...)                                         \
  SPECDEC_PRIVATE_INT_CASE(                                                                      \
      (PADDED == 32 || specdec_dispatch_hd > PADDED / 2) && specdec_dispatch_hd <= PADDED, NAME, \
      PADDED, __VA_ARGS__)

// Head dim -> the next of 32 / 64 / 128 / 256 / 512 (the padded head dim a kernel is built
// for). Larger head dims throw: a kernel that takes them needs its own path (tree_verify's CUDA
// launcher checks before dispatching).
#define SPECDEC_DISPATCH_HEAD_DIM(head_dim, HEAD_DIM_PADDED, ...)            \
  do {                                                                       \
    const int64_t specdec_dispatch_hd = (head_dim);                          \
    TORCH_CHECK(specdec_dispatch_hd <= 512, "specdec: ", __func__,           \
                " supports head dims up to 512, got ", specdec_dispatch_hd); \
    {                                                                        \
      SPECDEC_PRIVATE_HEAD_DIM_CASE(32, HEAD_DIM_PADDED, __VA_ARGS__)        \
      SPECDEC_PRIVATE_HEAD_DIM_CASE(64, HEAD_DIM_PADDED, __VA_ARGS__)        \
      SPECDEC_PRIVATE_HEAD_DIM_CASE(128, HEAD_DIM_PADDED, __VA_ARGS__)       \
      SPECDEC_PRIVATE_HEAD_DIM_CASE(256, HEAD_DIM_PADDED, __VA_ARGS__)       \
      SPECDEC_PRIVATE_HEAD_DIM_CASE(512, HEAD_DIM_PADDED, __VA_ARGS__)       \
    }                                                                        \
  } while (0)

#define SPECDEC_PRIVATE_UNIT_CASE(COND, UNIT_T, Unit, ...) \
  if (COND) {                                              \
    using Unit = UNIT_T;                                   \
    __VA_ARGS__                                            \
  }

// Vector bytes -> the widest load / store unit of 16 / 8 / 4 / 2 / 1 bytes (uint4, uint2,
// uint32_t, uint16_t, uint8_t) whose size divides `bytes` (e.g. the OR of a row size and
// the addresses it is copied between). CUDA only.
#define SPECDEC_DISPATCH_VEC_BYTES(bytes, Unit, ...)                                                                       \
  do {                                                                                                                     \
    const uint64_t specdec_dispatch_vb = (bytes);                                                                          \
    SPECDEC_PRIVATE_UNIT_CASE(specdec_dispatch_vb % 16 == 0, uint4, Unit, __VA_ARGS__)                                     \
    else SPECDEC_PRIVATE_UNIT_CASE(specdec_dispatch_vb % 8 == 0, uint2, Unit, __VA_ARGS__) else SPECDEC_PRIVATE_UNIT_CASE( \
        specdec_dispatch_vb % 4 == 0, uint32_t, Unit,                                                                      \
        __VA_ARGS__) else SPECDEC_PRIVATE_UNIT_CASE(specdec_dispatch_vb % 2 == 0, uint16_t, Unit,                          \
                                                    __VA_ARGS__) else SPECDEC_PRIVATE_UNIT_CASE(true,                      \
                                                                                                uint8_t,                   \
                                                                                                Unit,                      \
                                                                                                __VA_ARGS__)               \
  } while (0)
