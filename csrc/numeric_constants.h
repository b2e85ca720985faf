// Numeric constants shared by the CPU and CUDA kernels. Torch-free and usable in device code
// (constexpr scalars). Not named math_constants.h: csrc/ is an include directory, and CUDA's
// own <math_constants.h> must stay the one crt/math_functions.hpp finds.
#pragma once

namespace specdec {

// log2(e): the attention kernels run their softmax in base 2 (exp(x) = exp2(x * log2(e))).
constexpr float kLog2e = 1.4426950408889634f;

}  // namespace specdec
