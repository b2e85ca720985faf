"""`specdec train-head --kind medusa`: train Medusa-1 heads (specdec.drafters.medusa_heads)
for a target.

Reads the self-distillation shards of the EAGLE trainer (specdec.training.eagle: token ids and
the target's final-norm hidden state of every position). Head k (k = 1..K) reads hidden[t]
and is scored by cross-entropy against token t + 1 + k through the target's frozen lm_head,
over the draft vocabulary (or the tokens of the data), summed over heads with Medusa's decay
weights 0.8^k; only positions t >= prompt_len - 1 count (the hidden states the drafter reads:
the prompt's last one and the generated ones) whose label lies inside the sequence. The
residual blocks start at zero (Medusa's init: each head starts as the identity). AdamW,
warm-up then cosine, resumable checkpoints; per-head held-out top-1 after every epoch.
"""

import json
import os
import time

import torch
import torch.nn.functional as F

from specdec.errors import InvalidRequestError
from specdec.training.loop import LoopSettings, frequent_tokens, train_loop

DECAY = 0.8  # Medusa's per-head loss weight: head k weighs DECAY ** k
RANKS = 10  # held-out rank accuracies kept per head (the drafter's sparse-tree prior)


def make_medusa_batch(seqs: list, num_heads: int, device=None):
    """Training tensors of a list of (tokens [S], hidden [S, dim], prompt_len).

    Rows are the positions t in [prompt_len - 1, S - 2] of every sequence: hidden [N, dim]
    (float32) and labels long [N, K], labels[:, k - 1] = tokens[t + 1 + k], -1 past the end."""
    hid, lab = [], []
    for tok, h, p in seqs:
        S = len(tok)
        start = max(p - 1, 0)
        if start > S - 2:
            continue
        t = torch.arange(start, S - 1)
        idx = t[:, None] + 1 + torch.arange(1, num_heads + 1)[None]  # [n, K]
        lab.append(torch.where(idx < S, tok[idx.clamp(max=S - 1)], -1))
        hid.append(h[start : S - 1])
    if not hid:
        dim = seqs[0][1].shape[-1]
        return torch.zeros(0, dim, device=device), torch.zeros(
            0, num_heads, dtype=torch.long, device=device
        )
    return torch.cat(hid).float().to(device), torch.cat(lab).long().to(device)


def medusa_loss(heads, hidden, labels, vocab, weight):
    """-> (loss, [top-1 per head]) of one batch. hidden [N, dim]; labels long [N, K];
    vocab: sorted long [Vs] target ids the cross-entropy ranges over (labels outside it, which
    heads drafting over that vocabulary never propose, are left out); weight [Vs, dim]: their
    lm_head rows."""
    x = heads(hidden)  # [N, K, dim]
    loss, accs = 0.0, []
    for k in range(heads.num_heads):
        lab = labels[:, k]
        index = torch.searchsorted(vocab, lab.clamp(min=0)).clamp(max=len(vocab) - 1)
        known = (lab >= 0) & (vocab[index] == lab)
        logits = x[known, k] @ weight.T
        ce = F.cross_entropy(logits, index[known]) if known.any() else x.sum() * 0
        loss = loss + DECAY ** (k + 1) * ce
        valid = max(1, int((lab >= 0).sum()))
        accs.append((logits.argmax(-1) == index[known]).float().sum().item() / valid)
    return loss, accs


@torch.no_grad()
def evaluate_medusa(heads, seqs: list, batch_size: int = 64) -> dict:
    """Teacher-forced held-out metrics through heads.logits (what drafting ranks): per head
    top-1 and the rate at which its rank-j candidate (j < RANKS) is the true token."""
    K = heads.num_heads
    hits = torch.zeros(K, RANKS)
    n = torch.zeros(K)
    for i in range(0, len(seqs), batch_size):
        hidden, labels = make_medusa_batch(seqs[i : i + batch_size], K, heads.weight.device)
        if not len(hidden):
            continue
        top = heads.draft_to_target(heads.draft_logits(hidden).topk(RANKS, dim=-1).indices)
        match = top == labels[..., None]  # [N, K, RANKS]
        valid = labels >= 0
        hits += (match & valid[..., None]).sum(0).float().cpu()
        n += valid.sum(0).float().cpu()
    rank_acc = (hits / n.clamp(min=1)[:, None]).tolist()
    return {
        "top1": [round(r[0], 4) for r in rank_acc],
        "top5": [round(sum(r[:5]), 4) for r in rank_acc],
        "rank_accuracy": [[round(a, 4) for a in r] for r in rank_acc],
        "positions": int(n[0]),
    }


def train_medusa(
    target,
    seqs: list,
    output: str,
    num_heads: int = 4,
    num_layers: int = 1,
    epochs: float = 3.0,
    batch_size: int = 8,
    lr: float = 1e-3,
    full_vocab_ce: bool = False,
    draft_vocab: int = 0,
    checkpoint_every: int = 100,
    save_dtype=torch.bfloat16,
    seed: int = 0,
    progress: bool = True,
    max_steps: int | None = None,
    val_seqs: list | None = None,
):
    """Trains fresh Medusa heads on self-distillation sequences (batch_size sequences, all
    their positions, per step) and saves them to `output` (resuming from output/checkpoint.pt
    if present); val_seqs are scored after every epoch and their rank accuracies become the
    heads' head_accuracy. Returns the per-step log of this call (plus {"epoch", "val"})."""
    from specdec.drafters.medusa_heads import MedusaHeads

    if num_heads < 1 or num_layers < 1:
        raise InvalidRequestError(
            f"--medusa-heads and --medusa-layers must be >= 1, got {num_heads}, {num_layers}"
        )
    seqs = [s for s in seqs if len(s[0]) - 2 >= max(s[2] - 1, 0)]  # something to predict
    if not seqs:
        raise InvalidRequestError("no training sequence with generated tokens")
    os.makedirs(output, exist_ok=True)
    target = target.float().requires_grad_(False)
    heads = MedusaHeads.random(target, num_heads, num_layers, seed=seed, scale=0.0).float()
    vocab = (
        torch.arange(target.args.vocab_size)
        if full_vocab_ce
        else torch.unique(torch.cat([t[max(p, 2) :] for t, _, p in seqs]))
    )
    if draft_vocab:
        vocab = frequent_tokens(seqs, draft_vocab)
    device = target.tok_embeddings.weight.device
    vocab = vocab.to(device)
    weight = target.output.weight[vocab].float()
    heads.to(device)

    def step_fn(batch_seqs: list, step: int) -> tuple[torch.Tensor, dict]:
        hidden, labels = make_medusa_batch(batch_seqs, num_heads, device)
        loss, accs = medusa_loss(heads, hidden, labels, vocab, weight)
        return loss, {"loss": loss.item(), "acc_by_head": accs}

    def validate_fn(step: int) -> tuple[dict, str]:
        if draft_vocab:  # score what drafting will rank: the draft vocabulary only
            heads.set_draft_vocab(vocab.cpu())
        val = evaluate_medusa(heads, val_seqs)
        heads.set_draft_vocab(torch.arange(target.args.vocab_size))  # back to training
        seconds = time.perf_counter() - t0
        return {"val": val, "seconds": seconds}, f"held-out top-1 per head {val['top1']}"

    settings = LoopSettings(
        epochs, batch_size, lr, checkpoint_every, seed, progress, max_steps, "train-medusa"
    )
    t0 = time.perf_counter()
    result = train_loop(
        heads,
        list(heads.parameters()),
        seqs,
        output,
        settings,
        step_fn,
        validate_fn if val_seqs else None,
        lambda r: {"top1": "/".join(f"{a:.2f}" for a in r["acc_by_head"])},
    )
    log, running = result.log, result.running
    if result.finished:
        if draft_vocab:
            heads.set_draft_vocab(vocab.cpu())
        held_out = [r for r in log if "val" in r]
        if held_out:
            heads.head_accuracy = held_out[-1]["val"]["rank_accuracy"]
        heads.save(output, save_dtype)
        summary = {
            "kind": "medusa",
            "num_heads": num_heads,
            "num_layers": num_layers,
            "steps": result.total,
            "epochs": epochs,
            "batch_size": batch_size,
            "lr": lr,
            "loss_decay": DECAY,
            "sequences": len(seqs),
            "vocab_for_ce": len(vocab),
            "draft_vocab": draft_vocab or target.args.vocab_size,
            "seconds_this_call": result.seconds,
            "final": running,
            "held_out": held_out,
        }
        with open(os.path.join(output, "training.json"), "w") as f:
            json.dump(summary, f, indent=2)
    return log
