"""The engine's start-up: what a first request would otherwise pay (the CPU decode path's
weight copies, a first forward's one-time costs) is paid when the engine is built and
reported as its start-up time (docs/cpu-decode-path.md)."""

import statistics

import pytest
import torch

import specdec_kernels.ops as ops
from specdec.drafters.eagle_head import EagleHead
from specdec.runtime.engine import Engine
from specdec.runtime.requests import Request, SamplingParams

from model_testing import tiny_model

pytestmark = pytest.mark.usefixtures("single_thread")


def count_packing(monkeypatch) -> list:
    """-> a list that grows by one per weight copy made (tiles or oneDNN's layout)."""
    made = []
    tiles, onednn = ops.pack_linear_tiles, torch.ops.mkldnn._reorder_linear_weight

    def counted_tiles(*args, **kwargs):
        made.append("tiles")
        return tiles(*args, **kwargs)

    def counted_onednn(*args, **kwargs):
        made.append("onednn")
        return onednn(*args, **kwargs)

    monkeypatch.setattr(ops, "pack_linear_tiles", counted_tiles)
    monkeypatch.setattr(torch.ops.mkldnn, "_reorder_linear_weight", counted_onednn)
    return made


@pytest.mark.parametrize("drafter", ["plain", "eagle"])
def test_requests_make_no_weight_copies(drafter, monkeypatch):
    """bf16 on CPU with the decode path's copies forced on: building the engine makes them
    all; the requests' prefills and steps (a short prompt, a long one) make none."""
    monkeypatch.setenv("SPECDEC_PREPACK_WEIGHTS", "1")
    made = count_packing(monkeypatch)
    model = tiny_model(layer_scale=1.0, seed=1).to(torch.bfloat16)
    head = EagleHead.random(model, seed=0).to(torch.bfloat16) if drafter == "eagle" else None
    engine = Engine(model, head=head, tree="chain:2", max_seq_len=96)
    assert made and engine.startup_s > 0
    made.clear()
    requests = [Request(list(range(1, n)), SamplingParams(max_new_tokens=6)) for n in (3, 40)]
    _, stats = engine.generate(requests)
    assert made == []
    assert stats.startup_s == engine.startup_s and "engine start-up" in stats.summary()


def test_warm_up_leaves_the_cache_empty():
    """The start-up forward writes slot 0 and gives it back: a request's greedy output is the
    same as from an engine whose slot 0 was never used (float32)."""
    model = tiny_model(layer_scale=1.0, seed=1)
    engine = Engine(model, tree="chain:1", batch_size=2, max_seq_len=64)
    assert int(engine.cache.cache_lens.sum()) == 0
    fresh, _ = engine.generate([Request([5, 6, 7], SamplingParams(max_new_tokens=12))])
    again, _ = Engine(model, tree="chain:1", max_seq_len=64).generate(
        [Request([5, 6, 7], SamplingParams(max_new_tokens=12))]
    )
    assert fresh[0].token_ids == again[0].token_ids


def test_first_request_prefill_is_not_charged_the_set_up():
    """The default model in bf16, plain decoding: the first request's prefill is within 2x
    of the next ones' (same prompt; the median of two), where the decode path's set-up used
    to make it several times slower."""
    from specdec.models.loader import load_model

    model, tok = load_model(dtype=torch.bfloat16)
    engine = Engine(model, tok, tree="chain:1", max_seq_len=256)
    ids = tok.apply_chat_template([{"role": "user", "content": "Why is the sky blue?"}])
    prefill = []
    for _ in range(3):
        _, stats = engine.generate([Request(list(ids), SamplingParams(max_new_tokens=2))])
        prefill.append(stats.time_s["prefill"])
    assert prefill[0] <= 2 * statistics.median(prefill[1:]), prefill
