"""Where a decode step's time goes, one part at a time (docs/benchmarks.md#step-profile).

--part decode: one bf16 verify step of the default model by operator class (torch.profiler
    self CPU time) for each variant of the CPU decode path (common.DECODE_PATHS: the eager
    modules, the layer ops op by op, each block as one decode_layer call, the linears in
    oneDNN's layout or the tiles', all blocks as one decode_layers call); "Python and
    dispatch" is the wall time the profiled ops do not account for.
--part draft: one EAGLE draft level (the head on M new tree nodes over a head cache of
    CONTEXT positions, the draft lm_head, the top-k of a dynamic tree), each part timed alone,
    all parts and configurations interleaved round-robin; `level` is the real thing and
    `overhead` is level minus the sum of the parts (Python glue and dispatch).
--part engine: a warm engine over MT-bench questions at batch size 1, its step's functions
    wrapped with wall-clock timers: calls per step, time per call and per step (inclusive).
    Unlike torch.profiler this times what a step pays with the caches as the step leaves
    them (after a forward has streamed the weights, a small torch call costs 3-5x its warm
    time on a CPU).
--part vllm: a warm vLLM engine (in this process) over MT-bench questions at batch size 1,
    its worker's step functions and the plugin's tree step wrapped with the same timers, with
    specdec's trees or plain (--vllm-config).

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/profile_step.py --part decode
    .venv/bin/python benchmarks/profile_step.py --part draft --threads 1
    .venv/bin/python benchmarks/profile_step.py --part engine --tree adaptive --threads 2
    .venv/bin/python benchmarks/profile_step.py --part vllm --vllm-config plain --dtype float32
    .venv/bin/python benchmarks/profile_step.py --part vllm --vllm-config eagle --dtype float32
"""

import argparse
import collections
import functools
import json
import statistics
import time

import torch
from common import DECODE_PATHS, configure_decode_path, machine_info
from torch.profiler import profile

import specdec_kernels.ops as kernel_ops
from specdec import cpu
from specdec.cli.generate import encode
from specdec.cpu import fused_layers, packed_linear
from specdec.datasets import mtbench_prompts
from specdec.drafters import base as drafters_base
from specdec.drafters.eagle import EagleDrafter
from specdec.drafters.eagle_head import EagleHead, load_head
from specdec.heads import shipped_head_path
from specdec.models import llama
from specdec.models.llama import AttentionMetadata
from specdec.models.loader import load_model
from specdec.runtime.engine import Engine
from specdec.runtime.requests import Request, SamplingParams
from specdec.speculation import policy, trees

ops = kernel_ops

# ---------------------------------------------------------------------- --part decode
# the decode path's steps that change where the time goes (common.DECODE_PATHS)
PROFILED = (
    "eager",
    "prepacked+layer_ops",
    "prepacked+decode_layer",
    "tiles+decode_layer",
    "tiles+decode_layers",
)


def classify_op(name: str) -> str:
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


def profile_decode(opts):
    """--part decode: one bf16 verify step of the default model by operator class."""
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
                by_class[classify_op(e.key)] += e.self_cpu_time_total / opts.iters / 1e3
            row = {"variant": name, "T": T, "wall_ms": round(wall, 1)}
            row["tiled_rows"] = packed_linear.tiled_rows()
            row.update({k: round(v, 1) for k, v in by_class.most_common()})
            row["python_and_dispatch"] = round(wall - sum(by_class.values()), 1)
            rows.append(row)
            print(row, flush=True)
    return {"threads": opts.threads, "ctx": opts.ctx}, rows


# ---------------------------------------------------------------------- --part draft
CONTEXT = 256  # committed positions in the head's cache
TOPK = 8


def draft_parts(head, B, M):
    """-> {name: zero-argument callable} of one draft level's parts, plus "level"."""
    dev = head.fc.weight.device
    dtype = head.fc.weight.dtype
    cache = head.new_cache(B, CONTEXT + 64)
    slots = torch.arange(B, device=dev)
    cache.cache_lens[slots] = CONTEXT
    with torch.no_grad():
        cache.k.normal_()
        cache.v.normal_()
    base = cache.cache_lens[slots] - 1
    parents = torch.zeros(B, 1 + M, dtype=torch.int32, device=dev)
    parents[:, 0] = -1
    num = torch.full((B,), 1 + M, dtype=torch.int32, device=dev)
    tokens = torch.randint(0, head.args.vocab_size, (B, M), device=dev)
    feats = torch.randn(B, M, head.args.dim, dtype=dtype, device=dev)
    positions = (base + 1)[:, None].expand(B, M)
    mask, _ = ops.build_tree_mask(parents, num)
    lay, att = head.layer, head.layer.attention
    cos, sin = head._rope(positions)
    emb = head.target.tok_embeddings(tokens)
    if head.version < 3:
        x = head.fc(torch.cat((emb, feats), -1))
        attn_in = x
    else:
        x = feats
        attn_in = torch.cat((lay.attention_norm(emb), head.hidden_norm(x)), -1)
    meta = AttentionMetadata.verify(cache, slots, base, num, mask, 1, M)
    q, k, v = att.project(attn_in, cos, sin)
    o = att.attend(q, k, v, meta)
    h = x + att.wo(o.reshape(B, M, -1))
    out = h + lay.feed_forward(lay.ffn_norm(h))
    logits = head.draft_logits(out)

    def level():
        m, _ = ops.build_tree_mask(parents, num)
        hid = head(tokens, feats, cache, slots, base, 1, num, m, positions)
        lp, tok = torch.log_softmax(head.draft_logits(hid), -1).topk(TOPK, dim=-1)
        return head.draft_to_target(tok)

    p = {
        "tree_mask": lambda: ops.build_tree_mask(parents, num),
        "metadata": lambda: AttentionMetadata.verify(cache, slots, base, num, mask, 1, M),
        "embed_rope": lambda: (head.target.tok_embeddings(tokens), head._rope(positions)),
    }
    if head.version < 3:
        p["fc"] = lambda: head.fc(torch.cat((emb, feats), -1))
    else:
        p["input_norms"] = lambda: torch.cat((lay.attention_norm(emb), head.hidden_norm(x)), -1)
    p.update(
        {
            "qkv_proj": lambda: att.project(attn_in, cos, sin),
            "attention_op": lambda: att.attend(q, k, v, meta),
            "o_proj": lambda: x + att.wo(o.reshape(B, M, -1)),
            "mlp": lambda: h + lay.feed_forward(lay.ffn_norm(h)),
            "draft_lm_head": lambda: head.draft_logits(out),
            "topk": lambda: head.draft_to_target(
                torch.log_softmax(logits, -1).topk(TOPK, dim=-1)[1]
            ),
            "level": level,
        }
    )
    return p


def profile_draft(args):
    """--part draft: one EAGLE draft level, part by part."""
    dtype = getattr(torch, args.dtype)
    model, _ = load_model(dtype=dtype)

    def make_heads():
        return {
            "eagle2_shipped": load_head(shipped_head_path(), model),
            "eagle3_random": EagleHead.random(model, version=3, seed=0, draft_vocab_size=8192),
        }

    heads = {}
    if args.decode_path in ("off", "both"):  # the torch modules as written
        heads.update(make_heads())
    if args.decode_path in ("on", "both"):  # as the engine's drafter runs them
        for name, head in make_heads().items():
            cpu.configure(head)
            heads[f"{name}+cpu_path"] = head
    configs = [
        (name, B, M)
        for name in heads
        for B in map(int, args.batches.split(","))
        for M in map(int, args.nodes.split(","))
    ]
    with torch.no_grad():
        fns = {c: draft_parts(heads[c[0]], c[1], c[2]) for c in configs}
        times = {c: {k: [] for k in fns[c]} for c in configs}
        for c in configs:  # warm-up
            for f in fns[c].values():
                f()
        for _ in range(args.reps):
            for c in configs:
                for k, f in fns[c].items():
                    t0 = time.perf_counter()
                    f()
                    times[c][k].append(time.perf_counter() - t0)
    rows = []
    for c in configs:
        med = {k: statistics.median(v) * 1e6 for k, v in times[c].items()}
        level = med.pop("level")
        row = {"head": c[0], "batch": c[1], "nodes": c[2], "level_us": round(level, 1)}
        row.update({f"{k}_us": round(v, 1) for k, v in med.items()})
        row["overhead_us"] = round(level - sum(med.values()), 1)
        rows.append(row)
        print(json.dumps(row), flush=True)
    meta = {
        "dtype": args.dtype,
        "context": CONTEXT,
        "topk": TOPK,
        "reps": args.reps,
        "decode_path": args.decode_path,
    }
    return meta, rows


# ---------------------------------------------------------------------- --part engine
# (owner, attribute) of every timed function
TIMED = (
    [
        (Engine, name)
        for name in (
            "_advance",
            "_verify_step",
            "_sample",
            "_sampling",
            "_slots",
            "_emit",
            "_retire",
        )
    ]
    + [
        (llama.Transformer, "eager_forward"),
        (llama.Transformer, "lm_head"),
        (llama.Transformer, "rope"),
        (llama.AttentionMetadata, "verify"),
        # the fused calls' hooks are bound at configure time: their callees are timed
        (fused_layers, "_layers_args"),
        (fused_layers, "_run_layers"),
        (fused_layers, "block_args"),
        (EagleDrafter, "propose"),
        (EagleDrafter, "commit"),
        (EagleDrafter, "_catch_up"),
        (EagleHead, "forward"),
        (EagleHead, "draft_logits"),
        (EagleHead, "_rope"),
        (trees, "draft"),
        (trees, "draft_dynamic"),
        (trees, "grow_dynamic"),
        (drafters_base.Proposal, "truncate"),
        (kernel_ops, "build_tree_mask"),
        (kernel_ops, "compact_kv"),
        (kernel_ops, "make_uniforms"),
        (kernel_ops, "tree_rejection_sample"),
    ]
    + [
        (policy.Policy, name)
        for name in (
            "speculate",
            "node_value",
            "prefix_values",
            "expand_width",
            "sizes",
            "best",
            "draft_cost",
            "observe",
            "observe_time",
            "observe_level",
        )
    ]
)


def instrument(totals: dict, functions=TIMED) -> None:
    """Wraps every (owner, name) function so that each call adds [1, seconds] to
    totals[label]."""
    for owner, name in functions:
        fn = getattr(owner, name)
        label = f"{getattr(owner, '__name__', str(owner)).rsplit('.', 1)[-1]}.{name}"

        @functools.wraps(fn)
        def timed(*args, _fn=fn, _label=label, **kwargs):
            t0 = time.perf_counter()
            try:
                return _fn(*args, **kwargs)
            finally:
                entry = totals[_label]
                entry[0] += 1
                entry[1] += time.perf_counter() - t0

        setattr(owner, name, timed)


def timing_rows(totals: dict, steps: int) -> list:
    """instrument()'s totals -> one row per timed function, the costliest first."""
    return [
        {
            "function": label,
            "calls_per_step": n / steps,
            "us_per_call": 1e6 * s / n,
            "ms_per_step": 1e3 * s / steps,
        }
        for label, (n, s) in sorted(totals.items(), key=lambda kv: -kv[1][1])
        if n
    ]


def print_timing_rows(rows: list, width: int) -> None:
    for r in rows:
        print(
            f"{r['function']:{width}s} {r['calls_per_step']:5.2f}/step "
            f"{r['us_per_call']:9.1f} us/call {r['ms_per_step']:7.3f} ms/step"
        )


def profile_engine(opts):
    """--part engine: a warm engine's decode steps, function by function."""
    model, tokenizer = load_model(None, dtype=torch.bfloat16)
    plain = opts.tree == "plain"
    head = None if plain else load_head(shipped_head_path(), model)
    prompts = [encode(tokenizer, q, True) for q in mtbench_prompts(opts.num_prompts)]
    engine = Engine(
        model,
        tokenizer,
        head=head,
        tree="chain:1" if plain else opts.tree,
        max_seq_len=max(len(q) for q in prompts) + opts.max_new_tokens + 1,
    )
    # warm: the longest prompt's prefill packs oneDNN's layout of the weights
    engine.generate([Request(list(max(prompts, key=len)), SamplingParams(max_new_tokens=8))])
    totals: dict = collections.defaultdict(lambda: [0, 0.0])
    instrument(totals)
    steps = 0
    for q in prompts:
        request = Request(list(q), SamplingParams(0.0, max_new_tokens=opts.max_new_tokens))
        steps += engine.generate([request])[1].target_forwards
    rows = timing_rows(totals, steps)
    print(f"{opts.tree}, {opts.threads} threads, {steps} steps (inclusive wall times)")
    print_timing_rows(rows, 34)
    return {"tree": opts.tree, "steps": steps}, rows


# ---------------------------------------------------------------------- --part vllm
# vLLM's worker step (gpu_model_runner.py, the CPU worker's runner), the plugin's tree step
# (trees.py, hosted.py) and both attention backends: (module, owner path, attribute)
VLLM_TIMED = [
    ("vllm.v1.worker.gpu_model_runner", "GPUModelRunner", name)
    for name in (
        "execute_model",
        "sample_tokens",
        "_update_states",
        "_prepare_inputs",
        "_calc_spec_decode_metadata",
        "_preprocess",
        "_model_forward",
        "_sample",
        "_bookkeeping_sync",
        "propose_draft_token_ids",
    )
] + [
    ("vllm.v1.sample.rejection_sampler", "RejectionSampler", "forward"),
    ("vllm.v1.attention.backends.cpu_attn", "CPUAttentionBackendImpl", "forward"),
    ("vllm.v1.attention.backends.cpu_attn", "CPUAttentionBackendImpl", "do_kv_cache_update"),
    ("specdec.integrations.vllm.attention", "TreeAttentionImpl", "forward"),
    ("specdec.integrations.vllm.attention", "TreeAttentionImpl", "do_kv_cache_update"),
    ("specdec.integrations.vllm.attention", "TreeAttentionMetadataBuilder", "build"),
    ("specdec.integrations.vllm.trees", None, "_place_tree_nodes"),
    ("specdec.integrations.vllm.trees", None, "_hand_over_step"),
    ("specdec.integrations.vllm.trees", None, "_compact"),
    ("specdec.integrations.vllm.hosted", "DrafterProposer", "observe"),
    ("specdec.integrations.vllm.hosted", "DrafterProposer", "propose"),
]


def profile_vllm(opts):
    """--part vllm: a warm in-process vLLM engine's steps at batch size 1 (or --concurrency
    requests submitted at once), function by function, with specdec's trees (--vllm-config)
    or without (plain)."""
    import importlib
    import os

    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the worker in this process
    from vllm import LLM
    from vllm import SamplingParams as VllmSampling

    from specdec.integrations.vllm import speculative_config
    from specdec.models.loader import default_model_path, gguf_checkpoint_dir, load_tokenizer

    model_dir = gguf_checkpoint_dir(default_model_path())
    tok = load_tokenizer(model_dir)
    prompts = [
        tok.apply_chat_template([{"role": "user", "content": q}])
        for q in mtbench_prompts(opts.num_prompts)
    ]
    if opts.vllm_config == "plain":
        spec = None
    elif opts.vllm_config == "backend":  # the tree backend, no drafts (no prompt matches)
        spec = speculative_config("ngram", tree=True, ngram_min=64, ngram_max=64)
    else:
        method, _, tree = opts.vllm_config.partition(":")
        if tree == "chain":  # vLLM's own chain method with specdec's exported head
            spec = speculative_config(method)
        else:
            spec = speculative_config(method, tree=tree or True)
    drafts = (spec or {}).get("num_speculative_tokens", 0)
    llm = LLM(
        model_dir,
        dtype=opts.dtype,
        seed=0,
        enforce_eager=True,
        max_model_len=max(len(q) for q in prompts) + opts.max_new_tokens + 16 + drafts,
        max_num_seqs=opts.concurrency,
        kv_cache_memory_bytes=max(256, 32 * opts.concurrency) << 20,
        speculative_config=spec,
    )
    params = VllmSampling(temperature=0.0, max_tokens=opts.max_new_tokens, ignore_eos=True)
    llm.generate([{"prompt_token_ids": max(prompts, key=len)}], params, use_tqdm=False)  # warm
    totals: dict = collections.defaultdict(lambda: [0, 0.0])
    timed_functions = []
    for module, owner, name in VLLM_TIMED:
        holder = importlib.import_module(module)
        holder = getattr(holder, owner) if owner else holder
        timed_functions.append((holder, name))
    instrument(totals, timed_functions)
    # batch 1: one request at a time; else --concurrency requests (the prompts cycled) at once;
    # --arrive-every N: the prompts arriving one every N engine steps (arrivals' prompt chunks
    # in the steps of running decodes), at most --concurrency running
    if opts.arrive_every:
        from specdec.bench.vllm import _staggered

        t0 = time.perf_counter()
        tokens = sum(len(o) for o in _staggered(llm, prompts, params, opts.arrive_every))
    else:
        if opts.concurrency == 1:
            batches = [[q] for q in prompts]
        else:
            batches = [[prompts[i % len(prompts)] for i in range(opts.concurrency)]]
        tokens, t0 = 0, time.perf_counter()
        for batch in batches:
            outs = llm.generate([{"prompt_token_ids": q} for q in batch], params, use_tqdm=False)
            tokens += sum(len(o.outputs[0].token_ids) for o in outs)
    wall = time.perf_counter() - t0
    steps = totals["GPUModelRunner.execute_model"][0]
    rows = timing_rows(totals, steps)
    meta = {
        "vllm_config": opts.vllm_config,
        "dtype": opts.dtype,
        "concurrency": opts.concurrency,
        "arrive_every": opts.arrive_every,
        "steps": steps,
        "tokens": tokens,
        "tokens_per_step": tokens / steps,
        "tokens_per_s": tokens / wall,
        "ms_per_step": 1e3 * wall / steps,
    }
    print(
        f"vLLM {opts.vllm_config} ({opts.dtype}, {opts.concurrency} at once), {steps} steps, "
        f"{tokens / steps:.2f} tokens/step, "
        f"{1e3 * wall / steps:.2f} ms/step, {tokens / wall:.2f} tok/s (inclusive wall times)"
    )
    print_timing_rows(rows, 44)
    return meta, rows


PARTS = {
    "decode": profile_decode,
    "draft": profile_draft,
    "engine": profile_engine,
    "vllm": profile_vllm,
}


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--part", choices=sorted(PARTS), required=True)
    p.add_argument("--threads", type=int, default=None, help="default: 1 (decode, draft), 2")
    p.add_argument("--json", default=None, help="also write the rows here (with the machine)")
    decode = p.add_argument_group("--part decode")
    decode.add_argument("--ctx", type=int, default=256)
    decode.add_argument("--trees", default="1,16")
    decode.add_argument("--iters", type=int, default=10)
    draft = p.add_argument_group("--part draft")
    draft.add_argument("--batches", default="1,8,16")
    draft.add_argument("--nodes", default="8,16,32,48")
    draft.add_argument("--reps", type=int, default=30)
    draft.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    draft.add_argument(
        "--decode-path",
        choices=("on", "off", "both"),
        default="both",
        help="the heads with specdec.cpu configured (prepacked linears and layer ops, as "
        "the engine's drafter runs them), without, or both",
    )
    engine = p.add_argument_group("--part engine")
    engine.add_argument("--tree", default="adaptive", help="'plain', or a tree spec (chain:1)")
    engine.add_argument("--num-prompts", type=int, default=8)
    engine.add_argument("--max-new-tokens", type=int, default=128)
    vllm = p.add_argument_group("--part vllm (also --num-prompts, --max-new-tokens, --dtype)")
    vllm.add_argument("--concurrency", type=int, default=1, help="requests at once")
    vllm.add_argument(
        "--arrive-every",
        type=int,
        default=0,
        help="the prompts arriving one every N engine steps instead (at most --concurrency "
        "running)",
    )
    vllm.add_argument(
        "--vllm-config",
        default="eagle+ngram:adaptive",
        help="'plain', 'backend' (specdec's attention backend, no drafts), METHOD[:TREE] for "
        "speculative_config(METHOD, tree=TREE or True), or METHOD:chain for vLLM's own "
        "chain method (speculative_config(METHOD))",
    )
    opts = p.parse_args()
    if opts.threads is None:
        opts.threads = 2 if opts.part == "engine" else 1
    torch.set_num_threads(opts.threads)
    meta, rows = PARTS[opts.part](opts)
    if opts.json:
        meta = {**machine_info(), "part": opts.part, "threads": opts.threads, **meta}
        with open(opts.json, "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
