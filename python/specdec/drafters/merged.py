"""Merged trees (`eagle+ngram`): one draft tree per request holding the EAGLE tree and the
n-gram branches, identical token paths merged.

Both parts draft from the same root: the EAGLE head its dynamic tree (EAGLE-2 top-k, its own
drafting.draft_dynamic), n-gram lookup the continuations of the longest matching suffix
(drafters.ngram). The trees are merged as a trie: a node is a (parent, token) pair, so a
branch whose prefix equals a path of the other tree shares those nodes and only its new
suffix costs verification. Both parts' drafts are deterministic (top-k candidates, earlier
occurrences), so the merged tree passes draft_probs=None (point masses) and
tree_rejection_sample keeps the output exactly the target's, greedy or sampled. (A chain
tree samples its EAGLE drafts when sampling, so it is refused: draft probabilities of a
sampled chain and point masses of n-gram branches at the same node do not mix.)

Sizes (TreeSpec bounds: TOTAL nodes per request, root included):
  dynamic:D,K,N: the n-gram trie first (at most K branches of D tokens: they cost no
      drafting and are usually right when a match exists), then EAGLE's nodes in its own
      ranking (best cumulative log-prob first) until N nodes. The tree thus contains the
      n-gram drafter's own tree, and its greedy acceptance is at least the n-gram one's.
  adaptive[:D,K,N]: every candidate of both parts gets its predicted acceptance from the
      policy (the tree sizer's node_value of its confidence, per depth: the head's
      probability for EAGLE, NgramDrafter.confidences for n-gram; a shared node takes the
      larger), and the policy keeps each request's best ones in one ranking (Policy.sizes).
      Drafting is priced at EAGLE's levels (lookups cost ~0).

commit() forwards the StepResult to both parts: the n-gram part appends the emitted tokens,
EAGLE gathers the target's features of the accepted nodes from result.hidden / result.aux by
result.accepted_nodes, which index the merged tree that was verified (the parts never see
their own node numbers again), so neither needs to know about the merge.
"""

import torch

from specdec.drafters.base import Drafter, Proposal
from specdec.drafters.eagle import EagleDrafter
from specdec.drafters.ngram import NgramDrafter
from specdec.errors import InvalidTreeSpecError


def merge_trees(root: int, trees: list, visits, total: int):
    """Trie merge of draft trees under one root.

    trees: per part (tokens, parents), node 0 the root (its token ignored), parents before
    children; visits: (part, node) pairs in the order nodes are taken (a node after its
    parent); total: the most nodes of the result, root included. A node whose (parent,
    token) is already there maps onto it (no new node); one that does not fit, or whose
    parent was left out, is left out. -> (tokens, parents, origin): the merged tree (node
    0 the root, parents before children) and per part {its node: merged node}."""
    tokens, parents = [root], [-1]
    child: dict[tuple[int, int], int] = {}
    origin: list[dict[int, int]] = [{0: 0} for _ in trees]
    for part, node in visits:
        part_tokens, part_parents = trees[part]
        parent = origin[part].get(part_parents[node])
        if parent is None:
            continue  # its parent did not fit
        key = (parent, part_tokens[node])
        merged = child.get(key)
        if merged is None:
            if len(tokens) >= total:
                continue
            merged = child[key] = len(tokens)
            tokens.append(part_tokens[node])
            parents.append(parent)
        origin[part][node] = merged
    return tokens, parents, origin


class _Uncapped:
    """The policy as draft_dynamic sees it, except that every request keeps all its
    candidates (up to TOTAL - 1): the merged drafter ranks them together with the n-gram
    ones. Records the levels drafted."""

    def __init__(self, policy):
        self.policy, self.levels = policy, 0

    def __getattr__(self, name):
        return getattr(self.policy, name)

    def sizes(self, values, levels):
        self.levels = levels
        n = min(values.shape[1], self.policy.spec.total - 1)
        return torch.full((values.shape[0],), n, dtype=torch.long, device=values.device)


class MergedDrafter(Drafter):
    """EAGLE's dynamic tree and n-gram branches in one tree (`dynamic` or `adaptive`)."""

    name = "eagle+ngram"
    adaptive = True

    def __init__(self, eagle: EagleDrafter, ngram: NgramDrafter):
        self.eagle, self.ngram = eagle, ngram
        self.head = eagle.head
        self.feature_layers = eagle.feature_layers

    def modules(self):
        return self.eagle.modules() + self.ngram.modules()

    def check(self, tree, max_nodes: int) -> None:
        if tree.kind == "chain":
            raise InvalidTreeSpecError(
                f"eagle+ngram merges trees: --tree must be dynamic:D,K,N or adaptive, got {tree}"
            )
        self.eagle.check(tree, max_nodes)

    def cache_positions(self, tree, capacity: int) -> int:
        return self.eagle.cache_positions(tree, capacity)

    def measure_cost(self, model, tree, batch_size: int, target_forward=None):
        # n-gram lookup costs ~0
        return self.eagle.measure_cost(model, tree, batch_size, target_forward)

    def setup(self, setup) -> None:
        self.tree, self.device = setup.tree, setup.device
        self.eagle.setup(setup)
        self.ngram.setup(setup)

    def start(self, slots, prompts, first_tokens, hidden, aux, ok) -> None:
        self.eagle.start(slots, prompts, first_tokens, hidden, aux, ok)
        self.ngram.start(slots, prompts, first_tokens, hidden, aux, ok)

    def commit(self, slots, proposal, result) -> None:
        # result indexes the merged tree; both parts read only its tokens / target features
        self.eagle.commit(slots, proposal, result)
        self.ngram.commit(slots, proposal, result)

    def propose(self, slots, roots, sampling, policy=None) -> Proposal:
        ng = self.ngram
        ngram_rows, matched = [], []  # per request the n-gram trie, and the n matched
        for slot, root in zip(slots.tolist(), roots.tolist()):
            n, conts = ng.match(ng.history[slot][: ng.lens[slot]])
            ngram_rows.append(ng.trie(root, conts))  # (tokens, parents, depths, counts)
            matched.append(n)
        if policy is None:
            return self._dynamic(slots, roots, sampling, ngram_rows)
        return self._adaptive(slots, roots, sampling, ngram_rows, matched, policy)

    def _dynamic(self, slots, roots, sampling, ngram_rows) -> Proposal:
        e = self.eagle.propose(slots, roots, sampling, None)  # ranked best first, topological
        e_tokens, e_parents, e_num = e.tokens.tolist(), e.parents.tolist(), e.num_nodes.tolist()
        total = self.tree.total
        rows = []
        for b, (n_tok, n_par, _, _) in enumerate(ngram_rows):
            visits = [(0, i) for i in range(1, len(n_tok))] + [(1, i) for i in range(1, e_num[b])]
            trees = [(n_tok, n_par), (e_tokens[b], e_parents[b])]
            tok, par, _ = merge_trees(int(roots[b]), trees, visits, total)
            rows.append((tok, par, None))
        return self._proposal(rows, roots, None)

    def _adaptive(self, slots, roots, sampling, ngram_rows, matched, policy) -> Proposal:
        uncapped = _Uncapped(policy)
        e = self.eagle.propose(slots, roots, sampling, uncapped)  # every candidate, ranked
        assert e.confidence is not None
        e_tokens, e_parents = e.tokens.tolist(), e.parents.tolist()
        e_num, e_conf = e.num_nodes.tolist(), e.confidence.tolist()
        merged = []  # per request: tokens, parents, values, confidences of the union
        for b, (n_tok, n_par, _, _) in enumerate(ngram_rows):
            n_conf = self.ngram.confidences(ngram_rows[b], matched[b])
            trees = [(n_tok, n_par), (e_tokens[b], e_parents[b])]
            visits = [(1, i) for i in range(1, e_num[b])] + [(0, i) for i in range(1, len(n_tok))]
            tok, par, origin = merge_trees(int(roots[b]), trees, visits, 1 << 30)
            value, conf, depth = [1.0] + [0.0] * (len(tok) - 1), [1.0] * len(tok), [0] * len(tok)
            for i in range(1, len(tok)):
                depth[i] = depth[par[i]] + 1
            # in merged order, so that a parent's value is final before its children's
            estimates = sorted(
                (m, part_conf[node])
                for part, part_conf in ((1, e_conf[b]), (0, n_conf))
                for node, m in origin[part].items()
                if m > 0
            )
            local = policy.local_values([c for _, c in estimates], [depth[m] for m, _ in estimates])
            for (m, c), p in zip(estimates, local.tolist()):
                v = value[par[m]] * p
                if v > value[m]:  # a shared node: the more confident part's estimate
                    value[m], conf[m] = v, c
            merged.append((tok, par, value, conf))
        # one ranking per request: the policy keeps each request's best candidates; a
        # child's value is <= its parent's and its number larger, so a stable descending
        # sort keeps every kept node's ancestors before it (as draft_dynamic does)
        B, C = len(merged), max(len(m[0]) for m in merged) - 1
        values = torch.zeros(B, max(C, 1))
        for b, (tok, _, value, _) in enumerate(merged):
            values[b, : len(tok) - 1] = torch.tensor(value[1:])
        levels = uncapped.levels  # what drafting cost: EAGLE's levels (lookups cost ~0)
        kept = policy.sizes(values, levels).cpu() if C else torch.zeros(B, dtype=torch.long)
        rows = []
        for b, (tok, par, _, conf) in enumerate(merged):
            n = min(int(kept[b]), len(tok) - 1)
            order = torch.sort(values[b, : len(tok) - 1], descending=True, stable=True)
            keep = [0] + (order.indices[:n] + 1).tolist()
            new = {old: j for j, old in enumerate(keep)}
            rows.append(
                (
                    [tok[i] for i in keep],
                    [-1] + [new[par[i]] for i in keep[1:]],
                    [conf[i] for i in keep],
                )
            )
        return self._proposal(rows, roots, policy)

    def _proposal(self, rows, roots, policy) -> Proposal:
        """rows: per request (tokens, parents, confidences or None) -> the padded Proposal."""
        B, dev = len(rows), roots.device
        T = max(len(r[0]) for r in rows)
        tokens = torch.zeros(B, T, dtype=torch.long)
        parents = torch.full((B, T), -1, dtype=torch.int32)
        confidence = torch.ones(B, T) if policy is not None else None
        for b, (tok, par, conf) in enumerate(rows):
            tokens[b, : len(tok)] = torch.tensor(tok)
            parents[b, : len(par)] = torch.tensor(par, dtype=torch.int32)
            if confidence is not None:
                confidence[b, : len(conf)] = torch.tensor(conf)
        tokens[:, 0] = roots.cpu()
        num_nodes = torch.tensor([len(r[0]) for r in rows], dtype=torch.int32)
        return Proposal(
            tokens.to(dev),
            parents.to(dev),
            num_nodes.to(dev),
            None,
            None if confidence is None else confidence.to(dev),
        )
