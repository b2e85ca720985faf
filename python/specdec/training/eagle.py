"""`specdec train-head`: train an EAGLE-2 or EAGLE-3 draft head for a target model, on CPU
or GPU.

1. Self-distillation (`generate_shards`): the target answers ShareGPT first-turn prompts
   itself (greedy by default), in batches, and the final-norm hidden state of every
   position (the feature an EAGLE-1/2 head reads) is kept, with `--features eagle3` also
   the pre-norm outputs of EAGLE-3's three feature layers (aux). Each batch of prompts
   becomes one append-only shard (safetensors: token ids int32, hidden / aux bf16), so an
   interrupted run resumes at the first missing shard.
2. Training (`train_head`): EAGLE-2: the head reads (token t + 1, feature t) and regresses
   feature t + 1 (smooth L1, weight 1.0) while the target's frozen lm_head turns its output
   into next-token logits (cross-entropy against token t + 2, weight 0.1), as in EAGLE;
   input features get uniform noise (EAGLE's augmentation for the head's own, imperfect
   features at depth >= 2). EAGLE-3 (`--eagle-version 3`): the head reads the fused layer
   outputs and is trained by cross-entropy alone, over its own lm_head's draft vocabulary,
   at every pass of the training-time test (`--ttt-steps`: pass s drafts depth s from the
   head's own outputs of the passes before). Only positions that predict generated tokens
   count. Checkpoints (head + optimiser + step) resume; the result is a head directory
   that `specdec.eagle.load_head` reads.
"""

import json
import math
import os
import sys
import time

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

import specdec_kernels.ops as ops

from .. import decode_path
from ..errors import InvalidRequestError
from .train_utils import CHECKPOINT, _bar, _checkpoint, _resume, _smooth, frequent_tokens

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
    decode_path.configure(model)
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
    bar = _bar(len(todo), "self-distill", "batch", progress)
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


# ---------------------------------------------------------------------- training
FEATURE_WEIGHT, TOKEN_WEIGHT = 1.0, 0.1  # EAGLE's v_w / p_w


def head_train_forward(head, tokens, features, steps: int = 1) -> list:
    """Differentiable causal passes of an EAGLE head over whole sequences: the maths of
    EagleHead.forward over its paged cache, with SDPA so autograd works.

    tokens: long [B, S] (token t + 1 at position t); features: [B, S, F] (feature t: the
    final-norm hidden, F = dim, for EAGLE-1/2; the fused layer outputs, F = 3 * dim, for
    EAGLE-3). Returns [pred_1, ..., pred_steps], each [B, S, dim] (the head's output: the
    predicted feature t + 1 for EAGLE-1/2, the pre-norm draft hidden for EAGLE-3). pred_1
    reads the target's features. Pass s > 1 is EAGLE-3's training-time test: position t
    reads pred_{s-1}[t - 1], i.e. it is the depth-s draft node below committed position
    t - s + 1, and attends to what that node sees while drafting: committed positions
    <= t - s + 1 (keys of pass 1) and its draft ancestors (position t - s + u of pass u).
    Rows t < s - 1 have no committed ancestor: callers ignore them."""
    B, S = tokens.shape
    emb = head.target.tok_embeddings(tokens)
    cos, sin = head._rope(torch.arange(S, device=tokens.device)[None].expand(B, S))
    gqa = head.args.n_heads != head.args.n_kv_heads
    keys, values, preds = [], [], []
    v3 = head.version == 3
    # EAGLE-3 reads fc(fused features) at committed positions and its own dim-wide output
    # at draft nodes (fc skipped, as EagleHead.forward does); EAGLE-1/2 always runs fc
    feats = head.fc(features) if v3 else features
    if v3:
        emb_normed = head.layer.attention_norm(emb)
    for step in range(1, steps + 1):
        mask = _draft_mask(S, step, tokens.device)

        def attend(q, k, v, mask=mask):  # this step's mask, bound now
            keys.append(k)
            values.append(v)
            out = F.scaled_dot_product_attention(
                q.transpose(1, 2),
                torch.cat(keys, 1).transpose(1, 2),
                torch.cat(values, 1).transpose(1, 2),
                attn_mask=mask,
                scale=head.scale,
                enable_gqa=gqa,
            )
            return out.transpose(1, 2)

        if v3:
            attn_in = torch.cat((emb_normed, head.hidden_norm(feats)), dim=-1)
            preds.append(head.layer(feats, cos, sin, attend, attn_in=attn_in))
            first = feats[:, :1]  # row 0 of later passes is ignored: any dim-wide value
        else:
            x = head.fc(torch.cat((emb, feats), dim=-1))
            preds.append(head.layer(x, cos, sin, attend))  # attention_norm is the identity
            first = features[:, :1]
        feats = torch.cat((first, preds[-1][:, :-1]), dim=1)
    return preds


def _draft_mask(S: int, step: int, device) -> torch.Tensor:
    """bool [S, step * S]: query t of pass `step` sees pass-1 keys j <= t - step + 1 and the
    pass-u key j == t - step + u for u = 2..step (causal for step 1)."""
    t = torch.arange(S, device=device)[:, None]
    j = torch.arange(S, device=device)[None]
    return torch.cat([j <= t - step + 1] + [j == t - step + u for u in range(2, step + 1)], dim=1)


def make_batch(seqs: list, device=None):
    """Training tensors of a list of (tokens [S], hidden [S, dim], prompt_len).

    Position t reads (tokens[t + 1], hidden[t]) and is scored against hidden[t + 1] and
    tokens[t + 2], for t from prompt_len - 2 (predicting the first generated token) on.
    Returns tok_in long [B, L], feat_in [B, L, dim], feat_out [B, L, dim], labels long
    [B, L], mask bool [B, L] with L = max S - 2, on `device` (default CPU)."""
    L = max(len(t) for t, _, _ in seqs) - 2
    dim = seqs[0][1].shape[-1]
    tok_in = torch.zeros(len(seqs), L, dtype=torch.long)
    labels = torch.zeros(len(seqs), L, dtype=torch.long)
    feat_in = torch.zeros(len(seqs), L, dim)
    feat_out = torch.zeros(len(seqs), L, dim)
    mask = torch.zeros(len(seqs), L, dtype=torch.bool)
    for b, (tok, hid, p) in enumerate(seqs):
        n = len(tok) - 2
        tok_in[b, :n], labels[b, :n] = tok[1:-1], tok[2:]
        feat_in[b, :n], feat_out[b, :n] = hid[:-2].float(), hid[1:-1].float()
        mask[b, max(p - 2, 0) : n] = True
    return tuple(t.to(device) for t in (tok_in, feat_in, feat_out, labels, mask))


TOKEN_LOSSES = ("label", "distribution")


def head_loss(
    head,
    batch,
    vocab,
    noise: float,
    generator=None,
    steps: int = 1,
    token_loss: str = "label",
):
    """The loss of one batch, averaged over `steps` training-time-test passes -> (loss,
    feature loss, token loss, [top-1 accuracy of each pass = draft depth]).

    EAGLE-1/2: smooth-L1 feature regression + TOKEN_WEIGHT x cross-entropy through the
    target's lm_head rows `vocab`, against the generated token (token_loss "label") or
    against the target's own next-token distribution over `vocab`, softmax(feature t + 1 @
    lm_head rows) (token_loss "distribution": EAGLE's soft labels; they carry the target's
    uncertainty, by which sampling at temperature > 0 accepts drafts). EAGLE-3: cross-entropy
    over the head's own draft vocabulary only (no feature regression; feature loss 0).

    vocab: sorted long [Vs] target ids the cross-entropy ranges over (for EAGLE-3 the draft
    vocabulary, draft id i = vocab[i]); labels outside it, which the head can never propose,
    are left out of the label loss (and count as misses in the accuracy); the distribution
    loss keeps every position, against the target's distribution renormalised over vocab."""
    tok_in, feat_in, feat_out, labels, mask = batch
    if noise:
        rms = feat_in.pow(2).mean(-1, keepdim=True).sqrt()
        u = torch.rand(feat_in.shape, generator=generator, device=feat_in.device)
        feat_in = feat_in + (u - 0.5) * noise * rms
    v3 = head.version == 3
    w = None if v3 else head.target.output.weight[vocab].float()
    fl, tl, accs = feat_in.new_zeros(()), 0.0, []
    for step, pred in enumerate(head_train_forward(head, tok_in, feat_in, steps)):
        m = mask.clone()
        m[:, :step] = False  # no committed ancestor
        index = torch.searchsorted(vocab, labels[m]).clamp(max=len(vocab) - 1)
        known = vocab[index] == labels[m]
        if v3:
            logits = head.draft_logits(pred[m][known])
        else:
            fl = fl + F.smooth_l1_loss(pred[m], feat_out[m], reduction="none").mean(-1).mean()
        if token_loss == "distribution":  # every scored position: the target's p is known
            with torch.no_grad():
                target_p = torch.softmax(feat_out[m] @ w.T, dim=-1)
            all_logits = pred[m] @ w.T
            ce = -(target_p * F.log_softmax(all_logits, dim=-1)).sum()
            tl = tl + ce / max(1, int(m.sum()))
            logits = all_logits[known]
        else:
            if not v3:
                logits = pred[m][known] @ w.T
            ce = F.cross_entropy(logits, index[known], reduction="sum")
            tl = tl + ce / max(1, int(known.sum()))
        accs.append(
            (logits.argmax(-1) == index[known]).float().sum().item() / max(1, m.sum().item())
        )
    fl, tl = fl / steps, tl / steps
    loss = tl if v3 else FEATURE_WEIGHT * fl + TOKEN_WEIGHT * tl
    return loss, fl, tl, accs


def train_head(
    target,
    seqs: list,
    output: str,
    epochs: float = 3.0,
    batch_size: int = 8,
    lr: float = 1e-3,
    noise: float = 0.2,
    full_vocab_ce: bool = False,
    draft_vocab: int = 0,
    checkpoint_every: int = 100,
    save_dtype=torch.bfloat16,
    seed: int = 0,
    progress: bool = True,
    max_steps: int | None = None,
    val_seqs: list | None = None,
    ttt_steps: int = 1,
    version: int = 2,
    feature_layers: tuple | None = None,
    token_loss: str = "label",
    init_head: str | None = None,
):
    """Trains a fresh EAGLE-2 or EAGLE-3 head on self-distillation sequences and saves it to
    `output` (resuming from output/checkpoint.pt if present); ttt_steps > 1 adds
    training-time-test passes on the head's own predictions (EAGLE-3 style); val_seqs
    (held-out sequences) are scored at the end of every epoch, per pass.

    seqs: (tokens, feature, prompt_len) as load_shards gives them: features "hidden" for
    version 2, "aux" (the outputs of feature_layers, default eagle3_feature_layers) for
    version 3. An EAGLE-3 head gets its own lm_head over the draft vocabulary (the
    draft_vocab most frequent generated tokens; 0: every token id in the sequences).
    Returns the per-step log [{"step", "loss", "feature_loss", "token_loss", "acc",
    "acc_by_depth"}] of this call (plus {"epoch", "val"} records).

    token_loss: "label" (cross-entropy against the generated token) or "distribution"
    (against the target's next-token distribution; EAGLE-2 only, see head_loss).
    init_head: a head directory (of the same version) to start from instead of random
    weights: a fine-tuning run, e.g. with the distribution loss after label training."""
    from ..eagle import EagleHead, check_head_matches, load_head

    if version not in (2, 3):
        raise InvalidRequestError(f"version must be 2 or 3, got {version}")
    if ttt_steps < 1:
        raise InvalidRequestError(f"ttt_steps must be >= 1, got {ttt_steps}")
    if token_loss not in TOKEN_LOSSES:
        raise InvalidRequestError(f"token_loss must be one of {TOKEN_LOSSES}, got {token_loss!r}")
    if token_loss == "distribution" and version == 3:
        raise InvalidRequestError(
            "token_loss 'distribution' needs the target's final-norm features, which an EAGLE-3 "
            "batch does not carry (it reads layer outputs): use it with version 2"
        )
    seqs = [s for s in seqs if len(s[0]) - 2 > max(s[2] - 2, 0)]  # something to predict
    if not seqs:
        raise InvalidRequestError("no training sequence with generated tokens")
    width = seqs[0][1].shape[-1]
    want = (3 if version == 3 else 1) * target.args.dim
    if width != want:
        raise InvalidRequestError(
            f"an EAGLE-{version} head reads features of width {want}, the data has {width} "
            "(EAGLE-3 needs the 'aux' features of data made with --features eagle3)"
        )
    os.makedirs(output, exist_ok=True)
    target = target.float().requires_grad_(False)
    # Cross-entropy over the tokens the data uses (a sampled softmax: the full 49k-way
    # product would cost ~7x the head itself per token on CPU).
    vocab = (
        torch.arange(target.args.vocab_size)
        if full_vocab_ce
        else torch.unique(torch.cat([t[2:] for t, _, _ in seqs]))
    )
    if draft_vocab:
        vocab = frequent_tokens(seqs, draft_vocab)
    if version == 3:  # its lm_head ranges over exactly the draft vocabulary
        head = EagleHead.random(target, version=3, seed=seed, draft_vocab_size=len(vocab))
        if feature_layers is not None:
            head.feature_layers = tuple(feature_layers)
            check_head_matches(head, target)
        head.d2t.copy_(vocab - torch.arange(len(vocab)))
    else:
        head = EagleHead.random(target, version=2, seed=seed)
    if init_head is not None:
        start = load_head(init_head, target)
        if start.version != head.version:
            raise InvalidRequestError(
                f"init_head {init_head} is an EAGLE-{start.version} head, training EAGLE-{version}"
            )
        if version == 3 and not torch.equal(start.d2t.cpu(), head.d2t.cpu()):
            raise InvalidRequestError(
                f"init_head {init_head} drafts over another vocabulary than this data's"
            )
        # the trained weights only: the draft vocabulary is this run's (an EAGLE-2 head
        # drafts through the target's lm_head rows, whatever its d2t was)
        mine, theirs = dict(head.named_parameters()), dict(start.named_parameters())
        if {k: v.shape for k, v in mine.items()} != {k: v.shape for k, v in theirs.items()}:
            raise InvalidRequestError(f"init_head {init_head} does not match this head's shapes")
        with torch.no_grad():
            for name, param in mine.items():
                param.copy_(theirs[name])
    head = head.float()
    device = target.tok_embeddings.weight.device  # the target's: a GPU trains much faster
    vocab = vocab.to(device)
    params = [p for p in head.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.95), weight_decay=0.0)
    steps_per_epoch = math.ceil(len(seqs) / batch_size)
    total = max(1, round(epochs * steps_per_epoch))
    warmup = max(1, total // 20)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt,
        lambda s: min(
            (s + 1) / warmup, 0.1 + 0.45 * (1 + math.cos(math.pi * min(s, total) / total))
        ),
    )
    step = _resume(os.path.join(output, CHECKPOINT), head, opt, sched)
    stop = total if max_steps is None else min(total, step + max_steps)
    bar = _bar(stop - step, "train-head", "step", progress)
    log, t0, running = [], time.perf_counter(), None
    while step < stop:
        epoch, i = divmod(step, steps_per_epoch)
        order = torch.randperm(len(seqs), generator=torch.Generator().manual_seed(seed + epoch))
        batch = make_batch(
            [seqs[j] for j in order[i * batch_size : (i + 1) * batch_size].tolist()], device
        )
        noise_gen = torch.Generator(device).manual_seed(seed * 7919 + step)
        loss, fl, tl, accs = head_loss(head, batch, vocab, noise, noise_gen, ttt_steps, token_loss)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 0.5)
        opt.step()
        sched.step()
        step += 1
        rec = {
            "step": step,
            "loss": loss.item(),
            "feature_loss": fl.item(),
            "token_loss": tl.item(),
            "acc": accs[0],
            "acc_by_depth": accs,
        }
        log.append(rec)
        running = _smooth(running, rec)
        if bar:
            bar.set_postfix(
                loss=f"{running['loss']:.3f}",
                epoch=epoch,
                top1="/".join(f"{a:.2f}" for a in running["acc_by_depth"]),
            )
            bar.update(1)
        if step % checkpoint_every == 0 or step == stop:
            _checkpoint(os.path.join(output, CHECKPOINT), head, opt, sched, step)
        if val_seqs and (step % steps_per_epoch == 0 or step == total):
            log.append(
                {
                    "epoch": step / steps_per_epoch,
                    "val": evaluate(head, val_seqs, batch_size, ttt_steps),
                }
            )
            msg = f"epoch {step / steps_per_epoch:.2f}: held-out {log[-1]['val']}"
            if bar:
                bar.write(msg)
            else:
                print(msg, file=sys.stderr)
    if bar:
        bar.close()
    if step == total:
        if draft_vocab and version < 3:
            head.set_draft_vocab(vocab.cpu())
        head.to(save_dtype).save(output)
        summary = {
            "steps": total,
            "epochs": epochs,
            "batch_size": batch_size,
            "lr": lr,
            "noise": noise,
            "ttt_steps": ttt_steps,
            "token_loss": token_loss,
            "init_head": init_head,
            "eagle_version": version,
            "feature_layers": list(head.feature_layers),
            "sequences": len(seqs),
            "vocab_for_ce": len(vocab),
            "draft_vocab": draft_vocab or target.args.vocab_size,
            "seconds_this_call": time.perf_counter() - t0,
            "final": running,
            "held_out": [r for r in log if "val" in r],
        }
        with open(os.path.join(output, "training.json"), "w") as f:
            json.dump(summary, f, indent=2)
    return log


@torch.no_grad()
def evaluate(head, seqs: list, batch_size: int = 8, steps: int = 1) -> dict:
    """Teacher-forced metrics on held-out sequences, over the full vocabulary: {"top1",
    "top1_by_depth", "positions"} (+ "feature_loss" for EAGLE-1/2). top1 = how often the
    first draft would be accepted (greedy); top1_by_depth[s - 1] = the same for pass s of
    the training-time test (the depth-s draft node given the head's own deeper features)."""
    fl, hits, n = 0.0, [0] * steps, [0] * steps
    for i in range(0, len(seqs), batch_size):
        tok_in, feat_in, feat_out, labels, mask = make_batch(
            seqs[i : i + batch_size], head.fc.weight.device
        )
        for step, pred in enumerate(head_train_forward(head, tok_in, feat_in, steps)):
            m = mask.clone()
            m[:, :step] = False  # no committed ancestor
            if step == 0 and head.version < 3:
                fl += F.smooth_l1_loss(pred[m], feat_out[m], reduction="none").mean(-1).sum().item()
            hits[step] += (head.logits(pred[m]).argmax(-1) == labels[m]).sum().item()
            n[step] += int(m.sum())
    top1 = [round(h / max(1, c), 4) for h, c in zip(hits, n)]
    out = {"top1": top1[0], "top1_by_depth": top1, "positions": n[0]}
    if head.version < 3:
        out["feature_loss"] = round(fl / max(1, n[0]), 4)
    return out


# ---------------------------------------------------------------------- command line
def add_arguments(p):
    p.add_argument(
        "--model", metavar="PATH", help="target: .gguf or HF dir (default: SmolLM2-135M-Instruct)"
    )
    p.add_argument(
        "--output",
        required=True,
        metavar="DIR",
        help="head directory to write (config.json + model.safetensors)",
    )
    p.add_argument(
        "--data-dir", metavar="DIR", help="self-distillation shards (default: OUTPUT/data)"
    )
    p.add_argument("--stage", choices=("all", "generate", "train"), default="all")
    p.add_argument(
        "--kind",
        choices=("eagle", "medusa"),
        default="eagle",
        help="what to train: an EAGLE-2 head (default) or Medusa-1 heads (same data)",
    )
    p.add_argument(
        "--medusa-heads", type=int, default=4, metavar="K", help="medusa: heads (default 4)"
    )
    p.add_argument(
        "--medusa-layers",
        type=int,
        default=1,
        metavar="N",
        help="medusa: residual blocks per head (default 1)",
    )
    p.add_argument("--num-prompts", type=int, default=2048, help="ShareGPT prompts to answer")
    p.add_argument(
        "--max-prompt-tokens", type=int, default=128, help="longer (templated) prompts are skipped"
    )
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--gen-batch-size", type=int, default=32)
    p.add_argument(
        "--gen-temperature", type=float, default=0.0, help="0 = greedy answers (default)"
    )
    p.add_argument("--max-shards", type=int, help="stop data generation after this many shards")
    p.add_argument(
        "--features",
        choices=("hidden", "eagle3"),
        default="hidden",
        help="what generated shards store per position: the final-norm hidden (EAGLE-1/2, "
        "Medusa; 2 * dim bytes) or also the outputs of EAGLE-3's three feature layers (both "
        "EAGLE-2 and EAGLE-3 train on it; 8 * dim bytes)",
    )
    p.add_argument(
        "--gen-dtype",
        choices=("bfloat16", "float32"),
        default="float32",
        help="target dtype while generating (bfloat16 is ~2x faster on CPUs with AVX512-BF16)",
    )
    p.add_argument("--epochs", type=float, default=3.0)
    p.add_argument("--batch-size", type=int, default=8, help="sequences per training step")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument(
        "--eagle-version",
        type=int,
        choices=(2, 3),
        default=2,
        help="eagle kind: 2 = EAGLE-2 head over the final-norm hidden (default); 3 = EAGLE-3 "
        "head over the fused outputs of three target layers, with its own lm_head over the "
        "--draft-vocab (needs data made with --features eagle3)",
    )
    p.add_argument(
        "--ttt-steps",
        type=int,
        default=1,
        help="passes per batch; > 1 trains on the head's own predicted features (EAGLE-3 "
        "training-time test)",
    )
    p.add_argument(
        "--noise",
        type=float,
        help="uniform feature noise width, relative to the feature RMS (default 0.2 for "
        "EAGLE-2, 0 for EAGLE-3, whose training-time test takes its place)",
    )
    p.add_argument(
        "--token-loss",
        choices=TOKEN_LOSSES,
        default="label",
        help="EAGLE-2 token loss: cross-entropy against the generated token (label, default) or "
        "against the target's next-token distribution (distribution: EAGLE's soft labels)",
    )
    p.add_argument(
        "--init-head",
        metavar="DIR",
        help="start from this head's weights (same EAGLE version) instead of random ones: "
        "fine-tuning, e.g. --token-loss distribution after label training",
    )
    p.add_argument(
        "--full-vocab-ce",
        action="store_true",
        help="cross-entropy over the whole vocabulary (default: over the tokens of the data)",
    )
    p.add_argument(
        "--draft-vocab",
        type=int,
        default=0,
        metavar="N",
        help="draft over the N most frequent generated tokens only (stored as d2t; cuts the "
        "draft lm_head cost by V / N); 0 = the whole vocabulary (default; for EAGLE-3: "
        "every token id in the data)",
    )
    p.add_argument(
        "--val-shards", type=int, default=1, help="last shards held out for per-epoch validation"
    )
    p.add_argument(
        "--checkpoint-every", type=int, default=100, help="steps between resumable checkpoints"
    )
    p.add_argument(
        "--dtype",
        choices=("bfloat16", "float16", "float32"),
        default="bfloat16",
        help="dtype of the saved head",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--device", default="auto", help="cpu, cuda, cuda:N (default: cuda when available)"
    )
    p.add_argument("--threads", type=int, help="torch CPU threads")
    p.add_argument("--no-progress", action="store_true")


def run(args) -> int:
    from ..eagle import eagle3_feature_layers
    from ..loader import load_model, resolve_device
    from .data import sharegpt_prompts

    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    data_dir = args.data_dir or os.path.join(args.output, "data")
    progress = not args.no_progress
    device = resolve_device(args.device)
    if args.stage in ("all", "generate"):
        model, tokenizer = load_model(
            args.model, dtype=getattr(torch, args.gen_dtype), device=device
        )
        prompts = tokenize_prompts(
            tokenizer, sharegpt_prompts(args.num_prompts, args.seed), args.max_prompt_tokens
        )
        feature_layers = (
            eagle3_feature_layers(model.args.n_layers) if args.features == "eagle3" else ()
        )
        generate_shards(
            model,
            tokenizer,
            prompts,
            data_dir,
            args.gen_batch_size,
            args.max_new_tokens,
            args.gen_temperature,
            args.seed,
            args.max_shards,
            progress,
            feature_layers,
        )
    if args.stage in ("all", "train"):
        model, _ = load_model(args.model, device=device)
        shards = shard_paths(data_dir)
        if args.val_shards >= len(shards):
            raise InvalidRequestError(
                f"{data_dir} has {len(shards)} shards: too few to hold {args.val_shards} out"
            )
        cut = len(shards) - args.val_shards
        if args.kind == "medusa":
            from .train_medusa import train_medusa

            train_medusa(
                model,
                load_shards(data_dir, shards[:cut]),
                args.output,
                num_heads=args.medusa_heads,
                num_layers=args.medusa_layers,
                epochs=args.epochs,
                batch_size=args.batch_size,
                lr=args.lr,
                full_vocab_ce=args.full_vocab_ce,
                draft_vocab=args.draft_vocab,
                checkpoint_every=args.checkpoint_every,
                save_dtype=getattr(torch, args.dtype),
                seed=args.seed,
                progress=progress,
                val_seqs=load_shards(data_dir, shards[cut:]),
            )
            return 0
        features, feature_layers = "hidden", None
        if args.eagle_version == 3:
            features, feature_layers = "aux", data_feature_layers(data_dir)
            if not feature_layers:
                raise InvalidRequestError(
                    f"{data_dir} holds no EAGLE-3 features: generate it with --features eagle3"
                )
        noise = args.noise if args.noise is not None else (0.2 if args.eagle_version < 3 else 0.0)
        train_head(
            model,
            load_shards(data_dir, shards[:cut], features),
            args.output,
            epochs=args.epochs,
            batch_size=args.batch_size,
            lr=args.lr,
            noise=noise,
            full_vocab_ce=args.full_vocab_ce,
            draft_vocab=args.draft_vocab,
            checkpoint_every=args.checkpoint_every,
            save_dtype=getattr(torch, args.dtype),
            seed=args.seed,
            progress=progress,
            val_seqs=load_shards(data_dir, shards[cut:], features),
            ttt_steps=args.ttt_steps,
            version=args.eagle_version,
            feature_layers=feature_layers,
            token_loss=args.token_loss,
            init_head=args.init_head,
        )
    return 0
