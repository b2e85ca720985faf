"""Where a decode step of the engine goes, function by function, as the engine runs it.

Wraps the step's functions (the engine's phases, the target forward and its parts, the
drafter's, adaptive mode's policy) with wall-clock timers, runs a warm engine over MT-bench
first turns at batch size 1 and prints, per function, its calls per step, wall time per call and
per step (inclusive: a caller's time holds its callees'). Unlike torch.profiler this times what a
step pays with the caches as the step leaves them: after a forward has streamed the weights, a
small torch call costs 3-5x its warm time on a CPU (RESULTS.md, sessions 14 and 16).

    PYTHONPATH=.:python python benchmarks/profile_engine_step.py --tree adaptive --threads 2
"""

import argparse
import collections
import functools
import json
import time

import torch
from common import machine_info

import specdec_kernels.ops as kernel_ops
from specdec import adaptive, drafting
from specdec import model as model_module
from specdec.apps.data import mtbench_prompts
from specdec.apps.generate import encode
from specdec.drafters import base as drafters_base
from specdec.drafters.eagle import EagleDrafter
from specdec.eagle import EagleHead, load_head
from specdec.engine import Engine, Request, SamplingParams
from specdec.heads import shipped_head_path
from specdec.loader import load_model

# (owner, attribute) of every timed function
TIMED = (
    [
        (Engine, name)
        for name in (
            "_advance",
            "_verify_step",
            "_sample",
            "_sampling",
            "_slots",
            "_emit",
            "_retire",
        )
    ]
    + [
        (model_module.Transformer, "eager_forward"),
        (model_module.Transformer, "_run_decode_layers"),
        (model_module.Transformer, "lm_head"),
        (model_module.Transformer, "rope"),
        (model_module.AttentionMetadata, "verify"),
        (model_module.TransformerBlock, "_decode_layer"),
        (EagleDrafter, "propose"),
        (EagleDrafter, "commit"),
        (EagleDrafter, "_catch_up"),
        (EagleHead, "forward"),
        (EagleHead, "draft_logits"),
        (EagleHead, "_rope"),
        (drafting, "draft"),
        (drafting, "draft_dynamic"),
        (drafting, "grow_dynamic"),
        (drafters_base.Proposal, "truncate"),
        (kernel_ops, "build_tree_mask"),
        (kernel_ops, "compact_kv"),
        (kernel_ops, "make_uniforms"),
        (kernel_ops, "tree_rejection_sample"),
    ]
    + [
        (adaptive.Policy, name)
        for name in (
            "speculate",
            "node_value",
            "prefix_values",
            "expand_width",
            "sizes",
            "best",
            "draft_cost",
            "observe",
            "observe_time",
            "observe_level",
        )
    ]
)


def instrument(totals: dict) -> None:
    """Wraps every TIMED function so that each call adds [1, seconds] to totals[label]."""
    for owner, name in TIMED:
        fn = getattr(owner, name)
        label = f"{getattr(owner, '__name__', str(owner)).rsplit('.', 1)[-1]}.{name}"

        @functools.wraps(fn)
        def timed(*args, _fn=fn, _label=label, **kwargs):
            t0 = time.perf_counter()
            try:
                return _fn(*args, **kwargs)
            finally:
                entry = totals[_label]
                entry[0] += 1
                entry[1] += time.perf_counter() - t0

        setattr(owner, name, timed)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tree", default="adaptive", help="'plain', or a tree spec (chain:1, ...)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--num-prompts", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--json", default=None, help="also write the table here")
    opts = p.parse_args()
    torch.set_num_threads(opts.threads)
    model, tokenizer = load_model(None, dtype=torch.bfloat16)
    plain = opts.tree == "plain"
    head = None if plain else load_head(shipped_head_path(), model)
    prompts = [encode(tokenizer, q, True) for q in mtbench_prompts(opts.num_prompts)]
    engine = Engine(
        model,
        tokenizer,
        head=head,
        tree="chain:1" if plain else opts.tree,
        max_seq_len=max(len(q) for q in prompts) + opts.max_new_tokens + 1,
    )
    # warm: the longest prompt's prefill packs oneDNN's layout of the weights
    engine.generate([Request(list(max(prompts, key=len)), SamplingParams(max_new_tokens=8))])
    totals: dict = collections.defaultdict(lambda: [0, 0.0])
    instrument(totals)
    steps = 0
    for q in prompts:
        request = Request(list(q), SamplingParams(0.0, max_new_tokens=opts.max_new_tokens))
        steps += engine.generate([request])[1].target_forwards
    rows = [
        {
            "function": label,
            "calls_per_step": n / steps,
            "us_per_call": 1e6 * s / n,
            "ms_per_step": 1e3 * s / steps,
        }
        for label, (n, s) in sorted(totals.items(), key=lambda kv: -kv[1][1])
        if n
    ]
    print(f"{opts.tree}, {opts.threads} threads, {steps} steps (inclusive wall times)")
    for r in rows:
        print(
            f"{r['function']:34s} {r['calls_per_step']:5.2f}/step {r['us_per_call']:9.1f} us/call "
            f"{r['ms_per_step']:7.3f} ms/step"
        )
    if opts.json:
        meta = {**machine_info(), "tree": opts.tree, "threads": opts.threads, "steps": steps}
        with open(opts.json, "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
