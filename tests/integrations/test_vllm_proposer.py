"""The n-gram custom_class proposer, called as vLLM's model runner calls it. Runs without
vLLM (a stand-in for its config)."""

from types import SimpleNamespace

import numpy as np
import pytest

from specdec.errors import InvalidRequestError
from specdec.integrations.vllm.proposers import NgramProposer, best_chain


def _config(depth=3, max_len=64, **options):
    return SimpleNamespace(
        speculative_config=SimpleNamespace(num_speculative_tokens=depth),
        model_config=SimpleNamespace(max_model_len=max_len),
        additional_config={"specdec": options} if options else {},
    )


def _batch(histories, width=64):
    tokens = np.zeros((len(histories), width), dtype=np.int32)
    for i, h in enumerate(histories):
        tokens[i, : len(h)] = h
    return np.array([len(h) for h in histories], dtype=np.int32), tokens


def test_rows_in_batch_order():
    proposer = NgramProposer(_config(depth=3))
    proposer.load_model(None)
    histories = [
        [5, 6, 7, 8, 9, 1, 5, 6],  # "5 6" occurred before: 7 8 9 followed it
        [1, 2, 3, 4],  # no earlier occurrence of any suffix
        [3, 3, 3],  # prefill still running: nothing sampled this step
    ]
    num, tokens = _batch(histories)
    drafts = proposer.propose([[6], [4], []], num, tokens)
    assert drafts == [[7, 8, 9], [], []]


def test_best_chain_follows_the_most_occurrences():
    # most recent first: two of three continuations agree on 4 then 5
    assert best_chain([[9, 9], [4, 5, 6], [4, 5, 7]], 3) == [4, 5, 6]
    assert best_chain([[1, 2], [3, 4]], 4) == [1, 2]  # a tie: the most recent occurrence
    assert best_chain([], 4) == [] and best_chain([[1, 2, 3]], 2) == [1, 2]


def test_room_left_in_the_model_length():
    proposer = NgramProposer(_config(depth=4, max_len=10))
    history = [5, 6, 7, 8, 9, 5, 6, 7]  # 8 of 10 positions used
    num, tokens = _batch([history])
    assert proposer.propose([[7]], num, tokens) == [[8, 9]]


def test_options_from_the_engine_config():
    proposer = NgramProposer(_config(ngram_max=2, ngram_min=2))
    num, tokens = _batch([[1, 2, 3, 9, 2, 3]])  # the 2-gram "2 3" matched, not the 1-gram "3"
    assert proposer.propose([[3]], num, tokens) == [[9, 2, 3]]
    num, tokens = _batch([[1, 2, 3, 9, 4, 3]])  # only the 1-gram "3" matches: below ngram_min
    assert proposer.propose([[3]], num, tokens) == [[]]
    with pytest.raises(InvalidRequestError, match="min_n"):
        NgramProposer(_config(ngram_max=1, ngram_min=3))
