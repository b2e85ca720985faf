"""EAGLE heads side by side (the head card's ablation): teacher-forced held-out top-1 per
training-time-test depth on the held-out shards of a data directory, and on MT-bench first
turns (never trained on) the tokens per target forward and acceptance by depth of each head
in our engine (bf16 target, batch 1, one tree), greedy and sampled.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/compare_heads.py \\
        --heads eagle2_old=python/specdec/heads/smollm2-135m-instruct,eagle3=OUT \\
        --data-dir DATA --json benchmarks/out/heads.json
"""

import argparse
import json
import os
import time

import torch

from specdec.bench.e2e import run_ours
from specdec.datasets import mtbench_prompts
from specdec.drafters.eagle_head import load_head
from specdec.models.loader import load_model
from specdec.training.data import load_shards, shard_paths
from specdec.training.eagle import evaluate


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--heads", required=True, help="comma-separated name=path")
    p.add_argument("--data-dir", required=True, help="shards whose last --val-shards are held out")
    p.add_argument("--val-shards", type=int, default=1)
    p.add_argument("--depths", type=int, default=3, help="TTT depths to score")
    p.add_argument("--num-prompts", type=int, default=20)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--tree", default="dynamic:6,8,48")
    p.add_argument("--temperatures", default="0,1")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--json", default=None)
    opts = p.parse_args()
    torch.set_num_threads(opts.threads)
    heads = dict(item.split("=", 1) for item in opts.heads.split(","))
    val_paths = shard_paths(opts.data_dir)[-opts.val_shards :]
    model32, tokenizer = load_model(None, dtype=torch.float32)
    model16, _ = load_model(None, dtype=torch.bfloat16)
    prompts = mtbench_prompts(opts.num_prompts)
    prompt_ids = [tokenizer.apply_chat_template([{"role": "user", "content": q}]) for q in prompts]
    out = {
        "config": {**vars(opts), "val_shards_paths": [os.path.basename(p) for p in val_paths]},
        "heads": {},
    }
    for name, path in heads.items():
        t0 = time.time()
        head32 = load_head(path, model32).float()
        seqs = load_shards(opts.data_dir, val_paths, "aux" if head32.version == 3 else "hidden")
        with torch.no_grad():
            held_out = evaluate(head32, seqs, 8, steps=opts.depths)
        row = {"version": head32.version, "held_out": held_out, "mtbench": {}}
        del head32, seqs
        head16 = load_head(path, model16)
        for temp in [float(t) for t in opts.temperatures.split(",")]:
            r = run_ours(
                model16, tokenizer, head16, opts.tree, prompt_ids, temp, 1, opts.max_new_tokens, 0
            )
            row["mtbench"][str(temp)] = {
                k: r[k]
                for k in ("mean_acceptance_length", "acceptance_rate", "tokens_per_s")
                if k in r
            }
        row["seconds"] = round(time.time() - t0)
        out["heads"][name] = row
        print(name, json.dumps(row), "load", os.getloadavg(), flush=True)
        if opts.json:
            with open(opts.json, "w") as f:
                json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
