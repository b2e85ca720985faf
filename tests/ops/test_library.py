"""The compiled library: built with OpenMP, so ATen's at::parallel_for (a header template that
runs its body serially in a file compiled without it) spreads the CPU kernels over torch's
threads, and sharing torch's OpenMP runtime (one libgomp in the process, one thread pool)."""

import ast
import os
import subprocess
import sys

import pytest

import specdec_kernels
from specdec_kernels import _library

# Run in a fresh interpreter: other libraries this suite imports (vLLM's, llama.cpp's) may map
# their own OpenMP runtime into the test process; the claim is about torch and this library.
_ONE_RUNTIME = """
import torch, specdec_kernels
torch.ops.specdec.tiled_linear(  # runs a parallel_for
    torch.randn(2, 64).bfloat16(), torch.randn(4, 32, 64, 2).bfloat16(), 256
)
with open("/proc/self/maps") as maps:
    print(sorted({line.split()[-1] for line in maps if "libgomp" in line}))
"""


def test_built_with_openmp_on_torchs_runtime(tmp_path):
    path = _library.compiled_library_path()
    if path is None or specdec_kernels.load_library() != "aot":
        pytest.skip("a JIT build: its flags are _build.CXX_FLAGS, checked below")
    with open(path, "rb") as f:
        assert b"GOMP_parallel" in f.read()  # parallel_for's OpenMP region is compiled in
    roots = {os.path.dirname(os.path.dirname(os.path.abspath(specdec_kernels.__file__)))}
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([*roots, os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run(
        [sys.executable, "-c", _ONE_RUNTIME],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,  # `-c` puts the cwd first: not the checkout's sources
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    runtimes = ast.literal_eval(proc.stdout.strip().splitlines()[-1])
    assert len(runtimes) == 1, runtimes


def test_build_flags_ask_for_openmp():
    from specdec_kernels import _build

    assert "-fopenmp" in _build.CXX_FLAGS and "-fopenmp" in _build.LD_FLAGS
