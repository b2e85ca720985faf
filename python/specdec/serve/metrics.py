"""The server's counters, gauges and histograms, as Prometheus text (GET /metrics).

Written from two threads: the HTTP side records requests (latencies, tokens, errors), the
engine thread records steps, finished requests' speculation statistics and the engines' rows
in use. One lock guards them all (a handful of additions per step). The names and what they
count are listed in docs/serving.md, "Metrics".
"""

import threading

# seconds: from a fast CPU step to a long queued request
LATENCY_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75,
    1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0,
)  # fmt: skip
TOKEN_TIME_BUCKETS = (
    0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.04, 0.05, 0.075,
    0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5,
)  # fmt: skip
ROW_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
NODE_BUCKETS = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128)


class Histogram:
    """Cumulative buckets, sum and count (Prometheus' histogram type)."""

    def __init__(self, buckets):
        self.buckets = tuple(buckets)
        self.counts = [0] * (len(self.buckets) + 1)  # the last one: +Inf
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float):
        i = next((i for i, b in enumerate(self.buckets) if value <= b), len(self.buckets))
        self.counts[i] += 1
        self.sum += value
        self.count += 1

    def lines(self, name: str, labels: str = "") -> list:
        sep = "," if labels else ""
        out, total = [], 0
        for bound, n in zip((*self.buckets, "+Inf"), self.counts):
            total += n
            le = bound if bound == "+Inf" else f"{bound:g}"
            out.append(f'{name}_bucket{{{labels}{sep}le="{le}"}} {total}')
        braces = f"{{{labels}}}" if labels else ""
        out.append(f"{name}_sum{braces} {_num(self.sum)}")
        out.append(f"{name}_count{braces} {self.count}")
        return out


class Metrics:
    """model: the served model name (a label on every sample)."""

    def __init__(self, model: str):
        self._lock = threading.Lock()
        self.model = model
        # HTTP side
        self.admitted = 0  # requests accepted and not yet answered (running or waiting)
        self.finished: dict[str, int] = {}  # finish_reason -> requests
        self.http_errors: dict[int, int] = {}  # status -> responses
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.ttft = Histogram(LATENCY_BUCKETS)
        self.tpot = Histogram(TOKEN_TIME_BUCKETS)
        self.e2e = Histogram(LATENCY_BUCKETS)
        # engine thread
        self.steps: dict[str, int] = {}
        self.step_seconds = Histogram(TOKEN_TIME_BUCKETS)
        self.step_rows = Histogram(ROW_BUCKETS)
        self.rows: dict[str, int] = {}  # lane -> batch rows (cache rows) of its engine
        self.rows_in_use: dict[str, int] = {}  # lane -> rows holding a request
        self.queued: dict[str, int] = {}  # lane -> submitted requests waiting for a row
        self.target_forwards = 0
        self.accepted_tokens = 0
        self.nodes_verified = 0
        self.depth_tried: list = []
        self.depth_accepted: list = []
        self.request_nodes = Histogram(NODE_BUCKETS)  # per request: mean tree nodes per step
        self.policy: dict[str, dict] = {}  # lane -> the adaptive policy's recent tree sizes

    # ------------------------------------------------------------------ HTTP side
    def admit(self, delta: int):
        with self._lock:
            self.admitted += delta

    def observe_request(self, finish_reason, prompt_tokens, completion_tokens, ttft, e2e):
        """A request answered (finish_reason stop / length) or ended early (cancelled,
        disconnected, error). ttft / e2e: seconds from its arrival (None: no token)."""
        with self._lock:
            self.finished[finish_reason] = self.finished.get(finish_reason, 0) + 1
            self.prompt_tokens += prompt_tokens
            self.generation_tokens += completion_tokens
            if ttft is not None:
                self.ttft.observe(ttft)
                self.e2e.observe(e2e)
                if completion_tokens > 1:
                    self.tpot.observe((e2e - ttft) / (completion_tokens - 1))

    def http_error(self, status: int):
        with self._lock:
            self.http_errors[status] = self.http_errors.get(status, 0) + 1

    # ------------------------------------------------------------------ engine thread
    def observe_step(self, lane: str, seconds: float, rows: int):
        with self._lock:
            self.steps[lane] = self.steps.get(lane, 0) + 1
            self.step_seconds.observe(seconds)
            self.step_rows.observe(rows)

    def observe_result(self, result):
        """A finished request's speculation statistics (specdec.stats.Stats)."""
        s = result.stats
        with self._lock:
            self.target_forwards += s.target_forwards
            self.accepted_tokens += s.accepted_tokens
            self.nodes_verified += s.nodes_verified
            _add(self.depth_tried, s.depth_tried)
            _add(self.depth_accepted, s.depth_accepted)
            if s.target_forwards:
                self.request_nodes.observe(s.nodes_verified / s.target_forwards)

    def set_engine_state(self, engines: dict):
        """{lane: Engine}: rows in use, queue, the adaptive policy (read in the engine thread)."""
        state = {}
        for lane, e in engines.items():
            p = e.policy
            steps = getattr(p, "spec_steps", 0.0) if p is not None else 0.0
            policy = None
            if p is not None:
                policy = {
                    "nodes": p.spec_nodes / steps if steps else 0.0,
                    "depth": p.spec_levels / steps if steps else 0.0,
                    "plain_streak": p.plain_streak,
                }
            state[lane] = (e.batch_size, e.num_active, e.num_queued, policy)
        with self._lock:
            for lane, (rows, active, queued, policy) in state.items():
                self.rows[lane], self.rows_in_use[lane], self.queued[lane] = rows, active, queued
                if policy is not None:
                    self.policy[lane] = policy

    @property
    def cache_rows_in_use(self) -> int:
        with self._lock:
            return sum(self.rows_in_use.values())

    # ------------------------------------------------------------------ exposition
    def render(self) -> str:
        """Prometheus text exposition format 0.0.4."""
        with self._lock:
            return "\n".join(self._lines()) + "\n"

    def _lines(self):
        m = f'model="{_escape(self.model)}"'
        out = []

        def metric(name, kind, help_text, samples):
            out.append(f"# HELP {name} {help_text}")
            out.append(f"# TYPE {name} {kind}")
            for labels, value in samples:
                out.append(f"{name}{{{m}{labels}}} {_num(value)}")

        running = sum(self.rows_in_use.values())
        metric(
            "specdec_requests_running",
            "gauge",
            "Requests holding a batch row (decoding).",
            [("", running)],
        )
        metric(
            "specdec_requests_waiting",
            "gauge",
            "Requests accepted and waiting for a batch row.",
            [("", max(0, self.admitted - running))],
        )
        metric(
            "specdec_requests_finished_total",
            "counter",
            "Requests ended, by finish reason (stop, length; cancelled: the client went away "
            "or the server stopped; error).",
            [(f',finish_reason="{k}"', v) for k, v in sorted(self.finished.items())],
        )
        metric(
            "specdec_http_errors_total",
            "counter",
            "Error responses, by HTTP status.",
            [(f',status="{k}"', v) for k, v in sorted(self.http_errors.items())],
        )
        metric(
            "specdec_prompt_tokens_total", "counter", "Prompt tokens.", [("", self.prompt_tokens)]
        )
        metric(
            "specdec_generation_tokens_total",
            "counter",
            "Generated tokens.",
            [("", self.generation_tokens)],
        )
        for name, hist, help_text in (
            (
                "specdec_time_to_first_token_seconds",
                self.ttft,
                "Arrival of the request to its first token.",
            ),
            (
                "specdec_time_per_output_token_seconds",
                self.tpot,
                "Per request: first to last token over the tokens after the first.",
            ),
            (
                "specdec_e2e_request_latency_seconds",
                self.e2e,
                "Arrival of the request to its last token.",
            ),
            ("specdec_engine_step_seconds", self.step_seconds, "One engine step."),
            (
                "specdec_engine_step_rows",
                self.step_rows,
                "Batch rows a step decoded (the batch occupancy per step).",
            ),
            (
                "specdec_request_tree_nodes_per_step",
                self.request_nodes,
                "Per finished request: mean nodes (root included) of the trees it verified.",
            ),
        ):
            out.append(f"# HELP {name} {help_text}")
            out.append(f"# TYPE {name} histogram")
            out.extend(hist.lines(name, m))
        metric(
            "specdec_engine_steps_total",
            "counter",
            "Engine steps, by engine (main; seeded: seeded sampling under an adaptive tree).",
            [(f',lane="{k}"', v) for k, v in sorted(self.steps.items())],
        )
        metric(
            "specdec_cache_rows",
            "gauge",
            "KV-cache rows (the batch size) of each engine.",
            [(f',lane="{k}"', v) for k, v in sorted(self.rows.items())],
        )
        metric(
            "specdec_cache_rows_in_use",
            "gauge",
            "KV-cache rows holding a request.",
            [(f',lane="{k}"', v) for k, v in sorted(self.rows_in_use.items())],
        )
        metric(
            "specdec_batch_occupancy",
            "gauge",
            "Rows in use over rows.",
            [
                (f',lane="{k}"', self.rows_in_use.get(k, 0) / r if r else 0.0)
                for k, r in sorted(self.rows.items())
            ],
        )
        metric(
            "specdec_engine_queue_length",
            "gauge",
            "Requests submitted to an engine and waiting for a row.",
            [(f',lane="{k}"', v) for k, v in sorted(self.queued.items())],
        )
        metric(
            "specdec_target_forwards_total",
            "counter",
            "Verification steps of finished requests (one target forward each).",
            [("", self.target_forwards)],
        )
        metric(
            "specdec_accepted_tokens_total",
            "counter",
            "Tokens those steps emitted (accepted drafts + 1 each).",
            [("", self.accepted_tokens)],
        )
        metric(
            "specdec_mean_acceptance_length",
            "gauge",
            "Tokens per target forward over finished requests (1 for plain decoding).",
            [("", self.accepted_tokens / self.target_forwards if self.target_forwards else 0.0)],
        )
        metric(
            "specdec_tree_nodes_verified_total",
            "counter",
            "Tree nodes verified (root included) by finished requests.",
            [("", self.nodes_verified)],
        )
        metric(
            "specdec_acceptance_rate",
            "gauge",
            "Per draft depth: accepted / reached, over finished requests.",
            [
                (f',depth="{d + 1}"', a / t if t else 0.0)
                for d, (a, t) in enumerate(zip(self.depth_accepted, self.depth_tried))
            ],
        )
        metric(
            "specdec_adaptive_tree_nodes",
            "gauge",
            "Adaptive policy: recent mean tree size (nodes, root included) of speculative steps.",
            [(f',lane="{k}"', p["nodes"]) for k, p in sorted(self.policy.items())],
        )
        metric(
            "specdec_adaptive_tree_depth",
            "gauge",
            "Adaptive policy: recent mean draft levels of speculative steps.",
            [(f',lane="{k}"', p["depth"]) for k, p in sorted(self.policy.items())],
        )
        metric(
            "specdec_adaptive_plain_streak",
            "gauge",
            "Adaptive policy: consecutive steps it ran plain (no speculation).",
            [(f',lane="{k}"', p["plain_streak"]) for k, p in sorted(self.policy.items())],
        )
        return out


def _add(into: list, values):
    for i, v in enumerate(values):
        if i < len(into):
            into[i] += v
        else:
            into.append(v)


def _num(v) -> str:
    if isinstance(v, int):
        return str(v)
    return repr(float(v))


def _escape(label: str) -> str:
    return label.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
