"""The online API: Engine.submit / Engine.step / RequestHandle.

A request's greedy output must not depend on when it arrived or who shared its steps
(continuous batching: requests join between steps, finished ones leave), and sampled output
must be reproducible from its seed, for a fixed tree, whatever the arrival pattern. Tiny
random models, a few seconds per test."""

import pytest

from specdec.drafters import NgramDrafter
from specdec.drafters.eagle_head import EagleHead
from specdec.errors import InvalidRequestError
from specdec.runtime.engine import Engine, RequestHandle
from specdec.runtime.requests import Request, SamplingParams

from model_testing import CHEAP_VERIFY, PROMPTS, oracle_head, tiny_model

pytestmark = pytest.mark.usefixtures("single_thread")

# max_new_tokens differ so that requests finish (and free slots) at different steps
LENGTHS = (9, 17, 5, 12, 7)
ALL_PROMPTS = PROMPTS + [[20, 21, 22, 23]]


@pytest.fixture(scope="module")
def model():
    return tiny_model()


@pytest.fixture(scope="module")
def contextual_model():
    return tiny_model(layer_scale=1.0, seed=1)


def make_engine(model, kind, batch_size):
    kw = dict(batch_size=batch_size, max_seq_len=64)
    if kind == "plain":
        return Engine(model, **kw)
    if kind == "chain":
        return Engine(model, head=oracle_head(model), tree="chain:3", **kw)
    if kind == "dynamic":
        return Engine(model, head=oracle_head(model), tree="dynamic:3,2,6", **kw)
    if kind == "eagle-random":
        return Engine(
            model, head=EagleHead.random(model, version=3, seed=1), tree="dynamic:3,2,6", **kw
        )
    if kind == "ngram":
        return Engine(model, drafter=NgramDrafter(), tree="dynamic:3,2,6", **kw)
    if kind == "adaptive":
        return Engine(
            model, head=oracle_head(model), tree="adaptive:3,2,6", cost_model=CHEAP_VERIFY, **kw
        )
    raise ValueError(kind)


def requests(params=None):
    return [
        Request(p, params(i) if params else SamplingParams(max_new_tokens=n), id=f"r{i}")
        for i, (p, n) in enumerate(zip(ALL_PROMPTS, LENGTHS))
    ]


def serve(eng, reqs, pattern):
    """Submits reqs by `pattern` and steps until all are done -> {id: token_ids}, checking the
    streams: step()'s dict, each handle's new_tokens() and result.token_ids agree. A pattern
    ending in "+admit" calls admit() before each step(), as the server does: each request's
    first token comes from admit(), alone."""
    pattern, admit_first = pattern.removesuffix("+admit"), pattern.endswith("+admit")
    if pattern == "reverse":
        reqs = reqs[::-1]
    handles, steps_gained, polled = {}, {}, {}
    pending, nsteps = list(reqs), 0
    while pending or eng.has_work:
        if pattern in ("all", "reverse"):
            batch, pending = pending, []
        elif pattern == "one-per-step":
            batch, pending = pending[:1], pending[1:]
        elif pattern == "two-then-one-every-3":  # arrivals between the steps of running requests
            n = 2 if not handles else int(nsteps % 3 == 0)
            batch, pending = pending[:n], pending[n:]
        for r in batch:
            handles[r.id] = eng.submit(r)
        if admit_first:
            for rid, toks in eng.admit().items():
                assert rid not in steps_gained and len(toks) == 1, (rid, toks)
                steps_gained[rid] = list(toks)
        for rid, toks in eng.step().items():
            assert toks, "a request appears only when it gained tokens"
            steps_gained.setdefault(rid, []).extend(toks)
        for rid, h in handles.items():
            polled.setdefault(rid, []).extend(h.new_tokens())
        nsteps += 1
    assert eng.step() == {} and eng.admit() == {} and not eng.has_work
    out = {}
    for rid, h in handles.items():
        assert h.done and h.result.request_id == rid
        assert polled[rid] == steps_gained[rid] == h.result.token_ids == h.token_ids
        out[rid] = h.result.token_ids
    return out


@pytest.mark.parametrize("kind", ["plain", "chain", "dynamic", "eagle-random", "ngram", "adaptive"])
def test_greedy_independent_of_arrival_and_batch(model, contextual_model, kind):
    m = contextual_model if kind == "eagle-random" else model
    reference, _ = Engine(m, max_seq_len=64).generate(requests())  # plain, one at a time
    want = {r.request_id: r.token_ids for r in reference}
    for batch_size in (1, 3):
        eng = make_engine(m, kind, batch_size)
        for pattern in (
            "all",
            "one-per-step",
            "reverse",
            "two-then-one-every-3",
            "two-then-one-every-3+admit",
        ):
            assert serve(eng, requests(), pattern) == want, (batch_size, pattern)
        results, _ = eng.generate(requests())  # generate() on the same engine afterwards
        assert {r.request_id: r.token_ids for r in results} == want


@pytest.mark.parametrize("kind", ["chain", "dynamic", "ngram"])
def test_sampled_seed_reproducible_regardless_of_arrival(model, kind):
    def params(i):
        return SamplingParams(temperature=0.9, top_p=0.95, seed=100 + i, max_new_tokens=LENGTHS[i])

    want = None
    for batch_size, pattern in (
        (1, "all"),
        (3, "all"),
        (3, "reverse"),
        (3, "one-per-step"),
        (2, "two-then-one-every-3"),
        (2, "two-then-one-every-3+admit"),
    ):
        got = serve(make_engine(model, kind, batch_size), requests(params), pattern)
        want = want or got
        assert got == want, (batch_size, pattern)
    # and the same as generate() gives them
    results, _ = make_engine(model, kind, 2).generate(requests(params))
    assert {r.request_id: r.token_ids for r in results} == want


def test_queue_beyond_batch_size(model):
    eng = make_engine(model, "chain", batch_size=2)
    handles = [eng.submit(r) for r in requests()]
    assert eng.num_queued == 5 and eng.num_active == 0
    eng.step()
    assert eng.num_active == 2 and eng.num_queued == 3  # two slots, the rest waits in order
    assert [h.token_ids != [] for h in handles] == [True, True, False, False, False]
    peak = 2
    while eng.has_work:
        eng.step()
        peak = max(peak, eng.num_active)
        assert eng.num_active <= 2
    assert peak == 2 and all(h.done for h in handles)
    assert [len(h.result.token_ids) for h in handles] == list(LENGTHS)
    assert all(h.result.finish_reason == "length" for h in handles)
    # TTFT counts from submission: the last ones waited for a slot
    assert handles[-1].result.stats.ttft_s > handles[0].result.stats.ttft_s


def test_handle_iteration_drives_the_engine(model):
    eng = make_engine(model, "dynamic", batch_size=2)
    a = eng.submit(Request(PROMPTS[0], SamplingParams(max_new_tokens=10)))
    b = eng.submit(PROMPTS[1])  # a plain token list: default parameters, a fresh id
    assert isinstance(a, RequestHandle) and a.request_id != b.request_id and not a.done
    streamed = list(a)  # steps the engine (b advances too) until a is done
    assert a.done and streamed == a.result.token_ids and len(streamed) == 10
    assert b.token_ids and not b.done
    b_rest = list(b)
    assert b_rest == b.result.token_ids  # nothing was read from b before
    assert list(a) == [] and a.new_tokens() == []  # exhausted


def test_step_with_nothing_active(model):
    eng = make_engine(model, "chain", batch_size=2)
    assert eng.step() == {} and not eng.has_work
    h = eng.submit(Request(PROMPTS[0], SamplingParams(max_new_tokens=1)))
    assert eng.step() == {h.request_id: h.result.token_ids} and h.done
    assert eng.step() == {}


def test_invalid_submissions_raise_and_queue_nothing(model):
    eng = make_engine(model, "chain", batch_size=2)
    with pytest.raises(InvalidRequestError, match="request 'x': empty prompt"):
        eng.submit(Request([], id="x"))
    with pytest.raises(InvalidRequestError, match="temperature"):
        eng.submit(Request([1, 2], SamplingParams(temperature=-1)))
    assert not eng.has_work
    eng.submit(Request([1, 2], id="x"))
    with pytest.raises(InvalidRequestError, match="still in flight"):
        eng.submit(Request([3, 4], id="x"))
    while eng.has_work:
        eng.step()
    eng.submit(Request([3, 4], id="x"))  # finished: the id is free again


def test_failure_while_running_finishes_only_that_handle(model, monkeypatch):
    from test_engine_errors import poison

    eng = make_engine(model, "chain", batch_size=3)
    finished = []
    alone = eng.generate([Request(PROMPTS[0], SamplingParams(max_new_tokens=12))])[0][0].token_ids
    h0 = eng.submit(
        Request(PROMPTS[0], SamplingParams(max_new_tokens=12)), on_finish=finished.append
    )
    eng.step()
    poison(monkeypatch, model, slot=1, call=1)  # the next step's verify, for the request in slot 1
    h1 = eng.submit(
        Request(PROMPTS[1], SamplingParams(max_new_tokens=12)), on_finish=finished.append
    )
    while eng.has_work:
        eng.step()
    assert h1.result.finish_reason == "error" and "NaN" in h1.result.error
    assert h0.result.finish_reason == "length" and h0.result.token_ids == alone
    assert [r.request_id for r in finished] == [h1.request_id, h0.request_id]


def test_cancel(model):
    eng = make_engine(model, "chain", batch_size=1)
    a = eng.submit(Request(PROMPTS[0], SamplingParams(max_new_tokens=30)))
    b = eng.submit(Request(PROMPTS[1], SamplingParams(max_new_tokens=30)))
    c = eng.submit(Request(PROMPTS[2], SamplingParams(max_new_tokens=5)))
    eng.step()
    assert b.cancel() and b.result.finish_reason == "cancelled" and eng.num_queued == 1
    assert a.cancel() and eng.num_active == 0 and not a.cancel()
    assert list(c) == c.result.token_ids and len(c.result.token_ids) == 5


def test_abandoned_stream_frees_its_slots(model):
    eng = make_engine(model, "chain", batch_size=2)
    run = eng.stream([Request(p, SamplingParams(max_new_tokens=30)) for p in PROMPTS])
    next(run)
    run.close()
    assert not eng.has_work
    results, _ = eng.generate(requests())
    assert [len(r.token_ids) for r in results] == list(LENGTHS)


def test_timing_collects_the_steps_inside_its_block(model, monkeypatch):
    """Engine.timing(): the time split of exactly the steps run inside the block (step() and
    generate() alike), each batched step once; nothing before or after."""
    from types import SimpleNamespace

    eng = Engine(model, batch_size=2, max_seq_len=64)
    fake = iter(range(1000))
    # every timed phase lasts exactly 1 fake second (stats.timed reads its clock twice)
    monkeypatch.setattr(
        "specdec.runtime.stats.time", SimpleNamespace(perf_counter=lambda: next(fake))
    )
    eng.submit(Request(PROMPTS[0], SamplingParams(max_new_tokens=3)))
    eng.step()  # outside: not counted
    with eng.timing() as t:
        eng.submit(Request(PROMPTS[1], SamplingParams(max_new_tokens=3)))
        eng.step()  # the second request's prefill, then one verify step for both
        inside = dict(t.time_s)
        eng.generate([Request(PROMPTS[2], SamplingParams(max_new_tokens=2))])
    eng.generate([Request(PROMPTS[0], SamplingParams(max_new_tokens=2))])  # after: not counted
    assert inside["prefill"] == 1.0 and inside["verify"] == 1.0
    assert t.time_s["prefill"] == 2.0 and t.time_s["verify"] > inside["verify"]
    assert eng._timers == []  # the block left no timer behind
