"""specdec_kernels: exact, fast speculative-decoding ops as torch custom ops.

Importing this package loads the compiled library (once per process), which registers
torch.ops.specdec.{build_tree_mask, tree_verify, tree_rejection_sample, compact_kv}.
Without a compiled library the import raises ImportError saying how to build it, unless
SPECDEC_JIT=1 asks for a JIT build (see envs.py for every environment variable and
docs/ops.md for the op contract).
"""

from . import envs
from ._library import cpu_isa, load_library, set_cpu_isa, set_validate, validate_enabled

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
    "cpu_isa",
    "envs",
    "load_library",
    "make_uniforms",
    "reference",
    "set_cpu_isa",
    "set_validate",
    "tree_rejection_sample",
    "tree_verify",
    "validate_enabled",
]
