"""The engine loop of `specdec serve` (specdec.serve.worker): what a listener receives.

A request's first token goes out as soon as its prefill is done, alone, before the verify
round of the batch it joins (docs/serving.md, Results: TTFT); its tokens in order equal the
engine's own output. Tiny random model with an oracle head, so that verify rounds accept
several tokens."""

import threading

import pytest

from specdec.runtime.engine import Engine
from specdec.runtime.requests import Request, SamplingParams
from specdec.serve.worker import EngineWorker

from model_testing import PROMPTS, oracle_head, tiny_model

pytestmark = pytest.mark.usefixtures("single_thread")


def test_first_token_is_sent_alone_then_the_rest_in_order():
    model = tiny_model()
    engine = Engine(model, head=oracle_head(model), tree="chain:3", batch_size=2, max_seq_len=64)
    reqs = [
        Request(p, SamplingParams(max_new_tokens=12), id=f"r{i}") for i, p in enumerate(PROMPTS[:3])
    ]
    want = {r.request_id: r.token_ids for r in engine.generate(reqs)[0]}

    updates: dict = {r.id: [] for r in reqs}
    done = threading.Event()

    def listener_of(rid):
        def listener(update):
            updates[rid].append(update)
            if all(u and u[-1].result is not None for u in updates.values()):
                done.set()

        return listener

    worker = EngineWorker({"main": engine})
    worker.start()
    try:
        for r in reqs:  # three requests, two slots: the third joins a running batch
            worker.submit(r, "main", listener_of(r.id))
        assert done.wait(timeout=120), {k: len(v) for k, v in updates.items()}
    finally:
        assert worker.stop(timeout=30)
    for r in reqs:
        got = updates[r.id]
        assert got[0].tokens == want[r.id][:1] and got[0].result is None, got[0]
        assert [t for u in got for t in u.tokens] == want[r.id]
        assert got[-1].result.token_ids == want[r.id]
    # the oracle head's rounds accept several tokens: a first update of one token is the
    # split, not a step that happened to confirm only one
    assert any(len(u.tokens) > 1 for r in reqs for u in updates[r.id][1:])
