"""specdec.apps.bench on a tiny random Llama shared by transformers and our loader: JSON fields,
speedup bookkeeping, greedy exactness of every method against our plain loop, the plots."""

import json
import os

import pytest
import torch

from specdec.apps.bench import plot, run_bench, summary
from specdec.eagle import EagleHead
from specdec.loader import load_checkpoint_dir

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.usefixtures("single_thread")
VOCAB = 64


class CharTokenizer:
    eos_token_ids = {1}

    def apply_chat_template(self, messages, add_generation_prompt=True):
        return [2] + [3 + ord(c) % (VOCAB - 3) for c in messages[-1]["content"]]

    def decode(self, ids, skip_special_tokens=True):
        return " ".join(map(str, ids))


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """(ours, transformers') over the same random weights."""
    cfg = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for p in hf.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.3)
    path = str(tmp_path_factory.mktemp("tiny_llama"))
    hf.save_pretrained(path)
    return load_checkpoint_dir(path), hf


def test_quick_bench_json_fields_and_plots(models, tmp_path):
    ours, hf = models
    head = EagleHead.random(ours, version=2, seed=0)
    result = run_bench(
        ours,
        CharTokenizer(),
        head,
        ["Why is the sky blue?"],
        max_new_tokens=6,
        temperatures=(0.0, 1.0),
        chain_ks=(2,),
        tree="dynamic:2,2,4",
        batch_sizes=(1, 2),
        hf_model=hf,
        log=lambda m: None,
        adaptive="adaptive:2,2,4",
    )
    json.dumps(result)  # JSON-ready
    greedy, sampled = result["batch1"]["0.0"], result["batch1"]["1.0"]
    assert list(greedy) == [
        "hf_plain",
        "hf_prompt_lookup",
        "plain",
        "eagle_chain2",
        "eagle_tree(dynamic:2,2,4)",
        "eagle_adaptive",
    ]
    assert "hf_prompt_lookup" not in sampled and "eagle_chain2" in sampled
    for name, r in greedy.items():
        assert r["same_tokens_as_plain"] == 1.0, name  # every method decodes the same greedy text
        assert r["generated_tokens"] >= 1 and r["tokens_per_s"] > 0
        assert r["speedup_vs_hf_plain"] == pytest.approx(
            r["tokens_per_s"] / greedy["hf_plain"]["tokens_per_s"]
        )
        assert "outputs" not in r
    assert (
        greedy["plain"]["speedup_vs_plain"] == 1.0
        and greedy["plain"]["mean_acceptance_length"] == 1.0
    )
    tree = greedy["eagle_tree(dynamic:2,2,4)"]
    for key in (
        "mean_acceptance_length",
        "acceptance_rate",
        "first_rejection_hist",
        "time_s",
        "nodes_per_step",
    ):
        assert key in tree
    assert tree["mean_acceptance_length"] >= 1.0 and set(tree["time_s"]) >= {"draft", "verify"}
    assert sum(tree["first_rejection_hist"]) == tree["target_forwards"]
    assert set(result["sweep"]) == {
        "hf_plain",
        "plain",
        "eagle_tree(dynamic:2,2,4)",
        "eagle_adaptive",
    }
    assert all(set(v) == {"1", "2"} for v in result["sweep"].values())
    assert result["sweep"]["eagle_tree(dynamic:2,2,4)"]["2"]["num_requests"] == 2
    adaptive = greedy["eagle_adaptive"]
    assert adaptive["cost_model"]["verify_tokens"] == [1, 2, 4] and adaptive["startup_s"] > 0
    hostile = result["hostile"]  # an untrained head: same greedy text, whatever it costs
    assert list(hostile) == ["plain", "eagle_chain2", "eagle_tree(dynamic:2,2,4)", "eagle_adaptive"]
    assert all(r["same_tokens_as_plain"] == 1.0 for r in hostile.values())
    cfg = result["config"]
    assert cfg["dtype"] == "float32" and cfg["date"] and cfg["machine"] and "commit" in cfg
    text = summary(result)
    assert "batch sweep" in text and "hostile" in text

    paths = plot(result, str(tmp_path / "e2e"))
    assert len(paths) == 4
    for p in paths:
        with open(p, "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n" and os.path.getsize(p) > 1000


# ---------------------------------------------------------------------- serving (issue 15)
def test_serving_metrics_and_plots(models, tmp_path):
    from specdec.apps import serving

    ours, _ = models
    tok = CharTokenizer()
    prompt_ids = [
        tok.apply_chat_template([{"role": "user", "content": p}])
        for p in ("Hi there", "Why?", "Tell me")
    ]
    head = EagleHead.random(ours, version=2, seed=0)
    result = serving.run_serving(
        ours,
        tok,
        head,
        prompt_ids,
        rates=(20.0, 2000.0),
        num_requests=6,
        max_new_tokens=6,
        batch_size=2,
        tree="dynamic:2,2,4",
        adaptive="adaptive:2,2,4",
        slo_ttft_s=10.0,
        slo_tpot_s=10.0,
        log=lambda m: None,
    )
    json.dumps(result)
    assert list(result["methods"]) == ["plain", "eagle_tree(dynamic:2,2,4)", "eagle_adaptive"]
    for rows in result["methods"].values():
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
        assert (
            rows["2000.0"]["mean_occupancy"] > 1.2
        )  # all arrive at once: both slots busy, a queue
    assert "TTFT p50/p95/p99" in serving.summary(result)
    paths = serving.plot(result, str(tmp_path / "e2e"))
    assert [os.path.basename(p) for p in paths] == [
        "e2e_serving_latency.png",
        "e2e_serving_throughput.png",
    ]
    assert all(os.path.getsize(p) > 1000 for p in paths)


def test_serve_counts_latency_from_the_scheduled_arrival(models):
    """A fake clock: the loop sleeps until the first arrival; a request that arrives while a
    step runs waits for it, and that wait is in its TTFT."""
    from specdec.apps.serving import serve
    from specdec.engine import Engine, Request, SamplingParams

    ours, _ = models
    now = [0.0]
    eng = Engine(ours, batch_size=1, max_seq_len=32)
    real_step = eng.step

    def step():  # every step takes 1 fake second
        now[0] += 1.0
        return real_step()

    eng.step = step
    reqs = [Request([2, 5, 7], SamplingParams(max_new_tokens=3), id=i) for i in range(2)]
    r = serve(
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


def test_bench_serving_quick_cli(models, tmp_path, monkeypatch, capsys):
    """`specdec bench --serving --quick` end to end (model loading and MT-bench prompts
    stubbed with the tiny model; explicit fast --rates keep it to a second)."""
    from specdec.apps import bench
    from specdec.cli import main

    ours, _ = models
    monkeypatch.setattr(
        "specdec.apps.common.load_model_from_args", lambda args: (ours, CharTokenizer())
    )
    monkeypatch.setattr(
        "specdec.apps.data.mtbench_prompts",
        lambda n: ["Why is the sky blue?", "Hi", "Name three"][:n],
    )
    monkeypatch.setattr(
        bench, "_load_head", lambda args, model: EagleHead.random(model, version=2, seed=0)
    )
    out = tmp_path / "e2e"
    assert main(
        [
            "bench",
            "--serving",
            "--quick",
            "--rates",
            "200,2000",
            "--tree",
            "dynamic:2,2,4",
            "--adaptive",
            "adaptive:2,2,4",
            "--output",
            str(out),
        ]
    ) in (0, None)
    result = json.loads((tmp_path / "e2e_serving.json").read_text())
    cfg = result["config"]
    assert (
        cfg["rates"] == [200.0, 2000.0] and cfg["num_requests"] == 6 and cfg["max_new_tokens"] == 16
    )
    assert cfg["batch_size"] == 4 and len(result["methods"]) == 3
    assert (tmp_path / "e2e_serving_latency.png").exists() and "goodput" in capsys.readouterr().out


def test_bench_serving_rejects_bad_rates(capsys):
    from specdec.cli import main

    with pytest.raises(SystemExit) as exc:
        main(["bench", "--serving", "--rates", "0,1"])
    assert exc.value.code == 2 and "--rates must be positive" in capsys.readouterr().err
