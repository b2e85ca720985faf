"""Prepacked bf16 linears (specdec.cpu.packed_linear): oneDNN's copy gives the same numbers as
F.linear, the tiles' float32 sums within rounding of float64 and row by row the same whatever
the other rows; the layout chosen by rows (SPECDEC_TILED_ROWS), a weight changed in place is
repacked, training and other dtypes untouched, the engine's switch."""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from specdec.cpu import packed_linear
from specdec.cpu.packed_linear import PackedLinear

from model_testing import bf16_run, tiny_model

ONEDNN = packed_linear._supported()  # oneDNN's bf16 layout
PACKS = packed_linear.packs()  # the linears are packed by default here
needs_onednn = pytest.mark.skipif(not ONEDNN, reason="oneDNN without bf16 on this CPU")


def linear(in_features, out_features, bias, seed=0):
    gen = torch.Generator().manual_seed(seed)
    lin = nn.Linear(in_features, out_features, bias=bias).to(torch.bfloat16)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(lin.weight.shape, generator=gen))
        if bias:
            lin.bias.copy_(torch.randn(lin.bias.shape, generator=gen))
    return lin


def reference_product(x, lin):
    bias = None if lin.bias is None else lin.bias.double()
    return F.linear(x.double(), lin.weight.double(), bias)


@needs_onednn
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [1, 3, 16, 32, 200])
def test_onednn_same_as_f_linear(bias, rows, monkeypatch):
    monkeypatch.setenv("SPECDEC_TILED_ROWS", "0")
    lin = linear(96, 160, bias)
    x = torch.randn(2, rows, 96).to(torch.bfloat16)
    want = F.linear(x, lin.weight, lin.bias)
    packed = PackedLinear.convert(copy.deepcopy(lin))
    with torch.no_grad():
        got = packed(x)
    assert list(packed._pack._packed) == ["onednn"]  # the packed path ran
    assert got.shape == want.shape and got.dtype == torch.bfloat16
    if rows <= 32:  # the same oneDNN kernels as F.linear: bitwise
        assert torch.equal(got, want)
    else:  # float32 accumulation either way; may round differently
        ref = reference_product(x, lin)
        assert (got.double() - ref).abs().max() <= 0.02 * ref.abs().max()


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [1, 2, 5, 6, 7, 13, 64])
def test_tiles_within_rounding_and_row_independent(bias, rows, monkeypatch):
    """Up to SPECDEC_TILED_ROWS rows take the tiles: float32 sums of the bf16 products, one
    rounding (so within an ulp of bf16 of float64 but for the float32 sum's error), and each
    row bitwise what it gives alone (a tree's node the same as a plain step's token)."""
    monkeypatch.setenv("SPECDEC_TILED_ROWS", "64")
    lin = PackedLinear.convert(linear(96, 160, bias))  # 160 = 2.5 tiles: a padded last tile
    x = torch.randn(rows, 96).to(torch.bfloat16)
    with torch.no_grad():
        got = lin(x)
        alone = torch.cat([lin(x[r : r + 1]) for r in range(rows)])
    assert list(lin._pack._packed) == ["tiles"]
    assert torch.equal(got, alone)
    ref = reference_product(x, lin)
    bound = 2**-8 * ref.abs() + 1e-5 * (x.double().abs() @ lin.weight.double().abs().T)
    assert ((got.double() - ref).abs() <= bound).all()


@needs_onednn
def test_layout_by_rows(monkeypatch):
    """SPECDEC_TILED_ROWS=4: up to 4 rows take the tiles, more oneDNN's copy; both are kept,
    and both are dropped when the weight changes. Odd in_features never take tiles."""
    monkeypatch.setenv("SPECDEC_TILED_ROWS", "4")
    lin = PackedLinear.convert(linear(64, 48, False))
    with torch.no_grad():
        lin(torch.randn(2, 2, 64).to(torch.bfloat16))  # 4 rows
        assert list(lin._pack._packed) == ["tiles"]
        lin(torch.randn(5, 64).to(torch.bfloat16))
        assert sorted(lin._pack._packed) == ["onednn", "tiles"]
        assert lin.packed_weight(torch.randn(3, 64).to(torch.bfloat16)).dim() == 4
        lin.weight.add_(1)
        lin(torch.randn(5, 64).to(torch.bfloat16))
        assert list(lin._pack._packed) == ["onednn"]
        odd = PackedLinear.convert(linear(63, 48, False))
        odd(torch.randn(1, 63).to(torch.bfloat16))
        assert list(odd._pack._packed) == ["onednn"]


def test_without_onednn_wider_products_take_f_linear(monkeypatch):
    """Where oneDNN has no bf16 (AVX2 CPUs) the tiles are the only packed layout: products of
    more rows than SPECDEC_TILED_ROWS take F.linear, bitwise, and pack nothing."""
    monkeypatch.setattr(packed_linear, "_supported", lambda: False)
    monkeypatch.setenv("SPECDEC_TILED_ROWS", "4")
    lin = PackedLinear.convert(linear(64, 48, True))
    x = torch.randn(5, 64).to(torch.bfloat16)
    with torch.no_grad():
        assert torch.equal(lin(x), F.linear(x, lin.weight, lin.bias))
        assert not lin._pack._packed
        lin(x[:4])
    assert list(lin._pack._packed) == ["tiles"]


def test_tiled_rows_setting(monkeypatch):
    """SPECDEC_TILED_ROWS: an integer, or auto by the CPU: 64 with AVX512-BF16 and no AMX, 1
    with AMX, every product on AVX2 CPUs without AVX-512 (whose oneDNN has no bf16), else 0,
    and 0 under a lower SPECDEC_CPU_ISA cap."""
    monkeypatch.setattr(packed_linear, "_supported", lambda: False)  # as on AVX2 CPUs
    monkeypatch.setenv("SPECDEC_TILED_ROWS", "12")
    assert packed_linear.tiled_rows() == 12
    monkeypatch.setenv("SPECDEC_TILED_ROWS", "lots")
    with pytest.raises(ValueError, match="SPECDEC_TILED_ROWS"):
        packed_linear.tiled_rows()
    monkeypatch.setenv("SPECDEC_TILED_ROWS", "auto")
    for capability, cap, want in [
        ({"avx512_bf16": True, "amx_bf16": False}, None, 64),
        ({"avx512_bf16": True, "amx_bf16": True}, None, 1),
        ({"avx512_bf16": False}, None, 0),
        ({"avx512_bf16": True, "amx_bf16": False}, "avx2", 0),
        ({"avx2": True}, None, packed_linear.AVX2_TILED_ROWS),
        ({"avx2": True}, "baseline", 0),
        ({"avx2": True, "avx512_f": True}, None, 0),  # AVX-512 without BF16: unmeasured
    ]:
        monkeypatch.setattr(torch._C._cpu, "_get_cpu_capability", lambda c=capability: c)
        if cap is None:
            monkeypatch.delenv("SPECDEC_CPU_ISA", raising=False)
        else:
            monkeypatch.setenv("SPECDEC_CPU_ISA", cap)
        packed_linear._auto_tiled_rows.cache_clear()
        assert packed_linear.tiled_rows() == want
    packed_linear._auto_tiled_rows.cache_clear()


@pytest.mark.parametrize("tiled_rows", ["0", "64"])
def test_weight_changed_in_place_is_repacked(tiled_rows, monkeypatch):
    if tiled_rows == "0" and not ONEDNN:
        pytest.skip("oneDNN without bf16 on this CPU")
    monkeypatch.setenv("SPECDEC_TILED_ROWS", tiled_rows)
    lin = PackedLinear.convert(linear(64, 48, False))
    x = torch.randn(4, 64).to(torch.bfloat16)
    fresh = PackedLinear.convert(linear(64, 48, False))  # packs each weight anew
    with torch.no_grad():
        before = lin(x)
        lin.weight.mul_(-2)  # a stale packed copy would return `before`
        after = lin(x)
        fresh.weight.copy_(lin.weight)
        want_after = fresh(x)
        lin.weight.copy_(torch.randn(48, 64).to(torch.bfloat16))  # load_state_dict does this
        reloaded = lin(x)
        fresh.weight.copy_(lin.weight)
        want_reloaded = fresh(x)
    assert not torch.equal(after, before)
    assert torch.equal(after, want_after)
    assert torch.equal(reloaded, want_reloaded)


def test_training_and_other_dtypes_take_f_linear():
    lin = PackedLinear.convert(linear(32, 16, True))
    x = torch.randn(3, 32).to(torch.bfloat16)
    y = lin(x)  # grad mode, weight requires grad: autograd as nn.Linear
    y.float().sum().backward()
    assert lin.weight.grad is not None and not lin._pack._packed
    lin32 = PackedLinear.convert(nn.Linear(32, 16))
    with torch.no_grad():
        out = lin32(torch.randn(3, 32))
    assert out.dtype == torch.float32 and not lin32._pack._packed


def test_configure_switch_and_state_dict(monkeypatch):
    model = tiny_model().to(torch.bfloat16)
    keys = list(model.state_dict())
    n_linear = sum(isinstance(m, nn.Linear) for m in model.modules())
    monkeypatch.setenv("SPECDEC_PREPACK_WEIGHTS", "0")
    assert packed_linear.configure(model) == 0
    monkeypatch.delenv("SPECDEC_PREPACK_WEIGHTS")
    packed = packed_linear.configure(model)
    assert packed == (n_linear if PACKS else 0)
    kinds = {type(m) for m in model.modules() if isinstance(m, nn.Linear)}
    assert kinds == ({PackedLinear} if PACKS else {nn.Linear})
    assert list(model.state_dict()) == keys  # same parameters, same names
    assert packed_linear.configure(model, False) == 0  # unpacks
    assert {type(m) for m in model.modules() if isinstance(m, nn.Linear)} == {nn.Linear}
    # float32 models are never packed: the exactness contract's dtype keeps F.linear
    assert packed_linear.configure(tiny_model(), True) == 0
    # "auto" leaves the weights alone when their packed copy would not fit in half the memory
    monkeypatch.setattr(packed_linear, "free_memory", lambda device: 1000)
    assert packed_linear.configure(model) == 0
    assert packed_linear.configure(model, True) == (n_linear if PACKS else 0)  # asked for


@needs_onednn
@pytest.mark.parametrize("tree", ["chain:1", "dynamic:4,3,10"])
def test_engine_bf16_same_tokens_packed_or_not(tree, monkeypatch):
    """The engine packs a bf16 target and its EAGLE head by default; in oneDNN's layout at these
    sizes (M <= 32 rows per matmul) the numbers are bitwise those of F.linear, so the tokens
    are too."""
    monkeypatch.setenv("SPECDEC_TILED_ROWS", "0")
    outs = []
    for setting in ("0", "1"):
        tokens, model, head = bf16_run(tree, monkeypatch, SPECDEC_PREPACK_WEIGHTS=setting)
        packed = {type(m) for m in (*model.modules(), *head.modules()) if isinstance(m, nn.Linear)}
        assert packed == ({PackedLinear} if setting == "1" else {nn.Linear})
        outs.append(tokens)
    assert outs[0] == outs[1]


def test_subclasses_with_their_own_forward_are_left_alone():
    """Tensor parallelism's row-parallel linear sums its partial outputs in forward: switching
    its class would drop the all_reduce."""
    from specdec.models.tensor_parallel import RowParallelLinear

    model = tiny_model().to(torch.bfloat16)
    block = model.layers[0]
    row_parallel = RowParallelLinear(64, 32, bias=False).to(torch.bfloat16)
    block.feed_forward.w2 = row_parallel
    packed_linear.configure(model, True)
    assert type(block.feed_forward.w2) is RowParallelLinear
    assert type(block.attention.wo) is (PackedLinear if PACKS else nn.Linear)


@needs_onednn
@pytest.mark.parametrize("layout", ["onednn", "tiles"])
@pytest.mark.parametrize("rows", [1, 8, 32])
def test_eagle_draft_lm_head_runs_prepacked(rows, layout, monkeypatch):
    """An EAGLE-2 head with a draft vocabulary drafts through its own copy of the lm_head
    rows: prepacked once the head's linears are (specdec.cpu): oneDNN's bitwise F.linear's
    logits, the tiles' as tiled_linear computes them."""
    from specdec import cpu
    from specdec.drafters.eagle_head import EagleHead
    from specdec_kernels import ops

    monkeypatch.setenv("SPECDEC_TILED_ROWS", "64" if layout == "tiles" else "0")
    target = tiny_model().to(torch.bfloat16)
    head = EagleHead.random(target, seed=1).set_draft_vocab(torch.arange(0, 32, 3))
    hidden = torch.randn(2, rows, target.args.dim).to(torch.bfloat16)
    with torch.no_grad():
        plain = head.draft_logits(hidden)
        assert not head._draft_lm_pack._packed  # plain linears: F.linear
        cpu.configure(head)
        assert isinstance(head.fc, PackedLinear)
        packed = head.draft_logits(hidden)
    assert list(head._draft_lm_pack._packed) == [layout]
    weight = head.draft_lm_weight
    want = F.linear(hidden, weight).float()
    assert torch.equal(plain, want)
    if layout == "onednn":
        assert torch.equal(packed, want)
    else:
        tiles = ops.pack_linear_tiles(weight)
        assert torch.equal(packed, ops.tiled_linear(hidden, tiles, weight.shape[0]).float())
