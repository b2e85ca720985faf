"""`specdec bench --serving`: the online engine under Poisson arrivals.

For each method (our plain loop, the EAGLE tree, EAGLE adaptive mode, optionally n-gram
adaptive mode) and each arrival rate, a fixed list of requests (a seeded interleaving of
MT-bench and ShareGPT first turns, cycled) arrives at exponential inter-arrival times (seeded);
a real-time loop submits each one when its time comes (Engine.submit) and steps the engine
(Engine.step) while anything is queued or active, sleeping when it is idle.

Rates: explicit, or "auto": our plain loop's saturated throughput is measured offline first
(measure_capacity: every slot full) and the sweep is that capacity (requests/s) times
MULTIPLIERS, from light load to past saturation. Requests per rate: --num-requests, capped at
rate x max_rate_seconds (arrivals spanning about that long, so light-load points do not take
forever) but never below MIN_REQUESTS (requests_at).

Per rate: TTFT / TPOT / end-to-end latency P50 / P95 / P99 (from the scheduled arrival, so time
a request waited for the loop counts, to the end of the step that emitted its first / last
token), throughput (generated tokens per second from the first arrival to the last finish),
goodput (requests per second that met both SLOs), mean batch occupancy (time-weighted), queue
length, tokens per target forward (mean acceptance length) and the time split of the steps
(prefill / draft / verify / sample / compact, Engine.timing). Analysis (analyze, pure
functions of the result): where each fixed tree starts losing to plain decoding (crossover),
adaptive mode against the better of plain and the best fixed tree at every rate
(adaptive_vs_best), and the light-load TPOT cut (light_load_cut) against the batch-1 speedup
each adaptive method shows offline (measure_offline_batch1, when asked for). Writes
PREFIX_serving.json and PREFIX_serving_{latency,throughput,crossover}.png.
"""

import math
import random
import time

import numpy as np

from specdec.bench.common import warm_up
from specdec.errors import InvalidRequestError
from specdec.runtime.stats import PHASES, Stats, percentiles

MULTIPLIERS = (0.1, 0.3, 0.6, 0.9, 1.2, 1.6)  # auto rates: times the measured plain capacity
MIN_REQUESTS = 8  # requests per rate never go below this (nor above --num-requests)
TOLERANCE = 0.03  # adaptive mode: within 3% of the better of plain and the best fixed tree


def poisson_arrivals(n: int, rate: float, seed: int) -> list:
    """n arrival times (seconds from 0) of a Poisson process of `rate` requests per second."""
    gaps = np.random.default_rng(seed).exponential(1.0 / rate, size=n)
    return np.cumsum(gaps).tolist()


def auto_rates(capacity_req_s: float, multipliers=MULTIPLIERS) -> list:
    """The sweep: capacity (requests/s) x each multiplier, to 4 significant digits."""
    if not capacity_req_s > 0 or math.isinf(capacity_req_s):
        raise InvalidRequestError(f"capacity must be a positive number, got {capacity_req_s!r}")
    return [float(f"{capacity_req_s * m:.4g}") for m in multipliers]


def requests_at(
    rate: float, num_requests: int, max_rate_seconds: float | None, min_requests=MIN_REQUESTS
) -> int:
    """Requests to send at `rate`: num_requests, capped at rate x max_rate_seconds (None: no
    cap) but at least min(min_requests, num_requests)."""
    if max_rate_seconds is None:
        return num_requests
    return min(num_requests, max(min_requests, math.ceil(rate * max_rate_seconds)))


def mix_prompts(mtbench: list, sharegpt: list, seed: int) -> tuple:
    """Both prompt lists in one order shuffled by seed (deterministic) -> (prompts, sources),
    sources[i] "mtbench" or "sharegpt"."""
    tagged = [(p, "mtbench") for p in mtbench] + [(p, "sharegpt") for p in sharegpt]
    random.Random(seed).shuffle(tagged)
    return [p for p, _ in tagged], [src for _, src in tagged]


def _requests(ids: list, n: int, max_new_tokens: int, seed: int) -> list:
    """n greedy requests cycling through the prompts; the same ones at every rate."""
    from specdec.runtime.requests import Request, SamplingParams

    return [
        Request(
            list(ids[i % len(ids)]),
            SamplingParams(max_new_tokens=max_new_tokens, seed=seed + i),
            id=i,
        )
        for i in range(n)
    ]


def measure_capacity(
    model, tokenizer, prompt_ids: list, batch_size: int, max_new_tokens: int, seed=0, rounds=2
) -> dict:
    """Our plain loop's saturated throughput, offline: rounds x batch_size of the serving
    requests through Engine.generate, every slot taken while the queue lasts -> {"tokens_per_s",
    "mean_generated_tokens", "requests_per_s" (tokens_per_s / mean_generated_tokens: the
    arrival rate plain decoding can keep up with), "num_requests", "elapsed_s"}."""
    reqs = _requests(prompt_ids, rounds * batch_size, max_new_tokens, seed)
    max_seq_len = max(len(r.prompt_ids) for r in reqs) + max_new_tokens + 1
    engine = _engine(model, tokenizer, {"tree": "chain:1"}, batch_size, max_seq_len)
    warm_up(engine, [r.prompt_ids for r in reqs])
    t0 = time.perf_counter()
    results, _ = engine.generate(reqs)
    elapsed = time.perf_counter() - t0
    tokens = sum(r.stats.generated_tokens for r in results)
    mean_tokens = tokens / len(results)
    tok_s = tokens / elapsed
    return {
        "tokens_per_s": tok_s,
        "mean_generated_tokens": mean_tokens,
        "requests_per_s": tok_s / mean_tokens,
        "num_requests": len(results),
        "elapsed_s": elapsed,
        "measured": True,
    }


def serve(
    engine,
    requests: list,
    arrivals: list,
    slo_ttft_s: float,
    slo_tpot_s: float,
    clock=time.perf_counter,
    sleep=time.sleep,
) -> dict:
    """Submits requests[i] at arrivals[i] (seconds from the start) and steps the engine until
    every one finished -> the serving metrics (see the module docstring)."""
    n = len(requests)
    handles, by_id = [None] * n, {}
    first, end = (
        [None] * n,
        [None] * n,
    )  # clock times (from t0) at the end of the step that emitted them
    busy_s = occupancy_s = queue_s = 0.0
    steps, i, running = 0, 0, set()
    with engine.timing() as timer:  # the steps' time split, as engine.generate reports it
        t0 = clock()
        while i < n or engine.has_work:
            now = clock() - t0
            while i < n and arrivals[i] <= now:
                handles[i] = engine.submit(requests[i])
                by_id[handles[i].request_id] = i
                running.add(i)
                i += 1
            if not engine.has_work:
                sleep(max(0.0, arrivals[i] - (clock() - t0)))
                continue
            waiting = engine.num_active + engine.num_queued
            batch = min(
                engine.batch_size, waiting
            )  # the requests this step runs (queued ones join first)
            s0 = clock()
            gained = engine.step()
            t = clock()
            dt = t - s0
            steps += 1
            busy_s += dt
            occupancy_s += batch * dt
            queue_s += (waiting - batch) * dt
            for rid in gained:
                k = by_id[rid]
                if first[k] is None:
                    first[k] = t - t0
            for k in [
                k for k in running if handles[k].done
            ]:  # finished in this step (with or without tokens)
                end[k] = t - t0
                running.discard(k)
    makespan = clock() - t0 - arrivals[0] if n else 0.0
    ttft, tpot, e2e, good, tokens = [], [], [], 0, 0
    for k, h in enumerate(handles):
        m = h.result.stats.generated_tokens
        if first[k] is None:  # no token (a request that failed at once)
            first[k] = end[k]
        ttft.append(first[k] - arrivals[k])
        e2e.append(end[k] - arrivals[k])
        step_s = (end[k] - first[k]) / (m - 1) if m > 1 else 0.0
        if m > 1:
            tpot.append(step_s)
        tokens += m
        good += ttft[-1] <= slo_ttft_s and step_s <= slo_tpot_s
    split = Stats.aggregate([h.result.stats for h in handles], timer.time_s, makespan)
    total = sum(timer.time_s.values())
    return {
        "num_requests": n,
        "generated_tokens": tokens,
        "steps": steps,
        "makespan_s": makespan,
        "throughput_tok_s": tokens / makespan if makespan > 0 else 0.0,
        "request_rate_achieved": n / makespan if makespan > 0 else 0.0,
        "goodput_req_s": good / makespan if makespan > 0 else 0.0,
        "slo_attained": good / n if n else 0.0,
        "ttft_s": percentiles(ttft),
        "tpot_s": percentiles(tpot),
        "e2e_s": percentiles(e2e),
        "ttft_mean_s": float(np.mean(ttft)) if ttft else 0.0,
        "mean_occupancy": occupancy_s / busy_s if busy_s else 0.0,
        "mean_queued": queue_s / busy_s if busy_s else 0.0,
        "busy_fraction": busy_s / makespan if makespan else 0.0,
        # tokens emitted per target verify forward (1 for plain decoding)
        "tokens_per_forward": split.mean_acceptance_length,
        "target_forwards": split.target_forwards,
        "nodes_per_step": split.nodes_per_step,
        "time_s": dict(timer.time_s),
        "time_share": {p: (timer.time_s[p] / total if total else 0.0) for p in PHASES},
        "busy_s": busy_s,  # steps' wall time; busy_s - sum(time_s): the loop's own overhead
    }


def _engine(model, tokenizer, kw: dict, batch_size: int, max_seq_len: int):
    """One method's Engine (kw: head= or drafter= (a factory: a fresh drafter), tree=)."""
    from specdec.runtime.engine import Engine

    kw = dict(kw, drafter=kw["drafter"]()) if "drafter" in kw else kw
    return Engine(model, tokenizer, batch_size=batch_size, max_seq_len=max_seq_len, **kw)


def measure_offline_batch1(
    model, tokenizer, prompt_ids: list, methods: list, max_new_tokens: int, n: int, seed=0
) -> dict:
    """The batch-1 speedup each method shows offline, the yardstick for its light-load TPOT
    cut: the first n serving requests one at a time (Engine.generate, batch_size 1) with plain
    decoding and each method -> {method: {"tpot_p50_s", "tokens_per_s", "speedup" (plain's P50
    TPOT / its own)}}. methods: [(name, engine kwargs)], plain first."""
    reqs = _requests(prompt_ids, n, max_new_tokens, seed)
    max_seq_len = max(len(r.prompt_ids) for r in reqs) + max_new_tokens + 1
    out = {}
    for name, kw in methods:
        engine = _engine(model, tokenizer, kw, 1, max_seq_len)
        warm_up(engine, [r.prompt_ids for r in reqs])
        _, stats = engine.generate(_requests(prompt_ids, n, max_new_tokens, seed))
        out[name] = {
            "tpot_p50_s": stats.latency.get("tpot_s", {}).get("p50"),
            "tokens_per_s": stats.tokens_per_s,
            "num_requests": n,
        }
    plain = out[methods[0][0]]["tpot_p50_s"]
    for v in out.values():
        v["speedup"] = plain / v["tpot_p50_s"] if plain and v["tpot_p50_s"] else None
    return out


def run_serving(
    model,
    tokenizer,
    head,
    prompt_ids: list,
    rates,
    num_requests: int,
    max_new_tokens: int,
    batch_size: int,
    tree: str,
    adaptive: str,
    slo_ttft_s: float,
    slo_tpot_s: float,
    seed: int = 0,
    log=print,
    max_rate_seconds: float | None = None,
    min_requests: int = MIN_REQUESTS,
    capacity: float | None = None,
    multipliers=MULTIPLIERS,
    ngram=None,
    offline_requests: int = 0,
) -> dict:
    """Every method at every rate -> {"config", "methods": {method: {rate: metrics}},
    "analysis"}.

    rates: requests/s, or "auto": capacity (requests/s; None: measure_capacity) x multipliers.
    Requests per rate: requests_at(rate, num_requests, max_rate_seconds, min_requests).
    ngram: None, or a callable -> a fresh n-gram Drafter (adds "ngram_adaptive").
    offline_requests > 0: first measure_offline_batch1 of plain and the adaptive methods on
    that many requests (config "offline_batch1"; light_load_cut compares against it). config
    records the capacity, the rates, the requests per rate and each method's kind ("plain",
    "fixed", "adaptive") and drafter, which the analysis reads."""
    from specdec.bench.common import machine_info

    weight = model.tok_embeddings.weight
    cap = None
    if capacity is not None:
        cap = {"requests_per_s": float(capacity), "measured": False}
    if isinstance(rates, str):
        if rates != "auto":
            raise InvalidRequestError(f"rates must be 'auto' or a list of numbers, got {rates!r}")
        if cap is None:
            cap = measure_capacity(model, tokenizer, prompt_ids, batch_size, max_new_tokens, seed)
            log(
                f"[serving capacity] plain, {batch_size} slots full: {cap['tokens_per_s']:.2f} "
                f"tok/s / {cap['mean_generated_tokens']:.1f} tokens per request = "
                f"{cap['requests_per_s']:.3f} req/s"
            )
        rates = auto_rates(cap["requests_per_s"], multipliers)
    else:
        rates, multipliers = [float(r) for r in rates], None
    if not rates or min(rates) <= 0:
        raise InvalidRequestError(f"rates must be positive, got {rates!r}")
    counts = {r: requests_at(r, num_requests, max_rate_seconds, min_requests) for r in rates}
    methods = [("plain", "plain", "plain", {"tree": "chain:1"})]
    if head is not None:
        methods += [
            (f"eagle_tree({tree})", "fixed", "eagle", {"head": head, "tree": tree}),
            ("eagle_adaptive", "adaptive", "eagle", {"head": head, "tree": adaptive}),
        ]
    if ngram is not None:
        methods.append(
            ("ngram_adaptive", "adaptive", "ngram", {"drafter": ngram, "tree": adaptive})
        )
    result = {
        "config": {
            "rates": list(rates),
            "rate_multipliers": list(multipliers) if multipliers is not None else None,
            "capacity": cap,
            "num_requests": num_requests,
            "max_rate_seconds": max_rate_seconds,
            "min_requests": min_requests,
            "requests_per_rate": {str(r): n for r, n in counts.items()},
            "max_new_tokens": max_new_tokens,
            "batch_size": batch_size,
            "tree": tree,
            "adaptive": adaptive,
            "methods": {
                name: {"kind": kind, "drafter": drafter, "tree": kw["tree"]}
                for name, kind, drafter, kw in methods
            },
            "seed": seed,
            "slo_ttft_s": slo_ttft_s,
            "slo_tpot_s": slo_tpot_s,
            "device": str(weight.device),
            "dtype": str(weight.dtype).removeprefix("torch."),
            **machine_info(weight.device),
        },
        "methods": {},
    }
    if offline_requests > 0:
        offline = [(name, kw) for name, kind, _, kw in methods if kind in ("plain", "adaptive")]
        result["config"]["offline_batch1"] = b1 = measure_offline_batch1(
            model, tokenizer, prompt_ids, offline, max_new_tokens, offline_requests, seed
        )
        log(
            "[serving offline batch 1] P50 TPOT speedup over plain: "
            + ", ".join(f"{m} {v['speedup'] or 0:.2f}x" for m, v in b1.items())
        )
    longest = max(len(p) for p in prompt_ids[: max(counts.values())])
    for name, _, _, kw in methods:
        engine = _engine(model, tokenizer, kw, batch_size, longest + max_new_tokens + 1)
        warm_up(engine, prompt_ids[: max(counts.values())])
        rows = {}
        for rate in rates:
            n = counts[rate]
            reqs = _requests(prompt_ids, n, max_new_tokens, seed)
            rows[str(rate)] = r = serve(
                engine, reqs, poisson_arrivals(n, rate, seed), slo_ttft_s, slo_tpot_s
            )
            if cap is not None:
                r["load"] = rate / cap["requests_per_s"]
            log(
                f"[serving {name} @ {rate} req/s, {n} requests] {r['throughput_tok_s']:.2f} "
                f"tok/s, goodput {r['goodput_req_s']:.3f} req/s, TPOT P50 "
                f"{1000 * r['tpot_s'].get('p50', 0):.0f} ms, occupancy "
                f"{r['mean_occupancy']:.2f}, {r['tokens_per_forward']:.2f} tokens/forward"
            )
        result["methods"][name] = rows
    result["analysis"] = analyze(result)
    return result


# ---------------------------------------------------------------------- analysis (pure)
def _kinds(result: dict, kind: str) -> list:
    return [m for m, c in result["config"]["methods"].items() if c["kind"] == kind]


def _points(rows: dict) -> list:
    """[(rate, row)] in increasing rate."""
    return sorted(((float(r), row) for r, row in rows.items()), key=lambda x: x[0])


def _value(row: dict, metric: str):
    """The metric of one rate's row; None where it is missing."""
    if metric == "throughput":
        return row.get("throughput_tok_s")
    key, _, q = metric.rpartition("_")  # "tpot_p50" -> tpot_s, p50
    return row.get(f"{key}_s", {}).get(q)


HIGHER_IS_BETTER = {"throughput": True, "tpot_p50": False, "tpot_p99": False}


def ratio_vs_plain(result: dict, method: str, metric: str) -> list:
    """[(rate, method's metric / plain's)] at the rates where both have it (and plain's > 0)."""
    plain = dict(_points(result["methods"]["plain"]))
    out = []
    for rate, row in _points(result["methods"][method]):
        v, p = _value(row, metric), _value(plain.get(rate, {}), metric)
        if v is not None and p:
            out.append((rate, v / p))
    return out


def crossover(result: dict, method: str, metric: str = "throughput") -> dict:
    """Where `method` starts losing to plain decoding on `metric` ("throughput", "tpot_p50"),
    on its ratio to plain's (a tie is not a loss) -> {"rate": the lowest rate at which it is
    strictly worse, linearly interpolated in the rate between the sweep point before (not
    worse) and that one; "sustained_rate": the same for the rate from which it stays worse up
    to the end of the sweep (differs from rate when a light-load loss, e.g. noise while
    throughput only follows the arrivals, is followed by a win; None when the last point is
    not a loss); "load" / "sustained_load": those / the capacity (None without one);
    "below_sweep": already worse at the lightest rate (rate is that one); "max_rate"}. rate
    None: it never loses within the sweep."""
    sign = 1.0 if HIGHER_IS_BETTER[metric] else -1.0
    pts = [(r, sign * (x - 1.0)) for r, x in ratio_vs_plain(result, method, metric)]
    out = {
        "rate": None,
        "load": None,
        "sustained_rate": None,
        "sustained_load": None,
        "below_sweep": False,
        "max_rate": pts[-1][0] if pts else None,
    }

    def at(i):  # the rate where the loss that begins at point i begins
        if i == 0:
            return pts[0][0]
        (r0, g0), (r1, g1) = pts[i - 1], pts[i]  # g0 >= 0 > g1
        return r0 + (r1 - r0) * g0 / (g0 - g1)

    losses = [i for i, (_, g) in enumerate(pts) if g < 0]
    if losses:
        out["rate"], out["below_sweep"] = at(losses[0]), losses[0] == 0
    if pts and pts[-1][1] < 0:
        wins = [i for i, (_, g) in enumerate(pts) if g >= 0]
        out["sustained_rate"] = at(wins[-1] + 1 if wins else 0)
    cap = (result["config"].get("capacity") or {}).get("requests_per_s")
    for key in ("rate", "sustained_rate"):
        if out[key] is not None and cap:
            out[key.replace("rate", "load")] = out[key] / cap
    return out


def adaptive_vs_best(result: dict, method: str, tolerance: float = TOLERANCE) -> list:
    """Per rate: the adaptive method's throughput / max(plain's, the best fixed tree's) and its
    P99 TPOT / min(plain's, the best fixed tree's), and whether each is within `tolerance`
    (throughput ratio >= 1 - tolerance, P99 ratio <= 1 + tolerance). Fixed trees: those of
    the same drafter, else all of them."""
    cfg = result["config"]["methods"]
    fixed = _kinds(result, "fixed")
    fixed = [m for m in fixed if cfg[m]["drafter"] == cfg[method]["drafter"]] or fixed
    rivals = ["plain", *fixed]
    table = {m: dict(_points(result["methods"][m])) for m in rivals}
    out = []
    for rate, row in _points(result["methods"][method]):
        entry = {"rate": rate, "load": row.get("load")}
        for metric, key, best_of in (
            ("throughput", "throughput", max),
            ("tpot_p99", "tpot_p99", min),
        ):
            values = {m: _value(table[m][rate], metric) for m in rivals if rate in table[m]}
            values = {m: v for m, v in values.items() if v is not None}
            mine = _value(row, metric)
            if not values or mine is None or not best_of(values.values()):
                entry.update({f"{key}_ratio": None, f"{key}_within": None, f"{key}_best": None})
                continue
            best = best_of(values, key=values.get)
            ratio = mine / values[best]
            within = ratio >= 1 - tolerance if HIGHER_IS_BETTER[metric] else ratio <= 1 + tolerance
            entry.update({f"{key}_ratio": ratio, f"{key}_within": within, f"{key}_best": best})
        out.append(entry)
    return out


def light_load_cut(result: dict, method: str) -> dict:
    """At the lowest rate: plain's P50 TPOT / the method's (> 1: the method is faster), and
    whether that is at least the method's offline batch-1 speedup when the config has it
    ("offline_batch1"; None otherwise)."""
    offline = (result["config"].get("offline_batch1") or {}).get(method, {}).get("speedup")
    out = {
        "rate": None,
        "plain_tpot_p50_s": None,
        "tpot_p50_s": None,
        "cut": None,
        "offline_speedup": offline,
        "meets_offline": None,
    }
    pts = _points(result["methods"][method])
    if not pts:
        return out
    rate, row = pts[0]
    mine = _value(row, "tpot_p50")
    plain = _value(dict(_points(result["methods"]["plain"])).get(rate, {}), "tpot_p50")
    cut = plain / mine if plain is not None and mine else None
    out.update(rate=rate, plain_tpot_p50_s=plain, tpot_p50_s=mine, cut=cut)
    if cut is not None and offline is not None:
        out["meets_offline"] = cut >= offline
    return out


def analyze(result: dict, tolerance: float = TOLERANCE) -> dict:
    """{"crossover": {metric: {fixed method: crossover}}, "adaptive_vs_best": {adaptive method:
    {"points": [...], "all_within": bool}}, "light_load": {adaptive method: light_load_cut},
    "tolerance"}."""
    fixed, adaptive = _kinds(result, "fixed"), _kinds(result, "adaptive")
    vs = {}
    for m in adaptive:
        pts = adaptive_vs_best(result, m, tolerance)
        flags = [p[k] for p in pts for k in ("throughput_within", "tpot_p99_within")]
        vs[m] = {"points": pts, "all_within": bool(flags) and all(f is True for f in flags)}
    return {
        "tolerance": tolerance,
        "crossover": {
            metric: {m: crossover(result, m, metric) for m in fixed}
            for metric in ("throughput", "tpot_p50")
        },
        "adaptive_vs_best": vs,
        "light_load": {m: light_load_cut(result, m) for m in adaptive},
    }


def summary(result: dict) -> str:
    c = result["config"]
    cap = c.get("capacity")
    lines = [
        f"{c['machine']}, {c['device']}, {c['dtype']}; {c['date']}, commit {c['commit']}; "
        f"batch_size {c['batch_size']}, up to {c['num_requests']} requests per rate x "
        f"{c['max_new_tokens']} tokens, SLO TTFT {1000 * c['slo_ttft_s']:.0f} ms / TPOT "
        f"{1000 * c['slo_tpot_s']:.0f} ms",
    ]
    if cap:
        how = "measured" if cap.get("measured") else "given"
        lines.append(
            f"plain capacity ({how}): {cap['requests_per_s']:.3f} req/s; rates "
            + ", ".join(f"{r:g}" for r in c["rates"])
            + (
                f" (x {', '.join(f'{m:g}' for m in c['rate_multipliers'])})"
                if c.get("rate_multipliers")
                else ""
            )
        )
    if c.get("prompt_mix"):
        lines.append("prompts: " + ", ".join(f"{k} {v}" for k, v in c["prompt_mix"].items()))
    lines.append(
        f"{'method':<28}{'rate':>7}{'n':>4}{'tok/s':>9}{'goodput':>9}{'occ':>6}{'tok/fw':>7}"
        f"{'TTFT p50/p95/p99 ms':>21}{'TPOT p50/p95/p99 ms':>21}  draft/verify/other %"
    )

    def ms(p):
        return "/".join(f"{1000 * p.get(k, 0):.0f}" for k in ("p50", "p95", "p99"))

    for name, rows in result["methods"].items():
        for rate, r in rows.items():
            share = r.get("time_share", {})
            d, v = 100 * share.get("draft", 0), 100 * share.get("verify", 0)
            lines.append(
                f"{name:<28}{rate:>7}{r['num_requests']:>4}{r['throughput_tok_s']:>9.2f}"
                f"{r['goodput_req_s']:>9.3f}{r['mean_occupancy']:>6.2f}"
                f"{r.get('tokens_per_forward', 0):>7.2f}{ms(r['ttft_s']):>21}"
                f"{ms(r['tpot_s']):>21}  {d:.0f}/{v:.0f}/{100 - d - v:.0f}"
            )
    lines += _analysis_lines(result.get("analysis"))
    return "\n".join(lines)


def _analysis_lines(a: dict | None) -> list:
    if not a:
        return []
    lines = []
    for metric, label in (("throughput", "throughput"), ("tpot_p50", "P50 TPOT")):
        for m, x in a["crossover"][metric].items():
            if x["rate"] is None:
                where = (
                    f"never loses to plain within the sweep (up to {x['max_rate']:g} req/s)"
                    if x["max_rate"] is not None
                    else "no data"
                )
            else:
                load = f" (load {x['load']:.2f})" if x["load"] is not None else ""
                where = f"loses to plain from {x['rate']:.3g} req/s{load}" + (
                    ", already at the lightest rate" if x["below_sweep"] else ""
                )
                if x["sustained_rate"] is None:
                    where += ", but not at the heaviest"
                elif x["sustained_rate"] != x["rate"]:
                    where += f"; for good from {x['sustained_rate']:.3g} req/s"
            lines.append(f"crossover ({label}): {m} {where}")
    tol = 100 * a["tolerance"]
    for m, v in a["adaptive_vs_best"].items():
        cells = []
        for p in v["points"]:

            def f(key, p=p):
                r = p[f"{key}_ratio"]
                return "-" if r is None else f"{r:.3f}{'' if p[f'{key}_within'] else '!'}"

            cells.append(f"{p['rate']:g}: {f('throughput')}/{f('tpot_p99')}")
        lines.append(
            f"{m} vs the better of plain and the best fixed tree (throughput / P99 TPOT ratio, "
            f"! = beyond {tol:g}%): "
            + ", ".join(cells)
            + ("; all within" if v["all_within"] else "; NOT all within")
        )
    for m, x in a["light_load"].items():
        if x["cut"] is not None:
            lines.append(
                f"{m} at the lightest rate ({x['rate']:g} req/s): P50 TPOT "
                f"{1000 * x['tpot_p50_s']:.0f} ms vs plain {1000 * x['plain_tpot_p50_s']:.0f} ms "
                f"= {x['cut']:.2f}x cut"
                + (
                    ""
                    if x.get("offline_speedup") is None
                    else f" (offline batch-1 speedup {x['offline_speedup']:.2f}x: "
                    + ("met)" if x["meets_offline"] else "NOT met)")
                )
            )
    return lines


def plot(result: dict, prefix: str) -> list:
    """PREFIX_serving_latency.png (TTFT / TPOT / end-to-end P50 and P99 vs rate),
    PREFIX_serving_throughput.png (throughput, goodput, occupancy vs rate) and
    PREFIX_serving_crossover.png (each method's throughput and P50 TPOT over plain's vs load,
    rate / capacity when known, the fixed trees' crossovers marked)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    for name, rows in result["methods"].items():
        pts = _points(rows)
        rates = [r for r, _ in pts]
        for ax, key in zip(axes, ("ttft_s", "tpot_s", "e2e_s")):
            (line,) = ax.plot(
                rates,
                [1000 * r[key].get("p50", 0) for _, r in pts],
                marker="o",
                label=f"{name} P50",
            )
            ax.plot(
                rates,
                [1000 * r[key].get("p99", 0) for _, r in pts],
                marker="x",
                ls="--",
                color=line.get_color(),
                label=f"{name} P99",
            )
    for ax, title in zip(axes, ("TTFT", "TPOT", "end-to-end latency")):
        ax.set(xlabel="arrival rate (requests/s)", ylabel="ms", title=title)
        ax.legend(fontsize=7)
    paths.append(_save(fig, plt, f"{prefix}_serving_latency.png"))
    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    for name, rows in result["methods"].items():
        pts = _points(rows)
        for ax, key in zip(axes, ("throughput_tok_s", "goodput_req_s", "mean_occupancy")):
            ax.plot([r for r, _ in pts], [r[key] for _, r in pts], marker="o", label=name)
    for ax, (title, unit) in zip(
        axes,
        (
            ("throughput", "tokens/s"),
            ("goodput (both SLOs met)", "requests/s"),
            ("mean batch occupancy", "active requests"),
        ),
    ):
        ax.set(xlabel="arrival rate (requests/s)", ylabel=unit, title=title)
        ax.legend(fontsize=7)
    paths.append(_save(fig, plt, f"{prefix}_serving_throughput.png"))
    paths.append(_plot_crossover(result, plt, f"{prefix}_serving_crossover.png"))
    return paths


def _plot_crossover(result: dict, plt, path: str) -> str:
    cap = (result["config"].get("capacity") or {}).get("requests_per_s")
    scale = 1.0 / cap if cap else 1.0
    analysis = analyze(result)  # pure: recomputed, so older JSON files plot too
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, metric, title in (
        (axes[0], "throughput", "throughput / plain's (higher is better)"),
        (axes[1], "tpot_p50", "P50 TPOT / plain's (lower is better)"),
    ):
        ax.axhline(1.0, color="gray", lw=1, label="plain")
        for name in result["methods"]:
            if name == "plain":
                continue
            pts = ratio_vs_plain(result, name, metric)
            (line,) = ax.plot(
                [r * scale for r, _ in pts], [x for _, x in pts], marker="o", label=name
            )
            x = analysis["crossover"][metric].get(name)
            if x and x["rate"] is not None:
                ax.axvline(x["rate"] * scale, color=line.get_color(), ls=":", lw=1)
                ax.plot([x["rate"] * scale], [1.0], marker="D", color=line.get_color())
                ax.annotate(
                    f"crossover {x['rate'] * scale:.2g}",
                    (x["rate"] * scale, 1.0),
                    textcoords="offset points",
                    xytext=(4, 6),
                    fontsize=7,
                    color=line.get_color(),
                )
            if x and x["sustained_rate"] not in (None, x["rate"]):
                ax.plot([x["sustained_rate"] * scale], [1.0], marker="X", color=line.get_color())
                ax.annotate(
                    f"for good {x['sustained_rate'] * scale:.2g}",
                    (x["sustained_rate"] * scale, 1.0),
                    textcoords="offset points",
                    xytext=(4, -12),
                    fontsize=7,
                    color=line.get_color(),
                )
        xlabel = "load (arrival rate / plain capacity)" if cap else "arrival rate (requests/s)"
        ax.set(xlabel=xlabel, ylabel="ratio to plain", title=title)
        ax.legend(fontsize=7)
    return _save(fig, plt, path)


def _save(fig, plt, path):
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
