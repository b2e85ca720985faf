"""The C++ layer ops in the model (specdec.layer_ops): the switch, the same forward outputs and
greedy tokens as the torch ops in bf16, training untouched."""

import pytest
import torch

import specdec_kernels.ops as ops
from specdec import layer_ops
from specdec.model import Attention, FeedForward, RMSNorm

from test_engine import bf16_run, tiny_model

pytestmark = pytest.mark.usefixtures("single_thread")


def parts(module):
    return [m for m in module.modules() if isinstance(m, (RMSNorm, Attention, FeedForward))]


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
