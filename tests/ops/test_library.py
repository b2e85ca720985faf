"""The compiled library: built with OpenMP, so ATen's at::parallel_for (a header template that
runs its body serially in a file compiled without it) spreads the CPU kernels over torch's
threads, and sharing torch's OpenMP runtime (one libgomp in the process, one thread pool)."""

import pytest
import torch

import specdec_kernels
from specdec_kernels import _library


def test_built_with_openmp_on_torchs_runtime():
    path = _library.compiled_library_path()
    if path is None or specdec_kernels.load_library() != "aot":
        pytest.skip("a JIT build: its flags are _build.CXX_FLAGS, checked below")
    with open(path, "rb") as f:
        assert b"GOMP_parallel" in f.read()  # parallel_for's OpenMP region is compiled in
    torch.ops.specdec.tiled_linear(  # runs a parallel_for
        torch.randn(2, 64).bfloat16(), torch.randn(4, 32, 64, 2).bfloat16(), 256
    )
    with open("/proc/self/maps") as maps:
        runtimes = {line.split()[-1] for line in maps if "libgomp" in line}
    assert len(runtimes) <= 1, runtimes


def test_build_flags_ask_for_openmp():
    from specdec_kernels import _build

    assert "-fopenmp" in _build.CXX_FLAGS and "-fopenmp" in _build.LD_FLAGS
