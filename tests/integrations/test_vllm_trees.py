"""Trees inside vLLM's step (specdec.integrations.vllm.trees / attention): the n-gram tree
proposer's tries, the attention backend against a float64 dense reference over vLLM's cache
layout, the sampler's tree path against the greedy walk, and a running vLLM engine whose
greedy output equals vLLM plain's at batch 1 and with concurrent requests (float32)."""

import functools
import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from specdec.integrations.vllm import sampler, trees
from specdec.integrations.vllm.attention import TreeAttentionImpl
from specdec.integrations.vllm.trees import kv_views
from specdec.integrations.vllm.version import INSTALL_HINT, installed_version


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
        model_config=SimpleNamespace(max_model_len=1000),
        additional_config={"specdec": {"tree": True, "sampler": "specdec", **options}},
    )


def test_tree_proposer_drafts_topological_tries_of_the_continuations():
    proposer = trees.NgramTreeProposer(_vllm_config(nodes=6, tree_branches=2, tree_depth=3))
    # "1 2" was followed by 3 4 5, 7 8 and 3 4 9: the trie under the root 2 holds 3-4-9 and
    # 7-8-0 (most recent first), and 3-4-5 would need a seventh node
    history = np.array([1, 2, 3, 4, 5, 0, 1, 2, 7, 8, 0, 1, 2, 3, 4, 9, 0, 1, 2])
    rows = np.stack([history, history])
    drafts = proposer.propose([[2], []], np.array([len(history), len(history)]), rows)
    assert drafts[1] == [] and proposer.parents[1] == [-1]
    assert drafts[0] == [3, 4, 9, 7, 8, 0]
    assert proposer.parents[0] == [-1, 0, 1, 2, 0, 4, 5]
    # vLLM may keep a prefix of the drafts: every prefix is a tree (parents before children)
    assert all(0 <= p < i for i, p in enumerate(proposer.parents[0]) if i)


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


def test_tree_attention_matches_a_dense_reference_in_vllms_cache_layout(tree_step):
    torch.manual_seed(0)
    Hq, Hkv, D, block_size, num_blocks = 4, 2, 16, 8, 12
    kv_cache = torch.randn(num_blocks, Hkv, block_size, 2 * D)  # vLLM's per-layer allocation
    block_table = torch.tensor([[5, 2, 9], [0, 7, 3]], dtype=torch.int32)
    cache_lens = [6, 11]  # row 0: a 4-token prefill chunk; row 1: a 5-node tree
    query_lens = [4, 5]
    tree = [-1, 0, 0, 1, 2]
    tree_step.update(parents={1: tree})
    starts = [0, 4, 9]
    N = starts[-1]
    positions = torch.tensor(
        [cache_lens[0] + i for i in range(4)] + [cache_lens[1] + i for i in range(5)]
    )
    req = torch.tensor([0] * 4 + [1] * 5)
    slots = block_table.long()[req, positions // block_size] * block_size + positions % block_size
    meta = SimpleNamespace(
        num_reqs=2,
        num_actual_tokens=N,
        query_start_loc_cpu=torch.tensor(starts, dtype=torch.int32),
        seq_lens=torch.tensor([c + q for c, q in zip(cache_lens, query_lens)], dtype=torch.int32),
        block_table_tensor=block_table,
        slot_mapping=slots,
    )
    from specdec.integrations.vllm.attention import TreeAttentionMetadataBuilder

    builder = object.__new__(TreeAttentionMetadataBuilder)
    attn_metadata = builder.build(0, meta)
    impl = TreeAttentionImpl(Hq, D, D**-0.5, Hkv, None, None, "auto")
    q, k, v = torch.randn(N, Hq, D), torch.randn(N, Hkv, D), torch.randn(N, Hkv, D)
    before = kv_cache.clone()
    impl.do_kv_cache_update(None, k, v, kv_cache, slots)
    output = torch.zeros(N, Hq * D)
    impl.forward(None, q, k, v, kv_cache, attn_metadata, output)

    k_old, v_old = kv_views(before, D)
    for b in range(2):
        blocks = block_table[b].long()
        rows = slice(starts[b], starts[b + 1])
        S = cache_lens[b]
        k_all = torch.cat((k_old.index_select(0, blocks).reshape(-1, Hkv, D)[:S], k[rows]))
        v_all = torch.cat((v_old.index_select(0, blocks).reshape(-1, Hkv, D)[:S], v[rows]))
        n = query_lens[b]
        allowed = torch.zeros(n, S + n, dtype=torch.bool)
        allowed[:, :S] = True
        parents = tree if b == 1 else list(range(-1, n - 1))
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
    k_new, _ = kv_views(kv_cache, D)
    for t in range(N):
        blk, row = divmod(int(slots[t]), block_size)
        torch.testing.assert_close(k_new[blk, row], k[t])


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


def test_tree_options_are_checked():
    from specdec.errors import InvalidRequestError
    from specdec.integrations.vllm import speculative_config
    from specdec.integrations.vllm.options import check_options

    if installed_version() is None:
        pytest.skip(f"speculative_config checks the vLLM version: {INSTALL_HINT}")
    config = speculative_config("ngram", tree=True, tree_branches=2)
    assert config["model"].endswith("NgramTreeProposer")
    assert config["specdec"] == {"tree": True, "sampler": "specdec", "tree_branches": 2}
    with pytest.raises(InvalidRequestError, match="adaptive"):
        speculative_config("ngram", tree="adaptive")
    with pytest.raises(InvalidRequestError, match="sampler"):
        speculative_config("ngram", tree=True, sampler="vllm")
    with pytest.raises(InvalidRequestError, match="sampler"):
        check_options({"tree": True})


@pytest.fixture(scope="module")
def engine(model_dir):
    """engine(spec) -> run_engine's result (batch 1 and 3 concurrent requests, float32)."""
    from specdec.bench.vllm import run_engine_process
    from specdec.datasets import mtbench_prompts
    from specdec.models.loader import load_tokenizer

    tok = load_tokenizer(model_dir)
    prompts = [
        tok.apply_chat_template([{"role": "user", "content": p}]) for p in mtbench_prompts(3)
    ]

    @functools.cache
    def run(tree: bool):
        from specdec.integrations.vllm import speculative_config

        return run_engine_process(
            {
                "model_dir": model_dir,
                "dtype": "float32",
                "threads": 2,
                "prompt_ids": prompts,
                "max_new_tokens": 24,
                "concurrency": 3,
                "eos": sorted(tok.eos_token_ids),
                "seed": 0,
                "enforce_eager": True,
                "speculative_config": speculative_config("ngram", tree=True) if tree else None,
            }
        )

    return run


@pytest.mark.slow
@pytest.mark.skipif(installed_version() is None, reason=f"vLLM is not installed: {INSTALL_HINT}")
def test_vllm_with_ngram_trees_is_exact(engine):
    plain, tree = engine(False), engine(True)
    assert tree["specdec_sampler"], "the worker did not sample through specdec's op"
    assert tree["batch1"]["outputs"] == plain["batch1"]["outputs"]
    assert tree["concurrent"]["outputs"] == plain["concurrent"]["outputs"]
    assert tree["batch1"]["drafts"] > 0 and tree["batch1"]["accepted"] > 0
