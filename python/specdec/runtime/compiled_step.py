"""CompiledStep: the target's verify forward (a plain decode step is the one-node tree) run
through torch.compile, one static-shape graph per (B, bucketed T, feature_layers, cache) it meets.

Transformer.forward packs the real nodes of trees of different sizes and builds its
AttentionMetadata from the cache with data-dependent shapes (nonzero), which a static graph
cannot hold. The compiled step instead runs the padded [B, T] trees whole, T padded further
to a power of two (`bucket`: few shapes, few compiles); the real nodes' K/V are written as
eagerly (the selection inside the write_kv op, which mutates the cache graph inputs in
place), padding is neither written nor attended (tree_verify stops at num_nodes), and the
outputs at padding are whatever the padding computes (callers read real nodes only).
tree_verify is in the graph (fullgraph=True proves it: it has a fake and passes opcheck).

On CPU inductor's `freezing` folds the weights into the graph as constants and prepacks the
bf16 matmuls for oneDNN (AMX / AVX512-BF16), the largest single win at small M
(docs/cpu-decode-path.md). Compile time is paid once per shape and kept in
`compile_s`. Enabled per model by `enable(model)` or `configure(model, setting)` (the Engine
applies SPECDEC_COMPILE, the CLI --compile / --no-compile); Transformer.forward then
delegates here.
"""

import time
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from specdec import envs
from specdec.models.cache import PagedKVCache
from specdec.models.llama import Transformer, VerifyOut
from specdec_kernels import ops


@torch.library.custom_op("specdec_engine::write_kv", mutates_args=("k_cache", "v_cache"))
def write_kv(
    k_cache: Tensor,
    v_cache: Tensor,
    layer: int,
    rows: Tensor,
    source: Tensor,
    k: Tensor,
    v: Tensor,
) -> None:
    """k_cache, v_cache: [L, num_blocks, block_size, Hkv, D]; rows: int64 [N], the cache row
    of each of the N = B * T nodes; source: int64 [N], the node whose K/V each entry writes:
    itself for a real node, node 0 of its tree for padding; k, v: [N, Hkv, D] -> written at
    their rows of layer `layer` (as PagedKVCache.write_rows). Padding thus rewrites its tree's
    node 0 with node 0's own values (duplicate indices, identical values: deterministic), so
    the write has static shapes and no host sync: CUDA graphs can capture it. An op that
    declares the mutation, so that inductor writes the cache in place (index_copy_ on a view
    of a graph input is functionalized into copies of the layer's whole cache)."""
    rows, k, v = rows[source], k[source], v[source]
    k_cache[layer].view(-1, *k.shape[1:]).index_copy_(0, rows, k.to(k_cache.dtype))
    v_cache[layer].view(-1, *v.shape[1:]).index_copy_(0, rows, v.to(v_cache.dtype))


@write_kv.register_fake
def _(k_cache, v_cache, layer, rows, source, k, v) -> None:
    return None


def write_sources(num_nodes: Tensor, T: int) -> Tensor:
    """num_nodes: int32 [B] (>= 1) -> int64 [B * T]: write_kv's source of each node (itself
    when real, node 0 of its tree when padding)."""
    B = num_nodes.shape[0]
    entry = torch.arange(B * T, device=num_nodes.device).view(B, T)
    real = entry % T < num_nodes[:, None]
    return torch.where(real, entry, entry[:, :1]).flatten()


CUDA_GRAPH_MODES = ("reduce-overhead", "max-autotune")


def compile_mode(device: torch.device, mode: str | None = None) -> tuple[str, bool]:
    """-> (torch.compile's mode for a step on `device`, whether inductor replays it as CUDA
    graphs). mode None: SPECDEC_COMPILE_MODE, else "reduce-overhead" on CUDA and "default"
    elsewhere (CPU tensors have no graphs)."""
    if mode is None:
        on_cuda = device.type == "cuda"
        mode = envs.SPECDEC_COMPILE_MODE or ("reduce-overhead" if on_cuda else "default")
    return mode, device.type == "cuda" and mode in CUDA_GRAPH_MODES


def bucket(T: int) -> int:
    """The compiled tree size T pads to: the next power of two (adaptive mode sizes its trees
    anywhere in 1..total; buckets bound the compiles to log2(total) + 1, the sizes its cost
    model measures)."""
    return 1 << (T - 1).bit_length()


class _Step(torch.nn.Module):
    """The traced body, a module around the target so that inductor's freezing sees its
    weights as parameters (and folds / prepacks them)."""

    def __init__(self, model: Transformer, feature_layers: tuple[int, ...]):
        super().__init__()
        self.model = model
        self.feature_layers = feature_layers

    def forward(self, *args: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        return _step(self.model, self.feature_layers, *args)


def _step(
    model: Transformer,
    feature_layers: tuple[int, ...],
    tokens: Tensor,
    positions: Tensor,
    rows: Tensor,
    sources: Tensor,
    block_table: Tensor,
    cache_lens: Tensor,
    num_nodes: Tensor,
    tree_mask: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
) -> tuple[Tensor, Tensor, Tensor]:
    """The traced body. tokens, positions: long [B, T] (positions = cache_lens + depth);
    rows: int64 [B * T] physical cache rows of nodes 0..T-1, sources: int64 [B * T] (write_kv's:
    padding writes nothing new); block_table: int32 [B, nb];
    cache_lens, num_nodes: int32 [B]; tree_mask: int64 [B, T, mask_words]; k_cache, v_cache:
    [L, num_blocks, block_size, Hkv, D] (written in place) -> logits [B, T, V] float32,
    hidden [B, T, dim], aux [B, T, len(feature_layers) * dim]."""
    B, T = tokens.shape
    cos, sin = model.rope(positions)
    x = model.tok_embeddings(tokens)
    feats = []
    for i, layer in enumerate(model.layers):
        attn = layer.attention
        q, k, v = attn.project(layer.attention_norm(x), cos, sin)
        kv_shape = (B * T, attn.n_kv_heads, attn.head_dim)
        write_kv(k_cache, v_cache, i, rows, sources, k.reshape(kv_shape), v.reshape(kv_shape))
        out = ops.tree_verify(
            q, k_cache[i], v_cache[i], block_table, cache_lens, num_nodes, tree_mask, attn.scale
        )
        h = x + attn.wo(out.reshape(B, T, -1))
        x = h + layer.feed_forward(layer.ffn_norm(h))
        if i in feature_layers:
            feats.append(x)
    h = model.norm(x)
    aux = torch.cat(feats, dim=-1) if feats else h.new_empty(B, T, 0)
    return model.lm_head(h).float(), h, aux


class CompiledStep:
    """Callable as Transformer.forward (same arguments, same VerifyOut at the real nodes).

    model: the target; freezing: inductor's weight freezing / prepacking (default: on CPU,
    where it pays; off on CUDA, where the weights stay parameters); mode: torch.compile's
    mode (default: SPECDEC_COMPILE_MODE, else "reduce-overhead" on CUDA, as gpt-fast: each
    shape's step is replayed as a CUDA graph, one launch instead of ~20 per layer; "default" on
    CPU, where there are no graphs); max_shapes: shapes compiled at most, later ones run
    eagerly (each costs a compile; a long-running engine meets few: T is fixed per tree size
    and B by the batch)."""

    def __init__(
        self,
        model: Transformer,
        freezing: bool | None = None,
        mode: str | None = None,
        max_shapes: int = 16,
        fullgraph: bool = True,
        backend: str = "inductor",
    ):
        self.model = model
        device = model.tok_embeddings.weight.device
        self.freezing = device.type == "cpu" if freezing is None else freezing
        self.mode, self.cuda_graphs = compile_mode(device, mode)
        self.max_shapes = max_shapes
        self.fullgraph = fullgraph
        self.backend = backend
        # (B, bucket T, feature_layers, cache shape, blocks per slot) -> first-call seconds
        self.compile_s: dict[tuple, float] = {}
        self._fns: dict[tuple, object] = {}

    def _compiled(self, key: tuple):
        fn = self._fns.get(key)
        if fn is None:
            if len(self._fns) >= self.max_shapes:
                return None
            # A fresh torch.compile per shape: dynamic=False and its own cache entry, so
            # shapes never recompile one another or hit dynamo's recompile limit.
            fn = torch.compile(
                _Step(self.model, key[2]),
                fullgraph=self.fullgraph,
                dynamic=False,
                backend=self.backend,
                mode=self.mode,
            )
            self._fns[key] = fn
        return fn

    @torch.no_grad()
    def __call__(
        self,
        tokens: Tensor,
        cache: PagedKVCache,
        slots: Tensor,
        num_nodes: Tensor,
        tree_mask: Tensor,
        depth: Tensor,
        feature_layers: Sequence[int] = (),
    ) -> VerifyOut:
        """As Transformer.forward; outputs at padding nodes are unspecified (not zeros)."""
        B, T = tokens.shape
        feature_layers = tuple(feature_layers)
        Tb = bucket(T)
        # the cache's geometry too: each Engine (max_seq_len) has its own, and dynamo guards
        # on every input shape
        key = (B, Tb, feature_layers, tuple(cache.k.shape), cache.block_table.shape[1])
        fn = self._compiled(key)
        if fn is None:
            return self.model.eager_forward(
                tokens, cache, slots, num_nodes, tree_mask, depth, feature_layers
            )
        if Tb != T:  # more padding nodes: past num_nodes, so neither written nor attended
            tokens, depth = F.pad(tokens, (0, Tb - T)), F.pad(depth, (0, Tb - T))
            mask_words = -(-Tb // 64)
            tree_mask = F.pad(tree_mask, (0, mask_words - tree_mask.shape[2], 0, Tb - T))
        cache_lens = cache.cache_lens[slots]
        node = torch.arange(Tb, device=tokens.device)[None]
        rows, _ = cache.rows(slots, cache_lens[:, None] + node)  # padding's rows: unused
        args = (
            tokens,
            (cache_lens[:, None] + depth).long(),
            rows,
            write_sources(num_nodes, Tb),
            cache.block_table[slots],
            cache_lens,
            num_nodes,
            tree_mask,
            cache.k,
            cache.v,
        )
        # freezing is read from the global config when dynamo hands the graph to inductor (the
        # options= of torch.compile come too late for it): patched around every call, so that a
        # recompile sees it too
        # dynamo keeps every graph of _Step.forward in one process-wide cache (per code object,
        # shared by every CompiledStep and shape): its recompile limit (8) must cover them all;
        # max_shapes bounds what each CompiledStep adds
        limit = max(256, torch._dynamo.config.recompile_limit)
        if self.cuda_graphs:
            # the cache is written in place by the replays: its address is part of the graph
            # (dynamo guards on it, so another cache recompiles instead of writing this one);
            # the other inputs are copied into the graph's own buffers at each replay
            torch._dynamo.mark_static_address(cache.k)
            torch._dynamo.mark_static_address(cache.v)
            torch.compiler.cudagraph_mark_step_begin()
        with (
            torch._inductor.config.patch(freezing=self.freezing),
            torch._dynamo.config.patch(recompile_limit=limit),
        ):
            t0 = time.perf_counter()
            outputs = fn(*args)
            if key not in self.compile_s:
                self.compile_s[key] = time.perf_counter() - t0
        if self.cuda_graphs:  # the next replay reuses the output buffers: the caller keeps these
            outputs = tuple(t.clone() for t in outputs)
        out = VerifyOut(*outputs)
        return out if Tb == T else VerifyOut(*(t[:, :T] for t in out))


def wanted(model: Transformer, setting: bool | str | None = None) -> bool:
    """Whether model's verify forwards should be compiled. setting: True / False, or None /
    "auto": SPECDEC_COMPILE's value ("auto" when unset). "auto" is off for now: on this
    machine class (2 shared cores) a step is ~1.3-1.5x faster compiled in bf16, but a compile
    costs 1-4 minutes per tree-size bucket (adaptive mode: 6 buckets), which only runs of
    thousands of tokens earn back; it turns on where a measurement shows it pays (CUDA, a
    persistent compile cache)."""
    if setting is None:
        setting = envs.SPECDEC_COMPILE
    if setting != "auto":
        return bool(setting)
    return False


def configure(model: Transformer, setting: bool | None = None) -> CompiledStep | None:
    """Applies a compile decision to model (kept by later Engines on it). setting None: a
    decision already taken stands (the CLI's --compile / --no-compile), else SPECDEC_COMPILE.
    Returns the CompiledStep or None (eager). Targets other than specdec's Transformer (the
    transformers integration's HFTarget) always run eagerly."""
    if not isinstance(model, Transformer):
        return None
    if setting is None and model.compiled_step is not None:
        return model.compiled_step or None
    if wanted(model, setting):
        return enable(model)
    model.compiled_step = False  # decided: eager
    return None


def enable(model: Transformer, **kwargs) -> CompiledStep:
    """Routes model's verify forwards (engine steps, cost measurement) through a CompiledStep
    (kwargs as CompiledStep's); returns it (its compile_s reports compile times)."""
    step = model.compiled_step
    if not step:
        step = model.compiled_step = CompiledStep(model, **kwargs)
    return step


def disable(model: Transformer) -> None:
    """Back to the eager forward."""
    model.compiled_step = False
