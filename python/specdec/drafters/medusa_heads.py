"""Medusa-1 decoding heads (Cai et al. 2024) over a target model, and their checkpoint loader.

Head k (k = 1..K) reads the target's final-norm hidden state h at position t and predicts
the token at t + 1 + k (the target's own lm_head predicts t + 1: the step's root). Each head
is n residual blocks, x <- x + SiLU(W x + b) starting from x = h, followed by the target's
frozen lm_head, shared by all heads (Medusa-1 trains a vocabulary projection per head; sharing
the target's keeps a head at dim^2 + dim parameters per block and needs no vocabulary-sized
training). With a draft vocabulary (`d2t`, as EagleHead.set_draft_vocab) the heads rank only
its N most frequent tokens, so each head's lm_head costs N / V of the full one.

Checkpoint (our format): config.json {"medusa_num_heads", "medusa_num_layers", "hidden_size",
"vocab_size", "draft_vocab_size"?, "head_accuracy"?} + model.safetensors with
"heads.{k}.{l}.linear.weight" / ".bias" (k, l from 0) and "d2t" with a draft vocabulary.
"""

import json
import os

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import Tensor, nn

from specdec.errors import HeadMismatchError, ModelLoadError, SpecdecError
from specdec.models.llama import Transformer


class MedusaHeads(nn.Module):
    """K Medusa heads of n residual blocks each over `target` (see the module docstring).

    Parameters are stacked over heads so that one batched matmul runs all of them:
    weight [K, n, dim, dim] (out, in), bias [K, n, dim]."""

    def __init__(
        self,
        target: Transformer,
        num_heads: int = 4,
        num_layers: int = 1,
        draft_vocab_size: int | None = None,
        head_accuracy: list | None = None,
    ):
        super().__init__()
        if num_heads < 1 or num_layers < 1:
            raise ValueError(f"Medusa needs >= 1 head and layer, got {num_heads}, {num_layers}")
        self._target = (target,)  # shared lm_head; a tuple keeps it out of state_dict
        self.dim, self.vocab_size = target.args.dim, target.args.vocab_size
        self.num_heads, self.num_layers = num_heads, num_layers
        self.weight = nn.Parameter(torch.zeros(num_heads, num_layers, self.dim, self.dim))
        self.bias = nn.Parameter(torch.zeros(num_heads, num_layers, self.dim))
        # head_accuracy[k][j]: measured P(head k+1's rank-j candidate is the true token)
        # (held-out, teacher-forced); the drafter's prior for its sparse tree
        self.head_accuracy = head_accuracy
        self.draft_vocab_size = draft_vocab_size or self.vocab_size
        reduced = self.draft_vocab_size < self.vocab_size
        self.register_buffer(
            "d2t", torch.zeros(self.draft_vocab_size, dtype=torch.long) if reduced else None
        )
        self.register_buffer("draft_lm_weight", None, persistent=False)

    @property
    def target(self) -> Transformer:
        return self._target[0]

    # ------------------------------------------------------------------ construction
    @classmethod
    def random(
        cls,
        target: Transformer,
        num_heads: int = 4,
        num_layers: int = 1,
        seed: int = 0,
        scale: float = 0.02,
    ) -> "MedusaHeads":
        """Heads with N(0, scale) weights and zero biases (for tests; scale 0 is Medusa's
        training init: each head starts as the identity, i.e. predicts the root's token)."""
        heads = cls(target, num_heads, num_layers)
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            heads.weight.copy_(torch.randn(heads.weight.shape, generator=gen) * scale)
        heads.refresh_draft_vocab()
        w = target.tok_embeddings.weight
        return heads.to(dtype=w.dtype, device=w.device)

    def set_draft_vocab(self, target_ids: Tensor) -> "MedusaHeads":
        """Restricts drafting to target_ids: long [N] (distinct; sorted here) -> self. The
        lm_head is the target's, so this needs no retraining."""
        ids = torch.unique(target_ids.long().cpu())
        if ids.numel() == 0 or ids[0] < 0 or ids[-1] >= self.vocab_size:
            raise ValueError(f"draft vocabulary ids must be in [0, {self.vocab_size}), non-empty")
        self.draft_vocab_size = ids.numel()
        reduced = self.draft_vocab_size < self.vocab_size
        self.d2t = (ids - torch.arange(ids.numel())).to(self.weight.device) if reduced else None
        return self.refresh_draft_vocab()

    def refresh_draft_vocab(self) -> "MedusaHeads":
        """Re-derives draft_lm_weight (the target lm_head rows of the draft vocabulary) -> self."""
        w = self.target.output.weight.detach()
        self.draft_lm_weight = (
            None
            if self.d2t is None
            else w[self.draft_to_target(torch.arange(self.draft_vocab_size, device=w.device))]
            .to(self.weight.dtype)
            .clone()
        )
        return self

    # ------------------------------------------------------------------ compute
    def forward(self, hidden: Tensor) -> Tensor:
        """hidden: [..., dim] (target final-norm hidden) -> [..., K, dim], head k's input to
        the lm_head."""
        x = hidden.to(self.weight.dtype)[..., None, :].expand(
            *hidden.shape[:-1], self.num_heads, -1
        )
        for layer in range(self.num_layers):
            y = torch.einsum("...kd,ked->...ke", x, self.weight[:, layer]) + self.bias[:, layer]
            x = x + F.silu(y)
        return x

    def draft_logits(self, hidden: Tensor) -> Tensor:
        """hidden: [..., dim] -> float32 logits [..., K, Vd] over the draft vocabulary
        (draft_to_target maps its ids; Vd = V without a draft vocabulary)."""
        x = self(hidden)
        if self.draft_lm_weight is None:
            return self.target.lm_head(x.to(self.target.output.weight.dtype)).float()
        return F.linear(x, self.draft_lm_weight.to(x.dtype)).float()

    def draft_to_target(self, draft_ids: Tensor) -> Tensor:
        """Draft-vocabulary ids (long, any shape) -> target ids."""
        return draft_ids if self.d2t is None else draft_ids + self.d2t[draft_ids]

    def logits(self, hidden: Tensor) -> Tensor:
        """hidden: [..., dim] -> float32 logits [..., K, V] over target ids (-inf outside the
        draft vocabulary)."""
        d = self.draft_logits(hidden)
        if self.d2t is None:
            return d
        out = d.new_full((*d.shape[:-1], self.vocab_size), float("-inf"))
        ids = self.draft_to_target(torch.arange(self.draft_vocab_size, device=d.device))
        return out.index_copy_(-1, ids, d)

    # ------------------------------------------------------------------ checkpoints
    def config(self) -> dict:
        cfg = {
            "architectures": ["MedusaHeads"],
            "medusa_num_heads": self.num_heads,
            "medusa_num_layers": self.num_layers,
            "hidden_size": self.dim,
            "vocab_size": self.vocab_size,
            "lm_head": "shared with the target (frozen)",
        }
        if self.d2t is not None:
            cfg["draft_vocab_size"] = self.draft_vocab_size
        if self.head_accuracy is not None:
            cfg["head_accuracy"] = self.head_accuracy
        return cfg

    def save(self, path: str, dtype: torch.dtype | None = None) -> None:
        """config.json + model.safetensors (weights in dtype, default the heads' own)."""
        os.makedirs(path, exist_ok=True)
        with open(os.path.join(path, "config.json"), "w") as f:
            json.dump(self.config(), f, indent=2)
        sd = {}
        for k in range(self.num_heads):
            for layer in range(self.num_layers):
                sd[f"heads.{k}.{layer}.linear.weight"] = self.weight[k, layer]
                sd[f"heads.{k}.{layer}.linear.bias"] = self.bias[k, layer]
        sd = {k: v.detach().to(dtype or v.dtype).contiguous().cpu() for k, v in sd.items()}
        if self.d2t is not None:
            sd["d2t"] = self.d2t.cpu().contiguous()
        save_file(sd, os.path.join(path, "model.safetensors"))


def load_medusa(path: str, target: Transformer) -> MedusaHeads:
    """A Medusa heads directory (MedusaHeads.save) for `target`: ModelLoadError when it cannot
    be read, HeadMismatchError when it was trained for another hidden size or vocabulary."""
    cfg_path = os.path.join(path, "config.json")
    if not os.path.isfile(cfg_path):
        raise ModelLoadError(f"Medusa heads {path!r}: no config.json (expected a heads directory)")
    try:
        with open(cfg_path, encoding="utf-8") as f:
            cfg = json.load(f)
        sd = load_file(os.path.join(path, "model.safetensors"))
    except SpecdecError:
        raise
    except Exception as e:  # OSError, bad JSON, SafetensorError: unreadable or truncated
        raise ModelLoadError(
            f"Medusa heads {path!r}: cannot read: {type(e).__name__}: {e}"
        ) from None
    try:
        return _build(path, cfg, sd, target)
    except SpecdecError:
        raise
    except (TypeError, ValueError, KeyError, AttributeError, IndexError) as e:
        raise ModelLoadError(
            f"Medusa heads {path!r}: invalid config.json or weights: {type(e).__name__}: {e}"
        ) from None


def _build(path: str, cfg: dict, sd: dict, target: Transformer) -> MedusaHeads:
    if not isinstance(cfg, dict) or "medusa_num_heads" not in cfg:
        raise ModelLoadError(f"Medusa heads {path!r}: config.json lacks medusa_num_heads")
    t = target.args
    if cfg.get("hidden_size") != t.dim:
        raise HeadMismatchError(
            f"Medusa heads {path!r} have hidden size {cfg.get('hidden_size')}, the target {t.dim}"
        )
    if cfg.get("vocab_size") != t.vocab_size:
        raise HeadMismatchError(
            f"Medusa heads {path!r} have vocabulary {cfg.get('vocab_size')}, "
            f"the target {t.vocab_size}"
        )
    K, n = int(cfg["medusa_num_heads"]), int(cfg.get("medusa_num_layers", 1))
    heads = MedusaHeads(target, K, n, cfg.get("draft_vocab_size"), cfg.get("head_accuracy"))
    weight = torch.empty(K, n, t.dim, t.dim)
    bias = torch.empty(K, n, t.dim)
    for k in range(K):
        for layer in range(n):
            key = f"heads.{k}.{layer}.linear"
            w, b = sd[f"{key}.weight"], sd[f"{key}.bias"]
            if tuple(w.shape) != (t.dim, t.dim) or tuple(b.shape) != (t.dim,):
                raise HeadMismatchError(
                    f"Medusa heads {path!r}: {key} is {list(w.shape)}, expected "
                    f"[{t.dim}, {t.dim}] for a target of hidden size {t.dim}"
                )
            weight[k, layer], bias[k, layer] = w.float(), b.float()
    with torch.no_grad():
        heads.weight.copy_(weight)
        heads.bias.copy_(bias)
    if heads.d2t is not None:
        d2t = sd["d2t"].long()
        ids = d2t + torch.arange(len(d2t))
        if d2t.shape != heads.d2t.shape or ids.min() < 0 or ids.max() >= t.vocab_size:
            raise HeadMismatchError(
                f"Medusa heads {path!r}: d2t maps draft ids outside the target vocabulary"
            )
        heads.d2t = d2t
    w = target.tok_embeddings.weight
    return heads.to(dtype=w.dtype, device=w.device).refresh_draft_vocab().eval()
