"""The CPU decode step with its packed bf16 tiles in 4 KB pages (SPECDEC_HUGE_PAGES=0) against
2 MB pages (specdec.host_memory, the default where the kernel has transparent huge pages): two
copies of the default model (SmolLM2-135M, bf16, the decode path's defaults), each packed under
its setting, verify steps of T nodes over --ctx cached tokens interleaved pair by pair (the
order alternating), and the step's 121 linears alone over each copy's own tiles. Reports the
medians and the median and quartiles of the per-pair ratios (the shared machine drifts; a pair
does not).

    OMP_NUM_THREADS=2 PYTHONPATH=.:python python benchmarks/bench_huge_pages.py --threads 2 \
        --json benchmarks/results/huge_pages_t2.json
"""

import argparse
import os
import statistics
import time

import torch
from common import write_json

from specdec import host_memory
from specdec.drafters.plain import PlainDrafter
from specdec.engine import Engine
from specdec.loader import load_model
from specdec.packed_linear import PackedLinear
from specdec_kernels import ops

SETTINGS = {"4K": "0", "2M": "1"}


def ratio_summary(base: list, other: list) -> dict:
    """Medians of each and of the per-pair ratios other / base, with their quartiles."""
    ratios = [b / a for a, b in zip(base, other)]
    q1, med, q3 = statistics.quantiles(ratios, n=4)
    return {
        "4K_ms": round(statistics.median(base) * 1e3, 2),
        "2M_ms": round(statistics.median(other) * 1e3, 2),
        "ratio_median": round(statistics.median(ratios), 3),
        "ratio_quartiles": [round(q1, 3), round(q3, 3)],
    }


def time_pairs(calls: dict, pairs: int) -> dict:
    """{name: fn} -> {name: seconds of each call}: the calls interleaved, `pairs` rounds, the
    order alternating (the shared machine drifts; a round does not)."""
    times: dict = {name: [] for name in calls}
    for i in range(pairs):
        for name in calls if i % 2 == 0 else reversed(calls):
            t0 = time.perf_counter()
            calls[name]()
            times[name].append(time.perf_counter() - t0)
    return times


def packed_tiles(model) -> list:
    """[(tiles, out_features, in_features)] of the model's linears packed as tiles."""
    return [
        (m._pack._packed["tiles"], m.weight.shape[0], m.weight.shape[1])
        for m in model.modules()
        if isinstance(m, PackedLinear) and "tiles" in m._pack._packed
    ]


def step_args(T, cache):
    """A verify step's arguments: a chain of T nodes over cache's slot 0."""
    parents = torch.arange(-1, T - 1, dtype=torch.int32)[None]
    num_nodes = torch.full((1,), T, dtype=torch.int32)
    mask, depth = ops.build_tree_mask(parents, num_nodes)
    tokens = torch.randint(0, 49152, (1, T))
    return tokens, cache, torch.arange(1), num_nodes, mask, depth


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--ctx", type=int, default=256)
    p.add_argument("--trees", default="1,4,6")
    p.add_argument("--pairs", type=int, default=40, help="interleaved pairs per measurement")
    p.add_argument("--json", default=None)
    opts = p.parse_args()
    torch.set_num_threads(opts.threads)
    if not host_memory.supported():
        raise SystemExit("no transparent huge pages here: nothing to compare")
    trees = [int(t) for t in opts.trees.split(",")]
    models = {}
    for name, setting in SETTINGS.items():
        os.environ["SPECDEC_HUGE_PAGES"] = setting
        model, tok = load_model(None, dtype=torch.bfloat16, device=torch.device("cpu"))
        # the engine configures the decode path, as `specdec generate` does
        Engine(model, tok, drafter=PlainDrafter(), tree="chain:1", batch_size=1, max_seq_len=512)
        cache = model.new_cache(1, opts.ctx + max(trees))
        cache.cache_lens.fill_(opts.ctx)
        models[name] = (model, cache)
        with torch.inference_mode():  # packs the tiles (on first use), under this setting
            for T in trees:
                model(*step_args(T, cache))
    del os.environ["SPECDEC_HUGE_PAGES"]
    linears = {name: packed_tiles(model) for name, (model, _) in models.items()}
    in_arena = {
        name: sum(t.untyped_storage().nbytes() >= host_memory.CHUNK_BYTES for t, _, _ in tiles)
        for name, tiles in linears.items()
    }
    print("linears with their tiles in 2 MB pages:", in_arena)
    assert in_arena["4K"] == 0 and in_arena["2M"] > 0

    rows = []
    with torch.inference_mode():
        for T in trees:
            args = {name: step_args(T, cache) for name, (_, cache) in models.items()}
            times = time_pairs(
                {name: lambda name=name, a=args: models[name][0](*a[name]) for name in models},
                opts.pairs,
            )
            row = {"what": "verify step", "T": T, "ctx": opts.ctx, "threads": opts.threads}
            row.update(ratio_summary(times["4K"], times["2M"]))
            rows.append(row)
            print(row, flush=True)
        # the linears alone, over each copy's own tiles
        xs = {k: torch.randn(1, k, dtype=torch.bfloat16) for _, _, k in linears["4K"]}

        def products(name):
            for tiles, n, k in linears[name]:
                torch.ops.specdec.tiled_linear(xs[k], tiles, n, None)

        times = time_pairs({name: lambda name=name: products(name) for name in models}, opts.pairs)
        mb = sum(t.numel() * t.element_size() for t, _, _ in linears["4K"]) / 1e6
        row = {"what": "linears, 1 row", "linears": len(linears["4K"]), "weight_mb": round(mb)}
        row.update(ratio_summary(times["4K"], times["2M"]))
        row["threads"] = opts.threads
        rows.append(row)
        print(row, flush=True)
    if opts.json:
        write_json(opts.json, rows, {"bench": "huge_pages", "dtype": "bfloat16"})


if __name__ == "__main__":
    main()
