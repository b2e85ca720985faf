"""Tensor parallelism end to end: `specdec generate --tp N` against --tp 1, tokens/s.

Each variant is its own launch (torchrun with N processes; N = 1 runs without it), the
variants interleaved round by round so that the machine's load drifts over all of them
alike; the figure is the median over the rounds of the tokens/s rank 0 reports (decode
only: model loading and the adaptive cost measurement are outside it). The default model
(SmolLM2-135M: 9 query heads, 3 KV heads) splits over 3 ranks, not 2.

    python benchmarks/bench_tp.py [--tp 3] [--rounds 3] [--max-new-tokens 64] [--json PATH]
"""

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROMPT = "Explain in a few sentences why the sky is blue."


def launch(tp: int, method: list, max_new_tokens: int) -> float:
    """One generate run -> rank 0's tokens/s."""
    argv = ["-m", "specdec", "generate", "--prompt", PROMPT, "--dtype", "float32"]
    argv += ["--max-new-tokens", str(max_new_tokens), "--temperature", "0", *method]
    if tp > 1:
        argv = ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={tp}", *argv]
        argv += ["--tp", str(tp)]
    env = dict(
        os.environ,
        OMP_NUM_THREADS="1",
        PYTHONPATH=os.pathsep.join([ROOT, os.path.join(ROOT, "python")]),
    )
    out = subprocess.run(
        [sys.executable, *argv], env=env, capture_output=True, text=True, timeout=900
    )
    if out.returncode:
        raise SystemExit(f"tp {tp} {method} failed:\n{out.stderr[-3000:]}")
    return float(re.search(r"tokens/s\s+([\d.]+)", out.stdout).group(1))


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tp", type=int, default=3)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--json")
    args = p.parse_args()
    methods = {"plain": ["--method", "plain"], "adaptive": ["--tree", "adaptive"]}
    rates = {(m, tp): [] for m in methods for tp in (1, args.tp)}
    loads = []
    for r in range(args.rounds):
        for (m, tp), xs in rates.items():
            loads.append(os.getloadavg()[0])
            xs.append(launch(tp, methods[m], args.max_new_tokens))
            print(f"round {r}: {m} --tp {tp}: {xs[-1]:.1f} tokens/s", flush=True)
    rows = [
        {"method": m, "tp": tp, "tokens_per_s": statistics.median(xs), "runs": xs}
        for (m, tp), xs in rates.items()
    ]
    for row in rows:
        print(f"{row['method']:9s} --tp {row['tp']}: {row['tokens_per_s']:.1f} tokens/s (median)")
    if args.json:
        sys.path.insert(0, os.path.join(ROOT, "python"))
        import torch

        from specdec.bench.common import machine_info

        info = machine_info(torch.device("cpu"))
        info.update(
            date_utc=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            load_1min=[round(x, 2) for x in loads],
            command=" ".join(["python benchmarks/bench_tp.py", *sys.argv[1:]]),
            prompt=PROMPT,
            max_new_tokens=args.max_new_tokens,
            backend="gloo (CPU), OMP_NUM_THREADS=1 per rank",
        )
        with open(args.json, "w") as f:
            json.dump({"info": info, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
