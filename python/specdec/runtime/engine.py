"""The batched speculative decode loop (and, with the drafter off, plain decoding).

One step for the B active requests:
    drafter.propose -> build_tree_mask -> target verify forward -> tree_rejection_sample
          -> compact_kv + commit (target) -> drafter.commit -> emit.
The loop knows only a `Drafter` (specdec.drafters: the EAGLE head, n-gram lookup, ...);
plain decoding is the drafter that proposes the one-node tree (root only, T = 1). The first
token after prefill is sampled the same way, on a one-node tree over the prefill logits. In
adaptive mode (specdec.speculation.policy) a policy sizes each step's tree, or makes it a
plain step.

Requests advance together with different accepted lengths; a finished one (EOS, max
tokens, stop string, full cache) frees its slot for the next queued request. The engine is
online: `submit(request) -> RequestHandle` queues a request at any time and `step()` runs one
such step (admitting queued requests into free slots first); `generate()` and `stream()` are
loops over it. Not thread-safe: submit and step from one thread. Each request
has its own torch.Generator feeding its uniforms (and chain-draft samples), so what it
generates does not depend on its batch-mates.
"""

import collections
import heapq
import itertools
import operator
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING

import torch

import specdec_kernels.ops as ops
from specdec import cpu
from specdec.cpu import modules_unchanged
from specdec.device_memory import free_memory
from specdec.drafters.base import Drafter, Proposal, Setup, StepResult, root_only
from specdec.errors import InvalidRequestError, InvalidTreeSpecError
from specdec.models import tensor_parallel
from specdec.models.llama import Transformer
from specdec.runtime import compiled_step
from specdec.runtime.requests import Request, Result, SamplingParams, _Seq
from specdec.runtime.stats import Stats, timed
from specdec.speculation.cost_model import CostModel
from specdec.speculation.policy import Policy
from specdec.speculation.trees import BatchSampling, TreeSpec

if TYPE_CHECKING:
    from specdec.drafters.eagle_head import EagleHead
    from specdec.models.tokenizer import Tokenizer


class RequestHandle:
    """A submitted request (Engine.submit): its tokens as step() produces them, its Result.

    .request_id; .done; .result (the Result once finished, else None); .token_ids (all
    generated so far); .new_tokens() (those since the last call); iterating over the handle
    yields its token ids as they arrive, calling engine.step() whenever it has none to give
    (which advances every request in the engine), until it finishes; .cancel() withdraws it."""

    def __init__(self, engine: "Engine", seq: _Seq):
        self.engine, self._seq, self._read = engine, seq, 0
        self.result: Result | None = None

    @property
    def request_id(self):
        return self._seq.req.id

    @property
    def done(self) -> bool:
        return self.result is not None

    @property
    def token_ids(self) -> list:
        return list(self._seq.tokens)

    def new_tokens(self) -> list:
        """Tokens gained since the last new_tokens() (or since submission)."""
        tokens = self._seq.tokens[self._read :]
        self._read += len(tokens)
        return tokens

    def __iter__(self):
        while True:
            tokens = self.new_tokens()
            if tokens:
                yield from tokens
            elif self.done:
                return
            else:
                self.engine.step()

    def cancel(self) -> bool:
        """Withdraws the request if it has not finished: it leaves the queue or the batch at
        once and finishes with finish_reason "cancelled" (on_finish is called). -> whether it
        was cancelled."""
        if self.done or not self.engine._cancel(self._seq):
            return False
        self.engine._finish(self._seq)
        return True

    def __repr__(self):
        state = self.result.finish_reason if self.done else "running"
        return f"RequestHandle({self.request_id!r}, {len(self._seq.tokens)} tokens, {state})"


class Engine:
    """Speculative (a drafter or head given) or plain decoding of batches of requests.

    model: specdec.models.llama.Transformer; tokenizer: for EOS ids, stop strings and text
    (optional);
    head: an EagleHead or None (shorthand for drafter=EagleDrafter(head)); drafter: a
    specdec.drafters.Drafter (default: EAGLE with head, else plain); tree: TreeSpec or its
    string form, the shape of the drafter's trees ("chain:4",
    "dynamic:5,8,32", "adaptive"); batch_size: requests decoded together; max_seq_len: cache
    positions per request (prompt + generated); cost_model: adaptive mode's costs (default:
    measured here, which takes a few forwards; pass one to make the choices reproducible);
    calibrate: adaptive mode scales the costs by each step's measured times (the whole step and
    its draft levels: Policy.observe_time / observe_level; default: when the cost model is
    measured here, so that a passed one keeps the choices independent of timing; True to
    calibrate a reused cost model);
    sampler: tree_rejection_sample's stand-in, same arguments and outputs (default: the op;
    tensor parallelism passes tp.BroadcastSampler: rank 0 samples, every rank gets its result).

    Every argument is checked here, before any work (a tree that cannot fit the cache, caches
    larger than the memory left): InvalidTreeSpecError / InvalidRequestError."""

    def __init__(
        self,
        model: Transformer,
        tokenizer: "Tokenizer | None" = None,
        head: "EagleHead | None" = None,
        tree: TreeSpec | str = TreeSpec.DEFAULT,
        batch_size: int = 1,
        max_seq_len: int | None = None,
        block_size: int = 16,
        eos_token_ids: Iterable[int] | None = None,
        cost_model: CostModel | None = None,
        drafter: Drafter | None = None,
        sampler: Callable | None = None,
        calibrate: bool | None = None,
    ):
        start = time.perf_counter()
        if drafter is None:
            from specdec.drafters.eagle import EagleDrafter
            from specdec.drafters.plain import PlainDrafter

            drafter = PlainDrafter() if head is None else EagleDrafter(head)
        elif head is not None:
            raise InvalidRequestError("pass either head= or drafter=, not both")
        elif not isinstance(drafter, Drafter):
            raise InvalidRequestError(
                f"drafter must be a specdec.drafters.Drafter, got {drafter!r}"
            )
        self.model, self.tokenizer, self.drafter = model, tokenizer, drafter
        self.sampler = sampler
        self.head = getattr(drafter, "head", None)
        self.tree = TreeSpec.parse(tree) if isinstance(tree, str) else tree
        if not isinstance(self.tree, TreeSpec):
            raise InvalidTreeSpecError(f"tree must be a TreeSpec or its string form, got {tree!r}")
        self.tree.validate()
        for name, value in (
            ("batch_size", batch_size),
            ("block_size", block_size),
            ("max_seq_len", max_seq_len),
        ):
            if value is None and name == "max_seq_len":
                continue  # the default
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise InvalidRequestError(f"{name} must be an integer >= 1, got {value!r}")
        self.batch_size = batch_size
        self.device = model.tok_embeddings.weight.device
        max_pos = model.args.max_position_embeddings
        max_seq_len = max_seq_len or min(2048, max_pos)
        # Padded tree nodes are addressed (not written) past a request's last position, so
        # both caches keep T positions of slack beyond `capacity`, the per-request limit.
        T = drafter.num_nodes(self.tree)
        # the model's context holds the tree and at least a 1-token prompt
        drafter.check(self.tree, max_pos - 1)
        cache_len = min(max_seq_len + T, max_pos)
        capacity = min(max_seq_len, -(-cache_len // block_size) * block_size - T)
        self._check_memory(
            batch_size, block_size, cache_len, drafter.cache_positions(self.tree, capacity), T
        )
        try:
            self.cache = model.new_cache(batch_size, cache_len, block_size)
        except (RuntimeError, MemoryError) as e:  # torch.OutOfMemoryError is a RuntimeError
            raise InvalidRequestError(
                f"cannot allocate the KV cache for batch_size {batch_size}: {e}"
            ) from None
        self.capacity = min(max_seq_len, self.cache.capacity - T)
        self.max_seq_len, self.tree_slack = max_seq_len, T
        self.feature_layers = tuple(drafter.feature_layers)
        compiled_step.configure(model)  # SPECDEC_COMPILE, unless decided (the CLI's --compile)
        if isinstance(model, Transformer) and not model.compiled_step:
            # SPECDEC_PREPACK_WEIGHTS (the compiled step prepacks its own; a transformers
            # model, the integration's target, is the user's object: left as it is)
            cpu.configure(model)
            cpu.prepare(model)  # the weights' copies now: no request's TTFT pays them
        drafter.setup(Setup(model, self.tree, batch_size, capacity, block_size, self.device))
        # adaptive: the machine's costs, measured now, and the running acceptance statistics
        self.policy = None
        self.calibrate = cost_model is None if calibrate is None else bool(calibrate)
        if drafter.adaptive and self.tree.kind == "adaptive":
            if cost_model is None:
                # timed as generate() runs its steps: the modules checked once, not per call
                # (~0.6-2 ms a forward otherwise, which made every tree size look alike)
                with modules_unchanged(model, *drafter.modules()):
                    cost_model = drafter.measure_cost(model, self.tree, batch_size)
            self.policy = Policy(cost_model, self.tree, calibrate=self.calibrate)
        if eos_token_ids is None:
            eos_token_ids = tokenizer.eos_token_ids if tokenizer is not None else ()
        self.eos_token_ids = set(eos_token_ids)
        # online state (submit / step): waiting requests, the batch, free slots
        self._queue: collections.deque[_Seq] = collections.deque()
        self._active: list[_Seq] = []
        self._free = list(range(batch_size))  # a heap
        self._timers: list[Stats] = []  # run-level Stats that collect every step's time split
        if isinstance(model, Transformer) and not model.compiled_step:
            self._warm_up()  # (a compiled step compiles per batch and tree size as they come)
        # seconds the engine took to start: the CPU decode path's set-up, the drafter's, the
        # adaptive cost model, a warm-up forward (reported with every run's stats, never in a
        # request's latency)
        self.startup_s = time.perf_counter() - start
        self._greedy_uniforms: dict[tuple[int, int], torch.Tensor] = {}  # _sample's, read-only
        self._ids = itertools.count()

    @torch.inference_mode()
    def _warm_up(self, prompt_len: int = 8) -> None:
        """A short prompt's prefill and one plain verify step in slot 0, then the slot is
        emptied again: the one-time costs of a first forward (kernels' first calls, allocator
        growth) are paid at start-up, not by the first request's time to first token."""
        slot = torch.zeros(1, dtype=torch.long, device=self.device)
        n = max(1, min(prompt_len, self.capacity))  # the step's node goes in the tree slack
        tokens = torch.zeros(n, dtype=torch.long, device=self.device)
        self.model.prefill([tokens], self.cache, slot)
        parents = torch.full((1, 1), -1, dtype=torch.int32, device=self.device)
        num_nodes = torch.ones(1, dtype=torch.int32, device=self.device)
        mask, depth = ops.build_tree_mask(parents, num_nodes)
        self.model(tokens[None, :1], self.cache, slot, num_nodes, mask, depth)
        self.cache.cache_lens[slot] = 0

    def _check_memory(self, batch_size, block_size, cache_len, head_len, T):
        """InvalidRequestError when the caches plus one step's logits cannot fit in the memory
        left on the device (before allocating them: a huge batch_size would swap or be killed)."""
        a, itemsize = self.model.args, self.model.tok_embeddings.weight.element_size()
        blocks = -(-cache_len // block_size) * a.n_layers + -(-head_len // block_size)
        per_position = 2 * a.n_kv_heads * a.head_dim * itemsize  # k and v
        need = batch_size * per_position * block_size * blocks
        need += (
            2 * batch_size * T * a.vocab_size * 4
        )  # the verify logits, float32, and the sampler's copy
        free = free_memory(self.device)
        if free is not None and need > free:
            raise InvalidRequestError(
                f"batch_size {batch_size} needs about {need / 2**30:.1f} GiB for its KV caches "
                f"({cache_len} positions per request) and logits, more than the "
                f"{free / 2**30:.1f} GiB "
                f"free on {self.device}: lower batch_size or max_seq_len"
            )

    # ------------------------------------------------------------------ public API
    def generate(
        self,
        requests: Iterable[Request | Sequence[int]],
        progress: Callable[[Result], None] | None = None,
    ) -> tuple[list[Result], Stats]:
        """Runs every request to completion -> (list[Result] in input order, aggregate Stats).
        progress: optional callable(result) invoked as each request finishes (for an invalid
        request: at the start, before any work).

        The model's and the drafter's modules are checked for changes (weights, parameters,
        eps, flags) at the first step and after each progress call, not at every step
        (specdec.cpu.modules_unchanged): change them from progress (a change another thread makes
        meanwhile shows from the next generate call on). step() and stream() check every step."""
        with modules_unchanged(self.model, *self.drafter.modules()) as unchanged:
            run = self.stream(
                requests, on_finish=None if progress is None else unchanged.recheck_after(progress)
            )
            for _ in run:
                pass
        return run.results, run.stats

    def stream(
        self,
        requests: Iterable[Request | Sequence[int]],
        on_finish: Callable[[Result], None] | None = None,
    ) -> "Run":
        """An iterator of (request_id, new_token_ids) as tokens are accepted; once it is
        exhausted, .results and .stats hold the outputs. A loop over step() (requests the
        engine was already serving, e.g. submit()ted ones, advance with these).

        Requests are validated here, all of them: an invalid one finishes at once with
        finish_reason "error" (its Result's .error says why) and the others run; when no
        request is valid, InvalidRequestError names every problem. A request that fails while
        it runs (e.g. NaN logits) also finishes alone with finish_reason "error"."""
        reqs = [r if isinstance(r, Request) else Request(list(r)) for r in requests]
        rejected = {}
        for i, r in enumerate(reqs):
            if r.id is None:
                r.id = i
            try:
                self.validate(r)
            except InvalidRequestError as e:
                rejected[i] = str(e)
        if reqs and len(rejected) == len(reqs):
            raise InvalidRequestError(join_errors(list(rejected.values())))
        return Run(self, reqs, on_finish, rejected)

    # ------------------------------------------------------------------ online API
    def submit(
        self, request: Request | Sequence[int], on_finish: Callable[[Result], None] | None = None
    ) -> "RequestHandle":
        """Queues one request, at any time (between steps) -> its RequestHandle. It takes a
        slot at the next step() that finds one free (continuous batching: up to batch_size
        requests decode together, the others wait in arrival order). Its time to first token
        counts from now.

        request.id None: a fresh integer id (unique among the requests in flight). An invalid
        request raises InvalidRequestError here (nothing is queued), as does an id that a
        request still in flight has (step() reports tokens by id). on_finish: optional
        callable(result) when it finishes. A request that fails while it runs (e.g. NaN
        logits) finishes alone with finish_reason "error"."""
        req = request if isinstance(request, Request) else Request(list(request))
        in_flight = {s.req.id for s in self._queue} | {s.req.id for s in self._active}
        if req.id is None:
            req.id = next(i for i in self._ids if i not in in_flight)
        elif req.id in in_flight:
            raise InvalidRequestError(
                f"request {req.id!r}: a request with this id is still in flight"
            )
        self.validate(req)
        return self._enqueue(req, time.perf_counter(), on_finish)

    def step(self) -> dict:
        """Advances the engine by one step -> {request_id: [token ids it gained]}.

        Queued requests take the free slots (their prompt forward and first token), then
        every active request gets one speculative (or plain) step; requests that finish (EOS,
        max tokens, stop string, full cache, error) leave and free their slots. Requests that
        finished in this step are included with their last tokens (a request that gained no
        token is absent). Nothing queued or active: {} at no cost. A request's greedy output
        does not depend on when it was submitted or which requests shared its steps; sampled
        output is reproducible from its seed for a fixed tree shape (in adaptive mode the tree
        size follows the batch)."""
        return _by_request(self._advance())

    def admit(self) -> dict:
        """The first half of step() on its own -> {request_id: [its first token]}: queued
        requests take the free slots (prompt forward, first token) and nothing else runs. A
        server calls it before step() to send first tokens without waiting for the verify
        round of the whole batch (docs/serving.md, Results); step() then finds them admitted.
        Requests that finished with their first token are included, as in step()."""
        events: list[tuple[_Seq, list[int]]] = []
        self._admit(events)
        return _by_request(events)

    @contextmanager
    def timing(self) -> Iterator[Stats]:
        """`with engine.timing() as t:` -> a Stats whose time_s collects the time split
        (prefill / draft / verify / sample / compact seconds) of every step run inside the
        block, whoever runs them (step(), generate(), stream()); each batched step counts once."""
        timer = Stats(num_requests=0)
        self._timers.append(timer)
        try:
            yield timer
        finally:
            self._timers.remove(timer)

    @property
    def num_active(self) -> int:
        """Requests holding a slot (decoding)."""
        return len(self._active)

    @property
    def num_queued(self) -> int:
        """Submitted requests waiting for a slot."""
        return len(self._queue)

    @property
    def has_work(self) -> bool:
        """Whether step() would do anything."""
        return bool(self._queue or self._active)

    def validate(self, req: Request) -> None:
        """InvalidRequestError (message prefixed with the request's id) if the engine cannot
        serve req."""
        if not isinstance(req.params, SamplingParams):
            raise InvalidRequestError(
                f"request {req.id!r}: params must be a SamplingParams, got {req.params!r}"
            )
        try:
            req.params.validate()
        except InvalidRequestError as e:
            raise InvalidRequestError(f"request {req.id!r}: {e}") from None
        try:
            n = len(req.prompt_ids)
            for t in req.prompt_ids:
                operator.index(t)  # ints (Python, numpy, integer tensors); not floats or strings
        except TypeError:
            raise InvalidRequestError(
                f"request {req.id!r}: prompt_ids must be a list of integer token ids, "
                f"got {req.prompt_ids!r:.80}"
            ) from None
        V = self.model.args.vocab_size
        if n == 0:
            raise InvalidRequestError(f"request {req.id!r}: empty prompt")
        if n > self.capacity:
            why = (
                ""
                if self.capacity >= self.max_seq_len
                else (
                    f": the model's context of {self.model.args.max_position_embeddings} "
                    f"positions less "
                    f"{self.tree_slack} for the verified tree"
                )
            )
            raise InvalidRequestError(
                f"request {req.id!r}: prompt of {n} tokens is longer than the "
                f"cache ({self.capacity} positions per request{why})"
            )
        if min(req.prompt_ids) < 0 or max(req.prompt_ids) >= V:
            raise InvalidRequestError(f"request {req.id!r}: prompt token ids must be in [0, {V})")
        if req.params.stop and self.tokenizer is None:
            raise InvalidRequestError(f"request {req.id!r}: stop strings need a tokenizer")

    # ------------------------------------------------------------------ the online core
    def _enqueue(self, req: Request, arrival: float, on_finish=None, owner=None) -> "RequestHandle":
        """Queues a validated request (its generator seeded now: seed None draws one from
        torch's global RNG)."""
        seed = req.params.seed
        if seed is None:
            seed = int(torch.randint(0, 2**62, ()))
        gen = torch.Generator(self.device).manual_seed(seed)
        s = _Seq(req, -1, gen, Stats(), arrival, on_finish=on_finish, owner=owner)
        s.handle = RequestHandle(self, s)
        self._queue.append(s)
        return s.handle

    def _admit(self, events: list) -> None:
        """Queued requests take the free slots: prompt forward and first token (appended to
        events); requests finished by their first token leave again."""
        if not (self._free and self._queue):
            return
        timers = list(self._timers)
        with torch.inference_mode():
            new = []
            while self._free and self._queue:
                s = self._queue.popleft()
                s.slot = heapq.heappop(self._free)  # the lowest free slot
                new.append(s)
            first = self._prefill(new, timers + [s.stats for s in new])
            for s, tok in zip(new, first.tolist()):
                s.first_token_time = time.perf_counter()
                if s.error is None:
                    self._emit(s, [tok], events)
            self._active += new
            self._retire()

    def _advance(self) -> list:
        """One engine step -> [(seq, tokens it gained)] in order (a request appears at most
        twice: its first token, then its first verify step)."""
        events: list[tuple[_Seq, list[int]]] = []
        if not self.has_work:
            return events
        self._admit(events)  # retires requests finished by their first token
        timers = list(self._timers)
        with torch.inference_mode():
            if self._active:
                active = self._active
                out_tokens, num_accepted = self._verify_step(
                    active, timers + [s.stats for s in active]
                )
                for s, toks, a in zip(active, out_tokens.tolist(), num_accepted.tolist()):
                    if s.error is None:
                        self._emit(s, toks[: a + 1], events)
                self._retire()
        return events

    def _emit(self, s: _Seq, new_tokens: list, events: list):
        """Appends accepted tokens up to EOS / max tokens / a stop string; records what was kept."""
        p = s.req.params
        kept = []
        for tok in new_tokens:
            s.tokens.append(tok)
            kept.append(tok)
            if not p.ignore_eos and tok in self.eos_token_ids:
                s.finish_reason = "eos"
            elif p.stop and self._hit_stop(s):
                s.finish_reason = "stop"
            elif len(s.tokens) >= p.max_new_tokens:
                s.finish_reason = "length"
            if s.finish_reason:
                break
        s.stats.generated_tokens += len(kept)
        if s.finish_reason is None and len(s.req.prompt_ids) + len(s.tokens) > self.capacity:
            s.finish_reason = "length"  # no cache position left for the next root token
        if kept:
            events.append((s, kept))

    def _hit_stop(self, s: _Seq) -> bool:
        assert self.tokenizer is not None  # validate() rejects stop strings without one
        text = self.tokenizer.decode(s.tokens)
        cuts = [text.find(stop) for stop in s.req.params.stop if stop in text]
        if cuts:
            s.text = text[: min(cuts)]
        return bool(cuts)

    def _retire(self):
        """Finished requests leave the batch (their slots go back to the free list)."""
        still = []
        for s in self._active:
            if s.finish_reason is None:
                still.append(s)
                continue
            heapq.heappush(self._free, s.slot)
            self._finish(s)
        self._active = still

    def _finish(self, s: _Seq):
        s.stats.finish(s.arrival, s.first_token_time, time.perf_counter())
        if s.text is None and self.tokenizer is not None and (s.tokens or s.error is None):
            s.text = self.tokenizer.decode(s.tokens)
        try:
            prompt_ids = list(s.req.prompt_ids)
        except TypeError:  # a rejected request's
            prompt_ids = []
        result = Result(
            s.req.id,
            s.req.prompt,
            prompt_ids,
            list(s.tokens),
            s.text,
            s.finish_reason or "error",  # set before a sequence finishes
            s.stats,
            s.error,
        )
        if s.handle is not None:
            s.handle.result = result
        if s.on_finish is not None:
            s.on_finish(result)

    def _cancel(self, s: _Seq) -> bool:
        """Removes an unfinished request from the queue or the batch (its slot freed)."""
        if s in self._queue:
            self._queue.remove(s)
        elif any(a is s for a in self._active):
            self._active = [a for a in self._active if a is not s]
            heapq.heappush(self._free, s.slot)
        else:
            return False
        s.finish_reason = "cancelled"
        return True

    # ------------------------------------------------------------------ one batch step
    def _prefill(self, seqs: list[_Seq], all_stats: list[Stats]) -> torch.Tensor:
        """Prompt forward of newly admitted requests, first token on a one-node tree, and
        the drafter's start. Returns the first tokens (long [B])."""
        slots = self._slots(seqs)
        prompts = [
            torch.tensor([int(t) for t in s.req.prompt_ids], dtype=torch.long, device=self.device)
            for s in seqs
        ]
        with timed(self.device, "prefill", all_stats):
            out = self.model.prefill(prompts, self.cache, slots, self.feature_layers)
            B = len(seqs)
            root = root_only(torch.zeros(B, dtype=torch.long, device=self.device))
            _, _, first = self._sample(self._sampling(seqs), out.logits[:, None], root, seqs)
            first = first[:, 0].long()
            if self.policy is not None:  # the slots' per-request statistics start over
                self.policy.start(slots.tolist())
            self.drafter.start(
                slots, prompts, first, out.hidden, out.aux, [s.error is None for s in seqs]
            )
        return first

    def _verify_step(
        self, seqs: list[_Seq], all_stats: list[Stats]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One draft / verify / accept round. Returns (output_tokens int32 [B, T] -1 padded,
        num_accepted int32 [B])."""
        start = time.perf_counter()
        slots = self._slots(seqs)
        roots = torch.tensor([s.tokens[-1] for s in seqs], device=self.device)
        room = self.capacity - self.cache.cache_lens[slots]
        sampling = self._sampling(seqs)
        speculative = True
        with timed(self.device, "draft", all_stats):
            if self.policy is not None:
                self.policy.new_step([s.slot for s in seqs])
                speculative = self.policy.speculate()
            if not speculative:
                d = root_only(roots)
            else:
                d = self.drafter.propose(slots, roots, sampling, self.policy)
            # (a host check on CPU, ~5 us, against ~50 us of masking when every tree fits)
            if self.device.type != "cpu" or int(room.min()) < d.tokens.shape[1]:
                d = d.truncate(room)
        with timed(self.device, "verify", all_stats):
            tree_mask, depth = ops.build_tree_mask(d.parents, d.num_nodes)
            out = self.model(
                d.tokens, self.cache, slots, d.num_nodes, tree_mask, depth, self.feature_layers
            )
        with timed(self.device, "sample", all_stats):
            accepted_nodes, num_accepted, output_tokens = self._sample(
                sampling, out.logits, d, seqs
            )
            ok = [b for b, s in enumerate(seqs) if s.error is None]
            if d.confidence is not None and self.policy is not None and ok:
                if len(ok) < len(seqs):  # learn from the requests that sampled
                    rows = torch.tensor(ok, device=self.device)
                    self.policy.observe(
                        Proposal(
                            d.tokens[rows],
                            d.parents[rows],
                            d.num_nodes[rows],
                            None,
                            d.confidence[rows],
                        ),
                        depth[rows],
                        accepted_nodes[rows],
                        num_accepted[rows],
                        [seqs[b].slot for b in ok],
                    )
                else:
                    self.policy.observe(
                        d, depth, accepted_nodes, num_accepted, [s.slot for s in seqs]
                    )
        with timed(self.device, "compact", all_stats):
            if d.tokens.shape[1] > 1:  # a root-only step's K / V are already in place
                ops.compact_kv(
                    self.cache.k,
                    self.cache.v,
                    self.cache.block_table[slots],
                    self.cache.cache_lens[slots],
                    accepted_nodes,
                    num_accepted,
                )
            self.cache.cache_lens[slots] += num_accepted + 1
        with timed(self.device, "draft", all_stats):
            self.drafter.commit(
                slots,
                d,
                StepResult(
                    accepted_nodes,
                    num_accepted,
                    output_tokens,
                    out.hidden,
                    out.aux,
                    [s.error is None for s in seqs],
                ),
            )
        tree_depth = depth.max(dim=1).values.tolist()
        for s, a, n, dep in zip(seqs, num_accepted.tolist(), d.num_nodes.tolist(), tree_depth):
            if s.error is None:
                s.stats.record_step(a, n, dep)
        if self.policy is not None and self.calibrate:  # the step's cost against the prediction
            nodes = self.policy.step_nodes(d.num_nodes, d.tokens.shape[1])
            seconds = time.perf_counter() - start
            # tensor parallel: every rank decides alike
            seconds = tensor_parallel.agree_time(seconds, self.device)
            self.policy.observe_time(seconds, speculative, self.policy.levels, nodes)
        return output_tokens, num_accepted

    # ------------------------------------------------------------------ helpers
    def _slots(self, seqs):
        return torch.tensor([s.slot for s in seqs], dtype=torch.long, device=self.device)

    def _sampling(self, seqs) -> BatchSampling:
        p = [s.req.params for s in seqs]
        return BatchSampling(
            temperature=torch.tensor(
                [x.temperature for x in p], dtype=torch.float32, device=self.device
            ),
            top_k=torch.tensor([x.top_k for x in p], dtype=torch.int32, device=self.device),
            top_p=torch.tensor([x.top_p for x in p], dtype=torch.float32, device=self.device),
            generators=[s.generator for s in seqs],
            random=any(x.temperature > 0 for x in p),
        )

    def _sample(self, sp: BatchSampling, logits, d, seqs):
        """tree_rejection_sample with each request's parameters and its own uniforms.

        Should it raise (on CPU: NaN / inf logits, out-of-range draft tokens), each row is
        sampled alone, with the same uniforms, to find the culprits: those requests get
        .finish_reason "error" and an inert row (root accepted, no token); the others get
        exactly what the batched call would have given them."""
        B, T = logits.shape[:2]
        if sp.random:
            uniforms = ops.make_uniforms(B, T, self.device, sp.generators)
        else:  # greedy rows never read their uniforms: no draws (~60 us a step on CPU)
            if (B, T) not in self._greedy_uniforms:
                self._greedy_uniforms[(B, T)] = torch.zeros(B, T + 1, device=self.device)
            uniforms = self._greedy_uniforms[(B, T)]
        args = (
            logits,
            d.tokens,
            d.parents,
            d.num_nodes,
            d.draft_probs,
            sp.temperature,
            sp.top_k,
            sp.top_p,
            uniforms,
        )
        sample = self.sampler or ops.tree_rejection_sample
        try:
            return sample(*args)
        except (RuntimeError, ValueError):
            rows: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None] = []
            failed: dict[int, str] = {}
            for b in range(len(seqs)):
                try:
                    row_args = [a if a is None else a[b : b + 1] for a in args]
                    rows.append(sample(*row_args))  # type: ignore[arg-type]
                except (RuntimeError, ValueError) as e:
                    failed[b] = str(e).strip().splitlines()[0]
                    rows.append(None)
            if not failed:
                raise  # not a per-request problem: the batched call's error
        for b, msg in failed.items():
            seqs[b].finish_reason = "error"
            seqs[b].error = f"request {seqs[b].req.id!r}: sampling failed: {msg}"
            inert = torch.full((1, T), -1, dtype=torch.int32, device=self.device)
            inert[0, 0] = 0
            rows[b] = (
                inert,
                torch.zeros(1, dtype=torch.int32, device=self.device),
                inert.new_full((1, T), -1),
            )
        return tuple(torch.cat(parts) for parts in zip(*rows))


def _by_request(events: list) -> dict:
    """[(seq, tokens)] in order -> {request_id: [tokens]} (a request may appear twice)."""
    gained: dict[object, list[int]] = {}
    for s, tokens in events:
        gained.setdefault(s.req.id, []).extend(tokens)
    return gained


def join_errors(messages: list, limit: int = 3) -> str:
    """One line for several per-request errors."""
    if len(messages) == 1:
        return messages[0]
    more = f"; and {len(messages) - limit} more" if len(messages) > limit else ""
    return f"no valid request ({len(messages)} invalid): " + "; ".join(messages[:limit]) + more


class Run:
    """One generate()/stream() call: a loop over the engine's steps until its requests are
    done. rejected: {index: message} of the requests that failed validation (finished first).
    Closing it early (or dropping it) cancels its unfinished requests."""

    def __init__(self, engine: Engine, requests: list, on_finish=None, rejected=None):
        self.engine, self.on_finish = engine, on_finish
        self.rejected = dict(rejected or {})
        self.requests = list(requests)
        self.results: list[Result] = [None] * len(requests)  # type: ignore[list-item]  # filled as requests finish
        self.per_request = [None] * len(requests)
        self.engine_stats = Stats(num_requests=len(requests))  # run-level time split
        self.stats: Stats = None  # type: ignore[assignment]  # the aggregate, once the run is exhausted
        self._events = self._loop()

    def __iter__(self):
        return self

    def __next__(self):
        return next(self._events)

    def close(self):
        self._events.close()

    def _done(self, index, result, ran=True):
        self.results[index] = result
        self.per_request[index] = result.stats if ran else None  # the aggregate: requests that ran
        if self.on_finish is not None:
            self.on_finish(result)

    def _loop(self):
        eng = self.engine
        start = time.perf_counter()
        for index, message in sorted(self.rejected.items()):  # reported together, before any work
            s = _Seq(
                self.requests[index],
                -1,
                None,
                Stats(),
                start,
                start,
                finish_reason="error",
                error=message,
                on_finish=lambda r, i=index: self._done(i, r, ran=False),
            )
            eng._finish(s)
        mine = [
            eng._enqueue(r, start, lambda res, i=i: self._done(i, res), owner=self)
            for i, r in enumerate(self.requests)
            if i not in self.rejected
        ]
        eng._timers.append(self.engine_stats)
        try:
            while not all(h.done for h in mine):
                for s, tokens in eng._advance():
                    if s.owner is self:
                        yield s.req.id, tokens
        finally:
            eng._timers.remove(self.engine_stats)
            for h in mine:
                if not h.done:
                    eng._cancel(h._seq)
        ran = [s for s in self.per_request if s is not None]
        self.stats = Stats.aggregate(ran, self.engine_stats.time_s, time.perf_counter() - start)
        self.stats.startup_s = eng.startup_s
