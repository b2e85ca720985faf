"""Loads the compiled specdec library into torch.ops.specdec.

AOT: `pip install .` leaves specdec_kernels/_C*.so next to this file.
JIT: with SPECDEC_JIT=1, or when no compiled library is found (a plain checkout),
the sources are compiled with ninja through torch.utils.cpp_extension.load, into
SPECDEC_BUILD_DIR if set (else torch's default extension cache).
"""
import glob
import os

import torch

from . import _build

_HERE = os.path.dirname(os.path.abspath(__file__))
_loaded = None


def _jit_load():
    from torch.utils.cpp_extension import load

    with_cuda = _build.want_cuda()
    sources = _build.cpp_sources() + (_build.cuda_sources() if with_cuda else [])
    build_dir = os.environ.get("SPECDEC_BUILD_DIR")
    if build_dir:
        os.makedirs(build_dir, exist_ok=True)
    load(
        name="specdec_jit_cuda" if with_cuda else "specdec_jit",
        sources=sources,
        extra_cflags=_build.CXX_FLAGS + (["-DSPECDEC_WITH_CUDA"] if with_cuda else []),
        extra_cuda_cflags=_build.NVCC_FLAGS + _build.cuda_arch_flags() + ["-DSPECDEC_WITH_CUDA"],
        extra_include_paths=_build.include_dirs(),
        build_directory=build_dir,
        is_python_module=False,
        verbose=os.environ.get("SPECDEC_VERBOSE_BUILD", "0") not in ("", "0"),
    )
    return "jit"


def load_library():
    """Idempotently registers torch.ops.specdec.*; returns "aot" or "jit"."""
    global _loaded
    if _loaded is not None:
        return _loaded
    built = glob.glob(os.path.join(_HERE, "_C*.so")) + glob.glob(os.path.join(_HERE, "_C*.pyd"))
    if os.environ.get("SPECDEC_JIT", "0") not in ("", "0") or not built:
        _loaded = _jit_load()
    else:
        torch.ops.load_library(built[0])
        _loaded = "aot"
    return _loaded
