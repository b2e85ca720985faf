"""Speculative decoding of a Hugging Face transformers causal LM with specdec's engine.

    from transformers import AutoModelForCausalLM
    from specdec.integrations.transformers import generate

    hf_model = AutoModelForCausalLM.from_pretrained("HuggingFaceTB/SmolLM2-135M-Instruct")
    ids, stats = generate(hf_model, input_ids, max_new_tokens=64)  # input_ids: [B, S]
    # ids: [B, S + n] as hf_model.generate returns them; stats: acceptance, tokens/s, ...

The model's own HF modules run (embeddings, decoder layers, RoPE, norms, lm_head); only the
attention kernel is specdec's: `HFTarget` registers a function named "specdec_tree" through
transformers' AttentionInterface, switches the model to it for the duration of a call, and
passes the step's AttentionMetadata down through the forward's **kwargs (transformers hands
those to the attention function). There each layer (module.layer_idx) writes its K/V into a
specdec PagedKVCache and attends with causal SDPA (prompt prefill) or
torch.ops.specdec.tree_verify (draft-tree verification; a plain step is the one-node tree).

HFTarget offers what the engine and the drafters need from a target (model.Transformer's
interface: args, new_cache, prefill, forward -> final-norm hidden and feature-layer
outputs, tok_embeddings, lm_head), so `generate` is specdec.runtime.engine.Engine over it: EAGLE
drafting, tree_rejection_sample and compact_kv are the engine's own code, and greedy float32
output equals `hf_model.generate`'s.

Supported: Llama, Mistral (within its sliding window), Qwen2 and SmolLM checkpoints (the
families specdec.models.config.ModelArgs reads); tested with transformers 5.24.0. Prompts are
given unpadded (a [B, S] tensor of equal-length prompts, or a list of token-id lists).
"""

import copy
from collections.abc import Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor, nn

from specdec.errors import InvalidRequestError, ModelLoadError
from specdec.models.cache import PagedKVCache
from specdec.models.config import ModelArgs
from specdec.models.llama import Attention, AttentionMetadata, PrefillOut, VerifyOut
from specdec.speculation.trees import TreeSpec

ATTENTION_NAME = "specdec_tree"  # the name registered in transformers' AttentionInterface
SHIPPED = "auto"  # generate(head=...): the shipped EAGLE head when it fits the model


class _LayerAttention(Attention):
    """model.Attention's cache write + SDPA / tree_verify (attend) for one HF layer, without
    its projections (the HF module did those): holds only the shapes and scale."""

    def __init__(self, layer_idx: int, args: ModelArgs):
        nn.Module.__init__(self)  # no weights: Attention.__init__ would allocate wqkv / wo
        self.layer_idx = layer_idx
        self.n_heads, self.n_kv_heads, self.head_dim = args.n_heads, args.n_kv_heads, args.head_dim
        self.scale = args.head_dim**-0.5


def tree_attention(
    module: nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[Tensor, None]:
    """transformers' attention-function signature: query: [B, Hq, T, D]; key, value:
    [B, Hkv, T, D] (rotated, this forward's tokens only) -> ([B, T, Hq, D], None).

    kwargs carry specdec_meta (the step's AttentionMetadata: cache rows, tree mask) and
    specdec_layers (a _LayerAttention per layer); the HF mask is unused (None: the mask is
    the tree's). Without specdec_meta (the model called outside HFTarget while switched to
    this implementation) it is transformers' SDPA attention."""
    meta = kwargs.get("specdec_meta")
    if meta is None:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    # kwargs["sliding_window"] (Mistral) is moot: ModelArgs caps the context at the window,
    # within which attention is full (Qwen2's sliding layers are rejected by ModelArgs)
    attn = kwargs["specdec_layers"][module.layer_idx]
    if scaling is not None:
        attn.scale = scaling
    out = attn.attend(query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2), meta)
    return out, None


def register() -> str:
    """Registers tree_attention in transformers' AttentionInterface -> its name."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION_NAME, tree_attention)
    return ATTENTION_NAME


class HFTarget(nn.Module):
    """A transformers causal LM (LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM) as a
    specdec target: the interface of specdec.models.llama.Transformer over the HF modules.

    forward / prefill run hf_model.model (the HF decoder) with position_ids = cache_len +
    tree depth and the "specdec_tree" attention, which writes K/V into a PagedKVCache;
    feature-layer outputs (EAGLE-3) are read with forward hooks on the decoder layers."""

    def __init__(self, hf_model: nn.Module):
        super().__init__()
        config = getattr(hf_model, "config", None)
        decoder = getattr(hf_model, "model", None)
        if config is None or decoder is None or not hasattr(decoder, "layers"):
            raise InvalidRequestError(
                f"hf_model must be a transformers causal LM (e.g. LlamaForCausalLM), got "
                f"{type(hf_model).__name__}"
            )
        try:
            self.args = ModelArgs.from_hf_config(config.to_dict())
        except ModelLoadError as e:
            raise InvalidRequestError(f"hf_model: {e}") from None
        self.hf = hf_model
        self.decoder = decoder
        self.tok_embeddings = hf_model.get_input_embeddings()
        self.output = hf_model.get_output_embeddings()
        self._attn = [_LayerAttention(i, self.args) for i in range(self.args.n_layers)]
        register()

    # ------------------------------------------------------------------ Transformer interface
    def new_cache(
        self,
        num_slots: int,
        max_seq_len: int,
        block_size: int = 16,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
        shuffle_blocks: bool = False,
    ) -> PagedKVCache:
        w = self.tok_embeddings.weight
        return PagedKVCache(
            self.args.n_layers,
            self.args.n_kv_heads,
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

    @contextmanager
    def attention(self):
        """The HF model runs specdec's attention inside (its previous one restored after)."""
        config = self.hf.config
        previous = config._attn_implementation
        if previous == ATTENTION_NAME:
            yield
            return
        self.hf.set_attn_implementation(ATTENTION_NAME)
        try:
            yield
        finally:
            self.hf.set_attn_implementation(previous)

    def _run(
        self, tokens: Tensor, positions: Tensor, meta: AttentionMetadata, feature_layers
    ) -> tuple[Tensor, list[Tensor]]:
        """tokens, positions: long [B, T] -> (final-norm hidden [B, T, dim], the outputs of
        feature_layers, [B, T, dim] each)."""
        feats: dict[int, Tensor] = {}
        hooks = [
            self.decoder.layers[i].register_forward_hook(
                lambda _m, _a, out, i=i: feats.__setitem__(
                    i, out[0] if isinstance(out, tuple) else out
                )
            )
            for i in feature_layers
        ]
        try:
            with self.attention():
                out = self.decoder(
                    input_ids=tokens,
                    position_ids=positions,
                    use_cache=False,
                    specdec_meta=meta,
                    specdec_layers=self._attn,
                )
        finally:
            for h in hooks:
                h.remove()
        return out.last_hidden_state, [feats[i] for i in feature_layers]

    @torch.no_grad()
    def prefill(
        self,
        tokens: Sequence[Tensor],
        cache: PagedKVCache,
        slots: Tensor,
        feature_layers: Sequence[int] = (),
    ) -> PrefillOut:
        """As model.Transformer.prefill: tokens: per request long [S_b]; slots: int [B]."""
        logits, hidden, aux = [], [], []
        for b, prompt in enumerate(tokens):
            slot = slots[b : b + 1]
            pos = torch.arange(len(prompt), device=prompt.device)[None]  # [1, S]
            meta = AttentionMetadata.prefill(cache, slot, pos)
            h, feats = self._run(prompt[None], pos, meta, feature_layers)
            cache.cache_lens[slot] = len(prompt)
            logits.append(self.lm_head(h[0, -1]).float())
            hidden.append(h[0])
            aux.append(torch.cat(feats, dim=-1)[0] if feats else h.new_empty(len(prompt), 0))
        return PrefillOut(torch.stack(logits), hidden, aux)

    @torch.no_grad()
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
        """As model.Transformer.forward: verifies draft trees tokens: long [B, T] (node i at
        cache position cache_lens + i, RoPE position cache_lens + depth[i]); trees of
        different sizes are packed into one [1, N] row of real nodes."""
        B, T = tokens.shape
        cache_lens = cache.cache_lens[slots]
        meta = AttentionMetadata.verify(cache, slots, cache_lens, num_nodes, tree_mask)
        positions = cache_lens[:, None].long() + depth.long()
        picked = meta.picked
        if picked is None or picked.numel() == B * T:  # full trees: nothing to skip
            h, feats = self._run(tokens, positions, meta, feature_layers)
            aux = torch.cat(feats, dim=-1) if feats else h.new_empty(B, T, 0)
            return VerifyOut(self.lm_head(h).float(), h, aux)
        meta.packed = True
        h, feats = self._run(
            tokens.flatten()[picked][None], positions.flatten()[picked][None], meta, feature_layers
        )

        def unpack(t: Tensor) -> Tensor:  # [1, N, C] -> [B, T, C], zeros at padding
            return t.new_zeros(B * T, t.shape[-1]).index_copy_(0, picked, t[0]).view(B, T, -1)

        aux = unpack(torch.cat(feats, dim=-1)) if feats else h.new_empty(B, T, 0)
        return VerifyOut(unpack(self.lm_head(h).float()), unpack(h), aux)


# ---------------------------------------------------------------------- generate
def _prompts(input_ids) -> tuple[list[list[int]], bool]:
    """input_ids: long [B, S] tensor or a list of token-id lists -> (prompts, given as a
    tensor)."""
    if isinstance(input_ids, Tensor):
        if input_ids.dim() == 1:
            input_ids = input_ids[None]
        if input_ids.dim() != 2 or input_ids.dtype.is_floating_point or input_ids.shape[1] == 0:
            raise InvalidRequestError(
                f"input_ids must be an integer tensor [B, S] with S >= 1, got "
                f"{input_ids.dtype} {list(input_ids.shape)}"
            )
        return input_ids.tolist(), True
    try:
        prompts = [list(p) for p in input_ids]
    except TypeError:
        raise InvalidRequestError(
            f"input_ids must be a [B, S] tensor or a list of token-id lists, got {input_ids!r:.80}"
        ) from None
    if not prompts:
        raise InvalidRequestError("input_ids holds no prompt")
    return prompts, False


def _eos_ids(hf_model, eos_token_id) -> list[int]:
    if eos_token_id is None:
        eos_token_id = getattr(getattr(hf_model, "generation_config", None), "eos_token_id", None)
    if eos_token_id is None:
        return []
    ids = [eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id)
    if not all(isinstance(i, int) for i in ids):
        raise InvalidRequestError(f"eos_token_id must be an int or ints, got {eos_token_id!r}")
    return ids


def shipped_head_for(target: HFTarget):
    """The shipped EAGLE head (trained for SmolLM2-135M-Instruct) when target has that
    model's shapes, else None."""
    from specdec.drafters.eagle_head import load_head
    from specdec.heads import shipped_head_path
    from specdec.models.loader import DEFAULT_MODEL_CONFIG

    path = shipped_head_path()
    a, d = target.args, ModelArgs.from_hf_config(DEFAULT_MODEL_CONFIG)
    shape = ("vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads")
    fits = all(getattr(a, f) == getattr(d, f) for f in shape)
    return load_head(path, target) if path and fits else None


def rebind_head(head, target: HFTarget):
    """An EagleHead built over another target object of the same weights (specdec's own
    model.Transformer, another HFTarget) -> a view of it that reads target's embeddings and
    lm_head (its weights shared, not copied). Drafts differ only if the weights do, and
    exactness never depends on the drafts."""
    from specdec.drafters.eagle_head import check_head_matches

    if head.target is target:
        return head
    check_head_matches(head, target)
    view = copy.copy(head)  # shares the parameters; only the target reference differs
    view._target = (target,)
    return view


def load_target_head(target: HFTarget, head):
    """head: "auto" (the shipped head when it fits, else None), None (plain decoding), a
    head directory (specdec.drafters.eagle_head.load_head), or an EagleHead (rebind_head) ->
    EagleHead or
    None."""
    from specdec.drafters.eagle_head import EagleHead, load_head

    if head is None:
        return None
    if isinstance(head, EagleHead):
        return rebind_head(head, target)
    if head == SHIPPED:
        return shipped_head_for(target)
    if isinstance(head, str):
        try:
            return load_head(head, target)
        except (OSError, ModelLoadError, ValueError) as e:
            raise InvalidRequestError(f"head {head!r}: {e}") from None
    raise InvalidRequestError(
        f"head must be 'auto', None, a head directory or an EagleHead, got {head!r:.80}"
    )


@torch.inference_mode()
def generate(
    hf_model,
    input_ids,
    head: Any = SHIPPED,
    max_new_tokens: int = 128,
    temperature: float = 0.0,
    top_p: float = 1.0,
    tree: TreeSpec | str = TreeSpec.DEFAULT,
    top_k: int = 0,
    seed: int | None = None,
    batch_size: int | None = None,
    eos_token_id: int | Sequence[int] | None = None,
    pad_token_id: int | None = None,
) -> tuple[Any, dict]:
    """Speculative decoding of hf_model (a transformers Llama / Mistral / Qwen2 / SmolLM
    causal LM) with specdec's engine -> (ids, stats).

    input_ids: long [B, S] (B prompts of equal length, no padding) -> ids: long [B, S + n],
    each row the prompt then its generated tokens, rows that ended early (EOS) padded with
    pad_token_id, as hf_model.generate returns them; or a list of token-id lists (any lengths)
    -> a list of (prompt + generated) lists. stats: specdec.runtime.stats.Stats.to_dict() (mean
    acceptance length, target forwards, tokens/s, time split).

    head: "auto" (default: the shipped EAGLE head for SmolLM2-135M-Instruct when hf_model has
    its shapes, else plain decoding), None (plain decoding, the same path with one-node
    trees), a head directory, or an EagleHead (e.g. built over specdec's own model of the
    same weights: it is rebound to hf_model's embeddings and lm_head). tree: the
    draft tree ("chain:4", "dynamic:6,10,60", "adaptive"; specdec.speculation.trees.TreeSpec).
    temperature 0 is greedy; top_k / top_p filter sampling (0 / 1: off); seed: request i uses
    seed + i (None: torch's global RNG). batch_size: requests decoded together (default: all);
    eos_token_id: default hf_model.generation_config's.
    Bad arguments raise specdec.errors.InvalidRequestError / InvalidTreeSpecError.
    """
    from specdec.runtime.engine import Engine
    from specdec.runtime.requests import Request, SamplingParams

    prompts, as_tensor = _prompts(input_ids)
    target = HFTarget(hf_model)
    drafter_head = load_target_head(target, head)
    eos = _eos_ids(hf_model, eos_token_id)
    if batch_size is None:
        batch_size = len(prompts)
    if seed is not None and not isinstance(seed, int):
        raise InvalidRequestError(f"seed must be an integer or None, got {seed!r}")
    longest = max((len(p) for p in prompts), default=0)
    new = max_new_tokens if isinstance(max_new_tokens, int) and max_new_tokens > 0 else 1
    engine = Engine(
        target,
        head=drafter_head,
        tree=tree,
        batch_size=batch_size,
        max_seq_len=min(longest + new + 1, target.args.max_position_embeddings),
        eos_token_ids=eos,
    )
    requests = [
        Request(
            p,
            SamplingParams(
                temperature=temperature,
                top_k=top_k,
                top_p=top_p,
                seed=None if seed is None else seed + i,
                max_new_tokens=max_new_tokens,
            ),
            id=f"input_ids[{i}]",
        )
        for i, p in enumerate(prompts)
    ]
    for r in requests:
        engine.validate(r)  # every request, before any work: one bad row is the caller's bug
    with target.attention():
        results, stats = engine.generate(requests)
    failed = [r.error for r in results if r.finish_reason == "error"]
    if failed:
        raise InvalidRequestError("; ".join(failed))
    outputs = [list(p) + r.token_ids for p, r in zip(prompts, results)]
    if not as_tensor:
        return outputs, stats.to_dict()
    if pad_token_id is None:
        pad_token_id = getattr(hf_model.generation_config, "pad_token_id", None)
    if pad_token_id is None:
        pad_token_id = eos[0] if eos else 0
    width = max(len(o) for o in outputs)
    ids = torch.full((len(outputs), width), pad_token_id, dtype=torch.long)
    for b, o in enumerate(outputs):
        ids[b, : len(o)] = torch.tensor(o, dtype=torch.long)
    return ids.to(input_ids.device), stats.to_dict()
