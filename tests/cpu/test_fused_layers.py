"""The C++ layer ops in the model (specdec.cpu.layer_ops): the switch, the same forward outputs and
greedy tokens as the torch ops in bf16, a verify step's block as one decode_layer call bit for
bit the modules' result, training untouched."""

import pytest
import torch

import specdec_kernels.ops as ops
from specdec.cpu import fused_layers, layer_ops, modules_unchanged, packed_linear
from specdec.drafters.eagle_head import EagleHead
from specdec.models.llama import (
    Attention,
    FeedForward,
    RMSNorm,
    TransformerBlock,
)
from specdec.runtime.engine import Engine
from specdec.runtime.requests import Request, SamplingParams

from model_testing import bf16_run, tiny_model

pytestmark = pytest.mark.usefixtures("single_thread")


def parts(module):
    return [
        m
        for m in module.modules()
        if isinstance(m, (RMSNorm, Attention, FeedForward, TransformerBlock))
    ]


def test_configure_switch(monkeypatch):
    model = tiny_model().to(torch.bfloat16)
    n = len(parts(model))
    assert layer_ops.configure(model) == n and all(m.layer_ops for m in parts(model))
    assert layer_ops.configure(model, False) == 0 and not any(m.layer_ops for m in parts(model))
    monkeypatch.setenv("SPECDEC_LAYER_OPS", "0")
    assert layer_ops.configure(model) == 0
    monkeypatch.setenv("SPECDEC_LAYER_OPS", "1")
    assert layer_ops.configure(model) == n
    # float32 keeps the torch ops (the exactness contract's dtype), whatever the setting
    assert layer_ops.configure(tiny_model()) == 0


def verify_inputs(model):
    """A batch of two trees (4 and 2 nodes) after prompts of 5 and 9 tokens."""
    cache = model.new_cache(2, 64, block_size=4)
    slots = torch.tensor([0, 1], dtype=torch.int32)
    prompts = [torch.randint(0, model.args.vocab_size, (n,)) for n in (5, 9)]
    parents = torch.tensor([[-1, 0, 0, 1], [-1, 0, -1, -1]], dtype=torch.int32)
    num_nodes = torch.tensor([4, 2], dtype=torch.int32)
    mask, depth = ops.build_tree_mask(parents, num_nodes)
    tokens = torch.randint(0, model.args.vocab_size, (2, 4))
    return cache, slots, prompts, (tokens, cache, slots, num_nodes, mask, depth, (0, 2))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_forward_same_as_torch_ops(dtype):
    model = tiny_model(layer_scale=1.0, seed=1).to(dtype)
    outs = []
    for on in (False, True):
        layer_ops.configure(model, on)
        torch.manual_seed(0)
        cache, slots, prompts, args = verify_inputs(model)
        pre = model.prefill(prompts, cache, slots, feature_layers=(0, 2))
        ver = model.forward(*args)
        outs.append((pre.logits, *pre.hidden, *pre.aux, *ver, cache.k, cache.v))
    for a, b in zip(*outs):
        # the ops round as the torch ops do: equal but for an ulp of exp / rsqrt, rarely
        assert a.shape == b.shape
        assert torch.allclose(a.float(), b.float(), rtol=2**-7, atol=1e-3)
    assert torch.equal(outs[0][-2], outs[1][-2])  # the cache's K: norm + projection + RoPE


@pytest.mark.parametrize("tree", ["chain:1", "dynamic:4,3,10"])
def test_engine_bf16_tokens_with_and_without(tree, monkeypatch):
    outs = []
    for setting in ("0", "1"):
        tokens, model, head = bf16_run(tree, monkeypatch, SPECDEC_LAYER_OPS=setting)
        assert all(m.layer_ops == (setting == "1") for m in parts(model) + parts(head))
        outs.append(tokens)
    assert outs[0] == outs[1]


def count_decode_layer_calls(monkeypatch):
    """-> a list that records, per block of a forward in verify mode, whether it ran in C++:
    one True per layer of each decode_layers call (Transformer's blocks in one call), and per
    block forward whether decode_layer ran."""
    calls = []
    original = fused_layers.block_forward  # patched before configure installs it

    def recorded(block, *args):
        out = original(block, *args)
        if args[-1].mode == "verify":
            calls.append(out is not None)
        return out

    monkeypatch.setattr(fused_layers, "block_forward", recorded)
    op = torch.ops.specdec.decode_layers

    def recorded_layers(x, attention_norm_weights, *args):
        calls.extend([True] * len(attention_norm_weights))
        return op(x, attention_norm_weights, *args)

    monkeypatch.setattr(torch.ops.specdec, "decode_layers", recorded_layers)
    return calls


def record_weight_layouts(monkeypatch):
    """-> a list that records the layout of the wqkv weight of each layer that decode_layer or
    decode_layers ran."""
    layouts = []

    def layout(w):
        return "onednn" if w.is_mkldnn else "tiles" if w.dim() == 4 else "plain"

    op, ops_layers = torch.ops.specdec.decode_layer, torch.ops.specdec.decode_layers

    def recorded(x, attention_norm_weight, ffn_norm_weight, eps, wqkv, *args):
        layouts.append(layout(wqkv))
        return op(x, attention_norm_weight, ffn_norm_weight, eps, wqkv, *args)

    def recorded_layers(x, attention_norm_weights, ffn_norm_weights, eps, wqkv, *args):
        layouts.extend(map(layout, wqkv))
        return ops_layers(x, attention_norm_weights, ffn_norm_weights, eps, wqkv, *args)

    monkeypatch.setattr(torch.ops.specdec, "decode_layer", recorded)
    monkeypatch.setattr(torch.ops.specdec, "decode_layers", recorded_layers)
    return layouts


def prepack_as(model, layout, monkeypatch):
    """Prepacks model's linears in one layout ("tiles": every product over the tiles;
    "onednn": none), or not at all (None)."""
    monkeypatch.setenv("SPECDEC_TILED_ROWS", "1000" if layout == "tiles" else "0")
    packed_linear.configure(model, layout is not None)


@pytest.mark.parametrize(
    "dtype,layout",
    [
        (torch.bfloat16, "tiles"),
        (torch.bfloat16, "onednn"),
        (torch.bfloat16, None),
        (torch.float16, None),
    ],
)
def test_decode_layer_bitwise_the_modules(dtype, layout, monkeypatch):
    """Verify forwards (padded trees of 4 and 2 nodes: packed rows; then full trees) with each
    block as one decode_layer call equal the modules' outputs and cache bit for bit."""
    calls = count_decode_layer_calls(monkeypatch)
    model = tiny_model(layer_scale=1.0, seed=1).to(dtype)
    prepack_as(model, layout, monkeypatch)
    outs = []
    for on in (False, True):
        layer_ops.configure(model, True, decode_layer=on)
        calls.clear()
        torch.manual_seed(0)
        cache, slots, prompts, args = verify_inputs(model)
        model.prefill(prompts, cache, slots)
        ragged = model.forward(*args)
        parents = torch.tensor([[-1, 0, 0, 1], [-1, 0, 1, 2]], dtype=torch.int32)
        mask, depth = ops.build_tree_mask(parents, torch.tensor([4, 4], dtype=torch.int32))
        full = model.forward(
            args[0], cache, slots, torch.tensor([4, 4], dtype=torch.int32), mask, depth, (1,)
        )
        outs.append((*ragged, *full, cache.k, cache.v))
        n = len(model.layers) * 2
        assert calls == [on] * n  # the op ran (or not) in every block of both forwards
    for a, b in zip(*outs):
        assert torch.equal(a, b)


@pytest.mark.parametrize("layout", ["tiles", "onednn", None])
@pytest.mark.parametrize(
    "change", ["in_place", "new_parameter", "load_state_dict", "eps", "off", "layout"]
)
def test_decode_layer_sees_changes_after_a_step(layout, change, monkeypatch):
    """decode_layer's arguments are cached per block between steps: a change to the modules
    made after a step (weights updated in place, a new Parameter, load_state_dict, eps, the
    layer ops switched off, the rows moving to the other weight layout) must show in the
    next step, bitwise as the modules compute it."""
    calls = count_decode_layer_calls(monkeypatch)
    model = tiny_model(layer_scale=1.0, seed=1).to(torch.bfloat16)
    other = tiny_model(layer_scale=1.0, seed=2).to(torch.bfloat16)
    prepack_as(model, layout, monkeypatch)
    layer_ops.configure(model, True)
    torch.manual_seed(0)
    cache, slots, prompts, args = verify_inputs(model)
    model.prefill(prompts, cache, slots)
    model.forward(*args)  # fills the cache of every block
    block = model.layers[1]
    with torch.no_grad():
        if change == "in_place":
            block.feed_forward.w2.weight.mul_(-2)
        elif change == "new_parameter":
            block.attention.wqkv.weight = torch.nn.Parameter(other.layers[1].attention.wqkv.weight)
        elif change == "load_state_dict":
            model.load_state_dict(other.state_dict())
        elif change == "eps":
            block.attention_norm.eps = block.ffn_norm.eps = 100.0  # large: changes the outputs
        elif change == "layout":  # the same rows now take the other layout
            monkeypatch.setenv("SPECDEC_TILED_ROWS", "0" if layout == "tiles" else "1000")
        else:
            layer_ops.configure(model, False)
    calls.clear()
    layouts = record_weight_layouts(monkeypatch)
    cached = model.forward(*args)
    # switched off, the blocks have no fused call to try: their modules run
    assert calls == ([] if change == "off" else [True] * len(model.layers))
    if change == "layout":  # (the tiny model's sums often round alike in both layouts)
        # (without oneDNN's bf16, as on AVX2 CPUs, the tiles' rows go to F.linear; with no
        # packed copy in the first place, the model's linears stay plain)
        onednn = "onednn" if packed_linear._supported() else "plain"
        tiles = "tiles" if packed_linear._supported() else "plain"
        assert set(layouts) == {{"tiles": onednn, "onednn": tiles, None: "plain"}[layout]}
    for b in model.layers:  # the same step from the modules, whatever is cached
        b.layer_ops = False
        b.__dict__.pop("_decode_cache", None)
    model.__dict__.pop("_decode_layers_cache", None)
    expected = model.forward(*args)
    for a, b in zip(cached, expected):  # decode_layer is bitwise the modules' layer ops
        assert torch.equal(a, b)


def count_decode_key_calls(monkeypatch):
    """-> a list that grows by one per fused_layers.block_key call (the modules' check)."""
    calls = []
    original = fused_layers.block_key

    def counted(block):
        calls.append(block)
        return original(block)

    monkeypatch.setattr(fused_layers, "block_key", counted)
    return calls


def test_modules_unchanged_checks_once_per_kind(monkeypatch):
    """Inside modules_unchanged() a verify step checks the blocks against their cached
    arguments once per kind of step (the first; again after recheck()); outside it, and
    after it ends, every step checks. The outputs are the same either way."""
    checks = count_decode_key_calls(monkeypatch)
    model = tiny_model(layer_scale=1.0, seed=1).to(torch.bfloat16)
    layer_ops.configure(model, True)
    torch.manual_seed(0)
    cache, slots, prompts, args = verify_inputs(model)
    model.prefill(prompts, cache, slots)
    n = len(model.layers)
    expected = model.forward(*args)
    counts = []
    with modules_unchanged(model) as unchanged:
        for step in range(4):
            if step == 2:
                unchanged.recheck()
            checks.clear()
            out = model.forward(*args)
            counts.append(len(checks))
            for a, b in zip(out, expected):
                assert torch.equal(a, b)
    checks.clear()
    model.forward(*args)
    assert counts == [n, 0, n, 0] and len(checks) == n


@pytest.mark.parametrize("head", [False, True])
def test_generate_sees_changes_made_by_its_progress_callback(head):
    """Engine.generate trusts the modules between its steps, but a progress callback is
    caller code: a change it makes (the target's or the head's weights updated in place) must
    show from the next step on, as in an engine built on the changed modules."""
    prompts = [[1, 2, 3, 4], [5, 6, 7]]
    params = SamplingParams(max_new_tokens=12)

    def build():
        model = tiny_model(layer_scale=1.0, seed=1).to(torch.bfloat16)
        eagle = EagleHead.random(model, version=2, seed=0).to(torch.bfloat16) if head else None
        return model, eagle

    def change(model, eagle):
        with torch.no_grad():
            if eagle is not None:
                eagle.layer.feed_forward.w2.weight.mul_(-3)
            model.layers[1].feed_forward.w2.weight.mul_(-3)

    def tokens(model, eagle, reqs, progress=None):
        eng = Engine(
            model, head=eagle, tree="chain:2" if head else "chain:1", batch_size=1, max_seq_len=64
        )
        results, _ = eng.generate([Request(p, params) for p in reqs], progress=progress)
        return [r.token_ids for r in results]

    model, eagle = build()
    changed = tokens(model, eagle, prompts, progress=lambda result: change(model, eagle))
    model, eagle = build()
    first = tokens(model, eagle, prompts[:1])
    change(model, eagle)
    second = tokens(model, eagle, prompts[1:])
    assert changed == first + second
    model, eagle = build()
    assert tokens(model, eagle, prompts[1:]) != second  # the change shows in the tokens


def test_decode_layer_leaves_other_linears_to_the_modules(monkeypatch):
    """A block whose linears are not plain (tensor parallelism's all-reducing RowParallelLinear
    is such a subclass) runs its modules."""
    calls = count_decode_layer_calls(monkeypatch)

    class Reducing(torch.nn.Linear):
        def forward(self, x):
            return super().forward(x)

    model = tiny_model().to(torch.bfloat16)
    layer_ops.configure(model, True)
    for block in model.layers:
        block.attention.wo.__class__ = Reducing
    cache, slots, prompts, args = verify_inputs(model)
    model.prefill(prompts, cache, slots)
    model.forward(*args)
    assert calls and not any(calls)


def test_training_takes_the_torch_ops():
    """A head switched to the layer ops (the engine does this) still trains: under grad mode
    the modules run the torch ops, so gradients reach every parameter."""
    model = tiny_model().to(torch.bfloat16)
    layer_ops.configure(model, True)
    x = torch.randn(1, 3, model.args.dim, dtype=torch.bfloat16)
    cos, sin = model.rope(torch.arange(3)[None])
    block = model.layers[0]

    def attend(q, k, v):  # a differentiable stand-in for the cache attention
        return q

    block(x, cos, sin, attend).float().sum().backward()
    assert all(p.grad is not None for p in block.parameters())


@pytest.mark.parametrize("layout", ["tiles", "onednn", None])
@pytest.mark.parametrize("feature_layers", [(), (1,), (0, 2), (0, 1, 2)])
def test_blocks_as_decode_layers_calls(layout, feature_layers, monkeypatch):
    """A verify step runs the model's blocks as one decode_layers call, or one per run ending
    at a feature layer (whose output it keeps), never block by block; bitwise the blocks run
    one at a time (each as decode_layer) and the modules."""
    runs = []
    op = torch.ops.specdec.decode_layers

    def recorded(x, attention_norm_weights, *args):
        runs.append((args[14], len(attention_norm_weights)))  # (first_layer, layers)
        return op(x, attention_norm_weights, *args)

    monkeypatch.setattr(torch.ops.specdec, "decode_layers", recorded)
    calls = count_decode_layer_calls(monkeypatch)
    model = tiny_model(layer_scale=1.0, seed=1).to(torch.bfloat16)
    prepack_as(model, layout, monkeypatch)
    outs = []
    for mode in ("layers", "blocks", "modules"):
        # "blocks": one at a time, each as decode_layer
        layer_ops.configure(
            model, True, decode_layer=mode != "modules", decode_layers=mode == "layers"
        )
        runs.clear()
        calls.clear()
        torch.manual_seed(0)
        cache, slots, prompts, args = verify_inputs(model)
        model.prefill(prompts, cache, slots)
        outs.append((*model.forward(*args[:-1], feature_layers), cache.k, cache.v))
        if mode == "layers":
            ends = sorted(set(feature_layers) | {2})
            starts = [0] + [e + 1 for e in ends[:-1]]
            assert runs == [(s, e - s + 1) for s, e in zip(starts, ends)]
            assert calls == [True] * 3
        else:
            assert runs == []
            assert calls == [mode == "blocks"] * 3
    for a, b, c in zip(*outs):
        assert torch.equal(a, b) and torch.equal(a, c)


@pytest.mark.parametrize("layout", ["tiles", None])
@pytest.mark.parametrize("start,num_new", [(0, 4), (1, 2), (3, 1)])
def test_eagle_draft_level_as_decode_layer(layout, start, num_new, monkeypatch):
    """An EAGLE-2 head's layer (identity input norm) on tree nodes start..start+M-1 runs as
    one decode_layer call, bitwise its modules (hidden and the head's cache)."""
    from specdec.drafters.eagle_head import EagleHead

    calls = count_decode_layer_calls(monkeypatch)
    model = tiny_model(layer_scale=1.0, seed=1).to(torch.bfloat16)
    head = EagleHead.random(model, version=2, seed=3)
    with torch.no_grad():  # non-trivial norms and weights
        for p in head.parameters():
            p.add_(0.05 * torch.randn(p.shape).to(p.dtype))
    prepack_as(head, layout, monkeypatch)
    parents = torch.tensor([[-1, 0, 0, 1], [-1, 0, 1, 2]], dtype=torch.int32)
    num_nodes = torch.tensor([4, 3], dtype=torch.int32)
    mask, depth = ops.build_tree_mask(parents, num_nodes)
    cache_lens = torch.tensor([5, 9], dtype=torch.int32)
    slots = torch.tensor([0, 1], dtype=torch.int32)
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, model.args.vocab_size, (2, num_new), generator=gen)
    feats = torch.randn(2, num_new, model.args.dim, generator=gen).to(torch.bfloat16)
    positions = (cache_lens[:, None] + depth[:, start : start + num_new]).long()
    outs = []
    for on in (True, False):
        layer_ops.configure(head, True, decode_layer=on)
        calls.clear()
        cache = head.new_cache(2, 32, block_size=4)
        with torch.no_grad():
            cache.k.normal_(generator=torch.Generator().manual_seed(1))
            cache.v.normal_(generator=torch.Generator().manual_seed(2))
            hidden = head(
                tokens, feats, cache, slots, cache_lens, start, num_nodes, mask, positions
            )
        assert calls == [on]
        outs.append((hidden, cache.k, cache.v))
    for a, b in zip(*outs):
        assert torch.equal(a, b)
