"""Where one bf16 verify step of the default model goes, by operator class (torch.profiler self
CPU time), for the eager modules, the CPU decode path with the layer ops op by op, and with each
block as one decode_layer call, the linears in oneDNN's layout, then (tiles+decode_layer) in
the tiles' where SPECDEC_TILED_ROWS (auto) takes them, then (tiles+decode_layers, the default)
all blocks as one decode_layers call; "Python and dispatch" is the wall time the
profiled ops do not account for. Wall time is measured apart from the profiled passes.

    OMP_NUM_THREADS=1 PYTHONPATH=.:python python benchmarks/profile_decode_step.py --threads 1
"""

import argparse
import collections
import json
import time

import torch
from common import DECODE_PATHS, configure_decode_path
from torch.profiler import profile

from specdec import packed_linear
from specdec.loader import load_model
from specdec_kernels import ops

# the decode path's steps that change where the time goes (common.DECODE_PATHS)
PROFILED = (
    "eager",
    "prepacked+layer_ops",
    "prepacked+decode_layer",
    "tiles+decode_layer",
    "tiles+decode_layers",
)


def classify(name: str) -> str:
    if "linear" in name or name in ("aten::mm", "aten::addmm", "aten::matmul"):
        return "linear"
    if name in ("specdec::decode_layer", "specdec::decode_layers"):  # own time: layer ops,
        # tree_verify, glue
        return "decode_layer (layer ops + tree_verify)"
    if "tree_verify" in name:
        return "tree_verify"
    if name.startswith("specdec::"):
        return "layer ops"
    if any(k in name for k in ("index_copy", "index_select")):
        return "cache write"
    return "other aten"


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--ctx", type=int, default=256)
    p.add_argument("--trees", default="1,16")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--json", default=None)
    opts = p.parse_args()
    torch.set_num_threads(opts.threads)
    torch.manual_seed(0)
    model, _ = load_model(None, dtype=torch.bfloat16)
    model.compiled_step = False
    cache = model.new_cache(1, opts.ctx + 64)
    slots = torch.tensor([0], dtype=torch.int32)
    model.prefill([torch.randint(0, model.args.vocab_size, (opts.ctx,))], cache, slots)
    rows = []
    for name in PROFILED:
        configure_decode_path(model, *DECODE_PATHS[name])
        for T in [int(t) for t in opts.trees.split(",")]:
            parents = torch.arange(-1, T - 1, dtype=torch.int32)[None]
            num_nodes = torch.tensor([T], dtype=torch.int32)
            mask, depth = ops.build_tree_mask(parents, num_nodes)
            tokens = torch.randint(0, model.args.vocab_size, (1, T))

            args = (tokens, cache, slots, num_nodes, mask, depth)

            def step(args=args):
                model.forward(*args)

            for _ in range(3):
                step()
            t0 = time.perf_counter()
            for _ in range(opts.iters):
                step()
            wall = (time.perf_counter() - t0) / opts.iters * 1e3
            with profile() as prof:
                for _ in range(opts.iters):
                    step()
            by_class: collections.Counter = collections.Counter()
            for e in prof.key_averages():
                by_class[classify(e.key)] += e.self_cpu_time_total / opts.iters / 1e3
            row = {"variant": name, "T": T, "wall_ms": round(wall, 1)}
            row["tiled_rows"] = packed_linear.tiled_rows()
            row.update({k: round(v, 1) for k, v in by_class.most_common()})
            row["python_and_dispatch"] = round(wall - sum(by_class.values()), 1)
            rows.append(row)
            print(row, flush=True)
    if opts.json:
        with open(opts.json, "w") as f:
            json.dump({"threads": opts.threads, "ctx": opts.ctx, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
