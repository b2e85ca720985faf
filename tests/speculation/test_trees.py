"""Draft trees: the tree spec, the EAGLE-2 dynamic tree against a brute-force expansion,
the head's own tree attention against chain recomputation, and the chain drafter."""

import types

import pytest
import torch
from scipy.stats import chisquare

import specdec_kernels.ops as ops
from specdec.drafters.eagle_head import EagleHead
from specdec.errors import InvalidTreeSpecError
from specdec.models.config import ModelArgs
from specdec.models.llama import Transformer
from specdec.speculation import trees as drafting
from specdec.speculation.trees import Draft, TreeSpec
from specdec_kernels.reference import process_logits

from model_testing import sampling

V = 12


@pytest.mark.parametrize(
    "text, kind, T, head_nodes",
    [
        ("chain:1", "chain", 2, 1),
        ("chain:4", "chain", 5, 4),
        ("dynamic:5,8,32", "dynamic", 32, 33),
        ("dynamic:1,3,4", "dynamic", 4, 1),
    ],
)
def test_tree_spec(text, kind, T, head_nodes):
    spec = TreeSpec.parse(text)
    assert (spec.kind, spec.num_nodes, spec.head_nodes, str(spec)) == (kind, T, head_nodes, text)


@pytest.mark.parametrize(
    "text",
    [
        "chain:0",
        "chain",
        "dynamic:3,2",
        "dynamic:0,2,4",
        "dynamic:3,0,4",
        "dynamic:3,2,1",
        "tree:3",
        "",
    ],
)
def test_bad_tree_spec(text):
    with pytest.raises(InvalidTreeSpecError):
        TreeSpec.parse(text)


class BigramHead:
    """A fake head whose next-token log-probs depend only on the node's token (table[token]);
    records the head-tree calls to check their masks and positions. Its hidden is
    [one-hot token; extra logits] (2V): a tree node's is [one_hot(token); 0], the committed
    state's [0; root logits] (see root_hidden)."""

    def __init__(self, table):
        self.table = table  # [V, V] logits
        self.calls = []

    def __call__(
        self, tokens, features, cache, slots, cache_lens, start, num_nodes, tree_mask, positions
    ):
        self.calls.append(
            (tokens.clone(), cache_lens.clone(), start, tree_mask.clone(), positions.clone())
        )
        one_hot = torch.nn.functional.one_hot(tokens, V).float()
        return torch.cat((one_hot, torch.zeros_like(one_hot)), -1)

    def draft_logits(self, hidden):
        return hidden[..., :V] @ self.table + hidden[..., V:]

    def draft_to_target(self, ids):
        return ids

    def scatter_to_target(self, values, fill):
        return values


def root_hidden(root_logits):
    """The committed state of a BigramHead whose next-token logits are root_logits [B, V]."""
    return torch.cat((torch.zeros_like(root_logits), root_logits), -1)


def brute_force_eagle2(root_logits, table, depth, topk, total, width=None):
    """EAGLE-2, one candidate at a time: -> {token path from the root: cumulative log-prob};
    each level expands the best `width` (default topk) frontier nodes."""

    def children(path, score, logits):
        lp = torch.log_softmax(logits, -1)
        top = lp.topk(topk)
        return [(path + (int(t),), score + float(s)) for s, t in zip(top.values, top.indices)]

    level = children((), 0.0, root_logits)
    cands = list(level)
    for _ in range(depth - 1):
        kids = [c for path, s in level[:width] for c in children(path, s, table[path[-1]])]
        cands += kids
        level = sorted(kids, key=lambda c: -c[1])[:topk]
    best = sorted(cands, key=lambda c: -c[1])[: total - 1]  # stable: ties keep creation order
    return dict(best)


def node_paths(draft, b):
    paths = {0: ()}
    for i in range(1, int(draft.num_nodes[b])):
        paths[i] = paths[int(draft.parents[b, i])] + (int(draft.tokens[b, i]),)
    return paths


def head_cache(B, lens):
    return types.SimpleNamespace(cache_lens=torch.tensor(lens, dtype=torch.int32)[:B])


@pytest.mark.parametrize(
    "depth, topk, total, width",
    [
        (4, 3, 12, None),
        (3, 2, 30, None),
        (1, 4, 3, None),
        (5, 2, 9, None),
        (4, 3, 12, 1),
        (3, 4, 20, 2),
    ],
)
def test_dynamic_tree_matches_brute_force(depth, topk, total, width):
    """The EAGLE-2 tree, and with levels `width` nodes wide (the cost model's narrow levels;
    the adaptive policy's expand_width)."""
    B = 3
    table = torch.randn(V, V) * 2
    root_logits = torch.randn(B, V) * 2
    head = BigramHead(table)
    roots = torch.tensor([1, 2, 3])
    spec = TreeSpec("dynamic", depth, topk, total)
    d = drafting.draft_dynamic(
        spec,
        head,
        root_hidden(root_logits),
        head_cache(B, [5, 9, 17]),
        torch.arange(B),
        roots,
        width=width,
    )
    width = width or topk
    assert d.tokens.shape == d.parents.shape == (B, total) and d.draft_probs is None
    for b in range(B):
        n = int(d.num_nodes[b])
        want = brute_force_eagle2(root_logits[b], table, depth, topk, total, width)
        assert n == len(want) + 1 and int(d.tokens[b, 0]) == int(roots[b])
        assert int(d.parents[b, 0]) == -1 and all(
            0 <= int(d.parents[b, i]) < i for i in range(1, n)
        )
        assert (d.parents[b, n:] == -1).all()
        paths = node_paths(d, b)
        assert set(paths.values()) - {()} == set(want)
        scores = [want[paths[i]] for i in range(1, n)]
        assert scores == sorted(scores, reverse=True)  # re-ranked by cumulative log-prob
    # the head's own tree: node 0 at the last committed position, depth-d nodes rotated at n - 1 + d
    for d_minus_1, (tokens, base, start, mask, positions) in enumerate(head.calls):
        assert start == 1 + d_minus_1 * width and tokens.shape == (B, width)
        assert torch.equal(base, torch.tensor([4, 8, 16], dtype=torch.int32))
        assert torch.equal(positions, (base + d_minus_1 + 1)[:, None].expand(B, width))
        assert mask.shape[1] == start + width


@pytest.mark.parametrize("width", [0, -1, 1.5, True])
def test_dynamic_tree_rejects_a_bad_width(width):
    head = BigramHead(torch.randn(V, V))
    with pytest.raises(ValueError, match="width"):
        drafting.draft_dynamic(
            TreeSpec("dynamic", 2, 2, 4),
            head,
            root_hidden(torch.randn(1, V)),
            head_cache(1, [5]),
            torch.arange(1),
            torch.tensor([1]),
            width=width,
        )


def tiny_target(seed=0):
    args = ModelArgs(
        vocab_size=V, dim=32, n_layers=3, n_heads=4, n_kv_heads=2, head_dim=8, hidden_dim=64
    )
    torch.manual_seed(seed)
    model = Transformer(args).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.5)
    return model


def extend(head, cache, slot, tokens, features):
    """Chain pass of the head over new (token, feature) pairs of one slot -> hidden [M, dim]."""
    M = len(tokens)
    slots = torch.tensor([slot])
    parents = torch.arange(-1, M - 1, dtype=torch.int32)[None]
    num = torch.tensor([M], dtype=torch.int32)
    mask, depth = ops.build_tree_mask(parents, num)
    lens = cache.cache_lens[slots]
    h = head(tokens[None], features[None], cache, slots, lens, 0, num, mask, lens[:, None] + depth)
    cache.cache_lens[slots] += M
    return h[0]


@pytest.mark.parametrize("version", [2, 3])
def test_head_tree_attention_equals_chain_recomputation(version):
    """A depth-3 node of the head's tree (with siblings and cousins in the tree) gets the
    same hidden as running the head on its own path as a plain sequence."""
    target = tiny_target()
    head = EagleHead.random(target, version=version, seed=3)
    F = (3 if version == 3 else 1) * 32
    S = 7
    prefix_tok, prefix_feat = torch.randint(0, V, (S,)), torch.randn(S, F)
    cache = head.new_cache(2, 64, block_size=4)
    with torch.no_grad():
        h_prefix = extend(head, cache, 1, prefix_tok, prefix_feat)
        tree = drafting.HeadTree(head, cache, torch.tensor([1]), 1 + 3 + 2 + 2)
        lvl1_tok = torch.randint(0, V, (1, 3))
        h1 = tree.add(lvl1_tok, h_prefix[-1].expand(1, 3, -1), torch.zeros(1, 3), depth=1)
        lvl2_tok = torch.randint(0, V, (1, 2))
        h2 = tree.add(
            lvl2_tok, h1[:, [2, 0]], torch.tensor([[3, 1]]), depth=2
        )  # children of nodes 3 and 1
        lvl3_tok = torch.randint(0, V, (1, 2))
        h3 = tree.add(
            lvl3_tok, h2[:, [1, 0]], torch.tensor([[5, 4]]), depth=3
        )  # children of 5 and 4

        # path of h3[0, 0]: level-1 node 1 (token lvl1[0]) -> node 5 (lvl2[1]) -> node 6
        fresh = head.new_cache(1, 64)
        extend(head, fresh, 0, prefix_tok, prefix_feat)
        path_tok = torch.stack([lvl1_tok[0, 0], lvl2_tok[0, 1], lvl3_tok[0, 0]])
        path_feat = torch.stack([h_prefix[-1], h1[0, 0], h2[0, 1]])
        want = extend(head, fresh, 0, path_tok, path_feat)
    torch.testing.assert_close(h1[0, 0], want[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(h2[0, 1], want[1], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(h3[0, 0], want[2], atol=1e-5, rtol=1e-5)
    assert int(cache.cache_lens[1]) == S  # drafting never commits


def test_greedy_chain_is_iterated_argmax():
    table = torch.randn(V, V)
    root_logits = torch.randn(2, V)
    d = drafting.draft_chain(
        TreeSpec("chain", 4),
        BigramHead(table),
        root_hidden(root_logits),
        head_cache(2, [3, 4]),
        torch.arange(2),
        torch.tensor([5, 6]),
        sampling([0.0, 0.0]),
    )
    assert d.draft_probs is None and d.num_nodes.tolist() == [5, 5]
    assert d.parents[0].tolist() == [-1, 0, 1, 2, 3]
    for b in range(2):
        tok = int(root_logits[b].argmax())
        for i in range(1, 5):
            assert int(d.tokens[b, i]) == tok
            tok = int(table[tok].argmax())


def test_sampled_chain_draws_from_draft_probs():
    """Sampled rows: token i is drawn from draft_probs[:, i - 1] (the head's processed
    distribution at its parent); the greedy row of the same batch gets one-hot rows."""
    N = 3000  # sampled rows, all with the same head state, plus one greedy row
    table = torch.randn(V, V)
    root_logits = torch.randn(V).expand(N + 1, V)
    d = drafting.draft_chain(
        TreeSpec("chain", 2),
        BigramHead(table),
        root_hidden(root_logits),
        head_cache(N + 1, [3] * (N + 1)),
        torch.arange(N + 1),
        torch.full((N + 1,), 5),
        sampling([0.8] * N + [0.0], top_k=6),
    )
    q1 = process_logits(root_logits[0], 0.8, 6, 1.0)
    torch.testing.assert_close(d.draft_probs[:N, 0], q1.expand(N, V))
    for b in range(0, N, 97):
        torch.testing.assert_close(
            d.draft_probs[b, 1], process_logits(table[int(d.tokens[b, 1])], 0.8, 6, 1.0)
        )
    assert (d.draft_probs[:N, 1].gather(1, d.tokens[:N, 2:3]) > 0).all()
    one_hot = torch.nn.functional.one_hot(root_logits[N].argmax(), V).float()
    assert torch.equal(d.draft_probs[N, 0], one_hot) and int(d.tokens[N, 1]) == int(
        one_hot.argmax()
    )
    counts = torch.bincount(d.tokens[:N, 1], minlength=V).float()
    support = q1 > 0
    assert counts[~support].sum() == 0
    assert chisquare(counts[support], q1[support] * N).pvalue > 1e-3


@pytest.mark.parametrize(
    "temperature, top_k, top_p", [(1.0, 0, 1.0), (0.7, 5, 1.0), (1.3, 0, 0.8), (0.5, 8, 0.6)]
)
def test_draft_distribution_matches_reference_processing(temperature, top_k, top_p):
    logits = torch.randn(4, 50) * 2
    q = drafting.draft_distribution(logits, sampling([temperature] * 4, top_k, top_p))
    for b in range(4):
        torch.testing.assert_close(q[b], process_logits(logits[b], temperature, top_k, top_p))


def test_sample_rows_is_inverse_cdf():
    probs = torch.tensor([[0.0, 0.5, 0.0, 0.3, 0.2, 0.0]])
    counts = torch.zeros(6)
    gen = [torch.Generator().manual_seed(1)]
    for _ in range(3000):
        counts[int(drafting.sample_rows(probs, gen))] += 1
    assert counts[[0, 2, 5]].sum() == 0
    assert chisquare(counts[[1, 3, 4]], probs[0, [1, 3, 4]] * 3000).pvalue > 1e-3


def test_truncate_keeps_a_valid_prefix_tree():
    parents = torch.tensor([[-1, 0, 0, 1, 2, 3], [-1, 0, 1, 2, -1, -1]], dtype=torch.int32)
    d = Draft(torch.arange(12).view(2, 6), parents, torch.tensor([6, 4], dtype=torch.int32))
    t = d.truncate(torch.tensor([3, 9]))
    assert t.num_nodes.tolist() == [3, 4]
    assert t.parents.tolist() == [[-1, 0, 0, -1, -1, -1], [-1, 0, 1, 2, -1, -1]]
    assert t.tokens[0].tolist() == [0, 1, 2, 0, 0, 0]
