#include "isa.h"

#include <cpuid.h>
#include <sys/syscall.h>
#include <torch/types.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <string>

namespace specdec {
namespace {

constexpr const char* kNames[] = {"baseline", "avx2", "avx512", "avx512bf16", "amx"};

// The cap set by set_cpu_isa (from specdec_kernels.envs.SPECDEC_CPU_ISA when the library loads).
std::atomic<CpuIsa> g_cap{CpuIsa::kAmx};

// Whether this thread may run AMX tile instructions: the CPU has AMX-TILE and AMX-BF16
// (CPUID leaf 7: EDX bits 24 and 22) and Linux granted the process the tile data state
// (arch_prctl ARCH_REQ_XCOMP_PERM for XFEATURE_XTILEDATA, which a process must ask for before
// its first tile instruction; granted once for every thread).
bool amx_usable() {
  unsigned eax, ebx, ecx, edx;
  if (!__get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx)) return false;
  if (!((edx >> 24) & 1) || !((edx >> 22) & 1)) return false;
  constexpr long kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
  return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
}

}  // namespace

void set_cpu_isa(const std::string& name) {
  CpuIsa cap = CpuIsa::kAmx;
  if (name == "avx512bf16") {
    cap = CpuIsa::kAvx512Bf16;
  } else if (name == "avx512") {
    cap = CpuIsa::kAvx512;
  } else if (name == "avx2") {
    cap = CpuIsa::kAvx2;
  } else if (name == "baseline") {
    cap = CpuIsa::kBaseline;
  } else {
    TORCH_CHECK(name.empty() || name == "amx",
                "SPECDEC_CPU_ISA must be amx, avx512bf16, avx512, avx2 or baseline, got '", name,
                "'");
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
    if (!__builtin_cpu_supports("avx512bf16")) return CpuIsa::kAvx512;
    return amx_usable() ? CpuIsa::kAmx : CpuIsa::kAvx512Bf16;
  }();
  return std::min(hardware, g_cap.load(std::memory_order_relaxed));
}

std::string cpu_isa_name() { return kNames[static_cast<int>(cpu_isa())]; }

}  // namespace specdec
