"""Every environment variable specdec reads, in one place (the model is vLLM's ``envs.py``).

Read a variable as an attribute: ``from specdec_kernels import envs; envs.SPECDEC_BACKEND``.
Each access reads the environment at that moment and parses it the same way everywhere
(flags: unset, ``""`` and ``"0"`` are off, anything else is on). No other module of the
project calls ``os.environ`` / ``getenv`` for these names; C++ gets its values passed in
(``SPECDEC_VALIDATE`` through ``torch.ops.specdec._set_validate`` when the library loads).

This module imports nothing from the package (nor torch): ``setup.py`` loads it by path,
through ``_build.py``, before the package is installed.

=========================  ==========================================================
variable                   meaning
=========================  ==========================================================
SPECDEC_JIT                ``1``: compile ``csrc/`` with ninja at import
                           (``torch.utils.cpp_extension.load``) instead of loading the
                           AOT library; what a plain checkout needs. Default off: a
                           missing library is an ImportError, never a silent build.
SPECDEC_BUILD_DIR          Folder of the JIT build (default: torch's extension cache,
                           ``~/.cache/torch_extensions``).
SPECDEC_VERBOSE_BUILD      ``1``: print the JIT build's compiler commands.
SPECDEC_NO_CUDA            ``1``: build without the CUDA kernels even when torch has CUDA
                           and ``nvcc`` is found (AOT and JIT builds).
TORCH_CUDA_ARCH_LIST       CUDA architectures to compile for (torch's variable; default
                           ``8.0;9.0``, i.e. sm_80 and sm_90; ``+PTX`` adds PTX).
SPECDEC_BACKEND            Default ``backend=`` of the Python API: ``cpp`` (default),
                           ``triton`` or ``reference``.
SPECDEC_VALIDATE           ``1``: run the data-dependent input checks on CUDA tensors too
                           (they always run on CPU tensors). Costs a host sync per op and
                           breaks CUDA-graph capture. Read once, when the library loads,
                           and passed to C++; the C++ and Triton backends then read the
                           same process-wide value, changed at run time only with
                           ``specdec_kernels.set_validate(bool)``.
SPECDEC_CPU_ISA            Caps the CPU kernels' instruction set: ``avx512bf16``,
                           ``avx512``, ``avx2`` or ``baseline`` (default: the best the
                           CPU has). Passed to C++ when the library loads;
                           ``specdec_kernels.set_cpu_isa(name)`` changes it at run time.
SPECDEC_COMPILE            Whether the decode engine runs the target's verify step
                           through torch.compile (``specdec.compiled_step``): ``1``
                           on, ``0`` off, ``auto`` (default, also when unset or
                           empty): off for now (compile time, minutes per tree size
                           on CPU, outweighs the per-step gain in short runs). The
                           CLI's ``--compile`` / ``--no-compile`` override it.
SPECDEC_COMPILE_MODE       torch.compile's ``mode`` for that step: ``default``,
                           ``reduce-overhead`` (CUDA graphs), ``max-autotune``, ...
                           (default: ``reduce-overhead`` on CUDA, ``default`` on CPU).
SPECDEC_PREPACK_WEIGHTS    Whether the decode engine runs the bf16 linear layers of
                           the target and the drafter on CPU with oneDNN-prepacked
                           weights (``specdec.packed_linear``): ``1`` on, ``0`` off,
                           ``auto`` (default): on where oneDNN supports bf16 or the
                           tiles take the products (SPECDEC_TILED_ROWS; an extra copy
                           of the weights; ~1.4x faster projections at M <= 32).
SPECDEC_TILED_ROWS         Up to how many rows a prepacked bf16 linear's product
                           takes the weight's tiles (``tiled_linear``, a GEMV-style
                           stream) instead of oneDNN: an integer (``0``: never), or
                           ``auto`` (default): 64 on CPUs with AVX512-BF16 and no AMX
                           (measured 1.05-2.4x oneDNN at 1-64 rows, even at 128),
                           1 with AMX (oneDNN's tiles win from a few rows), every
                           product on AVX2 CPUs without AVX-512, whose oneDNN has no
                           bf16 (1.4-3.5x ATen's bf16 product at 1-128 rows), else 0,
                           and 0 when SPECDEC_CPU_ISA caps the kernels below the CPU's.
SPECDEC_HUGE_PAGES         Whether the bf16 linears' packed tiles (above) live in
                           2 MB pages (``specdec.host_memory``; Linux transparent huge
                           pages, asked for with ``MADV_HUGEPAGE``): ``1`` on, ``0``
                           off, ``auto`` (default): on where the kernel's transparent
                           huge pages are not ``never`` (measured 0.83-0.88x the time
                           of a step's linears from 4 KB pages). Bitwise no change.
SPECDEC_LAYER_OPS          Whether the decode engine runs the RMSNorm, RoPE and SwiGLU
                           of bf16 / fp16 models on CPU as specdec's C++ layer ops
                           (``specdec.layer_ops``): ``1`` on, ``0`` off, ``auto``
                           (default): on for CPU bf16 / fp16 weights.
SPECDEC_CACHE_DIR          Where ``specdec`` caches the converted default model (default
                           ``~/.cache/specdec``).
SPECDEC_TEST_DEVICE        Default of ``pytest --device`` (``cpu`` or ``cuda``).
TRITON_INTERPRET           Triton's own variable, listed because the tests and the
                           benchmarks set it to ``1`` on CPU (the Triton kernels then run
                           in Triton's interpreter); it must be set before triton loads.
=========================  ==========================================================
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    SPECDEC_JIT: bool = False
    SPECDEC_BUILD_DIR: str | None = None
    SPECDEC_VERBOSE_BUILD: bool = False
    SPECDEC_NO_CUDA: bool = False
    TORCH_CUDA_ARCH_LIST: str = "8.0;9.0"
    SPECDEC_BACKEND: str | None = None
    SPECDEC_VALIDATE: bool = False
    SPECDEC_CPU_ISA: str | None = None
    SPECDEC_COMPILE: bool | str = "auto"
    SPECDEC_COMPILE_MODE: str | None = None
    SPECDEC_PREPACK_WEIGHTS: bool | str = "auto"
    SPECDEC_LAYER_OPS: bool | str = "auto"
    SPECDEC_TILED_ROWS: int | str = "auto"
    SPECDEC_HUGE_PAGES: bool | str = "auto"
    SPECDEC_CACHE_DIR: str = "~/.cache/specdec"
    SPECDEC_TEST_DEVICE: str = "cpu"
    TRITON_INTERPRET: bool = False

DEFAULT_CUDA_ARCHS = "8.0;9.0"


def _flag(name: str) -> bool:
    """Unset, "" and "0" are off; anything else is on."""
    return os.environ.get(name, "0") not in ("", "0")


def _tristate(name: str) -> bool | str:
    """ "auto" when unset, empty or "auto"; else a flag (as _flag)."""
    value = os.environ.get(name, "").strip().lower()
    return "auto" if value in ("", "auto") else value != "0"


def _count_or_auto(name: str) -> int | str:
    """ "auto" when unset, empty or "auto"; else an integer >= 0 (ValueError naming name)."""
    value = os.environ.get(name, "").strip().lower()
    if value in ("", "auto"):
        return "auto"
    if not value.isdigit():
        raise ValueError(f"{name} must be an integer >= 0 or 'auto', got {value!r}")
    return int(value)


def _str(name: str, default: str | None = None) -> str | None:
    """The value, or default when unset or empty."""
    return os.environ.get(name) or default


environment_variables: dict[str, Callable[[], Any]] = {
    # Build and loading of the compiled library.
    "SPECDEC_JIT": lambda: _flag("SPECDEC_JIT"),
    "SPECDEC_BUILD_DIR": lambda: _str("SPECDEC_BUILD_DIR"),
    "SPECDEC_VERBOSE_BUILD": lambda: _flag("SPECDEC_VERBOSE_BUILD"),
    "SPECDEC_NO_CUDA": lambda: _flag("SPECDEC_NO_CUDA"),
    "TORCH_CUDA_ARCH_LIST": lambda: _str("TORCH_CUDA_ARCH_LIST", DEFAULT_CUDA_ARCHS),
    # Ops.
    "SPECDEC_BACKEND": lambda: _str("SPECDEC_BACKEND"),
    "SPECDEC_VALIDATE": lambda: _flag("SPECDEC_VALIDATE"),
    "SPECDEC_CPU_ISA": lambda: _str("SPECDEC_CPU_ISA"),
    # The decode engine.
    "SPECDEC_COMPILE": lambda: _tristate("SPECDEC_COMPILE"),
    "SPECDEC_COMPILE_MODE": lambda: _str("SPECDEC_COMPILE_MODE"),
    "SPECDEC_PREPACK_WEIGHTS": lambda: _tristate("SPECDEC_PREPACK_WEIGHTS"),
    "SPECDEC_LAYER_OPS": lambda: _tristate("SPECDEC_LAYER_OPS"),
    "SPECDEC_TILED_ROWS": lambda: _count_or_auto("SPECDEC_TILED_ROWS"),
    "SPECDEC_HUGE_PAGES": lambda: _tristate("SPECDEC_HUGE_PAGES"),
    "SPECDEC_CACHE_DIR": lambda: _str(
        "SPECDEC_CACHE_DIR", os.path.join(os.path.expanduser("~"), ".cache", "specdec")
    ),
    # Tests and benchmarks.
    "SPECDEC_TEST_DEVICE": lambda: _str("SPECDEC_TEST_DEVICE", "cpu"),
    "TRITON_INTERPRET": lambda: _flag("TRITON_INTERPRET"),
}


def __getattr__(name: str) -> Any:
    if name in environment_variables:
        return environment_variables[name]()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return list(environment_variables)
