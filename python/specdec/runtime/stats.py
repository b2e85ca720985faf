"""Generation statistics, per request and aggregated over a run.

Acceptance is counted from the sampler's decision (num_accepted + 1 tokens per target
forward), before EOS / stop / max-token truncation of the last step.
"""

import time
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

PHASES = ("prefill", "draft", "verify", "sample", "compact")
QUANTILES = (50, 95, 99)


def percentiles(values, qs=QUANTILES) -> dict:
    """{"p50": .., "p95": .., "p99": ..} of values (numpy.percentile's default, linear
    interpolation between the closest ranks); {} for no values."""
    xs = sorted(float(v) for v in values)
    if not xs:
        return {}
    out = {}
    for q in qs:
        pos = (len(xs) - 1) * q / 100
        lo = int(pos)
        hi = min(lo + 1, len(xs) - 1)
        out[f"p{q:g}"] = xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)
    return out


@dataclass
class Stats:
    num_requests: int = 1
    generated_tokens: int = 0
    target_forwards: int = 0  # verification steps after prefill
    accepted_tokens: int = 0  # sum over steps of num_accepted + 1
    nodes_verified: int = 0  # sum over steps of the tree's num_nodes
    # per draft depth d = 1, 2, ... (index d - 1):
    depth_tried: list = field(
        default_factory=list
    )  # steps whose walk reached depth d - 1 with a depth-d child
    depth_accepted: list = field(default_factory=list)  # steps that accepted a depth-d node
    first_rejection_hist: list = field(
        default_factory=list
    )  # [a] = steps that accepted exactly a drafts
    time_s: dict = field(default_factory=lambda: dict.fromkeys(PHASES, 0.0))
    ttft_s: float = 0.0  # time to first token (mean over requests for an aggregate)
    tpot_s: float = 0.0  # time per output token after the first (mean over requests)
    elapsed_s: float = 0.0  # arrival -> finish (wall time of the run for an aggregate)
    # an aggregate's per-request latency percentiles: {"ttft_s" | "tpot_s" | "e2e_s": {"p50": ..}}
    latency: dict = field(default_factory=dict)
    startup_s: float = 0.0  # a run's: seconds its engine took to start (Engine.startup_s)

    # ------------------------------------------------------------------ recording
    def record_step(self, num_accepted: int, num_nodes: int, tree_depth: int):
        """One verification step: the accepted path had num_accepted drafts; the tree had
        num_nodes nodes (root included) and depth tree_depth."""
        self.target_forwards += 1
        self.accepted_tokens += num_accepted + 1
        self.nodes_verified += num_nodes
        _grow(self.first_rejection_hist, num_accepted + 1)
        self.first_rejection_hist[num_accepted] += 1
        _grow(self.depth_tried, tree_depth)
        _grow(self.depth_accepted, tree_depth)
        for d in range(1, min(num_accepted + 1, tree_depth) + 1):
            self.depth_tried[d - 1] += 1
        for d in range(1, num_accepted + 1):
            self.depth_accepted[d - 1] += 1

    def add_time(self, phase: str, seconds: float):
        self.time_s[phase] += seconds

    def finish(self, arrival: float, first_token: float, end: float):
        self.ttft_s = first_token - arrival
        self.elapsed_s = end - arrival
        self.tpot_s = (
            (end - first_token) / (self.generated_tokens - 1) if self.generated_tokens > 1 else 0.0
        )

    # ------------------------------------------------------------------ derived
    @property
    def mean_acceptance_length(self) -> float:
        """Tokens emitted per target forward (1.0 for plain decoding)."""
        return self.accepted_tokens / self.target_forwards if self.target_forwards else 0.0

    @property
    def acceptance_rate(self) -> list:
        """Per draft depth: P(depth d accepted | the walk reached depth d - 1 and could go on)."""
        return [a / t if t else 0.0 for a, t in zip(self.depth_accepted, self.depth_tried)]

    @property
    def nodes_per_step(self) -> float:
        return self.nodes_verified / self.target_forwards if self.target_forwards else 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.generated_tokens / self.elapsed_s if self.elapsed_s > 0 else 0.0

    def to_dict(self) -> dict:
        return {
            "num_requests": self.num_requests,
            "generated_tokens": self.generated_tokens,
            "target_forwards": self.target_forwards,
            "mean_acceptance_length": self.mean_acceptance_length,
            "acceptance_rate": self.acceptance_rate,
            "first_rejection_hist": list(self.first_rejection_hist),
            "nodes_per_step": self.nodes_per_step,
            "time_s": dict(self.time_s),
            "ttft_s": self.ttft_s,
            "tpot_s": self.tpot_s,
            "elapsed_s": self.elapsed_s,
            "tokens_per_s": self.tokens_per_s,
            "latency": {k: dict(v) for k, v in self.latency.items()},
            "startup_s": self.startup_s,
        }

    @classmethod
    def aggregate(cls, per_request: list, time_s: dict, elapsed_s: float) -> "Stats":
        """Counts summed over requests; time split and wall time of the run itself (batched
        steps would be double counted by summing requests); TTFT / TPOT averaged; .latency:
        P50 / P95 / P99 of TTFT, TPOT (requests with more than one token) and end-to-end
        latency (arrival -> finish) over the requests."""
        agg = cls(num_requests=len(per_request), time_s=dict(time_s), elapsed_s=elapsed_s)
        for s in per_request:
            agg.generated_tokens += s.generated_tokens
            agg.target_forwards += s.target_forwards
            agg.accepted_tokens += s.accepted_tokens
            agg.nodes_verified += s.nodes_verified
            for name in ("depth_tried", "depth_accepted", "first_rejection_hist"):
                mine, theirs = getattr(agg, name), getattr(s, name)
                _grow(mine, len(theirs))
                for i, v in enumerate(theirs):
                    mine[i] += v
        if per_request:
            agg.ttft_s = sum(s.ttft_s for s in per_request) / len(per_request)
            agg.tpot_s = sum(s.tpot_s for s in per_request) / len(per_request)
            agg.latency = {
                "ttft_s": percentiles(s.ttft_s for s in per_request),
                "tpot_s": percentiles(s.tpot_s for s in per_request if s.generated_tokens > 1),
                "e2e_s": percentiles(s.elapsed_s for s in per_request),
            }
        return agg

    def summary(self) -> str:
        """A small human-readable table."""
        rate = " ".join(f"{r:.2f}" for r in self.acceptance_rate) or "-"
        hist = " ".join(str(h) for h in self.first_rejection_hist) or "-"
        total = sum(self.time_s.values()) or 1.0
        split = "  ".join(
            f"{p} {self.time_s[p]:.3f}s ({100 * self.time_s[p] / total:.0f}%)" for p in PHASES
        )
        rows = [
            ("requests", f"{self.num_requests}"),
            ("generated tokens", f"{self.generated_tokens}"),
            ("tokens/s", f"{self.tokens_per_s:.2f}"),
            (
                "mean acceptance length",
                f"{self.mean_acceptance_length:.3f} tokens / target forward",
            ),
            ("acceptance rate by depth", rate),
            ("accepted drafts histogram", hist),
            ("tree nodes per step", f"{self.nodes_per_step:.1f}"),
            ("TTFT (mean)", f"{1000 * self.ttft_s:.1f} ms"),
            ("TPOT (mean)", f"{1000 * self.tpot_s:.1f} ms"),
        ]
        for key, name in (("ttft_s", "TTFT"), ("tpot_s", "TPOT"), ("e2e_s", "end-to-end")):
            if self.latency.get(key):
                ps = "  ".join(f"{k.upper()} {1000 * v:.1f}" for k, v in self.latency[key].items())
                rows.append((f"{name} percentiles", f"{ps} ms"))
        rows += [
            ("time split", split),
        ]
        if self.startup_s:
            rows.append(("engine start-up", f"{self.startup_s:.2f} s (not in the latencies)"))
        width = max(len(k) for k, _ in rows)
        return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


def _grow(values: list, n: int):
    values.extend([0] * (n - len(values)))


@contextmanager
def timed(device: torch.device, phase: str, targets):
    """Adds the wall time of the block to `phase` of every Stats in targets; synchronises
    CUDA so the time is the device's, not the launch's."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    yield
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    dt = time.perf_counter() - t0
    for s in targets:
        s.add_time(phase, dt)
