"""Why `specdec serve` steps its engines in the thread that built them (docs/serving.md,
"Threads"): the same work timed in that thread and in a second one, interleaved.

Each round times, in the main thread (which loaded the model and ran the first parallel
work) and then in a fresh thread: a bf16 [1, 576] x [576, 1536] linear (the model's MLP
shape at batch 1), and plain greedy decoding of one request through Engine.generate (tokens
per second). Prints the medians over the rounds and the load average.

    .venv/bin/python benchmarks/bench_serve_threads.py --rounds 5
"""

import argparse
import os
import statistics
import threading
import time

import torch

from specdec import Engine, Request, SamplingParams, load_model


def linear_us(x, w, calls=2000) -> float:
    for _ in range(100):
        torch.nn.functional.linear(x, w)
    start = time.perf_counter()
    for _ in range(calls):
        torch.nn.functional.linear(x, w)
    return (time.perf_counter() - start) / calls * 1e6


def decode_tok_s(engine, ids, tokens) -> float:
    start = time.perf_counter()
    engine.generate([Request(list(ids), SamplingParams(max_new_tokens=tokens, ignore_eos=True))])
    return tokens / (time.perf_counter() - start)


def in_thread(fn, *args):
    out = []
    t = threading.Thread(target=lambda: out.append(fn(*args)))
    t.start()
    t.join()
    return out[0]


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=64)
    opts = ap.parse_args()
    model, tok = load_model(None, dtype=torch.bfloat16)
    engine = Engine(model, tok, tree="chain:1", batch_size=1)
    ids = tok.apply_chat_template([{"role": "user", "content": "Write a poem about the sea."}])
    engine.generate([Request(list(ids), SamplingParams(max_new_tokens=4))])  # warm-up
    x = torch.randn(1, 576, dtype=torch.bfloat16)
    w = torch.randn(1536, 576, dtype=torch.bfloat16)
    rows = {k: [] for k in ("linear_main", "linear_thread", "decode_main", "decode_thread")}
    for _ in range(opts.rounds):
        rows["linear_main"].append(linear_us(x, w))
        rows["linear_thread"].append(in_thread(linear_us, x, w))
        rows["decode_main"].append(decode_tok_s(engine, ids, opts.tokens))
        rows["decode_thread"].append(in_thread(decode_tok_s, engine, ids, opts.tokens))
    print(f"torch threads {torch.get_num_threads()}, load average {os.getloadavg()}")
    for k, v in rows.items():
        unit = "us" if k.startswith("linear") else "tok/s"
        print(f"{k:14s} median {statistics.median(v):8.1f} {unit}  ({len(v)} rounds)")


if __name__ == "__main__":
    main()
