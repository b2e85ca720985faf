"""Microbenchmark of build_tree_mask: our kernels vs the naive reference (a Python walk), same
inputs.

Full random trees of T nodes for B requests. Byte floor: parents and num_nodes read once,
the packed mask (int64 [B, T, ceil(T/64)]) and depths written once; at these sizes the op
is launch-bound on a GPU, so the bandwidth fraction is reported but has no goal there.
Goal: CPU ours >= 3x naive (docs/benchmarks.md, Ops).

    python benchmarks/bench_build_tree_mask.py [--quick] [--device cpu|cuda] [--json PATH]
"""

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import BenchRun, bench_parser, goal_status  # noqa: E402

import specdec_kernels as sk  # noqa: E402
from specdec_kernels.testing import random_trees, rotated_inputs, time_fn  # noqa: E402


def floor_bytes(B, T):
    """parents + num_nodes read, mask + depth written."""
    return B * T * 4 + B * 4 + B * T * ((T + 63) // 64) * 8 + B * T * 4


def bench_one(run, B, T):
    parents, num_nodes = random_trees(B, T, "random", full=True)
    args = (parents.to(run.device), num_nodes.to(run.device))
    floor = floor_bytes(B, T)
    sets = rotated_inputs(args, floor, run.device)
    row = {"B": B, "T": T, "copies": len(sets)}
    expected = sk.reference.build_tree_mask(*args)
    # The reference walks every node in Python (a host sync per node on CUDA): few iterations.
    naive = time_fn(sk.reference.build_tree_mask, 0, 3, run.device, sets)
    row["naive_us"] = naive * 1e6
    fns = run.time_backends(
        row, sk.build_tree_mask, sets, naive, floor, 3, 30 if run.device.type == "cpu" else 100
    )
    for b, fn in fns.items():
        row[f"{b}_same_as_naive"] = all(torch.equal(g, e) for g, e in zip(fn(*args), expected))
        row[f"{b}_goal"] = goal_status(
            row[f"{b}_speedup"] >= 3 if run.device.type == "cpu" else None
        )
    run.add(row)


def main():
    opts = bench_parser(__doc__).parse_args()
    cuda = opts.device.startswith("cuda")
    if opts.quick:
        shapes = [(1, 8), (16, 64)]
    else:
        shapes = [(B, T) for B in ((1, 16, 64, 128) if cuda else (1, 16, 64)) for T in (8, 32, 64)]
    run = BenchRun(opts, "build_tree_mask")
    for B, T in shapes:
        bench_one(run, B, T)
    columns = ["B", "T", "naive_us"]
    for b in run.backends:
        columns += [
            f"{b}_us",
            f"{b}_speedup",
            f"{b}_frac_copy_bw",
            f"{b}_same_as_naive",
            f"{b}_goal",
        ]
    run.finish(columns)


if __name__ == "__main__":
    main()
