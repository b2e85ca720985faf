"""Soak test of specdec serve: requests at a steady rate for a long time, some of them bad and
some abandoned mid-stream, and the server must not drift.

Poisson arrivals at --rate requests/s for --duration seconds. Each request is, at random:
bad (--bad-fraction: one of a list of malformed bodies, which must get its 4xx with an
OpenAI-style error), abandoned (--disconnect-fraction: a stream closed after its first
chunks, which must cancel it), or good (MT-bench questions, greedy, --output-len tokens, EOS
ignored, streamed or not at random), which must be answered in full: 200, the reply's length,
usage counts, and with --exact the very text the server gave that question alone before the
soak (float32 only: in bf16 a batch's numerics may change a greedy reply). Meanwhile the
server's resident memory and /metrics are sampled every few seconds. Checks: the server stays
up, every good request is answered, resident memory stays within --rss-tolerance of its
post-warm-up level (the first --warm-up seconds excluded), and once the load stops /metrics
shows no cache row in use and nothing waiting (no request leaked). docs/serving.md, "Soak".

    # 10 minutes at a fixed rate (docs/serving.md, Soak results):
    .venv/bin/python benchmarks/soak_serve.py --duration 600 --rate 1.06
    # 80% of the closed-loop rate bench_serve.py measured for eagle+ngram on this machine:
    .venv/bin/python benchmarks/soak_serve.py --duration 600 \\
        --from-bench benchmarks/out/serve.json --json benchmarks/out/soak.json
    # a one-minute check at a fixed rate:
    .venv/bin/python benchmarks/soak_serve.py --duration 60 --rate 0.5 --warm-up 20

Exit code 0 when every check passes, 1 otherwise.
"""

import argparse
import asyncio
import json
import os
import random
import shlex
import sys
import time

from common import write_json
from server_process import ServerProcess, free_port, http_get

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NAME = "soak"
DEFAULT_SERVER_ARGS = "--method eagle+ngram --tree adaptive --dtype bfloat16 --max-batch-size 32"
ABANDONED_AFTER_CHUNKS = (1, 2, 3)
# (body, status): what a bad client sends to /v1/chat/completions, and the answer it must get
MESSAGES = [{"role": "user", "content": "hi"}]
BAD_REQUESTS = [
    (b"{not json", 400),
    ({"messages": []}, 400),
    ({"messages": [{"role": "robot", "content": "hi"}]}, 400),
    ({"messages": MESSAGES, "temperature": -1}, 400),
    ({"messages": MESSAGES, "top_p": 0}, 400),
    ({"messages": MESSAGES, "n": 3}, 400),
    ({"messages": MESSAGES, "logprobs": True}, 400),
    ({"messages": MESSAGES, "max_tokens": "many"}, 400),
    ({"messages": MESSAGES, "max_tokens": 10**9}, 400),
    ({"messages": MESSAGES, "stop": 7}, 400),
    ({"messages": MESSAGES, "unknown_field": 1}, 400),
    ({"messages": MESSAGES, "model": "not-this-one"}, 404),
    ({"messages": [{"role": "user", "content": "word " * 5000}]}, 400),
]


def parse_args():
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--duration", type=float, default=600.0, help="seconds of load")
    rate = ap.add_mutually_exclusive_group(required=True)
    rate.add_argument("--rate", type=float, help="requests per second (Poisson)")
    rate.add_argument(
        "--from-bench",
        metavar="JSON",
        help="bench_serve.py's JSON: --fraction of the saturated request rate it measured "
        "for --bench-server at its largest concurrency",
    )
    ap.add_argument("--bench-server", default="specdec-eagle+ngram")
    ap.add_argument("--fraction", type=float, default=0.8)
    ap.add_argument("--bad-fraction", type=float, default=0.05)
    ap.add_argument("--disconnect-fraction", type=float, default=0.05)
    ap.add_argument("--output-len", type=int, default=128, help="tokens per good reply")
    ap.add_argument("--prompts", type=int, default=16, help="MT-bench questions used")
    ap.add_argument("--warm-up", type=float, default=120.0, help="seconds before RSS is judged")
    ap.add_argument("--rss-tolerance", type=float, default=0.05)
    ap.add_argument("--sample-every", type=float, default=5.0, help="seconds between samples")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--server-args", default=DEFAULT_SERVER_ARGS, help="flags of `specdec serve`")
    ap.add_argument(
        "--exact",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="good replies must equal the question's reply alone (default: with --dtype float32)",
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=os.path.join(ROOT, "benchmarks", "out", "soak.json"))
    opts = ap.parse_args()
    if opts.from_bench:
        opts.rate = opts.fraction * saturated_rate(opts.from_bench, opts.bench_server)
    if not opts.rate > 0:
        ap.error(f"the rate must be > 0, got {opts.rate}")
    if opts.exact is None:
        opts.exact = "float32" in shlex.split(opts.server_args)
    return opts


def saturated_rate(path, server) -> float:
    """The request throughput bench_serve.py measured for server at its largest concurrency."""
    with open(path) as f:
        rows = [r for r in json.load(f)["rows"] if r["server"] == server and r["rate"] == "inf"]
    if not rows:
        raise SystemExit(f"{path} has no closed-loop row of {server}")
    return max(rows, key=lambda r: r["concurrency"])["request_throughput"]


def prompts(n) -> list:
    from specdec.datasets import mtbench_prompts

    return mtbench_prompts(n)


class Soak:
    def __init__(self, opts, server: ServerProcess, questions: list):
        import httpx

        self.opts, self.server, self.questions = opts, server, questions
        self.http = httpx.AsyncClient(
            base_url=server.url + "/v1",
            timeout=httpx.Timeout(600.0),
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=64),
        )
        self.references: dict = {}
        self.counts = {"good": 0, "good_ok": 0, "bad": 0, "bad_ok": 0, "abandoned": 0}
        self.failures: list = []
        self.samples: list = []

    def good_body(self, question, stream):
        return {
            "model": NAME,
            "messages": [{"role": "user", "content": question}],
            "max_tokens": self.opts.output_len,
            "ignore_eos": True,
            "temperature": 0,
            "stream": stream,
            **({"stream_options": {"include_usage": True}} if stream else {}),
        }

    async def ask(self, question, stream) -> tuple:
        """-> (status, text, usage, finish_reason, error)."""
        body = self.good_body(question, stream)
        if not stream:
            r = await self.http.post("/chat/completions", json=body)
            if r.status_code != 200:
                return r.status_code, None, None, None, r.text[:300]
            data = r.json()
            choice = data["choices"][0]
            return 200, choice["message"]["content"], data["usage"], choice["finish_reason"], None
        text, usage, reason = "", None, None
        async with self.http.stream("POST", "/chat/completions", json=body) as r:
            if r.status_code != 200:
                return r.status_code, None, None, None, (await r.aread())[:300]
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    return 200, None, None, None, chunk["error"]["message"]
                if chunk.get("usage"):
                    usage = chunk["usage"]
                for c in chunk.get("choices", []):
                    text += c["delta"].get("content") or ""
                    reason = c.get("finish_reason") or reason
        return 200, text, usage, reason, None

    async def good(self, i):
        question = self.questions[i % len(self.questions)]
        status, text, usage, reason, error = await self.ask(question, stream=i % 2 == 0)
        self.counts["good"] += 1
        problems = []
        if status != 200 or error is not None:
            problems.append(f"status {status}: {error}")
        else:
            if (
                reason != "length"
                or not usage
                or usage["completion_tokens"] != self.opts.output_len
            ):
                problems.append(f"finish_reason {reason}, usage {usage}")
            if self.opts.exact and text != self.references[question]:
                problems.append("the reply differs from the question's reply alone")
        if problems:
            self.failures.append({"request": i, "kind": "good", "problems": problems})
        else:
            self.counts["good_ok"] += 1

    async def bad(self, i, rng):
        body, status = rng.choice(BAD_REQUESTS)
        self.counts["bad"] += 1
        if isinstance(body, bytes):
            r = await self.http.post("/chat/completions", content=body)
        else:
            r = await self.http.post("/chat/completions", json=body)
        try:
            ok = r.status_code == status and r.json()["error"]["message"]
        except (ValueError, KeyError, TypeError):
            ok = False
        if ok:
            self.counts["bad_ok"] += 1
        else:
            self.failures.append(
                {"request": i, "kind": "bad", "problems": [f"{r.status_code}: {r.text[:200]}"]}
            )

    async def abandon(self, i, rng):
        self.counts["abandoned"] += 1
        body = self.good_body(self.questions[i % len(self.questions)], stream=True)
        body["max_tokens"] = 4 * self.opts.output_len
        chunks = rng.choice(ABANDONED_AFTER_CHUNKS)
        async with self.http.stream("POST", "/chat/completions", json=body) as r:
            seen = 0
            async for line in r.aiter_lines():
                seen += line.startswith("data: ")
                if seen >= chunks:
                    break  # leaving the block closes the connection mid-stream

    async def sample(self, start, stop_event):
        while not stop_event.is_set():
            metrics = metrics_of(self.server.url)
            self.samples.append(
                {
                    "t": time.monotonic() - start,
                    "rss_bytes": self.server.rss_bytes(),
                    "rows_in_use": metrics.get("specdec_cache_rows_in_use"),
                    "waiting": metrics.get("specdec_requests_waiting"),
                    "alive": self.server.alive(),
                    "load_1min": os.getloadavg()[0],
                }
            )
            try:
                await asyncio.wait_for(stop_event.wait(), self.opts.sample_every)
            except asyncio.TimeoutError:
                pass

    async def run(self):
        opts = self.opts
        rng = random.Random(opts.seed)
        for q in self.questions:  # each question alone first: the reference replies
            status, text, _, _, error = await self.ask(q, stream=False)
            if status != 200:
                raise SystemExit(f"the server cannot answer a reference request: {error}")
            self.references[q] = text
        start, stop_event, tasks = time.monotonic(), asyncio.Event(), []
        sampler = asyncio.ensure_future(self.sample(start, stop_event))
        t, i = 0.0, 0
        while True:
            t += rng.expovariate(opts.rate)
            if t > opts.duration:
                break
            await asyncio.sleep(max(0.0, start + t - time.monotonic()))
            kind = rng.random()
            if kind < opts.bad_fraction:
                tasks.append(asyncio.ensure_future(self.bad(i, rng)))
            elif kind < opts.bad_fraction + opts.disconnect_fraction:
                tasks.append(asyncio.ensure_future(self.abandon(i, rng)))
            else:
                tasks.append(asyncio.ensure_future(self.good(i)))
            i += 1
        results = await asyncio.gather(*tasks, return_exceptions=True)
        for n, r in enumerate(results):
            if isinstance(r, BaseException):
                self.failures.append({"request": n, "kind": "client", "problems": [repr(r)]})
        load_s = time.monotonic() - start
        idle = await wait_idle(self.server.url)
        stop_event.set()
        await sampler
        await self.http.aclose()
        return load_s, idle


def metrics_of(url) -> dict:
    status, text = http_get(url + "/metrics", timeout=10)
    out: dict = {}
    if status == 200:
        for line in text.splitlines():
            if line and not line.startswith("#"):
                sample, value = line.rsplit(" ", 1)
                name = sample.split("{", 1)[0]
                out[name] = out.get(name, 0.0) + float(value)
    return out


async def wait_idle(url, timeout=300.0) -> dict:
    """/metrics once no row is in use and nothing waits (or after timeout)."""
    deadline = time.monotonic() + timeout
    while True:
        m = metrics_of(url)
        idle = m.get("specdec_cache_rows_in_use") == 0 and m.get("specdec_requests_waiting") == 0
        if idle or time.monotonic() > deadline:
            return m
        await asyncio.sleep(1.0)


def checks(opts, soak: Soak, idle: dict, health: int, alive: bool) -> list:
    rows, waiting = idle.get("specdec_cache_rows_in_use"), idle.get("specdec_requests_waiting")
    after = [s["rss_bytes"] for s in soak.samples if s["t"] >= opts.warm_up and s["rss_bytes"]]
    drift = (max(after) - min(after)) / min(after) if len(after) >= 2 else None
    c = soak.counts
    return [
        {"check": "server up (alive, /health 200)", "value": f"{alive}, {health}",
         "met": alive and health == 200},
        {"check": "every good request answered in full", "value": f"{c['good_ok']}/{c['good']}",
         "met": c["good_ok"] == c["good"]},
        {"check": "every bad request got its 4xx", "value": f"{c['bad_ok']}/{c['bad']}",
         "met": c["bad_ok"] == c["bad"]},
        {"check": f"RSS within {opts.rss_tolerance:.0%} after warm-up",
         "value": None if drift is None else f"{drift:.1%} over {len(after)} samples",
         "met": drift is not None and drift <= opts.rss_tolerance},
        {"check": "idle: no cache row in use, nothing waiting",
         "value": f"{rows}, {waiting}", "met": rows == 0 and waiting == 0},
    ]  # fmt: skip


def main():
    opts = parse_args()
    port = free_port()
    argv = [sys.executable, "-m", "specdec", "serve", "--port", str(port),
            "--served-model-name", NAME, *shlex.split(opts.server_args)]  # fmt: skip
    env = dict(
        os.environ,
        OMP_NUM_THREADS=str(opts.threads),
        PYTHONUNBUFFERED="1",
    )
    server = ServerProcess("specdec serve", argv, port, env, opts.json + ".server.log")
    try:
        start_s = server.wait_ready()
        print(f"server ready in {start_s:.0f} s; {opts.rate:.3g} req/s for {opts.duration:.0f} s")
        soak = Soak(opts, server, prompts(opts.prompts))
        load_s, idle = asyncio.run(soak.run())
        health, _ = http_get(server.url + "/health")
        alive = server.alive()
    finally:
        exit_code = server.stop()
    results = checks(opts, soak, idle, health, alive)
    meta = {
        "options": vars(opts),
        "server_argv": argv,
        "load_seconds": load_s,
        "counts": soak.counts,
        "failures": soak.failures[:50],
        "samples": soak.samples,
        "checks": results,
        "server_exit_code": exit_code,
    }
    write_json(opts.json, soak.samples, meta)
    print(json.dumps(soak.counts))
    for f in soak.failures[:10]:
        print("failure:", f)
    for r in results:
        print(f"{'pass' if r['met'] else 'FAIL'}  {r['check']}: {r['value']}")
    print(f"written to {opts.json}")
    return 0 if all(r["met"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
