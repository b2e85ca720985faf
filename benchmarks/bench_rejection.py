"""Microbenchmark of tree_rejection_sample: our kernel vs the naive reference, same inputs.

Full random "bushy" draft trees of T nodes with point-mass drafts and float32 target logits
(randn * 2). The first child of each node carries a token that the target favours at that
node with probability 0.8 (its logit is raised by 16), so walks accept a few nodes as
with a good drafter; the mean number of visited rows is reported. Modes: greedy, and
temperature 0.8 with top_k 50 or top_p 0.9.

    python benchmarks/bench_rejection.py             # default sweep (a few minutes on CPU)
    python benchmarks/bench_rejection.py --quick     # a few shapes, for a smoke test
    python benchmarks/bench_rejection.py --threads 1 # one CPU thread for both (steadier on a busy box)
    python benchmarks/bench_rejection.py --device cuda --backends cpp,triton
"""
import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))

import specdec_kernels as sk  # noqa: E402
from common import print_table, time_fn, write_json  # noqa: E402
from trees import random_trees  # noqa: E402

MODES = {"greedy": (0.0, 0, 1.0), "top_k50": (0.8, 50, 1.0), "top_p0.9": (0.8, 0, 0.9)}
PLANT_PROB, PLANT_BOOST = 0.8, 16.0


def make_inputs(B, T, V, mode, device):
    """Arguments of tree_rejection_sample (draft_probs None) for B requests."""
    parents, num_nodes = random_trees(B, T, "bushy", full=True)
    logits = torch.randn(B, T, V) * 2
    draft = torch.randint(0, V, (B, T), dtype=torch.int32)
    for b in range(B):
        seen = set()
        for c in range(1, T):
            u = int(parents[b, c])
            if u not in seen and torch.rand(()) < PLANT_PROB:  # first child of u: the favoured token
                logits[b, u, int(draft[b, c])] += PLANT_BOOST
            seen.add(u)
    temperature, top_k, top_p = MODES[mode]
    args = (logits, draft, parents, num_nodes, None, torch.full((B,), temperature),
            torch.full((B,), top_k, dtype=torch.int32), torch.full((B,), top_p), torch.rand(B, T + 1))
    return tuple(a.to(device) if a is not None else None for a in args)


def sweep(quick, device):
    if quick:
        return [(1, 8, 32000), (8, 32, 128256)]
    return [(B, T, V) for V in (32000, 128256) for B in (1, 8, 32) for T in (8, 32)]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--backends", default="cpp", help="comma list of cpp,triton")
    ap.add_argument("--json", default=None, help="default benchmarks/out/rejection_<device>.json")
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    dev = torch.device(args.device)
    backends = args.backends.split(",")
    rows = []
    for B, T, V in sweep(args.quick, dev):
        for mode in MODES:
            inputs = make_inputs(B, T, V, mode, dev)
            row = {"B": B, "T": T, "V": V, "mode": mode}
            # The reference walks in Python and sorts every visited row: few iterations.
            naive = time_fn(lambda: sk.reference.tree_rejection_sample(*inputs), warmup=1, iters=3,
                            device=dev)
            row["naive_ms"] = naive * 1e3
            for backend in backends:
                fn = lambda: sk.tree_rejection_sample(*inputs, backend=backend)  # noqa: E731
                t = time_fn(fn, warmup=2, iters=10, device=dev)
                row[f"{backend}_ms"] = t * 1e3
                row[f"{backend}_speedup"] = naive / t
            row["rows_visited"] = float(fn()[1].float().mean()) + 1
            rows.append(row)
            print_table(rows[-1:], list(row))
    print()
    columns = ["B", "T", "V", "mode", "rows_visited", "naive_ms"]
    columns += [f"{b}_{k}" for b in backends for k in ("ms", "speedup")]
    print_table(rows, columns)
    path = args.json or os.path.join(os.path.dirname(os.path.abspath(__file__)), "out",
                                     f"rejection_{dev.type}.json")
    write_json(path, rows, {"device": args.device, "threads": torch.get_num_threads(),
                            "logits_dtype": "float32", "draft_probs": None})


if __name__ == "__main__":
    main()
