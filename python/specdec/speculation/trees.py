"""Draft trees from an EAGLE head: a chain of depth k, or the EAGLE-2 dynamic tree.

Both produce a `Draft` in the op contract's format: node 0 is the root (the last
emitted token, not yet in the target cache), parents[b, 0] = -1, 0 <= parents[b, i] < i,
padded with -1 up to T; draft_tokens[b, i] is node i's token.

The head drafts over its own tree too (`HeadTree`): head node 0 is the head's last
committed position n - 1 (already in its cache, never recomputed), and every draft
node that gets expanded becomes a head node at logical position (n - 1) + index, with
RoPE position (n - 1) + depth, attending to its ancestors through tree_verify.

Randomness: tree drafts are top-k picks (deterministic), so they are point masses and
the Draft carries draft_probs=None (as EAGLE-2 / SGLang). Chain drafts of sampled
requests are *sampled* from the head's processed distribution q (same temperature /
top-k / top-p as the request) and q is passed as draft_probs, which is the classic
speculative-sampling setting and accepts more than a top-1 chain; greedy rows of the
same batch put a one-hot q on their argmax (equivalent to a point mass).
"""

import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

import specdec_kernels.ops as ops
from specdec.errors import InvalidTreeSpecError


class TreeSizer(Protocol):
    """What sizes a draft tree while it grows: the adaptive policy
    (specdec.speculation.policy.Policy) is the one implementation; drafters and
    grow_dynamic see only this interface (docs/adaptive.md)."""

    spec: "TreeSpec"

    def node_value(
        self,
        parent_value: torch.Tensor | None,
        logprob: torch.Tensor,
        depth: int,
        children: bool = False,
    ) -> torch.Tensor:
        """P(accepted) of new candidates from their log-probabilities under the drafter."""

    def local_values(self, confidence, depth) -> np.ndarray:
        """node_value's P(accepted | parent accepted) on the host, for nodes of any depth."""

    def expand_width(self, levels: int, values: torch.Tensor, frontier_values: torch.Tensor) -> int:
        """How many frontier nodes one more draft level expands (0: drafting stops)."""

    def observe_level(self, seconds: float, levels: int, width: int, device=None) -> None:
        """A draft level's measured seconds."""

    def size(self, values: torch.Tensor, levels: int) -> int:
        """One tree size for every request."""

    def sizes(self, values: torch.Tensor, levels: int) -> torch.Tensor:
        """Candidate values [B, C] -> long [B]: how many candidates each request keeps."""


@dataclass(frozen=True)
class TreeSpec:
    """`chain:K` (K drafts in a line), `dynamic:DEPTH,TOPK,TOTAL` (EAGLE-2) or
    `adaptive[:DEPTH,TOPK,TOTAL]`.

    dynamic: DEPTH draft levels below the root; at each level the TOPK best frontier
    nodes (by cumulative log-prob) are expanded into TOPK children each; finally the
    best TOTAL - 1 candidates are kept, so the tree has TOTAL nodes with the root.
    adaptive: the dynamic tree with DEPTH and TOTAL as upper bounds, each step's depth and
    size (or no speculation at all) chosen by specdec.speculation.policy (default adaptive:6,8,32).
    """

    kind: str
    depth: int
    topk: int = 1
    total: int = 0

    DEFAULT = "dynamic:5,8,32"
    ADAPTIVE_DEFAULT = (6, 8, 32)

    @classmethod
    def parse(cls, text: str) -> "TreeSpec":
        m = re.fullmatch(r"chain:(\d+)", text.strip())
        if m:
            spec = cls("chain", int(m[1]))
        elif text.strip() == "adaptive":
            spec = cls("adaptive", *cls.ADAPTIVE_DEFAULT)
        else:
            m = re.fullmatch(r"(dynamic|adaptive):(\d+),(\d+),(\d+)", text.strip())
            if not m:
                raise InvalidTreeSpecError(
                    f"invalid tree spec {text!r}: expected chain:K, "
                    "dynamic:DEPTH,TOPK,TOTAL or adaptive[:DEPTH,TOPK,TOTAL]"
                )
            spec = cls(m[1], int(m[2]), int(m[3]), int(m[4]))
        spec.validate()
        return spec

    def validate(self):
        if self.depth < 1:
            raise InvalidTreeSpecError(f"tree depth must be >= 1, got {self}")
        if self.kind != "chain" and (self.topk < 1 or self.total < 2):
            raise InvalidTreeSpecError(
                f"{self.kind} trees need TOPK >= 1 and TOTAL >= 2, got {self}"
            )
        # a TOTAL-node tree holds TOTAL - 1 drafts: deeper levels or more frontier nodes per
        # level than that never make it into the tree, they only cost drafting time
        if self.kind != "chain" and max(self.depth, self.topk) > self.total - 1:
            raise InvalidTreeSpecError(
                f"{self} keeps TOTAL - 1 = {self.total - 1} drafts: DEPTH and TOPK "
                "must be <= TOTAL - 1"
            )

    def check_fits(self, max_nodes: int, draft_vocab_size: int | None = None):
        """Bounds that depend on the engine: the padded tree (num_nodes, root included) must
        leave room for a prompt in the model's context (at most max_nodes), and a dynamic level
        cannot pick more tokens than the head's draft vocabulary has."""
        if self.num_nodes > max_nodes:
            raise InvalidTreeSpecError(
                f"tree {self} has {self.num_nodes} nodes, more than the cache allows "
                f"(at most {max_nodes}: the model's context of {max_nodes + 1} "
                "positions must also hold the prompt)"
            )
        if self.kind != "chain" and draft_vocab_size is not None and self.topk > draft_vocab_size:
            raise InvalidTreeSpecError(
                f"{self}: TOPK must be <= the head's draft vocabulary ({draft_vocab_size} tokens)"
            )

    @property
    def num_nodes(self) -> int:
        """T: the padded tree size, root included (an upper bound for adaptive)."""
        return self.depth + 1 if self.kind == "chain" else self.total

    @property
    def head_nodes(self) -> int:
        """Size of the head's own tree: its root plus every expanded draft node."""
        return 1 + (self.depth - 1) * self.topk

    def __str__(self):
        if self.kind == "chain":
            return f"chain:{self.depth}"
        return f"{self.kind}:{self.depth},{self.topk},{self.total}"


@dataclass
class Draft:
    """tokens: long [B, T]; parents: int32 [B, T]; num_nodes: int32 [B];
    draft_probs: float [B, T, V] (row u = the distribution u's child was drawn from) or None."""

    tokens: torch.Tensor
    parents: torch.Tensor
    num_nodes: torch.Tensor
    draft_probs: torch.Tensor | None = None
    confidence: torch.Tensor | None = (
        None  # float [B, T]: the head's probability of each node (adaptive)
    )

    def truncate(self, room: torch.Tensor) -> "Draft":
        """Keep at most room[b] >= 1 nodes of row b (the first ones: topological order keeps
        it a valid tree), so verification never writes past a request's cache."""
        T = self.tokens.shape[1]
        num_nodes = torch.minimum(self.num_nodes, room.to(self.num_nodes.dtype))
        keep = torch.arange(T, device=self.tokens.device)[None, :] < num_nodes[:, None]
        return Draft(
            self.tokens.masked_fill(~keep, 0),
            self.parents.masked_fill(~keep, -1),
            num_nodes,
            self.draft_probs,
            self.confidence,
        )


@dataclass
class BatchSampling:
    """Per-request sampling parameters of the active batch.

    temperature: float32 [B] (0 = greedy); top_k: int32 [B] (0 = off); top_p: float32 [B]
    (1 = off); generators: one torch.Generator per request; random: whether any request
    samples (temperature > 0), when the caller knows it on the host (None: read from
    temperature)."""

    temperature: torch.Tensor
    top_k: torch.Tensor
    top_p: torch.Tensor
    generators: list
    random: bool | None = None

    @property
    def any_random(self) -> bool:
        if self.random is not None:
            return self.random
        return bool((self.temperature > 0).any())


def plain_draft(root_tokens: torch.Tensor) -> Draft:
    """The drafter switched off: a one-node tree (root only), T = 1."""
    B = root_tokens.shape[0]
    dev = root_tokens.device
    return Draft(
        root_tokens[:, None].clone(),
        torch.full((B, 1), -1, dtype=torch.int32, device=dev),
        torch.ones(B, dtype=torch.int32, device=dev),
    )


def draft(
    spec: TreeSpec, head, hidden, cache, slots, root_tokens, sampling: BatchSampling, policy=None
) -> Draft:
    """hidden: [B, dim], the head's output at its last committed position (the predicted
    feature of the root's successor); policy: the TreeSizer of an adaptive spec."""
    if spec.kind == "chain":
        return draft_chain(spec, head, hidden, cache, slots, root_tokens, sampling)
    return draft_dynamic(spec, head, hidden, cache, slots, root_tokens, policy)


class HeadTree:
    """The head's draft tree over its cache (see the module docstring).

    Node 0 is the committed position n - 1; `add` appends nodes and runs the head on
    them only, attending through the whole tree built so far."""

    def __init__(self, head, cache, slots, size: int):
        B = slots.shape[0]
        self.head, self.cache, self.slots = head, cache, slots
        self.base = cache.cache_lens[slots] - 1  # logical position of head node 0
        self.parents = torch.full((B, size), -1, dtype=torch.int32, device=slots.device)
        self.n = 1

    def add(self, tokens, features, parents, depth: int):
        """tokens: long [B, M]; features: [B, M, dim]; parents: head-node ids [B, M];
        depth: the draft depth of the new nodes. Returns the head's hidden [B, M, dim]."""
        B, M = tokens.shape
        start, self.n = self.n, self.n + M
        self.parents[:, start : self.n] = parents.to(torch.int32)
        num_nodes = torch.full((B,), self.n, dtype=torch.int32, device=tokens.device)
        tree_mask, _ = ops.build_tree_mask(self.parents[:, : self.n].contiguous(), num_nodes)
        positions = (self.base + depth)[:, None].expand(B, M)
        return self.head(
            tokens,
            features,
            self.cache,
            self.slots,
            self.base,
            start,
            num_nodes,
            tree_mask,
            positions,
        )


def draft_chain(spec, head, hidden, cache, slots, root_tokens, sampling) -> Draft:
    """K = spec.depth drafts in a line; head node d is draft node d (same indices)."""
    B, K = root_tokens.shape[0], spec.depth
    dev = root_tokens.device
    tokens = torch.zeros(B, K + 1, dtype=torch.long, device=dev)
    tokens[:, 0] = root_tokens
    parents = torch.arange(-1, K, dtype=torch.int32, device=dev).expand(B, K + 1).contiguous()
    sampled = sampling.any_random
    draft_probs = None
    tree = HeadTree(head, cache, slots, K) if K > 1 else None  # chain:1 drafts from hidden only
    feature = hidden
    for d in range(1, K + 1):
        logits = head.draft_logits(feature)  # [B, Vd]
        if sampled:
            q = draft_distribution(logits, sampling)
            tokens[:, d] = head.draft_to_target(sample_rows(q, sampling.generators))
            q = head.scatter_to_target(q, 0.0)  # [B, V]: zero outside the draft vocabulary
            if draft_probs is None:
                draft_probs = q.new_zeros(B, K + 1, q.shape[-1])
            draft_probs[:, d - 1] = q
        else:
            tokens[:, d] = head.draft_to_target(logits.argmax(-1))
        if tree is not None and d < K:
            parent = torch.full((B, 1), d - 1, device=dev)
            feature = tree.add(tokens[:, d : d + 1], feature[:, None], parent, depth=d)[:, 0]
    return Draft(
        tokens, parents, torch.full((B,), K + 1, dtype=torch.int32, device=dev), draft_probs
    )


@dataclass
class DynamicTree:
    """What grow_dynamic chose: the Draft of the kept candidates plus, for drafters that
    need to map them back, order: long [B, N] (candidate number of tree node 1..N) and
    real: bool [B, N] (node 1 + j is a kept node of row b, not padding)."""

    draft: Draft
    order: torch.Tensor
    real: torch.Tensor


# expand(front_tok: long [B, W] target ids, front_cand: long [B, W] their candidate numbers,
# from_front: long [B, W] index of each one's parent in the previous level's expanded nodes
# (None at depth 1, where every parent is the root), depth) -> the drafter's logits at each
# [B, W, V']; W <= TOPK, the level's width (grow_dynamic)
Expand = Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None, int], torch.Tensor]


def grow_dynamic(
    spec: TreeSpec,
    root_logits: torch.Tensor,
    root_tokens: torch.Tensor,
    expand: Expand,
    policy=None,
    to_target: Callable[[torch.Tensor], torch.Tensor] | None = None,
    width: int | None = None,
) -> DynamicTree:
    """EAGLE-2's dynamic tree over any drafter: expand the TOPK best frontier nodes per level
    (by cumulative log-prob), keep the best TOTAL - 1 candidates.

    root_logits: [B, V'] the drafter's logits after the root; root_tokens: long [B];
    to_target maps the drafter's token ids to the target's (a draft vocabulary; default:
    the same ids).

    Candidates are numbered in creation order (level by level), so a parent's number is
    below its children's; a child's score (cumulative log-prob) is <= its parent's. A
    stable descending sort therefore ranks every parent before its children: the top
    TOTAL - 1 are closed under ancestors and already in topological order.

    policy (a TreeSizer, optional) decides whether to draft each further level and how
    many candidates each request keeps, ranked by its predicted acceptance (also <= the
    parent's); the tree is then only as wide as the largest request's (T = max N_b + 1),
    the smaller ones padded, and carries each node's confidence. It also chooses how many of
    the frontier's best nodes each level expands (policy.expand_width: a level's cost grows
    with its rows, and the best node's children are most of its worth); without a policy
    every level expands `width` (default TOPK) of them."""
    B, K, D = root_tokens.shape[0], spec.topk, spec.depth
    width = K if width is None else width
    if not isinstance(width, int) or isinstance(width, bool) or width < 1:
        raise ValueError(f"width must be an integer >= 1 (frontier nodes per level), got {width!r}")
    dev = root_tokens.device
    to_target = to_target or (lambda t: t)

    scores, front_tok = torch.log_softmax(root_logits, -1).topk(K, dim=-1)  # [B, K]
    front_tok = to_target(front_tok)
    cand_scores, cand_tokens, cand_lp = [scores], [front_tok], [scores]
    cand_parents = [torch.full((B, K), -1, dtype=torch.long, device=dev)]  # -1: the root
    front_cand = torch.arange(K, device=dev).expand(B, K)  # candidate numbers of the frontier
    from_front: torch.Tensor | None = None
    front_value = policy.node_value(None, scores, depth=1) if policy else None
    cand_values: list = [front_value]  # (None without a policy: never read then)
    num_cand, levels = K, 1
    for d in range(1, D):
        # how many frontier nodes to expand: the best `width` of them (topk's order)
        if policy is not None:
            width = int(policy.expand_width(levels, torch.cat(cand_values, 1), front_value))
            if width < 1:
                break
        width = min(width, K)
        if width < front_tok.shape[1]:
            front_tok, front_cand, scores = (t[:, :width] for t in (front_tok, front_cand, scores))
            if front_value is not None:
                front_value = front_value[:, :width]
            if from_front is not None:
                from_front = from_front[:, :width]
        start = time.perf_counter()
        child_logits = expand(front_tok, front_cand, from_front, d)  # [B, width, V']
        child_lp, child_tok = torch.log_softmax(child_logits, -1).topk(K, dim=-1)  # [B, width, K]
        if policy is not None and child_lp.device.type == "cpu":  # GPU: the launches' time only
            policy.observe_level(time.perf_counter() - start, levels, width, child_lp.device)
        child_tok = to_target(child_tok)
        child_scores = (scores[:, :, None] + child_lp).flatten(1)  # [B, width*K]
        cand_scores.append(child_scores)
        cand_tokens.append(child_tok.flatten(1))
        cand_lp.append(child_lp.flatten(1))
        cand_parents.append(front_cand[:, :, None].expand(B, width, K).flatten(1))
        scores, best = child_scores.topk(K, dim=-1)  # next frontier
        if policy is not None:
            child_value = policy.node_value(front_value, child_lp, d + 1, children=True)
            child_value = child_value.flatten(1)
            cand_values.append(child_value)
            front_value = child_value.gather(1, best)
        front_cand = num_cand + best
        front_tok = child_tok.flatten(1).gather(1, best)
        from_front = best // K
        num_cand += width * K
        levels += 1

    all_tokens = torch.cat(cand_tokens, 1)
    all_parents = torch.cat(cand_parents, 1)
    if policy is None:
        rank, N, T = torch.cat(cand_scores, 1), min(spec.total - 1, num_cand), spec.num_nodes
        kept = torch.full((B,), N, dtype=torch.long, device=dev)
    else:
        rank = torch.cat(cand_values, 1)
        kept = policy.sizes(rank, levels)  # [B]: each request's own size (0: the root only)
        N = int(kept.max())
        T = N + 1
    if policy is None and levels == 1:  # topk's order, already descending: the ranking
        order = torch.arange(N, device=dev).expand(B, N)
    else:
        order = torch.sort(rank, dim=1, descending=True, stable=True).indices[:, :N]  # [B, N]
    # row b keeps its kept[b] best (a prefix of its ranking: closed under ancestors); the
    # rest of its N columns is padding
    real = torch.arange(1, N + 1, device=dev)[None] <= kept[:, None]  # [B, N]
    tokens = torch.zeros(B, T, dtype=torch.long, device=dev)
    parents = torch.full((B, T), -1, dtype=torch.int32, device=dev)
    tokens[:, 0] = root_tokens
    tokens[:, 1 : N + 1] = all_tokens.gather(1, order).masked_fill(~real, 0)
    if levels == 1:  # every candidate is a child of the root (most CPU steps: ~0.1 ms less)
        parents[:, 1 : N + 1].masked_fill_(real, 0)
    else:
        node_of = torch.zeros(B, num_cand, dtype=torch.long, device=dev)  # candidate -> node
        node_of.scatter_(1, order, torch.arange(1, N + 1, device=dev).expand(B, N))
        parent_cand = all_parents.gather(1, order)
        tree_parent = torch.where(parent_cand < 0, 0, node_of.gather(1, parent_cand.clamp(min=0)))
        parents[:, 1 : N + 1] = tree_parent.to(torch.int32).masked_fill(~real, -1)
    confidence = None
    if policy is not None:  # the drafter's probability of each node's token given its parent
        confidence = torch.ones(B, T, device=dev)
        confidence[:, 1:] = torch.cat(cand_lp, 1).gather(1, order).float().exp()
    draft = Draft(tokens, parents, (kept + 1).to(torch.int32), confidence=confidence)
    return DynamicTree(draft, order, real)


def draft_dynamic(
    spec, head, hidden, cache, slots, root_tokens, policy=None, width: int | None = None
) -> Draft:
    """EAGLE-2's dynamic tree (grow_dynamic) drafted by an EAGLE head: each expanded
    frontier node becomes a head node whose feature is its parent's head output (the
    root's: the target's hidden [B, dim])."""
    B = root_tokens.shape[0]
    tree = HeadTree(head, cache, slots, spec.head_nodes)
    last = {"hidden": hidden[:, None], "start": 0}  # the previous level's expanded nodes

    def expand(front_tok, front_cand, from_front, depth):
        prev = last["hidden"]
        if from_front is None:  # depth 1: every parent is the root (head node 0)
            feat = prev.expand(B, front_tok.shape[1], -1)
            head_parent = torch.zeros_like(front_tok)
        else:
            feat = prev.gather(1, from_front[..., None].expand(-1, -1, prev.shape[-1]))
            head_parent = last["start"] + from_front
        last["start"] = tree.n
        last["hidden"] = tree.add(front_tok, feat, head_parent, depth=depth)  # [B, W, dim]
        return head.draft_logits(last["hidden"])

    return grow_dynamic(
        spec,
        head.draft_logits(hidden),
        root_tokens,
        expand,
        policy,
        head.draft_to_target,
        width,
    ).draft


def draft_distribution(logits, sampling: BatchSampling):
    """logits [B, V] -> q [B, V]: the request's temperature / top-k / top-p applied to the
    head's logits (one-hot argmax for greedy rows). Any q is exact as long as the draft is
    drawn from it; matching the target's processing just keeps acceptance high."""
    greedy = sampling.temperature <= 0
    temp = torch.where(greedy, 1.0, sampling.temperature)[:, None]
    probs = torch.softmax(logits.float() / temp, dim=-1)
    V = logits.shape[-1]
    k = torch.where(sampling.top_k > 0, sampling.top_k, V).clamp(max=V).long()
    sorted_probs, sorted_idx = probs.sort(dim=-1, descending=True)
    in_top_k = torch.arange(V, device=logits.device)[None, :] < k[:, None]
    sorted_probs = sorted_probs * in_top_k  # top-k, then top-p on the renormalised rest
    sorted_probs = sorted_probs / sorted_probs.sum(-1, keepdim=True)
    mass_before = sorted_probs.cumsum(-1) - sorted_probs
    keep_sorted = in_top_k & (mass_before < sampling.top_p[:, None])
    keep = torch.zeros_like(keep_sorted).scatter_(1, sorted_idx, keep_sorted)
    probs = probs * keep
    probs = probs / probs.sum(-1, keepdim=True)
    one_hot = torch.nn.functional.one_hot(logits.argmax(-1), V).to(probs.dtype)
    return torch.where(greedy[:, None], one_hot, probs)


def sample_rows(probs, generators):
    """Inverse-CDF sample of each row of probs [B, V] with that row's generator -> long [B]."""
    u = torch.stack([torch.rand((), generator=g, device=g.device) for g in generators]).to(
        probs.device
    )
    cum = probs.cumsum(-1)
    idx = torch.searchsorted(cum, (u * cum[:, -1])[:, None], right=True)[:, 0]
    # u * total can round up to the total: fall back to the last token with mass
    last = probs.shape[-1] - 1 - (probs > 0).flip(-1).int().argmax(-1)
    return torch.minimum(idx, last)
