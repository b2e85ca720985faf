"""End-to-end exactness of the decode loop (float32, CPU).

Greedy speculative decoding must reproduce greedy plain decoding token for token; sampled
speculative decoding must follow the target's distribution (two-sample test against plain
decoding, which fails for a deliberately broken sampler). Tiny random models with a small
vocabulary make acceptance frequent even for random heads; the "oracle" head (which
predicts the target's residual-free next token) makes it frequent for long chains.
"""

import pytest
import torch

import specdec_kernels.ops as ops
from specdec.drafters.eagle_head import EagleHead
from specdec.errors import InvalidRequestError
from specdec.runtime import engine as engine_module
from specdec.runtime.engine import Engine
from specdec.runtime.requests import Request, SamplingParams

from model_testing import (
    PROMPTS,
    SAMPLING,
    always_accept,
    first_tokens,
    oracle_head,
    run,
    same_distribution_pvalue,
    tiny_model,
)

pytestmark = pytest.mark.usefixtures("single_thread")


@pytest.fixture(scope="module")
def model():
    """Predictable: the oracle head's drafts are accepted often (but not always)."""
    return tiny_model()


@pytest.fixture(scope="module")
def contextual_model():
    """Full-strength random layers: the next token depends on the whole context, so any
    KV-cache / attention mistake changes the output."""
    return tiny_model(layer_scale=1.0, seed=1)


@pytest.mark.parametrize(
    "head_kind", ["oracle-eagle2", "oracle-eagle2-draft-vocab", "random-eagle3"]
)
@pytest.mark.parametrize("tree", ["chain:4", "dynamic:4,3,10"])
@pytest.mark.parametrize("batch_size", [1, 3])
def test_greedy_speculative_equals_plain(model, contextual_model, head_kind, tree, batch_size):
    """batch_size 3 < 4 prompts: the last request takes a slot freed mid-run. The random head
    still gets drafts accepted now and then: 32 tokens, several candidates per node."""
    if head_kind.startswith("oracle-eagle2"):
        head = oracle_head(model)
        if head_kind.endswith("draft-vocab"):  # drafts only ever from 24 of the 32 ids
            head.set_draft_vocab(
                torch.randperm(32, generator=torch.Generator().manual_seed(0))[:24]
            )
    else:
        model = contextual_model
        head = EagleHead.random(model, version=3, seed=1)
    plain, plain_stats = run(model, None, tree, batch_size)
    spec, stats = run(model, head, tree, batch_size)
    assert spec == plain
    assert plain_stats.mean_acceptance_length == 1.0
    assert stats.target_forwards < plain_stats.target_forwards  # drafts were really accepted
    if head_kind == "oracle-eagle2":
        assert stats.mean_acceptance_length > 1.5


def test_greedy_mixed_lengths_and_cache_limit(model):
    """Different max_new_tokens per request and a cache that fills up: 'length', no crash;
    outputs still match plain decoding."""
    head = oracle_head(model)

    def reqs():
        return [
            Request(p, SamplingParams(max_new_tokens=n)) for p, n in zip(PROMPTS, (3, 40, 7, 60))
        ]

    outs = []
    for h in (None, head):
        eng = Engine(model, head=h, tree="dynamic:4,3,10", batch_size=2, max_seq_len=32)
        results, _ = eng.generate(reqs())
        outs.append(results)
    for plain, spec in zip(*outs):
        assert spec.token_ids == plain.token_ids
        assert spec.finish_reason == plain.finish_reason == "length"
    # prompts + generated never exceed the cache by more than the uncached last token
    for r, n in zip(outs[1], (3, 40, 7, 60)):
        assert len(r.token_ids) == min(n, 32 + 1 - len(r.prompt_ids))


def test_eos_and_stream(model):
    plain, _ = run(model, None, "chain:1", 1)
    eos = plain[0][5]  # the 6th generated token of prompt 0 ends it
    eng = Engine(
        model,
        head=oracle_head(model),
        tree="chain:4",
        batch_size=2,
        max_seq_len=96,
        eos_token_ids=[eos],
    )
    run_ = eng.stream([Request(p, SamplingParams(max_new_tokens=24)) for p in PROMPTS])
    streamed = {}
    for rid, new in run_:
        assert new, "every event carries at least one token"
        streamed.setdefault(rid, []).extend(new)
    r0 = run_.results[0]
    assert r0.finish_reason == "eos" and r0.token_ids == plain[0][: plain[0].index(eos) + 1]
    assert all(streamed[r.request_id] == r.token_ids for r in run_.results)
    assert run_.stats.generated_tokens == sum(len(r.token_ids) for r in run_.results)


class CharTokenizer:
    eos_token_ids = set()

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(ord("a") + i % 26) for i in ids)


def test_stop_string(model):
    plain, _ = run(model, None, "chain:1", 1)
    text = CharTokenizer().decode(plain[0])
    stop = text[6:8]
    cut = text.find(stop)
    eng = Engine(model, CharTokenizer(), head=oracle_head(model), tree="chain:4", max_seq_len=96)
    (r,), _ = eng.generate([Request(PROMPTS[0], SamplingParams(max_new_tokens=24, stop=(stop,)))])
    assert r.finish_reason == "stop" and r.text == text[:cut]
    assert r.token_ids == plain[0][: cut + len(stop)]  # up to the token completing the stop string


def test_greedy_steps_draw_no_uniforms(model, monkeypatch):
    """A batch of greedy requests never reads the sampler's uniforms, so the engine draws
    none (no RNG work per step); a sampled request in the batch makes every row draw again."""
    import specdec_kernels.ops as kernel_ops

    head = oracle_head(model)
    eng = Engine(model, head=head, tree="chain:3", batch_size=2, max_seq_len=64)
    draws = []
    make_uniforms = kernel_ops.make_uniforms
    monkeypatch.setattr(
        kernel_ops, "make_uniforms", lambda *a, **k: draws.append(a) or make_uniforms(*a, **k)
    )
    greedy = [Request(p, SamplingParams(max_new_tokens=12)) for p in PROMPTS[:2]]
    eng.generate(greedy)
    assert draws == []
    eng.generate([greedy[0], Request(PROMPTS[1], SamplingParams(temperature=1.0, seed=3))])
    assert draws and all(a[0] == 2 for a in draws[:1])


def test_sampled_request_independent_of_batch(model):
    """A seeded request generates the same tokens alone and next to other requests."""
    head = oracle_head(model)
    params = SamplingParams(temperature=0.9, top_p=0.95, seed=1234, max_new_tokens=16)
    for tree in ("chain:3", "dynamic:3,3,8"):
        eng = Engine(model, head=head, tree=tree, batch_size=3, max_seq_len=96)
        alone, _ = eng.generate([Request(PROMPTS[2], params)])
        mates = [
            Request(p, SamplingParams(temperature=1.0, seed=i, max_new_tokens=20))
            for i, p in enumerate(PROMPTS)
        ]
        mixed, _ = eng.generate(mates[:2] + [Request(PROMPTS[2], params)] + mates[2:])
        assert mixed[2].token_ids == alone[0].token_ids


def test_stats(model):
    _, stats = run(model, oracle_head(model), "chain:4", 2)
    d = stats.to_dict()
    assert d["generated_tokens"] == 4 * 24 and d["num_requests"] == 4
    assert sum(d["first_rejection_hist"]) == d["target_forwards"]
    assert len(d["acceptance_rate"]) == 4 and all(0 <= r <= 1 for r in d["acceptance_rate"])
    assert d["nodes_per_step"] == 5.0
    assert d["mean_acceptance_length"] == pytest.approx(
        sum((a + 1) * n for a, n in enumerate(d["first_rejection_hist"])) / d["target_forwards"]
    )
    assert all(d["time_s"][p] > 0 for p in ("prefill", "draft", "verify", "sample", "compact"))
    assert d["tokens_per_s"] > 0 and d["ttft_s"] > 0 and d["tpot_s"] > 0


@pytest.mark.parametrize(
    "bad",
    [
        dict(prompt=[]),
        dict(prompt=list(range(20)) * 5),  # 100 tokens > 96 cache positions
        dict(prompt=[1, 99]),  # out of vocabulary
        dict(temperature=-1.0),
        dict(temperature=float("nan")),
        dict(top_p=0.0),
        dict(top_p=1.5),
        dict(top_k=-2),
        dict(max_new_tokens=0),
    ],
)
def test_invalid_requests(model, bad):
    prompt = bad.pop("prompt", [1, 2, 3])
    eng = Engine(model, max_seq_len=96)
    with pytest.raises(InvalidRequestError):
        eng.generate([Request(prompt, SamplingParams(**bad))])


@pytest.fixture(scope="module")
def small_vocab_model():
    return tiny_model(vocab_size=16, layer_scale=0.01, seed=3)


@pytest.fixture(scope="module")
def plain_samples(small_vocab_model):
    return {
        key: first_tokens(small_vocab_model, None, "chain:1", params)
        for key, params in SAMPLING.items()
    }


@pytest.mark.parametrize("sampling", list(SAMPLING))
@pytest.mark.parametrize("tree", ["chain:3", "dynamic:3,3,8"])
def test_sampled_speculative_follows_target(small_vocab_model, plain_samples, tree, sampling):
    head = oracle_head(small_vocab_model)
    spec = first_tokens(small_vocab_model, head, tree, SAMPLING[sampling])
    assert same_distribution_pvalue(spec, plain_samples[sampling]) > 1e-3


def test_sampled_chain_with_draft_vocabulary_follows_target(small_vocab_model, plain_samples):
    """Sampled chain drafts from a reduced vocabulary: draft_probs is zero outside it."""
    head = oracle_head(small_vocab_model).set_draft_vocab(
        torch.tensor([0, 2, 3, 5, 7, 8, 9, 11, 12, 14])
    )
    spec = first_tokens(small_vocab_model, head, "chain:3", SAMPLING["t1"])
    assert same_distribution_pvalue(spec, plain_samples["t1"]) > 1e-3


def test_broken_sampler_is_detected(small_vocab_model, plain_samples, monkeypatch):
    class BrokenOps:
        def __getattr__(self, name):
            return always_accept if name == "tree_rejection_sample" else getattr(ops, name)

    monkeypatch.setattr(engine_module, "ops", BrokenOps())
    spec = first_tokens(
        small_vocab_model, oracle_head(small_vocab_model), "dynamic:3,3,8", SAMPLING["t1"]
    )
    assert same_distribution_pvalue(spec, plain_samples["t1"]) < 1e-6


# ---------------------------------------------------------------------- the real model
@pytest.mark.slow
def test_default_model_greedy_speculative_equals_plain():
    from specdec.models.loader import load_model

    model, tok = load_model()
    prompts = [
        tok.apply_chat_template([{"role": "user", "content": q}])
        for q in ("What is 2 + 2?", "Name a colour.")
    ]
    head = EagleHead.random(model, seed=0)
    outs = {}
    for name, h, tree in (
        ("plain", None, "chain:1"),
        ("chain", head, "chain:3"),
        ("tree", head, "dynamic:3,4,12"),
    ):
        eng = Engine(model, tok, head=h, tree=tree, batch_size=2, max_seq_len=128)
        results, _ = eng.generate([Request(p, SamplingParams(max_new_tokens=8)) for p in prompts])
        outs[name] = [r.token_ids for r in results]
    assert outs["chain"] == outs["plain"] and outs["tree"] == outs["plain"]
