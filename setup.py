"""AOT build: `pip install --no-build-isolation .` compiles csrc/ into specdec_kernels/_C.

CPU kernels always; CUDA kernels too when torch has CUDA and nvcc is found.
"""

import importlib.util
import os

from setuptools import setup
from torch.utils.cpp_extension import BuildExtension, CppExtension, CUDAExtension

_spec = importlib.util.spec_from_file_location(
    "_specdec_build",
    os.path.join(os.path.dirname(os.path.abspath(__file__)), "specdec_kernels", "_build.py"),
)
build = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(build)


def extension():
    def rel(paths):
        return [os.path.relpath(p, build.ROOT) for p in paths]

    if build.want_cuda():
        return CUDAExtension(
            "specdec_kernels._C",
            rel(build.cpp_sources() + build.cuda_sources()),
            include_dirs=build.include_dirs(),
            define_macros=[("SPECDEC_WITH_CUDA", None)],
            extra_compile_args={
                "cxx": build.CXX_FLAGS,
                "nvcc": build.NVCC_FLAGS + build.cuda_arch_flags(),
            },
            extra_link_args=build.LD_FLAGS,
        )
    return CppExtension(
        "specdec_kernels._C",
        rel(build.cpp_sources()),
        include_dirs=build.include_dirs(),
        extra_compile_args={"cxx": build.CXX_FLAGS},
        extra_link_args=build.LD_FLAGS,
    )


setup(
    ext_modules=[extension()],
    cmdclass={"build_ext": BuildExtension.with_options(use_ninja=True)},
)
