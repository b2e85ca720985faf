"""The machine description recorded beside every figure (specdec.bench.common)."""

import sys

import pytest
import torch

from specdec.bench.common import machine_info
from specdec_kernels.testing import cpu_description


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/cpuinfo")
def test_cpu_description_names_generation_and_vector_isa():
    with open("/proc/cpuinfo") as f:
        text = f.read()
    flags = set(next(line for line in text.splitlines() if line.startswith("flags")).split())
    desc = cpu_description()
    assert "family" in desc and "model" in desc, desc
    listed = desc.rsplit("; ", 1)[-1].rstrip(")").split(", ")
    for isa in ("avx2", "avx512f", "avx512_bf16", "amx_bf16"):
        assert (isa in listed) == (isa in flags), (isa, desc)


def test_machine_info_records_the_cpu_description():
    assert machine_info(torch.device("cpu"))["machine"].startswith(cpu_description())
