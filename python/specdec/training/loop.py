"""What the head trainers share (specdec.apps.train's EAGLE one, specdec.apps.train_medusa's):
progress bars, resumable checkpoints, the draft vocabulary, the smoothed log."""

import os
import sys

import torch

CHECKPOINT = "checkpoint.pt"


def _bar(total, desc, unit, enabled):
    if not enabled or total == 0:
        return None
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit=unit, file=sys.stderr, dynamic_ncols=True)


def frequent_tokens(seqs: list, n: int) -> torch.Tensor:
    """The n most frequent generated token ids of the sequences (ties: lower id), sorted:
    the draft vocabulary (as EAGLE-3 picks its d2t from the training data)."""
    counts = torch.bincount(torch.cat([t[p:].long() for t, _, p in seqs]))
    n = min(n, int((counts > 0).sum()))
    return torch.sort(torch.argsort(-counts, stable=True)[:n]).values


def _smooth(running: dict | None, rec: dict) -> dict:
    """Exponential moving average of a step record (lists element-wise), for the progress bar."""
    if running is None:
        return dict(rec)
    mix = lambda a, b: 0.9 * a + 0.1 * b  # noqa: E731
    return {
        k: [mix(a, b) for a, b in zip(running[k], v)] if isinstance(v, list) else mix(running[k], v)
        for k, v in rec.items()
    }


def _checkpoint(path, head, opt, sched, step):
    """Atomically saves head + optimiser + schedule + step (what _resume reads)."""
    tmp = path + ".tmp"
    torch.save(
        {
            "head": head.state_dict(),
            "opt": opt.state_dict(),
            "sched": sched.state_dict(),
            "step": step,
        },
        tmp,
    )
    os.replace(tmp, path)


def _resume(path, head, opt, sched) -> int:
    if not os.path.exists(path):
        return 0
    ck = torch.load(path, map_location="cpu", weights_only=True)
    head.load_state_dict(ck["head"])
    opt.load_state_dict(ck["opt"])
    sched.load_state_dict(ck["sched"])
    return ck["step"]
