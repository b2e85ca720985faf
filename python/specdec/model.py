"""A minimal Llama-family decoder (Llama, Mistral, Qwen2, SmolLM) over a PagedKVCache.

Numerics follow transformers' LlamaForCausalLM op for op (RMSNorm in float32, RoPE from
the same inverse frequencies, SwiGLU), so greedy decoding reproduces it token for token.
q/k/v and gate/up projections are fused into single matmuls by the loader.

prefill() runs whole prompts with causal SDPA; forward() verifies a batch of draft trees
(a plain decode step is the one-node tree) with torch.ops.specdec.tree_verify in every layer.
"""
import math
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

import specdec_kernels  # noqa: F401  (registers torch.ops.specdec)

from .cache import PagedKVCache
from .config import ModelArgs


class PrefillOut(NamedTuple):
    logits: torch.Tensor  # [B, V] at the last prompt position
    hidden: list  # per request [S_b, dim], final-norm output
    aux: list  # per request [S_b, len(feature_layers) * dim], pre-norm outputs of feature_layers


class VerifyOut(NamedTuple):
    logits: torch.Tensor  # [B, T, V] float32
    hidden: torch.Tensor  # [B, T, dim], final-norm output
    aux: torch.Tensor  # [B, T, len(feature_layers) * dim]


class RMSNorm(nn.Module):
    def __init__(self, dim, eps):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


def inv_freq(args: ModelArgs) -> torch.Tensor:
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


def rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class TransformerBlock(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = args.n_heads, args.n_kv_heads, args.head_dim
        self.qkv_sizes = [args.n_heads * args.head_dim] + [args.n_kv_heads * args.head_dim] * 2
        self.attention_norm = RMSNorm(args.dim, args.norm_eps)
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps)
        self.wqkv = nn.Linear(args.dim, sum(self.qkv_sizes), bias=args.attention_bias)
        self.wo = nn.Linear(args.n_heads * args.head_dim, args.dim, bias=False)
        self.w13 = nn.Linear(args.dim, 2 * args.hidden_dim, bias=False)  # [gate; up]
        self.w2 = nn.Linear(args.hidden_dim, args.dim, bias=False)

    def forward(self, x, cos, sin, attend):
        """x: [B, T, dim]; cos, sin: [B, T, 1, D]; attend(q, k, v) -> [B, T, Hq, D]."""
        B, T, _ = x.shape
        q, k, v = self.wqkv(self.attention_norm(x)).split(self.qkv_sizes, dim=-1)
        q = q.view(B, T, self.n_heads, self.head_dim)
        k = k.view(B, T, self.n_kv_heads, self.head_dim)
        v = v.view(B, T, self.n_kv_heads, self.head_dim)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        x = x + self.wo(attend(q, k, v).reshape(B, T, -1))
        gate, up = self.w13(self.ffn_norm(x)).chunk(2, dim=-1)
        return x + self.w2(F.silu(gate) * up)


class Transformer(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleList(TransformerBlock(args) for _ in range(args.n_layers))
        self.norm = RMSNorm(args.dim, args.norm_eps)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
        if args.tie_word_embeddings:
            self.output.weight = self.tok_embeddings.weight
        self.register_buffer("inv_freq", inv_freq(args), persistent=False)
        self.scale = args.head_dim ** -0.5

    def new_cache(self, num_slots, max_seq_len, block_size=16, dtype=None, device=None,
                  shuffle_blocks=False) -> PagedKVCache:
        """Callers keep sequences within args.max_position_embeddings (the Mistral window, say)."""
        w = self.tok_embeddings.weight
        return PagedKVCache(self.args.n_layers, self.args.n_kv_heads, self.args.head_dim, num_slots,
                            max_seq_len, block_size, dtype or w.dtype, device or w.device,
                            shuffle_blocks)

    def lm_head(self, hidden):
        return self.output(hidden)

    def rope(self, positions):
        """positions int [B, T] -> cos, sin [B, T, 1, D] (computed as transformers does)."""
        freqs = positions[..., None].float() * self.inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        dtype = self.tok_embeddings.weight.dtype
        return emb.cos().to(dtype)[:, :, None], emb.sin().to(dtype)[:, :, None]

    def _layers(self, x, cos, sin, attend_in_layer, feature_layers):
        """Runs every block; returns (final-norm hidden, [pre-norm outputs of feature_layers])."""
        feats = []
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, sin, attend_in_layer(i))
            if i in feature_layers:
                feats.append(x)
        return self.norm(x), feats

    @torch.no_grad()
    def prefill(self, tokens, cache: PagedKVCache, slots, feature_layers=()) -> PrefillOut:
        """tokens: list of LongTensor [S_b] (whole prompts) -> KV at positions 0..S_b-1, cache_lens = S_b."""
        logits, hidden, aux = [], [], []
        for b, prompt in enumerate(tokens):
            slot = slots[b : b + 1]
            pos = torch.arange(len(prompt), device=prompt.device)[None]  # [1, S]
            rows, _ = cache.rows(slot, pos)
            cos, sin = self.rope(pos)

            def attend_in_layer(layer):
                def attend(q, k, v):
                    cache.write_rows(layer, rows, None, k, v)
                    out = F.scaled_dot_product_attention(
                        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True,
                        scale=self.scale, enable_gqa=self.args.n_heads != self.args.n_kv_heads)
                    return out.transpose(1, 2)
                return attend

            h, feats = self._layers(self.tok_embeddings(prompt[None]), cos, sin, attend_in_layer,
                                    feature_layers)
            cache.cache_lens[slot] = len(prompt)
            logits.append(self.lm_head(h[0, -1]).float())
            hidden.append(h[0])
            aux.append(torch.cat(feats, dim=-1)[0] if feats else h.new_empty(len(prompt), 0))
        return PrefillOut(torch.stack(logits), hidden, aux)

    @torch.no_grad()
    def forward(self, tokens, cache: PagedKVCache, slots, num_nodes, tree_mask, depth,
                feature_layers=()) -> VerifyOut:
        """Verify draft trees: tokens [B, T] (node 0 = last emitted token, not yet cached);
        num_nodes int32 [B]; tree_mask, depth from build_tree_mask. Node i is written at
        cache_lens + i and rotated at cache_lens + depth[i]; cache_lens is not advanced."""
        B, T = tokens.shape
        cache_lens = cache.cache_lens[slots]
        block_table = cache.block_table[slots]
        node = torch.arange(T, device=tokens.device)[None]
        valid = None if T == 1 else node < num_nodes[:, None]  # num_nodes >= 1 always
        rows, picked = cache.rows(slots, cache_lens[:, None] + node, valid)
        cos, sin = self.rope(cache_lens[:, None] + depth)

        def attend_in_layer(layer):
            def attend(q, k, v):
                cache.write_rows(layer, rows, picked, k, v)
                return torch.ops.specdec.tree_verify(q, cache.k[layer], cache.v[layer], block_table,
                                                     cache_lens, num_nodes, tree_mask, self.scale)
            return attend

        h, feats = self._layers(self.tok_embeddings(tokens), cos, sin, attend_in_layer, feature_layers)
        aux = torch.cat(feats, dim=-1) if feats else h.new_empty(B, T, 0)
        return VerifyOut(self.lm_head(h).float(), h, aux)
