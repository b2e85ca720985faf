"""Failures of the engine API: typed errors before any work, and a request that
fails (validation, NaN logits) finishing alone with finish_reason "error" while the others
complete exactly as they would have. Tiny random models, a few seconds in all."""

import pytest
import torch

from specdec.drafters.eagle_head import EagleHead
from specdec.errors import InvalidRequestError, InvalidTreeSpecError
from specdec.runtime.engine import Engine
from specdec.runtime.requests import Request, SamplingParams
from specdec.speculation import cost_model
from specdec.speculation.cost_model import CostModel
from specdec.speculation.trees import TreeSpec

from model_testing import PROMPTS, oracle_head, tiny_model

pytestmark = pytest.mark.usefixtures("single_thread")

# adaptive mode with fixed costs (no start-up measurement): greedy outputs do not depend on them
FIXED_COSTS = dict(cost_model=CostModel(3, [1, 2, 8], [1.0, 1.1, 1.5], [0.1, 0.2, 0.3]))


@pytest.fixture(scope="module")
def model():
    return tiny_model()


def poison(monkeypatch, model, slot, call):
    """NaN logits for the request in `slot` on the `call`-th target call (0: the prefill,
    1: the first verify step, ...), once."""
    calls = [0]

    def poisoned(fn):
        def wrapped(tokens, cache, slots, *args, **kw):
            out = fn(tokens, cache, slots, *args, **kw)
            if calls[0] == call:
                out.logits[torch.as_tensor(slots) == slot] = float("nan")
            calls[0] += 1
            return out

        return wrapped

    monkeypatch.setattr(model, "prefill", poisoned(model.prefill))
    monkeypatch.setattr(model, "forward", poisoned(model.forward))


@pytest.mark.parametrize("tree", ["plain", "chain:3", "dynamic:3,3,8", "adaptive:3,3,8"])
@pytest.mark.parametrize("call", [0, 3])
@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_nan_logits_fail_one_request_only(model, monkeypatch, tree, call, temperature):
    head = None if tree == "plain" else oracle_head(model)
    kw = FIXED_COSTS if tree.startswith("adaptive") else {}
    params = [SamplingParams(temperature=temperature, seed=i, max_new_tokens=20) for i in range(3)]
    eng = Engine(
        model,
        head=head,
        tree="chain:1" if head is None else tree,
        batch_size=3,
        max_seq_len=96,
        **kw,
    )
    if temperature == 0 or not tree.startswith(
        "adaptive"
    ):  # sampled adaptive: depends on batch-mates
        alone = [eng.generate([Request(PROMPTS[i], params[i])])[0][0] for i in (0, 2)]
    else:
        alone = None
    poison(monkeypatch, model, slot=1, call=call)
    finished = []
    results, stats = eng.generate(
        [Request(p, q) for p, q in zip(PROMPTS[:3], params)], progress=finished.append
    )
    bad = results[1]
    assert bad.finish_reason == "error" and bad.error.startswith("request 1: sampling failed:")
    assert "NaN" in bad.error and len(bad.token_ids) == (
        0 if call == 0 else bad.stats.generated_tokens
    )
    assert len(finished) == 3 and finished[0] is bad  # reported when it fails, not at the end
    for r in (results[0], results[2]):
        assert r.finish_reason == "length" and r.error is None and len(r.token_ids) == 20
    if alone is not None:
        assert [results[0].token_ids, results[2].token_ids] == [a.token_ids for a in alone]
    assert stats.generated_tokens == sum(len(r.token_ids) for r in results)


def test_nan_logits_in_every_request(model, monkeypatch):
    eng = Engine(model, head=oracle_head(model), tree="chain:2", batch_size=2, max_seq_len=96)
    monkeypatch.setattr(model, "forward", _nan_everywhere(model.forward))
    results, _ = eng.generate([Request(p, SamplingParams(max_new_tokens=8)) for p in PROMPTS[:2]])
    assert [r.finish_reason for r in results] == ["error", "error"]


def _nan_everywhere(fn):
    def wrapped(*args, **kw):
        out = fn(*args, **kw)
        out.logits.fill_(float("nan"))
        return out

    return wrapped


def test_invalid_requests_reported_together_before_any_work(model):
    eng = Engine(model, head=oracle_head(model), tree="chain:3", batch_size=2, max_seq_len=32)
    params = SamplingParams(max_new_tokens=6)
    reqs = [
        Request(PROMPTS[0], params),
        Request([], params),
        Request(list(range(20)) * 2, params),
        Request([1.0, 2.0], params),
        Request(PROMPTS[1], SamplingParams(max_new_tokens=6, seed=2**70)),
        Request(PROMPTS[1], params),
    ]
    events = []
    run = eng.stream(reqs, on_finish=lambda r: events.append(("finish", r.request_id)))
    for rid, _ in run:
        events.append(("tokens", rid))
    assert events[:4] == [("finish", i) for i in (1, 2, 3, 4)]  # all of them, before any token
    errors = {r.request_id: r.error for r in run.results if r.finish_reason == "error"}
    assert sorted(errors) == [1, 2, 3, 4]
    assert "empty prompt" in errors[1] and "longer than the cache" in errors[2]
    assert "integer token ids" in errors[3] and "seed" in errors[4]
    assert all(m.startswith(f"request {i}: ") for i, m in errors.items())
    alone, _ = eng.generate([reqs[0], reqs[5]])
    assert [run.results[0].token_ids, run.results[5].token_ids] == [r.token_ids for r in alone]
    assert run.stats.num_requests == 2  # the aggregate covers the requests that ran


def test_no_valid_request_raises_every_problem(model):
    eng = Engine(model, max_seq_len=32)
    with pytest.raises(
        InvalidRequestError, match=r"2 invalid.*request 0: empty prompt.*request 1: .*\[0, 32\)"
    ):
        eng.generate([Request([]), Request([1, 99])])


@pytest.mark.parametrize(
    "prompt, params, match",
    [
        ([1.5, 2.0], {}, "integer token ids"),
        (torch.tensor([1.0, 2.0]), {}, "integer token ids"),
        ("abc", {}, "integer token ids"),
        ([1, 2], dict(seed=2**70), r"seed must be an integer in \[-2\*\*63, 2\*\*64\)"),
        ([1, 2], dict(seed=1.5), "seed"),
    ],
)
def test_request_types_are_checked(model, prompt, params, match):
    with pytest.raises(InvalidRequestError, match=match):
        Engine(model, max_seq_len=32).generate(
            [Request(prompt, SamplingParams(max_new_tokens=2, **params))]
        )


def test_integer_like_token_ids_are_accepted(model):
    import numpy as np

    eng = Engine(model, max_seq_len=32)
    results, _ = eng.generate(
        [Request(np.array([1, 2, 3])), Request(torch.tensor([1, 2, 3]))],
    )
    assert results[0].token_ids == results[1].token_ids and results[0].finish_reason == "length"


@pytest.mark.parametrize(
    "kw",
    [
        dict(batch_size=0),
        dict(batch_size=-1),
        dict(batch_size=2.0),
        dict(block_size=0),
        dict(max_seq_len=0),
        dict(max_seq_len=-5),
    ],
)
def test_engine_arguments_are_checked(model, kw):
    """batch_size=0 used to loop forever in generate(); max_seq_len=0 silently meant the default."""
    with pytest.raises(InvalidRequestError, match=next(iter(kw))):
        Engine(model, **kw)


def test_batch_size_larger_than_memory(model):
    with pytest.raises(InvalidRequestError, match=r"batch_size 100000000 needs about .* GiB"):
        Engine(model, batch_size=100_000_000)


@pytest.mark.parametrize(
    "tree",
    [
        "dynamic:100,100,10000",
        "chain:100000",
        "adaptive:100,100,10000",
        "chain:256",
        "dynamic:4,4,256",
    ],
)
def test_tree_must_fit_the_cache(model, monkeypatch, tree):
    """Checked at construction, before adaptive mode measures its costs over such trees: the
    model's context (tiny_model: 256 positions) holds the tree and at least a 1-token prompt.
    (These used to fail at the first request, saying it was longer than a cache of a
    negative number of positions.)"""
    monkeypatch.setattr(cost_model.CostModel, "measure", lambda *a, **k: pytest.fail("measured"))
    with pytest.raises(
        InvalidTreeSpecError, match=r"nodes, more than the cache allows \(at most 255"
    ):
        Engine(model, head=oracle_head(model), tree=tree, max_seq_len=96)


def test_largest_tree_that_fits(model):
    """chain:254 (255 nodes) leaves one position of the 256 for the prompt; the smaller cache
    is what a too long prompt is told about."""
    eng = Engine(model, head=oracle_head(model), tree="chain:254", max_seq_len=24)
    (r,), _ = eng.generate([Request([1], SamplingParams(max_new_tokens=200))])
    assert r.finish_reason == "length" and len(r.token_ids) == 1  # prompt + tokens = cache + 1
    with pytest.raises(
        InvalidRequestError,
        match=r"longer than the cache \(1 positions per request: the "
        r"model's context of 256 positions less 255 for the verified tree",
    ):
        eng.generate([Request([1, 2])])
    eng = Engine(
        model, head=oracle_head(model), tree="chain:30", max_seq_len=24
    )  # larger than max_seq_len
    (r,), _ = eng.generate([Request([1], SamplingParams(max_new_tokens=200))])
    assert r.finish_reason == "length" and len(r.token_ids) == 24


@pytest.mark.parametrize("spec", ["dynamic:8,2,4", "adaptive:2,9,8", "dynamic:3,8,8"])
def test_tree_spec_depth_and_topk_bounded_by_total(spec):
    with pytest.raises(InvalidTreeSpecError, match="TOTAL - 1"):
        TreeSpec.parse(spec)


def test_topk_bounded_by_draft_vocabulary(model):
    head = EagleHead.random(model, seed=0).set_draft_vocab(torch.tensor([1, 2, 3, 4]))
    with pytest.raises(InvalidTreeSpecError, match="draft vocabulary"):
        Engine(model, head=head, tree="dynamic:2,6,8", max_seq_len=64)
    Engine(model, head=head, tree="dynamic:2,4,8", max_seq_len=64)  # fits


def test_tree_spec_objects_are_validated(model):
    with pytest.raises(InvalidTreeSpecError):
        Engine(model, head=oracle_head(model), tree=TreeSpec("chain", 0))
    with pytest.raises(InvalidTreeSpecError):
        Engine(model, head=oracle_head(model), tree=42)
