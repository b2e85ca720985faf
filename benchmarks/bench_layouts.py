"""CPU benchmark of tree_verify and compact_kv on each engine's KV-cache layout (read through
strides) against the contiguous cache of the same geometry.

Layouts (specdec_kernels.testing.KV_LAYOUTS): vLLM FlashAttention [2, NB, bs, Hkv, D],
vLLM / FlashInfer NHD [NB, 2, bs, Hkv, D] and HND [NB, 2, Hkv, bs, D] (block size 16),
SGLang token pool [tokens, Hkv, D] (block size 1, against a contiguous block-size-1 cache),
transformers [B, Hkv, S, D] (one block per request, against a contiguous [B, S, Hkv, D]);
"qkv_slice" is the contiguous paged cache with q sliced out of a fused QKV output.
Shapes: SmolLM2-135M (Hq 9 / Hkv 3 / D 64) and a Llama-8B-like head (Hq 32 / Hkv 8 /
D 128), float32; B = 2, context 512 and 2048, T = 1 and 32 (a chain). tree_verify runs one
layer; compact_kv moves a worst-case root path of min(T, 8) nodes in 4 layers, K and V.

Variants are interleaved in one process (round r times every variant once, in a rotating
order); a row's time is the median over the rounds, its ratio the median over the rounds
of (layout / its contiguous baseline) timed in the same round (goal <= 1.15, docs/benchmarks.md).
"contiguous_again" is a second, identical contiguous cache: its ratio is pure noise and
shows how far the others can be trusted on a loaded machine. Record the machine load
beside the figures (the JSON keeps it).

    python benchmarks/bench_layouts.py [--quick] [--rounds N] [--json PATH]
"""

import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import BenchRun, bench_parser, goal_status  # noqa: E402

import specdec_kernels as sk  # noqa: E402
from specdec_kernels import reference  # noqa: E402
from specdec_kernels.testing import kv_layout  # noqa: E402

B, BS = 2, 16
# Hq, Hkv, D, layers: compact_kv's time is linear in the layers and independent of the cache
# size, so 4 layers stand for the model's 30 / 32 (9 variants of the cache fit in memory).
MODELS = {"smollm2": (9, 3, 64, 4), "llama8b": (32, 8, 128, 4)}
GOAL = 1.15
# variant -> (layout, geometry): "paged" (block size 16), "token" (1), "request" (S)
VARIANTS = {
    "contiguous": ("contiguous", "paged"),
    "contiguous_again": ("contiguous", "paged"),  # A/A control: the noise floor of a ratio
    "vllm_flash": ("vllm_flash", "paged"),
    "flashinfer_nhd": ("flashinfer_nhd", "paged"),
    "flashinfer_hnd": ("flashinfer_hnd", "paged"),
    "qkv_slice": ("contiguous", "paged"),
    "contiguous_bs1": ("contiguous", "token"),
    "sglang_pool": ("sglang_pool", "token"),
    "contiguous_per_request": ("contiguous", "request"),
    "transformers": ("transformers", "request"),
}
BASELINE = {"paged": "contiguous", "token": "contiguous_bs1", "request": "contiguous_per_request"}


def geometry(kind, S):
    """(num_blocks, block_size, block_table [B, max_blocks]) for S positions per request."""
    if kind == "request":
        return B, S, torch.arange(B, dtype=torch.int32)[:, None]
    bs = BS if kind == "paged" else 1
    per_seq = (S + bs - 1) // bs
    NB = B * per_seq
    return NB, bs, torch.randperm(NB).view(B, per_seq).int()


def make_inputs(variant, Hq, Hkv, D, L, ctx, T):
    """tree_verify and compact_kv arguments (per-layer caches for tree_verify, all layers for
    compact_kv) of one variant; the same random tree and path for every variant."""
    layout, kind = VARIANTS[variant]
    NB, bs, table = geometry(kind, ctx + T)
    tensors, views = kv_layout(layout, (L,), NB, bs, Hkv, D, torch.float32)
    k_all, v_all = views(tensors)
    if variant == "qkv_slice":
        q = torch.randn(B, T, (Hq + 2 * Hkv) * D)[..., : Hq * D].view(B, T, Hq, D)
    else:
        q = torch.randn(B, T, Hq, D)
    parents = torch.arange(-1, T - 1, dtype=torch.int32).repeat(B, 1)  # chains
    num_nodes = torch.full((B,), T, dtype=torch.int32)
    tree_mask, _ = reference.build_tree_mask(parents, num_nodes)
    cache_lens = torch.full((B,), ctx, dtype=torch.int32)
    verify = (q, k_all[0], v_all[0], table, cache_lens, num_nodes, tree_mask, D**-0.5)
    acc = min(T, 8)
    path = torch.cat([torch.zeros(1, dtype=torch.int32), torch.arange(T - acc + 1, T)]).int()
    accepted = torch.full((B, T), -1, dtype=torch.int32)
    accepted[:, :acc] = path
    num_acc = torch.full((B,), acc - 1, dtype=torch.int32)
    compact = (k_all, v_all, table, cache_lens, accepted, num_acc)
    return verify, compact


def interleaved_times(calls, rounds, reps):
    """{name: [seconds per call in round r]}: each round times every call `reps` times back
    to back, the order rotating from round to round."""
    names = list(calls)
    times = {n: [] for n in names}
    for fn in calls.values():  # warm-up
        fn()
    for r in range(rounds):
        for n in names[r % len(names) :] + names[: r % len(names)]:
            t0 = time.perf_counter()
            for _ in range(reps):
                calls[n]()
            times[n].append((time.perf_counter() - t0) / reps)
    return times


def paired_ratio(times, name, base):
    """Median over the rounds of times[name][r] / times[base][r]."""
    return statistics.median(a / b for a, b in zip(times[name], times[base], strict=True))


def main():
    ap = bench_parser(__doc__)
    ap.add_argument("--rounds", type=int, default=None, help="interleaved rounds (default 40)")
    opts = ap.parse_args()
    run = BenchRun(opts, "layouts", meta={"goal": f"layout / contiguous <= {GOAL}"})
    rounds = opts.rounds or (5 if opts.quick else 40)
    contexts, trees = ((512,), (1, 32)) if opts.quick else ((512, 2048), (1, 32))
    for model, (Hq, Hkv, D, L) in MODELS.items():
        for ctx in contexts:
            for T in trees:
                torch.manual_seed(0)
                inputs = {v: make_inputs(v, Hq, Hkv, D, L, ctx, T) for v in VARIANTS}
                verify = {v: (lambda a=a[0]: sk.tree_verify(*a)) for v, a in inputs.items()}
                compact = {v: (lambda a=a[1]: sk.compact_kv(*a)) for v, a in inputs.items()}
                t_verify = interleaved_times(verify, rounds, reps=3)
                t_compact = interleaved_times(compact, rounds, reps=20)
                for v, (_, kind) in VARIANTS.items():
                    base = BASELINE[kind]
                    row = {
                        "model": model,
                        "context": ctx,
                        "T": T,
                        "layout": v,
                        "baseline": base,
                        "verify_us": statistics.median(t_verify[v]) * 1e6,
                        "verify_ratio": paired_ratio(t_verify, v, base),
                        "compact_us": statistics.median(t_compact[v]) * 1e6,
                        "compact_ratio": paired_ratio(t_compact, v, base),
                        "load_1min": os.getloadavg()[0],
                    }
                    worst = max(row["verify_ratio"], row["compact_ratio"])
                    control = v == base or v == "contiguous_again"
                    row["goal"] = goal_status(None if control else worst <= GOAL)
                    run.add(row)
    run.finish(
        [
            "model",
            "context",
            "T",
            "layout",
            "baseline",
            "verify_us",
            "verify_ratio",
            "compact_us",
            "compact_ratio",
            "load_1min",
            "goal",
        ]
    )


if __name__ == "__main__":
    main()
