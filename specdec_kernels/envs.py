"""Every environment variable the kernels package reads, in one place (the model is vLLM's
``envs.py``); the engine's own variables are in ``specdec/envs.py``, read the same way.

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
SPECDEC_CPU_ISA            Caps the CPU kernels' instruction set: ``amx``,
                           ``avx512bf16``, ``avx512``, ``avx2`` or ``baseline``
                           (default: the best the CPU has). Passed to C++ when the
                           library loads; ``specdec_kernels.set_cpu_isa(name)`` changes
                           it at run time, ``specdec_kernels.cpu_isa()`` reads it.
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
    SPECDEC_TEST_DEVICE: str = "cpu"
    TRITON_INTERPRET: bool = False

DEFAULT_CUDA_ARCHS = "8.0;9.0"


def parse_flag(name: str) -> bool:
    """Unset, "" and "0" are off; anything else is on."""
    return os.environ.get(name, "0") not in ("", "0")


def parse_tristate(name: str) -> bool | str:
    """ "auto" when unset, empty or "auto"; else a flag (as parse_flag)."""
    value = os.environ.get(name, "").strip().lower()
    return "auto" if value in ("", "auto") else value != "0"


def parse_count_or_auto(name: str) -> int | str:
    """ "auto" when unset, empty or "auto"; else an integer >= 0 (ValueError naming name)."""
    value = os.environ.get(name, "").strip().lower()
    if value in ("", "auto"):
        return "auto"
    if not value.isdigit():
        raise ValueError(f"{name} must be an integer >= 0 or 'auto', got {value!r}")
    return int(value)


def parse_str(name: str, default: str | None = None) -> str | None:
    """The value, or default when unset or empty."""
    return os.environ.get(name) or default


environment_variables: dict[str, Callable[[], Any]] = {
    # Build and loading of the compiled library.
    "SPECDEC_JIT": lambda: parse_flag("SPECDEC_JIT"),
    "SPECDEC_BUILD_DIR": lambda: parse_str("SPECDEC_BUILD_DIR"),
    "SPECDEC_VERBOSE_BUILD": lambda: parse_flag("SPECDEC_VERBOSE_BUILD"),
    "SPECDEC_NO_CUDA": lambda: parse_flag("SPECDEC_NO_CUDA"),
    "TORCH_CUDA_ARCH_LIST": lambda: parse_str("TORCH_CUDA_ARCH_LIST", DEFAULT_CUDA_ARCHS),
    # Ops.
    "SPECDEC_BACKEND": lambda: parse_str("SPECDEC_BACKEND"),
    "SPECDEC_VALIDATE": lambda: parse_flag("SPECDEC_VALIDATE"),
    "SPECDEC_CPU_ISA": lambda: parse_str("SPECDEC_CPU_ISA"),
    # Tests and benchmarks.
    "SPECDEC_TEST_DEVICE": lambda: parse_str("SPECDEC_TEST_DEVICE", "cpu"),
    "TRITON_INTERPRET": lambda: parse_flag("TRITON_INTERPRET"),
}


def __getattr__(name: str) -> Any:
    if name in environment_variables:
        return environment_variables[name]()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return list(environment_variables)
