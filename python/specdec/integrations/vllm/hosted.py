"""specdec's drafters inside vLLM's step: `DrafterProposer`, a vLLM custom_class proposer
that hosts any specdec Drafter (drafters/base.py: EAGLE-2/3 heads, n-gram, the merged
eagle+ngram trees) and drafts its trees for trees.py's tree step (docs/integration.md,
"Trees inside vLLM").

vLLM hands a custom_class proposer the token history only. A drafter also needs the target's
hidden states (EAGLE's features) and to know what was accepted; trees.py's runner hook hands
both over every step (`observe`) before vLLM asks for drafts (`propose`):

    observe(step)   per request of the step, from its scheduled tokens' hidden states:
                    a prefill (possibly in chunks) is gathered until the request samples its
                    first token, then Drafter.start; a decode step is Drafter.commit of the
                    tree proposed for it last step, its accepted path found by walking the
                    emitted tokens down that tree (siblings hold distinct tokens)
    propose(...)    Drafter.propose for the requests that sampled a token: node tokens in
                    topological order as vLLM's draft tokens, their parents in `parents`

A request keeps a drafter slot while vLLM runs it. A request whose state does not match the
step (new, recomputed after preemption, a step vLLM drafted nothing for, evicted for lack of
slots) starts over from the tokens this step computed: its drafter then sees fewer features,
which costs acceptance, never exactness (any tree is verified by tree_rejection_sample).
Drafts are deterministic (greedy drafting, point masses), so sampled requests stay exact too.

Adaptive trees (tree spec "adaptive[:D,K,N]") size every step with specdec's Policy: its cost
model times vLLM's own forward (`vllm_target_forward`: the target model over B x T tokens and
their logits, as vLLM's profiling runs it) and the drafter at start-up, at batch 1 and up to the
engine's max_num_seqs (POLICY_MAX_BATCH at most), priced at each step's live occupancy and
calibrated by the measured wall time of vLLM's steps (Policy.observe_time), and a step the
policy finds not worth speculating drafts nothing (vLLM then runs a plain step). With tensor or
pipeline parallelism the verify costs are timed on specdec's forward of the same checkpoint
instead (each rank times on its own; vLLM's forward is collective, and ranks whose timings
stopped at different tree sizes would wait on each other).
"""

import time
from dataclasses import dataclass, field

import numpy as np
import torch

import specdec_kernels.ops as ops
from specdec.drafters.base import Proposal, Setup, StepResult
from specdec.integrations.vllm.options import specdec_options
from specdec.models.loader import resolve_dtype
from specdec.speculation.cost_model import TargetForward
from specdec.speculation.trees import BatchSampling, TreeSpec

MAX_SLOTS = 64  # drafter slots (head caches) at most; requests past them draft nothing
HEAD_BLOCK_SIZE = 16  # the head cache's block size (its own cache, not vLLM's)
# the largest batch the adaptive policy's cost model is measured at (also at 1 and about
# half of it): the policy prices a step at its live occupancy, so under load it sees that big
# trees cost more than they earn and goes plain; past this batch it prices the largest
# measured one. Bounded for start-up time (each size is a few target forwards).
POLICY_MAX_BATCH = 32


@dataclass
class _Request:
    """One vLLM request's drafter state."""

    slot: int
    next_position: int  # the cache length its next step must start from to match this state
    started: bool = False  # Drafter.start done (the prompt's features were handed over)
    chunks: list = field(default_factory=list)  # prefill: (tokens, hidden, aux) per step
    proposal: tuple | None = None  # (tokens, parents, confidence) last proposed, root first
    last_step: int = 0


class DrafterProposer:
    """A specdec Drafter as a vLLM custom_class proposer drafting trees (module docstring).
    Options (specdec options, options.py): drafter ("ngram", "eagle", "eagle+ngram"), head
    (an EAGLE head directory), ngram_max / ngram_min, tree_spec (a TreeSpec of at most
    num_speculative_tokens + 1 nodes)."""

    def __init__(self, vllm_config):
        options = specdec_options(vllm_config)
        self.method = options.get("drafter", "ngram")
        self.head = options.get("head")
        self.ngram = (int(options.get("ngram_max", 4)), int(options.get("ngram_min", 1)))
        self.tree = TreeSpec.parse(options["tree_spec"])
        self.num_nodes = int(vllm_config.speculative_config.num_speculative_tokens)
        self.max_model_len = int(vllm_config.model_config.max_model_len)
        self.model_path = vllm_config.model_config.model
        self.num_slots = min(int(vllm_config.scheduler_config.max_num_seqs), MAX_SLOTS)
        # the drafter's own model copy (heads, cost model): bfloat16 where the CPU computes it
        # natively ("auto"), whatever vLLM's dtype; drafts are verified by vLLM's forward, so
        # their precision changes acceptance only (docs/integration.md, "Trees inside vLLM")
        self.draft_dtype = resolve_dtype(options.get("draft_dtype", "auto"), torch.device("cpu"))
        self.target_dtype = vllm_config.model_config.dtype  # vLLM's forward, the cost model's
        self.vllm_config = vllm_config
        parallel = vllm_config.parallel_config
        self.single_process = parallel.tensor_parallel_size * parallel.pipeline_parallel_size == 1
        self.drafter = None
        self.policy = None
        self.feature_layers: tuple = ()  # target layers whose outputs the drafter reads
        self.requests: dict[str, _Request] = {}
        self.free = list(range(self.num_slots))[::-1]
        self.parents: list = []  # per batch row of the last propose: its tree's parents
        self._by_row: list = []  # per batch row: its request's state (bind_rows)
        self.steps = 0
        self._step_start: float | None = None  # adaptive: when the last propose began
        self._prefill_in_step = False  # the step observed last scheduled prompt tokens
        self._speculative = False

    # ------------------------------------------------------------------ set-up
    def load_model(self, target_model) -> None:
        """Builds the drafter (its own copy of the target's embeddings and output for the
        heads: specdec's model of the same checkpoint, in draft_dtype), its slots and, for
        adaptive trees, the policy with its measured cost model (the verify costs timed on
        vLLM's forward of target_model, the drafts by the drafter as it runs; see the module
        docstring for tensor parallelism)."""
        from specdec.drafters.choice import DrafterChoice
        from specdec.models.loader import load_model

        adaptive = self.tree.kind == "adaptive"
        # the verify costs' forward: vLLM's (None: a copy of the target in vLLM's dtype)
        target_forward = (
            vllm_target_forward(
                self.vllm_config, target_model, self.vllm_config.model_config.get_vocab_size()
            )
            if adaptive and self.single_process
            else None
        )
        model = draft_model = None
        if adaptive and target_forward is None:
            model, _ = load_model(self.model_path, dtype=self.target_dtype)
        if self.method != "ngram":
            draft_model = model
            if model is None or self.draft_dtype != self.target_dtype:
                draft_model, _ = load_model(self.model_path, dtype=self.draft_dtype)
        choice = DrafterChoice(
            self.method, self.head, ngram_max=self.ngram[0], ngram_min=self.ngram[1]
        )
        choice.check().check_tree(self.tree)
        self.drafter = drafter = choice.build(draft_model, self.model_path)
        drafter.check(self.tree, self.max_model_len - 1)
        capacity = self.max_model_len + self.num_nodes + 1
        cpu = torch.device("cpu")
        drafter.setup(
            Setup(draft_model or model, self.tree, self.num_slots, capacity, HEAD_BLOCK_SIZE, cpu)
        )
        self.feature_layers = tuple(drafter.feature_layers)
        if drafter.adaptive and adaptive:
            from specdec.speculation.policy import Policy

            batch = min(self.num_slots, POLICY_MAX_BATCH)
            cost_model = draft_model if target_forward is not None else model
            cost = drafter.measure_cost(cost_model, self.tree, batch, target_forward)
            self.policy = Policy(cost, self.tree, calibrate=True)

    def vllm_aux_layers(self) -> tuple:
        """vLLM's aux hidden-state layer ids for the drafter's feature layers: vLLM collects
        the residual stream entering layer i, specdec the output of layer i (= entering i+1)."""
        return tuple(i + 1 for i in self.feature_layers)

    # ------------------------------------------------------------------ each step
    def observe(self, step: "HostedStep") -> None:
        """What the step computed (see HostedStep), before propose(): starts the requests
        whose prompt is done and commits the decode rows' proposals."""
        self.steps += 1
        starts, commits = [], []
        # a row with more tokens than its drafts + 1 is a prompt (chunk): its cost is not
        # what the policy prices a decode step at, so the step's time calibrates nothing
        self._prefill_in_step = any(n > k + 1 for n, k in zip(step.num_scheduled, step.num_drafts))
        for b, req_id in enumerate(step.req_ids):
            n, computed, k = step.num_scheduled[b], step.computed[b], step.num_drafts[b]
            emitted = step.sampled[b]
            r = self.requests.get(req_id)
            if r is None or r.next_position != computed or (r.started and r.proposal is None):
                self._forget(req_id)
                if k:  # drafts that are not ours to commit: wait for a plain step
                    continue
                r = self._new_request(req_id, computed)
                if r is None:
                    continue
            r.last_step = self.steps
            rows = slice(step.starts[b], step.starts[b] + n)
            if not r.started:
                r.chunks.append(
                    (step.tokens(b, computed, n), step.hidden[rows], step.aux_rows(rows))
                )
                r.next_position = computed + n
                if emitted:
                    starts.append((req_id, r, emitted[0]))
                continue
            path = _accepted_path(r.proposal, k, emitted)
            if path is None:  # vLLM kept more drafts than proposed, or a foreign tree
                self._forget(req_id)
                continue
            commits.append((r, path, emitted, step.starts[b], k))
            r.next_position = computed + len(emitted)
        for req_id in step.finished:
            self._forget(req_id)
        if starts:
            self._start(starts)
        if commits:
            self._commit(commits, step)

    def propose(self, sampled_token_ids, num_tokens_no_spec, token_ids_cpu, slot_mappings=None):
        """One draft list per batch row (node tokens, root excluded, parents before children);
        `self.parents[row]` the tree's parents (root first). Rows without a started state, a
        sampled token or room draft nothing."""
        rows, roots = [], []
        for i, sampled in enumerate(sampled_token_ids):
            r = self._by_row[i] if i < len(self._by_row) else None
            n = int(num_tokens_no_spec[i])
            if r is not None and r.started and len(sampled) and n < self.max_model_len:
                rows.append(i)
                roots.append(int(token_ids_cpu[i, n - 1]))
        drafts = [[] for _ in sampled_token_ids]
        self.parents = [[-1] for _ in sampled_token_ids]
        if not rows:
            return drafts
        states = [self._by_row[i] for i in rows]
        slots = torch.tensor([r.slot for r in states], dtype=torch.long)
        root_tokens = torch.tensor(roots, dtype=torch.long)
        self._step_start = time.perf_counter()
        self._speculative = True
        if self.policy is not None:
            self.policy.new_step([r.slot for r in states])
            self._speculative = self.policy.speculate()
        if self._speculative:
            p = self.drafter.propose(slots, root_tokens, _greedy(len(rows)), self.policy)
        else:
            p = None
        for j, (i, r) in enumerate(zip(rows, states)):
            if p is None:
                r.proposal = ([roots[j]], [-1], None)
                continue
            room = min(self.num_nodes, self.max_model_len - int(num_tokens_no_spec[i]))
            m = min(int(p.num_nodes[j]), room + 1)
            tokens = p.tokens[j, :m].tolist()
            parents = p.parents[j, :m].tolist()
            confidence = None if p.confidence is None else p.confidence[j, :m].tolist()
            r.proposal = (tokens, parents, confidence)
            drafts[i] = [int(t) for t in tokens[1:]]
            self.parents[i] = parents
        return drafts

    # ------------------------------------------------------------------ helpers
    def bind_rows(self, req_ids: list) -> None:
        """The batch rows' requests, in row order, for the propose() that follows."""
        self._by_row = [self.requests.get(req_id) for req_id in req_ids]

    def _new_request(self, req_id: str, computed: int) -> "_Request | None":
        if not self.free:
            idle = [q for q, r in self.requests.items() if r.last_step < self.steps]
            if not idle:
                return None
            self._forget(min(idle, key=lambda q: self.requests[q].last_step))
        r = self.requests[req_id] = _Request(self.free.pop(), computed)
        return r

    def _forget(self, req_id: str) -> None:
        r = self.requests.pop(req_id, None)
        if r is not None:
            self.free.append(r.slot)

    def _start(self, starts: list) -> None:
        prompts, hidden, aux, firsts = [], [], [], []
        for _, r, first in starts:
            prompts.append(torch.cat([c[0] for c in r.chunks]))
            hidden.append(torch.cat([c[1] for c in r.chunks]).to(self.draft_dtype))
            aux.append(torch.cat([c[2] for c in r.chunks]).to(self.draft_dtype))
            firsts.append(first)
            r.chunks, r.started = [], True
        slots = torch.tensor([r.slot for _, r, _ in starts], dtype=torch.long)
        if self.policy is not None:
            self.policy.start(slots.tolist())
        self.drafter.start(
            slots,
            prompts,
            torch.tensor(firsts, dtype=torch.long),
            hidden,
            aux,
            [True] * len(starts),
        )

    def _commit(self, commits: list, step: "HostedStep") -> None:
        """Drafter.commit of the decode rows (r, path, emitted, first hidden row, k), their
        trees padded to the widest. Built in numpy and gathered in one index_select each: at
        32 rows, per-row tensors cost ~2.5 ms a step (profile_step.py --part vllm)."""
        B = len(commits)
        T = max(k + 1 for *_, k in commits)
        tokens = np.zeros((B, T), dtype=np.int64)
        parents = np.full((B, T), -1, dtype=np.int32)
        confidence = np.ones((B, T), dtype=np.float32)
        accepted = np.full((B, T), -1, dtype=np.int32)
        output = np.full((B, T), -1, dtype=np.int32)
        num_nodes = np.zeros(B, dtype=np.int32)
        num_accepted = np.zeros(B, dtype=np.int32)
        src, dst = [], []  # hidden rows of the step -> rows of the padded [B * T] batch
        speculative_rows = []
        for b, (r, path, emitted, first, k) in enumerate(commits):
            toks, pars, conf = r.proposal
            tokens[b, : k + 1] = toks[: k + 1]
            parents[b, : k + 1] = pars[: k + 1]
            if conf is not None:  # drafted by the policy's speculative step (maybe root-only)
                confidence[b, : k + 1] = conf[: k + 1]
                speculative_rows.append(b)
            accepted[b, : len(path)] = path
            output[b, : len(emitted)] = emitted
            src.extend(range(first, first + k + 1))
            dst.extend(range(b * T, b * T + k + 1))
            num_nodes[b], num_accepted[b] = k + 1, len(path) - 1
            r.proposal = None
        src_rows, dst_rows = torch.tensor(src), torch.tensor(dst)
        dtype = self.draft_dtype
        hidden = step.hidden.new_zeros(B * T, step.hidden.shape[-1], dtype=dtype)
        hidden.index_copy_(0, dst_rows, step.hidden.index_select(0, src_rows).to(dtype))
        aux_dim = 0 if step.aux is None else step.aux.shape[-1]
        aux = step.hidden.new_zeros(B * T, aux_dim, dtype=dtype)
        if aux_dim:
            aux.index_copy_(0, dst_rows, step.aux.index_select(0, src_rows).to(dtype))
        tokens, parents = torch.from_numpy(tokens), torch.from_numpy(parents)
        confidence, accepted = torch.from_numpy(confidence), torch.from_numpy(accepted)
        output, num_nodes = torch.from_numpy(output), torch.from_numpy(num_nodes)
        num_accepted = torch.from_numpy(num_accepted)
        hidden, aux = hidden.view(B, T, -1), aux.view(B, T, aux_dim)
        slots = torch.tensor([c[0].slot for c in commits], dtype=torch.long)
        proposal = Proposal(tokens, parents, num_nodes, None, confidence)
        if self.policy is not None:
            self._observe_policy(proposal, accepted, num_accepted, slots, speculative_rows)
        self.drafter.commit(
            slots,
            proposal,
            StepResult(accepted, num_accepted, output, hidden, aux, [True] * B),
        )

    def _observe_policy(self, proposal, accepted, num_accepted, slots, rows) -> None:
        """Adaptive: the accepted paths of the speculative step's rows (a row its trees left
        root-only counts too: the step's tokens per request are what its cost bought), and
        the step's wall time (from its drafting to now) against the cost model's prediction,
        unless the step also ran prompt tokens."""
        policy = self.policy
        if rows:
            idx = torch.tensor(rows)
            sub = Proposal(
                proposal.tokens[idx],
                proposal.parents[idx],
                proposal.num_nodes[idx],
                None,
                proposal.confidence[idx],
            )
            _, depth = ops.build_tree_mask(sub.parents, sub.num_nodes)
            policy.observe(sub, depth, accepted[idx], num_accepted[idx], slots[idx].tolist())
        if self._step_start is not None and not self._prefill_in_step:
            seconds = time.perf_counter() - self._step_start
            nodes = policy.step_nodes(proposal.num_nodes, proposal.tokens.shape[1])
            policy.observe_time(seconds, self._speculative, policy.levels, nodes)
            self._step_start = None


def vllm_target_forward(
    vllm_config, target_model, vocab_size: int, context: int = 128
) -> TargetForward:
    """A CostModel target_forward running vLLM's forward: target_model over B x T tokens (of
    [0, vocab_size), T positions from `context` per request) and their logits, which a tree
    step computes at every scheduled token. Without attention metadata, as vLLM's own
    profiling runs its model (no KV cache read or written): the linears and the logits, which
    is where a step's cost grows with its tokens; the attention's share is left to the
    policy's calibration by the steps' measured times."""
    from vllm.forward_context import set_forward_context

    dev = next(target_model.parameters()).device

    def forward(B: int, T: int):
        n = B * T
        input_ids = torch.randint(0, vocab_size, (n,), device=dev)
        positions = (context + torch.arange(T, device=dev)).repeat(B)

        @torch.inference_mode()
        def run():
            with set_forward_context(None, vllm_config, num_tokens=n):
                out = target_model(input_ids=input_ids, positions=positions)
            hidden = out[0] if isinstance(out, tuple) else out  # (hidden, aux) for EAGLE-3
            return target_model.compute_logits(hidden)

        return run

    return forward


@dataclass
class HostedStep:
    """One vLLM step as DrafterProposer.observe reads it, rows in batch order: req_ids,
    num_scheduled / computed (the cache length the step started from) / num_drafts per row,
    starts (each row's first index into hidden), hidden [N, dim] (the target's final-norm
    hidden state of every scheduled token), aux [N, F] or None (the drafter's feature layers'
    outputs, concatenated), sampled (the tokens each row emitted: [] for a partial prefill),
    token_ids [num_reqs, max_len] (vLLM's token history), finished (request ids vLLM ended)."""

    req_ids: list
    num_scheduled: list
    computed: list
    num_drafts: list
    starts: list
    hidden: torch.Tensor
    aux: torch.Tensor | None
    sampled: list
    token_ids: np.ndarray
    finished: set

    def tokens(self, b: int, start: int, n: int) -> torch.Tensor:
        return torch.from_numpy(self.token_ids[b, start : start + n].astype(np.int64))

    def aux_rows(self, rows: slice) -> torch.Tensor:
        if self.aux is None:
            return self.hidden.new_zeros(rows.stop - rows.start, 0)
        return self.aux[rows]


def _accepted_path(proposal, k: int, emitted: list) -> list | None:
    """The node indices of the accepted path of a tree whose first k + 1 nodes were verified,
    given the emitted tokens (accepted drafts, then the bonus token): the walk from the root
    down the children holding each accepted token. None when it does not fit the tree."""
    tokens, parents, _ = proposal
    if k + 1 > len(tokens) or not emitted:
        return None
    path = [0]
    for tok in emitted[:-1]:
        here = path[-1]
        child = next(
            (i for i in range(here + 1, k + 1) if parents[i] == here and tokens[i] == tok), None
        )
        if child is None:
            return None
        path.append(child)
    return path


def _greedy(batch: int) -> BatchSampling:
    """Greedy drafting: deterministic trees (point masses), exact for any request."""
    return BatchSampling(
        torch.zeros(batch),
        torch.zeros(batch, dtype=torch.int32),
        torch.ones(batch),
        [None] * batch,
        random=False,
    )
