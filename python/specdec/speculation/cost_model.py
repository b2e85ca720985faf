"""What speculation costs on the machine at hand: seconds of a target verify forward by tree
size and of drafting by number of draft levels, measured once when the engine starts
(`CostModel.measure`), at a few batch sizes, and priced as docs/adaptive.md#cost-model
describes. The adaptive policy (specdec.speculation.policy) and the drafters' own
`measure_cost` read it; `median_time` is the one timer of every cost measurement.
"""

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

import specdec_kernels.ops as ops
from specdec.models.tensor_parallel import agree_time
from specdec.speculation.trees import TreeSpec, draft_dynamic

# the cost model times every tree size up to this one, powers of two past it: small trees
# are where a CPU decides, and its verify cost is flat up to the rows one pass over the
# weights serves, then steep (Zen 3, one thread: 3 nodes cost what 2 do, each node from the
# 4th ~+25%); interpolated between 2 and 4, a 3-node tree was priced ~2.3 ms (14%) too dear
# and adaptive mode verified 2 nodes where 3 paid (docs/adaptive.md)
EVERY_SIZE_UP_TO = 8

# target_forward(B, T) -> a call running one target forward over B requests' trees of T nodes
# (their logits included): what CostModel.measure times for the verify costs when the forward
# the steps run is not specdec's model (an engine hosting the drafters, e.g. vLLM's)
TargetForward = Callable[[int, int], Callable[[], object]]


@dataclass
class CostModel:
    """verify_tokens / verify_s: seconds of one target forward over a batch of `batch_size`
    trees of T nodes, at the measured T; draft_s[l - 1]: seconds of drafting l levels, each
    level past the first expanding TOPK frontier nodes; draft_narrow_s[l - 1]: the same with
    those levels expanding one node each (empty: the width does not change the cost, as for
    drafters that did not time it). others: the same at other batch sizes, dicts with these
    keys; verify() and draft() given a batch interpolate linearly between the measured batch
    sizes (outside them: the nearest one's costs)."""

    batch_size: int
    verify_tokens: list
    verify_s: list
    draft_s: list
    others: list = field(default_factory=list)
    draft_narrow_s: list = field(default_factory=list)

    def verify(self, T: float, batch: int | None = None) -> float:
        """Linear interpolation (and extrapolation past the last point) in T."""
        return self._at(batch, lambda c: _verify(c["verify_tokens"], c["verify_s"], T))

    def draft(self, levels: float, batch: int | None = None) -> float:
        return self._at(batch, lambda c: _draft(c["draft_s"], levels))

    def draft_narrow(self, levels: int, batch: int | None = None) -> float:
        """draft() with the levels past the first one node wide (draft() when not timed)."""
        return self._at(batch, lambda c: _draft(c.get("draft_narrow_s") or c["draft_s"], levels))

    def _at(self, batch, f) -> float:
        mine = dict(
            batch_size=self.batch_size,
            verify_tokens=self.verify_tokens,
            verify_s=self.verify_s,
            draft_s=self.draft_s,
            draft_narrow_s=self.draft_narrow_s,
        )
        if batch is None or not self.others:
            return f(mine)
        curves = sorted(
            [mine] + [o for o in self.others if o["batch_size"] != self.batch_size],
            key=lambda c: c["batch_size"],
        )
        if batch <= curves[0]["batch_size"]:
            return f(curves[0])
        for c0, c1 in zip(curves, curves[1:]):
            b0, b1 = c0["batch_size"], c1["batch_size"]
            if batch == b1:
                return f(c1)
            if batch < b1:
                y0, y1 = f(c0), f(c1)
                return y0 + (y1 - y0) * (batch - b0) / (b1 - b0)
        return f(curves[-1])

    @classmethod
    @torch.inference_mode()
    def measure(
        cls,
        model,
        head,
        spec,
        batch_size: int,
        context: int = 128,
        repeats: int = 3,
        batch_sizes=None,
        target_forward: TargetForward | None = None,
    ) -> "CostModel":
        """The costs at batch_size, with .others at batch_sizes (default: 1 and, from 8 on,
        about half of batch_size; the policy interpolates between them for the live
        occupancy). Each is measured by _measure_one, the others with one timed call per
        size (after a warm-up call) to keep the engine's start-up short. target_forward: the
        verify forward to time (default: `model`'s over a scratch cache; model may then be
        None when head is)."""
        if batch_sizes is None:
            batch_sizes = {1} | ({1 << (batch_size.bit_length() - 2)} if batch_size >= 8 else set())
        main = cls._measure_one(model, head, spec, batch_size, context, repeats, target_forward)
        for b in sorted(
            set(batch_sizes) - {batch_size}
        ):  # one timed call each: start-up stays short
            c = cls._measure_one(model, head, spec, b, context, 1, target_forward)
            main.others.append(
                dict(
                    batch_size=b,
                    verify_tokens=c.verify_tokens,
                    verify_s=c.verify_s,
                    draft_s=c.draft_s,
                    draft_narrow_s=c.draft_narrow_s,
                )
            )
        return main

    @classmethod
    @torch.inference_mode()
    def _measure_one(
        cls,
        model,
        head,
        spec,
        batch_size: int,
        context: int = 128,
        repeats: int = 3,
        target_forward: TargetForward | None = None,
    ) -> "CostModel":
        """Times the target over trees of 1, 2, 3, ... EVERY_SIZE_UP_TO, then 16, 32, ...
        spec.total nodes and the drafter over 1 .. spec.depth levels, at batch_size requests
        of `context` cached tokens (scratch caches; the cache contents do not change the
        time). Sizes whose verify costs more than depth + 1 plain steps can never pay (a step
        yields at most depth + 1 tokens), so measuring stops there and verify() extrapolates.
        head None: a drafter that costs no model call (n-gram lookup), draft_s is all zeros.
        target_forward: the verify forward to time instead of model's (see measure)."""
        B = batch_size
        if target_forward is None:
            target_forward = _scratch_forward(model, head, B, context, spec.total)
        if model is not None:
            dev = model.tok_embeddings.weight.device
        else:  # an engine's own forward: on the head's device, or the CPU for n-gram lookups
            dev = head.fc.weight.device if head is not None else torch.device("cpu")
        slots = torch.arange(B, device=dev)
        sizes = sorted(
            {spec.total}
            | set(range(1, min(EVERY_SIZE_UP_TO, spec.total) + 1))
            | {2**i for i in range(1, 12) if 2**i < spec.total}
        )
        verify_s = []
        for T in sizes:
            verify_s.append(median_time(target_forward(B, T), repeats, dev))
            if verify_s[-1] > (spec.depth + 1) * verify_s[0]:
                break

        if head is None:
            timed = sizes[: len(verify_s)]
            return cls(B, timed, cost_curve(timed, verify_s), [0.0] * spec.depth)
        head_cache = head.new_cache(B, context + spec.head_nodes)
        head_cache.cache_lens.fill_(context)
        hidden = torch.randn(B, head.args.dim, device=dev, dtype=head.fc.weight.dtype)
        roots = torch.zeros(B, dtype=torch.long, device=dev)

        def draft_s(width: int) -> list:  # levels past the first expand `width` nodes
            return cost_curve(
                list(range(1, spec.depth + 1)),
                [
                    median_time(
                        lambda levels=levels: draft_dynamic(
                            TreeSpec("dynamic", levels, spec.topk, spec.total),
                            head,
                            hidden,
                            head_cache,
                            slots,
                            roots,
                            width=width,
                        ),
                        repeats,
                        dev,
                    )
                    for levels in range(1, spec.depth + 1)
                ],
            )

        return cls(
            B,
            sizes[: len(verify_s)],
            cost_curve(sizes[: len(verify_s)], verify_s),
            draft_s(spec.topk),
            draft_narrow_s=draft_s(1) if spec.topk > 1 and spec.depth > 1 else [],
        )


def _scratch_forward(model, head, B: int, context: int, capacity: int) -> TargetForward:
    """model's verify forward over chains of T nodes behind `context` cached tokens of a
    scratch cache (its contents do not change the time), feeding the head's feature layers."""
    dev = model.tok_embeddings.weight.device
    slots = torch.arange(B, device=dev)
    cache = model.new_cache(B, context + capacity)
    cache.cache_lens.fill_(context)
    feature_layers = head.feature_layers if head is not None else ()

    def forward(batch: int, T: int):
        assert batch == B, "a scratch forward runs the batch its cache was made for"
        tokens = torch.randint(0, model.args.vocab_size, (B, T), device=dev)
        parents = torch.arange(-1, T - 1, dtype=torch.int32, device=dev).expand(B, T).contiguous()
        num_nodes = torch.full((B,), T, dtype=torch.int32, device=dev)

        def verify():
            mask, depth = ops.build_tree_mask(parents, num_nodes)
            model(tokens, cache, slots, num_nodes, mask, depth, feature_layers)

        return verify

    return forward


def cost_curve(xs: list, ys: list) -> list:
    """The measured costs ys at sizes xs (increasing), as the policy prices them: the lower
    convex envelope of the points after each y is lowered to the least y at any larger size.

    Why: timing noise on a shared machine is one-sided (another process, a cold cache or a
    frequency dip make a call slower, never faster), so the lowest times are the truest; a
    bigger tree or one more draft level never costs less; and the extra cost of one more node
    or level does not shrink as the tree grows (a few rows stream the weights at the cost of
    one, more become compute-bound: flat, then linear). One slow point (a verify of 2 nodes
    timed at +1.2 ms over 1 node where the steps measure +0.4) would otherwise make small trees
    look dear and the next sizes almost free: the policy then chose 5-6-node trees on a machine
    where 2-3 nodes pay best (docs/adaptive.md)."""
    low = [float(y) for y in ys]
    for i in range(len(low) - 2, -1, -1):
        low[i] = min(low[i], low[i + 1])
    hull: list[int] = []  # the lower hull's vertices, left to right
    for i in range(len(low)):
        while len(hull) >= 2:
            a, b = hull[-2], hull[-1]
            # b is above (or on) the chord from a to i: not a vertex of the lower hull
            if (low[b] - low[a]) * (xs[i] - xs[a]) >= (low[i] - low[a]) * (xs[b] - xs[a]):
                hull.pop()
            else:
                break
        hull.append(i)
    out = []
    for x in xs:
        j = next(k for k in range(len(hull)) if xs[hull[k]] >= x)
        if xs[hull[j]] == x:
            out.append(low[hull[j]])
            continue
        a, b = hull[j - 1], hull[j]
        out.append(low[a] + (low[b] - low[a]) * (x - xs[a]) / (xs[b] - xs[a]))
    return out


def _verify(xs, ys, T) -> float:
    if T <= xs[0]:
        return ys[0]
    for (x0, y0), (x1, y1) in zip(zip(xs, ys), zip(xs[1:], ys[1:])):
        if T <= x1:
            return y0 + (y1 - y0) * (T - x0) / (x1 - x0)
    slope = (ys[-1] - ys[-2]) / (xs[-1] - xs[-2]) if len(xs) > 1 else 0.0
    return ys[-1] + slope * (T - xs[-1])


def _draft(draft_s, levels) -> float:
    if levels <= 0:
        return 0.0
    if levels != int(levels):  # a mean number of levels: linear between the neighbours
        lo = int(levels)
        return _draft(draft_s, lo) + (_draft(draft_s, lo + 1) - _draft(draft_s, lo)) * (levels - lo)
    levels = int(levels)
    if levels <= len(draft_s):
        return draft_s[levels - 1]
    step = draft_s[-1] - draft_s[-2] if len(draft_s) > 1 else draft_s[-1]
    return draft_s[-1] + step * (levels - len(draft_s))


def median_time(fn, repeats: int, device) -> float:
    """Seconds of fn(): the median of `repeats` timed calls after one warm-up call (CUDA
    synchronised around each, so it is the device's time); the cost models' one timer."""
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - t0)
    median = sorted(times)[len(times) // 2]
    return agree_time(median, device)
