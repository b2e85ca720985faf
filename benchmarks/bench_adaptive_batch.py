"""Adaptive mode against plain decoding at a batch size, interleaved in one process.

Variants, each round in turn on the same prompts (MT-bench first turns, greedy, bf16, the
shipped EAGLE head): `plain` (no drafter), `adaptive` (calibrated: Policy.observe_time) and
`uncalibrated` (the start-up cost model alone), the adaptive ones sharing one cost model
measured once. Reports tokens/s end to end and over the decode phases only (prefill is the
same work for every variant, and on a shared machine its time drifts), nodes per step, the
calibration factors, and with --trace every step of one adaptive run: kind, predicted vs
measured seconds, the drafter's catch-up, the forward and sampling.

    PYTHONPATH=.:python OMP_NUM_THREADS=2 python benchmarks/bench_adaptive_batch.py \
        --threads 2 --batch-sizes 16,64 --rounds 3 --json benchmarks/results/adaptive_batch.json
"""

import argparse
import statistics
import time

import torch
from common import write_json

from specdec.adaptive import Policy
from specdec.apps.data import mtbench_prompts
from specdec.drafters.eagle import EagleDrafter
from specdec.eagle import load_head
from specdec.engine import Engine, Request, SamplingParams
from specdec.heads import shipped_head_path
from specdec.loader import load_model
from specdec.model import Transformer

VARIANTS = ("plain", "adaptive", "uncalibrated")


def run(model, tok, head, prompts, variant, new_tokens, cost):
    """One engine run -> (Stats dict, the engine)."""
    adaptive = variant != "plain"
    engine = Engine(
        model,
        tok,
        head=head if adaptive else None,
        tree="adaptive" if adaptive else "chain:1",
        batch_size=len(prompts),
        max_seq_len=max(map(len, prompts)) + new_tokens + 1,
        cost_model=cost,
        calibrate=variant == "adaptive",
    )
    engine.generate([Request(list(prompts[0]), SamplingParams(max_new_tokens=2))])  # warm-up
    reqs = [Request(list(p), SamplingParams(max_new_tokens=new_tokens)) for p in prompts]
    _, stats = engine.generate(reqs)
    return stats.to_dict(), engine


def trace(model, tok, head, prompts, new_tokens, cost) -> list:
    """Every step of one calibrated adaptive run, its parts timed by wrapping them."""
    parts: dict[str, float] = {}
    patched = []

    def wrap(owner, name, key):
        f = getattr(owner, name)

        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return f(*args, **kwargs)
            finally:
                parts[key] = parts.get(key, 0.0) + time.perf_counter() - t0

        setattr(owner, name, timed)
        patched.append((owner, name, f))

    steps = []
    observe = Policy.observe_time

    def record(self, seconds, speculative, levels, nodes):
        predicted = self.predicted_step_s(levels, nodes)
        row = dict(speculative=speculative, batch=self.batch, levels=levels, nodes=nodes)
        row.update(seconds=seconds, predicted_s=predicted, **parts)
        steps.append(row)
        parts.clear()
        observe(self, seconds, speculative, levels, nodes)

    wrap(EagleDrafter, "_catch_up", "catch_up_s")
    wrap(Transformer, "__call__", "forward_s")
    wrap(Engine, "_sample", "sample_s")
    patched.append((Policy, "observe_time", observe))
    Policy.observe_time = record  # type: ignore[method-assign]
    try:
        run(model, tok, head, prompts, "adaptive", new_tokens, cost)
    finally:
        for owner, name, f in reversed(patched):
            setattr(owner, name, f)
    return steps[1:]  # steps[0]: the warm-up request's one step


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--batch-sizes", default="16,64")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.add_argument("--trace", action="store_true", help="also every step of one adaptive run")
    p.add_argument("--json", default=None)
    opts = p.parse_args()
    torch.set_num_threads(opts.threads)
    model, tok = load_model(None, dtype=torch.bfloat16)
    head = load_head(shipped_head_path(None), model)
    ids = [tok.apply_chat_template([{"role": "user", "content": q}]) for q in mtbench_prompts()]
    rows = []
    for bs in [int(b) for b in opts.batch_sizes.split(",")]:
        prompts = [ids[i % len(ids)] for i in range(bs)]
        cost = None
        results: dict[str, list[dict]] = {v: [] for v in VARIANTS}
        for r in range(opts.rounds):
            for variant in VARIANTS:
                d, engine = run(model, tok, head, prompts, variant, opts.max_new_tokens, cost)
                if engine.policy is not None:
                    cost = engine.policy.cost
                decode_s = sum(t for k, t in d["time_s"].items() if k != "prefill")
                entry = dict(
                    tokens_per_s=d["tokens_per_s"],
                    decode_tokens_per_s=d["generated_tokens"] / decode_s,
                    nodes_per_step=d["nodes_per_step"],
                    time_s=d["time_s"],
                )
                if engine.policy is not None:
                    entry["calibration"] = [engine.policy.calibration(k) for k in (False, True)]
                results[variant].append(entry)
                print(f"batch {bs} round {r} {variant}: {entry}", flush=True)
        row = dict(batch_size=bs, threads=opts.threads, max_new_tokens=opts.max_new_tokens)
        for variant, entries in results.items():
            for key in ("tokens_per_s", "decode_tokens_per_s"):
                row[f"{variant}_{key}"] = round(statistics.median(e[key] for e in entries), 2)
            row[f"{variant}_runs"] = entries
        for variant in VARIANTS[1:]:
            for key in ("tokens_per_s", "decode_tokens_per_s"):
                row[f"{variant}_vs_plain_{key}"] = round(
                    row[f"{variant}_{key}"] / row[f"plain_{key}"], 3
                )
        if opts.trace:
            row["trace"] = trace(model, tok, head, prompts, opts.max_new_tokens, cost)
        rows.append(row)
        print({k: v for k, v in row.items() if not isinstance(v, list)}, flush=True)
        if opts.json:
            write_json(opts.json, rows, {"bench": "adaptive_batch", "dtype": "bfloat16"})


if __name__ == "__main__":
    main()
