"""The standalone draft model drafter: a small Llama-family model with the target's tokenizer
drafts for the target (the original speculative decoding), or the target's own first N layers
with its final norm and LM head (`self:N`, self-speculative / early-exit drafting: the weights
are the target's tensors, shared, not copied).

Draft cache (the drafter's own PagedKVCache, one layer per draft layer): positions 0..n-1
hold the draft model's KV of the request's tokens up to and including the root (the last
emitted token). Its draft tree is scratch past them (`ModelTree`): tree node 0 is the root
at position n - 1 (cached, never recomputed), every draft node that gets expanded (run
through the draft model to draft its children) is appended at (n - 1) + index, RoPE
position (n - 1) + depth, attending to its ancestors through tree_verify.

After verification the accepted path's drafts whose KV the draft model computed (a prefix of
the path: a node is run only after its parent) are moved into place with compact_kv, a second
real user of the op: their KV was computed from exactly the tokens they follow, so it is what
a sequential pass would have written. The rest of the path (an accepted leaf that was never
run, and always the target's bonus / correction token, which the draft model has not seen)
is pending: the next propose runs it in one batched pass (_catch_up) before drafting, so the
plain steps of adaptive mode cost no draft work at all (a new request's prompt is prefilled
there too, at its first draft).

Randomness as in specdec.speculation.trees: `chain:K` drafts of sampled requests are *sampled* from
the draft model's distribution under the request's temperature / top-k / top-p (with the
request's generator) and that distribution is passed as draft_probs (classic speculative
sampling); greedy rows take the argmax. Tree drafts (`dynamic`, `adaptive`) are top-k picks,
deterministic, so draft_probs=None (point masses).
"""

import re

import torch

import specdec_kernels.ops as ops
from specdec.drafters.base import Drafter, Proposal
from specdec.errors import InvalidRequestError, ModelLoadError
from specdec.models.cache import PagedKVCache
from specdec.models.llama import AttentionMetadata, Transformer
from specdec.speculation.cost_model import CostModel, median_time
from specdec.speculation.trees import TreeSpec, draft_distribution, grow_dynamic, sample_rows

SELF_PREFIX = "self:"


class DraftNet:
    """A Transformer's embeddings, its first n_layers blocks, final norm and LM head, run over
    a cache of its own. The modules are the model's own objects (no weight is copied), so
    `DraftNet(target, N)` is the self-draft and `DraftNet(model)` a standalone draft model."""

    def __init__(self, model: Transformer, n_layers: int | None = None):
        self.model = model
        self.args = model.args
        self.n_layers = model.args.n_layers if n_layers is None else n_layers
        self.tok_embeddings = model.tok_embeddings
        self.layers = list(model.layers)[: self.n_layers]  # Attention.layer_idx < n_layers
        self.norm = model.norm
        self.output = model.output
        self.vocab_size = model.args.vocab_size

    @property
    def device(self) -> torch.device:
        return self.tok_embeddings.weight.device

    def parameters(self):
        """The tensors this net computes with (all of them the model's own)."""
        seen = {}
        for m in [self.tok_embeddings, *self.layers, self.norm, self.output]:
            for p in m.parameters():
                seen[id(p)] = p
        return list(seen.values())

    def new_cache(self, num_slots: int, max_seq_len: int, block_size: int) -> PagedKVCache:
        """One layer per draft layer (self:N: N layers of the target's KV width)."""
        w, a = self.tok_embeddings.weight, self.args
        return PagedKVCache(
            self.n_layers,
            a.n_kv_heads,
            a.head_dim,
            num_slots,
            max_seq_len,
            block_size,
            dtype=w.dtype,
            device=w.device,
        )

    def _run(self, tokens, cos, sin, meta):
        """tokens: long [B, M] -> final-norm hidden [B, M, dim]."""
        x = self.tok_embeddings(tokens)
        for layer in self.layers:
            x = layer(x, cos, sin, meta)
        return self.norm(x)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [..., dim] -> float32 logits [..., V]."""
        return self.output(hidden).float()

    @torch.no_grad()
    def prefill(self, prompts: list[torch.Tensor], cache: PagedKVCache, slots: torch.Tensor):
        """prompts: long [S_b] each -> their KV at positions 0..S_b-1, cache_lens = S_b."""
        for b, prompt in enumerate(prompts):
            slot = slots[b : b + 1]
            pos = torch.arange(len(prompt), device=prompt.device)[None]  # [1, S]
            cos, sin = self.model.rope(pos)
            self._run(prompt[None], cos, sin, AttentionMetadata.prefill(cache, slot, pos))
            cache.cache_lens[slot] = len(prompt)

    @torch.no_grad()
    def forward(self, tokens, cache, slots, base, start, num_nodes, tree_mask, positions):
        """Tree nodes start..start+M-1 of padded trees of T = tree_mask.shape[1] nodes (the
        earlier ones already cached), node i at logical position base + i.
        tokens: long [B, M]; slots: [B]; base, num_nodes: int32 [B]; tree_mask: int64
        [B, T, ceil(T / 64)]; positions: int [B, M] RoPE positions -> hidden [B, M, dim]."""
        meta = AttentionMetadata.verify(
            cache, slots, base, num_nodes, tree_mask, start, tokens.shape[1]
        )
        cos, sin = self.model.rope(positions)
        return self._run(tokens, cos, sin, meta)


class ModelTree:
    """The draft model's tree over its cache (module docstring): node 0 is the root at the
    last committed position base = cache_lens - 1; `add` appends nodes and runs the draft
    model on them only, attending through the tree built so far."""

    def __init__(self, net: DraftNet, cache: PagedKVCache, slots: torch.Tensor, size: int):
        B = slots.shape[0]
        self.net, self.cache, self.slots = net, cache, slots
        self.base = cache.cache_lens[slots] - 1
        self.parents = torch.full((B, size), -1, dtype=torch.int32, device=slots.device)
        self.n = 1

    def add(self, tokens: torch.Tensor, parents: torch.Tensor, depth: int) -> torch.Tensor:
        """tokens: long [B, M]; parents: tree-node ids [B, M]; depth: the new nodes' draft
        depth -> the draft model's float32 logits after each new node [B, M, V]."""
        B, M = tokens.shape
        start, self.n = self.n, self.n + M
        self.parents[:, start : self.n] = parents.to(torch.int32)
        num_nodes = torch.full((B,), self.n, dtype=torch.int32, device=tokens.device)
        tree_mask, _ = ops.build_tree_mask(self.parents[:, : self.n].contiguous(), num_nodes)
        positions = (self.base + depth)[:, None].expand(B, M)
        hidden = self.net.forward(
            tokens, self.cache, self.slots, self.base, start, num_nodes, tree_mask, positions
        )
        return self.net.logits(hidden)


class DraftModelDrafter(Drafter):
    """Chain (`chain:K`), EAGLE-2-style dynamic (`dynamic:D,K,N`) or adaptive trees from a
    draft model sharing the target's vocabulary (see the module docstring).

        DraftModelDrafter(small_model)            # a standalone draft model
        DraftModelDrafter.self_draft(target, 8)   # the target's first 8 layers
    """

    name = "draft"
    adaptive = True

    def __init__(self, model: Transformer, n_layers: int | None = None, label: str | None = None):
        if not isinstance(model, Transformer):
            raise InvalidRequestError(
                f"--draft-model must be a specdec.models.llama.Transformer, "
                f"got {type(model).__name__}"
            )
        self.net = DraftNet(model, n_layers)
        self.label = label or f"draft model ({self.net.n_layers} layers)"

    def modules(self):
        return [self.net.model]

    @classmethod
    def self_draft(cls, target: Transformer, n_layers) -> "DraftModelDrafter":
        """The target's first n_layers blocks + its final norm and LM head, weights shared."""
        L = target.args.n_layers
        if not isinstance(n_layers, int) or isinstance(n_layers, bool) or not 1 <= n_layers <= L:
            raise InvalidRequestError(
                f"--draft-model self:N: N must be an integer in [1, {L}] (the target's "
                f"layers), got {n_layers!r}"
            )
        return cls(target, n_layers, label=f"self:{n_layers}")

    @classmethod
    def from_arg(cls, spec: str, target: Transformer) -> "DraftModelDrafter":
        """--draft-model: `self:N`, or a .gguf file / HF checkpoint dir, loaded in the target's
        dtype on its device."""
        if spec.startswith(SELF_PREFIX):
            n = spec[len(SELF_PREFIX) :]
            if not re.fullmatch(r"\d+", n):
                raise InvalidRequestError(
                    f"--draft-model {spec!r}: expected self:N with N an integer in "
                    f"[1, {target.args.n_layers}]"
                )
            return cls.self_draft(target, int(n))
        from specdec.models.loader import load_model

        w = target.tok_embeddings.weight
        try:
            model, _ = load_model(spec, dtype=w.dtype, device=w.device)
        except ModelLoadError as e:
            raise ModelLoadError(f"--draft-model {spec}: {e}") from None
        drafter = cls(model, label=spec)
        drafter.check_target(target)
        return drafter

    def check_target(self, target: Transformer) -> None:
        """InvalidRequestError unless the draft model can draft for target (same vocabulary,
        same device)."""
        if self.net.vocab_size != target.args.vocab_size:
            raise InvalidRequestError(
                f"--draft-model {self.label}: its vocabulary has {self.net.vocab_size} tokens, "
                f"the target's {target.args.vocab_size}; a draft model must share the target's "
                "tokenizer"
            )
        if self.net.device != target.tok_embeddings.weight.device:
            raise InvalidRequestError(
                f"--draft-model {self.label} is on {self.net.device}, the target on "
                f"{target.tok_embeddings.weight.device}"
            )

    # ------------------------------------------------------------------ sizing
    def check(self, tree, max_nodes: int) -> None:
        tree.check_fits(max_nodes, self.net.vocab_size)

    @staticmethod
    def tree_nodes(tree: TreeSpec) -> int:
        """Nodes of the draft model's own tree: the root plus every expanded draft node."""
        return tree.depth if tree.kind == "chain" else tree.head_nodes

    def cache_positions(self, tree, capacity: int) -> int:
        # The committed tokens (the root included: one more than the target's) plus the
        # scratch tree, per draft layer: the engine counts positions of one target layer,
        # exact for self:N (same KV width), an estimate for another draft model.
        return (capacity + 1 + self.tree_nodes(tree)) * self.net.n_layers

    def measure_cost(self, model, tree, batch_size: int, target_forward=None) -> CostModel:
        """The target's verify costs (CostModel.measure) and, at each measured batch size,
        draft_s[l - 1]: seconds of a catch-up over two tokens (a typical accepted step's
        bonus token and one more) plus l levels of dynamic drafting with the draft model."""
        cost = CostModel.measure(model, None, tree, batch_size, target_forward=target_forward)
        cost.draft_s = self._draft_seconds(tree, batch_size)
        for other in cost.others:
            other["draft_s"] = self._draft_seconds(tree, other["batch_size"], repeats=1)
        return cost

    @torch.inference_mode()
    def _draft_seconds(self, tree, batch_size: int, context: int = 128, repeats: int = 3):
        net, dev = self.net, self.net.device
        B = batch_size
        slots = torch.arange(B, device=dev)
        cache = net.new_cache(B, context + 2 + self.tree_nodes(tree), 16)
        sampling = None  # dynamic trees never sample
        out = []
        for levels in range(1, tree.depth + 1):
            spec = TreeSpec("dynamic", levels, tree.topk, tree.total)

            def step(spec=spec):
                cache.cache_lens.fill_(context)
                pending = torch.zeros(B, 2, dtype=torch.long, device=dev)
                logits = self._feed(slots, cache, pending, torch.full((B,), 2, device=dev))
                self._draft_dynamic(spec, cache, slots, pending[:, -1], logits, sampling)

            out.append(median_time(step, repeats, dev))
        return out

    # ------------------------------------------------------------------ per run
    def setup(self, setup) -> None:
        self.check_target(setup.model)
        self.tree, self.device = setup.tree, setup.device
        positions = setup.capacity + 1 + self.tree_nodes(setup.tree)
        try:
            self.cache = self.net.new_cache(setup.batch_size, positions, setup.block_size)
        except (RuntimeError, MemoryError) as e:
            raise InvalidRequestError(
                f"cannot allocate the --draft-model KV cache for batch_size {setup.batch_size}: {e}"
            ) from None
        # per slot: tokens emitted but not yet run through the draft model (the root last)
        self.pending: dict[int, list[torch.Tensor]] = {}
        self.prompts: dict[int, torch.Tensor] = {}  # per slot: the prompt, until prefilled
        # the last propose: (slots, draft-model tree node of each proposal node [B, T], -1
        # for nodes never run); commit() reads and clears it
        self._step: tuple[list, torch.Tensor] | None = None

    def start(self, slots, prompts, first_tokens, hidden, aux, ok) -> None:
        """Queues each prompt for the draft model's prefill and the first token as pending
        (both run by the first _catch_up: a request adaptive mode never drafts for costs no
        draft work, not even the prefill)."""
        self.cache.reset(slots)
        for b, slot in enumerate(slots.tolist()):
            self.pending.pop(slot, None)
            self.prompts.pop(slot, None)
            if ok[b]:
                self.prompts[slot] = prompts[b]
                self.pending[slot] = [first_tokens[b : b + 1].long()]

    def propose(self, slots, roots, sampling, policy=None) -> Proposal:
        root_logits = self._catch_up(slots)  # [B, V]: the draft model's next-token logits
        if self.tree.kind == "chain":
            p, fed = self._draft_chain(self.tree, self.cache, slots, roots, root_logits, sampling)
        else:
            p, fed = self._draft_dynamic(
                self.tree, self.cache, slots, roots, root_logits, sampling, policy
            )
        self._step = (slots.tolist(), fed)
        return p

    def commit(self, slots, proposal, result) -> None:
        step, self._step = self._step, None
        n_out = (result.num_accepted + 1).tolist()
        if step is None or step[0] != slots.tolist():
            # a plain step (no propose): nothing was run, every emitted token is pending
            for good, slot, toks, n in zip(
                result.ok, slots.tolist(), result.output_tokens.long(), n_out
            ):
                if good:
                    self.pending[slot].append(toks[:n])
            return
        fed = step[1]
        path = result.accepted_nodes.long()  # [B, T]: proposal nodes of the accepted path
        tree_path = torch.where(path >= 0, fed.gather(1, path.clamp(min=0)), -1)
        # the path's prefix the draft model ran (root included: tree node 0)
        run = (tree_path >= 0).long().cumprod(1)
        num_run = run.sum(1) - 1  # accepted drafts whose KV is in the draft cache
        # compact_kv's node ids index its accepted_nodes' width: room for every tree node
        W = max(path.shape[1], self.tree_nodes(self.tree))
        moves = torch.full((len(path), W), -1, dtype=torch.int32, device=path.device)
        moves[:, : path.shape[1]] = torch.where(run.bool(), tree_path, -1).to(torch.int32)
        base = self.cache.cache_lens[slots] - 1  # the root's position
        ops.compact_kv(
            self.cache.k,
            self.cache.v,
            self.cache.block_table[slots],
            base,
            moves,
            num_run.to(torch.int32),
        )
        self.cache.cache_lens[slots] = (base + 1 + num_run).to(torch.int32)
        for good, slot, toks, f, n in zip(
            result.ok, slots.tolist(), result.output_tokens.long(), num_run.tolist(), n_out
        ):
            if good:  # the path's tokens after the run prefix; the bonus token always
                self.pending[slot] = [toks[f:n]]

    # ------------------------------------------------------------------ catch-up
    def _catch_up(self, slots) -> torch.Tensor:
        """Runs the draft model over each slot's pending tokens (those emitted since it last
        ran, the root last) in one batched pass -> logits after the root [B, V]. New
        requests' prompts are prefilled first (causal attention, one request at a time)."""
        new = [b for b, s in enumerate(slots.tolist()) if s in self.prompts]
        if new:
            rows = torch.tensor(new, device=slots.device)
            prompts = [self.prompts.pop(int(slots[b])) for b in new]
            self.net.prefill(prompts, self.cache, slots[rows])
        chunks = [torch.cat(self.pending.pop(s)) for s in slots.tolist()]
        counts = torch.tensor([len(c) for c in chunks], dtype=torch.int32, device=self.device)
        tokens = torch.nn.utils.rnn.pad_sequence(chunks, batch_first=True)
        return self._feed(slots, self.cache, tokens, counts)

    def _feed(self, slots, cache, tokens, counts) -> torch.Tensor:
        """Appends counts[b] tokens (long [B, M]) to each slot's draft cache -> the logits
        after the last one [B, V]."""
        B, M = tokens.shape
        counts = counts.to(torch.int32)
        parents = (
            torch.arange(-1, M - 1, dtype=torch.int32, device=tokens.device)
            .expand(B, M)
            .contiguous()
        )
        tree_mask, depth = ops.build_tree_mask(parents, counts)
        lens = cache.cache_lens[slots]
        hidden = self.net.forward(
            tokens, cache, slots, lens, 0, counts, tree_mask, lens[:, None] + depth
        )
        cache.cache_lens[slots] += counts
        last = hidden[torch.arange(B, device=tokens.device), counts.long() - 1]
        return self.net.logits(last)

    # ------------------------------------------------------------------ drafting
    def _draft_chain(self, spec, cache, slots, roots, logits, sampling):
        """K = spec.depth drafts in a line; proposal node d is tree node d (d < K)."""
        B, K, dev = roots.shape[0], spec.depth, roots.device
        tree = ModelTree(self.net, cache, slots, K)
        tokens = torch.zeros(B, K + 1, dtype=torch.long, device=dev)
        tokens[:, 0] = roots
        parents = torch.arange(-1, K, dtype=torch.int32, device=dev).expand(B, K + 1).contiguous()
        fed = torch.full((B, K + 1), -1, dtype=torch.long, device=dev)
        fed[:, :K] = torch.arange(K, device=dev)  # the last draft is never run
        draft_probs = None
        sampled = sampling is not None and sampling.any_random
        for d in range(1, K + 1):
            if sampled:
                q = draft_distribution(logits, sampling)  # [B, V]
                tokens[:, d] = sample_rows(q, sampling.generators)
                if draft_probs is None:
                    draft_probs = q.new_zeros(B, K + 1, q.shape[-1])
                draft_probs[:, d - 1] = q
            else:
                tokens[:, d] = logits.argmax(-1)
            if d < K:
                parent = torch.full((B, 1), d - 1, device=dev)
                logits = tree.add(tokens[:, d : d + 1], parent, depth=d)[:, 0]
        num_nodes = torch.full((B,), K + 1, dtype=torch.int32, device=dev)
        return Proposal(tokens, parents, num_nodes, draft_probs), fed

    def _draft_dynamic(self, spec, cache, slots, roots, logits, sampling, policy=None):
        """EAGLE-2's tree (drafting.grow_dynamic) with the draft model's logits: every
        expanded frontier node is fed to the draft model (a ModelTree node whose logits
        give its children). Returns the Proposal and fed: long [B, T], the ModelTree node
        where each tree node was fed (-1: never fed), for commit."""
        B, K, D, dev = roots.shape[0], spec.topk, spec.depth, roots.device
        tree = ModelTree(self.net, cache, slots, 1 + (D - 1) * K)
        max_cand = K + (D - 1) * K * K
        cand_node = torch.full((B, max_cand), -1, dtype=torch.long, device=dev)  # tree node
        prev_start = [0]  # ModelTree node of the previous level's first frontier entry

        def expand(front_tok, front_cand, from_front, depth):
            parent = (
                torch.zeros_like(front_tok) if from_front is None else prev_start[0] + from_front
            )
            prev_start[0] = start = tree.n
            child_logits = tree.add(front_tok, parent, depth=depth)  # [B, W, V]
            width = front_tok.shape[1]  # W <= K: the level's width (grow_dynamic)
            cand_node.scatter_(
                1, front_cand, start + torch.arange(width, device=dev).expand(B, width)
            )
            return child_logits

        grown = grow_dynamic(spec, logits, roots, expand, policy)
        d = grown.draft
        T, N = d.tokens.shape[1], grown.order.shape[1]
        fed = torch.full((B, T), -1, dtype=torch.long, device=dev)
        fed[:, 0] = 0
        fed[:, 1 : N + 1] = cand_node.gather(1, grown.order).masked_fill(~grown.real, -1)
        return Proposal(d.tokens, d.parents, d.num_nodes, None, d.confidence), fed
