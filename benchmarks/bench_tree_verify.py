"""Microbenchmark of tree_verify: our kernels vs the naive reference (gather + dense mask + SDPA).

All run on the same inputs: full random trees of T nodes, a prefix of `context`
positions per request in a paged cache (block_size 16, shuffled block table),
Hq = 32 query heads over Hkv = 8 KV heads, D = 128.

Byte floor: K and V of every prefix and tree position, read once per request and KV
head, plus q and the output; `frac_copy_bw` is the achieved floor bandwidth over the
measured copy bandwidth. Goals (docs/benchmarks.md, Ops): CPU ours >= 3x naive at the default
sizes; CUDA at context >= 4k, >= 70% of the copy bandwidth and >= 5x naive.
On CUDA the inputs are rotated through enough copies to defeat the L2, the naive
reference is skipped where its peak memory (gathered K/V, GQA expansion, dense mask,
scores) would not fit, and FlashInfer's paged prefill with a custom mask is timed
beside ours when `flashinfer` can be imported.

    python benchmarks/bench_tree_verify.py            # default CPU sweep (a few minutes)
    python benchmarks/bench_tree_verify.py --quick    # a few shapes, for a smoke test
    python benchmarks/bench_tree_verify.py --device cuda   # cpp and triton, bfloat16
"""

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import BenchRun, bench_parser, goal_status  # noqa: E402
from flashinfer_tree import flashinfer_tree_verify  # noqa: E402

import specdec_kernels as sk  # noqa: E402
from specdec_kernels.testing import (  # noqa: E402
    free_device_bytes,
    random_block_table,
    random_trees,
    rotated_inputs,
    time_fn,
)

HQ, HKV, D, BLOCK_SIZE = 32, 8, 128, 16
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

# CPU (B, T, context): one axis at a time around (4, 32, 2048), plus the corners that matter
# for decoding (a single long request; many short ones). --full: B x T x context cross product.
CPU_SHAPES = [
    (1, 8, 512),
    (1, 32, 2048),
    (1, 64, 8192),
    (4, 8, 2048),
    (4, 32, 512),
    (4, 32, 2048),
    (4, 64, 2048),
    (4, 32, 8192),
    (16, 8, 2048),
    (16, 32, 512),
]
CPU_FULL_SHAPES = [(b, t, c) for b in (1, 4, 16) for t in (8, 32, 64) for c in (512, 2048, 8192)]
CPU_QUICK_SHAPES = [(1, 8, 512), (4, 32, 2048)]
CUDA_SHAPES = [(b, t, c) for b in (1, 16, 64, 128) for t in (8, 64) for c in (1024, 4096, 32768)]
CUDA_QUICK_SHAPES = [(1, 8, 1024), (16, 64, 4096)]
NAIVE_MEMORY_FRACTION = 0.6  # of the free device memory the naive reference may use


def make_inputs(B, T, context, dtype, device):
    """Arguments of tree_verify (without sm_scale) for B requests of `context` cached positions.
    The caches are drawn on the device (GBs at the CUDA sizes); the trees on the host."""
    parents, num_nodes = random_trees(B, T, "random", full=True)
    tree_mask, _ = sk.build_tree_mask(parents, num_nodes)
    blocks_per_seq = (context + T + BLOCK_SIZE - 1) // BLOCK_SIZE
    num_blocks = B * blocks_per_seq
    block_table = random_block_table(B, blocks_per_seq, num_blocks)
    cache_lens = torch.full((B,), context, dtype=torch.int32)
    q = torch.randn(B, T, HQ, D, dtype=dtype, device=device)
    k_cache = torch.randn(num_blocks, BLOCK_SIZE, HKV, D, dtype=dtype, device=device)
    v_cache = torch.randn_like(k_cache)
    small = (block_table, cache_lens, num_nodes, tree_mask)
    return (q, k_cache, v_cache) + tuple(a.to(device) for a in small)


def floor_bytes(B, T, context, dtype):
    """K and V of all prefix + tree positions once per request and KV head, plus q and out."""
    elt = torch.tensor([], dtype=dtype).element_size()
    return 2 * B * (context + T) * HKV * D * elt + 2 * B * T * HQ * D * elt


def naive_peak_bytes(B, T, context, dtype):
    """Rough (generous) peak of the reference: gathered K/V, their fp32 copies and GQA expansion
    (SDPA's math path, taken with a mask, upcasts half types), the [B, T, S] bool masks and the
    additive mask, and fp32 scores + probabilities [B, Hq, T, S]."""
    elt = torch.tensor([], dtype=dtype).element_size()
    S = (context + T + BLOCK_SIZE - 1) // BLOCK_SIZE * BLOCK_SIZE
    kv = 2 * B * S * D * (HKV * (elt + 4) + HQ * 4)
    return kv + 10 * B * T * S + 3 * B * HQ * T * S * 4


def naive_skip_reason(B, T, context, dtype, device):
    """Why the naive reference is not run at this shape, or None."""
    free = free_device_bytes(device)
    need = naive_peak_bytes(B, T, context, dtype)
    if free is not None and need > NAIVE_MEMORY_FRACTION * free:
        return f"skipped: needs ~{need / 2**30:.0f} GiB, {free / 2**30:.0f} GiB free"
    return None


def time_naive(sets, row, warmup, iters, device, scale):
    """Times the reference into row (naive_ms, or naive_note when skipped / out of memory)."""
    B, T, context = row["B"], row["T"], row["context"]
    reason = naive_skip_reason(B, T, context, sets[0][0].dtype, device)
    if reason is None:
        try:
            t = time_fn(lambda *a: sk.reference.tree_verify(*a, scale), warmup, iters, device, sets)
            row["naive_ms"] = t * 1e3
            return sk.reference.tree_verify(*sets[0], scale)
        except torch.cuda.OutOfMemoryError:
            reason = "skipped: out of device memory"
            torch.cuda.empty_cache()
    row["naive_ms"], row["naive_note"] = None, reason
    return None


def time_flashinfer(sets, row, run, warmup, iters, scale):
    """FlashInfer beside ours (CUDA, half types): flashinfer_ms or flashinfer_note."""
    try:
        fn = flashinfer_tree_verify(sets[0], BLOCK_SIZE, scale)
        t = time_fn(fn, warmup, iters, run.device, sets)
    except Exception as e:  # not installed, or an API it does not have: say so in the row
        row["flashinfer_note"] = f"{type(e).__name__}: {e}"[:200]
        return
    row["flashinfer_ms"] = t * 1e3
    row.update(
        run.bandwidth(
            "flashinfer", floor_bytes(row["B"], row["T"], row["context"], sets[0][0].dtype), t
        )
    )


def add_goals(row, run):
    """Goal columns per backend: CPU ours >= 3x naive; CUDA (context >= 4k) bandwidth, speedup."""
    for b in run.backends:
        speedup = row.get(f"{b}_speedup")
        if run.device.type == "cpu":
            row[f"{b}_goal"] = goal_status(None if speedup is None else speedup >= 3)
            continue
        long_context = row["context"] >= 4096
        row[f"{b}_bw_goal"] = goal_status(row[f"{b}_frac_copy_bw"] >= 0.7 if long_context else None)
        row[f"{b}_vs_naive_goal"] = goal_status(speedup >= 5 if long_context and speedup else None)


def bench_one(run, B, T, context, dtype_name, warmup, iters, with_flashinfer):
    dtype = DTYPES[dtype_name]
    args = make_inputs(B, T, context, dtype, run.device)
    floor = floor_bytes(B, T, context, dtype)
    sets = rotated_inputs(args, floor, run.device)
    scale = D**-0.5
    row = {
        "dtype": dtype_name,
        "B": B,
        "T": T,
        "context": context,
        "copies": len(sets),
        "floor_MB": floor / 1e6,
    }
    expected = time_naive(sets, row, warmup, iters, run.device, scale)
    naive = row["naive_ms"] / 1e3 if row["naive_ms"] else None
    fns = run.time_backends(
        row,
        lambda *a, backend: sk.tree_verify(*a, scale, backend=backend),
        sets,
        naive,
        floor,
        warmup,
        iters,
        unit="ms",
    )
    for b, fn in fns.items():
        if expected is not None:  # a sanity check that the timed kernel computes the op
            out = fn(*sets[0])
            row[f"{b}_max_abs_diff"] = float((out.float() - expected.float()).abs().max())
    if with_flashinfer:
        time_flashinfer(sets, row, run, warmup, iters, scale)
    add_goals(row, run)
    run.add(row)


def main():
    ap = bench_parser(__doc__)
    ap.add_argument(
        "--full", action="store_true", help="CPU: the full B x T x context cross product"
    )
    ap.add_argument(
        "--dtypes",
        default=None,
        help="comma list of "
        + ",".join(DTYPES)
        + " (default float32,bfloat16 on CPU, bfloat16 on CUDA)",
    )
    opts = ap.parse_args()
    cuda = opts.device.startswith("cuda")
    if cuda:
        shapes, warmup, iters = (CUDA_QUICK_SHAPES if opts.quick else CUDA_SHAPES), 3, 30
    elif opts.quick:
        shapes, warmup, iters = CPU_QUICK_SHAPES, 1, 3
    else:
        shapes, warmup, iters = (CPU_FULL_SHAPES if opts.full else CPU_SHAPES), 2, 7
    dtypes = (opts.dtypes or ("bfloat16" if cuda else "float32,bfloat16")).split(",")
    run = BenchRun(
        opts,
        "tree_verify",
        {
            "Hq": HQ,
            "Hkv": HKV,
            "D": D,
            "block_size": BLOCK_SIZE,
            "warmup": warmup,
            "iters": iters,
            "tree": "random, full",
        },
    )
    for dtype_name in dtypes:
        for B, T, context in shapes:
            bench_one(
                run,
                B,
                T,
                context,
                dtype_name,
                warmup,
                iters,
                with_flashinfer=cuda and dtype_name != "float32",
            )
    columns = ["dtype", "B", "T", "context", "naive_ms"]
    for b in run.backends:
        columns += [
            f"{b}_ms",
            f"{b}_speedup",
            f"{b}_frac_copy_bw",
            f"{b}_goal",
            f"{b}_bw_goal",
            f"{b}_vs_naive_goal",
        ]
    run.finish(columns + ["flashinfer_ms", "flashinfer_frac_copy_bw"])


if __name__ == "__main__":
    main()
