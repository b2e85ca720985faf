"""Microbenchmark of tree_verify: our kernel vs the naive reference (gather + dense mask + SDPA).

Both run on the same inputs: full random trees of T nodes, a prefix of `context`
positions per request in a paged cache (block_size 16, shuffled block table),
Hq = 32 query heads over Hkv = 8 KV heads, D = 128.

    python benchmarks/bench_tree_verify.py            # default sweep (a couple of minutes on CPU)
    python benchmarks/bench_tree_verify.py --quick    # a few shapes, for a smoke test
    python benchmarks/bench_tree_verify.py --device cuda --backend triton
"""
import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))

import specdec_kernels as sk  # noqa: E402
from common import print_table, time_fn, write_json  # noqa: E402
from trees import random_block_table, random_trees  # noqa: E402

HQ, HKV, D, BLOCK_SIZE = 32, 8, 128, 16
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

# (B, T, context): one axis at a time around (4, 32, 2048), plus the corners that matter
# for decoding (a single long request; many short ones). The full cross product of
# B in {1, 4, 16}, T in {8, 32, 64}, context in {512, 2048, 8192} is --full.
DEFAULT_SHAPES = [
    (1, 8, 512), (1, 32, 2048), (1, 64, 8192),
    (4, 8, 2048), (4, 32, 512), (4, 32, 2048), (4, 64, 2048), (4, 32, 8192),
    (16, 8, 2048), (16, 32, 512),
]
QUICK_SHAPES = [(1, 8, 512), (4, 32, 2048)]


def make_inputs(B, T, context, dtype, device):
    """Arguments of tree_verify (without sm_scale) for B requests of `context` cached positions."""
    parents, num_nodes = random_trees(B, T, "random", full=True)
    tree_mask, _ = sk.build_tree_mask(parents, num_nodes)
    blocks_per_seq = (context + T + BLOCK_SIZE - 1) // BLOCK_SIZE
    num_blocks = B * blocks_per_seq
    block_table = random_block_table(B, blocks_per_seq, num_blocks)
    cache_lens = torch.full((B,), context, dtype=torch.int32)
    q = torch.randn(B, T, HQ, D, dtype=dtype)
    k_cache = torch.randn(num_blocks, BLOCK_SIZE, HKV, D, dtype=dtype)
    v_cache = torch.randn(num_blocks, BLOCK_SIZE, HKV, D, dtype=dtype)
    args = (q, k_cache, v_cache, block_table, cache_lens, num_nodes, tree_mask)
    return tuple(a.to(device) for a in args)


def bench_one(B, T, context, dtype_name, device, backend, warmup, iters):
    args = make_inputs(B, T, context, DTYPES[dtype_name], device)
    scale = D ** -0.5
    ours = time_fn(lambda: sk.tree_verify(*args, scale, backend=backend), warmup, iters, device)
    naive = time_fn(lambda: sk.reference.tree_verify(*args, scale), warmup, iters, device)
    return {
        "B": B, "T": T, "context": context, "dtype": dtype_name,
        "Hq": HQ, "Hkv": HKV, "D": D, "block_size": BLOCK_SIZE,
        "ours_ms": ours * 1e3, "naive_ms": naive * 1e3, "speedup": naive / ours,
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="two small shapes, one timed iteration pass")
    parser.add_argument("--full", action="store_true", help="the full B x T x context cross product")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--backend", default="cpp", choices=["cpp", "triton"])
    parser.add_argument("--dtypes", default="float32,bfloat16", help="comma separated: " + ",".join(DTYPES))
    parser.add_argument("--json", default=None,
                        help="output path (default benchmarks/out/tree_verify_<device>.json)")
    opts = parser.parse_args()

    if opts.quick:
        shapes, warmup, iters = QUICK_SHAPES, 1, 3
    elif opts.full:
        shapes, warmup, iters = [(b, t, c) for b in (1, 4, 16) for t in (8, 32, 64)
                                 for c in (512, 2048, 8192)], 2, 5
    else:
        shapes, warmup, iters = DEFAULT_SHAPES, 2, 7
    torch.manual_seed(0)
    rows = []
    for dtype_name in opts.dtypes.split(","):
        for B, T, context in shapes:
            row = bench_one(B, T, context, dtype_name, opts.device, opts.backend, warmup, iters)
            rows.append(row)
            print(f"  B={B} T={T} context={context} {dtype_name}: ours {row['ours_ms']:.2f} ms, "
                  f"naive {row['naive_ms']:.2f} ms", flush=True)
    print_table(rows, ["dtype", "B", "T", "context", "ours_ms", "naive_ms", "speedup"])
    path = opts.json or os.path.join(os.path.dirname(os.path.abspath(__file__)), "out",
                                     f"tree_verify_{torch.device(opts.device).type}.json")
    write_json(path, rows, {"device": opts.device, "backend": opts.backend, "op": "tree_verify",
                            "warmup": warmup, "iters": iters})


if __name__ == "__main__":
    main()
