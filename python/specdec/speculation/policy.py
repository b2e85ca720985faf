"""Adaptive speculation: size each step's draft tree by what it is expected to earn on the
machine at hand, and decode plainly when speculation does not pay.

Cost (`CostModel`, measured once when the engine starts): seconds of a target verify forward
as a function of the tree size T, and seconds of drafting as a function of the number of draft
levels (the head over the frontier, its logits, top-k), at a few batch sizes (1 and the
engine's batch_size, a middle one for large batches). Every choice below uses the costs at the
step's live occupancy (the requests in the batch, `Policy.batch`, interpolated between the
measured batch sizes): under load, when a bigger tree costs more than its drafts earn, the trees
shrink and the steps go plain by themselves.

Value (`Policy`, running): as EAGLE-2 observed, a draft node's confidence (the head's
probability of its token) tracks its chance of being accepted. Per draft depth and band of
confidence (CONFIDENCE_EDGES) we keep the ratio of accepted nodes to the summed confidence of
the nodes the walk tried (both decayed, so the ratio follows the workload) and predict
    P(node accepted) = P(parent accepted) * min(1, ratio[depth, band] * confidence(node)).
Low-confidence (high-entropy) drafts thus get small trees, an over-confident head (high
temperature, an untrained head) gets its ratio pulled down by what is actually accepted. The
bands matter: a head trained on the target's distribution under-states its top candidate and
over-states the runners-up (Zen 3, MT-bench, greedy: one ratio per depth of 1.27 valued a
second child at 1.27x its confidence, so adaptive mode verified three children of the root
where one paid best; docs/adaptive.md).

Each step, with E = 1 + sum of P over the kept nodes (expected tokens per target forward):
 1. plain or speculative: when the recent speculative rate (the recent steps' mean tokens
    per predicted second of their mean tree at the live occupancy), even at its upper
    confidence bound (few steps: a wide one; the steps' weight decays with every step,
    plain ones too, so the bound widens again while speculation goes untried), is below
    plain decoding's 1 / verify(1), the step is plain (no drafting at all); a probe
    step every `probe` plain steps keeps the statistics fresh, and the probe interval doubles
    (up to MAX_PROBE) while probes lose;
 2. depth and width: another draft level is drafted only while it raises E / time, and it
    expands the w best frontier nodes for the w that pays best (expand_width): each expanded
    node is worth its best child, valued from the recent best children's confidence at that
    depth and frontier rank, against the level's cost at that width (the cost model times
    levels TOPK nodes wide and one node wide; a level's cost is linear in between);
 3. size: the N most likely nodes maximizing E / (draft time + verify(N + 1)) are verified.
    Per request (the default, `per_request`): the target's verify forward computes only the
    real nodes of each tree (model.Transformer.forward packs them), so a step costs about
    verify(mean tree size) and the best trees are the M most likely nodes of the whole
    batch (one ranking over every request's candidates, M maximizing the batch's expected
    tokens per second): a confident request gets a big tree, an unsure one a small tree or
    the root alone (a plain step for it inside the same forward). The shared per-depth
    statistics cannot tell requests apart when their drafts look alike (n-gram lookups are
    as "sure" in free text as in copied text), so each request also keeps its own record,
    accepted drafts over predicted ones (decayed, reset when its slot is reused), which
    scales its values (Policy.request_factor). `per_request = False`: one size N for every
    request, from the batch-mean values (the earlier rule, without the records).
Calibration (`Policy.observe_time`): the cost model times the target forward and the drafter
alone, once, at start-up; a real step also samples, moves the KV, runs the drafter's
bookkeeping and this policy, and a speculative step's forward over ragged per-request trees is
not the start-up's uniform one. The engine reports each step's wall time; per kind (plain,
speculative) the policy keeps the decayed ratio of measured to predicted seconds and prices
rule 1 with it. Without it, at batch 16-64 on a CPU, where a plain step is compute-bound and
speculation is near break-even by the cost model, adaptive mode lost 8-11% to plain decoding.
The ratios are kept per occupancy bucket (1, 2-3, 4-7, 8-15, ...; the kind's ratio over every
bucket is the prior of a bucket with little evidence of its own): how far an engine's step is
from the cost model changes with the batch (inside vLLM, a plain step at batch 1 took 1.2-1.3x
the cost model's, at batch 8 0.83-0.85x; priced at batch 1's ratio, plain lost to speculation
at 8 by a margin it did not have, and 8 requests at once ran 0.89x plain). A kind that never
runs at a bucket is never measured there, so while speculation wins by less than
MEASURE_MARGIN at a bucket whose plain steps are unmeasured or stale (REMEASURE_STEPS), the
step is plain: it measures what speculation is judged against.
Rules 2 and 3 compare speculative steps with each other, so one factor does not change them;
but they weigh draft levels against verify sizes, and a level run in a step (after the target
forward has swept the caches) is slower than the start-up loop timed it: on CPU the drafter's
levels are timed as they run (Policy.observe_level) and their decayed measured / predicted
ratio scales the levels' costs (draft_cost).

Every step is an ordinary speculative step (exact for any tree), so the outputs follow the
target exactly; only the speed depends on these choices.
"""

import functools

import numpy as np
import torch

from specdec.models.tensor_parallel import agree_time
from specdec.speculation.cost_model import CostModel

DECAY = 0.97  # per step: the statistics cover roughly the last 30 steps
PRIOR = 2.0  # pseudo-count of confidence behind the initial ratio 1 (trust the head at first)
# the confidence bands of the ratios: [0, 0.05), [0.05, 0.15), ..., [0.65, 1]
CONFIDENCE_EDGES = np.array([0.05, 0.15, 0.35, 0.65])
NUM_BANDS = len(CONFIDENCE_EDGES) + 1
MIN_PROBE, MAX_PROBE = 4, 64
# plain or speculative: speculation's recent tokens per step are a mean over few, noisy steps
# (a step accepts 0 or 1+ drafts); the decision uses its upper confidence bound, mean +
# UCB_Z standard errors, so a few unlucky first steps cannot price speculation out for good
# (only evidence can). The variance has a prior of TOKENS_VAR_PRIOR (a coin flip between 0
# and 1 accepted drafts) behind one pseudo-step, so one step alone is not taken as certain;
# a step's tokens are a mean over its requests, so at occupancy B the prior is
# TOKENS_VAR_PRIOR / B (with 0.25 at every occupancy, the bound at 32 requests stayed ~15%
# wide while the evidence aged, and 14% of the steps there speculated where it lost;
# docs/adaptive.md "Plain or speculative").
UCB_Z, TOKENS_VAR_PRIOR = 1.0, 0.25
# per request: pseudo-count of expected acceptances behind its factor 1 (a new request is
# trusted to behave as the shared statistics predict)
REQUEST_PRIOR = 1.0
# calibration: pseudo-steps of measured = predicted behind each kind's factor 1, and the range
# one step's ratio is clipped to (a step that waited on something else, e.g. the first call
# of a kernel, must not price its kind out for good)
CALIBRATION_PRIOR, CALIBRATION_CLIP = 4.0, (0.5, 2.0)
# per occupancy bucket: pseudo-steps of the kind's overall ratio behind a bucket's own ratio;
# a plain step is run to measure a bucket's plain cost while it has fewer than MIN_MEASURED
# (decayed) plain steps, or none in its last REMEASURE_STEPS steps, and speculation is
# judged to win there by less than MEASURE_MARGIN (a margin no wrong price inside the clip's
# usual range would overturn): ~1 plain step in 128 where speculation is close to plain
BUCKET_PRIOR, MIN_MEASURED, REMEASURE_STEPS, MEASURE_MARGIN = 0.25, 2.5, 128, 2.0
# draft levels in the steps against the cost model's (Policy.observe_level): one level's ratio
# is clipped wider than a step's, cold caches more than double a small level's time
LEVEL_CLIP = (0.25, 4.0)


class Policy:
    """The per-engine adaptive state. The statistics (acceptance per depth, recent rates) are
    shared by every request; the tree sizes are chosen per request (`sizes`), or one for the
    whole batch step when per_request is False."""

    def __init__(self, cost: CostModel, spec, per_request: bool = True, calibrate: bool = True):
        self.cost, self.spec, self.per_request = cost, spec, per_request
        # calibrate: the draft levels' times in the steps scale their costs (observe_level);
        # False keeps the choices a function of the cost model and the acceptance alone
        # (reproducible: the engine's cost model passed in; the engine also skips
        # observe_time then)
        self.calibrate = calibrate
        # the policy's statistics and arithmetic live on the host, in numpy: a step's few
        # dozen operations on [B, C] values cost ~1 us each there against ~5-10 us as torch
        # calls (~0.9 ms a step at batch 1, 6% of a CPU step); the tensors it reads come over
        # in one transfer per call
        # [depth, band]: decayed accepted counts and summed confidence of the tried nodes
        self.accepted = np.full((spec.depth, NUM_BANDS), PRIOR)
        self.confidence = np.full((spec.depth, NUM_BANDS), PRIOR)
        # per depth and rank in the frontier, decayed: the summed confidence of an expanded
        # node's best child and the count of expansions behind it (PRIOR pseudo-counts of
        # confidence 1: at first a level is priced at its best case)
        self.best_child = np.full((2, spec.depth, spec.topk), PRIOR)
        # decayed sums over speculative steps: steps, tokens per request, draft levels, nodes
        self.spec_steps = self.spec_tokens = self.spec_levels = self.spec_nodes = 0.0
        self.spec_tokens_sq = 0.0  # decayed sum of squared tokens per step (their spread)
        self.plain_streak, self.probe = 0, MIN_PROBE
        self.levels = 0  # draft levels of the current step
        self.batch = (
            cost.batch_size
        )  # live occupancy: the requests in this step (set by the engine)
        # per request (engine slot): decayed accepted drafts and what the shared statistics
        # predicted for them; their ratio scales the request's values in sizes(), so a request
        # whose drafts fail more (or less) often than their confidence says gets smaller
        # (larger) trees. slots: the requests of this step's rows (set by the engine).
        self.request_stats: dict[int, list[float]] = {}
        self.slots: list | None = None
        # calibration per kind (False: plain, True: speculative): the decayed sum of its
        # steps' measured / predicted seconds and their decayed count, each with
        # CALIBRATION_PRIOR pseudo-steps at 1; the mean scales the kind's costs in rule 1
        self.step_ratios = {kind: [CALIBRATION_PRIOR, CALIBRATION_PRIOR] for kind in (False, True)}
        # the same per (kind, occupancy bucket), without the prior (calibration() adds the
        # kind's overall ratio; empty while no step time was reported, and an engine that
        # reports none gets no measuring steps); per bucket, the steps observed there since
        # its last plain one
        self.bucket_ratios: dict[tuple[bool, int], list[float]] = {}
        self.plain_age: dict[int, int] = {}
        self.level_ratios = [CALIBRATION_PRIOR, CALIBRATION_PRIOR]  # the same for draft levels
        # per batch size, from the cost model: verify(1 .. TOTAL) and the draft levels' costs
        self._curves: dict[int, tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]] = {}
        self._curves_of: CostModel | None = None
        # the widths this step's levels past the first were drafted at (expand_width)
        self.widths: list[int] = []
        # batch 1: (levels, the values, n) when expand_width last chose to stop: its "stop
        # here" option is what sizes() then computes for the same values (~0.1 ms a step)
        self._stopped: tuple[int, np.ndarray, int] | None = None

    def new_step(self, slots: list) -> None:
        """A step begins for the requests in these engine slots (its rows, in order): the
        costs are priced at its live occupancy, and nothing is drafted yet."""
        self.batch = len(slots)
        self.slots = slots
        self.levels = 0
        self.widths = []
        self._stopped = None

    # ------------------------------------------------------------------ 1. plain or not
    def calibration(self, speculative: bool) -> float:
        """Measured over predicted seconds of recent steps of this kind at the live
        occupancy's bucket, shrunk to the kind's ratio over every bucket (1: no evidence)."""
        ratios, steps = self.step_ratios[speculative]
        overall = ratios / steps
        own = self.bucket_ratios.get((speculative, _bucket(self.batch)))
        if own is None:
            return overall
        return (own[0] + BUCKET_PRIOR * overall) / (own[1] + BUCKET_PRIOR)

    def plain_unmeasured(self) -> bool:
        """Whether a plain step's cost at the live occupancy's bucket wants measuring: too
        few plain steps there, or none recently (only when step times are reported)."""
        if not self.bucket_ratios:
            return False
        bucket = _bucket(self.batch)
        own = self.bucket_ratios.get((False, bucket))
        return own is None or own[1] < MIN_MEASURED or self.plain_age[bucket] >= REMEASURE_STEPS

    def predicted_step_s(self, levels: float, nodes: float) -> float:
        """The cost model's seconds of a step at the live occupancy: `levels` draft levels
        (0: a plain step) and trees of `nodes` nodes per request (the root included)."""
        return self.cost.draft(levels, self.batch) + self.cost.verify(nodes, self.batch)

    def step_nodes(self, num_nodes: torch.Tensor | np.ndarray, T: int) -> float:
        """The tree size a step's verify cost is priced at: num_nodes int [B] of trees padded
        to T; per request the mean real size (the forward computes the real nodes only),
        else the padded T."""
        if not self.per_request:
            return float(T)
        sizes = num_nodes.tolist()
        return sum(sizes) / len(sizes)

    def observe_time(self, seconds: float, speculative: bool, levels: float, nodes: float) -> None:
        """A step took `seconds` (wall, the whole step: drafting to the KV commit); it was
        speculative or plain, with `levels` draft levels and trees of `nodes` nodes per
        request, mean."""
        predicted = self.predicted_step_s(levels, nodes)
        if not predicted > 0 or not seconds >= 0:
            return
        lo, hi = CALIBRATION_CLIP
        ratio = min(max(seconds / predicted, lo), hi)
        bucket = _bucket(self.batch)
        own = self.bucket_ratios.setdefault((speculative, bucket), [0.0, 0.0])
        for st in (self.step_ratios[speculative], own):
            st[0] = DECAY * st[0] + ratio
            st[1] = DECAY * st[1] + 1.0
        self.plain_age[bucket] = 0 if not speculative else self.plain_age.get(bucket, 0) + 1

    def plain_rate(self) -> float:
        """Tokens per second of a plain step at the live occupancy (calibrated)."""
        return 1.0 / (self.cost.verify(1, self.batch) * self.calibration(False))

    def spec_rate(self) -> float:
        """Recent speculative tokens per second at the live occupancy: the recent steps' mean
        tokens over the cost, at this batch, of their mean draft levels and tree size (what
        was accepted does not depend on the batch, what it cost does)."""
        if not self.spec_steps:
            return float("inf")
        n = self.spec_steps
        step_s = self.predicted_step_s(self.spec_levels / n, self.spec_nodes / n)
        return self.spec_tokens / n / (step_s * self.calibration(True))

    def spec_rate_bound(self) -> float:
        """spec_rate with the mean tokens per step raised by UCB_Z standard errors (their
        decayed spread, TOKENS_VAR_PRIOR / the live occupancy behind one pseudo-step): what
        speculation may still be earning given how few steps it was tried on."""
        if not self.spec_steps:
            return float("inf")
        n = self.spec_steps
        mean = self.spec_tokens / n
        var = max(self.spec_tokens_sq / n - mean * mean, 0.0)
        var = (n * var + TOKENS_VAR_PRIOR / max(self.batch, 1)) / (n + 1.0)
        return self.spec_rate() * (1.0 + UCB_Z * (var / n) ** 0.5 / mean)

    def speculate(self) -> bool:
        bound, plain = self.spec_rate_bound(), self.plain_rate()
        if bound >= plain:
            # (the dict lookups first: most steps have plain measured, no spec_rate again)
            if self.plain_unmeasured() and self.spec_rate() < MEASURE_MARGIN * plain:
                return False  # a measuring plain step (the streak and probes unchanged)
            self.plain_streak, self.probe = 0, MIN_PROBE
            return True
        # evidence ages with every step, plain ones too: the means stay, their weight
        # shrinks, so the bound widens while speculation goes untried and it is tried again
        # (the probes remain a floor on how often)
        self.spec_steps *= DECAY
        self.spec_tokens *= DECAY
        self.spec_tokens_sq *= DECAY
        self.spec_levels *= DECAY
        self.spec_nodes *= DECAY
        self.plain_streak += 1
        if self.plain_streak >= self.probe:
            self.plain_streak, self.probe = 0, min(2 * self.probe, MAX_PROBE)
            return True
        return False

    # ------------------------------------------------------------------ 2. and 3. tree shape
    def node_value(self, parent_value, logprob, depth: int, children: bool = False):
        """P(accepted) of new candidates: parent_value [B, K] or None (children of the root),
        logprob [B, K, C] / [B, C] (the head's log-probability of each child), depth >= 1.
        children: logprob [B, W, C] holds the C children of each of the W expanded nodes, in
        frontier order (grow_dynamic): each rank's best child's confidence is recorded for
        expand_width."""
        ratios = self.accepted[depth - 1] / self.confidence[depth - 1]  # [NUM_BANDS]
        conf = logprob.float().exp()
        if children:
            top = _host(conf.amax(-1).mean(0))  # [W]: by the expanded node's rank
            seen = self.best_child[:, depth - 1, : len(top)]
            seen *= DECAY
            seen[0] += top
            seen[1] += 1.0
        ratio = torch.from_numpy(ratios.astype(np.float32)).to(conf.device)
        local = (conf * ratio[_bands(conf)]).clamp(max=1.0)
        return local if parent_value is None else parent_value[..., None] * local

    def local_values(self, confidence, depth) -> np.ndarray:
        """node_value's P(accepted | parent accepted) on the host, in one call for nodes of
        any depths: confidence (floats) and depth (ints >= 1; past the statistics' depth, the
        deepest they have) of one shape -> float32 of that shape, computed as node_value does
        (float32 confidence times its band's float32 ratio, at most 1). For drafters that build
        their trees on the host (n-gram lookup, merged trees): a node_value call per node cost
        ~33 us, 14 of them a step for eagle+ngram (benchmarks/profile_step.py --part engine)."""
        conf = np.asarray(confidence, dtype=np.float32)
        ratio = self.ratio(np.minimum(np.asarray(depth, dtype=np.int64), self.spec.depth), conf)
        return np.minimum(ratio.astype(np.float32) * conf, np.float32(1.0))

    def ratio(self, depth, confidence) -> np.ndarray:
        """Accepted over predicted for draft nodes at `depth` >= 1 (an int, or ints of
        confidence's shape) of these confidences (any shape; the learnt calibration
        node_value applies)."""
        at = np.asarray(depth) - 1, _bands(confidence)
        return self.accepted[at] / self.confidence[at]

    def prefix_values(self, values) -> np.ndarray:
        """Candidate values [B, C] (tensor or array) -> [s_1, s_2, ...]: expected accepted
        drafts per request of the n most likely candidates. Batch-level: n per request, the
        batch mean (C entries). Per request: n over the whole batch, best first, divided by B
        (B * C' entries, C' = min(C, TOTAL - 1): entry M is the mean over requests when the
        batch keeps its M best nodes, about M / B per request)."""
        values = _descending(_host(values))
        if not self.per_request:
            return values.cumsum(1).sum(0) / values.shape[0]  # (np.mean's own overhead: ~8 us)
        return _batch_prefix(values[:, : self.spec.total - 1])

    def _curves_at(self, batch: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """(verify(T) at T = 1 .. TOTAL, draft(l), draft_narrow(l) at l = 1 .. DEPTH + 1,
        verify(T + 1) - verify(T) at T = 1 .. TOTAL (0 at TOTAL: nothing is larger)) at this
        batch, computed once per batch size (the cost model is fixed once measured)."""
        if self._curves_of is not self.cost:  # a new cost model: forget the old curves
            self._curves, self._curves_of = {}, self.cost
        curves = self._curves.get(batch)
        if curves is None:
            levels = range(1, self.spec.depth + 2)
            verify = np.array([self.cost.verify(T, batch) for T in range(1, self.spec.total + 1)])
            curves = self._curves[batch] = (
                verify,
                np.array([self.cost.draft(lv, batch) for lv in levels]),
                np.array([self.cost.draft_narrow(lv, batch) for lv in levels]),
                np.append(np.diff(verify), 0.0),
            )
        return curves

    def draft_cost(self, levels: int, widths: list | None = None) -> float:
        """Seconds of drafting `levels` levels at the live occupancy, level l >= 2 expanding
        widths[l - 2] frontier nodes (default: this step's, self.widths; TOPK where unknown):
        per level, linear in the width between its one-node and its TOPK-node cost, times
        what such levels were measured to take in the steps (observe_level)."""
        if levels < 1:
            return 0.0
        widths = self.widths if widths is None else widths
        K = self.spec.topk
        more = sum(
            self._level_s(lv, widths[lv - 2] if lv - 2 < len(widths) else K)
            for lv in range(2, levels + 1)
        )
        return float(self._curves_at(self.batch)[1][0] + more * self.level_factor())

    def _level_s(self, level: int, width: int) -> float:
        """The cost model's seconds of draft level `level` >= 2 at `width` nodes."""
        _, full, narrow, _ = self._curves_at(self.batch)
        wide = full[level - 1] - full[level - 2]
        one = min(narrow[level - 1] - narrow[level - 2], wide)
        K = self.spec.topk
        return wide if K <= 1 else one + (wide - one) * (min(width, K) - 1) / (K - 1)

    def level_factor(self) -> float:
        """Measured over predicted seconds of recent draft levels past the first (1: none)."""
        ratios, levels = self.level_ratios
        return ratios / levels

    def observe_level(self, seconds: float, levels: int, width: int, device=None) -> None:
        """Draft level `levels + 1`, `width` nodes wide, took `seconds` in a step
        (grow_dynamic times it on CPU): the start-up timing ran the levels in a loop, warm,
        while a step runs them after the target forward has swept the caches, so the
        decayed ratio of measured to predicted level seconds scales them (draft_cost).
        Under tensor parallelism every rank takes the same time (agree_time), so that the
        ranks keep choosing the same trees."""
        if not self.calibrate:
            return
        seconds = agree_time(seconds, device)
        predicted = self._level_s(levels + 1, width)
        if not predicted > 0 or not seconds >= 0:
            return
        lo, hi = LEVEL_CLIP
        st = self.level_ratios
        st[0] = DECAY * st[0] + min(max(seconds / predicted, lo), hi)
        st[1] = DECAY * st[1] + 1.0

    def best(
        self,
        sums,
        levels: int,
        extra_nodes: int = 0,
        gain: float = 0.0,
        rows: int = 1,
        widths: list | None = None,
    ) -> tuple[float, int]:
        """-> (rate, n): the best expected tokens per second over the n most likely
        candidates (sums from prefix_values), drafting `levels` levels (at `widths`, see
        draft_cost); gain (with extra_nodes more nodes per request) is the optimistic value
        of one more level. Per request (sums over the batch's `rows` requests) the n-th
        candidate adds 1 / rows node to the mean tree size, whose verify cost is interpolated
        between whole sizes (the forward computes the real nodes only). Ties go to the
        smallest n."""
        draft = np.array([self.draft_cost(levels, widths)])
        rates, ns = self._best_rates(sums, draft, np.array([extra_nodes]), np.array([gain]), rows)
        return float(rates[0]), int(ns[0])

    def _best_rates(
        self, sums, draft: np.ndarray, extra: np.ndarray, gain: np.ndarray, rows: int
    ) -> tuple[np.ndarray, np.ndarray]:
        """best() for several options at once: draft, extra, gain [O] -> (rate, n) [O]
        (one numpy pass: expand_width prices every width of a level)."""
        # verify(T) is piecewise linear between whole T (the measured sizes are whole), so
        # the mean sizes below interpolate exactly
        whole, _, _, slope = self._curves_at(self.batch)
        plain = 1.0 / (draft + whole[0])  # n = 0: the root alone
        step = 1.0 / rows if self.per_request else 1.0
        limit = len(sums) if self.per_request else min(len(sums), self.spec.total - 1)
        if limit < 1:
            return plain, np.zeros(len(draft), dtype=np.int64)
        n = np.arange(1, limit + 1)
        # drafts per request, mean: [O, limit]
        x = np.minimum(n[None] * step + extra[:, None], self.spec.total - 1)
        lo = x.astype(np.int64)
        verify = whole[lo] + slope[lo] * (x - lo)
        tokens = 1.0 + np.asarray(sums[:limit], dtype=np.float64)[None] + gain[:, None]
        rate = tokens / (draft[:, None] + verify)
        i = rate.argmax(1)  # the first of equal rates: the smallest tree
        top = rate.max(1)
        better = top > plain
        return np.where(better, top, plain), np.where(better, i + 1, 0)

    def expand_width(self, levels: int, values: torch.Tensor, frontier_values: torch.Tensor) -> int:
        """After `levels` draft levels with candidate values [B, C]: how many of the
        frontier's nodes (frontier_values [B, W], best first) one more level should expand,
        0 for none (drafting stops). Each width's worth: every expanded node's best child,
        valued as node_value values a child of the mean confidence of the recent best
        children at that depth and frontier rank, against the level's cost at that width
        (draft_cost); the width with the best expected rate wins, if it beats stopping.
        Records the choice in self.widths (this step's levels)."""
        del self.widths[max(levels - 1, 0) :]  # levels 2 .. `levels` of this step
        self._stopped = None
        if levels >= self.spec.depth:
            return 0
        host = _host(values)
        sums, rows = self.prefix_values(host), values.shape[0]
        widths = self.widths + [self.spec.topk] * (levels - 1 - len(self.widths))
        frontier = _host(frontier_values)  # [B, W]
        seen = self.best_child[:, levels, : frontier.shape[1]]
        mean = seen[0] / seen[1]  # [W]: a best child's confidence, by rank
        child = np.minimum(self.ratio(levels + 1, mean) * mean, 1.0)  # [W]: its value
        gains = (frontier * child).cumsum(1).sum(0) / rows  # [W]: the first w expanded
        # option 0: stop here; option w: one more level, w nodes wide, whose cost is linear
        # in w (draft_cost: priced at the two ends)
        options = np.arange(len(gains) + 1)
        now, factor = self.draft_cost(levels, widths), self.level_factor()
        one, wide = (now + self._level_s(levels + 1, w) * factor for w in (1, self.spec.topk))
        draft = one + (wide - one) * (options - 1) / max(self.spec.topk - 1, 1)
        draft[0] = now
        rates, ns = self._best_rates(sums, draft, options, np.concatenate(([0.0], gains)), rows)
        choice = int(rates.argmax())  # ties: the narrowest, stopping first
        if choice:
            self.widths[:] = widths + [choice]
        elif rows == 1 and self.per_request:
            self._stopped = (levels, host, int(ns[0]))
        return choice

    def expand(self, levels: int, values: torch.Tensor, frontier_values: torch.Tensor) -> bool:
        """After `levels` draft levels with candidate values [B, C]: is one more level worth it
        (at its best width, expand_width)?"""
        return self.expand_width(levels, values, frontier_values) > 0

    def size(self, values: torch.Tensor, levels: int) -> int:
        """One tree size for every request (the batch-level rule; B = 1: the same as sizes)."""
        self.levels = levels
        per_request, self.per_request = self.per_request, False
        try:
            return self.best(self.prefix_values(values), levels)[1]
        finally:
            self.per_request = per_request

    def start(self, slots) -> None:
        """New requests in slots (ints): their own statistics start over."""
        for s in slots:
            self.request_stats.pop(int(s), None)

    def request_factor(self, slot: int) -> float:
        """How much more often this request's drafts are accepted than predicted (1: as
        predicted, or no evidence yet)."""
        acc, expected = self.request_stats.get(slot, (0.0, 0.0))
        return (acc + REQUEST_PRIOR) / (expected + REQUEST_PRIOR)

    def sizes(self, values: torch.Tensor, levels: int) -> torch.Tensor:
        """Candidate values [B, C] (>= 0; padding 0) -> long [B]: how many candidates each
        request keeps (its most likely ones). Per request: the M best candidates of the
        whole batch, so rows keep different counts (0: the root alone); batch-level: size()
        for every row."""
        self.levels = levels
        B = values.shape[0]
        if not self.per_request:
            n = self.best(self.prefix_values(values), levels)[1]
            return torch.full((B,), n, dtype=torch.long, device=values.device)
        host = _host(values)
        stopped = self._stopped
        if B == 1 and stopped and stopped[0] == levels and np.array_equal(stopped[1], host):
            return torch.full((1,), stopped[2], dtype=torch.long, device=values.device)
        # each request's own record, against the others': a lone request's record would
        # count the shared statistics' own evidence twice (a few rejected drafts pushed its
        # values below what a 1-node tree needs, those steps verified nothing, and nothing
        # new was learnt)
        if self.slots is not None and len(self.slots) == B and B > 1:
            f = np.array([self.request_factor(s) for s in self.slots])
            host = np.minimum(host * f[:, None], 1.0)
        top = _descending(host)[:, : self.spec.total - 1]
        M = self.best(_batch_prefix(top), levels, rows=B)[1]
        if B == 1:
            return torch.full((1,), M, dtype=torch.long, device=values.device)
        # the M best of the batch; a stable sort takes, among equal values, a row's earlier
        # candidates first, so each row keeps a prefix of its own ranking
        pick = np.argsort(-top.ravel(), kind="stable")[:M]
        counts = np.zeros(top.size, dtype=np.int64)
        counts[pick] = 1
        return torch.from_numpy(counts.reshape(B, -1).sum(1)).to(values.device)

    # ------------------------------------------------------------------ learning
    def observe(self, d, depth, accepted_nodes, num_accepted, slots=None):
        """After a speculative step: d the Draft (with .confidence), depth [B, T] of its nodes,
        accepted_nodes / num_accepted from tree_rejection_sample (the counts are what the
        accepted paths say: only the paths are read); slots: the rows' requests (their own
        statistics, see request_factor)."""
        del num_accepted  # the path's length: one host transfer less
        B, T = d.tokens.shape
        # (a step at batch 1 pays ~5 us per numpy call here, after the forward swept the
        # caches: the int32 indices are used as they come, and the calls are few)
        parents = _host(d.parents)
        accepted = _host(accepted_nodes)
        num_nodes = _host(d.num_nodes)
        confidence = _host(d.confidence)
        node_depth = _host(depth)
        rows = np.arange(B)[:, None]
        on_path = np.zeros((B, T + 1), dtype=bool)
        on_path[rows, np.where(accepted >= 0, accepted, T)] = True
        on_path = on_path[:, :T]
        valid = (np.arange(T)[None] < num_nodes[:, None]) & (parents >= 0)
        tried = valid & on_path[rows, np.maximum(parents, 0)]
        tried_conf = confidence[tried]
        D = self.spec.depth
        # per depth (a tried node has a parent: depth >= 1), summed confidence and accepted
        # count of the tried nodes
        cell = (node_depth[tried] - 1) * NUM_BANDS + _bands(tried_conf)
        conf = np.bincount(cell, weights=tried_conf, minlength=D * NUM_BANDS)
        if conf.size > D * NUM_BANDS:
            deepest = int(node_depth[tried].max())
            raise IndexError(f"a draft node at depth {deepest} > the spec's {D}")
        acc = np.bincount(cell, weights=on_path[tried], minlength=D * NUM_BANDS)
        conf, acc = conf.reshape(D, NUM_BANDS), acc.reshape(D, NUM_BANDS)
        # per request: accepted vs predicted (before this update); a lone request has no
        # batch-mates to be told apart from, and sizes() uses the records only when B > 1
        if slots is not None and B > 1:
            ratio = self.ratio(np.maximum(node_depth, 1), confidence)  # (the root: any row)
            predicted = np.where(tried, np.minimum(ratio * confidence, 1.0), 0.0)
            hits = (on_path & tried).sum(1)
            for slot, a, e in zip(slots, hits.tolist(), predicted.sum(1).tolist()):
                st = self.request_stats.setdefault(int(slot), [0.0, 0.0])
                st[0], st[1] = DECAY * st[0] + a, DECAY * st[1] + e
        self.confidence = DECAY * self.confidence + conf
        self.accepted = DECAY * self.accepted + acc
        # keep the prior's weight as a floor, so a depth that is never tried keeps ratio ~1
        floor = PRIOR * (1 - DECAY)
        self.confidence += floor
        self.accepted += floor
        tokens = int(on_path.sum()) / B  # mean tokens per request: the accepted path's nodes
        self.spec_steps = DECAY * self.spec_steps + 1.0
        self.spec_tokens = DECAY * self.spec_tokens + tokens
        self.spec_tokens_sq = DECAY * self.spec_tokens_sq + tokens * tokens
        self.spec_levels = DECAY * self.spec_levels + self.levels
        self.spec_nodes = DECAY * self.spec_nodes + self.step_nodes(num_nodes, T)


def _host(t) -> np.ndarray:
    """A tensor's values as a float64 / int numpy array on the host (one transfer; a CPU
    tensor's float64 or integer values are not copied). Arrays pass through. (The widening
    runs in numpy: a torch op costs ~8 us a call, and the policy makes ~10 of these a step.)"""
    if isinstance(t, np.ndarray):
        return t
    if t.requires_grad:
        t = t.detach()
    if t.is_floating_point() and t.dtype not in (torch.float32, torch.float64):
        t = t.double()  # bfloat16 and the like: numpy has no such dtype
    host = t.cpu().numpy()
    return host.astype(np.float64) if host.dtype == np.float32 else host


def _bucket(batch: int) -> int:
    """The occupancy bucket of a batch size: 1 | 2-3 | 4-7 | 8-15 | ... -> 1, 2, 3, 4, ..."""
    return max(int(batch), 1).bit_length()


def _bands(confidence):
    """The CONFIDENCE_EDGES band of each confidence -> int array, or for a tensor a long
    tensor on its device (the draft path's values stay where they are). Both compare in
    float32, as the drafts' confidences are, so a node falls in the same band when it is
    valued (node_value) as when it is learnt from (observe)."""
    if isinstance(confidence, torch.Tensor):
        return torch.searchsorted(_edges(confidence.device), confidence.float(), right=True)
    return np.searchsorted(_EDGES32, np.asarray(confidence, dtype=np.float32), side="right")


_EDGES32 = CONFIDENCE_EDGES.astype(np.float32)


@functools.cache
def _edges(device: torch.device) -> torch.Tensor:
    """The float32 CONFIDENCE_EDGES on a device (made once per device)."""
    return torch.from_numpy(_EDGES32).to(device)


def _batch_prefix(top: np.ndarray) -> np.ndarray:
    """top: each request's values [B, C], largest first -> the cumulative sum of the whole
    batch's values, largest first, divided by B (prefix_values per request)."""
    flat = top[0] if top.shape[0] == 1 else np.sort(top.ravel())[::-1]
    return flat.cumsum() / top.shape[0]


def _descending(values: np.ndarray) -> np.ndarray:
    """Each row of values [B, C] sorted, largest first."""
    return -np.sort(-values, axis=1)
