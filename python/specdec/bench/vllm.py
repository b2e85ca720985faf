"""The vLLM rows of `specdec bench --vllm`, beside specdec's own in the same run and table.

    specdec bench --vllm --no-hf --no-llamacpp --no-hostile --temperatures 0 --batch-sizes 1,32

Same prompts (the bench's MT-bench first turns, chat template applied by specdec's tokenizer
and handed to vLLM as token ids), same stop rule (specdec's EOS ids, max_new_tokens), greedy,
same dtype as the bench's model and the same threads (vLLM's worker gets OMP_NUM_THREADS =
torch's threads; it would drop to one thread otherwise). Each vLLM configuration runs in its
own process (one engine at a time; vLLM spawns its workers, so its process needs a
`__main__` guard: `python -m specdec.bench.vllm ROW.json OUT.json`), at batch 1
(one prompt at a time) and with `concurrency` prompts (the bench's prompts repeated) in one
generate call.

Rows (VLLM_ROWS): vLLM plain, vLLM's own n-gram, its eagle / eagle3 / medusa with specdec's
exported shipped heads, and the plugin's methods (specdec's n-gram proposer; EAGLE-2 with
specdec's sampler; specdec's trees verified inside vLLM's step: n-gram, EAGLE-2 and the
merged adaptive eagle+ngram). Per row: tokens/s, tokens per target forward (generated
tokens after the first over the target forwards after prefill, from vLLM's acceptance
counters, the same definition as specdec's mean_acceptance_length), vLLM's own acceptance
length (1 + accepted / drafts) and whether greedy output equals vLLM plain's.

Beside them: specdec's own chains with the same heads and depth (and with the draft
vocabulary dropped, as the export must for vLLM), specdec at the same concurrency, the
sampler timed both ways on the same inputs (sampler.py against vLLM's CPU kernels), and the
goals' ratios (specdec's best over vLLM's best, at batch 1 and at the concurrency).
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

# name -> (speculative_config builder arguments, or None for plain). ("vllm", cfg): vLLM's own
# dict; ("specdec", method, options): speculative_config(method, **options).
VLLM_ROWS = {
    "vllm_plain": None,
    "vllm_ngram": ("vllm", {"method": "ngram", "prompt_lookup_max": 4, "prompt_lookup_min": 1}),
    "vllm_eagle": ("specdec", "eagle", {}),
    "vllm_eagle3": ("specdec", "eagle3", {}),
    "vllm_medusa": ("specdec", "medusa", {}),
    "vllm_specdec_ngram": ("specdec", "ngram", {}),
    "vllm_eagle_specdec_sampler": ("specdec", "eagle", {"sampler": "specdec"}),
    # trees verified inside vLLM's step (integrations/vllm/trees.py): n-gram tries and EAGLE
    # dynamic trees of 8 nodes below the root, the merged eagle+ngram tree sized per step
    "vllm_specdec_ngram_tree": ("specdec", "ngram", {"tree": True, "num_speculative_tokens": 8}),
    "vllm_specdec_eagle_tree": ("specdec", "eagle", {"tree": True, "num_speculative_tokens": 8}),
    "vllm_specdec_eagle_ngram_adaptive": ("specdec", "eagle+ngram", {"tree": "adaptive"}),
}
KV_CACHE_BYTES = 1 << 30  # vLLM's CPU KV cache; its default reserves 92 % of the memory
ENGINE_TIMEOUT_S = 1800


def add_arguments(p) -> None:
    """`specdec bench`'s vLLM flags (apps/bench.py calls this). Bad values fail while the
    arguments are parsed, before any model loads."""
    g = p.add_argument_group(
        "vLLM (--vllm: vLLM's rows beside specdec's; pip install 'specdec[vllm]')"
    )
    g.add_argument("--vllm", action=_VllmFlag, nargs=0, default=False, help="add the vLLM rows")
    g.add_argument(
        "--vllm-rows",
        type=_rows,
        default=list(VLLM_ROWS),
        help=f"comma-separated vLLM rows (default: all: {','.join(VLLM_ROWS)})",
    )
    g.add_argument(
        "--vllm-concurrency",
        type=_positive_int,
        default=32,
        help="prompts at once in the batched rows (default %(default)s)",
    )
    g.add_argument(
        "--vllm-depth",
        type=_positive_int,
        default=4,
        help="draft tokens per step (default %(default)s)",
    )
    g.add_argument(
        "--vllm-eager",
        action="store_true",
        help="enforce_eager: vLLM without torch.compile (starts in ~30 s instead of ~2 min)",
    )


class _VllmFlag(argparse.Action):
    """--vllm: refused at parse time when vLLM is not installed."""

    def __call__(self, parser, namespace, values, option_string=None):
        from specdec.integrations.vllm.version import INSTALL_HINT, installed_version

        if installed_version() is None:
            parser.error(f"--vllm needs vLLM: {INSTALL_HINT}")
        setattr(namespace, self.dest, True)


def _rows(text: str) -> list:
    rows = [r.strip() for r in text.split(",") if r.strip()]
    unknown = [r for r in rows if r not in VLLM_ROWS]
    if unknown or not rows:
        raise argparse.ArgumentTypeError(
            f"unknown row(s) {unknown or text!r}; known: {', '.join(VLLM_ROWS)}"
        )
    return rows


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {text!r}")
    return value


def run(args, result: dict, model, tokenizer, prompts: list, log=print) -> dict:
    """The vLLM part of the benchmark: runs every row, adds them to result (greedy batch-1
    table, the sweep at the concurrency, result["vllm"]) -> result["vllm"]."""
    from specdec.integrations.vllm.version import installed_version

    rows = args.vllm_rows
    from specdec.models.loader import default_model_path, gguf_checkpoint_dir

    model_path = args.model or default_model_path()
    model_dir = gguf_checkpoint_dir(model_path) if model_path.endswith(".gguf") else model_path
    import torch

    dtype = str(model.tok_embeddings.weight.dtype).removeprefix("torch.")
    prompt_ids = [tokenizer.apply_chat_template([{"role": "user", "content": p}]) for p in prompts]
    setting = {
        "model_dir": model_dir,
        "dtype": dtype,
        "threads": torch.get_num_threads(),
        "prompt_ids": prompt_ids,
        "max_new_tokens": args.max_new_tokens,
        "concurrency": args.vllm_concurrency,
        "eos": sorted(tokenizer.eos_token_ids),
        "seed": args.seed,
        "enforce_eager": args.vllm_eager,
    }
    vllm = {
        "config": {k: v for k, v in setting.items() if k != "prompt_ids"}
        | {"depth": args.vllm_depth, "vllm": installed_version()},
        "batch1": {},
        "concurrent": {},
    }
    for name in rows:
        t0 = time.perf_counter()
        spec = _speculative_config(VLLM_ROWS[name], args.vllm_depth, model_path)
        out = run_engine_process({**setting, "speculative_config": spec})
        vllm["batch1"][name], vllm["concurrent"][name] = out["batch1"], out["concurrent"]
        log(
            f"[vLLM {name}] batch 1: {out['batch1']['tokens_per_s']:.2f} tok/s, "
            f"{out['batch1']['tokens_per_forward']:.3f} tokens/forward; "
            f"{args.vllm_concurrency} at once: {out['concurrent']['tokens_per_s']:.2f} tok/s "
            f"({time.perf_counter() - t0:.0f}s)"
        )
    plain_outputs = vllm["batch1"].get("vllm_plain", {}).get("outputs")
    _mark_exact(vllm)
    vllm["specdec_chains"], ours = specdec_chains(model, tokenizer, prompt_ids, args, log)
    if plain_outputs is not None:  # do both engines decode the same text? (float32: they should)
        vllm["vllm_plain_same_tokens_as_specdec_plain"] = sum(
            a == b for a, b in zip(plain_outputs, ours)
        ) / len(ours)
    vllm["specdec_concurrent"] = specdec_concurrent(model, tokenizer, prompt_ids, args, log)
    vllm["sampler"] = run_sampler_timing_process(args.vllm_concurrency, args.vllm_depth, setting)
    log(f"[vLLM sampler] {json.dumps(vllm['sampler'])}")
    vllm["goals"] = _goals(result, vllm)
    _merge(result, vllm)
    result["vllm"] = vllm
    return vllm


def _speculative_config(row, depth: int, model_path: str):
    if row is None:
        return None
    if row[0] == "vllm":
        return {**row[1], "num_speculative_tokens": depth}
    from specdec.integrations.vllm.config import speculative_config

    _, method, options = row
    if "tree" in options or method == "eagle+ngram":  # trees: their own size, specdec's model
        return speculative_config(method, **options)
    options = {"num_speculative_tokens": depth, **options}
    if method != "ngram":
        options["model"] = model_path
    return speculative_config(method, **options)


# ---------------------------------------------------------------------- one vLLM engine
SAMPLER_MARK = "rejection sampling through tree_rejection_sample"  # plugin.py logs it


def _child_env() -> dict:
    """os.environ with PYTHONPATH's entries made absolute: the children run in a temporary
    directory (a relative entry such as `python` would no longer resolve)."""
    entries = os.environ.get("PYTHONPATH", "").split(os.pathsep)
    paths = os.pathsep.join(os.path.abspath(p) for p in entries if p)
    return {**os.environ, "PYTHONPATH": paths}


def run_engine_process(setting: dict) -> dict:
    """run_engine(setting) in a child process (OMP_NUM_THREADS = setting["threads"]) -> its
    result, with "specdec_sampler": whether a worker logged that it samples through specdec's
    op; a failed child is a RuntimeError carrying the end of its log. setting["in_process"]:
    vLLM's engine core and worker in that process (VLLM_ENABLE_V1_MULTIPROCESSING=0), not in
    processes of their own (docs/benchmarks.md "Trees inside vLLM": on 2 vCPUs the engine
    core's wait for its worker keeps a core busy)."""
    setting = dict(setting, model_dir=os.path.abspath(setting["model_dir"]))
    spec = setting.get("speculative_config")
    if spec and "model" in spec and os.path.exists(spec["model"]):
        setting["speculative_config"] = dict(spec, model=os.path.abspath(spec["model"]))
    with tempfile.TemporaryDirectory(prefix="specdec-vllm-bench-") as tmp:
        row, out, log = (os.path.join(tmp, n) for n in ("row.json", "out.json", "log.txt"))
        with open(row, "w") as f:
            json.dump(setting, f)
        env = {**_child_env(), "OMP_NUM_THREADS": str(setting["threads"])}
        if setting.get("in_process"):
            env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        with open(log, "w") as f:
            proc = subprocess.run(
                [sys.executable, "-m", __name__, "engine", row, out],
                env=env,
                stdout=f,
                stderr=subprocess.STDOUT,
                timeout=ENGINE_TIMEOUT_S,
                cwd=tmp,  # `-m` puts the cwd first: a checkout's unbuilt sources would shadow
            )
        if proc.returncode != 0 or not os.path.isfile(out):
            with open(log) as f:
                tail = f.read()[-3000:]
            raise RuntimeError(f"the vLLM engine process failed ({proc.returncode}):\n{tail}")
        with open(out) as f:
            result = json.load(f)
        with open(log) as f:
            result["specdec_sampler"] = SAMPLER_MARK in f.read()
        return result


def run_engine(setting: dict) -> dict:
    """One vLLM engine with setting["speculative_config"]: greedy, each prompt alone (batch
    1), then setting["concurrency"] prompts in one call (0: not), then, with
    setting["staggered"] = n, n prompts arriving one every setting["arrive_every"] engine
    steps -> {"batch1": row, "concurrent": row or None, "staggered": outputs and counters},
    a row holding tokens/s, the acceptance counters and the outputs. Optional settings:
    kv_cache_bytes, block_size (a small cache of small blocks forces preemption),
    tensor_parallel_size."""
    from vllm import LLM, SamplingParams

    prompts = setting["prompt_ids"]
    # vLLM drafts nothing in a step whose longest request has fewer free positions than
    # num_speculative_tokens: the context leaves that room past the longest request
    drafts = (setting["speculative_config"] or {}).get("num_speculative_tokens", 0)
    t0 = time.perf_counter()
    llm = LLM(
        setting["model_dir"],
        dtype=setting["dtype"],
        seed=setting["seed"],
        enforce_eager=setting["enforce_eager"],
        max_model_len=max(len(p) for p in prompts) + setting["max_new_tokens"] + 16 + drafts,
        max_num_seqs=max(1, setting["concurrency"], setting.get("staggered", 0)),
        kv_cache_memory_bytes=setting.get("kv_cache_bytes", KV_CACHE_BYTES),
        speculative_config=setting["speculative_config"],
        disable_log_stats=False,
        **({"block_size": setting["block_size"]} if setting.get("block_size") else {}),
        tensor_parallel_size=setting.get("tensor_parallel_size", 1),
    )
    startup_s = time.perf_counter() - t0
    greedy = SamplingParams(
        temperature=0.0, max_tokens=setting["max_new_tokens"], stop_token_ids=setting["eos"]
    )
    llm.generate(
        [{"prompt_token_ids": max(prompts, key=len)}],
        SamplingParams(temperature=0.0, max_tokens=4),
        use_tqdm=False,
    )

    def timed(batch):
        before = _counters(llm)
        t = time.perf_counter()
        outs = llm.generate([{"prompt_token_ids": p} for p in batch], greedy, use_tqdm=False)
        elapsed = time.perf_counter() - t
        after = _counters(llm)
        return (
            [list(o.outputs[0].token_ids) for o in outs],
            elapsed,
            {k: after[k] - before[k] for k in after},
        )

    parts = [timed([p]) for p in prompts]
    outputs = [out[0] for out, _, _ in parts]
    counts = {k: sum(c[k] for _, _, c in parts) for k in parts[0][2]}
    batch1 = _row(outputs, sum(e for _, e, _ in parts), counts)
    batch1["outputs"] = outputs
    batch1["startup_s"] = startup_s
    result = {"batch1": batch1, "concurrent": None}
    if setting["concurrency"]:
        many = [prompts[i % len(prompts)] for i in range(setting["concurrency"])]
        outs, elapsed, counts = timed(many)
        result["concurrent"] = _row(outs, elapsed, counts)
        result["concurrent"]["outputs"] = outs
    if setting.get("staggered"):
        many = [prompts[i % len(prompts)] for i in range(setting["staggered"])]
        before = _counters(llm)
        outs = _staggered(llm, many, greedy, setting.get("arrive_every", 2))
        after = _counters(llm)
        result["staggered"] = {"outputs": outs, **{k: after[k] - before[k] for k in after}}
    return result


def _staggered(llm, prompts: list, params, every: int) -> list:
    """The prompts through vLLM's engine loop, one arriving every `every` engine steps
    (arrivals and finishes mid-flight) -> their outputs' token ids, in prompt order."""
    engine = llm.llm_engine
    outputs: dict = {}
    step = 0
    while len(outputs) < len(prompts):
        arrived = step // every + 1
        if step % every == 0 and arrived <= len(prompts):
            engine.add_request(str(arrived - 1), {"prompt_token_ids": prompts[arrived - 1]}, params)
        for out in engine.step():
            if out.finished:  # vLLM appends a suffix to the id it was given
                outputs[int(out.request_id.split("-")[0])] = list(out.outputs[0].token_ids)
        step += 1
    return [outputs[i] for i in range(len(prompts))]


def _counters(llm) -> dict:
    values = {"drafts": 0, "draft_tokens": 0, "accepted": 0, "preemptions": 0}
    names = {
        "vllm:num_preemptions": "preemptions",
        "vllm:spec_decode_num_drafts": "drafts",
        "vllm:spec_decode_num_draft_tokens": "draft_tokens",
        "vllm:spec_decode_num_accepted_tokens": "accepted",
    }
    for metric in llm.get_metrics():
        if metric.name in names:
            values[names[metric.name]] += int(metric.value)
    return values


def _row(outputs: list, elapsed: float, counts: dict) -> dict:
    tokens = sum(len(o) for o in outputs)
    after_first = tokens - len(outputs)  # the first token of each request comes from prefill
    forwards = after_first - counts["accepted"]
    return {
        "num_requests": len(outputs),
        "generated_tokens": tokens,
        "elapsed_s": elapsed,
        "tokens_per_s": tokens / elapsed if elapsed > 0 else 0.0,
        "tokens_per_forward": after_first / forwards if forwards > 0 else 1.0,
        "vllm_acceptance_length": 1 + counts["accepted"] / counts["drafts"]
        if counts["drafts"]
        else None,
        **counts,
    }


def _mark_exact(vllm: dict) -> None:
    """same_tokens_as_plain of each row (batch 1, concurrent): the share of prompts whose
    greedy output equals vLLM plain's (when vllm_plain ran); the outputs are dropped."""
    for rows in (vllm["batch1"], vllm["concurrent"]):
        plain = (rows.get("vllm_plain") or {}).get("outputs")
        for row in rows.values():
            outputs = (row or {}).pop("outputs", None)
            if plain is not None and outputs is not None:
                same = sum(a == b for a, b in zip(outputs, plain)) / len(plain)
                row["same_tokens_as_plain"] = same
                row["plain_reference"] = "vllm_plain"


# ---------------------------------------------------------------------- specdec's side
def _specdec_row(engine, prompt_ids, max_new_tokens, seed) -> tuple[dict, list]:
    from specdec.runtime.requests import Request, SamplingParams

    requests = [
        Request(list(p), SamplingParams(0.0, seed=seed + i, max_new_tokens=max_new_tokens))
        for i, p in enumerate(prompt_ids)
    ]
    results, stats = engine.generate(requests)
    row = stats.to_dict()
    return {
        k: row[k]
        for k in (
            "num_requests",
            "generated_tokens",
            "elapsed_s",
            "tokens_per_s",
            "mean_acceptance_length",
        )
    }, [r.token_ids for r in results]


def specdec_chains(model, tokenizer, prompt_ids, args, log) -> tuple[dict, list]:
    """specdec's own chain:depth with each shipped head, batch 1, greedy, on the same prompts,
    with the head's draft vocabulary and without it (the export drops it for vLLM's eagle and
    medusa) -> ({name: row}, specdec plain's outputs)."""
    from specdec.bench.common import warm_up
    from specdec.drafters import EagleDrafter
    from specdec.drafters.choice import DrafterChoice
    from specdec.heads import EAGLE3_HEAD
    from specdec.runtime.engine import Engine

    depth = args.vllm_depth
    rows = {}
    plain = Engine(
        model, tokenizer, max_seq_len=max(len(p) for p in prompt_ids) + args.max_new_tokens + 1
    )
    _, plain_outputs = _specdec_row(plain, prompt_ids, args.max_new_tokens, args.seed)
    heads = {
        "eagle": DrafterChoice("eagle").eagle_head(model, None),
        "eagle3": DrafterChoice("eagle", head=EAGLE3_HEAD).eagle_head(model, None),
        "medusa": DrafterChoice("medusa").medusa_heads(model, None),
    }
    for name, head in heads.items():
        variants = [("", head)]
        if name != "eagle3" and head.d2t is not None:  # the exported vLLM heads' vocabulary
            full = DrafterChoice("medusa" if name == "medusa" else "eagle")
            copy = (
                full.medusa_heads(model, None) if name == "medusa" else full.eagle_head(model, None)
            )
            variants.append(("_full_vocab", copy.set_draft_vocab(_all_ids(model))))
        for suffix, h in variants:
            if name == "medusa":
                from specdec.drafters.medusa import MedusaDrafter

                drafter = MedusaDrafter(h)
            else:
                drafter = EagleDrafter(h)
            engine = Engine(
                model,
                tokenizer,
                drafter=drafter,
                tree=f"chain:{depth}",
                max_seq_len=max(len(p) for p in prompt_ids) + args.max_new_tokens + 1,
            )
            warm_up(engine, prompt_ids)
            row, _ = _specdec_row(engine, prompt_ids, args.max_new_tokens, args.seed)
            rows[f"specdec_{name}_chain{depth}{suffix}"] = row
            log(
                f"[specdec {name} chain:{depth}{suffix}] {row['tokens_per_s']:.2f} tok/s, "
                f"{row['mean_acceptance_length']:.3f} tokens/forward"
            )
    return rows, plain_outputs


def _all_ids(model):
    import torch

    return torch.arange(model.args.vocab_size)


def specdec_concurrent(model, tokenizer, prompt_ids, args, log) -> dict:
    """specdec at the vLLM rows' concurrency, greedy: plain, EAGLE adaptive and eagle+ngram
    adaptive (the bench's batch-1 best), the prompts repeated as for vLLM -> {name: row}."""
    from specdec.bench.common import warm_up
    from specdec.drafters.choice import DrafterChoice
    from specdec.runtime.engine import Engine

    n = args.vllm_concurrency
    many = [prompt_ids[i % len(prompt_ids)] for i in range(n)]
    rows = {}
    for name, choice, tree in (
        ("plain", DrafterChoice("plain"), "chain:1"),
        ("eagle_adaptive", DrafterChoice("eagle"), args.adaptive),
        ("eagle+ngram_adaptive", DrafterChoice("eagle+ngram"), args.adaptive),
    ):
        engine = Engine(
            model,
            tokenizer,
            drafter=choice.build(model),
            tree=tree,
            batch_size=n,
            max_seq_len=max(len(p) for p in many) + args.max_new_tokens + 1,
        )
        warm_up(engine, many)
        rows[name], _ = _specdec_row(engine, many, args.max_new_tokens, args.seed)
        log(f"[specdec {name}, {n} at once] {rows[name]['tokens_per_s']:.2f} tok/s")
    return rows


# ---------------------------------------------------------------------- the sampler
def run_sampler_timing_process(concurrency: int, depth: int, setting: dict) -> dict:
    """sampler_timing in a child process (vLLM's CPU kernels are registered there, as in a
    worker) -> its result."""
    with tempfile.TemporaryDirectory(prefix="specdec-vllm-sampler-") as tmp:
        row, out = os.path.join(tmp, "row.json"), os.path.join(tmp, "out.json")
        with open(row, "w") as f:
            json.dump(
                {"concurrency": concurrency, "depth": depth, "threads": setting["threads"]}, f
            )
        proc = subprocess.run(
            [sys.executable, "-m", __name__, "sampler", row, out],
            capture_output=True,
            text=True,
            env=_child_env(),
            timeout=ENGINE_TIMEOUT_S,
            cwd=tmp,  # as in run_engine_process
        )
        if proc.returncode != 0:
            raise RuntimeError(f"the sampler timing process failed:\n{proc.stderr[-3000:]}")
        with open(out) as f:
            return json.load(f)


def sampler_timing(
    batch_sizes=(1, 32), depth: int = 4, vocab: int = 49152, threads: int = 1, repeats: int = 40
) -> dict:
    """vLLM's rejection_sample (its CPU kernels) and sampler.rejection_sample on the same
    inputs, interleaved, median ms per call -> {"B=1 greedy accept=0.6": {"vllm": ms,
    "specdec": ms, "same_output": bool}, ...}. Inputs: random float32 logits, each draft the
    row's argmax with probability `accept` (else a random token), every request drafting
    `depth` tokens; greedy and temperature 1."""
    import torch
    from vllm.platforms import current_platform
    from vllm.v1.sample import rejection_sampler

    from specdec.integrations.vllm import sampler

    torch.set_num_threads(threads)
    current_platform.register_triton_kernel_overrides()  # as a worker does before sampling
    vllm_fn = sampler._original or rejection_sampler.rejection_sample
    out = {}
    for B in batch_sizes:
        for greedy in (True, False):
            for accept in (0.0, 0.6, 1.0):
                args = _sampler_inputs(B, depth, vocab, accept, greedy)
                times: dict = {"vllm": [], "specdec": []}
                for rep in range(repeats):
                    pair = (("vllm", vllm_fn), ("specdec", sampler.rejection_sample))
                    for name, fn in pair if rep % 2 else pair[::-1]:
                        t0 = time.perf_counter()
                        fn(*args)
                        times[name].append(time.perf_counter() - t0)
                key = f"B={B} {'greedy' if greedy else 'T=1'} accept={accept}"
                out[key] = {k: statistics.median(v[3:]) * 1e3 for k, v in times.items()}
                if greedy:
                    out[key]["same_output"] = bool(
                        torch.equal(vllm_fn(*args), sampler.rejection_sample(*args))
                    )
    return out


def sampling_metadata(B, temperature=None, top_k=None, top_p=None, generators=None):
    """vLLM's SamplingMetadata of B requests without penalties: greedy when temperature is
    None, else every request at that temperature (and top_k / top_p when given); generators:
    {batch row: torch.Generator} of the seeded requests."""
    import torch
    from vllm.v1.sample.logits_processor import LogitsProcessors
    from vllm.v1.sample.metadata import SamplingMetadata

    greedy = temperature is None
    return SamplingMetadata(
        temperature=None if greedy else torch.full((B,), temperature),
        all_greedy=greedy,
        all_random=not greedy,
        top_p=None if top_p is None else torch.full((B,), top_p),
        top_k=None if top_k is None else torch.full((B,), top_k, dtype=torch.int32),
        generators=generators or {},
        max_num_logprobs=None,
        no_penalties=True,
        prompt_token_ids=None,
        frequency_penalties=torch.zeros(B),
        presence_penalties=torch.zeros(B),
        repetition_penalties=torch.ones(B),
        output_token_ids=[[] for _ in range(B)],
        allowed_token_ids_mask=None,
        bad_words_token_ids={},
        logitsprocs=LogitsProcessors(),
    )


def _sampler_inputs(B, K, V, accept, greedy):
    import torch

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(B * K, V, generator=g) * 3
    best = logits.argmax(-1)
    hit = torch.rand(B * K, generator=g) < accept
    drafts = torch.where(hit, best, (best + 1 + torch.randint(V - 1, (B * K,), generator=g)) % V)
    meta = sampling_metadata(B, temperature=None if greedy else 1.0)
    cu = torch.cumsum(torch.full((B,), K, dtype=torch.int32), 0, dtype=torch.int32)
    bonus = torch.randint(V, (B, 1), generator=g)
    return drafts.to(torch.int32), [K] * B, K, cu, None, logits, bonus, meta


# ---------------------------------------------------------------------- the table
def _goals(result: dict, vllm: dict) -> dict:
    """specdec's best over vLLM's best tokens/s, at batch 1 (greedy) and at the concurrency."""
    ours1 = {  # specdec's own rows (its Stats have target_forwards; HF's, llama.cpp's not)
        k: v["tokens_per_s"]
        for k, v in result.get("batch1", {}).get("0.0", {}).items()
        if "target_forwards" in v
    } | {k: v["tokens_per_s"] for k, v in vllm["specdec_chains"].items()}
    ours_n = {k: v["tokens_per_s"] for k, v in vllm["specdec_concurrent"].items()}
    theirs1 = {k: v["tokens_per_s"] for k, v in vllm["batch1"].items()}
    theirs_n = {k: v["tokens_per_s"] for k, v in vllm["concurrent"].items()}
    concurrency = vllm["config"]["concurrency"]
    goals = {
        "batch1": _best_ratio(ours1, theirs1, 2.0),
        f"concurrent{concurrency}": _best_ratio(ours_n, theirs_n, 1.3),
    }
    # specdec's trees inside vLLM against vLLM's own best chain with the same heads (1.3x)
    # and vLLM plain (2x at batch 1, at most 3 % slower at the concurrency)
    trees = {
        k for k in theirs1 if k.startswith("vllm_specdec_") and ("tree" in k or "adaptive" in k)
    }
    chains = {"vllm_eagle", "vllm_eagle3"}
    for label, table, base, target in (
        ("trees_batch1_vs_vllm_chain", theirs1, chains, 1.3),
        ("trees_batch1_vs_vllm_plain", theirs1, {"vllm_plain"}, 2.0),
        (f"trees_concurrent{concurrency}_vs_vllm_plain", theirs_n, {"vllm_plain"}, 0.97),
    ):
        goals[label] = _best_ratio(
            {k: table[k] for k in trees if k in table},
            {k: table[k] for k in base if k in table},
            target,
        )
    return {label: goal for label, goal in goals.items() if goal is not None}


def _best_ratio(ours: dict, theirs: dict, target: float) -> dict | None:
    """The best of ours over the best of theirs ({name: tokens/s}); None when either is empty."""
    if not ours or not theirs:
        return None
    a, b = max(ours, key=ours.get), max(theirs, key=theirs.get)
    return {
        "specdec_best": a,
        "specdec_tokens_per_s": ours[a],
        "vllm_best": b,
        "vllm_tokens_per_s": theirs[b],
        "ratio": ours[a] / theirs[b],
        "target": target,
    }


def _merge(result: dict, vllm: dict) -> None:
    """The vLLM rows join the bench's greedy batch-1 table (speedup_vs_plain against specdec's
    plain, as every row there) and its sweep at the concurrency."""
    table = result.setdefault("batch1", {}).setdefault("0.0", {})
    base = table.get("plain", {}).get("tokens_per_s")
    for name, row in vllm["batch1"].items():
        merged = dict(row, mean_acceptance_length=row["tokens_per_forward"])
        if base:
            merged["speedup_vs_plain"] = row["tokens_per_s"] / base
        table[name] = merged
    n = str(vllm["config"]["concurrency"])
    plain_n = vllm["specdec_concurrent"]["plain"]["tokens_per_s"]
    for name, row in {**vllm["concurrent"], **vllm["specdec_concurrent"]}.items():
        key = name if name.startswith("vllm") else f"{name} (vs vLLM)"
        merged = dict(row, speedup_vs_plain=row["tokens_per_s"] / plain_n)
        result.setdefault("sweep", {}).setdefault(key, {})[n] = merged


def summary(result: dict) -> str:
    """The vLLM section of the bench's printed summary."""
    vllm = result.get("vllm")
    if not vllm:
        return ""
    c = vllm["config"]
    lines = [
        f"== vLLM {c['vllm']} beside specdec: {c['dtype']}, {c['threads']} threads, greedy, "
        f"depth {c['depth']}, {'eager' if c['enforce_eager'] else 'compiled'} ==",
        f"{'row':<34}{'b1 tok/s':>10}{'tok/fwd':>9}{'vLLM AL':>9}{'exact':>7}"
        + f"x{c['concurrency']} tok/s".rjust(12),
    ]
    for name, row in vllm["batch1"].items():
        al, same = row.get("vllm_acceptance_length"), row.get("same_tokens_as_plain")
        lines.append(
            f"{name:<34}{row['tokens_per_s']:>10.2f}{row['tokens_per_forward']:>9.3f}"
            f"{'-' if al is None else f'{al:.3f}':>9}{'-' if same is None else f'{same:.0%}':>7}"
            f"{vllm['concurrent'][name]['tokens_per_s']:>12.2f}"
        )
    for name, row in vllm["specdec_chains"].items():
        lines.append(f"{name:<34}{row['tokens_per_s']:>10.2f}{row['mean_acceptance_length']:>9.3f}")
    for name, row in vllm["specdec_concurrent"].items():
        lines.append(f"{'specdec ' + name:<34}{'':>35}{row['tokens_per_s']:>12.2f}")
    lines.append("== rejection sampling per call (ms): vLLM's CPU kernels vs specdec's op ==")
    for key, t in vllm["sampler"].items():
        lines.append(
            f"{key:<28}vLLM {t['vllm']:8.3f}  specdec {t['specdec']:8.3f}"
            + (f"  same output: {t['same_output']}" if "same_output" in t else "")
        )
    if "vllm_plain_same_tokens_as_specdec_plain" in vllm:
        lines.append(
            "vLLM plain's greedy output equals specdec plain's on "
            f"{vllm['vllm_plain_same_tokens_as_specdec_plain']:.0%} of the prompts"
        )
    for label, g in vllm["goals"].items():
        lines.append(
            f"goal {label}: specdec {g['specdec_best']} {g['specdec_tokens_per_s']:.2f} / vLLM "
            f"{g['vllm_best']} {g['vllm_tokens_per_s']:.2f} = {g['ratio']:.2f}x "
            f"(target >= {g['target']}x)"
        )
    return "\n".join(lines)


def main(argv=None) -> None:
    """`python -m specdec.bench.vllm engine|sampler IN.json OUT.json`: one
    vLLM engine's rows (run_engine) or the sampler timing, as the benchmark's children."""
    kind, src, dst = (sys.argv[1:] if argv is None else argv)[:3]
    with open(src) as f:
        setting = json.load(f)
    if kind == "engine":
        out = run_engine(setting)
    else:
        out = sampler_timing(
            (1, setting["concurrency"]), setting["depth"], threads=setting["threads"]
        )
    with open(dst, "w") as f:
        json.dump(out, f)


if __name__ == "__main__":
    main()
