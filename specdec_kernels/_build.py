"""Build configuration shared by the AOT build (setup.py) and the JIT loader.

Kept free of package imports so that setup.py can load it by path before the
package is installed (envs.py, equally import-free, is then loaded by path too).
"""

from __future__ import annotations

import glob
import importlib.util
import os


def _load_envs():
    try:
        from . import envs  # imported as specdec_kernels._build

        return envs
    except ImportError:  # loaded by path from setup.py
        path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "envs.py")
        spec = importlib.util.spec_from_file_location("_specdec_envs", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module


envs = _load_envs()

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CSRC = os.path.join(ROOT, "csrc")

# -fopenmp: ATen's at::parallel_for is a header template that runs its body serially unless
# the including file is compiled with OpenMP, so without it every CPU kernel ran on one thread.
# The OpenMP runtime is torch's own (libgomp.so.1, already loaded by libtorch_cpu), so the
# kernels share torch's thread pool and torch.set_num_threads.
CXX_FLAGS = ["-O3", "-std=c++20", "-fno-math-errno", "-fopenmp"]
LD_FLAGS = ["-fopenmp"]
NVCC_FLAGS = ["-O3", "-std=c++20", "--use_fast_math", "-lineinfo", "--expt-relaxed-constexpr"]
# sm_80 (A100) and sm_90 (H100/H200) unless TORCH_CUDA_ARCH_LIST says otherwise.
DEFAULT_CUDA_ARCHS = envs.DEFAULT_CUDA_ARCHS


def cpp_sources() -> list[str]:
    return [os.path.join(CSRC, "ops.cpp"), os.path.join(CSRC, "checks.cpp")] + sorted(
        glob.glob(os.path.join(CSRC, "cpu", "*.cpp"))
    )


def cuda_sources() -> list[str]:
    return sorted(glob.glob(os.path.join(CSRC, "cuda", "*.cu")))


def want_cuda() -> bool:
    """Build the CUDA kernels when torch has CUDA and nvcc is found (SPECDEC_NO_CUDA=1 opts out)."""
    if envs.SPECDEC_NO_CUDA:
        return False
    import torch
    from torch.utils.cpp_extension import CUDA_HOME

    return torch.version.cuda is not None and CUDA_HOME is not None and bool(cuda_sources())


def include_dirs() -> list[str]:
    """csrc/, plus the CUDA headers that ship with pip's CUDA torch (nvidia/cu13/include)."""
    dirs = [CSRC]
    try:
        import nvidia

        for base in nvidia.__path__:
            dirs += sorted(glob.glob(os.path.join(base, "cu*", "include")))
    except ImportError:
        pass
    return dirs


def cuda_arch_flags() -> list[str]:
    archs = envs.TORCH_CUDA_ARCH_LIST
    flags = []
    for arch in archs.replace(",", ";").replace(" ", ";").split(";"):
        if not arch:
            continue
        num = arch.replace("+PTX", "").replace(".", "")
        flags.append(f"-gencode=arch=compute_{num},code=sm_{num}")
        if arch.endswith("+PTX"):
            flags.append(f"-gencode=arch=compute_{num},code=compute_{num}")
    return flags
