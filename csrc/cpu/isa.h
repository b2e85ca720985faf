// Which vector build of a CPU kernel to run.
#pragma once

namespace specdec {

// Instruction sets of the CPU kernels' builds, narrowest first (so they compare).
enum class CpuIsa { kBaseline, kAvx2, kAvx512, kAvx512Bf16 };

// The widest build this CPU runs, capped by SPECDEC_CPU_ISA=avx512bf16|avx512|avx2|baseline.
// The variable is read at every call, so the tests exercise every build on one machine.
CpuIsa cpu_isa();

}  // namespace specdec
