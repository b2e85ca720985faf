"""torch.ops.specdec.decode_layer (one decoder layer of a CPU verify step) against its float64
reference, bit for bit against the ops it chains (plain and prepacked weights, packed and
padded trees), the cache rows it writes and no others, bad inputs named before anything is
written, and its fake."""

import pytest
import torch
import torch.nn.functional as F

from specdec_kernels import ops, reference
from specdec_kernels.testing import random_block_table

Hq, Hkv, D, DIM, HIDDEN = 4, 2, 16, 48, 80
BLOCK, NUM_BLOCKS = 4, 24


def _prepack_supported():
    return bool(
        torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()
    )


def layer_inputs(dtype, packed=False, bias=True, seed=0):
    """Two requests with trees of 4 and 2 real nodes (padded to T = 4) after 7 and 10 cached
    tokens; random weights and a random (poisoned) cache. Returns the op's keyword arguments
    (plain weights)."""
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape, scale=1.0):
        return (scale * torch.randn(*shape, generator=gen)).to(dtype)

    parents = torch.tensor([[-1, 0, 0, 1], [-1, 0, -1, -1]], dtype=torch.int32)
    num_nodes = torch.tensor([4, 2], dtype=torch.int32)
    if not packed:
        parents[1] = torch.tensor([-1, 0, 1, 1])
        num_nodes[1] = 4
    tree_mask, depth = ops.build_tree_mask(parents, num_nodes)
    cache_lens = torch.tensor([7, 10], dtype=torch.int32)
    block_table = random_block_table(2, 4, NUM_BLOCKS, gen)
    B, T = 2, 4
    node = torch.arange(T)[None].expand(B, T)
    valid = node < num_nodes[:, None]
    pos = (cache_lens[:, None] + node).long()
    phys = block_table.long().gather(1, pos // BLOCK) * BLOCK + pos % BLOCK  # [B, T]
    picked = valid.flatten().nonzero()[:, 0]
    rows = phys.flatten()[picked]
    M = T
    x = rand(B, T, DIM)
    rot = (cache_lens[:, None] + depth).float()[..., None] * (
        1.0 / 10000 ** (torch.arange(0, D, 2).float() / D)
    )
    emb = torch.cat((rot, rot), -1)
    cos, sin = emb.cos().to(dtype)[:, :, None], emb.sin().to(dtype)[:, :, None]
    if packed:  # the real nodes only, [1, N]
        x = x.view(B * T, DIM)[picked][None]
        cos = cos.view(B * T, 1, 1, D)[picked].view(1, -1, 1, D)
        sin = sin.view(B * T, 1, 1, D)[picked].view(1, -1, 1, D)
        M = len(picked)
    del M
    return dict(
        x=x,
        attention_norm_weight=(1 + 0.2 * torch.randn(DIM, generator=gen)).to(dtype),
        ffn_norm_weight=(1 + 0.2 * torch.randn(DIM, generator=gen)).to(dtype),
        eps=1e-5,
        wqkv=rand((Hq + 2 * Hkv) * D, DIM, scale=DIM**-0.5),
        wqkv_bias=rand((Hq + 2 * Hkv) * D, scale=0.1) if bias else None,
        wo=rand(DIM, Hq * D, scale=(Hq * D) ** -0.5),
        w13=rand(2 * HIDDEN, DIM, scale=DIM**-0.5),
        w2=rand(DIM, HIDDEN, scale=HIDDEN**-0.5),
        prepacked=False,
        cos=cos,
        sin=sin,
        num_q_heads=Hq,
        num_kv_heads=Hkv,
        k_cache=rand(NUM_BLOCKS, BLOCK, Hkv, D),
        v_cache=rand(NUM_BLOCKS, BLOCK, Hkv, D),
        rows=rows,
        picked=picked if packed else None,
        packed=packed,
        block_table=block_table,
        cache_lens=cache_lens,
        num_nodes=num_nodes,
        tree_mask=tree_mask,
        sm_scale=D**-0.5,
    )


def call_op(kw):
    return torch.ops.specdec.decode_layer(**kw)


def prepack(kw):
    kw = dict(kw, prepacked=True)
    for name in ("wqkv", "wo", "w13", "w2"):
        kw[name] = torch.ops.mkldnn._reorder_linear_weight(kw[name], 1)
    return kw


def tile(kw, names=("wqkv", "wo", "w13", "w2")):
    """kw with the named weights as pack_linear_tiles' tiles (prepacked)."""
    kw = dict(kw, prepacked=True)
    for name in names:
        kw[name] = ops.pack_linear_tiles(kw[name])
    return kw


def tiled_linear(x, weight, bias=None):
    """F.linear's signature over the weight's tiles."""
    return ops.tiled_linear(x, ops.pack_linear_tiles(weight), weight.shape[0], bias)


def clone(kw):
    return {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in kw.items()}


def chained_ops(kw, linear=F.linear):
    """The eager model's block with the layer ops (TransformerBlock.forward), op by op."""
    x, cache_k, cache_v = kw["x"], kw["k_cache"], kw["v_cache"]
    B, M, _ = x.shape
    h = x
    if kw["attention_norm_weight"] is not None:
        h = torch.ops.specdec.rms_norm(x, kw["attention_norm_weight"], kw["eps"])
    qkv = linear(h, kw["wqkv"], kw["wqkv_bias"])
    q, k, v = torch.ops.specdec.rope_qkv(qkv, kw["cos"], kw["sin"], Hq, Hkv)
    k, v = k.reshape(-1, Hkv, D), v.reshape(-1, Hkv, D)
    cache_k.view(-1, Hkv, D).index_copy_(0, kw["rows"], k)
    cache_v.view(-1, Hkv, D).index_copy_(0, kw["rows"], v)
    args = (kw["block_table"], kw["cache_lens"], kw["num_nodes"], kw["tree_mask"])
    if kw["packed"]:
        picked = kw["picked"]
        q_tree = q.new_zeros(2 * 4, Hq, D).index_copy_(0, picked, q[0]).view(2, 4, Hq, D)
        out = ops.tree_verify(q_tree, cache_k, cache_v, *args, kw["sm_scale"])
        out = out.reshape(-1, Hq, D).index_select(0, picked)[None]
    elif M != kw["tree_mask"].shape[1]:  # nodes start..start+M-1 (Attention.attend)
        start = kw.get("start", 0)
        q_tree = q.new_zeros(B, kw["tree_mask"].shape[1], Hq, D)
        q_tree[:, start : start + M] = q
        out = ops.tree_verify(q_tree, cache_k, cache_v, *args, kw["sm_scale"])
        out = out[:, start : start + M]
    else:
        out = ops.tree_verify(q, cache_k, cache_v, *args, kw["sm_scale"])
    total, normed = torch.ops.specdec.add_rms_norm(
        x, linear(out.reshape(B, M, -1), kw["wo"]), kw["ffn_norm_weight"], kw["eps"]
    )
    return total + linear(torch.ops.specdec.silu_and_mul(linear(normed, kw["w13"])), kw["w2"])


def oracle(kw):
    """reference.decode_layer in float64 on copies -> (out, k_cache, v_cache)."""
    kw64 = {
        k: v.double() if isinstance(v, torch.Tensor) and v.is_floating_point() else v
        for k, v in kw.items()
    }
    kw64 = clone(kw64)
    kw64.pop("prepacked")
    out = reference.decode_layer(**kw64)
    return out, kw64["k_cache"], kw64["v_cache"]


def close(got, want, dtype):
    """Within a few roundings of the dtype, relative to the tensor's scale."""
    tol = {torch.float32: 1e-5, torch.bfloat16: 3e-2, torch.float16: 4e-3}[dtype]
    scale = want.abs().max().item()
    return torch.allclose(got.double(), want, rtol=tol, atol=tol * scale)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("packed", [False, True])
def test_against_float64_reference(dtype, packed):
    kw = layer_inputs(dtype, packed)
    before_k, before_v = kw["k_cache"].clone(), kw["v_cache"].clone()
    want, want_k, want_v = oracle(kw)
    got = call_op(kw)
    assert got.shape == kw["x"].shape and got.dtype == dtype
    x = kw["x"].double()
    assert close(got - x, want - x, dtype)  # what the layer adds (the residual would hide it)
    assert close(kw["k_cache"], want_k, dtype) and close(kw["v_cache"], want_v, dtype)
    # only the new tokens' rows changed
    flat = kw["k_cache"].view(-1, Hkv, D)
    untouched = torch.ones(flat.shape[0], dtype=torch.bool)
    untouched[kw["rows"]] = False
    assert torch.equal(flat[untouched], before_k.view(-1, Hkv, D)[untouched])
    assert torch.equal(
        kw["v_cache"].view(-1, Hkv, D)[untouched], before_v.view(-1, Hkv, D)[untouched]
    )
    assert not torch.equal(flat[kw["rows"]], before_k.view(-1, Hkv, D)[kw["rows"]])


def test_the_tolerance_catches_a_wrong_layer():
    """The comparison above can fail: a layer with the attention scale off by 10% does."""
    kw = layer_inputs(torch.bfloat16)
    x = kw["x"].double()
    want = oracle(kw)[0] - x
    assert close(call_op(clone(kw)) - x, want, torch.bfloat16)
    assert not close(call_op(dict(kw, sm_scale=1.1 * kw["sm_scale"])) - x, want, torch.bfloat16)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("bias", [False, True])
def test_bitwise_the_chained_ops(dtype, packed, bias):
    kw = layer_inputs(dtype, packed, bias)
    mine, theirs = clone(kw), clone(kw)
    assert torch.equal(call_op(mine), chained_ops(theirs))
    assert torch.equal(mine["k_cache"], theirs["k_cache"])
    assert torch.equal(mine["v_cache"], theirs["v_cache"])


@pytest.mark.skipif(not _prepack_supported(), reason="oneDNN without bf16 support")
@pytest.mark.parametrize("packed", [False, True])
def test_prepacked_weights_bitwise_plain(packed):
    """oneDNN's prepacked linear equals F.linear's bits at these sizes (PackedLinear's claim)."""
    kw = layer_inputs(torch.bfloat16, packed)
    plain, pre = clone(kw), prepack(clone(kw))
    assert torch.equal(call_op(plain), call_op(pre))
    assert torch.equal(plain["k_cache"], pre["k_cache"])


@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("bias", [False, True])
def test_tiled_weights_bitwise_the_chained_ops(packed, bias):
    """Weights as tiles (DIM = 48, HIDDEN = 80: padded last tiles) run tiled_linear: bitwise
    the chained ops with it, within bf16 rounding of float64."""
    kw = layer_inputs(torch.bfloat16, packed, bias)
    want, want_k, _ = oracle(kw)
    mine, theirs = tile(clone(kw)), clone(kw)
    got = call_op(mine)
    assert torch.equal(got, chained_ops(theirs, tiled_linear))
    assert torch.equal(mine["k_cache"], theirs["k_cache"])
    x = kw["x"].double()
    assert close(got - x, want - x, torch.bfloat16)
    assert close(mine["k_cache"], want_k, torch.bfloat16)


@pytest.mark.skipif(not _prepack_supported(), reason="oneDNN without bf16 support")
def test_mixed_layouts():
    """Each weight in its own layout (what PackedLinear gives when one has odd in_features)."""
    kw = layer_inputs(torch.bfloat16, packed=True)
    mixed = tile(clone(kw), ("wqkv", "w2"))
    for name in ("wo", "w13"):
        mixed[name] = torch.ops.mkldnn._reorder_linear_weight(mixed[name], 1)

    def linear(x, weight, bias=None):
        if weight is kw["wqkv"] or weight is kw["w2"]:
            return tiled_linear(x, weight, bias)
        return F.linear(x, weight, bias)  # oneDNN's bits at these sizes

    theirs = clone(kw)
    for name in ("wqkv", "w2"):  # keep identity for `linear`
        theirs[name] = kw[name]
    assert torch.equal(call_op(mixed), chained_ops(theirs, linear))


TILED_BAD = {
    "wqkv": lambda kw: dict(kw, wqkv=kw["wqkv"][:-1]),  # one tile short
    "w13": lambda kw: dict(kw, w13=kw["w13"][:, :-1]),  # in_features 46
    "w2": lambda kw: dict(kw, w2=kw["w2"].transpose(2, 3).contiguous().transpose(2, 3)),
    "prepacked": lambda kw: dict(kw, prepacked=False),
}


@pytest.mark.parametrize("name", list(TILED_BAD))
def test_bad_tiles_named_and_nothing_written(name):
    kw = tile(layer_inputs(torch.bfloat16, packed=True))
    before = kw["k_cache"].clone()
    with pytest.raises(RuntimeError, match=name):
        call_op(TILED_BAD[name](kw))
    assert torch.equal(kw["k_cache"], before)


def test_padded_trees_equal_packed_rows():
    """The same trees as real nodes only ([1, N]) and padded ([B, T], picked rows written):
    the real nodes' outputs agree bit for bit."""
    packed = layer_inputs(torch.bfloat16, packed=True)
    out_packed = call_op(clone(packed))
    padded = layer_inputs(torch.bfloat16, packed=False)
    # give the padded call the packed call's trees, rows and picked entries
    for name in ("num_nodes", "tree_mask", "rows", "picked"):
        padded[name] = packed[name]
    B, T = 2, 4
    x = torch.zeros(B * T, DIM, dtype=torch.bfloat16)
    x[packed["picked"]] = packed["x"][0]
    cos = torch.ones(B * T, 1, D, dtype=torch.bfloat16)
    sin = torch.zeros(B * T, 1, D, dtype=torch.bfloat16)
    cos[packed["picked"]], sin[packed["picked"]] = packed["cos"][0], packed["sin"][0]
    for name in ("attention_norm_weight", "ffn_norm_weight", "wqkv", "wqkv_bias", "wo"):
        padded[name] = packed[name]
    padded.update(
        x=x.view(B, T, DIM),
        cos=cos.view(B, T, 1, D),
        sin=sin.view(B, T, 1, D),
        w13=packed["w13"],
        w2=packed["w2"],
        k_cache=packed["k_cache"].clone(),
        v_cache=packed["v_cache"].clone(),
    )
    out_padded = call_op(padded).view(B * T, DIM)[packed["picked"]]
    assert torch.equal(out_padded, out_packed[0])


BAD = {
    "x": lambda kw: dict(kw, x=kw["x"][0]),
    "attention_norm_weight": lambda kw: dict(
        kw, attention_norm_weight=kw["attention_norm_weight"][:-1]
    ),
    "ffn_norm_weight": lambda kw: dict(kw, ffn_norm_weight=kw["ffn_norm_weight"].float()),
    "eps": lambda kw: dict(kw, eps=float("nan")),
    "wqkv": lambda kw: dict(kw, wqkv=kw["wqkv"][:-1]),
    "wqkv_bias": lambda kw: dict(kw, wqkv_bias=kw["wqkv_bias"][:-1]),
    "wo": lambda kw: dict(kw, wo=kw["wo"].t()),
    "w13": lambda kw: dict(kw, w13=kw["w13"][:-1]),
    "w2": lambda kw: dict(kw, w2=kw["w2"][:, :-1]),
    "prepacked": lambda kw: dict(kw, prepacked=True),
    "cos": lambda kw: dict(kw, cos=kw["cos"][:, :1]),
    "num_q_heads": lambda kw: dict(kw, num_q_heads=3),
    "num_kv_heads": lambda kw: dict(kw, num_kv_heads=0),
    "k_cache": lambda kw: dict(kw, k_cache=kw["k_cache"][..., :-2]),
    "rows": lambda kw: dict(kw, rows=kw["rows"].int()),
    "rows out of range": lambda kw: dict(
        kw, rows=torch.cat([kw["rows"][:-1], kw["rows"].new_tensor([10**6])])
    ),
    "picked out of range": lambda kw: dict(
        kw, picked=torch.cat([kw["picked"][:-1], kw["picked"].new_tensor([8])])
    ),
    "picked": lambda kw: dict(kw, picked=kw["picked"][:-1]),
    "block_table": lambda kw: dict(kw, block_table=kw["block_table"][:1]),
    "cache_lens": lambda kw: dict(kw, cache_lens=torch.tensor([7, 100], dtype=torch.int32)),
    "tree_mask": lambda kw: dict(kw, tree_mask=kw["tree_mask"].int()),
    "sm_scale": lambda kw: dict(kw, sm_scale=float("inf")),
}


@pytest.mark.parametrize("name", list(BAD))
def test_bad_inputs_named_and_nothing_written(name):
    kw = layer_inputs(torch.bfloat16, packed=True)
    before = kw["k_cache"].clone(), kw["v_cache"].clone()
    bad = BAD[name](kw)
    with pytest.raises(RuntimeError, match=name.split()[0]):
        call_op(bad)
    assert torch.equal(kw["k_cache"], before[0]) and torch.equal(kw["v_cache"], before[1])


def test_packed_needs_picked():
    kw = layer_inputs(torch.bfloat16, packed=True)
    with pytest.raises(RuntimeError, match="packed needs picked"):
        call_op(dict(kw, picked=None))


@pytest.mark.parametrize("packed", [False, True])
def test_opcheck(packed):
    kw = layer_inputs(torch.bfloat16, packed)
    torch.library.opcheck(torch.ops.specdec.decode_layer, (), kw)


def test_fake_shape():
    from torch._subclasses.fake_tensor import FakeTensorMode

    kw = layer_inputs(torch.bfloat16, packed=True)
    with FakeTensorMode() as mode:
        fake = {k: mode.from_tensor(v) if isinstance(v, torch.Tensor) else v for k, v in kw.items()}
        out = call_op(fake)
    assert out.shape == kw["x"].shape and out.dtype == torch.bfloat16


def draft_level_inputs(start, num_new, bias=True):
    """layer_inputs' padded trees (4 and 4 nodes), the new tokens being nodes
    start..start+num_new-1 of each (an EAGLE head's draft level; earlier nodes cached)."""
    kw = layer_inputs(torch.bfloat16, packed=False, bias=bias)
    B, T = 2, 4
    rows = kw["rows"].view(B, T)[:, start : start + num_new].flatten()
    return dict(
        kw,
        x=kw["x"][:, start : start + num_new].contiguous(),
        cos=kw["cos"][:, start : start + num_new].contiguous(),
        sin=kw["sin"][:, start : start + num_new].contiguous(),
        rows=rows.contiguous(),
        start=start,
    )


@pytest.mark.parametrize("start,num_new", [(1, 2), (3, 1), (0, 2), (2, 2)])
@pytest.mark.parametrize("norm", [True, False])
def test_draft_level_bitwise_the_chained_ops(start, num_new, norm):
    """Nodes start..start+M-1 of the trees (M < T), with or without the input norm (an
    EAGLE-1/2 head's layer): bitwise the modules' path (Attention.attend pads the queries)."""
    kw = draft_level_inputs(start, num_new)
    if not norm:
        kw["attention_norm_weight"] = None
    mine, theirs = clone(kw), clone(kw)
    got = call_op(mine)
    assert got.shape == kw["x"].shape
    assert torch.equal(got, chained_ops(theirs))
    assert torch.equal(mine["k_cache"], theirs["k_cache"])
    # and not the same as the layer with the norm / at another start
    other = dict(clone(kw), attention_norm_weight=None if norm else theirs["ffn_norm_weight"])
    assert not torch.equal(call_op(other), got)


@pytest.mark.parametrize("start", [-1, 3])
def test_bad_start_named(start):
    kw = draft_level_inputs(1, 2)
    before = kw["k_cache"].clone()
    with pytest.raises(RuntimeError, match="start"):
        call_op(dict(kw, start=start))
    assert torch.equal(kw["k_cache"], before)
    packed = layer_inputs(torch.bfloat16, packed=True)
    with pytest.raises(RuntimeError, match="start"):
        call_op(dict(packed, start=1))


def test_draft_level_opcheck():
    kw = draft_level_inputs(1, 2)
    kw["attention_norm_weight"] = None
    torch.library.opcheck(torch.ops.specdec.decode_layer, (), kw)


# ---- decode_layers: a run of layers in one call --------------------------------------------

NUM_CACHE_LAYERS, FIRST_LAYER, NUM_LAYERS = 5, 1, 3
LIST_NAMES = ("attention_norm_weights", "ffn_norm_weights", "wqkv", "wqkv_bias", "wo", "w13", "w2")
ONE_NAMES = ("attention_norm_weight", "ffn_norm_weight", "wqkv", "wqkv_bias", "wo", "w13", "w2")


def layers_inputs(dtype, packed=False, bias=True, layout=None):
    """decode_layers' keyword arguments: layer_inputs' step with NUM_LAYERS layers of their own
    random weights (layout None: plain, "tiles", "onednn") over a random cache of
    NUM_CACHE_LAYERS layers, starting at FIRST_LAYER."""
    steps = [layer_inputs(dtype, packed, bias, seed=seed) for seed in range(NUM_LAYERS)]
    if layout == "tiles":
        steps = [tile(kw) for kw in steps]
    elif layout == "onednn":
        steps = [prepack(kw) for kw in steps]
    kw = {k: v for k, v in steps[0].items() if k not in ONE_NAMES + ("k_cache", "v_cache")}
    for many, one in zip(LIST_NAMES, ONE_NAMES):
        kw[many] = [step[one] for step in steps]
    gen = torch.Generator().manual_seed(7)
    shape = (NUM_CACHE_LAYERS, NUM_BLOCKS, BLOCK, Hkv, D)
    kw["k_cache"] = torch.randn(shape, generator=gen).to(dtype)
    kw["v_cache"] = torch.randn(shape, generator=gen).to(dtype)
    kw["first_layer"] = FIRST_LAYER
    return kw


def clone_layers(kw):
    return {k: list(v) if isinstance(v, list) else v for k, v in clone(kw).items()}


def layer_by_layer(kw):
    """decode_layer called for each layer in turn, on the cache's layer views."""
    x = kw["x"]
    for i in range(len(kw["wqkv"])):
        one = {k: v for k, v in kw.items() if k not in LIST_NAMES + ("first_layer",)}
        one.update({o: kw[m][i] for m, o in zip(LIST_NAMES, ONE_NAMES)})
        one.update(
            x=x,
            k_cache=kw["k_cache"][kw["first_layer"] + i],
            v_cache=kw["v_cache"][kw["first_layer"] + i],
        )
        x = call_op(one)
    return x


@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("layout", [None, "tiles", "onednn"])
def test_layers_bitwise_one_layer_at_a_time(packed, bias, layout):
    if layout == "onednn" and not _prepack_supported():
        pytest.skip("oneDNN without bf16 support")
    kw = layers_inputs(torch.bfloat16, packed, bias, layout)
    before_k = kw["k_cache"].clone()
    mine, theirs = clone_layers(kw), clone_layers(kw)
    assert torch.equal(torch.ops.specdec.decode_layers(**mine), layer_by_layer(theirs))
    assert torch.equal(mine["k_cache"], theirs["k_cache"])
    assert torch.equal(mine["v_cache"], theirs["v_cache"])
    # layers outside first_layer .. first_layer + NUM_LAYERS - 1 untouched, each inside written
    last = FIRST_LAYER + NUM_LAYERS
    assert torch.equal(mine["k_cache"][:FIRST_LAYER], before_k[:FIRST_LAYER])
    assert torch.equal(mine["k_cache"][last:], before_k[last:])
    for layer in range(FIRST_LAYER, last):
        assert not torch.equal(mine["k_cache"][layer], before_k[layer])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_layers_against_float64_reference(dtype):
    kw = layers_inputs(dtype, packed=True)
    kw64 = {
        k: v.double() if isinstance(v, torch.Tensor) and v.is_floating_point() else v
        for k, v in clone_layers(kw).items()
    }
    for name in LIST_NAMES:
        kw64[name] = [None if w is None else w.double() for w in kw64[name]]
    kw64.pop("prepacked")
    want = reference.decode_layers(**kw64)
    got = torch.ops.specdec.decode_layers(**kw)
    x = kw["x"].double()
    assert close(got - x, want - x, dtype)
    assert close(kw["k_cache"], kw64["k_cache"], dtype)
    # and the comparison can fail: a wrong first layer writes other cache layers
    wrong = clone_layers(kw)
    torch.ops.specdec.decode_layers(**dict(wrong, first_layer=0))
    assert not close(wrong["k_cache"], kw64["k_cache"], dtype)


LAYERS_BAD = {
    "w13": lambda kw: dict(kw, w13=kw["w13"][:-1]),  # one layer short
    r"wqkv\[2\]": lambda kw: dict(kw, wqkv=kw["wqkv"][:2] + [kw["wqkv"][2][:-1]]),
    r"attention_norm_weights\[1\]": lambda kw: dict(
        kw,
        attention_norm_weights=[
            w.float() if i == 1 else w for i, w in enumerate(kw["attention_norm_weights"])
        ],
    ),
    "wqkv": lambda kw: {**kw, **{name: [] for name in LIST_NAMES}},
    "first_layer": lambda kw: dict(kw, first_layer=NUM_CACHE_LAYERS - NUM_LAYERS + 1),
    "first_layer ": lambda kw: dict(kw, first_layer=-1),
    "k_cache": lambda kw: dict(kw, k_cache=kw["k_cache"][0]),
    "v_cache": lambda kw: dict(kw, v_cache=kw["v_cache"][:-1]),
    "rows": lambda kw: dict(kw, rows=torch.cat([kw["rows"][:-1], kw["rows"].new_tensor([10**6])])),
    "cache_lens": lambda kw: dict(kw, cache_lens=torch.tensor([7, 100], dtype=torch.int32)),
}


@pytest.mark.parametrize("name", list(LAYERS_BAD))
def test_layers_bad_inputs_named_and_nothing_written(name):
    kw = layers_inputs(torch.bfloat16, packed=True)
    before = kw["k_cache"].clone(), kw["v_cache"].clone()
    with pytest.raises(RuntimeError, match=name.strip()):
        torch.ops.specdec.decode_layers(**LAYERS_BAD[name](kw))
    assert torch.equal(kw["k_cache"], before[0]) and torch.equal(kw["v_cache"], before[1])


@pytest.mark.parametrize("packed", [False, True])
def test_layers_opcheck(packed):
    kw = layers_inputs(torch.bfloat16, packed)
    torch.library.opcheck(torch.ops.specdec.decode_layers, (), kw)
