"""The one training loop of the drafter heads (docs/training.md): the EAGLE trainer
(specdec.training.eagle) and the Medusa trainer (specdec.training.medusa) supply what is
theirs through hooks (a step's loss, a held-out evaluation, the progress bar's figures); the
loop owns the rest: AdamW, the warm-up + cosine schedule, shuffled epochs, gradient clipping,
resumable checkpoints, the smoothed log and the progress bar.

    result = train_loop(head, params, seqs, output, LoopSettings(epochs=3, batch_size=8), step_fn)
    if result.finished: ...save the head...

A run resumes from output/checkpoint.pt (head, optimiser, schedule, step) and, with
max_steps, stops after that many steps of this call (the checkpoint then says where to go on).
"""

import math
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

CHECKPOINT = "checkpoint.pt"
CLIP_NORM = 0.5  # gradient norm clip of both trainers
BETAS = (0.9, 0.95)
# the learning rate: a linear warm-up over the first 1 / WARMUP_DIVISOR of the steps, then a
# cosine from lr down to MIN_LR_SHARE * lr
WARMUP_DIVISOR, MIN_LR_SHARE = 20, 0.1

# step_fn(batch: the step's sequences, step: its index from 0) -> (loss to back-propagate, the
# step's log record: floats or lists of floats)
StepFn = Callable[[list, int], tuple[torch.Tensor, dict]]
# validate_fn(step) -> (the epoch's log record, one line for the user)
ValidateFn = Callable[[int], tuple[dict, str]]


@dataclass
class LoopSettings:
    epochs: float = 3.0
    batch_size: int = 8
    lr: float = 1e-3
    checkpoint_every: int = 100
    seed: int = 0  # the epochs' shuffles
    progress: bool = True
    max_steps: int | None = None  # of this call (None: to the end)
    desc: str = "train"  # the progress bar's label


@dataclass
class LoopResult:
    log: list = field(default_factory=list)  # this call's step records (and epoch records)
    step: int = 0  # steps done, this call's and earlier calls'
    total: int = 0  # steps of the whole run
    running: dict | None = None  # the smoothed last record (what the progress bar shows)
    seconds: float = 0.0  # this call's

    @property
    def finished(self) -> bool:
        return self.step == self.total


def schedule(total: int) -> Callable[[int], float]:
    """The learning-rate factor of step s of a run of `total` steps."""
    warmup = max(1, total // WARMUP_DIVISOR)
    floor, span = MIN_LR_SHARE, (1 - MIN_LR_SHARE) / 2
    return lambda s: min(
        (s + 1) / warmup, floor + span * (1 + math.cos(math.pi * min(s, total) / total))
    )


def train_loop(
    module: nn.Module,
    params: list,
    seqs: list,
    output: str,
    settings: LoopSettings,
    step_fn: StepFn,
    validate_fn: ValidateFn | None = None,
    postfix: Callable[[dict], dict] | None = None,
) -> LoopResult:
    """Trains params (of module, whose state_dict the checkpoint holds) over seqs in shuffled
    epochs of settings.batch_size sequences; validate_fn runs at the end of every epoch;
    postfix(running record) -> the progress bar's extra figures."""
    os.makedirs(output, exist_ok=True)
    opt = torch.optim.AdamW(params, lr=settings.lr, betas=BETAS, weight_decay=0.0)
    steps_per_epoch = math.ceil(len(seqs) / settings.batch_size)
    total = max(1, round(settings.epochs * steps_per_epoch))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, schedule(total))
    path = os.path.join(output, CHECKPOINT)
    step = _resume(path, module, opt, sched)
    stop = total if settings.max_steps is None else min(total, step + settings.max_steps)
    bar = progress_bar(stop - step, settings.desc, "step", settings.progress)
    result, t0 = LoopResult(step=step, total=total), time.perf_counter()
    while step < stop:
        epoch, i = divmod(step, steps_per_epoch)
        gen = torch.Generator().manual_seed(settings.seed + epoch)
        order = torch.randperm(len(seqs), generator=gen)
        picked = order[i * settings.batch_size : (i + 1) * settings.batch_size].tolist()
        loss, rec = step_fn([seqs[j] for j in picked], step)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, CLIP_NORM)
        opt.step()
        sched.step()
        step += 1
        rec = {"step": step, **rec}
        result.log.append(rec)
        result.running = _smooth(result.running, rec)
        if bar:
            extra = postfix(result.running) if postfix else {}
            bar.set_postfix(loss=f"{result.running['loss']:.3f}", epoch=epoch, **extra)
            bar.update(1)
        if step % settings.checkpoint_every == 0 or step == stop:
            _checkpoint(path, module, opt, sched, step)
        if validate_fn is not None and (step % steps_per_epoch == 0 or step == total):
            record, message = validate_fn(step)
            result.log.append({"epoch": step / steps_per_epoch, **record})
            if bar:
                bar.write(f"epoch {step / steps_per_epoch:.2f}: {message}")
            else:
                print(f"epoch {step / steps_per_epoch:.2f}: {message}", file=sys.stderr)
    if bar:
        bar.close()
    result.step, result.seconds = step, time.perf_counter() - t0
    return result


def frequent_tokens(seqs: list, n: int) -> torch.Tensor:
    """The n most frequent generated token ids of the sequences (ties: lower id), sorted:
    the draft vocabulary (as EAGLE-3 picks its d2t from the training data)."""
    counts = torch.bincount(torch.cat([t[p:].long() for t, _, p in seqs]))
    n = min(n, int((counts > 0).sum()))
    return torch.sort(torch.argsort(-counts, stable=True)[:n]).values


def progress_bar(total, desc, unit, enabled):
    """A tqdm bar on stderr, or None (disabled, or nothing to do)."""
    if not enabled or total == 0:
        return None
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit=unit, file=sys.stderr, dynamic_ncols=True)


def _smooth(running: dict | None, rec: dict) -> dict:
    """Exponential moving average of a step record (lists element-wise), for the progress bar."""
    if running is None:
        return dict(rec)
    mix = lambda a, b: 0.9 * a + 0.1 * b  # noqa: E731
    return {
        k: [mix(a, b) for a, b in zip(running[k], v)] if isinstance(v, list) else mix(running[k], v)
        for k, v in rec.items()
    }


def _checkpoint(path, module, opt, sched, step):
    """Atomically saves module + optimiser + schedule + step (what _resume reads)."""
    tmp = path + ".tmp"
    state = {
        "head": module.state_dict(),
        "opt": opt.state_dict(),
        "sched": sched.state_dict(),
        "step": step,
    }
    torch.save(state, tmp)
    os.replace(tmp, path)


def _resume(path, module, opt, sched) -> int:
    if not os.path.exists(path):
        return 0
    ck = torch.load(path, map_location="cpu", weights_only=True)
    module.load_state_dict(ck["head"])
    opt.load_state_dict(ck["opt"])
    sched.load_state_dict(ck["sched"])
    return ck["step"]
