"""specdec.bench.drafters on a tiny random Llama: a fixed-tree and an adaptive row per
drafter, per-category and overall stats, greedy exactness against our plain loop, HF speedups,
the summary and the plot."""

import json

import pytest
from test_e2e import CharTokenizer, models  # noqa: F401 (a fixture)

from specdec.bench.drafters import plot, rows_for, run_drafter_bench, summary
from specdec.drafters.choice import DrafterChoice
from specdec.drafters.eagle_head import EagleHead

pytestmark = pytest.mark.usefixtures("single_thread")
QUESTIONS = {
    "coding": ["def f(x): return x + 1 # again: def f(x): return", "abcabcabc"],
    "writing": ["Why is the sky blue?"],
}


def test_rows_plain_once_then_fixed_and_adaptive():
    rows = rows_for([DrafterChoice("plain"), DrafterChoice("ngram")], "adaptive:3,2,6")
    assert [(n, t) for n, _, t in rows] == [
        ("plain", "chain:1"),
        ("ngram:1-4(dynamic:6,2,13)", "dynamic:6,2,13"),
        ("ngram:1-4_adaptive", "adaptive:3,2,6"),
    ]


def test_drafter_bench_rows_categories_and_exactness(models, tmp_path):  # noqa: F811
    ours, hf = models
    head_dir = str(tmp_path / "head")
    EagleHead.random(ours, version=2, seed=0).save(head_dir)
    choices = [DrafterChoice("eagle", head=head_dir), DrafterChoice("ngram")]
    result = run_drafter_bench(
        ours,
        CharTokenizer(),
        choices,
        QUESTIONS,
        max_new_tokens=8,
        temperatures=(0.0, 1.0),
        adaptive="adaptive:2,2,4",
        batch_sizes=(1, 2),
        hf_model=hf,
        log=lambda m: None,
    )
    json.dumps(result)  # JSON-ready
    greedy = result["batch1"]["0.0"]
    assert list(greedy) == [
        "hf_plain",
        "plain",
        "eagle(dynamic:5,8,32)",
        "eagle_adaptive",
        "ngram:1-4(dynamic:6,2,13)",
        "ngram:1-4_adaptive",
    ]
    for name, row in greedy.items():
        assert set(row["by_category"]) == {"coding", "writing"}
        o = row["overall"]
        # overall = the categories' sums (each category is its own timed generate call)
        n = sum(c["generated_tokens"] for c in row["by_category"].values())
        assert o["generated_tokens"] == n > 0
        assert o["elapsed_s"] == pytest.approx(
            sum(c["elapsed_s"] for c in row["by_category"].values())
        )
        assert o["speedup_vs_hf_plain"] > 0
        if name != "hf_plain":
            assert o["same_tokens_as_plain"] == 1.0  # float32: every drafter is exact
            assert o["target_forwards"] > 0
    assert greedy["plain"]["overall"]["speedup_vs_plain"] == 1.0
    assert "same_tokens_as_plain" not in result["batch1"]["1.0"]["plain"]["overall"]
    assert set(result["sweep"]) == {"plain", "eagle_adaptive", "ngram:1-4_adaptive"}
    assert set(result["sweep"]["plain"]) == {"1", "2"}
    text = summary(result)
    assert "ngram:1-4_adaptive" in text and "codin" in text
    (path,) = plot(result, str(tmp_path / "x"))
    assert path.endswith("_drafters_by_category.png")
