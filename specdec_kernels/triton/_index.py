"""Narrowing of index tensors for the Triton kernels, shared by every launcher."""

import torch

_INT32_MIN, _INT32_MAX = -(2**31), 2**31 - 1


def index32(t: torch.Tensor) -> torch.Tensor:
    """Contiguous int32 copy of an int32 / int64 index tensor, saturating instead of wrapping.

    The C++ checks reject int64 values outside int32 before this runs wherever values are
    checked (CPU, or SPECDEC_VALIDATE=1); elsewhere (CUDA) a value such as 2^32 becomes
    2^31 - 1, which every kernel bound rejects, instead of wrapping to a valid-looking 0.
    A device op: no host sync, CUDA-graph safe. Same rule as as_index in csrc/checks.cpp.
    """
    if t.dtype == torch.int64:
        t = t.clamp(_INT32_MIN, _INT32_MAX)
    return t.to(torch.int32).contiguous()
