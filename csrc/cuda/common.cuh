// Helpers shared by the CUDA kernels: float conversion, warp / block reductions. (dtype,
// head-dim and vector-width dispatch: dispatch.h.)
//
// Every reduction here combines values in a fixed order, so a kernel gives bitwise the
// same result on every run (eager and CUDA-graph replays agree exactly).
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>

#include <cstdint>

namespace specdec {
namespace cuda {

constexpr int kWarpSize = 32;
constexpr unsigned kFullMask = 0xffffffffu;

inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// float, c10::Half or c10::BFloat16 (the types SPECDEC_DISPATCH_FLOAT_DTYPE binds) as float.
template <typename T>
__device__ __forceinline__ float to_float(T x) {
  return static_cast<float>(x);
}

// ---- warp reductions (xor butterfly: every lane ends with the same, bitwise equal value,
// since each step combines the same two operands, only swapped, with a commutative op) ----
template <typename T>
__device__ __forceinline__ T shfl_xor(T v, int offset) {
  return __shfl_xor_sync(kFullMask, v, offset);
}

template <typename T, typename Op>
__device__ __forceinline__ T warp_reduce(T v, Op op) {
#pragma unroll
  for (int offset = kWarpSize / 2; offset > 0; offset /= 2) v = op(v, shfl_xor(v, offset));
  return v;
}

struct Sum {
  template <typename T>
  __device__ __forceinline__ T operator()(T a, T b) const {
    return a + b;
  }
};
struct Max {
  __device__ __forceinline__ float operator()(float a, float b) const { return fmaxf(a, b); }
};
struct Min {
  __device__ __forceinline__ int operator()(int a, int b) const { return a < b ? a : b; }
};
struct MaxInt {
  __device__ __forceinline__ int operator()(int a, int b) const { return a > b ? a : b; }
};

// Block-wide reduction; every thread gets the result. `smem` holds >= blockDim.x / 32
// values of T. The leading barrier makes back-to-back calls on the same smem safe, and
// the barriers also publish every global / shared write made before the call.
template <typename T, typename Op>
__device__ __forceinline__ T block_reduce(T v, Op op, T* smem) {
  const int lane = threadIdx.x % kWarpSize, warp = threadIdx.x / kWarpSize;
  const int num_warps = blockDim.x / kWarpSize;
  v = warp_reduce(v, op);
  __syncthreads();
  if (lane == 0) smem[warp] = v;
  __syncthreads();
  T r = smem[0];
  for (int w = 1; w < num_warps; ++w) r = op(r, smem[w]);  // same order in every thread
  return r;
}

}  // namespace cuda
}  // namespace specdec
