"""Triton kernels of the specdec ops (GPU, or CPU tensors under TRITON_INTERPRET=1).

Called by specdec_kernels.ops after the shared C++ validation, with the same
positional arguments as the torch.ops.specdec ops.
"""

from .compact_kv import compact_kv
from .rejection import tree_rejection_sample
from .tree_mask import build_tree_mask
from .tree_verify import tree_verify

__all__ = ["build_tree_mask", "compact_kv", "tree_rejection_sample", "tree_verify"]
