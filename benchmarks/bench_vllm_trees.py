"""specdec's trees (n-gram, EAGLE, the merged adaptive eagle+ngram) verified inside vLLM's step
against vLLM plain and vLLM's own chains (its EAGLE and n-gram proposers), one engine process per
row (specdec.bench.vllm.run_engine_process), the same prompts and token budget:
tokens/s at batch 1 and with --concurrency requests at once, tokens per target forward,
whether greedy output equals vLLM plain's. The "tree, no drafts" row runs the tree engine
with an n-gram length no prompt matches: every step is a plain step through specdec's
attention backend, which isolates the backend's cost from the drafts' (docs/integration.md,
Trees inside vLLM).

    .venv/bin/python benchmarks/bench_vllm_trees.py --num-prompts 12 --max-new-tokens 64 \
        --concurrency 32 --output benchmarks/out/vllm_trees.json

--repeats N runs the rows N times, interleaved (plain, chain, trees, plain, ...), and prints each
row's median: with vLLM's default processes on a 2-vCPU host one run's figures move by up to
a third (docs/benchmarks.md, Trees inside vLLM).
"""

import argparse
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import write_json  # noqa: E402


def rows(nodes: int) -> dict:
    from specdec.integrations.vllm import speculative_config

    return {
        "vllm_plain": None,
        # vLLM's own chains (its proposers and rejection sampler), the same head and n-grams
        "vllm_eagle_chain_3": speculative_config("eagle", num_speculative_tokens=3),
        "vllm_ngram_chain_4": speculative_config("ngram", num_speculative_tokens=4),
        f"ngram_tree_{nodes}": speculative_config("ngram", tree=True, num_speculative_tokens=nodes),
        f"eagle_tree_{nodes}": speculative_config("eagle", tree=True, num_speculative_tokens=nodes),
        "eagle_ngram_adaptive": speculative_config("eagle+ngram", tree="adaptive"),
        "tree_backend_no_drafts": speculative_config(
            "ngram", tree=True, num_speculative_tokens=nodes, ngram_min=64, ngram_max=64
        ),
    }


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--num-prompts", type=int, default=12)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--nodes", type=int, default=8, help="tree nodes below the root")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--no-specdec", action="store_true", help="skip specdec's own engine rows")
    p.add_argument("--rows", default=None, help="comma-separated row names (default: all)")
    p.add_argument(
        "--in-process",
        action="store_true",
        help="vLLM's engine core and worker in the row's process (VLLM_ENABLE_V1_MULTIPROCESSING"
        "=0), not in processes of their own",
    )
    p.add_argument(
        "--repeats", type=int, default=1, help="runs of every row, interleaved; medians printed"
    )
    p.add_argument("--output", default="benchmarks/out/vllm_trees.json")
    args = p.parse_args(argv)

    from specdec.bench.vllm import run_engine_process
    from specdec.datasets import mtbench_prompts
    from specdec.models.loader import default_model_path, gguf_checkpoint_dir, load_tokenizer

    model_dir = gguf_checkpoint_dir(default_model_path())
    tok = load_tokenizer(model_dir)
    chat = [[{"role": "user", "content": q}] for q in mtbench_prompts(args.num_prompts)]
    prompts = [tok.apply_chat_template(m) for m in chat]
    setting = {
        "model_dir": model_dir,
        "dtype": args.dtype,
        "threads": args.threads,
        "prompt_ids": prompts,
        "max_new_tokens": args.max_new_tokens,
        "concurrency": args.concurrency,
        "eos": sorted(tok.eos_token_ids),
        "seed": 0,
        "enforce_eager": True,
        "in_process": args.in_process,
    }
    results, plain = [], None
    chosen = rows(args.nodes)
    if args.rows:
        wanted = args.rows.split(",")
        unknown = sorted(set(wanted) - set(chosen))
        if unknown:
            p.error(f"--rows: unknown {', '.join(unknown)}; rows are {', '.join(chosen)}")
        chosen = {n: chosen[n] for n in chosen if n in wanted or n == "vllm_plain"}
    if args.repeats < 1:
        p.error(f"--repeats must be >= 1, got {args.repeats}")
    meta = {**{k: v for k, v in setting.items() if k != "prompt_ids"}, "repeats": args.repeats}
    for repeat in range(args.repeats):
        for name, spec in chosen.items():
            out = run_engine_process({**setting, "speculative_config": spec})
            if plain is None:
                plain = out
            for mode in ("batch1", "concurrent"):
                if out[mode] is None:  # --concurrency 0: batch 1 only
                    continue
                row = dict(out[mode])
                outputs = row.pop("outputs")
                row["same_tokens_as_plain"] = sum(
                    a == b for a, b in zip(outputs, plain[mode]["outputs"])
                ) / len(outputs)
                results.append({"row": name, "mode": mode, "repeat": repeat, **row})
                print(
                    f"{name:24s} {mode:10s} {row['tokens_per_s']:8.2f} tok/s "
                    f"{row['tokens_per_forward']:.3f} tok/fwd "
                    f"same={row['same_tokens_as_plain']:.2f}",
                    flush=True,
                )
            write_json(args.output, results, meta)
    if args.repeats > 1:
        print_medians(results)
    if not args.no_specdec:
        results += specdec_rows(args, prompts)
        write_json(args.output, results, meta)


def print_medians(results: list) -> None:
    """Each (row, mode)'s median tokens/s over its repeats, and its ratio to vLLM plain's."""
    runs: dict = {}
    for r in results:
        if "repeat" in r:
            runs.setdefault((r["row"], r["mode"]), []).append(r["tokens_per_s"])
    medians = {key: statistics.median(v) for key, v in runs.items()}
    print("median over repeats:")
    for (name, mode), median in medians.items():
        plain = medians.get(("vllm_plain", mode))
        ratio = f"{median / plain:5.2f}x plain" if plain else ""
        spread = ", ".join(f"{t:.2f}" for t in runs[(name, mode)])
        print(f"{name:24s} {mode:10s} {median:8.2f} tok/s {ratio}  ({spread})", flush=True)


def specdec_rows(args, prompts) -> list:
    """specdec's own engine with the same drafters and tree specs as the vLLM tree rows, batch
    1 on the same prompts: the tokens per target forward trees inside vLLM should match."""
    import torch

    from specdec.bench.common import warm_up
    from specdec.bench.vllm import _specdec_row
    from specdec.drafters.choice import DrafterChoice
    from specdec.models.loader import default_model_path, load_model
    from specdec.runtime.engine import Engine

    torch.set_num_threads(args.threads)
    model, tokenizer = load_model(default_model_path(), dtype=getattr(torch, args.dtype))
    max_len = max(len(p) for p in prompts) + args.max_new_tokens + 1
    rows, plain = [], None
    for name, method, tree in (
        ("specdec_plain", "plain", "chain:1"),
        (f"specdec_eagle_tree_{args.nodes}", "eagle", f"dynamic:4,4,{args.nodes + 1}"),
        ("specdec_eagle_ngram_adaptive", "eagle+ngram", "adaptive:6,8,32"),
    ):
        drafter = DrafterChoice(method).build(model, None)  # None: the default model's heads
        engine = Engine(model, tokenizer, drafter=drafter, tree=tree, max_seq_len=max_len)
        warm_up(engine, prompts)
        row, outputs = _specdec_row(engine, prompts, args.max_new_tokens, 0)
        plain = plain or outputs  # specdec plain's, the first row
        row["same_tokens_as_plain"] = sum(a == b for a, b in zip(outputs, plain)) / len(outputs)
        row["tokens_per_forward"] = row.pop("mean_acceptance_length")
        rows.append({"row": name, "mode": "batch1", **row})
        print(
            f"{name:24s} batch1     {row['tokens_per_s']:8.2f} tok/s "
            f"{row['tokens_per_forward']:.3f} tok/fwd same={row['same_tokens_as_plain']:.2f}",
            flush=True,
        )
    return rows


if __name__ == "__main__":
    main()
