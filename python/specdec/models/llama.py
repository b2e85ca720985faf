"""A minimal Llama-family decoder (Llama, Mistral, Qwen2, SmolLM) over a PagedKVCache.

Numerics follow transformers' LlamaForCausalLM op for op (RMSNorm in float32, RoPE from
the same inverse frequencies, SwiGLU), so greedy decoding reproduces it token for token.
q/k/v and gate/up projections are fused into single matmuls by the loader.

Modules as in gpt-fast: TransformerBlock = RMSNorm + Attention + RMSNorm + FeedForward
(the EAGLE head reuses them). Each forward builds one AttentionMetadata (where the new
K/V go in the paged cache, what they attend to) that every layer's Attention reads.
prefill() runs whole prompts with causal SDPA; forward() verifies a batch of draft trees
(a plain decode step is the one-node tree) with the tree_verify op in every layer.
Shapes: B requests, T tokens (tree nodes) each, Hq / Hkv query / KV heads of size D, V vocab.
"""

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal, NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from specdec.models.cache import PagedKVCache
from specdec.models.config import ModelArgs
from specdec_kernels import ops  # importing specdec_kernels registers torch.ops.specdec
from specdec_kernels.reference import rms_norm, rope_qkv, silu_and_mul

# A custom attention (q [B, T, Hq, D], k, v [B, T, Hkv, D]) -> [B, T, Hq, D], used instead of
# AttentionMetadata by differentiable training passes (train.head_train_forward).
Attend = Callable[[Tensor, Tensor, Tensor], Tensor]


class PrefillOut(NamedTuple):
    logits: Tensor  # [B, V] float32 at the last prompt position
    hidden: list[Tensor]  # per request [S_b, dim], final-norm output
    aux: list[
        Tensor
    ]  # per request [S_b, len(feature_layers) * dim], pre-norm outputs of feature_layers


class VerifyOut(NamedTuple):
    logits: Tensor  # [B, T, V] float32
    hidden: Tensor  # [B, T, dim], final-norm output
    aux: Tensor  # [B, T, len(feature_layers) * dim]


@dataclass
class AttentionMetadata:
    """How one forward's new tokens meet the paged KV cache; built once per forward, read by
    every layer's Attention (which writes its layer's K/V at `rows`, then attends).

    mode "prefill": one whole prompt (B = 1) at positions 0..S-1; causal SDPA over itself.
    mode "verify": the new tokens are tree nodes start..start+M-1 of padded trees of
    T = tree_mask.shape[1] nodes, node i at logical position cache_lens[b] + i (nodes before
    `start` already cached); tree_verify over the cache (a plain decode step is T = 1).
    """

    mode: Literal["prefill", "verify"]
    cache: PagedKVCache
    rows: Tensor  # int64 [N]: physical cache rows of the new tokens (PagedKVCache.rows)
    picked: Tensor | None = (
        None  # int64 [N]: the valid entries of the flattened [B * M] new tokens; None: all
    )
    block_table: Tensor | None = None  # verify: int32 [B, blocks_per_slot], the batch's slots
    cache_lens: Tensor | None = None  # verify: int32 [B], logical position of tree node 0
    num_nodes: Tensor | None = (
        None  # verify: int32 [B]; nodes at or past it are padding (not written)
    )
    tree_mask: Tensor | None = None  # verify: int64 [B, T, ceil(T / 64)] from build_tree_mask
    start: int = 0  # verify: tree node of the first new token
    # verify: the layers' inputs hold only the real nodes, [1, N] (the `picked` entries of
    # [B * T]; Transformer.forward packs padded trees): attention unpacks them around the op
    packed: bool = False

    @classmethod
    def prefill(cls, cache: PagedKVCache, slots: Tensor, positions: Tensor) -> "AttentionMetadata":
        """slots: int [1]; positions: int [1, S] = 0..S-1 (the whole prompt)."""
        rows, _ = cache.rows(slots, positions)
        return cls("prefill", cache, rows)

    @classmethod
    def verify(
        cls,
        cache: PagedKVCache,
        slots: Tensor,
        cache_lens: Tensor,
        num_nodes: Tensor,
        tree_mask: Tensor,
        start: int = 0,
        num_new: int | None = None,
    ) -> "AttentionMetadata":
        """slots: int [B]; cache_lens, num_nodes: int32 [B]; tree_mask: int64 [B, T, ceil(T / 64)];
        the new tokens are nodes start..start+num_new-1 (default: start..T-1)."""
        T = tree_mask.shape[1]
        M = T - start if num_new is None else num_new
        node = start + torch.arange(M, device=cache_lens.device)[None]
        valid = (
            None if start == 0 and M == 1 else node < num_nodes[:, None]
        )  # num_nodes >= 1 always
        rows, picked = cache.rows(slots, cache_lens[:, None] + node, valid)
        return cls(
            "verify",
            cache,
            rows,
            picked,
            cache.block_table[slots],
            cache_lens,
            num_nodes,
            tree_mask,
            start,
        )


def unpack_rows(t: Tensor, picked: Tensor, B: int, T: int) -> Tensor:
    """t: [1, N, C], the packed real nodes (AttentionMetadata.picked of a padded [B, T]) ->
    [B, T, C], zeros at padding."""
    return t.new_zeros(B * T, t.shape[-1]).index_copy_(0, picked, t[0]).view(B, T, -1)


def use_layer_ops(
    module: "RMSNorm | Attention | FeedForward | TransformerBlock", x: Tensor
) -> bool:
    """Whether module (RMSNorm, Attention, FeedForward; a TransformerBlock: as one decode_layer
    call) runs its elementwise pieces through the C++ layer ops on x: switched on per module
    by specdec.cpu.layer_ops.configure, and only for inference on CPU (training takes the
    autograd-able torch ops; torch.compile traces them too, and fuses them itself)."""
    return module.layer_ops is True and layer_ops_apply(x)


def layer_ops_apply(x: Tensor) -> bool:
    """use_layer_ops' part that depends on the call, not the module: inference on CPU, not
    traced by torch.compile."""
    return (
        x.device.type == "cpu" and not torch.is_grad_enabled() and not torch.compiler.is_compiling()
    )


class RMSNorm(nn.Module):
    layer_ops = False  # the C++ op instead of the torch ops (use_layer_ops)

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        """x: [..., dim] -> [..., dim], normalised in float32."""
        if use_layer_ops(self, x):
            return torch.ops.specdec.rms_norm(x, self.weight, self.eps)
        return rms_norm(x, self.weight, self.eps)

    def add_forward(self, x: Tensor, residual: Tensor) -> tuple[Tensor, Tensor]:
        """-> (x + residual, forward(x + residual)), one pass with the layer ops."""
        if use_layer_ops(self, x):
            return torch.ops.specdec.add_rms_norm(x, residual, self.weight, self.eps)
        total = x + residual
        return total, self(total)


def inv_freq(args: ModelArgs) -> Tensor:
    """RoPE inverse frequencies [D / 2], with transformers' "linear" / "llama3" scaling."""
    dim = args.head_dim
    freq = 1.0 / (args.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))
    scaling = args.rope_scaling or {}
    kind = scaling.get("rope_type", "default")
    if kind == "linear":
        return freq / scaling["factor"]
    if kind == "llama3":
        factor, lo, hi = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_len = scaling["original_max_position_embeddings"]
        wavelen = 2 * math.pi / freq
        scaled = torch.where(wavelen > old_len / lo, freq / factor, freq)
        smooth = (old_len / wavelen - lo) / (hi - lo)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < old_len / hi) * ~(wavelen > old_len / lo)
        return torch.where(medium, smoothed, scaled)
    return freq


def rope_cos_sin(inv_freq: Tensor, positions: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """inv_freq: [D / 2]; positions: int [B, T] -> cos, sin: [B, T, 1, D] in dtype (as
    transformers)."""
    freqs = positions[..., None].float() * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype)[:, :, None], emb.sin().to(dtype)[:, :, None]


class FeedForward(nn.Module):
    """SwiGLU MLP: w2(silu(gate) * up), gate and up from one fused w13 = [gate; up]."""

    layer_ops = False  # silu_and_mul as one C++ op (use_layer_ops)

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.w13 = nn.Linear(args.dim, 2 * args.hidden_dim, bias=False)  # [gate; up]
        self.w2 = nn.Linear(args.hidden_dim, args.dim, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        """x: [B, T, dim] -> [B, T, dim]."""
        gate_up = self.w13(x)
        if use_layer_ops(self, gate_up):
            return self.w2(torch.ops.specdec.silu_and_mul(gate_up))
        return self.w2(silu_and_mul(gate_up))


class Attention(nn.Module):
    """Fused q/k/v projection (optional bias), RoPE, GQA attention over the paged KV cache, wo.

    Layer `layer_idx` of the cache holds its K/V. in_dim: the input width (dim; EAGLE-3's
    head attends over [embedding; feature], 2 * dim)."""

    layer_ops = False  # split + RoPE of q and k as one C++ op (use_layer_ops)

    def __init__(self, args: ModelArgs, layer_idx: int = 0, in_dim: int | None = None):
        super().__init__()
        self.layer_idx = layer_idx
        self.n_heads, self.n_kv_heads, self.head_dim = args.n_heads, args.n_kv_heads, args.head_dim
        self.qkv_sizes = [args.n_heads * args.head_dim] + [args.n_kv_heads * args.head_dim] * 2
        self.scale = args.head_dim**-0.5
        self.wqkv = nn.Linear(in_dim or args.dim, sum(self.qkv_sizes), bias=args.attention_bias)
        self.wo = nn.Linear(args.n_heads * args.head_dim, args.dim, bias=False)

    def project(self, x: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """x: [B, T, in_dim]; cos, sin: [B, T, 1, D] -> q: [B, T, Hq, D] and k, v: [B, T, Hkv, D],
        q and k rotated."""
        qkv = self.wqkv(x)
        if use_layer_ops(self, qkv) and cos.shape[:2] == qkv.shape[:2] and cos.dtype == qkv.dtype:
            return torch.ops.specdec.rope_qkv(qkv, cos, sin, self.n_heads, self.n_kv_heads)
        return rope_qkv(qkv, cos, sin, self.n_heads, self.n_kv_heads)

    def attend(self, q: Tensor, k: Tensor, v: Tensor, meta: AttentionMetadata) -> Tensor:
        """Writes k, v into the cache rows of `meta`, then attends.

        q: [B, T, Hq, D]; k, v: [B, T, Hkv, D] -> [B, T, Hq, D]."""
        if meta.packed:  # q, k, v: [1, N, H, D], the real nodes only
            return self._attend_packed(q, k, v, meta)
        meta.cache.write_rows(self.layer_idx, meta.rows, meta.picked, k, v)
        if meta.mode == "prefill":
            out = F.scaled_dot_product_attention(
                q.transpose(1, 2),
                k.transpose(1, 2),
                v.transpose(1, 2),
                is_causal=True,
                scale=self.scale,
                enable_gqa=self.n_heads != self.n_kv_heads,
            )
            return out.transpose(1, 2)
        # verify mode always has them (AttentionMetadata.verify)
        assert meta.tree_mask is not None and meta.block_table is not None
        assert meta.cache_lens is not None and meta.num_nodes is not None
        B, M = q.shape[:2]
        T, start = meta.tree_mask.shape[1], meta.start
        if M != T:  # a head adding nodes start..start+M-1: earlier nodes ask no query
            q_tree = q.new_zeros(B, T, self.n_heads, self.head_dim)
            q_tree[:, start : start + M] = q
            q = q_tree
        out = ops.tree_verify(
            q,
            meta.cache.k[self.layer_idx],
            meta.cache.v[self.layer_idx],
            meta.block_table,
            meta.cache_lens,
            meta.num_nodes,
            meta.tree_mask,
            self.scale,
        )
        return out if M == T else out[:, start : start + M]

    def _attend_packed(self, q: Tensor, k: Tensor, v: Tensor, meta: AttentionMetadata) -> Tensor:
        """q: [1, N, Hq, D], k, v: [1, N, Hkv, D], the real nodes (meta.picked of the padded
        [B, T] trees) -> [1, N, Hq, D]: k, v go to their cache rows, the queries are laid out
        as the padded trees for tree_verify (padding asks a zero query, its output dropped)."""
        assert meta.tree_mask is not None and meta.block_table is not None
        assert meta.cache_lens is not None and meta.num_nodes is not None
        assert meta.picked is not None
        meta.cache.write_rows(self.layer_idx, meta.rows, None, k, v)
        B, T = meta.tree_mask.shape[:2]
        q_tree = q.new_zeros(B * T, self.n_heads, self.head_dim).index_copy_(0, meta.picked, q[0])
        out = ops.tree_verify(
            q_tree.view(B, T, self.n_heads, self.head_dim),
            meta.cache.k[self.layer_idx],
            meta.cache.v[self.layer_idx],
            meta.block_table,
            meta.cache_lens,
            meta.num_nodes,
            meta.tree_mask,
            self.scale,
        )
        return out.reshape(B * T, self.n_heads, self.head_dim).index_select(0, meta.picked)[None]

    def forward(
        self, x: Tensor, cos: Tensor, sin: Tensor, meta: AttentionMetadata | Attend
    ) -> Tensor:
        """x: [B, T, in_dim]; cos, sin: [B, T, 1, D]; meta: this forward's AttentionMetadata, or a
        custom attention (q, k, v) -> [B, T, Hq, D] (differentiable training passes) -> [B, T, dim].
        """
        B, T, _ = x.shape
        q, k, v = self.project(x, cos, sin)
        out = self.attend(q, k, v, meta) if isinstance(meta, AttentionMetadata) else meta(q, k, v)
        return self.wo(out.reshape(B, T, -1))


# Parameters of TransformerBlock before it had Attention / FeedForward submodules (still
# accepted by load_state_dict: loader.py and older training checkpoints use them).
_FLAT_BLOCK_NAMES = {
    "wqkv": "attention.wqkv",
    "wo": "attention.wo",
    "w13": "feed_forward.w13",
    "w2": "feed_forward.w2",
}


class TransformerBlock(nn.Module):
    """x + Attention(attention_norm(x)), then + FeedForward(ffn_norm(.)) (pre-norm residuals)."""

    # a verify step's block as one C++ call (torch.ops.specdec.decode_layer) when its modules
    # use the layer ops (specdec.cpu.layer_ops.configure switches both)
    layer_ops = False
    # (block, x, cos, sin, meta) -> the block's output, or None where the modules must run:
    # the CPU decode path's whole-block call, installed by specdec.cpu.configure
    # (docs/cpu-decode-path.md); None: the modules always run
    fused_forward: Callable[..., Tensor | None] | None = None

    def __init__(self, args: ModelArgs, layer_idx: int = 0):
        super().__init__()
        self.attention_norm = RMSNorm(args.dim, args.norm_eps)
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps)
        self.attention = Attention(args, layer_idx)
        self.feed_forward = FeedForward(args)
        self._register_load_state_dict_pre_hook(_nest_flat_block_names)  # as gpt-fast does

    def forward(
        self,
        x: Tensor,
        cos: Tensor,
        sin: Tensor,
        meta: AttentionMetadata | Attend,
        attn_in: Tensor | None = None,
    ) -> Tensor:
        """x: [B, T, dim]; cos, sin: [B, T, 1, D]; meta: see Attention.forward; attn_in: the
        attention's input when it is not attention_norm(x) (EAGLE-3: [B, T, 2 * dim]) -> [B, T,
        dim]."""
        if (
            attn_in is None
            and self.fused_forward is not None
            and isinstance(meta, AttentionMetadata)
        ):
            out = self.fused_forward(self, x, cos, sin, meta)
            if out is not None:
                return out
        attn_in = self.attention_norm(x) if attn_in is None else attn_in
        h, ffn_in = self.ffn_norm.add_forward(x, self.attention(attn_in, cos, sin, meta))
        return h + self.feed_forward(ffn_in)


def _nest_flat_block_names(state_dict: dict, prefix: str, *_) -> None:
    for key in [k for k in state_dict if k.startswith(prefix)]:
        name, _, kind = key[len(prefix) :].partition(".")
        if name in _FLAT_BLOCK_NAMES and kind in ("weight", "bias"):
            state_dict[f"{prefix}{_FLAT_BLOCK_NAMES[name]}.{kind}"] = state_dict.pop(key)


class Transformer(nn.Module):
    """The target model: embeddings, args.n_layers TransformerBlocks, final norm, lm_head."""

    # (model, x, cos, sin, meta, feature_layers) -> (final-norm hidden, features), or None
    # where the blocks must run one by one: a verify step's blocks as decode_layers calls,
    # installed by specdec.cpu.configure (docs/cpu-decode-path.md); None: block by block
    fused_layers: Callable[..., tuple[Tensor, list[Tensor]] | None] | None = None

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleList(TransformerBlock(args, i) for i in range(args.n_layers))
        self.norm = RMSNorm(args.dim, args.norm_eps)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
        if args.tie_word_embeddings:
            self.output.weight = self.tok_embeddings.weight
        self.register_buffer("inv_freq", inv_freq(args), persistent=False)
        self.scale = args.head_dim**-0.5
        # a specdec.runtime.compiled_step.CompiledStep that forward() delegates to; None: not
        # decided yet, False: eager (compiled_step.configure)
        self.compiled_step = None

    def new_cache(
        self,
        num_slots: int,
        max_seq_len: int,
        block_size: int = 16,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
        shuffle_blocks: bool = False,
    ) -> PagedKVCache:
        """Callers keep sequences within args.max_position_embeddings (the Mistral window, say)."""
        w = self.tok_embeddings.weight
        # the KV heads this model computes: under tensor parallelism (tp.shard_model), this
        # rank's share of args.n_kv_heads
        block = self.layers[0] if len(self.layers) else None
        kv_heads = self.args.n_kv_heads
        if isinstance(block, TransformerBlock):
            kv_heads = block.attention.n_kv_heads
        return PagedKVCache(
            self.args.n_layers,
            kv_heads,
            self.args.head_dim,
            num_slots,
            max_seq_len,
            block_size,
            dtype or w.dtype,
            device or w.device,
            shuffle_blocks,
        )

    def lm_head(self, hidden: Tensor) -> Tensor:
        """hidden: [..., dim] -> logits [..., V] in the model's dtype."""
        return self.output(hidden)

    def rope(self, positions: Tensor) -> tuple[Tensor, Tensor]:
        """positions: int [B, T] -> cos, sin: [B, T, 1, D] (computed as transformers does)."""
        inv_freq = self.get_buffer("inv_freq")  # registered in __init__
        return rope_cos_sin(inv_freq, positions, self.tok_embeddings.weight.dtype)

    def _layers(
        self,
        x: Tensor,
        cos: Tensor,
        sin: Tensor,
        meta: AttentionMetadata,
        feature_layers: Sequence[int],
    ) -> tuple[Tensor, list[Tensor]]:
        """Runs every block; returns (final-norm hidden, [pre-norm outputs of feature_layers])."""
        if self.fused_layers is not None:
            out = self.fused_layers(self, x, cos, sin, meta, feature_layers)
            if out is not None:
                return out
        feats = []
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, sin, meta)
            if i in feature_layers:
                feats.append(x)
        return self.norm(x), feats

    @torch.no_grad()
    def prefill(
        self,
        tokens: Sequence[Tensor],
        cache: PagedKVCache,
        slots: Tensor,
        feature_layers: Sequence[int] = (),
    ) -> PrefillOut:
        """tokens: per request long [S_b] (whole prompts); slots: int [B] -> KV at positions
        0..S_b-1, cache_lens = S_b."""
        logits, hidden, aux = [], [], []
        for b, prompt in enumerate(tokens):
            slot = slots[b : b + 1]
            pos = torch.arange(len(prompt), device=prompt.device)[None]  # [1, S]
            meta = AttentionMetadata.prefill(cache, slot, pos)
            cos, sin = self.rope(pos)
            h, feats = self._layers(
                self.tok_embeddings(prompt[None]), cos, sin, meta, feature_layers
            )
            cache.cache_lens[slot] = len(prompt)
            logits.append(self.lm_head(h[0, -1]).float())
            hidden.append(h[0])
            aux.append(torch.cat(feats, dim=-1)[0] if feats else h.new_empty(len(prompt), 0))
        return PrefillOut(torch.stack(logits), hidden, aux)

    def forward(
        self,
        tokens: Tensor,
        cache: PagedKVCache,
        slots: Tensor,
        num_nodes: Tensor,
        tree_mask: Tensor,
        depth: Tensor,
        feature_layers: Sequence[int] = (),
    ) -> VerifyOut:
        """eager_forward, or the CompiledStep enabled on this model (outputs at padding nodes
        are then unspecified)."""
        step = self.compiled_step or self.eager_forward
        return step(tokens, cache, slots, num_nodes, tree_mask, depth, feature_layers)

    @torch.no_grad()
    def eager_forward(
        self,
        tokens: Tensor,
        cache: PagedKVCache,
        slots: Tensor,
        num_nodes: Tensor,
        tree_mask: Tensor,
        depth: Tensor,
        feature_layers: Sequence[int] = (),
    ) -> VerifyOut:
        """Verify draft trees: tokens: long [B, T] (node 0 = last emitted token, not yet cached);
        slots: int [B]; num_nodes: int32 [B]; tree_mask: int64 [B, T, ceil(T / 64)], depth: int32
        [B, T] from build_tree_mask. Node i is written at cache_lens + i and rotated at
        cache_lens + depth[i]; cache_lens is not advanced.

        Trees of different sizes (num_nodes < T for some rows) are packed: every per-token
        layer (projections, MLP, lm_head) runs on the real nodes only, so a request whose
        tree is small (a plain step: the root only) costs no more than its nodes, whatever
        the other requests' trees (the adaptive policy sizes trees per request on that
        basis). Outputs at padding are zeros."""
        B, T = tokens.shape
        cache_lens = cache.cache_lens[slots]
        meta = AttentionMetadata.verify(cache, slots, cache_lens, num_nodes, tree_mask)
        positions = cache_lens[:, None] + depth
        picked = meta.picked
        if picked is None or picked.numel() == B * T:  # full trees: nothing to skip
            cos, sin = self.rope(positions)
            h, feats = self._layers(self.tok_embeddings(tokens), cos, sin, meta, feature_layers)
            aux = torch.cat(feats, dim=-1) if feats else h.new_empty(B, T, 0)
            return VerifyOut(self.lm_head(h).float(), h, aux)
        meta.packed = True
        cos, sin = self.rope(positions.flatten()[picked][None])  # [1, N, 1, D]
        x = self.tok_embeddings(tokens.flatten()[picked][None])  # [1, N, dim]
        h, feats = self._layers(x, cos, sin, meta, feature_layers)

        aux = unpack_rows(torch.cat(feats, dim=-1), picked, B, T) if feats else h.new_empty(B, T, 0)
        logits = unpack_rows(self.lm_head(h).float(), picked, B, T)
        return VerifyOut(logits, unpack_rows(h, picked, B, T), aux)
