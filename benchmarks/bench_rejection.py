"""Microbenchmark of tree_rejection_sample: our kernels vs the naive reference, same inputs.

Full random "bushy" draft trees of T nodes with float32 target logits (randn * 2). The
first child of each node carries a token that the target favours at that node with
probability 0.8 (its logit is raised by 16), so walks accept a few nodes as with a good
drafter. Modes: greedy; temperature 0.8 with top_k 50 or top_p 0.9 (point-mass drafts);
temperature 0.8 with draft_probs (softmax of random draft logits), whose rejections
subtract the draft distribution from the residual.

Byte floor: each row the walk visits (num_accepted + 1 per request, reported by the op)
read once, V float32 logits, plus the draft_probs row of each visited node that has
children (the only ones a test reads). `rows_visited` is its mean per request.
Goals (docs/benchmarks.md, Ops): CPU ours >= 3x naive; CUDA at V >= 128k, >= 10x naive and
>= 50% of the copy bandwidth.

    python benchmarks/bench_rejection.py             # default CPU sweep (a few minutes)
    python benchmarks/bench_rejection.py --quick     # a few shapes, for a smoke test
    python benchmarks/bench_rejection.py --threads 1 # one CPU thread for both (steadier)
    python benchmarks/bench_rejection.py --device cuda
"""

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import BenchRun, bench_parser, goal_status  # noqa: E402

import specdec_kernels as sk  # noqa: E402
from specdec_kernels.testing import random_trees, rotated_inputs, time_fn  # noqa: E402

# mode: (temperature, top_k, top_p, with draft_probs)
MODES = {
    "greedy": (0.0, 0, 1.0, False),
    "top_k50": (0.8, 50, 1.0, False),
    "top_p0.9": (0.8, 0, 0.9, False),
    "draft_probs": (0.8, 0, 1.0, True),
}
PLANT_PROB, PLANT_BOOST = 0.8, 16.0


def plant(parents, V):
    """(b, node, child) index lists: the first child of a node is favoured with probability
    PLANT_PROB."""
    B, T = parents.shape
    bs, us, cs = [], [], []
    for b in range(B):
        seen = set()
        for c in range(1, T):
            u = int(parents[b, c])
            if u not in seen and torch.rand(()) < PLANT_PROB:
                bs.append(b), us.append(u), cs.append(c)
            seen.add(u)
    return (
        torch.tensor(bs, dtype=torch.long),
        torch.tensor(us, dtype=torch.long),
        torch.tensor(cs, dtype=torch.long),
    )


def make_inputs(B, T, V, mode, device):
    """Arguments of tree_rejection_sample for B requests; the [B, T, V] tensors are drawn on the
    device."""
    temperature, top_k, top_p, with_probs = MODES[mode]
    parents, num_nodes = random_trees(B, T, "bushy", full=True)
    draft = torch.randint(0, V, (B, T), dtype=torch.int32)
    logits = torch.randn(B, T, V, device=device) * 2
    b, u, c = plant(parents, V)
    logits[b.to(device), u.to(device), draft[b, c].long().to(device)] += PLANT_BOOST
    probs = torch.softmax(torch.randn(B, T, V, device=device), -1) if with_probs else None
    small = (draft, parents, num_nodes)
    params = (
        torch.full((B,), temperature),
        torch.full((B,), top_k, dtype=torch.int32),
        torch.full((B,), top_p),
        torch.rand(B, T + 1),
    )
    return (
        (logits,)
        + tuple(a.to(device) for a in small)
        + (probs,)
        + tuple(a.to(device) for a in params)
    )


def visited_rows(parents, accepted_nodes, num_accepted):
    """(rows the walk visited, of them the ones with children) summed over requests."""
    parents, acc, n = parents.cpu(), accepted_nodes.cpu(), num_accepted.cpu()
    B, T = parents.shape
    has_child = torch.zeros(B, T, dtype=torch.bool)
    rows = torch.arange(B)[:, None].expand(B, T - 1)
    has_child[rows[parents[:, 1:] >= 0], parents[:, 1:][parents[:, 1:] >= 0].long()] = True
    visited = sum(int(n[b]) + 1 for b in range(B))
    inner = sum(int(has_child[b, acc[b, : int(n[b]) + 1].long()].sum()) for b in range(B))
    return visited, inner


def floor_bytes(inputs, outputs):
    logits, probs = inputs[0], inputs[4]
    visited, inner = visited_rows(inputs[2], outputs[0], outputs[1])
    V = logits.shape[-1]
    return visited * V * logits.element_size() + (
        inner * V * probs.element_size() if probs is not None else 0
    )


def add_goals(row, run):
    for b in run.backends:
        speedup = row[f"{b}_speedup"]
        if run.device.type == "cpu":
            row[f"{b}_goal"] = goal_status(speedup >= 3)
            continue
        large_v = row["V"] >= 128000
        row[f"{b}_vs_naive_goal"] = goal_status(speedup >= 10 if large_v else None)
        row[f"{b}_bw_goal"] = goal_status(row[f"{b}_frac_copy_bw"] >= 0.5 if large_v else None)


def bench_one(run, B, T, V, mode):
    inputs = make_inputs(B, T, V, mode, run.device)
    expected = sk.reference.tree_rejection_sample(*inputs)
    floor = floor_bytes(inputs, expected)
    sets = rotated_inputs(inputs, floor, run.device)
    row = {
        "B": B,
        "T": T,
        "V": V,
        "mode": mode,
        "rows_visited": int(expected[1].sum() + B) / B,
        "copies": len(sets),
        "floor_MB": floor / 1e6,
    }
    # The reference walks in Python (host syncs on CUDA) and sorts visited rows: few iterations.
    naive = time_fn(sk.reference.tree_rejection_sample, 0, 3, run.device, sets)
    row["naive_ms"] = naive * 1e3
    fns = run.time_backends(
        row,
        sk.tree_rejection_sample,
        sets,
        naive,
        floor,
        2,
        10 if run.device.type == "cpu" else 50,
        unit="ms",
    )
    for b, fn in fns.items():
        got = fn(*sets[0])  # same uniforms: the exact rule must give the reference's walk
        row[f"{b}_same_as_naive"] = all(
            torch.equal(g.cpu(), e.cpu()) for g, e in zip(got, expected)
        )
    add_goals(row, run)
    run.add(row)


def shapes(quick, cuda):
    if quick:
        return [(1, 8, 32000), (8, 32, 128256)]
    if cuda:
        return [(B, T, V) for V in (32000, 128256, 151936) for B in (1, 32, 128) for T in (8, 64)]
    return [(B, T, V) for V in (32000, 128256) for B in (1, 8, 32) for T in (8, 32)]


def main():
    ap = bench_parser(__doc__)
    ap.add_argument("--modes", default=",".join(MODES), help="comma list of " + ",".join(MODES))
    opts = ap.parse_args()
    run = BenchRun(
        opts,
        "rejection",
        {
            "logits_dtype": "float32",
            "tree": "bushy, full",
            "plant_prob": PLANT_PROB,
            "plant_boost": PLANT_BOOST,
        },
    )
    for B, T, V in shapes(opts.quick, run.device.type == "cuda"):
        for mode in opts.modes.split(","):
            bench_one(run, B, T, V, mode)
    columns = ["B", "T", "V", "mode", "rows_visited", "naive_ms"]
    for b in run.backends:
        columns += [
            f"{b}_ms",
            f"{b}_speedup",
            f"{b}_frac_copy_bw",
            f"{b}_same_as_naive",
            f"{b}_goal",
            f"{b}_vs_naive_goal",
            f"{b}_bw_goal",
        ]
    run.finish(columns)


if __name__ == "__main__":
    main()
