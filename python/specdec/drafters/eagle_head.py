"""The EAGLE draft head (EAGLE-1/2 and EAGLE-3) and its checkpoint loader.

EAGLE-1/2 (Li et al. 2024): x = fc([embed(token); feature]) (2*dim -> dim), then one Llama
decoder layer whose attention reads x directly (the official first layer has no
input_layernorm); its output is a predicted *target feature* (the target's final-norm
hidden), so the target's own lm_head turns it into logits.

EAGLE-3 (Li et al. 2025): the target feature is the concatenation of three decoder-layer
outputs (low, mid, high), fused by fc (3*dim -> dim). The decoder layer's attention reads
[input_layernorm(embed(token)); hidden_norm(feature)] (2*dim), the residual stream is the
feature; the head has its own final norm and lm_head over a (possibly reduced) draft
vocabulary, mapped back with d2t offsets: target_id = draft_id + d2t[draft_id].

Both share the target's token embedding. At draft depths >= 2 the "feature" is the head's
own output at the parent node (dim wide, so EAGLE-3 skips fc), exactly as upstream.

The decoder layer is model.TransformerBlock (its Attention and FeedForward); attention runs
over the head's own 1-layer PagedKVCache through tree_verify; the caller (drafting.HeadTree,
engine) says which tree nodes are new. Parameters keep our names (layer.attention.wqkv, ...);
checkpoints use the official EAGLE names (official_state_dict / load_head map them).
"""

import json
import os
from dataclasses import replace

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import Tensor, nn

from specdec.cpu.packed_linear import PackedLinear, WeightPack
from specdec.errors import HeadMismatchError, ModelLoadError, SpecdecError
from specdec.models.cache import PagedKVCache
from specdec.models.config import ModelArgs
from specdec.models.llama import (
    Attention,
    AttentionMetadata,
    RMSNorm,
    Transformer,
    TransformerBlock,
    inv_freq,
    rope_cos_sin,
    unpack_rows,
)

# official EAGLE key of each fused / renamed parameter of our layer (a submodule of self.layer)
_LAYER_KEYS = {
    "attention.wqkv": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "attention.wo": ("self_attn.o_proj",),
    "feed_forward.w13": ("mlp.gate_proj", "mlp.up_proj"),
    "feed_forward.w2": ("mlp.down_proj",),
    "ffn_norm": ("post_attention_layernorm",),
}


def eagle3_feature_layers(n_layers: int) -> tuple[int, int, int]:
    """Decoder layers whose outputs EAGLE-3 fuses: upstream captures the *inputs* of layers
    2, L // 2 and L - 3, i.e. the outputs of layers 1, L // 2 - 1 and L - 4 (first, middle
    and last layer for tiny test models where those collide)."""
    layers = (1, n_layers // 2 - 1, n_layers - 4)
    if not 0 <= layers[0] < layers[1] < layers[2]:
        layers = (0, (n_layers - 1) // 2, n_layers - 1)
    return layers


class EagleHead(nn.Module):
    """An EAGLE-1/2/3 draft head over `target` (see the module docstring); args: the target's
    ModelArgs with n_layers = 1 (the head's own decoder layer)."""

    def __init__(
        self,
        args: ModelArgs,
        target: Transformer,
        version: int = 2,
        draft_vocab_size: int | None = None,
        fc_bias: bool = False,
        feature_layers: tuple[int, ...] | None = None,
    ):
        super().__init__()
        if version not in (1, 2, 3):
            raise ValueError(f"EAGLE version must be 1, 2 or 3, got {version}")
        self.args, self.version = args, version
        self._target = (target,)  # shared embedding / lm_head; a tuple keeps it out of state_dict
        dim = args.dim
        self.layer = TransformerBlock(args)
        if version < 3:
            self.fc = nn.Linear(2 * dim, dim, bias=fc_bias)
            self.layer.attention_norm = nn.Identity()
            self.feature_layers = ()
        else:
            self.fc = nn.Linear(3 * dim, dim, bias=fc_bias)
            self.layer.attention = Attention(args, in_dim=2 * dim)  # reads [embedding; feature]
            self.layer.attention_norm = RMSNorm(dim, args.norm_eps)  # official input_layernorm
            self.hidden_norm = RMSNorm(dim, args.norm_eps)
            self.norm = RMSNorm(dim, args.norm_eps)
            self.lm_head = nn.Linear(dim, draft_vocab_size or args.vocab_size, bias=False)
            self.feature_layers = tuple(
                feature_layers or eagle3_feature_layers(target.args.n_layers)
            )
        # Draft vocabulary: draft id i is target id i + d2t[i] (EAGLE-3's convention). An
        # EAGLE-1/2 head drafts through the rows of the target's lm_head it selects
        # (draft_lm_weight, a copy kept next to the head so it follows .to()).
        self.draft_vocab_size = draft_vocab_size or args.vocab_size
        reduced = version == 3 or self.draft_vocab_size < args.vocab_size
        self.register_buffer(
            "d2t", torch.zeros(self.draft_vocab_size, dtype=torch.long) if reduced else None
        )
        self.register_buffer("draft_lm_weight", None, persistent=False)
        # its prepacked copy, used when the head's linears are prepacked (decode_path): the
        # largest product of a draft level, ~1.5x faster prepacked at 1-48 rows
        self._draft_lm_pack = WeightPack()
        self.register_buffer("inv_freq", inv_freq(args), persistent=False)
        self.scale = args.head_dim**-0.5
        check_head_matches(self, target)

    @property
    def target(self) -> Transformer:
        return self._target[0]

    # ------------------------------------------------------------------ construction
    @classmethod
    def random(
        cls,
        target: Transformer,
        version: int = 2,
        seed: int = 0,
        draft_vocab_size: int | None = None,
    ) -> "EagleHead":
        """A freshly initialised head (transformers' init: N(0, 0.02) weights, unit norms),
        same dtype / device as the target; acceptance will be near zero."""
        args = replace(target.args, n_layers=1)
        gen = torch.Generator().manual_seed(seed)
        head = cls(args, target, version, draft_vocab_size)
        with torch.no_grad():
            for name, p in head.named_parameters():
                if "norm" not in name:
                    p.copy_(
                        torch.randn(p.shape, generator=gen) * 0.02
                        if p.dim() > 1
                        else torch.zeros(p.shape)
                    )
            if head.draft_vocab_size < args.vocab_size:
                ids = (
                    torch.randperm(args.vocab_size, generator=gen)[: head.draft_vocab_size]
                    .sort()
                    .values
                )
                head.d2t.copy_(ids - torch.arange(head.draft_vocab_size))
        head.refresh_draft_vocab()
        w = target.tok_embeddings.weight
        return head.to(dtype=w.dtype, device=w.device)

    def set_draft_vocab(self, target_ids: Tensor) -> "EagleHead":
        """Restricts drafting to target_ids: long [N] (distinct ids; sorted here) -> self. For an
        EAGLE-1/2 head (the lm_head is the target's) this needs no retraining."""
        ids = torch.unique(target_ids.long().cpu())
        if self.version == 3:
            raise ValueError("an EAGLE-3 head's draft vocabulary is fixed by its trained lm_head")
        if ids.numel() and (ids[0] < 0 or ids[-1] >= self.args.vocab_size):
            raise ValueError(f"draft vocabulary ids must be in [0, {self.args.vocab_size})")
        self.draft_vocab_size = ids.numel()
        reduced = self.draft_vocab_size < self.args.vocab_size
        self.d2t = (ids - torch.arange(ids.numel())).to(self.fc.weight.device) if reduced else None
        return self.refresh_draft_vocab()

    def refresh_draft_vocab(self) -> "EagleHead":
        """Re-derives draft_lm_weight from d2t (after d2t was loaded or set) -> self."""
        if self.version < 3:
            w = self.target.output.weight.detach()
            self.draft_lm_weight = (
                None
                if self.d2t is None
                else w[
                    self.draft_to_target(torch.arange(self.draft_vocab_size, device=w.device))
                ].clone()
            )
        return self

    def new_cache(self, num_slots: int, max_seq_len: int, block_size: int = 16) -> PagedKVCache:
        w = self.fc.weight
        return PagedKVCache(
            1,
            self.args.n_kv_heads,
            self.args.head_dim,
            num_slots,
            max_seq_len,
            block_size,
            w.dtype,
            w.device,
        )

    # ------------------------------------------------------------------ compute
    def select_features(self, hidden: Tensor | list[Tensor], aux: Tensor | list[Tensor]):
        """The target features this head reads: final-norm hidden (EAGLE-1/2) or the fused
        layer outputs (EAGLE-3); works on [.., dim] tensors and per-request lists alike."""
        return aux if self.version == 3 else hidden

    def forward(
        self,
        tokens: Tensor,
        features: Tensor,
        cache: PagedKVCache,
        slots: Tensor,
        cache_lens: Tensor,
        start: int,
        num_nodes: Tensor,
        tree_mask: Tensor,
        positions: Tensor,
    ) -> Tensor:
        """Run the head on M new nodes of a tree over its cache.

        tokens: long [B, M] (target ids); features: [B, M, F] (target features, or the head's
        own hidden [B, M, dim] at the parent); slots: int [B]; the new rows are tree nodes
        start..start+M-1 of a tree of T nodes (tree_mask: int64 [B, T, ceil(T / 64)]) whose
        node i sits at logical position cache_lens[b] + i (cache_lens: int32 [B]; earlier nodes
        are already cached); num_nodes: int32 [B] (rows at or past it are padding: not written,
        attention output zero); positions: int [B, M], the RoPE positions.
        Returns hidden: [B, M, dim] (the predicted feature of the next position; zeros at
        padding when the rows are packed, unspecified otherwise).

        Whole trees of different sizes (start 0, M = T, some num_nodes < M: the engine's
        catch-up over prompts and accepted paths of different lengths) are packed as
        Transformer.forward packs them: the per-token work runs on the real rows only (64
        MT-bench prompts pad 7 045 tokens to 25 728)."""
        B, M = tokens.shape
        meta = AttentionMetadata.verify(cache, slots, cache_lens, num_nodes, tree_mask, start, M)
        picked = meta.picked
        packed = (
            start == 0 and M == tree_mask.shape[1] and picked is not None and picked.numel() < B * M
        )
        if packed:
            assert picked is not None
            meta.packed = True
            tokens = tokens.flatten()[picked][None]  # [1, N]
            features = features.flatten(0, 1)[picked][None]  # [1, N, F]
            positions = positions.flatten()[picked][None]
        emb = self.target.tok_embeddings(tokens)
        cos, sin = self._rope(positions)
        if self.version < 3:
            x = self.fc(torch.cat((emb, features), dim=-1))
            out = self.layer(x, cos, sin, meta)  # attention_norm is the identity
        else:
            x = self.fc(features) if features.shape[-1] != self.args.dim else features
            attn_in = torch.cat((self.layer.attention_norm(emb), self.hidden_norm(x)), dim=-1)
            out = self.layer(x, cos, sin, meta, attn_in=attn_in)
        if not packed:
            return out
        assert picked is not None
        return unpack_rows(out, picked, B, M)

    def draft_logits(self, hidden: Tensor) -> Tensor:
        """hidden: [..., dim] -> float32 logits [..., Vd] over the draft vocabulary (what
        drafting ranks; draft_to_target maps its ids). Vd = V without a draft vocabulary."""
        if self.version == 3:
            return self.lm_head(self.norm(hidden)).float()
        if self.draft_lm_weight is None:
            return self.target.lm_head(hidden).float()
        if isinstance(self.fc, PackedLinear):  # the head's linears run prepacked: this too
            logits = self._draft_lm_pack.product(self.draft_lm_weight, hidden)
            if logits is not None:
                return logits.float()
        return F.linear(hidden, self.draft_lm_weight).float()

    def draft_to_target(self, draft_ids: Tensor) -> Tensor:
        """Draft-vocabulary ids (long, any shape) -> target ids."""
        return draft_ids if self.d2t is None else draft_ids + self.d2t[draft_ids]

    def scatter_to_target(self, draft_values: Tensor, fill: float) -> Tensor:
        """draft_values: [..., Vd] over draft ids -> [..., V] over target ids, `fill` elsewhere."""
        if self.d2t is None or (
            self.draft_vocab_size == self.args.vocab_size and not self.d2t.any()
        ):
            return draft_values
        out = draft_values.new_full((*draft_values.shape[:-1], self.args.vocab_size), fill)
        ids = self.draft_to_target(torch.arange(self.draft_vocab_size, device=draft_values.device))
        return out.index_copy_(-1, ids, draft_values)

    def logits(self, hidden: Tensor) -> Tensor:
        """hidden: [..., dim] -> float32 logits [..., V] over *target* ids (tokens outside
        the draft vocabulary get -inf, so they are never drafted)."""
        return self.scatter_to_target(self.draft_logits(hidden), float("-inf"))

    def _rope(self, positions: Tensor) -> tuple[Tensor, Tensor]:
        """positions: int [B, M] -> cos, sin: [B, M, 1, D] in the head's dtype."""
        return rope_cos_sin(self.inv_freq, positions, self.fc.weight.dtype)

    # ------------------------------------------------------------------ checkpoints
    def official_state_dict(self) -> dict[str, Tensor]:
        """Weights under the official EAGLE names (unfused q/k/v and gate/up)."""
        prefix = "midlayer." if self.version == 3 else "layers.0."
        sd = {"fc.weight": self.fc.weight}
        if self.fc.bias is not None:
            sd["fc.bias"] = self.fc.bias
        for ours, theirs in _LAYER_KEYS.items():
            mod = self.layer.get_submodule(ours)
            sizes = (
                self.layer.attention.qkv_sizes
                if ours == "attention.wqkv"
                else [mod.weight.shape[0] // len(theirs)] * len(theirs)
            )
            for name, w in zip(theirs, mod.weight.split(sizes)):
                sd[f"{prefix}{name}.weight"] = w
            if getattr(mod, "bias", None) is not None:
                for name, b in zip(theirs, mod.bias.split(sizes)):
                    sd[f"{prefix}{name}.bias"] = b
        if self.version < 3 and self.d2t is not None:
            sd["d2t"] = self.d2t  # our extension: drafting over these target rows only
        if self.version == 3:
            sd.update(
                {
                    "midlayer.input_layernorm.weight": self.layer.attention_norm.weight,
                    "midlayer.hidden_norm.weight": self.hidden_norm.weight,
                    "norm.weight": self.norm.weight,
                    "lm_head.weight": self.lm_head.weight,
                    "d2t": self.d2t,
                    "t2d": self._t2d(),
                }
            )
        return {k: v.detach().contiguous().cpu() for k, v in sd.items()}

    def _t2d(self) -> Tensor:
        t2d = torch.zeros(self.args.vocab_size, dtype=torch.bool)
        t2d[torch.arange(self.draft_vocab_size) + self.d2t.cpu()] = True
        return t2d

    def hf_config(self) -> dict:
        a = self.args
        cfg = {
            "architectures": [
                "LlamaForCausalLMEagle3" if self.version == 3 else "LlamaForCausalLM"
            ],
            "model_type": "llama",
            "hidden_size": a.dim,
            "num_attention_heads": a.n_heads,
            "num_key_value_heads": a.n_kv_heads,
            "head_dim": a.head_dim,
            "intermediate_size": a.hidden_dim,
            "num_hidden_layers": 1,
            "rms_norm_eps": a.norm_eps,
            "rope_theta": a.rope_theta,
            "vocab_size": a.vocab_size,
            "max_position_embeddings": a.max_position_embeddings,
            "hidden_act": "silu",
            "eagle_version": self.version,
        }
        if a.rope_scaling:
            cfg["rope_scaling"] = a.rope_scaling
        if self.d2t is not None:
            cfg["draft_vocab_size"] = self.draft_vocab_size
        if self.version == 3:
            cfg["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": list(self.feature_layers)}
        return cfg

    def save(self, path: str) -> None:
        """Our own format: config.json + model.safetensors with the official key names."""
        os.makedirs(path, exist_ok=True)
        with open(os.path.join(path, "config.json"), "w") as f:
            json.dump(self.hf_config(), f, indent=2)
        save_file(self.official_state_dict(), os.path.join(path, "model.safetensors"))


def check_head_matches(head: EagleHead, target: Transformer) -> None:
    t, h = target.args, head.args
    if h.dim != t.dim:
        raise HeadMismatchError(
            f"EAGLE head hidden size {h.dim} does not match the target's {t.dim}"
        )
    if h.vocab_size != t.vocab_size:
        raise HeadMismatchError(
            f"EAGLE head vocabulary {h.vocab_size} does not match the target's {t.vocab_size}"
        )
    layers = list(head.feature_layers)
    if layers and not (
        layers == sorted(set(layers)) and 0 <= layers[0] and layers[-1] < t.n_layers
    ):
        raise HeadMismatchError(
            f"EAGLE-3 feature layers {layers} are not distinct increasing layers "
            f"of a {t.n_layers}-layer target"
        )


# ---------------------------------------------------------------------- loading
def load_head(path: str, target: Transformer) -> EagleHead:
    """An EAGLE head directory: config.json plus model.safetensors / *.safetensors /
    pytorch_model.bin, in the official EAGLE(-3) layout or ours (same names)."""
    cfg_path = os.path.join(path, "config.json")
    if not os.path.isfile(cfg_path):
        raise ModelLoadError(
            f"EAGLE head {path!r}: no config.json (expected an EAGLE head directory)"
        )
    try:
        with open(cfg_path, encoding="utf-8") as f:
            cfg = json.load(f)
    except (OSError, ValueError) as e:  # ValueError: bad JSON or bad UTF-8
        raise ModelLoadError(f"EAGLE head {path!r}: cannot read config.json: {e}") from None
    if not isinstance(cfg, dict):
        raise ModelLoadError(f"EAGLE head {path!r}: config.json must hold a JSON object")
    sd = _read_weights(path)
    try:
        return _build_head(path, cfg, sd, target)
    except SpecdecError:
        raise
    except (
        TypeError,
        ValueError,
        AttributeError,
        IndexError,
    ) as e:  # config values of the wrong type
        raise ModelLoadError(
            f"EAGLE head {path!r}: invalid config.json or weights: {type(e).__name__}: {e}"
        ) from None


def _build_head(path: str, cfg: dict, sd: dict, target) -> EagleHead:
    version = 3 if any(k.startswith("midlayer.") for k in sd) else 2
    try:
        args = ModelArgs.from_hf_config(
            {**cfg, "model_type": cfg.get("model_type", "llama"), "num_hidden_layers": 1}
        )
    except KeyError as e:
        raise ModelLoadError(f"EAGLE head {path!r}: config.json lacks {e}") from None
    prefix = "midlayer." if version == 3 else "layers.0."
    args = replace(args, attention_bias=f"{prefix}self_attn.q_proj.bias" in sd)
    feature_layers = (cfg.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    # EAGLE-3: the trained lm_head's rows; EAGLE-1/2 (ours): a d2t selecting target rows
    draft_vocab = (
        sd["lm_head.weight"].shape[0]
        if version == 3 and "lm_head.weight" in sd
        else sd["d2t"].shape[0]
        if version < 3 and "d2t" in sd
        else None
    )
    _check_fc(sd, args, version, target)
    head = EagleHead(
        args,
        target,
        version,
        draft_vocab,
        fc_bias="fc.bias" in sd,
        feature_layers=tuple(feature_layers) if feature_layers else None,
    )
    _load_official(head, sd, prefix, path)
    w = target.tok_embeddings.weight
    return head.to(dtype=w.dtype, device=w.device).eval()


def _read_weights(path: str) -> dict[str, Tensor]:
    try:
        return _read_weight_files(path)
    except ModelLoadError:
        raise
    except (
        Exception
    ) as e:  # SafetensorError, unpickling errors, OSError: corrupt or truncated files
        raise ModelLoadError(
            f"EAGLE head {path!r}: cannot read its weights: {type(e).__name__}: {e}"
        ) from None


def _read_weight_files(path: str) -> dict[str, Tensor]:
    files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
    if files:
        sd = {}
        for f in files:
            sd.update(load_file(os.path.join(path, f)))
        return sd
    bin_path = os.path.join(path, "pytorch_model.bin")
    if os.path.isfile(bin_path):
        return torch.load(bin_path, map_location="cpu", weights_only=True)
    raise ModelLoadError(
        f"EAGLE head {path!r}: no *.safetensors or pytorch_model.bin next to config.json"
    )


def _check_fc(sd, args, version, target):
    if "fc.weight" not in sd:
        raise ModelLoadError("EAGLE head checkpoint has no fc.weight")
    want = (3 if version == 3 else 2) * target.args.dim
    got = tuple(sd["fc.weight"].shape)
    if got != (target.args.dim, want):
        raise HeadMismatchError(
            f"EAGLE-{version} head fc.weight is {list(got)}, expected [{target.args.dim}, {want}] "
            f"for a target of hidden size {target.args.dim}"
        )


def _load_official(head: EagleHead, sd: dict, prefix: str, path: str):
    ours = {"fc.weight": sd["fc.weight"]}
    if "fc.bias" in sd:
        ours["fc.bias"] = sd["fc.bias"]
    try:
        for name, theirs in _LAYER_KEYS.items():
            for kind in ("weight", "bias"):
                parts = [sd.get(f"{prefix}{t}.{kind}") for t in theirs]
                if all(p is not None for p in parts):
                    ours[f"layer.{name}.{kind}"] = torch.cat(parts)
        if head.version == 3:
            ours.update(
                {
                    "layer.attention_norm.weight": sd["midlayer.input_layernorm.weight"],
                    "hidden_norm.weight": sd["midlayer.hidden_norm.weight"],
                    "norm.weight": sd["norm.weight"],
                    "lm_head.weight": sd["lm_head.weight"],
                    "d2t": sd.get("d2t", torch.zeros(head.draft_vocab_size, dtype=torch.long)),
                }
            )
        elif head.d2t is not None:
            ours["d2t"] = sd["d2t"]
    except KeyError as e:
        raise ModelLoadError(f"EAGLE head {path!r}: missing weight {e}") from None
    expected = {k: v.shape for k, v in head.state_dict().items()}
    missing = sorted(set(expected) - set(ours))
    if missing:
        raise ModelLoadError(f"EAGLE head {path!r}: missing weights {missing}")
    for k, v in ours.items():
        if tuple(v.shape) != tuple(expected[k]):
            raise HeadMismatchError(
                f"EAGLE head {path!r}: {k} has shape {list(v.shape)}, expected {list(expected[k])}"
            )
    head.load_state_dict(ours)
    d2t = (
        head.draft_to_target(torch.arange(head.draft_vocab_size)) if head.d2t is not None else None
    )
    if d2t is not None and not (d2t.min() >= 0 and d2t.max() < head.args.vocab_size):
        raise HeadMismatchError(
            f"EAGLE head {path!r}: d2t maps draft ids outside the target vocabulary"
        )
    head.refresh_draft_vocab()
