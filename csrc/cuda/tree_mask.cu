// build_tree_mask on CUDA: one CTA per request, one thread per (node row i, mask word w).
//
// Each thread walks from node i up to the root and sets the bits of the ancestors that fall
// into its word, so threads never depend on each other's results. A step is taken only to a
// parent p with 0 <= p < current node, so the walk always terminates and never leaves the
// row, whatever `parents` holds (an out-of-order parent simply ends the walk: wrong bits,
// never an out-of-bounds access, for inputs that skipped validation).
#include "cuda/common.cuh"
#include "ops.h"

namespace specdec {
namespace cuda {
namespace {

constexpr int kThreads = 128;

// parents: [B, T]; num_nodes: [B]; mask: [B, T, mask_words], mask_words = ceil(T / 64);
// depth: [B, T]. Every element is written.
__global__ void __launch_bounds__(kThreads)
    build_tree_mask_kernel(const int32_t* __restrict__ parents,
                           const int32_t* __restrict__ num_nodes, uint64_t* __restrict__ mask,
                           int32_t* __restrict__ depth, int T, int mask_words) {
  const int b = blockIdx.x;
  const int n = min(max(num_nodes[b], 0), T);
  const int32_t* par = parents + int64_t(b) * T;
  for (int idx = threadIdx.x; idx < T * mask_words; idx += blockDim.x) {
    const int i = idx / mask_words, w = idx % mask_words;
    uint64_t word = 0;
    int d = 0;
    if (i < n) {
      for (int j = i;; ++d) {
        if (j / 64 == w) word |= uint64_t(1) << (j % 64);
        const int p = par[j];
        if (p < 0 || p >= j) break;  // root (or a malformed parent): the walk ends
        j = p;
      }
    }
    mask[(int64_t(b) * T + i) * mask_words + w] = word;
    if (w == 0) depth[int64_t(b) * T + i] = d;
  }
}

}  // namespace
}  // namespace cuda

std::tuple<at::Tensor, at::Tensor> build_tree_mask_cuda(const at::Tensor& parents,
                                                        const at::Tensor& num_nodes) {
  const at::cuda::OptionalCUDAGuard guard(parents.device());
  const int64_t B = parents.size(0), T = parents.size(1), mask_words = (T + 63) / 64;
  TORCH_CHECK(T * mask_words < (int64_t(1) << 31), "build_tree_mask: T = ", T, " is too large");
  TORCH_CHECK(B < (int64_t(1) << 31),
              "build_tree_mask (CUDA): the batch size B of parents must be < 2^31, got ", B);
  at::Tensor mask = at::empty({B, T, mask_words}, parents.options().dtype(at::kLong));
  at::Tensor depth = at::empty({B, T}, parents.options().dtype(at::kInt));
  if (B == 0) return {mask, depth};  // no launch: its grid would be empty
  cuda::build_tree_mask_kernel<<<B, cuda::kThreads, 0, at::cuda::getCurrentCUDAStream()>>>(
      parents.data_ptr<int32_t>(), num_nodes.data_ptr<int32_t>(),
      reinterpret_cast<uint64_t*>(mask.data_ptr<int64_t>()), depth.data_ptr<int32_t>(), int(T),
      int(mask_words));
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return {mask, depth};
}

}  // namespace specdec
