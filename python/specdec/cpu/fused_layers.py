"""A verify step's blocks as single C++ calls on the CPU decode path (docs/cpu-decode-path.md):
each TransformerBlock as one torch.ops.specdec.decode_layer call and a Transformer's blocks as
one decode_layers call (the loop over the blocks in C++), bitwise the modules' result (the same
kernels in the same order).

specdec.cpu.configure installs `block_forward` and `layers_forward` as the modules' hooks
(TransformerBlock.fused_forward, Transformer.fused_layers); each returns None where the
modules must run (not a verify step, no layer ops, linears that are not plain). The calls'
arguments that come from the modules (weights, prepacked or not, eps, heads) are cached on
the modules and checked against them before a step (`modules_unchanged` checks once per kind
of step instead).
"""

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from specdec.cpu.packed_linear import PackedLinear, tiled_rows
from specdec.models.llama import (
    AttentionMetadata,
    RMSNorm,
    Transformer,
    TransformerBlock,
    layer_ops_apply,
    use_layer_ops,
)


def block_forward(
    block: TransformerBlock, x: Tensor, cos: Tensor, sin: Tensor, meta: AttentionMetadata
) -> Tensor | None:
    """block.forward as one torch.ops.specdec.decode_layer call (bitwise the modules' result: the
    same kernels in the same order), or None where the modules must run: not a verify step,
    no layer ops (training, torch.compile, float32, other devices), or linears that are not
    plain (tensor parallelism's all-reducing ones). The new tokens may be any run of tree
    nodes (an EAGLE head's draft level: nodes start..start+M-1), and the input norm the
    identity (EAGLE-1/2 heads)."""
    if (
        not use_layer_ops(block, x)
        or meta.mode != "verify"
        or cos.dtype != x.dtype
        or cos.shape[:2] != x.shape[:2]
    ):
        return None
    args = block_args(block, x)
    if args is None:
        return None
    weights, (layer_idx, n_heads, n_kv_heads, scale) = args
    cache = meta.cache
    return torch.ops.specdec.decode_layer(
        x,
        *weights,
        cos,
        sin,
        n_heads,
        n_kv_heads,
        cache.k[layer_idx],
        cache.v[layer_idx],
        meta.rows,
        meta.picked,
        meta.packed,
        meta.block_table,
        meta.cache_lens,
        meta.num_nodes,
        meta.tree_mask,
        scale,
        meta.start,
    )


def block_args(
    block: TransformerBlock, x: Tensor
) -> tuple[tuple, tuple[int, int, int, float]] | None:
    """decode_layer's arguments that come from the modules: (the norm weights, eps, the
    four linears' weights, prepacked or not, the qkv bias) and (layer index, heads, KV
    heads, scale); None when the modules cannot run as one call.

    Cached: a step needs them in every layer, and gathering them through the modules'
    attribute lookups and WeightPack.get cost ~40 us per layer (~1.3 ms of a ~27 ms bf16
    step at one thread). The key holds what they derive from, read straight from the
    modules' dicts: the submodules and their classes, every parameter's identity, storage
    and version (an in-place update, load_state_dict, a new Parameter or a PackedLinear
    conversion rebuild them, and WeightPack repacks), eps, the layer ops flag and whether
    x's rows take the weights' tiles or oneDNN's layout (packed_linear.uses_tiles); under
    modules_unchanged() the modules' part is checked once per kind of x."""
    kind = _decode_kind(x)
    hit = _checked_decode_args(block, "_decode_cache", kind)
    if hit is not None:
        return hit[0]
    return _cache_decode_args(
        block, "_decode_cache", (*kind, block_key(block)), lambda: _collect_block_args(block, x)
    )


def _collect_block_args(
    block: TransformerBlock, x: Tensor
) -> tuple[tuple, tuple[int, int, int, float]] | None:
    """block_args' result, gathered from the modules (uncached)."""
    modules: dict[str, Any] = block._modules
    attn, ff = modules["attention"], modules["feed_forward"]
    norms = (modules["attention_norm"], modules["ffn_norm"])
    linears = tuple(attn._modules[n] for n in ("wqkv", "wo")) + tuple(
        ff._modules[n] for n in ("w13", "w2")
    )
    weights = _block_weights(x, attn, norms, linears)
    shape = (attn.layer_idx, attn.n_heads, attn.n_kv_heads, attn.scale)
    return None if weights is None else (weights, shape)


def block_key(block: TransformerBlock) -> tuple:
    """What block_args' result derives from, but for x, in one flat tuple read straight
    from the modules' dicts (Transformer checks all blocks' keys every step: ~2 us a block):
    the flags, the submodules and their classes, every parameter's identity, storage and
    version, and eps."""
    modules: dict[str, Any] = block._modules
    attn, ff = modules["attention"], modules["feed_forward"]
    attention_norm, ffn_norm = modules["attention_norm"], modules["ffn_norm"]
    parts = (
        attention_norm,
        ffn_norm,
        attn._modules["wqkv"],
        attn._modules["wo"],
        ff._modules["w13"],
        ff._modules["w2"],
    )
    return (
        block.layer_ops,
        attn.layer_ops,
        *parts,
        *map(type, parts),
        getattr(attention_norm, "eps", None),
        getattr(ffn_norm, "eps", None),
        *[
            (id(p), p.data_ptr(), p._version)
            for m in parts
            for p in m._parameters.values()
            if p is not None
        ],
    )


def _block_weights(x: Tensor, attn, norms: tuple, linears: tuple) -> tuple | None:
    """The weight arguments of decode_layer, or None (see block_forward)."""
    attention_norm, ffn_norm = norms
    wqkv, wo, w13, w2 = linears
    if (
        not use_layer_ops(attn, x)
        or type(attention_norm) not in (RMSNorm, nn.Identity)  # EAGLE-1/2 heads: Identity
        or type(ffn_norm) is not RMSNorm
        or getattr(attention_norm, "eps", ffn_norm.eps) != ffn_norm.eps
        or wo.bias is not None
        or w13.bias is not None
        or w2.bias is not None
    ):
        return None
    kinds = {type(m) for m in linears}
    if kinds == {PackedLinear}:
        weights = [m.packed_weight(x) for m in linears]
        prepacked = True
        if all(w is None for w in weights):  # no packed layout for these rows: F.linear's
            weights, prepacked = [m.weight for m in linears], False
        elif any(w is None for w in weights):
            return None
    elif kinds == {nn.Linear}:
        weights, prepacked = [m.weight for m in linears], False
    else:
        return None
    return (
        getattr(attention_norm, "weight", None),  # None: no input norm
        ffn_norm.weight,
        ffn_norm.eps,
        weights[0],
        wqkv.bias,
        weights[1],
        weights[2],
        weights[3],
        prepacked,
    )


def _decode_kind(x: Tensor) -> tuple:
    """The part of the cached decode arguments' key that comes from x, not the modules: its
    dtype and whether its rows take the weights' tiles (packed_linear.uses_tiles)."""
    return (x.dtype, x.numel() // x.shape[-1] <= tiled_rows())


def _checked_decode_args(module: nn.Module, cache: str, kind: tuple) -> tuple | None:
    """(the arguments cached in module.__dict__[cache],) when they are for kind and
    modules_unchanged() has checked them against the modules already; else None."""
    cached, checked = module.__dict__.get(cache), module.__dict__.get("_unchanged_kinds")
    if checked is not None and kind in checked and cached is not None and cached[0][:2] == kind:
        return (cached[1],)
    return None


def _cache_decode_args(module: nn.Module, cache: str, key: tuple, collect: Callable) -> Any:
    """module.__dict__[cache]'s arguments when they were cached under key (kind + the
    modules' part), else collect()'s, cached under it; under modules_unchanged() the key's kind
    counts as checked from here on."""
    checked = module.__dict__.get("_unchanged_kinds")
    if checked is not None:
        checked.add(key[:2])
    cached = module.__dict__.get(cache)
    if cached is None or cached[0] != key:
        cached = module.__dict__[cache] = (key, collect())
    return cached[1]


def _stack_decode_args(
    x: Tensor, blocks: list[TransformerBlock]
) -> tuple[list[list], tuple] | None:
    """_layers_args' lists from each block's block_args, or None."""
    if any(b.layer_ops is not True for b in blocks):  # decode_layer switched off
        return None
    per_block = [block_args(b, x) for b in blocks]
    if any(a is None for a in per_block):
        return None
    configs = set()
    weights: list[list] = [[] for _ in range(7)]
    for i, (args, (layer_idx, n_heads, n_kv_heads, scale)) in enumerate(per_block):  # type: ignore[misc]
        attention_norm, ffn_norm, eps, wqkv, wqkv_bias, wo, w13, w2, prepacked = args
        if attention_norm is None:  # decode_layers' layers all have an input norm
            return None
        for column, w in zip(weights, (attention_norm, ffn_norm, wqkv, wqkv_bias, wo, w13, w2)):
            column.append(w)
        configs.add((eps, prepacked, layer_idx - i, n_heads, n_kv_heads, scale))
    if len(configs) != 1:  # mixed eps, layouts, heads or scales; or layers not consecutive
        return None
    config = configs.pop()
    return (weights, config) if config[2] >= 0 else None


def _layers_args(
    model: Transformer, x: Tensor, cos: Tensor, sin: Tensor, meta: AttentionMetadata
) -> tuple[list[list], tuple] | None:
    """The blocks' weights as decode_layers' lists (attention_norm_weights,
    ffn_norm_weights, wqkv, wqkv_bias, wo, w13, w2) and (eps, prepacked, first layer, heads,
    KV heads, scale), when every block would run as one decode_layer call with the same
    eps, layout, heads and scale on consecutive cache layers; else None (the blocks run one
    by one, each as decode_layer or its modules).

    Cached between steps under the blocks' block_key()s (~2 us a block against ~13 us for
    each block's own block_args check) and whether x's rows take the tiles; under
    modules_unchanged() the modules are checked once per kind of x (in a step, after the
    weights streamed through the caches, the 30 blocks' check cost ~0.6 ms: ~5% of a plain
    bf16 step at 2 threads)."""
    if (
        not layer_ops_apply(x)
        or meta.mode != "verify"
        or meta.start != 0
        or cos.dtype != x.dtype
        or cos.shape[:2] != x.shape[:2]
        or (not meta.packed and x.shape[1] != meta.tree_mask.shape[1])  # type: ignore[union-attr]
    ):
        return None
    kind = _decode_kind(x)
    hit = _checked_decode_args(model, "_decode_layers_cache", kind)
    if hit is not None:
        return hit[0]
    blocks: list[TransformerBlock] = list(model.layers._modules.values())  # type: ignore[arg-type]
    if (
        not blocks
        or any(type(b) is not TransformerBlock for b in blocks)
        or blocks[0].layer_ops is not True  # the others' flags: _stack_decode_args
    ):
        return None
    return _cache_decode_args(
        model,
        "_decode_layers_cache",
        (*kind, tuple(block_key(b) for b in blocks)),
        lambda: _stack_decode_args(x, blocks),
    )


def _run_layers(
    model: Transformer,
    x: Tensor,
    cos: Tensor,
    sin: Tensor,
    meta: AttentionMetadata,
    feature_layers: Sequence[int],
    weights: list[list],
    config: tuple,
) -> tuple[Tensor, list[Tensor]]:
    """Transformer._layers as decode_layers calls: one for all blocks, or one per run of blocks
    ending at a feature layer (whose output is kept)."""
    eps, prepacked, first_layer, n_heads, n_kv_heads, scale = config
    n = len(weights[0])
    ends = sorted({i for i in feature_layers if 0 <= i < n} | {n - 1})
    feats, start = [], 0
    for end in ends:
        x = torch.ops.specdec.decode_layers(
            x,
            *(w[start : end + 1] for w in weights[:2]),
            eps,
            *(w[start : end + 1] for w in weights[2:]),
            prepacked,
            cos,
            sin,
            n_heads,
            n_kv_heads,
            meta.cache.k,
            meta.cache.v,
            first_layer + start,
            meta.rows,
            meta.picked,
            meta.packed,
            meta.block_table,
            meta.cache_lens,
            meta.num_nodes,
            meta.tree_mask,
            scale,
        )
        if end in feature_layers:
            feats.append(x)
        start = end + 1
    return model.norm(x), feats


def layers_forward(
    model: Transformer,
    x: Tensor,
    cos: Tensor,
    sin: Tensor,
    meta: AttentionMetadata,
    feature_layers: Sequence[int],
) -> tuple[Tensor, list[Tensor]] | None:
    """Transformer._layers as decode_layers calls -> (final-norm hidden, the outputs of
    feature_layers), or None where the blocks must run one by one (_layers_args)."""
    run = _layers_args(model, x, cos, sin, meta)
    if run is None:
        return None
    return _run_layers(model, x, cos, sin, meta, feature_layers, *run)


class ModulesUnchanged:
    """modules_unchanged()'s context. recheck(): the next step checks the modules again (after
    code that may have changed them ran inside the context, e.g. a caller's callback)."""

    def __init__(self, roots: Sequence[nn.Module]):
        owners = {
            id(m): m
            for root in roots
            for m in root.modules()
            if isinstance(m, (Transformer, TransformerBlock))
        }
        self._owners = list(owners.values())

    def __enter__(self) -> "ModulesUnchanged":
        self.recheck()
        return self

    def __exit__(self, *exc) -> None:
        for m in self._owners:
            m.__dict__.pop("_unchanged_kinds", None)

    def recheck(self) -> None:
        for m in self._owners:
            m.__dict__["_unchanged_kinds"] = set()

    def recheck_after(self, fn: Callable) -> Callable:
        """fn wrapped: recheck() once it returns."""

        def call(*args, **kwargs):
            try:
                return fn(*args, **kwargs)
            finally:
                self.recheck()

        return call


def modules_unchanged(*roots: nn.Module) -> ModulesUnchanged:
    """A context in which the decode path trusts that roots' Transformers and blocks do not
    change: their cached decode_layer(s) arguments are checked against the modules (weights,
    parameters, eps, flags: block_args) once per kind of step instead of at
    every step. For a caller that runs steps back to back with none of its users' code in
    between (Engine.generate); outside it (and after a nested context ends) every step checks.
    """
    return ModulesUnchanged(roots)
