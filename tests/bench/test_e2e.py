"""specdec.bench.e2e on a tiny random Llama shared by transformers and our loader: JSON fields,
speedup bookkeeping, greedy exactness of every method against our plain loop, the plots."""

import json
import os

import pytest
import torch

from specdec.bench.e2e import plot, run_bench, summary
from specdec.drafters.eagle_head import EagleHead
from specdec.models.loader import load_checkpoint_dir

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
        "hf_specdec_eagle",
        "plain",
        "eagle_chain2",
        "eagle_tree(dynamic:2,2,4)",
        "eagle_adaptive",
        "eagle+ngram_adaptive",
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
    # the cost model measures tree sizes 1, 2, 3, 4 in turn and may stop early when one is much
    # dearer (a wall-clock decision: only the order is asserted, not where it stopped)
    measured = adaptive["cost_model"]["verify_tokens"]
    assert measured and measured == [1, 2, 3, 4][: len(measured)] and adaptive["startup_s"] > 0
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


def test_repeats_report_medians_and_every_run():
    """repeats=3: each batch-1 row is its median run, tokens/s and speedups the medians of the
    three runs' (same-run ratios), every run's values kept; one run leaves rows as they were."""
    import statistics

    from specdec.bench.e2e import _median_of_runs

    runs = [
        {"plain": {"tokens_per_s": t, "speedup_vs_plain": 1.0, "n": i}, "x": {"tokens_per_s": u}}
        for i, (t, u) in enumerate([(10.0, 30.0), (30.0, 31.0), (20.0, 50.0)])
    ]
    for run in runs:
        run["x"]["speedup_vs_plain"] = run["x"]["tokens_per_s"] / run["plain"]["tokens_per_s"]
    rows = _median_of_runs(runs)
    assert rows["plain"]["tokens_per_s"] == 20.0 and rows["plain"]["n"] == 2  # the median run
    assert rows["plain"]["tokens_per_s_runs"] == [10.0, 30.0, 20.0]
    ratios = [3.0, 31.0 / 30.0, 2.5]
    assert rows["x"]["speedup_vs_plain_runs"] == ratios
    assert rows["x"]["speedup_vs_plain"] == statistics.median(ratios)  # not 31 / 20
    assert _median_of_runs(runs[:1]) is runs[0]


def test_repeats_in_run_bench(models):
    ours, _ = models
    result = run_bench(
        ours,
        CharTokenizer(),
        None,
        ["Why is the sky blue?"],
        max_new_tokens=4,
        temperatures=(0.0,),
        chain_ks=(),
        batch_sizes=(),
        log=lambda m: None,
        hostile=False,
        repeats=2,
    )
    plain = result["batch1"]["0.0"]["plain"]
    assert result["config"]["repeats"] == 2 and len(plain["tokens_per_s_runs"]) == 2
    assert plain["speedup_vs_plain_runs"] == [1.0, 1.0]
    with pytest.raises(ValueError, match="repeats"):
        run_bench(ours, CharTokenizer(), None, ["x"], repeats=0, log=lambda m: None)


def test_repeats_alternate_the_method_order(monkeypatch, models):
    """Every other run takes the methods in reverse (llama.cpp's rows last), so a drift within
    a run does not always favour the same end of the list; rows keep the usual order."""
    import specdec.bench.e2e as bench
    import specdec.bench.llamacpp as llamacpp_baseline

    ours, _ = models
    calls = []

    def fake_ours(model, tokenizer, head, tree, *args, ngram=False):
        calls.append(f"ngram+{tree}" if ngram else tree)
        return {"tokens_per_s": 1.0, "mean_acceptance_length": 1.0, "outputs": [[5]]}

    def fake_llamacpp(ggufs, *args):
        calls.append("llama.cpp")
        return {
            "llama.cpp bf16": {
                "tokens_per_s": 1.0,
                "mean_acceptance_length": None,
                "outputs": [[5]],
            }
        }

    monkeypatch.setattr(bench, "run_ours", fake_ours)
    monkeypatch.setattr(llamacpp_baseline, "bench_rows", fake_llamacpp)
    result = run_bench(
        ours,
        CharTokenizer(),
        EagleHead.random(ours, seed=0),
        ["x"],
        temperatures=(0.0,),
        chain_ks=(2,),
        tree="dynamic:2,2,4",
        batch_sizes=(),
        log=lambda m: None,
        hostile=False,
        llamacpp_ggufs={"bf16": "unused.gguf"},
        repeats=3,
    )
    first = ["llama.cpp", "chain:1", "chain:2", "dynamic:2,2,4", "adaptive", "ngram+adaptive"]
    assert calls == first + first[::-1] + first
    names = ["llama.cpp bf16", "plain", "eagle_chain2", "eagle_tree(dynamic:2,2,4)"]
    assert list(result["batch1"]["0.0"]) == names + ["eagle_adaptive", "eagle+ngram_adaptive"]


def test_cli_rejects_bad_repeats(capsys):
    from specdec.cli import main

    with pytest.raises(SystemExit) as exc:
        main(["bench", "--repeats", "0"])
    assert exc.value.code == 2 and "--repeats must be >= 1" in capsys.readouterr().err


def test_interleave_decodes_prompt_by_prompt(monkeypatch, models):
    """interleave=True: every method set up once, then each prompt decoded by every method in
    turn, the order reversed every other prompt (llama.cpp's rows, faked, last on odd
    prompts); rows keep the usual order and names, a row's counts are its prompts' sums, and
    greedy outputs are those of the method-after-method run (every method against plain, and
    our plain against run_ours over the same prompts)."""
    import specdec.bench.e2e as bench
    import specdec.bench.llamacpp as llamacpp_baseline

    ours, hf = models
    tok = CharTokenizer()
    prompts = ["Why is the sky blue?", "abc", "hello there"]
    prompt_ids = [tok.apply_chat_template([{"role": "user", "content": p}]) for p in prompts]
    plain = bench.run_ours(ours, tok, None, "chain:1", prompt_ids, 0.0, 1, 6, 0)["outputs"]
    calls = []

    def fake_decoders(ggufs, ids, n, temp, threads, seed, eos):
        assert ids == prompt_ids and n == 6 and threads == torch.get_num_threads()

        def generate(prompt, n, request_seed):
            i = prompt_ids.index(list(prompt))
            calls.append(("llama.cpp", i))
            assert request_seed == seed + i
            return list(plain[i])

        return [("llama.cpp bf16", generate)]

    generate = bench.OursMethod.generate

    def spy(self, ids, temperature, seed):
        calls.append((str(self.engine.tree), prompt_ids.index(list(ids[0]))))
        return generate(self, ids, temperature, seed)

    monkeypatch.setattr(llamacpp_baseline, "bench_decoders", fake_decoders)
    monkeypatch.setattr(bench.OursMethod, "generate", spy)
    head = EagleHead.random(ours, version=2, seed=0)
    result = run_bench(
        ours,
        tok,
        head,
        prompts,
        max_new_tokens=6,
        temperatures=(0.0,),
        chain_ks=(2,),
        tree="dynamic:2,2,4",
        batch_sizes=(),
        log=lambda m: None,
        hostile=False,
        adaptive="adaptive:2,2,4",
        llamacpp_ggufs={"bf16": "unused.gguf"},
        interleave=True,
    )
    greedy = result["batch1"]["0.0"]
    assert result["config"]["interleave"] is True
    assert list(greedy) == [
        "llama.cpp bf16",
        "plain",
        "eagle_chain2",
        "eagle_tree(dynamic:2,2,4)",
        "eagle_adaptive",
        "eagle+ngram_adaptive",
    ]
    methods = ["llama.cpp", "chain:1", "chain:2", "dynamic:2,2,4", "adaptive:2,2,4"]
    methods.append("adaptive:2,2,4")  # eagle+ngram
    per_prompt = [[m for m, i in calls if i == k] for k in range(3)]
    assert per_prompt == [methods, methods[::-1], methods]
    assert [i for _, i in calls] == [0] * 6 + [1] * 6 + [2] * 6
    for name, r in greedy.items():
        assert r["same_tokens_as_plain"] == 1.0, name
        assert r["num_requests"] == 3 and r["tokens_per_s"] > 0
    assert greedy["plain"]["generated_tokens"] == sum(len(o) for o in plain)
    assert greedy["plain"]["target_forwards"] == sum(len(o) for o in plain) - 3
    tree = greedy["eagle_tree(dynamic:2,2,4)"]
    assert sum(tree["first_rejection_hist"]) == tree["target_forwards"]
    assert tree["mean_acceptance_length"] >= 1.0 and tree["time_s"]["verify"] > 0
    assert greedy["eagle_adaptive"]["startup_s"] > 0 and "cost_model" in greedy["eagle_adaptive"]
    assert greedy["llama.cpp bf16"]["generated_tokens"] == sum(len(o) for o in plain)


def test_cli_interleave_flag():
    from specdec.cli import build_parser

    argv = ["bench", "--interleave"]
    assert build_parser(argv).parse_args(argv).interleave is True
    assert build_parser(["bench"]).parse_args(["bench"]).interleave is False
