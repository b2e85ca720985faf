"""Shared fixtures: the device under test and the backend under test.

`pytest` runs everything on CPU tensors: the C++ kernels directly and the Triton
kernels under TRITON_INTERPRET=1. `pytest --device cuda` runs the same tests on
CUDA tensors (C++ CUDA kernels and compiled Triton kernels).
"""

import importlib.util
import os
import zlib

import pytest
import torch

from specdec_kernels import envs


def pytest_addoption(parser):
    parser.addoption(
        "--device",
        default=envs.SPECDEC_TEST_DEVICE,
        choices=["cpu", "cuda"],
        help="device the op tests run on",
    )


def pytest_configure(config):
    if config.getoption("--device") == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the first triton import


HAVE_TRITON = importlib.util.find_spec("triton") is not None


@pytest.fixture
def device(request):
    dev = request.config.getoption("--device")
    if dev == "cuda" and not torch.cuda.is_available():
        pytest.fail("--device cuda was requested but torch.cuda.is_available() is False")
    return torch.device(dev)


@pytest.fixture(params=["cpp", "triton"])
def backend(request):
    """Kernel backend under test; the reference is the oracle, never the subject."""
    if request.param == "triton" and not HAVE_TRITON:
        pytest.skip("triton is not installed (pip install triton to test the Triton kernels)")
    return request.param


@pytest.fixture(autouse=True)
def _fresh_seed(request):
    """Fresh random data per test, reproducible from the test id (printed on failure)."""
    seed = zlib.crc32(request.node.nodeid.encode())  # not hash(): str hashes are salted per process
    torch.manual_seed(seed)
    return seed


@pytest.fixture
def cpu_isa():
    """cpu_isa(name) caps the C++ CPU kernels' build for this test (specdec_kernels.set_cpu_isa);
    the cap of SPECDEC_CPU_ISA is restored afterwards."""
    import specdec_kernels
    from specdec_kernels import envs

    yield specdec_kernels.set_cpu_isa
    specdec_kernels.set_cpu_isa(envs.SPECDEC_CPU_ISA)


@pytest.fixture(scope="module")
def single_thread():
    """Model-level tests (tiny matmuls, the 135M model) on a 2-core box: intra-op threads mostly
    add synchronisation. Opt in with `pytestmark = pytest.mark.usefixtures("single_thread")`."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
