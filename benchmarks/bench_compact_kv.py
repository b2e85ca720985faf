"""Microbenchmark of compact_kv: ours (one call, all layers) against the naive PyTorch reference.

The cache holds `--context` committed positions per request plus a draft tree of T nodes;
each request accepts a random root path of `accepted` nodes (the worst case: deepest
accepted node at the end of the tree, so every accepted row moves).

    python benchmarks/bench_compact_kv.py [--quick] [--device cpu|cuda] [--json PATH]
"""
import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import specdec_kernels as sk  # noqa: E402
from common import print_table, time_fn, write_json  # noqa: E402

L, HKV, D, BS = 32, 8, 128, 16


def make_case(B, context, T, accepted, dtype, device):
    blocks_per_seq = (context + T + BS - 1) // BS
    num_blocks = B * blocks_per_seq
    k = torch.randn(L, num_blocks, BS, HKV, D, dtype=dtype, device=device)
    v = torch.randn_like(k)
    block_table = torch.randperm(num_blocks, device=device).view(B, blocks_per_seq).int()
    cache_lens = torch.full((B,), context, dtype=torch.int32, device=device)
    # path 0 -> T-accepted+1 -> ... -> T-1: accepted nodes sit at the end, all rows move
    path = torch.cat([torch.zeros(1, dtype=torch.int32), torch.arange(T - accepted + 1, T, dtype=torch.int32)])
    acc = torch.full((B, T), -1, dtype=torch.int32)
    acc[:, :accepted] = path
    num_acc = torch.full((B,), accepted - 1, dtype=torch.int32)
    return k, v, block_table, cache_lens, acc.to(device), num_acc.to(device)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--backends", default="cpp", help="comma list of cpp,triton")
    ap.add_argument("--json", default="benchmarks/out/compact_kv_%s.json")
    args = ap.parse_args()
    dev = torch.device(args.device)
    batches = [1, 16] if args.quick else ([1, 8, 16] if dev.type == "cpu" else [1, 8, 64, 128])
    context = 256 if dev.type == "cpu" else 2048
    rows = []
    for dtype in (torch.bfloat16,):
        for B in batches:
            for T, accepted in ((8, 4), (64, 8)):
                case = make_case(B, context, T, accepted, dtype, dev)
                row = {"B": B, "layers": L, "T": T, "accepted": accepted, "dtype": str(dtype).split(".")[-1]}
                naive = time_fn(lambda: sk.reference.compact_kv(*case), warmup=1, iters=5, device=dev)
                row["naive_us"] = naive * 1e6
                for backend in args.backends.split(","):
                    t = time_fn(lambda: sk.compact_kv(*case, backend=backend), warmup=3, iters=30, device=dev)
                    row[f"{backend}_us"] = t * 1e6
                    row[f"{backend}_speedup"] = naive / t
                    # bytes moved: read + write of every moved row, K and V, all layers
                    moved = 2 * 2 * L * B * (accepted - 1) * HKV * D * case[0].element_size()
                    row[f"{backend}_GBps"] = moved / t / 1e9
                rows.append(row)
    cols = list(rows[0].keys())
    print_table(rows, cols)
    write_json(args.json.replace("%s", dev.type) if "%s" in args.json else args.json, rows,
               {"op": "compact_kv", "device": args.device, "context": context, "Hkv": HKV, "D": D,
                "block_size": BS})


if __name__ == "__main__":
    main()
