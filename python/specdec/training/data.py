"""Self-distillation data for the drafter heads (docs/training.md#data): the target answers
prompts itself (greedy by default), in batches, and the final-norm hidden state of every
position (the feature an EAGLE-1/2 head and Medusa heads read) is kept, with
`features eagle3` also the pre-norm outputs of EAGLE-3's three feature layers (aux). Each
batch of prompts becomes one append-only shard (safetensors: token ids int32, hidden / aux
bf16), so an interrupted run resumes at the first missing shard."""

import json
import math
import os
import time

import torch
from safetensors.torch import load_file, save_file

import specdec_kernels.ops as ops
from specdec import cpu
from specdec.errors import InvalidRequestError
from specdec.training.loop import progress_bar

MANIFEST = "manifest.json"


# ---------------------------------------------------------------------- self-distillation
def tokenize_prompts(tokenizer, prompts: list, max_prompt_tokens: int) -> list:
    """Chat-templated token ids of the prompts that fit in max_prompt_tokens (others dropped)."""
    out = []
    for p in prompts:
        ids = tokenizer.apply_chat_template([{"role": "user", "content": p}])
        if len(ids) <= max_prompt_tokens:
            out.append(ids)
    return out


def _pick(logits, temperature: float, generator):
    """logits [B, V] -> next tokens long [B] (argmax, or a sample at `temperature`)."""
    if temperature == 0:
        return logits.argmax(-1)
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    return torch.multinomial(probs, 1, generator=generator)[:, 0]


@torch.no_grad()
def generate_batch(
    model,
    prompts: list,
    max_new_tokens: int,
    eos_ids,
    temperature=0.0,
    generator=None,
    feature_layers=(),
):
    """Continues each prompt (list of ids) until EOS or max_new_tokens.

    Returns per prompt (tokens long [S], hidden [S, dim], aux [S, len(feature_layers) * dim]):
    prompt + answer ids, the target's final-norm hidden state at every position (the
    generated EOS included) and the pre-norm outputs of feature_layers there (EAGLE-3's
    features; [S, 0] without feature_layers)."""
    B = len(prompts)
    cache = model.new_cache(B, max(len(p) for p in prompts) + max_new_tokens + 1)
    slots = torch.arange(B, device=cache.k.device)
    out = model.prefill(
        [torch.tensor(p, device=slots.device) for p in prompts], cache, slots, feature_layers
    )
    tokens = [list(p) for p in prompts]
    hidden = [[h] for h in out.hidden]
    aux = [[a] for a in out.aux]
    eos = torch.tensor(sorted(eos_ids), dtype=torch.long, device=slots.device)
    active, nxt = slots, _pick(out.logits, temperature, generator)
    for i in range(max_new_tokens):
        n = len(active)
        tree_mask, depth = ops.build_tree_mask(
            torch.full((n, 1), -1, dtype=torch.int32, device=slots.device),
            torch.ones(n, dtype=torch.int32, device=slots.device),
        )
        o = model(
            nxt[:, None],
            cache,
            active,
            torch.ones(n, dtype=torch.int32, device=slots.device),
            tree_mask,
            depth,
            feature_layers,
        )
        cache.cache_lens[active] += 1
        for b, t, h, a in zip(active.tolist(), nxt.tolist(), o.hidden[:, 0], o.aux[:, 0]):
            tokens[b].append(t)
            hidden[b].append(h[None])
            aux[b].append(a[None])
        keep = ~torch.isin(nxt, eos)
        if i == max_new_tokens - 1 or not keep.any():
            break
        active, nxt = active[keep], _pick(o.logits[keep, 0], temperature, generator)
    return [(torch.tensor(t), torch.cat(h), torch.cat(a)) for t, h, a in zip(tokens, hidden, aux)]


def generate_shards(
    model,
    tokenizer,
    prompt_ids: list,
    data_dir: str,
    batch_size: int = 32,
    max_new_tokens: int = 128,
    temperature: float = 0.0,
    seed: int = 0,
    max_shards: int | None = None,
    progress: bool = True,
    feature_layers=(),
) -> list:
    """Self-distillation data: shard i holds prompts [i * batch_size, (i + 1) * batch_size)
    with the target's answers; existing shards are kept (resume). Returns the shard paths.

    Shard tensors: tokens int32 [N] (sequences concatenated), lengths int32 [n],
    prompt_lens int32 [n], hidden bf16 [N, dim], and with feature_layers (EAGLE-3 data) aux
    bf16 [N, len(feature_layers) * dim]: the pre-norm outputs of those target layers."""
    os.makedirs(data_dir, exist_ok=True)
    # the engine's CPU decode path (bf16: prepacked linears, C++ layer ops) for generation too
    cpu.configure(model)
    # everything that decides a shard's content (not the prompt count: the prompt list is
    # prefix-stable in --num-prompts, so a run can be extended with more shards)
    manifest = {
        "batch_size": batch_size,
        "max_new_tokens": max_new_tokens,
        "temperature": temperature,
        "seed": seed,
        "dim": model.args.dim,
        "vocab_size": model.args.vocab_size,
    }
    if feature_layers:  # only then: older EAGLE-1/2 data directories keep their manifest
        manifest["feature_layers"] = list(feature_layers)
    _check_manifest(data_dir, manifest)
    num_shards = math.ceil(len(prompt_ids) / batch_size)
    if max_shards is not None:
        num_shards = min(num_shards, max_shards)
    paths = [os.path.join(data_dir, f"shard_{i:05d}.safetensors") for i in range(num_shards)]
    todo = [i for i, p in enumerate(paths) if not os.path.exists(p)]
    bar = progress_bar(len(todo), "self-distill", "batch", progress)
    done_tokens, t0 = 0, time.perf_counter()
    for i in todo:
        batch = prompt_ids[i * batch_size : (i + 1) * batch_size]
        gen = torch.Generator().manual_seed(seed * 1_000_003 + i)  # per shard: resume-stable
        seqs = generate_batch(
            model, batch, max_new_tokens, tokenizer.eos_token_ids, temperature, gen, feature_layers
        )
        _write_shard(paths[i], seqs, [len(p) for p in batch])
        done_tokens += sum(len(t) - len(p) for (t, _, _), p in zip(seqs, batch))
        if bar:
            bar.set_postfix(gen_tok_s=f"{done_tokens / (time.perf_counter() - t0):.1f}")
            bar.update(1)
    if bar:
        bar.close()
    return paths


def _check_manifest(data_dir, manifest):
    path = os.path.join(data_dir, MANIFEST)
    if os.path.exists(path):
        with open(path) as f:
            old = json.load(f)
        if old != manifest:
            raise InvalidRequestError(
                f"{data_dir} holds shards made with different settings "
                f"({old}, now {manifest}); use another --data-dir"
            )
    else:
        with open(path, "w") as f:
            json.dump(manifest, f, indent=2)


def _write_shard(path, seqs, prompt_lens):
    tensors = {
        "tokens": torch.cat([t for t, _, _ in seqs]).to(torch.int32),
        "lengths": torch.tensor([len(t) for t, _, _ in seqs], dtype=torch.int32),
        "prompt_lens": torch.tensor(prompt_lens, dtype=torch.int32),
        "hidden": torch.cat([h for _, h, _ in seqs]).to(torch.bfloat16).cpu(),
    }
    if seqs[0][2].shape[-1]:
        tensors["aux"] = torch.cat([a for _, _, a in seqs]).to(torch.bfloat16).cpu()
    tmp = path + ".tmp"
    save_file(tensors, tmp)
    os.replace(tmp, path)  # a shard exists only once complete


def shard_paths(data_dir: str) -> list:
    """The complete shards of a data directory, in order."""
    return [
        os.path.join(data_dir, n)
        for n in sorted(os.listdir(data_dir))
        if n.startswith("shard_") and n.endswith(".safetensors")
    ]


def load_shards(data_dir: str, paths: list | None = None, features: str = "hidden") -> list:
    """Shards (default: all complete ones) -> list of (tokens long [S], feature bf16 [S, F],
    prompt_len); features: "hidden" (final-norm hidden, F = dim: EAGLE-1/2, Medusa) or "aux"
    (the fused layer outputs of EAGLE-3 data, F = len(feature_layers) * dim)."""
    if features not in ("hidden", "aux"):
        raise InvalidRequestError(f"features must be 'hidden' or 'aux', got {features!r}")
    seqs = []
    for path in shard_paths(data_dir) if paths is None else paths:
        t = load_file(path)
        if features not in t:
            raise InvalidRequestError(
                f"{path} holds no {features!r} features (EAGLE-3 training needs data made "
                "with --features eagle3)"
            )
        lengths = t["lengths"].tolist()
        for tok, hid, p in zip(
            t["tokens"].split(lengths), t[features].split(lengths), t["prompt_lens"].tolist()
        ):
            seqs.append((tok.long(), hid, p))
    return seqs


def data_feature_layers(data_dir: str) -> list:
    """The target layers whose outputs a data directory's shards hold as aux ([] if none)."""
    path = os.path.join(data_dir, MANIFEST)
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return json.load(f).get("feature_layers", [])
