"""Every environment variable the engine reads (the decode engine, the CPU decode path, the
model cache), in one place, read the way ``specdec_kernels/envs.py`` reads the kernels' own:
as an attribute, ``from specdec import envs; envs.SPECDEC_LAYER_OPS``, parsed at that moment
(flags: unset, ``""`` and ``"0"`` are off; ``auto`` when unset or empty where a variable has
an automatic setting). No other module of the package reads these names from ``os.environ``.

=========================  ==========================================================
variable                   meaning
=========================  ==========================================================
SPECDEC_COMPILE            Whether the decode engine runs the target's verify step
                           through torch.compile (``specdec.runtime.compiled_step``): ``1``
                           on, ``0`` off, ``auto`` (default, also when unset or
                           empty): off for now (compile time, minutes per tree size
                           on CPU, outweighs the per-step gain in short runs). The
                           CLI's ``--compile`` / ``--no-compile`` override it.
SPECDEC_COMPILE_MODE       torch.compile's ``mode`` for that step: ``default``,
                           ``reduce-overhead`` (CUDA graphs), ``max-autotune``, ...
                           (default: ``reduce-overhead`` on CUDA, ``default`` on CPU).
SPECDEC_PREPACK_WEIGHTS    Whether the decode engine runs the bf16 linear layers of
                           the target and the drafter on CPU with oneDNN-prepacked
                           weights (``specdec.cpu.packed_linear``): ``1`` on, ``0`` off,
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
                           2 MB pages (``specdec.cpu.host_memory``; Linux transparent huge
                           pages, asked for with ``MADV_HUGEPAGE``): ``1`` on, ``0``
                           off, ``auto`` (default): on where the kernel's transparent
                           huge pages are not ``never`` (measured 0.83-0.88x the time
                           of a step's linears from 4 KB pages). Bitwise no change.
SPECDEC_LAYER_OPS          Whether the decode engine runs the RMSNorm, RoPE and SwiGLU
                           of bf16 / fp16 models on CPU as specdec's C++ layer ops
                           (``specdec.cpu.layer_ops``): ``1`` on, ``0`` off, ``auto``
                           (default): on for CPU bf16 / fp16 weights.
SPECDEC_API_KEY            ``specdec serve``'s API key when ``--api-key`` is not given: clients
                           must send ``Authorization: Bearer KEY`` on ``/v1/*``.
SPECDEC_VLLM_SAMPLER       ``1``: vLLM's rejection sampling through
                           ``torch.ops.specdec.tree_rejection_sample`` in every vLLM engine
                           (``specdec.integrations.vllm``; per engine: ``sampler="specdec"``).
SPECDEC_CACHE_DIR          Where ``specdec`` caches the converted default model (default
                           ``~/.cache/specdec``).
ONEDNN_PRIMITIVE_CACHE_    oneDNN's own: how many compiled kernels (one per matrix shape
CAPACITY                   it ran: every prompt length a prefill met) it keeps. Default
                           1024; ``specdec serve`` sets 128 when unset
                           (``bound_onednn_primitive_cache``): at 1024 a server's memory
                           grew by ~0.65 MB per new prompt length (12.9% over a
                           10-minute soak; docs/serving.md, Soak), and 128 cost no
                           measurable time.
=========================  ==========================================================
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from specdec_kernels.envs import parse_count_or_auto, parse_flag, parse_str, parse_tristate

if TYPE_CHECKING:
    SPECDEC_COMPILE: bool | str = "auto"
    SPECDEC_COMPILE_MODE: str | None = None
    SPECDEC_PREPACK_WEIGHTS: bool | str = "auto"
    SPECDEC_LAYER_OPS: bool | str = "auto"
    SPECDEC_TILED_ROWS: int | str = "auto"
    SPECDEC_HUGE_PAGES: bool | str = "auto"
    SPECDEC_CACHE_DIR: str = "~/.cache/specdec"
    SPECDEC_API_KEY: str | None = None
    SPECDEC_VLLM_SAMPLER: bool = False

environment_variables: dict[str, Callable[[], Any]] = {
    # The verify step through torch.compile (specdec.runtime.compiled_step).
    "SPECDEC_COMPILE": lambda: parse_tristate("SPECDEC_COMPILE"),
    "SPECDEC_COMPILE_MODE": lambda: parse_str("SPECDEC_COMPILE_MODE"),
    # The CPU decode path (specdec.cpu).
    "SPECDEC_PREPACK_WEIGHTS": lambda: parse_tristate("SPECDEC_PREPACK_WEIGHTS"),
    "SPECDEC_LAYER_OPS": lambda: parse_tristate("SPECDEC_LAYER_OPS"),
    "SPECDEC_TILED_ROWS": lambda: parse_count_or_auto("SPECDEC_TILED_ROWS"),
    "SPECDEC_HUGE_PAGES": lambda: parse_tristate("SPECDEC_HUGE_PAGES"),
    # The server (specdec serve) and the vLLM plugin.
    "SPECDEC_API_KEY": lambda: parse_str("SPECDEC_API_KEY"),
    "SPECDEC_VLLM_SAMPLER": lambda: parse_flag("SPECDEC_VLLM_SAMPLER"),
    # Where the converted default model is cached (specdec.models.loader).
    "SPECDEC_CACHE_DIR": lambda: parse_str(
        "SPECDEC_CACHE_DIR", os.path.join(os.path.expanduser("~"), ".cache", "specdec")
    ),
}


SERVE_ONEDNN_PRIMITIVE_CACHE = 128


def bound_onednn_primitive_cache(capacity: int = SERVE_ONEDNN_PRIMITIVE_CACHE) -> None:
    """Caps oneDNN's primitive cache at `capacity` unless ONEDNN_PRIMITIVE_CACHE_CAPACITY is
    set. oneDNN reads the variable when it first builds a kernel: call before any."""
    os.environ.setdefault("ONEDNN_PRIMITIVE_CACHE_CAPACITY", str(capacity))


def __getattr__(name: str) -> Any:
    if name in environment_variables:
        return environment_variables[name]()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return list(environment_variables)
