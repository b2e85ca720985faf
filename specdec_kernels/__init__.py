"""specdec_kernels: exact, fast speculative-decoding ops as torch custom ops.

Importing this package registers torch.ops.specdec.{build_tree_mask, tree_verify,
tree_rejection_sample, compact_kv} (AOT library, or a JIT build from a checkout).
"""
from ._library import load_library

load_library()

from . import reference  # noqa: E402
from .ops import (  # noqa: E402
    BACKENDS,
    build_tree_mask,
    compact_kv,
    make_uniforms,
    tree_rejection_sample,
    tree_verify,
)

__all__ = [
    "BACKENDS",
    "build_tree_mask",
    "compact_kv",
    "make_uniforms",
    "reference",
    "tree_rejection_sample",
    "tree_verify",
]
