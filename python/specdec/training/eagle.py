"""EAGLE-2 / EAGLE-3 head training (docs/training.md), on CPU or GPU, over the
self-distillation shards of specdec.training.data.

EAGLE-2: the head reads (token t + 1, feature t) and regresses feature t + 1 (smooth L1,
weight 1.0) while the target's frozen lm_head turns its output into next-token logits
(cross-entropy against token t + 2, weight 0.1), as in EAGLE; input features get uniform
noise (EAGLE's augmentation for the head's own, imperfect features at depth >= 2). EAGLE-3:
the head reads the fused layer outputs and is trained by cross-entropy alone, over its own
lm_head's draft vocabulary, at every pass of the training-time test (`ttt_steps`: pass s
drafts depth s from the head's own outputs of the passes before). Only positions that
predict generated tokens count. The loop (checkpoints, resume, schedule) is
specdec.training.loop's; the result is a head directory that
`specdec.drafters.eagle_head.load_head` reads.
"""

import json
import os

import torch
import torch.nn.functional as F

from specdec.errors import InvalidRequestError
from specdec.training.loop import LoopSettings, frequent_tokens, train_loop

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
    from specdec.drafters.eagle_head import EagleHead, check_head_matches, load_head

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

    def step_fn(batch_seqs: list, step: int) -> tuple[torch.Tensor, dict]:
        batch = make_batch(batch_seqs, device)
        noise_gen = torch.Generator(device).manual_seed(seed * 7919 + step)
        loss, fl, tl, accs = head_loss(head, batch, vocab, noise, noise_gen, ttt_steps, token_loss)
        rec = {"loss": loss.item(), "feature_loss": fl.item(), "token_loss": tl.item()}
        return loss, {**rec, "acc": accs[0], "acc_by_depth": accs}

    def validate_fn(step: int) -> tuple[dict, str]:
        val = evaluate(head, val_seqs, batch_size, ttt_steps)
        return {"val": val}, f"held-out {val}"

    settings = LoopSettings(
        epochs, batch_size, lr, checkpoint_every, seed, progress, max_steps, "train-head"
    )
    result = train_loop(
        head,
        [p for p in head.parameters() if p.requires_grad],
        seqs,
        output,
        settings,
        step_fn,
        validate_fn if val_seqs else None,
        lambda r: {"top1": "/".join(f"{a:.2f}" for a in r["acc_by_depth"])},
    )
    log, running = result.log, result.running
    if result.finished:
        if draft_vocab and version < 3:
            head.set_draft_vocab(vocab.cpu())
        head.to(save_dtype).save(output)
        summary = {
            "steps": result.total,
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
            "seconds_this_call": result.seconds,
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
