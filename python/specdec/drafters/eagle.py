"""The EAGLE drafter: an EagleHead (specdec.drafters.eagle_head), its KV cache, and the
drafting state.

Head cache: positions 0..n-1 hold the head's pass over (token t+1, target feature t) pairs
with the target's true features. Its draft tree is scratch space past n - 1
(trees.HeadTree); the accepted pairs are re-run with the target's true features at
positions n..n+a (as upstream EAGLE and SGLang do: the draft KV was computed from the head's
own predicted features), so committing it is advancing cache_lens — the positions are
already contiguous and compaction would be the identity. That re-run is deferred to the next
propose (_catch_up), so plain steps of adaptive mode cost no head work.

The deferred pairs are capped (max_backlog): a request that went many steps without drafting
(adaptive mode under load, where most steps are plain and a probe step drafts now and then)
would otherwise pay the head's pass over its whole prompt and every token since, at each
probe. Past the cap the slot's head cache restarts from its last max_backlog pairs: the head
loses older context (its drafts, and so acceptance, may suffer), never exactness
(docs/adaptive.md, "Fallback to plain decoding under load").
"""

import torch

import specdec_kernels.ops as ops
from specdec import cpu
from specdec.drafters.base import Drafter, Proposal
from specdec.speculation import trees
from specdec.speculation.cost_model import CostModel

# (token, target feature) pairs of a slot the head's catch-up runs at most; past it the head
# restarts from the last MAX_BACKLOG pairs (module docstring): a probe step then costs the
# head this many tokens per request, not the prompt and every token since. The queue itself is
# cut back only past BACKLOG_SLACK times that (bounded memory, no copy every plain step).
MAX_BACKLOG = 16
BACKLOG_SLACK = 4


class EagleDrafter(Drafter):
    """Chain (`chain:K`), EAGLE-2 dynamic (`dynamic:D,K,N`) or adaptive trees from head."""

    name = "eagle"
    adaptive = True

    def __init__(self, head, max_backlog: int | None = MAX_BACKLOG):
        """max_backlog: pairs queued per slot for the catch-up at most (None: no cap)."""
        if max_backlog is not None and max_backlog < 1:
            raise ValueError(f"max_backlog must be >= 1 or None, got {max_backlog}")
        self.head = head
        self.feature_layers = head.feature_layers
        self.max_backlog = max_backlog

    def modules(self):
        return [self.head]

    def check(self, tree, max_nodes: int) -> None:
        tree.check_fits(max_nodes, self.head.draft_vocab_size)

    def cache_positions(self, tree, capacity: int) -> int:
        # plus the head's scratch draft tree past its last committed position
        return capacity + max(tree.num_nodes, tree.head_nodes)

    def measure_cost(self, model, tree, batch_size: int, target_forward=None) -> CostModel:
        return CostModel.measure(model, self.head, tree, batch_size, target_forward=target_forward)

    def setup(self, setup) -> None:
        head = self.head
        cpu.configure(head)  # as the target's, its weight copies made now
        cpu.prepare(head)
        with torch.inference_mode():  # and the draft lm_head's copy (EagleHead.draft_logits)
            head.draft_logits(head.fc.weight.new_zeros(1, head.args.dim))
        self.tree, self.device = setup.tree, setup.device
        self.cache = head.new_cache(
            setup.batch_size, self.cache_positions(setup.tree, setup.capacity), setup.block_size
        )
        # the head's output at each slot's last committed position: what drafting starts from
        self.draft_hidden = torch.zeros(
            setup.batch_size, setup.model.args.dim, dtype=head.fc.weight.dtype, device=setup.device
        )
        # per slot: (tokens, target features) accepted since the head last ran (_catch_up)
        self.pending: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        self.queued: dict[int, int] = {}  # per slot: the pairs in its pending queue
        self._chains: dict[tuple[int, int], tuple[torch.Tensor, ...]] = {}  # _chain's

    def start(self, slots, prompts, first_tokens, hidden, aux, ok) -> None:
        """Queues the head's pass over (prompt[t + 1], feature[t]) for t < S, the last pair
        using the first generated token (run by _catch_up before the first draft)."""
        features = self.head.select_features(hidden, aux)
        self.cache.reset(slots)
        for b, (slot, p, f) in enumerate(zip(slots.tolist(), prompts, features)):
            self.pending[slot] = [(torch.cat((p[1:], first_tokens[b : b + 1])), f)]
            self.queued[slot] = len(p)
        for slot, good in zip(slots.tolist(), ok):
            if not good:  # failed: its slot is freed, nothing to run
                self.pending.pop(slot, None)
                self.queued.pop(slot, None)

    def propose(self, slots, roots, sampling, policy=None) -> Proposal:
        hidden = self._catch_up(slots)
        d = trees.draft(
            self.tree,
            self.head,
            self.draft_hidden[slots] if hidden is None else hidden,
            self.cache,
            slots,
            roots,
            sampling,
            policy,
        )
        return Proposal(d.tokens, d.parents, d.num_nodes, d.draft_probs, d.confidence)

    def commit(self, slots, proposal, result) -> None:
        features = self.head.select_features(result.hidden, result.aux)
        path_features = features.gather(
            1,
            result.accepted_nodes.long().clamp(min=0)[..., None].expand(-1, -1, features.shape[-1]),
        )
        for good, slot, tok, feat, n in zip(
            result.ok,
            slots.tolist(),
            result.output_tokens.long(),
            path_features,
            (result.num_accepted + 1).tolist(),
        ):
            if good:
                self.pending.setdefault(slot, []).append((tok[:n], feat[:n]))
                self.queued[slot] = queued = self.queued.get(slot, 0) + n
                cap = self.max_backlog
                if cap is not None and queued > BACKLOG_SLACK * cap:
                    self._cut_backlog(slot, cap)

    def _cut_backlog(self, slot: int, cap: int) -> None:
        """Keeps the last `cap` of the slot's queued pairs and restarts its head cache (the
        kept pairs then run from position 0)."""
        queue = self.pending[slot]
        tokens = torch.cat([t for t, _ in queue])[-cap:]
        features = torch.cat([f for _, f in queue])[-cap:]
        queue[:] = [(tokens, features)]
        self.queued[slot] = cap
        self.cache.reset(torch.tensor([slot], device=self.device))

    def _catch_up(self, slots) -> torch.Tensor | None:
        """Runs the head over the (token, target feature) pairs queued since it last ran (the
        prompt's, then each step's accepted ones; the last max_backlog of them, the head's
        cache restarted, where more were queued): one call for however many steps that was,
        so adaptive mode's plain steps skip the head entirely and pay for it in one batched
        pass when drafting resumes. Returns the drafting state of every slot, [B, dim], when
        each had pairs queued (the usual step: no read-back of draft_hidden), else None."""
        slot_ids = slots.tolist()
        rows = [i for i, s in enumerate(slot_ids) if self.pending.get(s)]
        if not rows:
            return None
        cap = self.max_backlog
        for i in rows:
            if cap is not None and self.queued.get(slot_ids[i], 0) > cap:
                self._cut_backlog(slot_ids[i], cap)
            self.queued.pop(slot_ids[i], None)
        chunks = [self.pending.pop(slot_ids[i]) for i in rows]
        # (one chunk, one request: the usual batch-1 step, without the copies)
        token_runs = [c[0][0] if len(c) == 1 else torch.cat([t for t, _ in c]) for c in chunks]
        feat_runs = [c[0][1] if len(c) == 1 else torch.cat([f for _, f in c]) for c in chunks]
        lengths = [len(t) for t in token_runs]
        if len(rows) == 1:
            tokens, feats = token_runs[0][None], feat_runs[0][None]
        else:
            tokens = torch.nn.utils.rnn.pad_sequence(token_runs, batch_first=True)
            feats = torch.nn.utils.rnn.pad_sequence(feat_runs, batch_first=True)
        if len(rows) == len(slot_ids):
            return self._extend(slots, tokens, feats, lengths)
        self._extend(slots[rows], tokens, feats, lengths)
        return None

    def _extend(self, slots, tokens, features, lengths: list[int]) -> torch.Tensor:
        """Appends lengths[b] (token, target feature) pairs to the head's cache of each slot and
        stores the head's output after the last one as the next drafting state (returned too,
        [B, dim]). tokens: long [B, M]; features: [B, M, F]; lengths: B ints in [1, M]."""
        B, M = tokens.shape
        full = all(n == M for n in lengths)  # no run is padded (batch 1: always)
        if full:
            counts, tree_mask, depth = self._chain(B, M)
        else:
            counts = torch.tensor(lengths, dtype=torch.int32, device=self.device)
            tree_mask, depth = self._chain_mask(counts, M)
        lens = self.cache.cache_lens[slots]
        hidden = self.head(
            tokens,
            features,
            self.cache,
            slots,
            lens,
            0,
            counts,
            tree_mask,
            lens[:, None] + depth,
        )
        self.cache.cache_lens.index_add_(0, slots, counts)
        if full:
            last = hidden[:, -1]
        else:
            last = hidden[torch.arange(B, device=self.device), counts.long() - 1]
        self.draft_hidden[slots] = last
        return last

    def _chain(self, batch: int, length: int) -> tuple[torch.Tensor, ...]:
        """(num_nodes int32 [B] = length, tree_mask, depth) of B unpadded chains of `length`
        nodes: the same every step of that shape, so built once (read-only: the ops take them
        as inputs)."""
        key = (batch, length)
        chain = self._chains.get(key)
        if chain is None:
            counts = torch.full((batch,), length, dtype=torch.int32, device=self.device)
            chain = self._chains[key] = (counts, *self._chain_mask(counts, length))
        return chain

    def _chain_mask(self, counts, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """build_tree_mask of B chains padded to `length` nodes, counts[b] real (int32 [B])."""
        parents = torch.arange(-1, length - 1, dtype=torch.int32, device=self.device)
        return ops.build_tree_mask(parents.expand(len(counts), length).contiguous(), counts)
