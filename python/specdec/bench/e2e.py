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

import statistics
import time

import torch

from specdec.bench.common import machine_info, warm_up
from specdec.bench.hf import run_hf, run_hf_specdec
from specdec.speculation.trees import TreeSpec


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
        from specdec.drafters import EagleDrafter, NgramDrafter
        from specdec.drafters.merged import MergedDrafter
        from specdec.runtime.engine import Engine

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
        from specdec.runtime.requests import Request, SamplingParams

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
    from specdec.drafters.eagle_head import EagleHead

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
            from specdec.bench.llamacpp import bench_rows

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
    from specdec.runtime.stats import Stats

    todo = _batch1_methods(head, chain_ks, tree, adaptive, hf_model is not None, temp)
    # (name, run(i, prompt) -> (token ids, seconds, Stats or None, acceptance or None))
    runners: list = []
    if llamacpp_ggufs:
        from specdec.bench.llamacpp import bench_decoders

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
