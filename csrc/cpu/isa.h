// Which vector build of a CPU kernel to run.
#pragma once

#include <string>

namespace specdec {

// Instruction sets of the CPU kernels' builds, narrowest first (so they compare).
enum class CpuIsa { kBaseline, kAvx2, kAvx512, kAvx512Bf16, kAmx };

// The widest build this CPU runs, capped by set_cpu_isa.
CpuIsa cpu_isa();

// Caps cpu_isa() for the whole process: "amx" (or "": no cap), "avx512bf16", "avx512", "avx2",
// "baseline". Registered as torch.ops.specdec._set_cpu_isa; the Python loader passes
// specdec_kernels.envs.SPECDEC_CPU_ISA, and the tests switch builds at run time with it.
void set_cpu_isa(const std::string& name);

// The name of cpu_isa() (a set_cpu_isa value): what the CPU kernels run now. Registered as
// torch.ops.specdec._cpu_isa.
std::string cpu_isa_name();

}  // namespace specdec
