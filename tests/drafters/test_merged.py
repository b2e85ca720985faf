"""Merged trees (specdec.drafters.merged, `eagle+ngram`): the trie merge, exactness against
plain decoding (greedy token for token, sampled by a two-sample test), and acceptance at least
the better part's where the output copies the prompt."""

import pytest
import torch
from test_drafters import copying_model, run_with

from specdec.drafters import EagleDrafter, MergedDrafter, NgramDrafter, PlainDrafter
from specdec.drafters.eagle_head import EagleHead
from specdec.drafters.merged import merge_trees
from specdec.errors import InvalidTreeSpecError
from specdec.runtime.engine import Engine
from specdec.runtime.requests import Request, SamplingParams

from model_testing import (
    CHEAP_VERIFY,
    SAMPLING,
    oracle_head,
    run,
    same_distribution_pvalue,
    tiny_model,
)

pytestmark = pytest.mark.usefixtures("single_thread")


def merged(head, max_n=4, min_n=1):
    return MergedDrafter(EagleDrafter(head), NgramDrafter(max_n=max_n, min_n=min_n))


def paths(tokens, parents):
    """Every root-to-node token path of a tree (root excluded)."""
    out = set()
    for i in range(1, len(tokens)):
        path, j = [], i
        while j > 0:
            path.append(tokens[j])
            j = parents[j]
        out.add(tuple(reversed(path)))
    return out


# ---------------------------------------------------------------------- the trie merge
def test_merge_trees_shares_identical_paths():
    # n-gram: root -> 7 -> 4 -> 1, root -> 7 -> 8; EAGLE: root -> 7 -> 4 -> 9, root -> 3
    ngram = ([0, 7, 4, 1, 8], [-1, 0, 1, 2, 1])
    eagle = ([0, 3, 7, 4, 9], [-1, 0, 0, 2, 3])
    visits = [(0, i) for i in range(1, 5)] + [(1, i) for i in range(1, 5)]
    tokens, parents, origin = merge_trees(5, [ngram, eagle], visits, total=100)
    assert tokens[0] == 5 and parents[0] == -1
    assert paths(tokens, parents) == paths(*ngram) | paths(*eagle)
    assert len(tokens) == 1 + len(paths(*ngram) | paths(*eagle))  # 7 and 7 -> 4 shared
    pairs = list(zip(parents[1:], tokens[1:]))
    assert len(pairs) == len(set(pairs))  # no duplicate (parent, token)
    assert all(0 <= p < i for i, p in enumerate(parents[1:], 1))  # parents before children
    assert origin[1] == {0: 0, 1: 5, 2: 1, 3: 2, 4: 6}  # EAGLE's nodes onto the merged ones
    # a bound: nodes that do not fit are left out, and so are their descendants
    tokens, parents, _ = merge_trees(5, [ngram, eagle], visits, total=4)
    assert tokens == [5, 7, 4, 1] and parents == [-1, 0, 1, 2]
    tokens, parents, _ = merge_trees(5, [ngram, eagle], visits[4:] + visits[:4], total=4)
    assert paths(tokens, parents) == {(3,), (7,), (7, 4)}


def test_merged_needs_a_tree():
    model = tiny_model()
    with pytest.raises(InvalidTreeSpecError, match="dynamic"):
        Engine(model, drafter=merged(oracle_head(model)), tree="chain:4")


def test_proposals_hold_both_parts(monkeypatch):
    """Each merged proposal contains every path the n-gram part drafted, EAGLE's best nodes
    and no duplicate (parent, token) pair."""
    model = tiny_model()
    drafter = merged(oracle_head(model))
    seen = []
    propose = MergedDrafter.propose

    def spy(self, slots, roots, sampling, policy=None):
        p = propose(self, slots, roots, sampling, policy)
        ng = self.ngram
        for b, (slot, root) in enumerate(zip(slots.tolist(), roots.tolist())):
            n = int(p.num_nodes[b])
            tok, par = p.tokens[b, :n].tolist(), p.parents[b, :n].tolist()
            pairs = list(zip(par[1:], tok[1:]))
            assert len(pairs) == len(set(pairs)) and all(
                0 <= q < i for i, q in enumerate(par[1:], 1)
            )
            n_tok, n_par, _, _ = ng.trie(root, ng.continuations(ng.history[slot][: ng.lens[slot]]))
            assert paths(n_tok, n_par) <= paths(tok, par)
            seen.append(len(paths(n_tok, n_par)) < n - 1)  # EAGLE added nodes of its own
        return p

    monkeypatch.setattr(MergedDrafter, "propose", spy)
    out, _ = run_with(model, drafter, "dynamic:4,3,10", 3)
    assert out == run(model, None, "chain:1", 3, params=SamplingParams(max_new_tokens=40))[0]
    assert any(seen)


# ---------------------------------------------------------------------- exactness
@pytest.mark.parametrize(
    "tree,cost",
    [("dynamic:4,3,10", None), ("adaptive:4,3,10", CHEAP_VERIFY)],
    ids=["dynamic", "adaptive"],
)
@pytest.mark.parametrize("batch_size", [1, 3])
def test_greedy_merged_equals_plain(tree, cost, batch_size):
    """batch_size 3 < 4 prompts: the last request takes a slot freed mid-run."""
    model = tiny_model()
    plain, _ = run(model, None, "chain:1", batch_size, params=SamplingParams(max_new_tokens=40))
    out, stats = run_with(model, merged(oracle_head(model)), tree, batch_size, cost_model=cost)
    assert out == plain
    assert stats.mean_acceptance_length > 1.5


N_SEEDS = 2000


@pytest.mark.parametrize("sampling", list(SAMPLING))
def test_sampled_merged_follows_target(sampling):
    model = tiny_model(vocab_size=16, layer_scale=0.01, seed=3)
    prompt = [1, 2, 3, 1, 2, 3, 1, 2]

    def tokens(drafter, tree, **kw):
        eng = Engine(model, drafter=drafter, tree=tree, batch_size=250, max_seq_len=32, **kw)
        reqs = [
            Request(prompt, SamplingParams(**SAMPLING[sampling], seed=s, max_new_tokens=3))
            for s in range(N_SEEDS)
        ]
        results, stats = eng.generate(reqs)
        return torch.tensor([r.token_ids for r in results]), stats

    plain, _ = tokens(PlainDrafter(), "chain:1")
    for tree, kw in (("dynamic:3,3,8", {}), ("adaptive:3,3,8", dict(cost_model=CHEAP_VERIFY))):
        spec, stats = tokens(merged(oracle_head(model)), tree, **kw)
        assert same_distribution_pvalue(spec, plain) > 1e-3, tree
        assert stats.mean_acceptance_length > 1.0, tree


# ---------------------------------------------------------------------- acceptance
def test_acceptance_at_least_the_better_part_on_copying():
    """A model that copies its prompt's cycle, a random (weak) EAGLE head: the n-gram part is
    the better one, and the merged tree (which contains its tree) accepts at least as much;
    with the oracle head EAGLE is the better part, and the merged tree is not worse than it by
    more than one node's share."""
    model = copying_model()
    prompt = list(range(8)) + [0, 1, 2, 3]
    params = SamplingParams(max_new_tokens=30)
    tree = "dynamic:4,2,8"
    for head in (EagleHead.random(model, seed=0), oracle_head(model)):
        lengths = {}
        for name, drafter in (
            ("eagle", EagleDrafter(head)),
            ("ngram", NgramDrafter(max_n=3, min_n=2)),
            ("merged", merged(head, max_n=3, min_n=2)),
        ):
            _, stats = run_with(model, drafter, tree, 1, params=params, prompts=[prompt])
            lengths[name] = stats.mean_acceptance_length
        assert lengths["merged"] >= max(lengths["eagle"], lengths["ngram"]) - 1e-9, lengths


def test_without_lookups_merged_is_eagle():
    """When the n-gram part never matches (16-grams), the merged tree is EAGLE's own tree:
    the same steps as EAGLE alone, so EAGLE's state (its features of the accepted nodes,
    gathered by the merged tree's indices) is committed exactly as in the EAGLE drafter."""
    model = tiny_model()
    head = oracle_head(model)
    params = SamplingParams(max_new_tokens=24)
    eagle, eagle_stats = run_with(model, EagleDrafter(head), "dynamic:4,3,10", 3, params=params)
    out, stats = run_with(model, merged(head, 16, 16), "dynamic:4,3,10", 3, params=params)
    assert out == eagle
    assert stats.target_forwards == eagle_stats.target_forwards
    assert stats.nodes_verified == eagle_stats.nodes_verified
