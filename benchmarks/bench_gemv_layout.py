"""The decode step's weight stream: what one step's 121 bf16 linears of SmolLM2-135M (269 MB:
every projection of the 30 blocks and the lm_head) cost at M rows with oneDNN's prepacked
product (ATen's bf16 F.linear where oneDNN cannot prepack bf16: CPUs without AVX-512) against
torch.ops.specdec.tiled_linear over the weights' tiles (the two layouts the engine's
PackedLinear picks between, SPECDEC_TILED_ROWS), interleaved in one process, and a
plain sum over as many bytes (what the memory system streams). Outputs checked against
float64 first.

The layout is the library op (csrc/cpu/tiled_linear.cpp), which this script times.

    PYTHONPATH=.:python OMP_NUM_THREADS=1 python benchmarks/bench_gemv_layout.py --threads 1 \\
        --rows 1,2,4,8,16,32,64 --json benchmarks/out/gemv_layout_t1.json
"""

import argparse
import statistics

import torch
from common import write_json

from specdec_kernels import ops
from specdec_kernels.testing import time_fn


def step_weights(model) -> list[torch.Tensor]:
    """The bf16 weights of one decode step's linears, in the order a step reads them."""
    weights = []
    for block in model.layers:
        attn, ff = block.attention, block.feed_forward
        weights += [attn.wqkv.weight, attn.wo.weight, ff.w13.weight, ff.w2.weight]
    return weights + [model.output.weight]


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--rows", default="1,2,4,8,16,32,64")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--json", default=None)
    opts = p.parse_args()
    from specdec.models.loader import load_model

    torch.set_num_threads(opts.threads)
    model, _ = load_model(None, dtype=torch.bfloat16)
    weights = [w.detach() for w in step_weights(model)]
    nbytes = sum(w.numel() * 2 for w in weights)
    tiles = [ops.pack_linear_tiles(w) for w in weights]
    # oneDNN's prepacked bf16 product needs AVX512 (BW, VL, DQ) or AVX-NE-CONVERT; elsewhere
    # the baseline is ATen's bf16 F.linear on the weight as loaded (what a user gets)
    try:
        onednn = [torch.ops.mkldnn._reorder_linear_weight(w, 1) for w in weights]
        baseline, note = "onednn", None
    except RuntimeError as e:
        onednn, baseline, note = None, "aten", f"oneDNN's prepacked product: {e}"
        print(note, "- timing ATen's F.linear instead", flush=True)
    rows_out = []
    with torch.inference_mode():
        big = torch.randn(nbytes // 2, dtype=torch.bfloat16)
        for rows in [int(r) for r in opts.rows.split(",")]:
            xs = [torch.randn(rows, w.shape[1], dtype=torch.bfloat16) for w in weights]
            for x, t, w in zip(xs[:4], tiles, weights):  # one block's products, checked
                ref = torch.nn.functional.linear(x.double(), w.double())
                got = ops.tiled_linear(x, t, w.shape[0]).double()
                assert ((got - ref).abs() <= 2**-7 * ref.abs() + 1e-2).all()
            variants = {
                "onednn": lambda xs=xs: [
                    torch.ops.mkldnn._linear_pointwise(x, d, None, "none", [], "")
                    for x, d in zip(xs, onednn)
                ],
                "aten": lambda xs=xs: [
                    torch.nn.functional.linear(x, w) for x, w in zip(xs, weights)
                ],
                "tiles": lambda xs=xs: [
                    torch.ops.specdec.tiled_linear(x, t, w.shape[0])
                    for x, t, w in zip(xs, tiles, weights)
                ],
                "sum": big.sum,
            }
            del variants["aten" if baseline == "onednn" else "onednn"]
            times = {name: [] for name in variants}
            for _ in range(opts.rounds):  # interleaved rounds
                for name, f in variants.items():
                    times[name].append(time_fn(f, warmup=1, iters=9))
            row = {"rows": rows, "threads": opts.threads, "weight_mb": round(nbytes / 1e6)}
            for name, ts in times.items():
                t = statistics.median(ts)
                row[f"{name}_ms"] = round(t * 1e3, 2)
                row[f"{name}_gb_s"] = round(nbytes / t / 1e9, 1)
            row["tiles_speedup"] = round(row[f"{baseline}_ms"] / row["tiles_ms"], 2)
            if note:
                row["onednn_note"] = note
            rows_out.append(row)
            print(row, flush=True)
    if opts.json:
        write_json(opts.json, rows_out, {"bench": "gemv_layout", "dtype": "bfloat16"})


if __name__ == "__main__":
    main()
