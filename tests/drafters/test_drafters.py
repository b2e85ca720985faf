"""The drafter interface (specdec.drafters): the n-gram drafter and a drafter defined here.

Greedy decoding with any drafter must reproduce plain greedy decoding token for token, and
sampled decoding must follow the target (two-sample test against plain decoding, as in
test_engine.py); the n-gram drafter must get drafts accepted where the output repeats."""

import json

import numpy as np
import pytest
import torch

from specdec.drafters import Drafter, NgramDrafter, PlainDrafter, Proposal
from specdec.drafters.ngram import MAX_OCCURRENCES
from specdec.errors import InvalidRequestError
from specdec.runtime.engine import Engine
from specdec.runtime.requests import Request, SamplingParams

from model_testing import (
    CHEAP_VERIFY,
    PROMPTS,
    SAMPLING,
    oracle_head,
    run,
    same_distribution_pvalue,
    tiny_model,
)

pytestmark = pytest.mark.usefixtures("single_thread")


@pytest.fixture(scope="module")
def model():
    """Its greedy continuations fall into cycles: n-gram drafts are often right."""
    return tiny_model()


def run_with(model, drafter, tree, batch_size, params=None, prompts=PROMPTS, **kw):
    eng = Engine(model, drafter=drafter, tree=tree, batch_size=batch_size, max_seq_len=96, **kw)
    results, stats = eng.generate(
        [Request(p, params or SamplingParams(max_new_tokens=40)) for p in prompts]
    )
    return [r.token_ids for r in results], stats


# ---------------------------------------------------------------------- n-gram lookup
def windowed_match(d, h):
    """NgramDrafter.match's definition, n by n: a window comparison over the history."""
    L = len(h)
    for n in range(min(d.max_n, L - 1), d.min_n - 1, -1):
        windows = np.lib.stride_tricks.sliding_window_view(h[: L - 1], n)
        starts = np.flatnonzero((windows == h[L - n :]).all(axis=1))
        if len(starts):
            return n, [h[i + n : i + n + d.depth].tolist() for i in starts[::-1][:MAX_OCCURRENCES]]
    return 0, []


@pytest.mark.parametrize("max_n,min_n", [(4, 1), (3, 2), (1, 1), (5, 3)])
def test_ngram_match_is_the_windowed_search(max_n, min_n):
    """match() finds every n's occurrences in one pass; the same n and continuations as a
    window comparison per n, on random histories of 1-300 tokens over 2-12 token ids (many
    repeats, matches at the very start, runs of one token)."""
    g = np.random.default_rng(max_n * 10 + min_n)
    d = NgramDrafter(max_n, min_n)
    d.depth = 3
    for _ in range(400):
        h = g.integers(0, int(g.integers(2, 13)), size=int(g.integers(1, 301)))
        assert d.match(h) == windowed_match(d, h)
    assert d.match(np.array([7, 7, 7, 7, 7, 7])) == windowed_match(d, np.array([7] * 6))


def test_ngram_continuations_and_trie():
    d = NgramDrafter(max_n=3, min_n=1)
    d.depth, d.branches, d.total = 3, 2, 6
    h = np.array([5, 1, 2, 7, 8, 9, 1, 2, 7, 4, 1, 2])
    # longest suffix match: "1 2" (the 3-gram "4 1 2" occurs only at the end), most recent first
    assert d.continuations(h) == [[7, 4, 1], [7, 8, 9]]
    tokens, parents, depths, counts = d.trie(2, d.continuations(h))
    assert tokens == [2, 7, 4, 1, 8, 9] and parents == [
        -1,
        0,
        1,
        2,
        1,
        4,
    ]  # shared prefix "7" merged
    assert depths == [0, 1, 2, 3, 2, 3] and counts == [2, 2, 1, 1, 1, 1]
    assert d.continuations(np.array([1, 2, 3])) == []  # no earlier occurrence of any suffix
    d.branches = 1  # a second branch does not fit: the occurrence only adds to the counts
    assert d.trie(2, [[7, 4], [7, 8], [6]])[0] == [2, 7, 4]


@pytest.mark.parametrize(
    "tree,cost",
    [("chain:4", None), ("dynamic:4,3,10", None), ("adaptive:4,3,10", CHEAP_VERIFY)],
    ids=["chain", "tree", "adaptive"],
)
@pytest.mark.parametrize("batch_size", [1, 3])
def test_greedy_ngram_equals_plain(model, tree, cost, batch_size):
    """batch_size 3 < 4 prompts: the last request takes a slot freed mid-run (start() resets it)."""
    plain, _ = run(model, None, "chain:1", batch_size, params=SamplingParams(max_new_tokens=40))
    ngram, stats = run_with(model, NgramDrafter(), tree, batch_size, cost_model=cost)
    assert ngram == plain
    assert stats.mean_acceptance_length > 1.3  # the cycles are found


def copying_model(period=8):
    """Greedy continuation t -> t + 1, period - 1 -> 0 (t < period): no layer contributes, the
    embeddings are orthonormal and the output row of t + 1 is t's embedding. Its output
    repeats the cycle its prompt is in, as a model copying its input would."""
    model = tiny_model()
    V = model.args.vocab_size
    succ = torch.arange(1, V + 1)  # a permutation: two cycles, 0..period-1 and period..V-1
    succ[period - 1], succ[V - 1] = 0, period
    emb = torch.linalg.qr(torch.randn(V, V, generator=torch.Generator().manual_seed(0)))[0]
    with torch.no_grad():
        for layer in model.layers:
            layer.attention.wo.weight.zero_()
            layer.feed_forward.w2.weight.zero_()
        model.tok_embeddings.weight.copy_(emb)
        model.output.weight.zero_()
        model.output.weight[succ] = 10 * emb
    return model


def test_ngram_on_a_repeating_prompt():
    """A prompt repeating a sequence the model continues: n-gram drafts are accepted, far
    more than one token per target forward."""
    model = copying_model()
    prompt = list(range(8)) + [0, 1, 2, 3]
    ref, plain_stats = run(
        model, None, "chain:1", 1, prompts=[prompt], params=SamplingParams(max_new_tokens=30)
    )
    assert ref[0][:6] == [4, 5, 6, 7, 0, 1]
    for tree in ("chain:4", "dynamic:4,2,8"):
        out, stats = run_with(
            model,
            NgramDrafter(max_n=3, min_n=2),
            tree,
            1,
            prompts=[prompt],
            params=SamplingParams(max_new_tokens=30),
        )
        assert out == ref
        assert (
            stats.mean_acceptance_length > 4.0
            and stats.target_forwards <= plain_stats.target_forwards / 4
        )


def test_ngram_arguments():
    for bad in (dict(max_n=0), dict(min_n=0), dict(max_n=2, min_n=3), dict(max_n=2.5)):
        with pytest.raises(InvalidRequestError):
            NgramDrafter(**bad)


def test_head_and_drafter_are_exclusive(model):
    with pytest.raises(InvalidRequestError, match="either"):
        Engine(model, head=oracle_head(model), drafter=NgramDrafter())
    with pytest.raises(InvalidRequestError, match="Drafter"):
        Engine(model, drafter=object())


# ---------------------------------------------------------------------- a drafter defined here
class RandomTreeDrafter(Drafter):
    """Random trees of random tokens (point masses): no engine change, exactness by the op's
    rule. Deterministic per (slot, step) so that runs are reproducible."""

    name = "random-tree"

    def setup(self, setup):
        self.T, self.V = setup.tree.num_nodes, setup.model.args.vocab_size
        self.gen = torch.Generator().manual_seed(0)
        self.committed = 0

    def start(self, slots, prompts, first_tokens, hidden, aux, ok):
        pass

    def propose(self, slots, roots, sampling, policy=None):
        B, T = len(slots), self.T
        parents = torch.full((B, T), -1, dtype=torch.int32)
        for i in range(1, T):
            parents[:, i] = torch.randint(0, i, (B,), generator=self.gen, dtype=torch.int32)
        tokens = torch.randint(0, self.V, (B, T), generator=self.gen)
        tokens[:, 0] = roots
        num_nodes = torch.randint(1, T + 1, (B,), generator=self.gen, dtype=torch.int32)
        parents = parents.masked_fill(torch.arange(T)[None] >= num_nodes[:, None], -1)
        return Proposal(tokens, parents, num_nodes)

    def commit(self, slots, proposal, result):
        self.committed += int(sum(result.ok))


def test_a_new_drafter_needs_no_engine_change(model):
    plain, plain_stats = run(model, None, "chain:1", 3, params=SamplingParams(max_new_tokens=40))
    drafter = RandomTreeDrafter()
    out, stats = run_with(model, drafter, "dynamic:3,3,8", 3)
    assert out == plain
    assert drafter.committed == stats.target_forwards  # told after every step of every request
    assert (
        stats.target_forwards < plain_stats.target_forwards
    )  # random drafts do get accepted (vocab 32)


# ---------------------------------------------------------------------- sampled: follows the target
N_SEEDS = 2000
REPEATING = [1, 2, 3, 1, 2, 3, 1, 2]


def sampled_tokens(model, drafter, tree, params, **kw):
    eng = Engine(model, drafter=drafter, tree=tree, batch_size=250, max_seq_len=32, **kw)
    reqs = [
        Request(REPEATING, SamplingParams(**params, seed=s, max_new_tokens=3))
        for s in range(N_SEEDS)
    ]
    results, stats = eng.generate(reqs)
    return torch.tensor([r.token_ids for r in results]), stats


@pytest.mark.parametrize("sampling", list(SAMPLING))
def test_sampled_drafters_follow_target(sampling):
    model = tiny_model(vocab_size=16, layer_scale=0.01, seed=3)
    params = SAMPLING[sampling]
    plain, _ = sampled_tokens(model, PlainDrafter(), "chain:1", params)
    drafters = [(NgramDrafter(), "dynamic:3,3,8")] + [(RandomTreeDrafter(), "dynamic:3,3,8")] * (
        sampling == "t1"
    )
    for drafter, tree in drafters:
        spec, stats = sampled_tokens(model, drafter, tree, params)
        assert same_distribution_pvalue(spec, plain) > 1e-3, drafter.name
        assert stats.mean_acceptance_length > 1.0, drafter.name  # drafts were accepted


# ---------------------------------------------------------------------- the command line
def test_cli_method_ngram(capsys, tmp_path):
    from specdec.cli import main

    out = tmp_path / "out.jsonl"
    main(
        [
            "generate",
            "--prompt",
            "Repeat exactly: the cat sat on the mat, the cat sat on the mat.",
            "--method",
            "ngram",
            "--ngram-max",
            "3",
            "--ngram-min",
            "1",
            "--tree",
            "chain:4",
            "--max-new-tokens",
            "12",
            "--output",
            str(out),
        ]
    )
    assert "ngram:1-3 chain:4" in capsys.readouterr().out
    row = json.loads(out.read_text())
    assert (
        row["finish_reason"] in ("eos", "length")
        and row["token_ids"]
        and row["stats"]["target_forwards"] >= 1
    )


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--method", "draft"], "--method draft needs --draft-model"),
        (["--method", "eagle+ngram", "--tree", "chain:4"], "needs a dynamic or adaptive --tree"),
        (
            ["--method", "ngram", "--ngram-min", "3", "--ngram-max", "2"],
            "--ngram-min (3) must be <= --ngram-max (2)",
        ),
    ],
)
def test_cli_rejects_before_loading_the_model(capsys, argv, message):
    from specdec.cli import main

    with pytest.raises(SystemExit) as e:
        main(["generate", "--prompt", "hi", *argv])
    err = capsys.readouterr().err
    assert e.value.code == 2 and message in err and len(err.strip().splitlines()) == 1


def test_ngram_adaptive_sizes_each_request():
    """Adaptive per request: a request that repeats its prompt gets long n-gram
    trees, one whose lookups are split and wrong gets (nearly) the root only, in the same
    batch; outputs stay exact."""
    from specdec.speculation.cost_model import CostModel

    model = copying_model()
    # every extra node costs 0.3 of a plain step (the forward computes real nodes only)
    cost = CostModel(2, [1, 2, 4, 10], [1.0, 1.3, 1.9, 3.7], [0.0] * 4)
    # the second prompt: each token it will generate (9, 10, ...) occurs three times, with
    # three different (wrong) successors: split, low-confidence lookups
    other = [t for t in range(9, 21) for k in (5, 7, 9) for t in (t, 8 + (t - 8 + k) % 24)]
    prompts = [list(range(8)) + [0, 1, 2, 3], other + [8]]
    params = SamplingParams(max_new_tokens=20)
    ref, _ = run(model, None, "chain:1", 2, prompts=prompts, params=params)
    nodes = {}
    for per_request in (True, False):
        eng = Engine(
            model,
            drafter=NgramDrafter(),
            tree="adaptive:4,3,10",
            batch_size=2,
            max_seq_len=96,
            cost_model=cost,
        )
        eng.policy.per_request = per_request
        results, _ = eng.generate([Request(p, params) for p in prompts])
        assert [r.token_ids for r in results] == ref
        nodes[per_request] = [r.stats.nodes_verified / r.stats.target_forwards for r in results]
    (copy, unsure), (_, unsure_batch) = nodes[True], nodes[False]
    assert copy > 2.5 * unsure and unsure < unsure_batch, nodes
