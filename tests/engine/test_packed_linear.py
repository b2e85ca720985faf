"""Prepacked bf16 linears (specdec.packed_linear): the same numbers as F.linear, a weight
changed in place is repacked, training and other dtypes untouched, the engine's switch."""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from specdec import packed_linear
from specdec.packed_linear import PackedLinear

from test_engine import bf16_run, tiny_model

SUPPORTED = packed_linear._supported()
needs_bf16 = pytest.mark.skipif(not SUPPORTED, reason="oneDNN without bf16 on this CPU")


def linear(in_features, out_features, bias, seed=0):
    gen = torch.Generator().manual_seed(seed)
    lin = nn.Linear(in_features, out_features, bias=bias).to(torch.bfloat16)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(lin.weight.shape, generator=gen))
        if bias:
            lin.bias.copy_(torch.randn(lin.bias.shape, generator=gen))
    return lin


@needs_bf16
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [1, 3, 16, 32, 200])
def test_same_as_f_linear(bias, rows):
    lin = linear(96, 160, bias)
    x = torch.randn(2, rows, 96).to(torch.bfloat16)
    want = F.linear(x, lin.weight, lin.bias)
    packed = PackedLinear.convert(copy.deepcopy(lin))
    with torch.no_grad():
        got = packed(x)
    assert packed._pack._packed is not None  # the packed path ran
    assert got.shape == want.shape and got.dtype == torch.bfloat16
    if rows <= 32:  # the same oneDNN kernels as F.linear: bitwise
        assert torch.equal(got, want)
    else:  # float32 accumulation either way; may round differently
        ref = x.double() @ lin.weight.double().T + (lin.bias.double() if bias else 0)
        assert (got.double() - ref).abs().max() <= 0.02 * ref.abs().max()


@needs_bf16
def test_weight_changed_in_place_is_repacked():
    lin = PackedLinear.convert(linear(64, 48, False))
    x = torch.randn(4, 64).to(torch.bfloat16)
    with torch.no_grad():
        before = lin(x)
        lin.weight.mul_(-2)  # a stale packed copy would return `before`
        after = lin(x)
        want_after = F.linear(x, lin.weight)
        lin.weight.copy_(torch.randn(48, 64).to(torch.bfloat16))  # load_state_dict does this
        reloaded = lin(x)
        want_reloaded = F.linear(x, lin.weight)
    assert not torch.equal(after, before)
    assert torch.equal(after, want_after)
    assert torch.equal(reloaded, want_reloaded)


@needs_bf16
def test_training_and_other_dtypes_take_f_linear():
    lin = PackedLinear.convert(linear(32, 16, True))
    x = torch.randn(3, 32).to(torch.bfloat16)
    y = lin(x)  # grad mode, weight requires grad: autograd as nn.Linear
    y.float().sum().backward()
    assert lin.weight.grad is not None and lin._pack._packed is None
    lin32 = PackedLinear.convert(nn.Linear(32, 16))
    with torch.no_grad():
        out = lin32(torch.randn(3, 32))
    assert out.dtype == torch.float32 and lin32._pack._packed is None


def test_configure_switch_and_state_dict(monkeypatch):
    model = tiny_model().to(torch.bfloat16)
    keys = list(model.state_dict())
    n_linear = sum(isinstance(m, nn.Linear) for m in model.modules())
    monkeypatch.setenv("SPECDEC_PREPACK_WEIGHTS", "0")
    assert packed_linear.configure(model) == 0
    monkeypatch.delenv("SPECDEC_PREPACK_WEIGHTS")
    packed = packed_linear.configure(model)
    assert packed == (n_linear if SUPPORTED else 0)
    kinds = {type(m) for m in model.modules() if isinstance(m, nn.Linear)}
    assert kinds == ({PackedLinear} if SUPPORTED else {nn.Linear})
    assert list(model.state_dict()) == keys  # same parameters, same names
    assert packed_linear.configure(model, False) == 0  # unpacks
    assert {type(m) for m in model.modules() if isinstance(m, nn.Linear)} == {nn.Linear}
    # float32 models are never packed: the exactness contract's dtype keeps F.linear
    assert packed_linear.configure(tiny_model(), True) == 0
    # "auto" leaves the weights alone when their packed copy would not fit in half the memory
    monkeypatch.setattr(packed_linear, "free_memory", lambda device: 1000)
    assert packed_linear.configure(model) == 0
    assert packed_linear.configure(model, True) == (n_linear if SUPPORTED else 0)  # asked for


@needs_bf16
@pytest.mark.parametrize("tree", ["chain:1", "dynamic:4,3,10"])
def test_engine_bf16_same_tokens_packed_or_not(tree, monkeypatch):
    """The engine packs a bf16 target and its EAGLE head by default; at these sizes (M <= 32
    rows per matmul) the numbers are bitwise those of F.linear, so the tokens are too."""
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
    from specdec.tp import RowParallelLinear

    model = tiny_model().to(torch.bfloat16)
    block = model.layers[0]
    row_parallel = RowParallelLinear(64, 32, bias=False).to(torch.bfloat16)
    block.feed_forward.w2 = row_parallel
    packed_linear.configure(model, True)
    assert type(block.feed_forward.w2) is RowParallelLinear
    assert type(block.attention.wo) is (PackedLinear if SUPPORTED else nn.Linear)


@needs_bf16
@pytest.mark.parametrize("rows", [1, 8, 32])
def test_eagle_draft_lm_head_runs_prepacked(rows):
    """An EAGLE-2 head with a draft vocabulary drafts through its own copy of the lm_head
    rows: prepacked once the head's linears are (decode_path), bitwise F.linear's logits."""
    from specdec import decode_path
    from specdec.eagle import EagleHead

    target = tiny_model().to(torch.bfloat16)
    head = EagleHead.random(target, seed=1).set_draft_vocab(torch.arange(0, 32, 3))
    hidden = torch.randn(2, rows, target.args.dim).to(torch.bfloat16)
    with torch.no_grad():
        plain = head.draft_logits(hidden)
        assert head._draft_lm_pack._packed is None  # plain linears: F.linear
        decode_path.configure(head)
        assert isinstance(head.fc, PackedLinear)
        packed = head.draft_logits(hidden)
    assert head._draft_lm_pack._packed is not None
    want = F.linear(hidden, head.draft_lm_weight).float()
    assert torch.equal(plain, want) and torch.equal(packed, want)
