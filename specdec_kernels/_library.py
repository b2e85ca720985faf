"""Loads the compiled specdec library into torch.ops.specdec, once per process.

AOT: ``pip install .`` (or ``python setup.py build_ext --inplace``) leaves
``specdec_kernels/_C*.so`` next to this file, and that is what gets loaded.
JIT: with ``SPECDEC_JIT=1`` the sources are compiled with ninja through
``torch.utils.cpp_extension.load`` instead, into ``SPECDEC_BUILD_DIR`` if set (else torch's
extension cache). A missing library without ``SPECDEC_JIT=1`` is an ImportError that says
how to build it: importing never starts a build by surprise.

The getters are cached (``functools.cache``, as FlashInfer's module getters): the first
call loads, later calls return the same answer.
"""

from __future__ import annotations

import functools
import glob
import os

import torch

from . import _build, envs

_HERE = os.path.dirname(os.path.abspath(__file__))

_MISSING = """specdec_kernels: no compiled library (_C*.so) in {here}.
Build it in one of these ways:
  pip install --no-build-isolation .                    # AOT, from the repository root
  python setup.py build_ext --inplace                   # AOT, in place in a checkout
  SPECDEC_JIT=1 python -c "import specdec_kernels"      # JIT: compile with ninja at import
(or run `make test` / `make demo` from the repository root, which do the first)."""

_STALE = """specdec_kernels: the compiled library {path} lacks one of the ops
specdec::_set_validate, specdec::_set_cpu_isa, specdec::_cpu_isa: it was built from older
sources. Rebuild it (pip install --no-build-isolation ., or python setup.py build_ext
--inplace), or set SPECDEC_JIT=1."""

_validate = False


def _jit_load() -> None:
    from torch.utils.cpp_extension import load

    with_cuda = _build.want_cuda()
    sources = _build.cpp_sources() + (_build.cuda_sources() if with_cuda else [])
    build_dir = envs.SPECDEC_BUILD_DIR
    if build_dir:
        os.makedirs(build_dir, exist_ok=True)
    load(
        name="specdec_jit_cuda" if with_cuda else "specdec_jit",
        sources=sources,
        extra_cflags=_build.CXX_FLAGS + (["-DSPECDEC_WITH_CUDA"] if with_cuda else []),
        extra_cuda_cflags=_build.NVCC_FLAGS + _build.cuda_arch_flags() + ["-DSPECDEC_WITH_CUDA"],
        extra_include_paths=_build.include_dirs(),
        extra_ldflags=_build.LD_FLAGS,
        build_directory=build_dir,
        is_python_module=False,
        verbose=envs.SPECDEC_VERBOSE_BUILD,
    )


def compiled_library_path() -> str | None:
    """Path of the AOT library next to this package, or None."""
    built = sorted(
        glob.glob(os.path.join(_HERE, "_C*.so")) + glob.glob(os.path.join(_HERE, "_C*.pyd"))
    )
    return built[0] if built else None


@functools.cache
def load_library() -> str:
    """Registers torch.ops.specdec.* (once per process); returns "aot" or "jit".

    Raises ImportError when there is no compiled library and SPECDEC_JIT is not set.
    """
    if envs.SPECDEC_JIT:
        _jit_load()
        how, path = "jit", "the JIT build"
    else:
        path = compiled_library_path()
        if path is None:
            raise ImportError(_MISSING.format(here=_HERE))
        torch.ops.load_library(path)
        how = "aot"
    if not all(
        hasattr(torch.ops.specdec, op) for op in ("_set_validate", "_set_cpu_isa", "_cpu_isa")
    ):
        raise ImportError(_STALE.format(path=path))
    set_validate(envs.SPECDEC_VALIDATE)
    set_cpu_isa(envs.SPECDEC_CPU_ISA)
    return how


def set_cpu_isa(isa: str | None) -> None:
    """Caps the instruction set of the C++ CPU kernels for the whole process: "amx" (None: no
    cap, the widest build the CPU runs), "avx512bf16", "avx512", "avx2" or "baseline". The
    initial value is ``SPECDEC_CPU_ISA``, read when the library loads; RuntimeError for another
    name."""
    torch.ops.specdec._set_cpu_isa(isa or "")


def cpu_isa() -> str:
    """The instruction set the C++ CPU kernels run now: the widest this CPU (and, for "amx",
    the operating system) allows, capped by set_cpu_isa; one of set_cpu_isa's names."""
    return torch.ops.specdec._cpu_isa()


def set_validate(enabled: bool) -> None:
    """Turns the value checks on CUDA tensors on or off for the whole process, in every
    backend (the C++ flag and the Triton backend's read the same value). The initial value
    is ``SPECDEC_VALIDATE``, read when the library loads."""
    global _validate
    torch.ops.specdec._set_validate(bool(enabled))
    _validate = bool(enabled)


def validate_enabled() -> bool:
    """Whether the value checks run on CUDA tensors (they always run on CPU tensors)."""
    return _validate


def value_checks_run(device: torch.device) -> bool:
    """Whether ops on tensors of ``device`` check index values: always on CPU, on CUDA only
    with SPECDEC_VALIDATE (set_validate)."""
    return device.type == "cpu" or _validate
