"""The `specdec` command line.

    specdec generate --prompt "Why is the sky blue?"            # default model + its EAGLE head
    specdec generate --prompts in.jsonl --output out.jsonl --method plain --batch-size 4

Subcommands register themselves in SUBCOMMANDS (name -> (add_arguments, run)); `bench` and
`train-head` slot in next to `generate`. Bad input of any kind is one line on stderr and
exit code 2, never a traceback.
"""
import argparse
import json
import sys

from . import bench, train
from .drafting import TreeSpec
from .errors import InvalidRequestError, SpecdecError

RANDOM_HEAD_SEED = 0


# ---------------------------------------------------------------------- generate
def add_generate_arguments(p: argparse.ArgumentParser):
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="a single prompt")
    src.add_argument("--prompts", metavar="FILE.jsonl", help="one JSON object per line with a 'prompt' field")
    p.add_argument("--no-chat-template", action="store_true", help="tokenize prompts as raw text")
    p.add_argument("--model", metavar="PATH", help="a .gguf file or HF checkpoint dir (default: SmolLM2-135M-Instruct)")
    add_model_placement_arguments(p)
    p.add_argument("--method", choices=("plain", "eagle"), default="eagle")
    p.add_argument("--head", metavar="PATH", help="EAGLE head directory (default: the model's shipped head)")
    p.add_argument("--tree", default="adaptive",
                   help="chain:K, dynamic:DEPTH,TOPK,TOTAL or adaptive[:DEPTH,TOPK,TOTAL] (default %(default)s: "
                        "depth and size chosen each step from this machine's measured costs)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-k", type=int, default=0, help="0 = off (default)")
    p.add_argument("--top-p", type=float, default=1.0, help="1 = off (default)")
    p.add_argument("--seed", type=int, default=0, help="request i uses seed + i")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("--max-seq-len", type=int, default=2048, help="cache positions per request")
    p.add_argument("--output", metavar="FILE.jsonl", help="per prompt: prompt, text, token_ids, finish_reason, stats")


def run_generate(args) -> int:
    from .engine import Engine, Request, SamplingParams

    # everything checkable without the model first: bad flags fail fast
    prompts = read_prompts(args)
    tree = TreeSpec.parse(args.tree)
    params = [SamplingParams(args.temperature, args.top_k, args.top_p, args.seed + i, args.max_new_tokens)
              for i in range(len(prompts))]
    params[0].validate()
    for flag in ("batch_size", "max_seq_len"):
        if getattr(args, flag) < 1:
            raise InvalidRequestError(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}")
    model, tokenizer = load_model_from_args(args)
    head = load_eagle_head(args, model) if args.method == "eagle" else None
    requests = [Request(encode(tokenizer, text, not args.no_chat_template), p, id=i, prompt=text)
                for i, (text, p) in enumerate(zip(prompts, params))]
    engine = Engine(model, tokenizer, head=head, tree=tree, batch_size=args.batch_size,
                    max_seq_len=args.max_seq_len)
    bar = progress_bar(len(requests))
    results, stats = engine.generate(requests, progress=(lambda _: bar.update(1)) if bar else None)
    if bar:
        bar.close()
    if args.output:
        with open(args.output, "w") as f:
            for r in results:
                f.write(json.dumps({"prompt": r.prompt, "text": r.text, "token_ids": r.token_ids,
                                    "finish_reason": r.finish_reason, "stats": r.stats.to_dict()}) + "\n")
    else:
        for r in results:
            print(r.text if len(results) == 1 else f"[{r.request_id}] {r.text}")
    label = "plain" if head is None else f"eagle-{head.version} {tree}"
    print(f"\n== {label}, batch size {args.batch_size} ==")
    print(stats.summary())
    return 0


def add_model_placement_arguments(p):
    p.add_argument("--device", default="auto", help="cpu, cuda, cuda:N (default: cuda when available)")
    p.add_argument("--dtype", choices=("auto", "float32", "bfloat16", "float16"), default="auto",
                   help="model dtype (default auto: bfloat16 on GPUs and CPUs with native bf16, else float32)")


def load_model_from_args(args):
    from .loader import load_model, resolve_device, resolve_dtype

    device = resolve_device(args.device)
    return load_model(args.model, dtype=resolve_dtype(args.dtype, device), device=device)


def read_prompts(args) -> list:
    if args.prompt is not None:
        prompts = [args.prompt]
    else:
        try:
            with open(args.prompts) as f:
                lines = [line for line in f if line.strip()]
            prompts = [json.loads(line)["prompt"] for line in lines]
        except OSError as e:
            raise InvalidRequestError(f"cannot read --prompts file: {e}") from None
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise InvalidRequestError(f"--prompts {args.prompts}: each line must be a JSON object "
                                      f"with a 'prompt' field ({type(e).__name__}: {e})") from None
        if not prompts:
            raise InvalidRequestError(f"--prompts {args.prompts} holds no prompt")
    for i, p in enumerate(prompts):
        if not isinstance(p, str) or not p.strip():
            raise InvalidRequestError(f"prompt {i} is empty")
    return prompts


def encode(tokenizer, text: str, chat_template: bool) -> list:
    if not chat_template:
        return tokenizer.encode(text, add_special_tokens=True)
    try:
        return tokenizer.apply_chat_template([{"role": "user", "content": text}])
    except ValueError as e:
        raise InvalidRequestError(f"{e} (--no-chat-template)") from None


def load_eagle_head(args, model):
    from .eagle import EagleHead, load_head
    from .heads import shipped_head_path

    path = args.head or shipped_head_path(args.model)
    if path:
        return load_head(path, model)
    # Models without a shipped head: a seeded random head keeps the speculative path
    # runnable end to end (acceptance length ~1).
    print("specdec: warning: no EAGLE head given and none shipped for this model; using a randomly "
          "initialised head (acceptance will be low)", file=sys.stderr)
    return EagleHead.random(model, seed=RANDOM_HEAD_SEED)


def progress_bar(total: int):
    if total < 2:
        return None
    from tqdm import tqdm

    return tqdm(total=total, desc="requests", unit="req", file=sys.stderr)


# ---------------------------------------------------------------------- entry point
SUBCOMMANDS = {
    "generate": (add_generate_arguments, run_generate, "generate text, speculatively (EAGLE) or plainly"),
    "train-head": (train.add_arguments, train.run, train.HELP),
    "bench": (bench.add_arguments, bench.run, bench.HELP),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="specdec", description="Exact speculative decoding.")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (add_arguments, run, help_text) in SUBCOMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        add_arguments(p)
        p.set_defaults(run=run)
    return parser


def main(argv=None):
    args = build_parser().parse_args(argv)
    try:
        code = args.run(args)
    except SpecdecError as e:
        print(f"specdec: error: {e}", file=sys.stderr)
        code = 2
    if code:
        raise SystemExit(code)


if __name__ == "__main__":
    main()
