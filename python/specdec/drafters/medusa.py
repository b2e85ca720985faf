"""The Medusa drafter: K Medusa heads (specdec.drafters.medusa_heads) over the target's last
hidden state.

State per slot: the target's final-norm hidden state h of the last accepted node (the
prefill's last position at start, then the accepted path's last node of every step). The
root (the token the target sampled from h) sits at position t + 1; head d reads h and
predicts t + 1 + d, i.e. draft depth d. One pass of all heads per step, no cache.

Sparse tree (Medusa's): a node is a path (c_1, ..., c_d) of candidate ranks, c_i being an
index into head i's top-k; its token is head d's rank-c_d candidate and its value is the
product of the estimated per-head accuracies acc[i][c_i] (P(head i's rank-c candidate is
the true token)). The tree is the N - 1 paths of greatest value, found best-first (children
are worth at most their parent, so the set is closed under ancestors and comes out in
topological order), shared by the batch's rows. The accuracies start from the heads'
measured held-out ones (config.json "head_accuracy", else a generic prior) and follow what
the target emits: after each step the true tokens at depths 1 .. accepted + 1 are known, and
the rank each head gave them is counted (decayed). (When sampling, the token at the first
rejected depth is drawn from the residual distribution, which excludes the rejected drafts:
that depth's accuracy is somewhat underestimated. It only sizes the tree, never exactness.)

Trees (--tree): chain:D (top-1 of heads 1..D), dynamic:D,K,N (D heads, top-K each, N nodes
with the root) and adaptive[:D,K,N]: the dynamic tree's paths as candidates, each node's
confidence its head probability, valued by the tree sizer's node_value and cut to the size
Policy.size picks (DEPTH is capped at the number of heads). Drafts are deterministic top-k
candidates (draft_probs None, point masses): tree_rejection_sample keeps greedy and sampled
output exactly the target's (this is not Medusa's lossy typical acceptance).
"""

import heapq

import torch

from specdec.drafters.base import Drafter, Proposal
from specdec.errors import InvalidTreeSpecError
from specdec.speculation.cost_model import CostModel, median_time

PRIOR_COUNT = 20.0  # pseudo-observations behind the prior accuracies
DECAY = 0.995  # per observed step: the estimates follow the workload
MIN_ACC = 1e-4  # keeps every path's value positive (best-first needs a strict order)


def generic_prior(depth: int, topk: int) -> list:
    """Accuracy prior for heads without measured ones: head d's rank-j candidate."""
    return [[0.5 * 0.75**d / (j + 1) ** 1.5 for j in range(topk)] for d in range(depth)]


def sparse_tree(acc: list, n: int) -> list:
    """The n paths of greatest product of accuracies -> [(parent, depth, rank)] in best-first
    (topological) order; parent -1 is the root, else an index into this list.
    acc[d][j]: P(head d + 1's rank-j candidate is right), each in (0, 1]."""
    depth, topk = len(acc), len(acc[0])
    heap = [(-acc[0][j], 0, -1, 1, j) for j in range(topk)]  # (-value, tie, parent, depth, rank)
    heapq.heapify(heap)
    out: list[tuple[int, int, int]] = []
    tie = topk
    while heap and len(out) < n:
        neg, _, parent, d, j = heapq.heappop(heap)
        out.append((parent, d, j))
        if d < depth:
            me = len(out) - 1
            for r in range(topk):
                heapq.heappush(heap, (neg * acc[d][r], tie, me, d + 1, r))
                tie += 1
    return out


class MedusaDrafter(Drafter):
    """Chain, sparse-tree or adaptive drafts from MedusaHeads (see the module docstring)."""

    name = "medusa"
    adaptive = True

    def __init__(self, heads):
        self.heads = heads

    def modules(self):
        return [self.heads]

    # ------------------------------------------------------------------ sizing
    def _shape(self, tree):
        """-> (depth, topk, total) this drafter uses for tree."""
        if tree.kind == "chain":
            return tree.depth, 1, tree.depth + 1
        depth = min(tree.depth, self.heads.num_heads) if tree.kind == "adaptive" else tree.depth
        return depth, tree.topk, tree.total

    def check(self, tree, max_nodes: int) -> None:
        tree.check_fits(max_nodes, self.heads.draft_vocab_size)
        if tree.kind != "adaptive" and tree.depth > self.heads.num_heads:
            raise InvalidTreeSpecError(
                f"--tree {tree}: depth {tree.depth} needs {tree.depth} Medusa heads, these "
                f"heads have {self.heads.num_heads}"
            )

    def measure_cost(self, model, tree, batch_size: int, target_forward=None) -> CostModel:
        """Verify costs as CostModel.measure times them (no draft model: draft_s zero), then
        draft_s filled with the time of one heads pass (all levels at once: the same for any
        depth) at each measured batch size."""
        cost = CostModel.measure(model, None, tree, batch_size, target_forward=target_forward)
        depth, topk, _ = self._shape(tree)
        cost.draft_s = [self._time_heads(batch_size, depth, topk)] * tree.depth
        for other in cost.others:
            other["draft_s"] = [self._time_heads(other["batch_size"], depth, topk)] * tree.depth
        return cost

    @torch.inference_mode()
    def _time_heads(self, batch: int, depth: int, topk: int, repeats: int = 3) -> float:
        w = self.heads.weight
        h = torch.randn(batch, self.heads.dim, dtype=w.dtype, device=w.device)
        return median_time(lambda: self._candidates(h, depth, topk), repeats, w.device)

    # ------------------------------------------------------------------ per run
    def setup(self, setup) -> None:
        self.tree, self.device = setup.tree, setup.device
        self.depth, self.topk, self.total = self._shape(setup.tree)
        self.hidden = torch.zeros(
            setup.batch_size,
            setup.model.args.dim,
            dtype=self.heads.weight.dtype,
            device=self.device,
        )
        prior = self.heads.head_accuracy or generic_prior(self.depth, self.topk)
        prior = [
            [
                max(MIN_ACC, row[j] if j < len(row) else row[-1] * 0.8 ** (j - len(row) + 1))
                for j in range(self.topk)
            ]
            for row in (prior + prior[-1:] * self.depth)[: self.depth]
        ]
        self.hits = torch.tensor(prior, dtype=torch.float64) * PRIOR_COUNT  # [D, K]
        self.seen = torch.full((self.depth,), PRIOR_COUNT, dtype=torch.float64)  # [D]
        # the sparse tree, recomputed when the accuracies change
        self._paths: list[tuple[int, int, int]] | None = None
        # (top ids [B, D, K],) of this step's proposal, for commit's accuracy counts
        self._proposed: tuple[torch.Tensor] | None = None

    def accuracy(self) -> list:
        """acc[d][j]: estimated P(head d + 1's rank-j candidate is the true token)."""
        return (self.hits / self.seen[:, None]).clamp(MIN_ACC, 1.0).tolist()

    def start(self, slots, prompts, first_tokens, hidden, aux, ok) -> None:
        for slot, h, good in zip(slots.tolist(), hidden, ok):
            if good:
                self.hidden[slot] = h[-1]

    def commit(self, slots, proposal, result) -> None:
        B = len(slots)
        rows = torch.arange(B, device=self.device)
        last = result.accepted_nodes[rows, result.num_accepted.long()].long()  # [B]
        good = torch.tensor(result.ok, dtype=torch.bool, device=self.device)
        new = result.hidden[rows, last].to(self.hidden.dtype)
        self.hidden[slots] = torch.where(good[:, None], new, self.hidden[slots])
        if self._proposed is not None:
            self._learn(*self._proposed, result)
            self._proposed = None

    def _learn(self, top, result) -> None:
        """Counts, per head d, the rank of the true token at depth d (output_tokens[d - 1])
        in its top-k, for the depths the step revealed (d <= accepted + 1)."""
        out = result.output_tokens[:, : self.depth].long()  # [B, <=D]
        n = out.shape[1]
        known = (
            torch.arange(n, device=out.device)[None] <= result.num_accepted[:, None].long()
        ) & torch.tensor(result.ok, dtype=torch.bool, device=out.device)[:, None]
        match = (top[:, :n] == out[..., None]) & known[..., None]  # [B, n, K]
        self.hits *= DECAY
        self.seen *= DECAY
        self.hits[:n] += match.sum(0).double().cpu()
        self.seen[:n] += known.sum(0).double().cpu()
        self._paths = None

    # ------------------------------------------------------------------ drafting
    def _candidates(self, hidden, depth: int, topk: int):
        """hidden [B, dim] -> (log-probs [B, D, K], target ids long [B, D, K]) of each head's
        top-k candidates."""
        logits = self.heads.draft_logits(hidden)[:, :depth]  # [B, D, Vd]
        lp, ids = torch.log_softmax(logits, -1).topk(topk, dim=-1)
        return lp, self.heads.draft_to_target(ids)

    def paths(self) -> list:
        """The current sparse tree: [(parent, depth, rank)] (see sparse_tree)."""
        paths = self._paths
        if paths is None:
            paths = self._paths = sparse_tree(self.accuracy(), self.total - 1)
        return paths

    def propose(self, slots, roots, sampling, policy=None) -> Proposal:
        lp, top = self._candidates(self.hidden[slots], self.depth, self.topk)
        self._proposed = (top,)
        paths = self.paths()
        dev, B = roots.device, roots.shape[0]
        parent = torch.tensor([p for p, _, _ in paths], dtype=torch.long, device=dev)  # [C]
        depth = torch.tensor([d for _, d, _ in paths], dtype=torch.long, device=dev)
        rank = torch.tensor([j for _, _, j in paths], dtype=torch.long, device=dev)
        cand_tok = top[:, depth - 1, rank]  # [B, C]
        if policy is not None:
            return self._adaptive(roots, policy, parent, depth, cand_tok, lp[:, depth - 1, rank])
        C, T = len(paths), self.tree.num_nodes
        tokens = torch.zeros(B, T, dtype=torch.long, device=dev)
        parents = torch.full((B, T), -1, dtype=torch.int32, device=dev)
        tokens[:, 0] = roots
        tokens[:, 1 : C + 1] = cand_tok
        parents[:, 1 : C + 1] = (parent + 1).to(torch.int32)  # candidate c is node c + 1
        num_nodes = torch.full((B,), C + 1, dtype=torch.int32, device=dev)
        return Proposal(tokens, parents, num_nodes)

    def _adaptive(self, roots, policy, parent, depth, cand_tok, cand_lp) -> Proposal:
        """Keeps each row's N candidates of highest predicted acceptance, N chosen by the
        policy (as drafting.draft_dynamic does): a child's value is <= its parent's and its
        index larger, so a stable descending sort keeps every node's ancestors before it."""
        B, C = cand_tok.shape
        dev = roots.device
        values = torch.ones(B, C, device=dev)
        for d in range(1, int(depth.max()) + 1):
            at = (depth == d).nonzero()[:, 0]
            local = policy.node_value(None, cand_lp[:, at], depth=d).float()
            up = values[:, parent[at].clamp(min=0)] if d > 1 else 1.0
            values[:, at] = up * local
        N = policy.size(values, int(depth.max()))
        T = N + 1
        order = torch.sort(values, dim=1, descending=True, stable=True).indices[:, :N]  # [B, N]
        node_of = torch.zeros(B, C, dtype=torch.long, device=dev)  # candidate -> tree node
        node_of.scatter_(1, order, torch.arange(1, N + 1, device=dev).expand(B, N))
        parent_cand = parent[order]  # [B, N]
        tree_parent = torch.where(parent_cand < 0, 0, node_of.gather(1, parent_cand.clamp(min=0)))
        tokens = torch.zeros(B, T, dtype=torch.long, device=dev)
        parents = torch.full((B, T), -1, dtype=torch.int32, device=dev)
        confidence = torch.ones(B, T, device=dev)
        tokens[:, 0] = roots
        tokens[:, 1:] = cand_tok.gather(1, order)
        parents[:, 1:] = tree_parent.to(torch.int32)
        confidence[:, 1:] = cand_lp.gather(1, order).float().exp()
        num_nodes = torch.full((B,), T, dtype=torch.int32, device=dev)
        return Proposal(tokens, parents, num_nodes, confidence=confidence)
