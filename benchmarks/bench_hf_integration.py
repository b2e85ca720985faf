"""specdec inside transformers beside transformers' own decoding, batch 1, greedy.

Rows (same prompts, same dtype, same device, interleaved per repetition, medians):
HF generate, HF prompt lookup (assisted generation, 10 tokens), specdec in transformers
(specdec.integrations.transformers.generate with the shipped EAGLE head), and specdec's own
engine (EAGLE, the same head and tree) for reference. Writes a JSON with machine, date,
commit and load.

    python benchmarks/bench_hf_integration.py --dtype bfloat16 --num-prompts 8 \
        --max-new-tokens 64 --reps 2 --output benchmarks/out/hf_integration_cpu.json
"""

import argparse
import json
import os
import statistics
import sys

import torch

from specdec.bench.common import machine_info
from specdec.bench.e2e import run_ours
from specdec.bench.hf import load_hf, run_hf, run_hf_specdec
from specdec.datasets import mtbench_prompts
from specdec.drafters.eagle_head import load_head
from specdec.heads import shipped_head_path
from specdec.models.loader import load_model
from specdec.speculation.trees import TreeSpec


def load_avg() -> list:
    return list(os.getloadavg())


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--num-prompts", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--tree", default=TreeSpec.DEFAULT)
    p.add_argument("--output", default="benchmarks/out/hf_integration.json")
    args = p.parse_args()
    dtype = getattr(torch, args.dtype)
    model, tok = load_model(None, dtype, args.device)
    head = load_head(shipped_head_path(), model)
    hf_model = load_hf(None, dtype, args.device)
    prompts = mtbench_prompts(args.num_prompts)
    ids = [tok.apply_chat_template([{"role": "user", "content": q}]) for q in prompts]
    eos = tok.eos_token_ids
    n = args.max_new_tokens
    rows = {
        "hf_plain": lambda: run_hf(hf_model, ids, 0.0, 1, n, 0, eos),
        "hf_prompt_lookup": lambda: run_hf(hf_model, ids, 0.0, 1, n, 0, eos, 10),
        "hf_specdec_eagle": lambda: run_hf_specdec(hf_model, head, args.tree, ids, 0.0, n, 0, eos),
        "specdec_eagle": lambda: run_ours(model, tok, head, args.tree, ids, 0.0, 1, n, 0),
    }
    runs: dict = {k: [] for k in rows}
    outputs: dict = {}
    loads = [load_avg()]
    for rep in range(args.reps):
        for name, fn in rows.items():
            r = fn()
            outputs[name] = r.pop("outputs")
            runs[name].append(r)
            print(
                f"rep {rep} {name}: {r['tokens_per_s']:.2f} tok/s, "
                f"acceptance {r['mean_acceptance_length']}",
                file=sys.stderr,
                flush=True,
            )
        loads.append(load_avg())
    base = statistics.median(r["tokens_per_s"] for r in runs["hf_plain"])
    table = {}
    for name, rs in runs.items():
        tps = statistics.median(r["tokens_per_s"] for r in rs)
        acc = rs[-1]["mean_acceptance_length"]
        table[name] = {
            "tokens_per_s_median": tps,
            "tokens_per_s_all": [r["tokens_per_s"] for r in rs],
            "speedup_vs_hf_plain": tps / base,
            "mean_acceptance_length": acc,
            "generated_tokens": rs[-1]["generated_tokens"],
            "same_tokens_as_hf_plain": sum(
                a == b for a, b in zip(outputs[name], outputs["hf_plain"])
            )
            / len(ids),
        }
    import transformers

    result = {
        "config": {
            "command": " ".join(["python", *sys.argv]),
            "num_prompts": len(ids),
            "max_new_tokens": n,
            "batch_size": 1,
            "temperature": 0.0,
            "tree": args.tree,
            "reps": args.reps,
            "dtype": args.dtype,
            "device": args.device,
            "threads": torch.get_num_threads(),
            "transformers": transformers.__version__,
            "torch": torch.__version__,
            "load_avg_1_5_15_per_rep": loads,
            **machine_info(torch.device(args.device)),
        },
        "rows": table,
    }
    os.makedirs(os.path.dirname(os.path.abspath(args.output)), exist_ok=True)
    with open(args.output, "w") as f:
        json.dump(result, f, indent=2)
    print(f"{'method':<20}{'tok/s':>9}{'vs HF':>8}{'accept':>9}  same as HF")
    for name, r in table.items():
        acc = r["mean_acceptance_length"]
        print(
            f"{name:<20}{r['tokens_per_s_median']:>9.2f}{r['speedup_vs_hf_plain']:>8.2f}"
            f"{acc if acc is None else round(acc, 2)!s:>9}  {r['same_tokens_as_hf_plain']}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
