#include "isa.h"

#include <torch/types.h>

#include <algorithm>
#include <atomic>
#include <string>

namespace specdec {
namespace {

// The cap set by set_cpu_isa (from specdec_kernels.envs.SPECDEC_CPU_ISA when the library loads).
std::atomic<CpuIsa> g_cap{CpuIsa::kAvx512Bf16};

}  // namespace

void set_cpu_isa(const std::string& name) {
  CpuIsa cap = CpuIsa::kAvx512Bf16;
  if (name == "avx512") {
    cap = CpuIsa::kAvx512;
  } else if (name == "avx2") {
    cap = CpuIsa::kAvx2;
  } else if (name == "baseline") {
    cap = CpuIsa::kBaseline;
  } else {
    TORCH_CHECK(name.empty() || name == "avx512bf16",
                "SPECDEC_CPU_ISA must be avx512bf16, avx512, avx2 or baseline, got '", name, "'");
  }
  g_cap.store(cap, std::memory_order_relaxed);
}

CpuIsa cpu_isa() {
  static const CpuIsa hardware = [] {
    if (!(__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
          __builtin_cpu_supports("f16c"))) {
      return CpuIsa::kBaseline;
    }
    if (!(__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512vl") &&
          __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512dq"))) {
      return CpuIsa::kAvx2;
    }
    return __builtin_cpu_supports("avx512bf16") ? CpuIsa::kAvx512Bf16 : CpuIsa::kAvx512;
  }();
  return std::min(hardware, g_cap.load(std::memory_order_relaxed));
}

}  // namespace specdec
