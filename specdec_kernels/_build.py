"""Build configuration shared by the AOT build (setup.py) and the JIT loader.

Kept free of package imports so that setup.py can load it by path before the
package is installed.
"""
import glob
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CSRC = os.path.join(ROOT, "csrc")

CXX_FLAGS = ["-O3", "-std=c++20", "-fno-math-errno"]
NVCC_FLAGS = ["-O3", "-std=c++20", "--use_fast_math", "-lineinfo", "--expt-relaxed-constexpr"]
# sm_80 (A100) and sm_90 (H100/H200) unless TORCH_CUDA_ARCH_LIST says otherwise.
DEFAULT_CUDA_ARCHS = "8.0;9.0"


def cpp_sources():
    return [os.path.join(CSRC, "ops.cpp"), os.path.join(CSRC, "checks.cpp")] + sorted(
        glob.glob(os.path.join(CSRC, "cpu", "*.cpp"))
    )


def cuda_sources():
    return sorted(glob.glob(os.path.join(CSRC, "cuda", "*.cu")))


def want_cuda():
    """Build the CUDA kernels when torch has CUDA and nvcc is found (SPECDEC_NO_CUDA=1 opts out)."""
    if os.environ.get("SPECDEC_NO_CUDA", "0") not in ("", "0"):
        return False
    import torch
    from torch.utils.cpp_extension import CUDA_HOME

    return torch.version.cuda is not None and CUDA_HOME is not None and bool(cuda_sources())


def include_dirs():
    """csrc/, plus the CUDA headers that ship with pip's CUDA torch (nvidia/cu13/include)."""
    dirs = [CSRC]
    try:
        import nvidia

        for base in nvidia.__path__:
            dirs += sorted(glob.glob(os.path.join(base, "cu*", "include")))
    except ImportError:
        pass
    return dirs


def cuda_arch_flags():
    archs = os.environ.get("TORCH_CUDA_ARCH_LIST", DEFAULT_CUDA_ARCHS)
    flags = []
    for arch in archs.replace(",", ";").replace(" ", ";").split(";"):
        if not arch:
            continue
        num = arch.replace("+PTX", "").replace(".", "")
        flags.append(f"-gencode=arch=compute_{num},code=sm_{num}")
        if arch.endswith("+PTX"):
            flags.append(f"-gencode=arch=compute_{num},code=compute_{num}")
    return flags
