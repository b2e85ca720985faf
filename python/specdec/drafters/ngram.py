"""N-gram (prompt lookup) drafting: no model call, the request's own tokens are the draft.

Per request the drafter keeps its history (prompt + generated tokens, the root last). Each
step it looks for the longest n-gram, n from max_n down to min_n, that ends the history and
occurred earlier; the tokens that followed an earlier occurrence are the draft. Several
occurrences (most recent first) become branches of one tree: their continuations are merged
into a trie under the root, so shared prefixes are verified once.

Drafts are deterministic (point masses, draft_probs=None), so tree_rejection_sample keeps
every output exactly distributed as the target's, greedy or sampled.

Tree shapes (--tree): chain:K, one continuation of up to K tokens; dynamic:DEPTH,TOPK,TOTAL,
up to TOPK branches of up to DEPTH tokens, TOTAL nodes with the root; adaptive[:D,K,N], the
same bounds, and the adaptive tree sizer keeps the nodes worth verifying. A node's confidence is the
share of the merged occurrences through its parent that continue with its token (scaled by
n / max_n at the first level: longer matches are more often right); the policy
calibrates it per depth with what is actually accepted. Drafting costs ~0 model time, so the
cost model's draft times are zero.
"""

import numpy as np
import torch

from specdec.drafters.base import Drafter, Proposal
from specdec.errors import InvalidRequestError
from specdec.speculation.cost_model import CostModel

MAX_OCCURRENCES = (
    64  # earlier occurrences of the matched n-gram examined per step (most recent first)
)


class NgramDrafter(Drafter):
    name = "ngram"
    adaptive = True

    def __init__(self, max_n: int = 4, min_n: int = 1):
        for flag, v in (("max_n", max_n), ("min_n", min_n)):
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise InvalidRequestError(f"ngram {flag} must be an integer >= 1, got {v!r}")
        if min_n > max_n:
            raise InvalidRequestError(f"ngram min_n ({min_n}) must be <= max_n ({max_n})")
        self.max_n, self.min_n = max_n, min_n

    def measure_cost(self, model, tree, batch_size: int, target_forward=None) -> CostModel:
        return CostModel.measure(model, None, tree, batch_size, target_forward=target_forward)

    def setup(self, setup) -> None:
        self.tree, self.device = setup.tree, setup.device
        if self.tree.kind == "chain":
            self.depth, self.branches, self.total = self.tree.depth, 1, self.tree.depth + 1
        else:
            self.depth, self.branches, self.total = self.tree.depth, self.tree.topk, self.tree.total
        self.history = [np.zeros(0, dtype=np.int64)] * setup.batch_size
        self.lens = [0] * setup.batch_size

    # ------------------------------------------------------------------ state
    def start(self, slots, prompts, first_tokens, hidden, aux, ok) -> None:
        for slot, p, first in zip(slots.tolist(), prompts, first_tokens.tolist()):
            h = np.zeros(len(p) + 1 + 4 * self.total, dtype=np.int64)
            h[: len(p)] = p.cpu().numpy()
            h[len(p)] = first
            self.history[slot], self.lens[slot] = h, len(p) + 1

    def commit(self, slots, proposal, result) -> None:
        n_new = (result.num_accepted + 1).tolist()
        for good, slot, toks, n in zip(
            result.ok, slots.tolist(), result.output_tokens.tolist(), n_new
        ):
            if good:
                self._append(slot, toks[:n])

    def _append(self, slot, tokens):
        h, L = self.history[slot], self.lens[slot]
        if L + len(tokens) > len(h):
            h = np.concatenate((h, np.zeros(max(len(h), len(tokens)), dtype=np.int64)))
            self.history[slot] = h
        h[L : L + len(tokens)] = tokens
        self.lens[slot] = L + len(tokens)

    # ------------------------------------------------------------------ drafting
    def continuations(self, h: np.ndarray) -> list:
        """The token lists that followed earlier occurrences of the longest matching suffix
        n-gram of h (n in [min_n, max_n]), most recent occurrence first; [] if none."""
        return self.match(h)[1]

    def match(self, h: np.ndarray) -> tuple[int, list]:
        """-> (n, continuations): the length of the longest matching suffix n-gram (0: none)
        and what followed its earlier occurrences (see continuations)."""
        L = len(h)
        # the earlier positions e <= L - 2 holding the last token (each is followed by at
        # least one token), then how far back each agrees with the suffix: an n-gram occurs
        # at i = e - n + 1 where that run is >= n long. One pass over the history for all n
        # (a window comparison per n cost ~0.3 ms a step: benchmarks/profile_step.py --part engine)
        ends = np.flatnonzero(h[: L - 1] == h[L - 1]) if L > 1 else np.zeros(0, dtype=np.int64)
        agree = np.ones(len(ends), dtype=np.int64)  # the run's length so far, per end
        for k in range(1, self.max_n):
            alive = (agree == k) & (ends >= k)
            if not alive.any():
                break
            agree[alive] += h[ends[alive] - k] == h[L - 1 - k]
        for n in range(min(self.max_n, L - 1), self.min_n - 1, -1):
            starts = ends[agree >= n] - (n - 1)  # ascending, as the positions are
            if len(starts):
                return n, [
                    h[i + n : i + n + self.depth].tolist() for i in starts[::-1][:MAX_OCCURRENCES]
                ]
        return 0, []

    def confidences(self, row, n: int) -> list:
        """Per node of a trie row (tokens, parents, depths, counts) matched on a suffix
        n-gram of length n: the share of the occurrences through its parent that continue
        with its token, times n / max_n for the first level (a longer match is stronger
        evidence: a lone 1-gram match in free text is as "unanimous" as a 4-gram match in
        copied text, and far less often right). The root's is 1."""
        tokens, parents, depths, counts = row
        first = n / self.max_n
        return [1.0] + [
            counts[i] / counts[parents[i]] * (first if depths[i] == 1 else 1.0)
            for i in range(1, len(tokens))
        ]

    def trie(self, root: int, conts: list):
        """Merges conts under the root -> (tokens, parents, depths, counts), node 0 the root,
        parents before children; at most self.branches branches and self.total nodes."""
        tokens, parents, depths, counts = [root], [-1], [0], [0]
        child: dict[tuple[int, int], int] = {}  # (node, token) -> child node
        branches = 0
        for cont in conts:
            node, grew = 0, False
            counts[0] += 1
            for tok in cont:
                nxt = child.get((node, tok))
                if nxt is None:
                    if len(tokens) >= self.total or (not grew and branches >= self.branches):
                        break  # full: this occurrence only strengthens the branches already there
                    nxt = child[(node, tok)] = len(tokens)
                    tokens.append(tok)
                    parents.append(node)
                    depths.append(depths[node] + 1)
                    counts.append(0)
                    if not grew:
                        grew, branches = True, branches + 1
                counts[nxt] += 1
                node = nxt
        return tokens, parents, depths, counts

    def propose(self, slots, roots, sampling, policy=None) -> Proposal:
        rows, matched = [], []
        for slot, root in zip(slots.tolist(), roots.tolist()):
            n, conts = self.match(self.history[slot][: self.lens[slot]])
            rows.append(self.trie(root, conts))
            matched.append(n)
        B, dev = len(rows), roots.device
        if policy is not None:
            return self._adaptive(rows, matched, roots, policy)
        T = self.total
        tokens = torch.zeros(B, T, dtype=torch.long)
        parents = torch.full((B, T), -1, dtype=torch.int32)
        for b, (tok, par, _, _) in enumerate(rows):
            tokens[b, : len(tok)] = torch.tensor(tok)
            parents[b, : len(par)] = torch.tensor(par, dtype=torch.int32)
        num_nodes = torch.tensor([len(r[0]) for r in rows], dtype=torch.int32)
        return Proposal(tokens.to(dev), parents.to(dev), num_nodes.to(dev))

    def _adaptive(self, rows, matched, roots, policy) -> Proposal:
        """Keeps each request's N_b candidates of highest predicted acceptance, N_b chosen by
        the policy (as drafting.draft_dynamic does): a child's value is <= its parent's and
        its index is larger, so a stable descending sort keeps every kept node's ancestors
        before it."""
        B, dev = len(rows), roots.device
        C = max(len(r[0]) for r in rows) - 1  # candidates (drafts) of the widest row
        conf = torch.ones(B, C + 1)
        depth = torch.zeros(B, C + 1, dtype=torch.long)
        for b, (row, n) in enumerate(zip(rows, matched)):
            conf[b, : len(row[0])] = torch.tensor(self.confidences(row, n))
            depth[b, : len(row[0])] = torch.tensor(row[2])
        local = torch.ones(B, C + 1)  # the policy's P(accepted | parent accepted), per node
        at = depth > 0  # (the root: 1)
        local[at] = torch.from_numpy(policy.local_values(conf[at].numpy(), depth[at].numpy()))
        values = torch.full((B, C), -1.0)  # -1: padding, ranked last
        for b, (tok, par, _, _) in enumerate(rows):
            v = [1.0] * len(tok)
            for i, p in enumerate(local[b, : len(tok)].tolist()[1:], 1):
                v[i] = v[par[i]] * p
            values[b, : len(tok) - 1] = torch.tensor(v[1:])
        levels = max(max(r[2]) for r in rows)
        # each request's own size (0: the root only; padding has value 0 and never pays)
        kept = policy.sizes(values.clamp(min=0), levels) if C else torch.zeros(B, dtype=torch.long)
        kept = torch.minimum(kept.cpu(), torch.tensor([len(r[0]) - 1 for r in rows]))
        T = int(kept.max()) + 1
        tokens = torch.zeros(B, T, dtype=torch.long)
        parents = torch.full((B, T), -1, dtype=torch.int32)
        confidence = torch.ones(B, T)
        num_nodes = torch.ones(B, dtype=torch.int32)
        tokens[:, 0] = roots.cpu()
        for b, (tok, par, _, _) in enumerate(rows):
            n = int(kept[b])
            if n == 0:
                continue
            order = (
                torch.sort(values[b], descending=True, stable=True).indices[:n] + 1
            )  # candidate nodes
            new = {0: 0}
            for j, node in enumerate(order.tolist(), 1):
                new[node] = j
                tokens[b, j] = tok[node]
                parents[b, j] = new[par[node]]
                confidence[b, j] = conf[b, node]
            num_nodes[b] = n + 1
        return Proposal(
            tokens.to(dev), parents.to(dev), num_nodes.to(dev), confidence=confidence.to(dev)
        )
