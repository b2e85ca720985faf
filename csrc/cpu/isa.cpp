#include "isa.h"

#include <torch/types.h>

#include <algorithm>
#include <cstdlib>
#include <string>

namespace specdec {

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
  const char* env = std::getenv("SPECDEC_CPU_ISA");
  const std::string cap = env ? env : "";
  CpuIsa limit = CpuIsa::kAvx512Bf16;
  if (cap == "avx512") {
    limit = CpuIsa::kAvx512;
  } else if (cap == "avx2") {
    limit = CpuIsa::kAvx2;
  } else if (cap == "baseline") {
    limit = CpuIsa::kBaseline;
  } else {
    TORCH_CHECK(cap.empty() || cap == "avx512bf16",
                "SPECDEC_CPU_ISA must be avx512bf16, avx512, avx2 or baseline, got '", cap, "'");
  }
  return std::min(hardware, limit);
}

}  // namespace specdec
