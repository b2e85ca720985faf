"""`specdec bench --drafters plain,eagle,medusa,ngram,eagle+ngram,draft=self:8`: a row per
drafter on MT-bench first turns, split by category (coding, extraction and writing behave
differently).

For every drafter, in one process on the same prompts: a fixed tree and adaptive mode at batch
size 1, greedy and at temperature 1, per category and overall (tokens/s, speedup over our plain
loop and over HF generate, tokens per target forward, acceptance by depth, time split), whether
greedy output is token-identical to plain decoding, and a greedy batch-size sweep of the
adaptive rows. Each category is one `generate` call of an engine built once per row, so a
category's tokens/s is its wall time, not a share of a batch.
"""

import time

import torch

from specdec.bench.common import warm_up
from specdec.bench.hf import run_hf
from specdec.drafters.choice import DrafterChoice
from specdec.runtime.stats import Stats

# the fixed tree of each drafter's fixed-tree row (adaptive rows use --adaptive)
FIXED_TREES = {
    "eagle": "dynamic:5,8,32",
    "medusa": "dynamic:4,4,16",
    "draft": "chain:4",
    "ngram": "dynamic:6,2,13",
    "eagle+ngram": "dynamic:5,8,32",
}


def rows_for(choices: list, adaptive: str) -> list:
    """[(row name, DrafterChoice, tree)]: plain once, then a fixed-tree and an adaptive row per
    speculative drafter."""
    rows = [("plain", DrafterChoice("plain"), "chain:1")]
    for c in choices:
        if c.method == "plain":
            continue
        tree = FIXED_TREES[c.method]
        rows.append((f"{c.name}({tree})", c, tree))
        rows.append((f"{c.name}_adaptive", c, adaptive))
    return rows


def run_row(
    model,
    tokenizer,
    choice,
    tree,
    questions: dict,
    temperature,
    batch_size,
    max_new_tokens,
    seed,
    model_path=None,
) -> dict:
    """One drafter + tree over every category -> {"overall": stats, "by_category": {..},
    "outputs": {category: [token ids]}} (stats: Stats.to_dict plus startup_s)."""
    from specdec.runtime.engine import Engine
    from specdec.runtime.requests import Request, SamplingParams

    prompts = [p for ps in questions.values() for p in ps]
    t0 = time.perf_counter()
    engine = Engine(
        model,
        tokenizer,
        drafter=choice.build(model, model_path),
        tree=tree,
        batch_size=batch_size,
        max_seq_len=max(len(p) for p in prompts) + max_new_tokens + 1,
    )
    startup = time.perf_counter() - t0  # adaptive mode measures its cost model here
    warm_up(engine, prompts)
    by_category, outputs, per_request = {}, {}, []
    time_s, elapsed, i = dict.fromkeys(Stats().time_s, 0.0), 0.0, 0
    for cat, ps in questions.items():
        requests = [
            Request(
                list(p),
                SamplingParams(temperature, seed=seed + i + j, max_new_tokens=max_new_tokens),
            )
            for j, p in enumerate(ps)
        ]
        i += len(ps)
        results, stats = engine.generate(requests)
        by_category[cat] = _row_stats(stats)
        outputs[cat] = [r.token_ids for r in results]
        per_request += [r.stats for r in results]
        elapsed += stats.elapsed_s
        for k, v in stats.time_s.items():
            time_s[k] += v
    overall = _row_stats(Stats.aggregate(per_request, time_s, elapsed))
    overall["startup_s"] = startup
    return {"overall": overall, "by_category": by_category, "outputs": outputs}


def _row_stats(stats) -> dict:
    d = stats.to_dict()
    d.pop("latency", None)  # per-request latency percentiles are the serving benchmark's
    return d


def run_hf_row(hf_model, tokenizer, questions, temperature, max_new_tokens, seed) -> dict:
    by_category, outputs, n, elapsed = {}, {}, 0, 0.0
    for cat, ps in questions.items():
        r = run_hf(hf_model, ps, temperature, 1, max_new_tokens, seed, tokenizer.eos_token_ids)
        outputs[cat] = r.pop("outputs")
        by_category[cat] = r
        n += r["generated_tokens"]
        elapsed += r["elapsed_s"]
    overall = {
        "generated_tokens": n,
        "elapsed_s": elapsed,
        "tokens_per_s": n / elapsed,
        "mean_acceptance_length": None,
    }
    return {"overall": overall, "by_category": by_category, "outputs": outputs}


def run_drafter_bench(
    model,
    tokenizer,
    choices: list,
    questions: dict,
    max_new_tokens: int = 128,
    temperatures=(0.0, 1.0),
    adaptive: str = "adaptive",
    batch_sizes=(1, 4, 16),
    hf_model=None,
    seed: int = 0,
    model_path=None,
    log=print,
) -> dict:
    """questions: {category: [prompt text]} -> {"config", "batch1": {temperature: {row:
    {"overall", "by_category"}}}, "sweep": {row: {batch_size: stats}}}."""
    from specdec.bench.common import machine_info

    ids = {
        cat: [tokenizer.apply_chat_template([{"role": "user", "content": p}]) for p in ps]
        for cat, ps in questions.items()
    }
    weight = model.tok_embeddings.weight
    result = {
        "config": {
            "drafters": [c.name for c in choices],
            "prompts_per_category": {c: len(ps) for c, ps in ids.items()},
            "max_new_tokens": max_new_tokens,
            "fixed_trees": {c.method: FIXED_TREES.get(c.method) for c in choices},
            "adaptive": adaptive,
            "batch_sizes": list(batch_sizes),
            "seed": seed,
            "threads": torch.get_num_threads(),
            "device": str(weight.device),
            "dtype": str(weight.dtype).removeprefix("torch."),
            **machine_info(weight.device),
        },
        "batch1": {},
        "sweep": {},
    }
    rows = rows_for(choices, adaptive)
    for temp in temperatures:
        out = {}
        if hf_model is not None:
            out["hf_plain"] = run_hf_row(hf_model, tokenizer, ids, temp, max_new_tokens, seed)
            log(f"[T={temp}] hf_plain: {out['hf_plain']['overall']['tokens_per_s']:.2f} tok/s")
        for name, choice, tree in rows:
            t0 = time.perf_counter()
            out[name] = run_row(
                model, tokenizer, choice, tree, ids, temp, 1, max_new_tokens, seed, model_path
            )
            o = out[name]["overall"]
            log(
                f"[T={temp}] {name}: {o['tokens_per_s']:.2f} tok/s, "
                f"{o['mean_acceptance_length']:.2f} tokens/forward "
                f"({time.perf_counter() - t0:.0f}s)"
            )
        result["batch1"][str(temp)] = finish(out, greedy=temp == 0)
    mixed = {"all": [p for ps in ids.values() for p in ps]}
    sweep_rows = [r for r in rows if r[0] == "plain" or r[0].endswith("_adaptive")]
    for bs in batch_sizes:
        line = []
        for name, choice, tree in sweep_rows:
            r = run_row(
                model, tokenizer, choice, tree, mixed, 0.0, bs, max_new_tokens, seed, model_path
            )
            result["sweep"].setdefault(name, {})[str(bs)] = r["overall"]
            line.append(f"{name}: {r['overall']['tokens_per_s']:.2f}")
        log(f"[batch {bs}] " + ", ".join(line) + " tok/s")
    for by_bs in result["sweep"].values():
        for bs, r in by_bs.items():
            r["speedup_vs_plain"] = r["tokens_per_s"] / result["sweep"]["plain"][bs]["tokens_per_s"]
    return result


def finish(rows: dict, greedy: bool) -> dict:
    """Adds speedups (overall and per category, vs our plain and HF plain) and, when greedy,
    the share of prompts whose tokens equal our plain loop's; drops the outputs."""
    base = rows["plain"]
    for r in rows.values():
        for part, stats in [("overall", r["overall"])] + list(r["by_category"].items()):
            ref = base["overall"] if part == "overall" else base["by_category"][part]
            stats["speedup_vs_plain"] = stats["tokens_per_s"] / ref["tokens_per_s"]
            if "hf_plain" in rows:
                hf = rows["hf_plain"]
                hf_ref = hf["overall"] if part == "overall" else hf["by_category"][part]
                stats["speedup_vs_hf_plain"] = stats["tokens_per_s"] / hf_ref["tokens_per_s"]
        if greedy:
            pairs = [
                (a, b)
                for cat, outs in r["outputs"].items()
                for a, b in zip(outs, base["outputs"][cat])
            ]
            r["overall"]["same_tokens_as_plain"] = sum(a == b for a, b in pairs) / len(pairs)
    for r in rows.values():
        del r["outputs"]
    return rows


def summary(result: dict) -> str:
    c = result["config"]
    lines = [
        f"{c['machine']}, {c['device']}, {c['dtype']}, {c['threads']} threads; {c['date']}, "
        f"commit {c['commit']}; {sum(c['prompts_per_category'].values())} MT-bench prompts x "
        f"{c['max_new_tokens']} tokens"
    ]
    for temp, rows in result["batch1"].items():
        cats = list(next(iter(rows.values()))["by_category"])
        lines.append(f"== batch 1, temperature {temp}: speedup vs our plain loop ==")
        lines.append(
            f"{'drafter':<30}{'tok/s':>8}{'tok/fwd':>8}{'vs HF':>7}{'exact':>6}  all  "
            + " ".join(f"{k[:5]:>5}" for k in cats)
        )
        for name, r in rows.items():
            o = r["overall"]
            acc = o.get("mean_acceptance_length")
            lines.append(
                f"{name:<30}{o['tokens_per_s']:>8.2f}{acc or float('nan'):>8.2f}"
                f"{o.get('speedup_vs_hf_plain', float('nan')):>7.2f}"
                f"{o.get('same_tokens_as_plain', float('nan')):>6.2f}"
                f" {o['speedup_vs_plain']:>4.2f} "
                + " ".join(f"{r['by_category'][k]['speedup_vs_plain']:>5.2f}" for k in cats)
            )
    lines.append("== greedy batch sweep: tokens/s (speedup vs plain) ==")
    for name, by_bs in result["sweep"].items():
        lines.append(
            f"{name:<30}"
            + "  ".join(
                f"bs{b}: {r['tokens_per_s']:.2f} ({r['speedup_vs_plain']:.2f}x)"
                for b, r in by_bs.items()
            )
        )
    return "\n".join(lines)


def plot(result: dict, prefix: str) -> list:
    """PREFIX_drafters_by_category.png: greedy batch-1 speedup vs plain, per category."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = {k: v for k, v in result["batch1"].get("0.0", {}).items() if k != "plain"}
    if not rows:
        return []
    cats = list(next(iter(rows.values()))["by_category"])
    fig, ax = plt.subplots(figsize=(10, 4.5))
    width = 0.8 / len(rows)
    for i, (name, r) in enumerate(rows.items()):
        ax.bar(
            [c + i * width for c in range(len(cats) + 1)],
            [r["by_category"][k]["speedup_vs_plain"] for k in cats]
            + [r["overall"]["speedup_vs_plain"]],
            width,
            label=name,
        )
    ax.set_xticks([c + 0.4 - width / 2 for c in range(len(cats) + 1)], cats + ["all"])
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set(
        ylabel="tokens/s vs our plain loop", title="Drafters by MT-bench category, greedy, batch 1"
    )
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    path = f"{prefix}_drafters_by_category.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return [path]
