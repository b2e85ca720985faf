"""specdec.cpu: one switch for the CPU decode path (prepacked linears + layer ops)."""

import pytest
import torch

from specdec import cpu
from specdec.cpu.packed_linear import PackedLinear, packs
from specdec.models.llama import TransformerBlock

from model_testing import tiny_model


def state(model):
    packed = any(isinstance(m, PackedLinear) for m in model.modules())
    fused = all(m.layer_ops for m in model.modules() if isinstance(m, TransformerBlock))
    return packed, fused


def test_bf16_on_float32_off(monkeypatch):
    model = tiny_model().to(torch.bfloat16)
    cpu.configure(model)
    assert state(model) == (packs(), True)
    model32 = tiny_model()
    cpu.configure(model32)
    assert state(model32) == (False, False)


@pytest.mark.parametrize("var", ["SPECDEC_PREPACK_WEIGHTS", "SPECDEC_LAYER_OPS"])
def test_each_part_has_its_switch(var, monkeypatch):
    model = tiny_model().to(torch.bfloat16)
    cpu.configure(model)
    monkeypatch.setenv(var, "0")
    cpu.configure(model)
    packed, fused = state(model)
    if var == "SPECDEC_PREPACK_WEIGHTS":
        assert not packed and fused
    else:
        assert packed == packs() and not fused
