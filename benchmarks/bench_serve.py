"""specdec serve against vLLM's and llama.cpp's OpenAI servers, measured by vLLM's own client.

Each server runs alone (started, measured, stopped before the next) on loopback, the same
model (SmolLM2-135M-Instruct: specdec and vLLM from the same HF checkpoint, llama.cpp from
the same GGUF as bf16 and Q4_1), the same threads, prompts and output lengths. The client is
`vllm bench serve` (vllm.benchmarks.serve, run in vLLM's environment) with the openai-chat
backend, greedy (--temperature 0), fixed output lengths (--ignore-eos), streaming with usage.
Points: --concurrency C at an unlimited rate (closed loop: C clients, each sending its next
request when the last one ends) for each C, then --rates R (Poisson arrivals) with
max-concurrency max(C), from light load to past saturation. docs/serving.md, "The
comparison", describes the method and what each column means.

Servers (--servers, default all; a server whose software is missing is reported and skipped):
    specdec-plain        specdec serve --method plain
    specdec-eagle+ngram  specdec serve --method eagle+ngram --tree adaptive
    vllm-plain           python -m vllm.entrypoints.openai.api_server
    vllm-ngram           the same with --speculative-config ngram (its prompt-lookup method)
    vllm-eagle           the same with vLLM's EAGLE chain (3 drafts) and specdec's exported
                         EAGLE-2 head: speculative_config("eagle", num_speculative_tokens=3)
    vllm-specdec-trees   the same with specdec's trees inside vLLM's step, the documented
                         config: speculative_config("eagle+ngram", tree="adaptive")
    llamacpp-bf16        python -m llama_cpp.server, the bf16 GGUF (llama-cpp-python[server])
    llamacpp-q4_1        the same on the shipped Q4_1 GGUF

    # the full comparison (hours; on a quiet machine):
    .venv/bin/python benchmarks/bench_serve.py \\
        --json benchmarks/results/serve_comparison.json
    # a smoke test (minutes): two short points per server
    .venv/bin/python benchmarks/bench_serve.py --quick --json /tmp/serve_quick.json

Writes one JSON (machine, date, commit, load average per point, every row, the goal checks)
and prints the table. Server logs go beside the JSON (<json>.logs/).
"""

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile

from common import print_table, write_json
from server_process import ServerProcess, free_port, http_get

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SERVED_NAME = "smollm2-135m-instruct"
SERVERS = (
    "specdec-plain",
    "specdec-eagle+ngram",
    "vllm-plain",
    "vllm-ngram",
    "vllm-eagle",
    "vllm-specdec-trees",
    "llamacpp-bf16",
    "llamacpp-q4_1",
)
DEFAULT_VLLM_PYTHON = sys.executable  # vLLM installed beside specdec (pip install '.[vllm]')
# run in vLLM's environment: one `vllm bench serve` point -> its result JSON (lists dropped)
CLIENT = r"""
import json, sys
from argparse import ArgumentParser
from vllm.benchmarks.serve import add_cli_args, main
argv, out = json.loads(sys.argv[1]), sys.argv[2]
parser = ArgumentParser()
add_cli_args(parser)
result = main(parser.parse_args(argv))
summary = {k: v for k, v in result.items() if not isinstance(v, (list, dict))}
summary["errors"] = sorted({str(e)[:300] for e in result.get("errors", []) if e})[:5]
with open(out, "w") as f:
    json.dump(summary, f)
"""
# llama-cpp-python's server with two input fixes, neither touching its decoding: text
# content parts joined into a string (vLLM's client sends a message's content as
# [{"type": "text", ...}], valid OpenAI input that llama-cpp-python hands unjoined to the chat
# template: a TypeError), and X-Request-ID headers accepted as they come (its request-id
# middleware answers 400 to any that is not a UUID; vLLM's client sends "<prefix><index>")
LLAMACPP_SERVER = r"""
import sys
import llama_cpp
import llama_cpp.server.app as app
from llama_cpp.server.__main__ import main

RequestIdPlugin = app.RequestIdPlugin
app.RequestIdPlugin = lambda: RequestIdPlugin(validate=False)

create = llama_cpp.Llama.create_chat_completion


def text_of(message):
    content = message.get("content")
    if isinstance(content, list):
        text = "\n".join(p["text"] for p in content if p.get("type") == "text")
        return {**message, "content": text}
    return message


def create_chat_completion(self, *args, **kwargs):
    if "messages" in kwargs:
        kwargs["messages"] = [text_of(m) for m in kwargs["messages"]]
    return create(self, *args, **kwargs)


llama_cpp.Llama.create_chat_completion = create_chat_completion
sys.argv = ["llama_cpp.server", *sys.argv[1:]]
main()
"""
COLUMNS = [
    "server", "concurrency", "rate", "completed", "failed", "out_tok_s", "goodput_req_s",
    "ttft_p50", "ttft_p95", "ttft_p99", "tpot_p50", "tpot_p95", "tpot_p99",
    "e2el_p50", "e2el_p95", "e2el_p99", "load_1min",
]  # fmt: skip


def parse_args():
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--servers", default=",".join(SERVERS), help="comma list of the servers")
    ap.add_argument("--threads", type=int, default=2, help="CPU threads of every server")
    ap.add_argument("--dtype", default="bfloat16", help="specdec's and vLLM's weights' dtype")
    ap.add_argument("--dataset", choices=("mtbench", "random"), default="mtbench")
    ap.add_argument(
        "--input-len", type=int, default=128, help="random: prompt tokens (default 128)"
    )
    ap.add_argument("--output-len", type=int, default=128, help="tokens per reply (EOS ignored)")
    ap.add_argument("--num-prompts", type=int, default=64, help="requests per point (default 64)")
    ap.add_argument("--concurrency", default="1,8,32", help="closed-loop points: clients")
    ap.add_argument(
        "--rates",
        default="0.25,0.5,1,2,4",
        help="open-loop points: requests/s (Poisson), at max-concurrency max(--concurrency)",
    )
    ap.add_argument(
        "--goodput", default="ttft:2000 tpot:100", help="SLOs in ms for goodput (vLLM's syntax)"
    )
    ap.add_argument("--warmups", type=int, default=2, help="client warm-up requests per point")
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--vllm-python", default=os.environ.get("VLLM_PYTHON", DEFAULT_VLLM_PYTHON))
    ap.add_argument(
        "--llamacpp-python", default=sys.executable, help="a Python with llama-cpp-python[server]"
    )
    ap.add_argument("--vllm-ngram-tokens", type=int, default=4, help="vLLM ngram: drafts a step")
    ap.add_argument("--vllm-kv-gib", type=int, default=4, help="VLLM_CPU_KVCACHE_SPACE")
    ap.add_argument(
        "--vllm-enforce-eager",
        action="store_true",
        help="vLLM servers without torch.compile (starts in under a minute; as the tree rows "
        "of bench_vllm_trees.py and docs/integration.md's server)",
    )
    ap.add_argument("--start-timeout", type=float, default=1200.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quick", action="store_true", help="a smoke test: 4 short requests, 2 points")
    ap.add_argument("--json", default=os.path.join(ROOT, "benchmarks", "out", "serve.json"))
    opts = ap.parse_args()
    if opts.quick:
        opts.num_prompts, opts.output_len, opts.input_len = 4, 32, 32
        opts.concurrency, opts.rates, opts.warmups = "1,2", "1", 1
    opts.concurrency = [int(c) for c in opts.concurrency.split(",") if c]
    opts.rates = [float(r) for r in opts.rates.split(",") if r]
    opts.servers = [s for s in opts.servers.split(",") if s]
    unknown = set(opts.servers) - set(SERVERS)
    if unknown:
        ap.error(f"unknown servers {sorted(unknown)}: choose from {', '.join(SERVERS)}")
    return opts


# ---------------------------------------------------------------------- the servers
def model_files():
    """(HF checkpoint dir, Q4_1 GGUF, bf16 GGUF or None) of the default model."""
    from specdec.models.loader import default_model_path, gguf_checkpoint_dir

    gguf = default_model_path()
    from specdec.bench.llamacpp import bf16_gguf_path

    try:
        bf16 = bf16_gguf_path(gguf)
    except Exception as e:  # gguf's writer missing or failing: the bf16 row is skipped
        print(f"bf16 GGUF unavailable: {type(e).__name__}: {e}", file=sys.stderr)
        bf16 = None
    return gguf_checkpoint_dir(gguf), gguf, bf16


def server_command(name, opts, port, files):
    """-> (argv, env) of a server, or a string saying why it cannot run here."""
    hf_dir, q4_gguf, bf16_gguf = files
    threads = str(opts.threads)
    env = dict(os.environ, OMP_NUM_THREADS=threads, PYTHONUNBUFFERED="1")
    maxc = max(opts.concurrency)
    if name.startswith("specdec"):
        method = ["--method", "plain"] if name == "specdec-plain" else [
            "--method", "eagle+ngram", "--tree", "adaptive",
        ]  # fmt: skip
        argv = [
            sys.executable, "-m", "specdec", "serve", "--port", str(port),
            "--served-model-name", SERVED_NAME, "--dtype", opts.dtype,
            "--max-batch-size", str(maxc), "--max-queue", "4096",
            "--max-seq-len", str(opts.max_model_len), *method,
        ]  # fmt: skip
        return argv, env
    if name.startswith("vllm"):
        if not os.path.exists(opts.vllm_python):
            return f"no vLLM environment at {opts.vllm_python} (--vllm-python)"
        env.update(VLLM_CPU_OMP_THREADS_BIND=f"0-{opts.threads - 1}",
                   VLLM_CPU_KVCACHE_SPACE=str(opts.vllm_kv_gib))  # fmt: skip
        argv = [
            opts.vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--model", hf_dir,
            "--served-model-name", SERVED_NAME, "--dtype", opts.dtype,
            "--max-model-len", str(opts.max_model_len), "--max-num-seqs", str(maxc),
            "--host", "127.0.0.1", "--port", str(port), "--generation-config", "vllm",
        ]  # fmt: skip
        if opts.vllm_enforce_eager:
            argv.append("--enforce-eager")
        if name == "vllm-ngram":
            spec = {
                "method": "ngram",
                "num_speculative_tokens": opts.vllm_ngram_tokens,
                "prompt_lookup_max": 4,
                "prompt_lookup_min": 1,
            }
            argv += ["--speculative-config", json.dumps(spec)]
        elif name in ("vllm-eagle", "vllm-specdec-trees"):
            from specdec.integrations.vllm import speculative_config

            spec = (
                speculative_config("eagle", num_speculative_tokens=3)
                if name == "vllm-eagle"
                else speculative_config("eagle+ngram", tree="adaptive")
            )
            argv += ["--speculative-config", json.dumps(spec)]
        return argv, env
    probe = subprocess.run(
        [opts.llamacpp_python, "-c", "import llama_cpp.server"], capture_output=True, text=True
    )
    if probe.returncode != 0:
        return "llama-cpp-python[server] is not installed (pip install 'llama-cpp-python[server]')"
    gguf = bf16_gguf if name == "llamacpp-bf16" else q4_gguf
    if gguf is None:
        return "no bf16 GGUF"
    argv = [
        opts.llamacpp_python, "-c", LLAMACPP_SERVER, "--model", gguf,
        "--model_alias", SERVED_NAME, "--n_threads", threads, "--n_threads_batch", threads,
        "--n_ctx", str(opts.max_model_len), "--host", "127.0.0.1", "--port", str(port),
        # queue concurrent requests (its default cuts a running stream short for a new one)
        "--interrupt_requests", "False", "--verbose", "False",
    ]  # fmt: skip
    return argv, env


# ---------------------------------------------------------------------- the client
def mtbench_file(directory) -> str:
    from specdec.datasets import mtbench_prompts

    # in ShareGPT's format, which vLLM's client reads without extra packages (its custom
    # JSONL reader needs pandas); only the first (human) value is sent
    path = os.path.join(directory, "mtbench_sharegpt.json")
    with open(path, "w") as f:
        json.dump(
            [
                {"conversations": [{"from": "human", "value": p}, {"from": "gpt", "value": ""}]}
                for p in mtbench_prompts()
            ],
            f,
        )
    return path


def client_argv(opts, server, url, hf_dir, concurrency, rate, dataset_path):
    argv = [
        "--backend", "openai-chat", "--base-url", url, "--endpoint", "/v1/chat/completions",
        "--model", hf_dir, "--tokenizer", hf_dir, "--served-model-name", SERVED_NAME,
        "--num-prompts", str(opts.num_prompts), "--request-rate", str(rate),
        "--max-concurrency", str(concurrency), "--ignore-eos", "--temperature", "0",
        "--seed", str(opts.seed), "--percentile-metrics", "ttft,tpot,itl,e2el",
        "--metric-percentiles", "50,95,99", "--goodput", *opts.goodput.split(),
        "--num-warmups", str(opts.warmups), "--disable-tqdm",
    ]  # fmt: skip
    if server.startswith("llamacpp"):
        # its server reads neither ignore_eos nor max_completion_tokens: EOS held off by
        # min_tokens, the length set by max_tokens
        body = {"min_tokens": opts.output_len, "max_tokens": opts.output_len}
        argv += ["--extra-body", json.dumps(body)]
    if opts.dataset == "random":
        argv += ["--dataset-name", "random", "--random-input-len", str(opts.input_len),
                 "--random-output-len", str(opts.output_len)]  # fmt: skip
    else:  # the questions as user messages: each server applies its own chat template
        argv += ["--dataset-name", "sharegpt", "--dataset-path", dataset_path,
                 "--sharegpt-output-len", str(opts.output_len)]  # fmt: skip
    return argv


def run_point(opts, server, url, hf_dir, concurrency, rate, workdir, dataset_path) -> dict:
    out = os.path.join(workdir, f"point_{server}_{concurrency}_{rate}.json")
    argv = client_argv(opts, server, url, hf_dir, concurrency, rate, dataset_path)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run(
        [opts.vllm_python, "-c", CLIENT, json.dumps(argv), out],
        capture_output=True,
        text=True,
        env=env,
    )
    if proc.returncode != 0 or not os.path.exists(out):
        raise RuntimeError(f"vllm bench serve failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    with open(out) as f:
        return json.load(f)


def specdec_counters(url) -> dict:
    """Sums of the specdec server's /metrics samples used to explain a point."""
    status, text = http_get(url + "/metrics")
    if status != 200:
        return {}
    out: dict = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            sample, value = line.rsplit(" ", 1)
            name = sample.split("{", 1)[0]
            out[name] = out.get(name, 0.0) + float(value)
    return out


def row_of(name, concurrency, rate, r, load, before, after) -> dict:
    row = {
        "server": name,
        "concurrency": concurrency,
        "rate": "inf" if math.isinf(rate) else rate,
        "completed": r.get("completed"),
        "failed": r.get("failed"),
        "out_tok_s": r.get("output_throughput"),
        "goodput_req_s": r.get("request_goodput"),
        "request_throughput": r.get("request_throughput"),
        "duration_s": r.get("duration"),
        "mean_output_len": r["total_output_tokens"] / r["completed"]
        if r.get("completed")
        else None,
        "load_1min": load,
        "errors": r.get("errors"),
    }
    for metric in ("ttft", "tpot", "itl", "e2el"):
        for p in (50, 95, 99):
            row[f"{metric}_p{p}"] = r.get(f"p{p}_{metric}_ms")
    if before and after:  # the engine's side of the point (specdec servers)
        d = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
        steps = d.get("specdec_engine_step_seconds_count", 0.0)
        forwards = d.get("specdec_target_forwards_total", 0.0)
        row["engine_step_ms_mean"] = (
            1000 * d["specdec_engine_step_seconds_sum"] / steps if steps else None
        )
        row["engine_rows_mean"] = d["specdec_engine_step_rows_sum"] / steps if steps else None
        row["mean_acceptance_length"] = (
            d["specdec_accepted_tokens_total"] / forwards if forwards else None
        )
        row["tree_nodes_per_step"] = (
            d["specdec_tree_nodes_verified_total"] / forwards if forwards else None
        )
    return row


def measure_server(name, opts, files, workdir, dataset_path, log_dir) -> tuple[list, dict]:
    port = free_port()
    command = server_command(name, opts, port, files)
    if isinstance(command, str):
        print(f"== {name}: skipped: {command}", flush=True)
        return [], {"skipped": command}
    argv, env = command
    server = ServerProcess(name, argv, port, env, os.path.join(log_dir, f"{name}.log"))
    info = {"argv": argv}
    rows = []
    try:
        info["start_s"] = server.wait_ready(opts.start_timeout)
        print(f"== {name}: ready in {info['start_s']:.0f} s", flush=True)
        points = [(c, math.inf) for c in opts.concurrency]
        points += [(max(opts.concurrency), r) for r in opts.rates]
        for concurrency, rate in points:
            load = os.getloadavg()[0]
            before = specdec_counters(server.url) if name.startswith("specdec") else None
            r = run_point(
                opts, name, server.url, files[0], concurrency, rate, workdir, dataset_path
            )
            after = specdec_counters(server.url) if before is not None else None
            row = row_of(name, concurrency, rate, r, load, before, after)
            rows.append(row)
            print_table([row], COLUMNS[:8])
            sys.stdout.flush()
        info["rss_bytes_end"] = server.rss_bytes()
    except RuntimeError as e:
        print(f"== {name}: failed: {e}", flush=True)
        info["error"] = str(e)[-2000:]
    finally:
        info["exit_code"] = server.stop()
    return rows, info


# ---------------------------------------------------------------------- the goals
SPECDEC = ("specdec-plain", "specdec-eagle+ngram")
VLLM = ("vllm-plain", "vllm-ngram", "vllm-eagle")  # vLLM's own methods
ADAPTIVE_TOLERANCE = 0.97  # adaptive mode: never more than 3% below plain


def goal_checks(rows) -> list:
    """The comparison's goals (docs/serving.md, "The comparison") where their rows exist; each
    side is its best server at the point (highest tok/s, lowest latency)."""
    done = [r for r in rows if r["completed"] and r["out_tok_s"]]

    def at(servers, concurrency, rate):
        return [
            r for r in done
            if r["server"] in servers and r["concurrency"] == concurrency and r["rate"] == rate
        ]  # fmt: skip

    def best(servers, concurrency, rate, key="out_tok_s", lowest=False):
        found = [r for r in at(servers, concurrency, rate) if r.get(key) is not None]
        pick = min if lowest else max
        return pick(found, key=lambda r: r[key], default=None)

    checks = []

    def check(goal, ours, theirs, key, need, lowest=False):
        if ours and theirs and ours[key] and theirs[key]:
            ratio = theirs[key] / ours[key] if lowest else ours[key] / theirs[key]
            checks.append({
                "goal": goal, "ours": ours["server"], "theirs": theirs["server"],
                "ratio": ratio, "need": need, "met": ratio >= need,
            })  # fmt: skip

    if not done:
        return checks
    c1 = min(r["concurrency"] for r in done)
    cmax = max(r["concurrency"] for r in done)
    for key, lowest, what in (("out_tok_s", False, "tok/s"), ("tpot_p50", True, "P50 TPOT")):
        ours = best(SPECDEC, c1, "inf", key, lowest)
        check(f"concurrency {c1}: {what} vs vLLM's best", ours,
              best(VLLM, c1, "inf", key, lowest), key, 2.5, lowest)  # fmt: skip
        check(f"concurrency {c1}: {what} vs llama.cpp bf16", ours,
              best(("llamacpp-bf16",), c1, "inf", key, lowest), key, 1.4, lowest)  # fmt: skip
    check(
        f"saturation (concurrency {cmax}): tok/s vs vLLM's best",
        best(SPECDEC, cmax, "inf"), best(VLLM, cmax, "inf"), "out_tok_s", 1.5,
    )  # fmt: skip
    vllm_saturation = best(VLLM, cmax, "inf", "request_throughput")
    for rate in sorted({r["rate"] for r in done if r["rate"] != "inf"}):
        if vllm_saturation and rate < vllm_saturation["request_throughput"]:
            check(f"rate {rate} (below vLLM's saturation): P99 TTFT",
                  best(SPECDEC, cmax, rate, "ttft_p99", True),
                  best(VLLM, cmax, rate, "ttft_p99", True), "ttft_p99", 1.0, True)  # fmt: skip
    for plain in [r for r in done if r["server"] == "specdec-plain"]:
        point = (plain["concurrency"], plain["rate"])
        adaptive = at(("specdec-eagle+ngram",), *point)
        for key, lowest, what in (("out_tok_s", False, "tok/s"), ("tpot_p50", True, "P50 TPOT")):
            check(f"adaptive vs plain, {what} (concurrency {point[0]}, rate {point[1]})",
                  adaptive[0] if adaptive else None, plain, key, ADAPTIVE_TOLERANCE,
                  lowest)  # fmt: skip
    # specdec's trees inside vLLM (docs/integration.md, Trees inside vLLM): never more than 3%
    # below vLLM plain at any point; P99 TTFT no worse than vLLM's EAGLE chain
    for plain in [r for r in done if r["server"] == "vllm-plain"]:
        point = (plain["concurrency"], plain["rate"])
        trees = at(("vllm-specdec-trees",), *point)
        check(f"trees in vLLM vs vLLM plain, tok/s (concurrency {point[0]}, rate {point[1]})",
              trees[0] if trees else None, plain, "out_tok_s", ADAPTIVE_TOLERANCE)  # fmt: skip
        chain = at(("vllm-eagle",), *point)
        check(f"trees in vLLM vs vLLM EAGLE chain, P99 TTFT (concurrency {point[0]}, "
              f"rate {point[1]})", trees[0] if trees else None, chain[0] if chain else None,
              "ttft_p99", 1.0, True)  # fmt: skip
    return checks


def main():
    opts = parse_args()
    files = model_files()
    log_dir = opts.json + ".logs"
    rows, servers = [], {}
    with tempfile.TemporaryDirectory(prefix="bench-serve-") as workdir:
        dataset_path = mtbench_file(workdir) if opts.dataset == "mtbench" else None
        for name in opts.servers:
            server_rows, servers[name] = measure_server(
                name, opts, files, workdir, dataset_path, log_dir
            )
            rows += server_rows
            meta = {"servers": servers, "options": {k: v for k, v in vars(opts).items()}}
            write_json(opts.json, rows, {**meta, "goals": goal_checks(rows) if rows else []})
    print()
    print_table(rows, COLUMNS)
    checks = goal_checks(rows) if rows else []
    if checks:
        print()
        print_table(checks, ["goal", "ours", "theirs", "ratio", "need", "met"])
    print(f"\nwritten to {opts.json} (server logs in {log_dir})")


if __name__ == "__main__":
    main()
