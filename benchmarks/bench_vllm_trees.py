"""N-gram trees verified inside vLLM's step against vLLM plain and the n-gram chain, one engine
process per row (specdec.bench.vllm.run_engine_process), the same prompts and token budget:
tokens/s at batch 1 and with --concurrency requests at once, tokens per target forward,
whether greedy output equals vLLM plain's. The "tree, no drafts" row runs the tree engine
with an n-gram length no prompt matches: every step is a plain step through specdec's
attention backend, which isolates the backend's cost from the drafts' (docs/integration.md,
Trees inside vLLM).

    .venv/bin/python benchmarks/bench_vllm_trees.py --num-prompts 12 --max-new-tokens 64 \
        --concurrency 8 --output benchmarks/out/vllm_trees.json
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import write_json  # noqa: E402


def rows(nodes: int) -> dict:
    from specdec.integrations.vllm import speculative_config

    return {
        "vllm_plain": None,
        "ngram_chain_4": speculative_config("ngram", sampler="specdec", num_speculative_tokens=4),
        f"ngram_tree_{nodes}": speculative_config("ngram", tree=True, num_speculative_tokens=nodes),
        "tree_backend_no_drafts": speculative_config(
            "ngram", tree=True, num_speculative_tokens=nodes, ngram_min=64, ngram_max=64
        ),
    }


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--num-prompts", type=int, default=12)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--nodes", type=int, default=8, help="tree nodes below the root")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--threads", type=int, default=2)
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
    }
    results, plain = [], None
    for name, spec in rows(args.nodes).items():
        out = run_engine_process({**setting, "speculative_config": spec})
        if plain is None:
            plain = out
        for mode in ("batch1", "concurrent"):
            row = dict(out[mode])
            outputs = row.pop("outputs")
            row["same_tokens_as_plain"] = sum(
                a == b for a, b in zip(outputs, plain[mode]["outputs"])
            ) / len(outputs)
            results.append({"row": name, "mode": mode, **row})
            print(
                f"{name:24s} {mode:10s} {row['tokens_per_s']:8.2f} tok/s "
                f"{row['tokens_per_forward']:.3f} tok/fwd same={row['same_tokens_as_plain']:.2f}",
                flush=True,
            )
        write_json(args.output, results, {k: v for k, v in setting.items() if k != "prompt_ids"})


if __name__ == "__main__":
    main()
