"""Trees inside vLLM's step (specdec.integrations.vllm.trees / hosted / attention): the
hosted drafter's tries and accepted paths, the attention backend against a float64 dense
reference over vLLM's cache layout, the sampler's tree path against the greedy walk, and
running vLLM engines (n-gram, EAGLE and merged adaptive trees) whose greedy output equals
vLLM plain's at batch 1, with concurrent requests and with staggered arrivals under forced
preemption (float32)."""

import functools
import json
import math
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from specdec.integrations.vllm import hosted, sampler, trees
from specdec.integrations.vllm.attention import TreeAttentionImpl
from specdec.integrations.vllm.trees import kv_views
from specdec.integrations.vllm.version import INSTALL_HINT, installed_version
from specdec.speculation.trees import TreeSpec


@pytest.fixture
def tree_step():
    """The module's step state, restored after the test."""
    saved = dict(trees._step)
    yield trees._step
    trees._step.clear()
    trees._step.update(saved)


def _vllm_config(nodes=6, **options):
    return SimpleNamespace(
        speculative_config=SimpleNamespace(num_speculative_tokens=nodes),
        model_config=SimpleNamespace(max_model_len=1000, model=None, dtype=torch.float32),
        scheduler_config=SimpleNamespace(max_num_seqs=4),
        parallel_config=SimpleNamespace(tensor_parallel_size=1, pipeline_parallel_size=1),
        additional_config={"specdec": {"tree": True, "sampler": "specdec", **options}},
    )


# "1 2" was followed by 3 4 5, 7 8 and 3 4 9: the trie under the root 2 holds 3-4-9 and 7-8-0
# (most recent first), and 3-4-5 would need a seventh node
HISTORY = np.array([1, 2, 3, 4, 5, 0, 1, 2, 7, 8, 0, 1, 2, 3, 4, 9, 0, 1, 2])
TRIE = ([2, 3, 4, 9, 7, 8, 0], [-1, 0, 1, 2, 0, 4, 5])


def _step(req_ids, scheduled, computed, drafts, sampled, token_ids, finished=()):
    starts = np.concatenate(([0], np.cumsum(scheduled))).tolist()
    return hosted.HostedStep(
        req_ids,
        scheduled,
        computed,
        drafts,
        starts,
        torch.zeros(starts[-1], 8),
        None,
        sampled,
        token_ids,
        set(finished),
    )


def test_hosted_ngram_drafter_drafts_tries_and_commits_the_accepted_path():
    proposer = hosted.DrafterProposer(
        _vllm_config(nodes=6, drafter="ngram", tree_spec="dynamic:3,2,7")
    )
    proposer.load_model(None)
    n = len(HISTORY)
    ids = np.zeros((2, 64), dtype=np.int32)
    ids[0, :n] = HISTORY
    ids[1, :5] = HISTORY[:5]
    # row 0 prefills and samples its first token (2); row 1 is a partial prefill
    proposer.observe(_step(["a", "b"], [n - 1, 4], [0, 0], [0, 0], [[2], []], ids))
    proposer.bind_rows(["a", "b"])
    drafts = proposer.propose([[2], []], np.array([n, 4]), ids)
    assert drafts == [TRIE[0][1:], []]
    assert proposer.parents == [TRIE[1], [-1]]
    # vLLM may keep a prefix of the drafts: every prefix is a tree (parents before children)
    assert all(0 <= p < i for i, p in enumerate(proposer.parents[0]) if i)
    # the next step verified all 6 nodes and emitted 3, 4 (nodes 1, 2) and the bonus 5
    ids[0, n : n + 3] = [3, 4, 5]
    proposer.observe(_step(["a", "b"], [7, 1], [n - 1, 4], [6, 0], [[3, 4, 5], [1]], ids))
    assert proposer.requests["a"].next_position == n + 2
    proposer.bind_rows(["a", "b"])
    drafts = proposer.propose([[3, 4, 5], [1]], np.array([n + 3, 5]), ids)
    assert drafts[0] == [0, 1, 2]  # "3 4 5" was followed by "0 1 2"
    # a request vLLM finished gives its slot back; one whose cache length does not match
    # (recomputed after preemption) starts over
    proposer.observe(_step(["b"], [1], [5], [0], [[7]], ids[1:], finished=["a"]))
    assert set(proposer.requests) == {"b"} and len(proposer.free) == 3
    proposer.observe(_step(["b"], [3], [0], [0], [[7]], ids[1:]))
    assert proposer.requests["b"].next_position == 3


class _RecordingPolicy:
    """What the hosted drafter tells an adaptive policy; every step it decides is plain."""

    levels = 0

    def __init__(self):
        self.observed, self.timed = [], []

    def new_step(self, slots):
        pass

    def speculate(self):
        return False

    def start(self, slots):
        pass

    def step_nodes(self, num_nodes, T):
        return float(T)

    def observe(self, d, depth, accepted_nodes, num_accepted, slots):
        self.observed.append((d.num_nodes.tolist(), num_accepted.tolist()))

    def observe_time(self, seconds, speculative, levels, nodes):
        self.timed.append(speculative)


def test_hosted_policy_learns_from_every_row_of_a_speculative_step():
    """A speculative step's rows that its trees left root-only count in what the step
    earned (the policy's tokens per request are per row the step paid for); a step that
    also ran prompt tokens does not calibrate the price of decode steps."""
    proposer = hosted.DrafterProposer(
        _vllm_config(nodes=6, drafter="ngram", tree_spec="dynamic:3,2,7")
    )
    proposer.load_model(None)
    n = len(HISTORY)
    ids = np.zeros((3, 64), dtype=np.int32)
    ids[:2, :n] = HISTORY
    proposer.observe(_step(["a", "b"], [n - 1, n - 1], [0, 0], [0, 0], [[2], [2]], ids))
    proposer.bind_rows(["a", "b"])
    proposer.propose([[2], [2]], np.array([n, n]), ids)
    # as an adaptive step would have drafted them: a tree for "a", the root alone for "b"
    proposer.requests["a"].proposal = (TRIE[0], TRIE[1], [1.0] + [0.5] * 6)
    proposer.requests["b"].proposal = ([2], [-1], [1.0])
    policy = proposer.policy = _RecordingPolicy()
    proposer._speculative, proposer._step_start = True, 0.0
    ids[0, n : n + 3], ids[1, n] = [3, 4, 5], 3
    proposer.observe(_step(["a", "b"], [7, 1], [n - 1, n - 1], [6, 0], [[3, 4, 5], [3]], ids))
    assert policy.observed == [([7, 1], [2, 0])]  # both rows, "b" root-only
    assert policy.timed == [True]
    # a plain step beside a new request's prompt: not timed; a plain step alone: timed
    proposer.bind_rows(["a", "b"])
    proposer.propose([[3, 4, 5], [3]], np.array([n + 3, n + 1]), ids)
    ids[0, n + 3], ids[1, n + 1], ids[2, :6] = 0, 4, [1, 2, 3, 4, 5, 1]
    step = _step(["a", "b", "c"], [1, 1, 5], [n + 2, n, 0], [0, 0, 0], [[0], [4], [1]], ids)
    proposer.observe(step)
    assert policy.timed == [True]
    proposer.bind_rows(["a", "b", "c"])
    proposer.propose([[0], [4], [1]], np.array([n + 4, n + 2, 6]), ids)
    ids[0, n + 4], ids[1, n + 2], ids[2, 6] = 1, 0, 2
    step = _step(["a", "b", "c"], [1, 1, 1], [n + 3, n + 1, 5], [0, 0, 0], [[1], [0], [2]], ids)
    proposer.observe(step)
    assert policy.timed == [True, False]
    assert len(policy.observed) == 1  # plain steps teach the acceptance statistics nothing


@pytest.mark.skipif(installed_version() is None, reason=f"vLLM is not installed: {INSTALL_HINT}")
@pytest.mark.parametrize("aux", [False, True], ids=["hidden", "hidden+aux"])
def test_policy_cost_model_times_vllms_forward(aux):
    """The adaptive policy's verify costs time vLLM's own forward (hosted.vllm_target_forward):
    B x T tokens at T positions per request, as vLLM's profiling runs its model (no attention
    metadata, no KV slots), and logits at every one of them (a tree step samples them all),
    also when the model hands EAGLE-3's auxiliary states back beside the hidden states."""
    from vllm.config import VllmConfig
    from vllm.forward_context import get_forward_context

    seen = {}

    class Target(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.randn(11, 4))

        def forward(self, input_ids, positions):
            context = get_forward_context()
            seen.update(ids=input_ids, positions=positions, metadata=context.attn_metadata)
            seen["slots"] = getattr(context, "slot_mapping", None)
            hidden = torch.zeros(input_ids.shape[0], 4)
            return (hidden, [hidden]) if aux else hidden

        def compute_logits(self, hidden):
            seen["logit_rows"] = hidden.shape[0]
            return hidden @ self.w.T

    run = hosted.vllm_target_forward(VllmConfig(), Target(), vocab_size=11, context=100)(3, 2)
    logits = run()
    assert logits.shape == (6, 11) and seen["logit_rows"] == 6
    assert seen["ids"].shape == (6,) and 0 <= int(seen["ids"].min()) <= int(seen["ids"].max()) < 11
    assert seen["positions"].tolist() == [100, 101] * 3
    assert seen["metadata"] is None and not seen["slots"]


def test_accepted_path_walks_the_emitted_tokens_down_the_tree():
    proposal = (*TRIE, None)
    assert hosted._accepted_path(proposal, 6, [7, 8, 1]) == [0, 4, 5]
    assert hosted._accepted_path(proposal, 6, [5]) == [0]  # nothing accepted: the bonus only
    assert hosted._accepted_path(proposal, 6, [7, 4, 1]) is None  # 4 is not under 7
    assert hosted._accepted_path(proposal, 3, [7, 8]) is None  # node 4 was not verified


def test_drafts_past_the_proposed_tree_are_verified_as_a_chain(tree_step):
    """vLLM's placeholder drafts (a request entering decode from its waiting queue) and
    drafts past the tree proposed for a request hang below it as a chain."""
    runner = SimpleNamespace(
        _specdec_parents={"a": [-1, 0, 0]},
        input_batch=SimpleNamespace(
            num_reqs=3, req_ids=["a", "b", "c"], num_computed_tokens_cpu=np.array([10, 20, 30])
        ),
        positions=torch.zeros(16, dtype=torch.long),
    )
    scheduled = SimpleNamespace(scheduled_spec_decode_tokens={"a": [5, 6, 7, 8], "b": [-1, -1]})
    trees._place_tree_nodes(runner, scheduled, np.array([5, 3, 1]))
    assert tree_step["parents"] == {0: [-1, 0, 0, 2, 3], 1: [-1, 0, 1]}
    assert runner.positions[:9].tolist() == [
        10,
        11,
        11,
        12,
        13,
        20,
        21,
        22,
        0,
    ]  # row c ran plain: untouched
    assert runner._specdec_parents == {}  # proposed for that step only


def test_tree_positions_are_depths():
    assert trees.tree_positions([-1, 0, 0, 1, 3, 2]).tolist() == [0, 1, 1, 2, 3, 2]


def _dense_attention(q, k_all, v_all, allowed, scale):
    """q [N, Hq, D], k_all / v_all [S, Hkv, D], allowed [N, S] -> [N, Hq, D] (float64)."""
    group = q.shape[1] // k_all.shape[1]
    k = k_all.repeat_interleave(group, dim=1).double()
    v = v_all.repeat_interleave(group, dim=1).double()
    scores = torch.einsum("nhd,shd->hns", q.double(), k) * scale
    scores = scores.masked_fill(~allowed[None], -math.inf)
    return torch.einsum("hns,shd->nhd", scores.softmax(-1), v)


TREE = [-1, 0, 0, 1, 2]  # a 5-node tree: root, two children, a grandchild under each


@pytest.mark.parametrize(
    "query_lens, groups, dense",
    [
        ([4, 5], 1, False),  # a short prompt chunk and a tree: one padded batch
        ([5, 5], 1, True),  # rows of one length: straight through
        ([12, 5], 2, False),  # a prompt chunk apart from the tree
        ([5, 12, 1, 9], 2, False),  # decode and tree rows apart from the prompts, not consecutive
    ],
    ids=["ragged", "dense", "prompt-apart", "interleaved"],
)
def test_tree_attention_matches_a_dense_reference_in_vllms_cache_layout(
    tree_step, query_lens, groups, dense
):
    """Prompt chunks (causal rows) beside 5-node trees (the rows of 5 tokens) and decodes:
    rows longer than the longest tree are attended apart from the others, each set padded
    to its own longest row; rows of one length go straight through."""
    torch.manual_seed(0)
    Hq, Hkv, D, block_size = 4, 2, 16, 8
    R = len(query_lens)
    cache_lens = [6, 11, 3, 9][:R]
    blocks_per_row = 4
    num_blocks = R * blocks_per_row + 2
    kv_cache = torch.randn(num_blocks, Hkv, block_size, 2 * D)  # vLLM's per-layer allocation
    block_table = torch.randperm(num_blocks)[: R * blocks_per_row].view(R, -1).to(torch.int32)
    tree_step.update(parents={b: TREE for b in range(R) if query_lens[b] == 5})
    starts = np.concatenate(([0], np.cumsum(query_lens))).tolist()
    N = starts[-1]
    positions = torch.tensor([cache_lens[b] + i for b in range(R) for i in range(query_lens[b])])
    req = torch.tensor([b for b in range(R) for _ in range(query_lens[b])])
    slots = block_table.long()[req, positions // block_size] * block_size + positions % block_size
    meta = SimpleNamespace(
        num_reqs=R,
        num_actual_tokens=N,
        query_start_loc_cpu=torch.tensor(starts, dtype=torch.int32),
        seq_lens=torch.tensor([c + q for c, q in zip(cache_lens, query_lens)], dtype=torch.int32),
        block_table_tensor=block_table,
        slot_mapping=slots,
    )
    from specdec.integrations.vllm.attention import TreeAttentionMetadataBuilder

    builder = object.__new__(TreeAttentionMetadataBuilder)
    attn_metadata = builder.build(0, meta)
    assert len(attn_metadata.groups) == groups and attn_metadata.dense == dense
    impl = TreeAttentionImpl(Hq, D, D**-0.5, Hkv, None, None, "auto")
    q, k, v = torch.randn(N, Hq, D), torch.randn(N, Hkv, D), torch.randn(N, Hkv, D)
    before = kv_cache.clone()
    layer = SimpleNamespace()  # vLLM's layer: the backend keeps its cache views on it
    # one padding token past the real ones (vLLM's slot -1): written nowhere
    k_pad, v_pad = torch.cat((k, torch.randn(1, Hkv, D))), torch.cat((v, torch.randn(1, Hkv, D)))
    impl.do_kv_cache_update(
        layer, k_pad, v_pad, kv_cache, torch.cat((slots, slots.new_full((1,), -1)))
    )
    output = torch.full((N, Hq * D), float("nan"))
    impl.forward(layer, q, k, v, kv_cache, attn_metadata, output)

    k_old, v_old = kv_views(before, D)
    for b in range(R):
        blocks = block_table[b].long()
        rows = slice(starts[b], starts[b + 1])
        S = cache_lens[b]
        k_all = torch.cat((k_old.index_select(0, blocks).reshape(-1, Hkv, D)[:S], k[rows]))
        v_all = torch.cat((v_old.index_select(0, blocks).reshape(-1, Hkv, D)[:S], v[rows]))
        n = query_lens[b]
        allowed = torch.zeros(n, S + n, dtype=torch.bool)
        allowed[:, :S] = True
        parents = TREE if n == 5 else list(range(-1, n - 1))
        for i in range(n):
            node = i
            while node >= 0:
                allowed[i, S + node] = True
                node = parents[node]
        expected = _dense_attention(q[rows], k_all, v_all, allowed, D**-0.5)
        torch.testing.assert_close(
            output[rows].view(n, Hq, D).double(), expected, rtol=1e-5, atol=1e-5
        )
    # the new K/V went to vLLM's slots, nothing else moved
    k_new, v_new = kv_views(kv_cache, D)
    written = torch.zeros(num_blocks, block_size, dtype=torch.bool)
    for t in range(N):
        blk, row = divmod(int(slots[t]), block_size)
        torch.testing.assert_close(k_new[blk, row], k[t])
        torch.testing.assert_close(v_new[blk, row], v[t])
        written[blk, row] = True
    assert torch.equal(k_new[~written], k_old[~written])
    assert torch.equal(v_new[~written], v_old[~written])


def test_sampler_tree_path_accepts_the_greedy_walk(tree_step):
    torch.manual_seed(1)
    V = 11
    tree = [-1, 0, 0, 1, 2]  # root, two children, a grandchild under each
    logits = torch.randn(5, V)
    argmax = logits.argmax(-1)
    drafts = torch.tensor([(int(argmax[0]) + 1) % V, int(argmax[0]), 0, 0])  # nodes 1..4
    drafts[2] = (int(argmax[2]) + 1) % V  # node 3 (under node 1) is wrong
    drafts[3] = int(argmax[2])  # node 4 (under node 2) is right
    tree_step.update(parents={0: tree}, accepted=None)
    bonus = torch.tensor([[int(argmax[4])]])
    out = sampler.rejection_sample(
        drafts,
        [4],
        4,
        torch.tensor([4]),
        None,
        logits[:4],
        bonus,
        SimpleNamespace(all_greedy=True, generators={}),
    )
    # node 2 (= argmax of the root), then node 4 (= argmax of node 2), then the bonus
    assert out[0].tolist() == [int(argmax[0]), int(argmax[2]), int(argmax[4]), -1, -1]
    accepted_nodes, num_accepted = tree_step["accepted"]
    assert int(num_accepted[0]) == 2 and accepted_nodes[0, :3].tolist() == [0, 2, 4]


def _random_trees(B, K, V, gen, logits):
    """B random K + 1-node trees (parents [B, K + 1], root first) and their K drafts [B, K]
    (node j + 1's token): siblings hold distinct tokens, most of them their parent's argmax
    (node K's parent has no logits row in vLLM's layout: its token is random)."""
    parents = torch.full((B, K + 1), -1, dtype=torch.int32)
    drafts = torch.zeros(B, K, dtype=torch.int32)
    for b in range(B):
        for i in range(1, K + 1):
            p = int(torch.randint(i, (1,), generator=gen))
            parents[b, i] = p
            taken = {int(drafts[b, j - 1]) for j in range(1, i) if parents[b, j] == p}
            best = int(logits[b, p].argmax()) if p < K else -1
            choice = best if best not in taken and float(torch.rand(1, generator=gen)) < 0.6 else -1
            while choice < 0 or choice in taken:
                choice = int(torch.randint(V, (1,), generator=gen))
            drafts[b, i - 1] = choice
    return parents, drafts


def _tree_step_outputs(tree_step, parents, drafts, logits, bonus, metadata, padded):
    """The sampler's output rows and accepted paths for one tree step (every request with K
    drafts): through rejection_sample (padded=False: the uniform path) or the padded layout
    chain_batch builds (the path for requests of different sizes)."""
    B, K = drafts.shape
    tree_step.update(parents={b: parents[b].tolist() for b in range(B)}, accepted=None)
    flat, target = drafts.reshape(-1), logits[:, :K].reshape(B * K, -1)
    counts, cu = [K] * B, torch.arange(1, B + 1) * K
    if not padded:
        out = sampler.rejection_sample(flat, counts, K, cu, None, target, bonus, metadata)
    else:
        batch = sampler.chain_batch(flat, counts, K, None, target, bonus)
        trees.write_step_trees(batch.parents)
        temperature = torch.zeros(B) if metadata.all_greedy else torch.ones(B)
        uniforms = torch.zeros(B, K + 2) if metadata.all_greedy else torch.rand(B, K + 2)
        accepted, num_accepted, out = torch.ops.specdec.tree_rejection_sample(
            batch.logits,
            batch.tokens,
            batch.parents,
            batch.num_nodes,
            None,
            temperature,
            torch.zeros(B, dtype=torch.int32),
            torch.ones(B),
            uniforms,
        )
        trees.record_acceptance(accepted, num_accepted)
    accepted, num_accepted = tree_step["accepted"]
    paths = [accepted[b, : int(num_accepted[b]) + 1].tolist() for b in range(B)]
    return out, paths


def test_uniform_tree_steps_walk_as_the_padded_layout_greedy(tree_step, _fresh_seed):
    """Every request drafting K nodes (always at batch 1): vLLM's logits are walked as they
    are, the last node checked after the walk; greedy output and accepted paths equal the
    padded layout's on random trees."""
    gen = torch.Generator().manual_seed(_fresh_seed)
    B, K, V = 64, 6, 5
    logits = torch.randn(B, K + 1, V, generator=gen) * 3
    parents, drafts = _random_trees(B, K, V, gen, logits)
    bonus = torch.randint(V, (B, 1), generator=gen)
    greedy = SimpleNamespace(all_greedy=True, generators={})
    out, paths = _tree_step_outputs(tree_step, parents, drafts, logits, bonus, greedy, False)
    ref, ref_paths = _tree_step_outputs(tree_step, parents, drafts, logits, bonus, greedy, True)
    assert torch.equal(out, ref)
    assert paths == ref_paths
    assert any(p[-1] == K for p in paths), "no tree accepted its last node: nothing checked"


@pytest.mark.parametrize("wrong", [False, True], ids=["ours", "wrong-last-node-check"])
def test_uniform_tree_steps_sample_as_the_padded_layout(tree_step, monkeypatch, wrong):
    """Sampled (temperature 1): one tree step's outcomes (emitted tokens) over N copies are
    distributed as the padded layout's (chi-square, two samples); a last-node check that
    forgets the token (accepting node K wherever the walk stops at its parent) fails."""
    import scipy.stats

    torch.manual_seed(3)
    gen = torch.Generator().manual_seed(5)
    N, K, V = 20_000, 4, 4
    one = torch.randn(1, K + 1, V, generator=gen)
    parents = torch.tensor([[-1, 0, 0, 1, 0]], dtype=torch.int32)  # node 4 under the root
    drafts = torch.tensor([[int(one[0, 0].argmax()), (int(one[0, 0].argmax()) + 1) % V, 1, 3]])
    drafts[0, 3] = next(t for t in range(V) if t not in drafts[0, :2].tolist())
    drafts = drafts.to(torch.int32)
    if wrong:
        monkeypatch.setattr(
            sampler, "_accepts_last", lambda at, parent, emitted, token: at == parent
        )
    sampled = SimpleNamespace(all_greedy=False, temperature=torch.ones(N), generators={})
    rows = [parents.expand(N, -1), drafts.expand(N, -1), one.expand(N, -1, -1).contiguous()]
    bonus = torch.full((N, 1), V - 1)
    counts = []
    for padded in (False, True):
        out, _ = _tree_step_outputs(tree_step, *rows, bonus, sampled, padded)
        keys, freq = torch.unique(out, dim=0, return_counts=True)
        counts.append({tuple(k.tolist()): int(c) for k, c in zip(keys, freq)})
    outcomes = sorted(set(counts[0]) | set(counts[1]))
    table = [[c.get(o, 0) for o in outcomes] for c in counts]
    p = scipy.stats.chi2_contingency(table).pvalue
    if wrong:
        assert p < 1e-6, p
    else:
        assert p > 1e-3, p


def test_tree_options_are_checked():
    from specdec.errors import InvalidRequestError
    from specdec.integrations.vllm import speculative_config
    from specdec.integrations.vllm.options import check_options

    if installed_version() is None:
        pytest.skip(f"speculative_config checks the vLLM version: {INSTALL_HINT}")
    config = speculative_config("ngram", tree=True, tree_branches=2)
    assert config["model"].endswith("hosted.DrafterProposer")
    assert config["num_speculative_tokens"] == 8
    assert config["specdec"] == {
        "tree": True,
        "sampler": "specdec",
        "drafter": "ngram",
        "tree_spec": "dynamic:4,2,9",
    }
    merged = speculative_config("eagle+ngram", tree="adaptive")
    assert merged["specdec"]["tree_spec"].startswith("adaptive")
    assert merged["num_speculative_tokens"] == TreeSpec.parse("adaptive").num_nodes - 1
    assert os.path.isdir(merged["specdec"]["head"])
    assert check_options(merged["specdec"]) == merged["specdec"]
    assert speculative_config("eagle3", tree=True)["specdec"]["drafter"] == "eagle"
    with pytest.raises(InvalidRequestError, match="must equal"):
        speculative_config("eagle", tree="dynamic:3,2,7", num_speculative_tokens=5)
    with pytest.raises(InvalidRequestError, match="is a chain"):
        speculative_config("eagle", tree="chain:4")
    with pytest.raises(InvalidRequestError, match="trees only"):
        speculative_config("eagle+ngram", tree=False)
    with pytest.raises(InvalidRequestError, match="shapes tree=True only"):
        speculative_config("ngram", tree="adaptive", tree_branches=2)
    with pytest.raises(InvalidRequestError, match="unknown option"):
        speculative_config("medusa", tree=True)
    with pytest.raises(InvalidRequestError, match="sampler"):
        speculative_config("ngram", tree=True, sampler="vllm")
    with pytest.raises(InvalidRequestError, match="sampler"):
        check_options({"tree": True, "drafter": "ngram", "tree_spec": "dynamic:2,2,4"})
    with pytest.raises(InvalidRequestError, match="drafter"):
        check_options({"tree": True, "sampler": "specdec", "drafter": "medusa"})
    # the hosted drafter's precision: trees only, a dtype name
    bf16 = speculative_config("eagle", tree=True, draft_dtype="bfloat16")["specdec"]
    assert bf16["draft_dtype"] == "bfloat16" and check_options(bf16) == bf16
    assert "draft_dtype" not in merged["specdec"]  # "auto" unless asked
    with pytest.raises(InvalidRequestError, match="draft_dtype"):
        speculative_config("eagle", tree=True, draft_dtype="int8")
    with pytest.raises(InvalidRequestError, match="draft_dtype"):
        speculative_config("eagle", draft_dtype="bfloat16")  # vLLM's own chain method
    with pytest.raises(InvalidRequestError, match="draft_dtype"):
        check_options({**bf16, "draft_dtype": "fp8"})


# 16 MiB of float32 KV (45 KiB a token): ~11 blocks of 32 tokens, 3 or 4 requests' worth.
KV_CACHE_BYTES = 16 << 20
# The engine test's configurations (specdec's speculative_config helper; None: vLLM plain).
CONFIGS = {
    "plain": None,
    "ngram tree": ("ngram", {"tree": True}),
    "eagle tree": ("eagle", {"tree": True, "draft_dtype": "bfloat16"}),
    "eagle+ngram adaptive": ("eagle+ngram", {"tree": "adaptive", "draft_dtype": "float32"}),
}  # (the server test drafts at draft_dtype "auto")


@pytest.fixture(scope="module")
def engine(model_dir):
    """engine(name) -> run_engine's result for CONFIGS[name] (float32): 3 MT-bench prompts at
    batch 1, 3 concurrent requests, and 8 requests arriving one every 2 engine steps in a
    cache of 32-token blocks too small to hold them all (vLLM preempts and recomputes)."""
    from specdec.bench.vllm import run_engine_process
    from specdec.datasets import mtbench_prompts
    from specdec.models.loader import load_tokenizer

    tok = load_tokenizer(model_dir)
    prompts = [
        tok.apply_chat_template([{"role": "user", "content": p}]) for p in mtbench_prompts(3)
    ]

    @functools.cache
    def run(name: str):
        from specdec.integrations.vllm import speculative_config

        method = CONFIGS[name]
        return run_engine_process(
            {
                "model_dir": model_dir,
                "dtype": "float32",
                "threads": 2,
                "prompt_ids": prompts,
                "max_new_tokens": 24,
                "concurrency": 3,
                "staggered": 8,
                "arrive_every": 2,
                "block_size": 32,
                "kv_cache_bytes": KV_CACHE_BYTES,
                "eos": sorted(tok.eos_token_ids),
                "seed": 0,
                "enforce_eager": True,
                "speculative_config": method and speculative_config(method[0], **method[1]),
            }
        )

    run.prompt_ids, run.eos = prompts, sorted(tok.eos_token_ids)
    return run


@pytest.mark.slow
@pytest.mark.skipif(installed_version() is None, reason=f"vLLM is not installed: {INSTALL_HINT}")
@pytest.mark.parametrize("name", [n for n in CONFIGS if CONFIGS[n]])
def test_vllm_with_specdec_trees_is_exact(engine, name):
    plain, tree = engine("plain"), engine(name)
    assert tree["specdec_sampler"], "the worker did not sample through specdec's op"
    for part in ("batch1", "concurrent", "staggered"):
        assert tree[part]["outputs"] == plain[part]["outputs"], part
    assert tree["staggered"]["preemptions"] > 0, "the small cache forced no preemption"
    drafted = [tree[part]["drafts"] for part in ("batch1", "concurrent", "staggered")]
    accepted = [tree[part]["accepted"] for part in ("batch1", "concurrent", "staggered")]
    assert sum(drafted) > 0, drafted
    if "eagle" in name:  # (24-token answers repeat few n-grams: n-gram trees may accept none)
        assert sum(accepted) > 0, (drafted, accepted)


def _post(url: str, body: dict, stream: bool = False) -> list:
    """The completion's token ids (streamed: the chunks' deltas joined)."""
    request = urllib.request.Request(
        url, json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=300) as r:
        if not stream:
            return json.loads(r.read())["choices"][0]["token_ids"]
        ids = []
        for line in r:
            line = line.decode().strip()
            if line.startswith("data: ") and line != "data: [DONE]":
                ids += json.loads(line[6:])["choices"][0].get("token_ids") or []
        return ids


@pytest.mark.slow
@pytest.mark.skipif(installed_version() is None, reason=f"vLLM is not installed: {INSTALL_HINT}")
def test_vllm_server_with_merged_adaptive_trees_is_exact(engine, model_dir, tmp_path):
    """The documented server (docs/integration.md, Trees inside vLLM): vLLM's OpenAI server
    with speculative_config("eagle+ngram", tree="adaptive") completes, plain and streamed,
    with vLLM plain's greedy tokens (float32)."""
    from specdec.integrations.vllm import speculative_config

    plain = engine("plain")
    prompts, eos = engine.prompt_ids, engine.eos
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    spec = json.dumps(speculative_config("eagle+ngram", tree="adaptive"))
    argv = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model_dir]
    argv += ["--speculative-config", spec, "--port", str(port), "--dtype", "float32"]
    argv += ["--enforce-eager", "--kv-cache-memory-bytes", str(256 << 20)]
    argv += ["--max-model-len", "512", "--max-num-seqs", "4"]
    env = {**os.environ, "OMP_NUM_THREADS": "2"}
    if env.get("PYTHONPATH"):
        env["PYTHONPATH"] = os.pathsep.join(map(os.path.abspath, env["PYTHONPATH"].split(":")))
    log = open(tmp_path / "server.log", "w")
    server = subprocess.Popen(
        argv, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=tmp_path, start_new_session=True
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 600
        while True:
            assert server.poll() is None, (tmp_path / "server.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "the server did not start"
            try:
                urllib.request.urlopen(url + "/v1/models", timeout=5)
                break
            except OSError:
                time.sleep(2)
        for i, prompt in enumerate(prompts):
            body = {
                "model": model_dir,
                "prompt": prompt,
                "max_tokens": 24,
                "temperature": 0.0,
                "stop_token_ids": eos,
                "return_token_ids": True,
            }
            expected = plain["batch1"]["outputs"][i]
            assert _post(url + "/v1/completions", body) == expected, i
            assert _post(url + "/v1/completions", {**body, "stream": True}, True) == expected, i
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
        log.close()
