"""`specdec bench --serving`: the online engine under Poisson arrivals.

For each method (our plain loop, the EAGLE tree, adaptive mode) and each arrival rate, a fixed
list of requests (MT-bench first turns, cycled) arrives at exponential inter-arrival times
(seeded); a real-time loop submits each one when its time comes (Engine.submit) and steps the
engine (Engine.step) while anything is queued or active, sleeping when it is idle. Per rate:
TTFT / TPOT / end-to-end latency P50 / P95 / P99 (from the scheduled arrival, so time a request
waited for the loop counts, to the end of the step that emitted its first / last token),
throughput (generated tokens per second from the first
arrival to the last finish), goodput (requests per second that met both SLOs), mean batch
occupancy (time-weighted) and queue length. Writes PREFIX_serving.json and
PREFIX_serving_{latency,throughput}.png.
"""

import time

import numpy as np

from ..stats import percentiles


def poisson_arrivals(n: int, rate: float, seed: int) -> list:
    """n arrival times (seconds from 0) of a Poisson process of `rate` requests per second."""
    gaps = np.random.default_rng(seed).exponential(1.0 / rate, size=n)
    return np.cumsum(gaps).tolist()


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
    }


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
) -> dict:
    """Every method at every rate -> {"config", "methods": {method: {rate: metrics}}}."""
    from ..engine import Engine, Request, SamplingParams
    from .common import machine_info

    weight = model.tok_embeddings.weight
    ids = [list(prompt_ids[i % len(prompt_ids)]) for i in range(num_requests)]
    methods = [("plain", None, "chain:1")]
    if head is not None:
        methods += [(f"eagle_tree({tree})", head, tree), ("eagle_adaptive", head, adaptive)]
    result = {
        "config": {
            "rates": list(rates),
            "num_requests": num_requests,
            "max_new_tokens": max_new_tokens,
            "batch_size": batch_size,
            "tree": tree,
            "adaptive": adaptive,
            "seed": seed,
            "slo_ttft_s": slo_ttft_s,
            "slo_tpot_s": slo_tpot_s,
            "device": str(weight.device),
            "dtype": str(weight.dtype).removeprefix("torch."),
            **machine_info(weight.device),
        },
        "methods": {},
    }
    for name, h, t in methods:
        engine = Engine(
            model,
            tokenizer,
            head=h,
            tree=t,
            batch_size=batch_size,
            max_seq_len=max(len(p) for p in ids) + max_new_tokens + 1,
        )
        engine.generate([Request(ids[0], SamplingParams(max_new_tokens=2))])  # warm-up
        rows = {}
        for rate in rates:
            reqs = [
                Request(p, SamplingParams(max_new_tokens=max_new_tokens, seed=seed + i), id=i)
                for i, p in enumerate(ids)
            ]
            rows[str(rate)] = r = serve(
                engine, reqs, poisson_arrivals(num_requests, rate, seed), slo_ttft_s, slo_tpot_s
            )
            log(
                f"[serving {name} @ {rate} req/s] {r['throughput_tok_s']:.2f} tok/s, goodput "
                f"{r['goodput_req_s']:.3f} req/s, TTFT P50 "
                f"{1000 * r['ttft_s'].get('p50', 0):.0f} ms, "
                f"occupancy {r['mean_occupancy']:.2f}"
            )
        result["methods"][name] = rows
    return result


def summary(result: dict) -> str:
    c = result["config"]
    lines = [
        f"{c['machine']}, {c['device']}, {c['dtype']}; {c['date']}, commit {c['commit']}; "
        f"batch_size "
        f"{c['batch_size']}, {c['num_requests']} requests x {c['max_new_tokens']} tokens, SLO TTFT "
        f"{1000 * c['slo_ttft_s']:.0f} ms / TPOT {1000 * c['slo_tpot_s']:.0f} ms",
        f"{'method':<28}{'rate':>6}{'tok/s':>9}{'goodput':>9}{'occ':>6}"
        f"{'TTFT p50/p95/p99 ms':>22}{'TPOT p50/p95/p99 ms':>22}",
    ]
    for name, rows in result["methods"].items():
        for rate, r in rows.items():

            def ms(p):
                return "/".join(f"{1000 * p.get(k, 0):.0f}" for k in ("p50", "p95", "p99"))

            lines.append(
                f"{name:<28}{rate:>6}{r['throughput_tok_s']:>9.2f}{r['goodput_req_s']:>9.3f}"
                f"{r['mean_occupancy']:>6.2f}{ms(r['ttft_s']):>22}{ms(r['tpot_s']):>22}"
            )
    return "\n".join(lines)


def plot(result: dict, prefix: str) -> list:
    """PREFIX_serving_latency.png (TTFT / TPOT P50 and P99 vs rate) and
    PREFIX_serving_throughput.png (throughput, goodput, occupancy vs rate)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for name, rows in result["methods"].items():
        rates = [float(r) for r in rows]
        for ax, key in zip(axes, ("ttft_s", "tpot_s")):
            (line,) = ax.plot(
                rates,
                [1000 * r[key].get("p50", 0) for r in rows.values()],
                marker="o",
                label=f"{name} P50",
            )
            ax.plot(
                rates,
                [1000 * r[key].get("p99", 0) for r in rows.values()],
                marker="x",
                ls="--",
                color=line.get_color(),
                label=f"{name} P99",
            )
    for ax, title in zip(axes, ("TTFT", "TPOT")):
        ax.set(xlabel="arrival rate (requests/s)", ylabel="ms", title=title)
        ax.legend(fontsize=7)
    paths.append(_save(fig, plt, f"{prefix}_serving_latency.png"))
    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    for name, rows in result["methods"].items():
        rates = [float(r) for r in rows]
        for ax, key in zip(axes, ("throughput_tok_s", "goodput_req_s", "mean_occupancy")):
            ax.plot(rates, [r[key] for r in rows.values()], marker="o", label=name)
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
    return paths


def _save(fig, plt, path):
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
