"""`specdec generate`: decode prompts with the engine, speculatively (EAGLE, n-gram lookup) or
plainly.

    specdec generate --prompt "Why is the sky blue?"  # default model, EAGLE + n-gram, adaptive
    specdec generate --prompts in.jsonl --output out.jsonl --method plain --batch-size 4
    specdec generate --prompts edits.jsonl --method ngram --ngram-max 4 --ngram-min 2 --tree chain:8
    specdec generate --prompt "Why is the sky blue?" --method medusa --tree dynamic:4,4,16
    torchrun --nproc-per-node 2 -m specdec generate --tp 2 --prompt "Why is the sky blue?"

Bad input of any kind is a SpecdecError (the CLI prints one line, exit code 2). A request that
fails on its own (an invalid prompt among valid ones, NaN logits) is one stderr line and a row
with finish_reason "error"; the others complete, and the exit code is 1. Results are written as
requests finish; Ctrl-C keeps them and exits with 130.

--tp N (tensor parallelism, specdec.models.tensor_parallel): the N processes torchrun
launches each hold 1/N of the target's attention heads and MLP; rank 0 samples, prints and
writes --output, the others are silent.
"""

import argparse
import json
import os
import sys

from specdec.cli.common import (
    add_drafter_arguments,
    add_model_placement_arguments,
    add_tree_argument,
    load_model_from_args,
)
from specdec.drafters.choice import DrafterChoice
from specdec.errors import InvalidRequestError, SpecdecError
from specdec.speculation.trees import TreeSpec


def add_arguments(p: argparse.ArgumentParser):
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="a single prompt")
    src.add_argument(
        "--prompts", metavar="FILE.jsonl", help="one JSON object per line with a 'prompt' field"
    )
    p.add_argument("--no-chat-template", action="store_true", help="tokenize prompts as raw text")
    p.add_argument(
        "--model",
        metavar="PATH",
        help="a .gguf file or HF checkpoint dir (default: SmolLM2-135M-Instruct)",
    )
    add_model_placement_arguments(p)
    add_drafter_arguments(p)
    add_tree_argument(p)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-k", type=int, default=0, help="0 = off (default)")
    p.add_argument("--top-p", type=float, default=1.0, help="1 = off (default)")
    p.add_argument("--seed", type=int, default=0, help="request i uses seed + i")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("--max-seq-len", type=int, default=2048, help="cache positions per request")
    p.add_argument(
        "--tp",
        type=int,
        default=1,
        metavar="N",
        help="tensor parallelism over N processes (launch with torchrun --nproc-per-node N "
        "-m specdec generate --tp N ...): each rank holds 1/N of the target's attention heads "
        "and MLP; gloo on CPU, NCCL on GPUs (default 1: no parallelism)",
    )
    p.add_argument(
        "--output",
        metavar="FILE.jsonl",
        help="a row per prompt, written as it finishes: id, prompt, text, token_ids, "
        "finish_reason, "
        "error, stats",
    )


def run(args) -> int:
    from specdec.runtime.engine import join_errors
    from specdec.runtime.requests import SamplingParams

    # everything checkable without the model first: bad flags fail fast
    choice = DrafterChoice.from_args(args)
    prompts, rejected = read_prompts(args)  # rejected: {index: why} of prompts that cannot run
    tree = TreeSpec.parse(args.tree)
    choice.check_tree(tree)
    params = [
        SamplingParams(args.temperature, args.top_k, args.top_p, args.seed + i, args.max_new_tokens)
        for i in range(len(prompts))
    ]
    params[0].validate()
    for flag in ("batch_size", "max_seq_len", "tp"):
        if getattr(args, flag) < 1:
            raise InvalidRequestError(
                f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}"
            )
    check_output_path(args.output)
    if len(rejected) == len(prompts):
        raise InvalidRequestError(join_errors(list(rejected.values())))
    parallel = None
    if args.tp > 1:
        from specdec.models.loader import resolve_device
        from specdec.models.tensor_parallel import init

        parallel = init(args.tp, resolve_device(args.device))
        args.device = str(parallel.device)  # this rank's GPU
    try:
        return _run(args, choice, prompts, rejected, tree, params, parallel)
    except SpecdecError:
        if parallel is not None and parallel.rank != 0:
            return 2  # every rank meets the same bad input: rank 0 alone reports it
        raise
    finally:
        if parallel is not None:
            from specdec.models.tensor_parallel import shutdown

            shutdown()


def _run(args, choice, prompts, rejected, tree, params, parallel) -> int:
    from specdec.runtime.engine import Engine, join_errors
    from specdec.runtime.requests import Request

    model, tokenizer = load_model_from_args(args)
    drafter = choice.build(model, args.model)  # replicated on every rank: built whole
    sampler = None
    if parallel is not None:
        from specdec.models.tensor_parallel import BroadcastSampler, shard_model

        shard_model(model, parallel.rank, parallel.world)
        sampler = BroadcastSampler()
    requests = {}
    for i, (text, p) in enumerate(zip(prompts, params)):
        if i not in rejected:
            try:
                requests[i] = Request(
                    encode(tokenizer, text, not args.no_chat_template), p, id=i, prompt=text
                )
            except InvalidRequestError as e:
                rejected[i] = f"request {i}: {e}"
    if not requests:
        raise InvalidRequestError(join_errors([rejected[i] for i in sorted(rejected)]))
    engine = Engine(
        model,
        tokenizer,
        drafter=drafter,
        tree=tree,
        batch_size=args.batch_size,
        max_seq_len=args.max_seq_len,
        sampler=sampler,
    )
    for i, req in list(requests.items()):
        try:
            engine.validate(req)
        except InvalidRequestError as e:
            rejected[i] = str(e)
            del requests[i]
    if not requests:
        raise InvalidRequestError(join_errors([rejected[i] for i in sorted(rejected)]))

    quiet = parallel is not None and parallel.rank != 0  # rank 0 reports for all
    sink = ResultSink(None if quiet else args.output, len(prompts), quiet)
    try:
        for i in sorted(rejected):  # every invalid request, before any work
            sink.reject(i, prompts[i], rejected[i])
        _, stats = engine.generate(list(requests.values()), progress=sink)
    except KeyboardInterrupt:
        sink.close()
        where = f" (in {args.output})" if args.output else ""
        print(
            f"specdec: interrupted: {sink.finished} of {len(prompts)} requests finished{where}",
            file=sys.stderr,
        )
        return 130
    finally:
        sink.close()
    label = f"{choice.label(drafter)} {tree}" if choice.method != "plain" else "plain"
    if parallel is not None:
        label += f", tensor parallel over {parallel.world} ranks"
    if not quiet:
        print(f"\n== {label}, batch size {args.batch_size} ==")
        print(stats.summary())
    return 1 if sink.failed else 0


def check_output_path(path):
    """Before any work: --output must be a file we can create or overwrite."""
    if path is None:
        return
    if os.path.isdir(path):
        raise InvalidRequestError(f"--output {path} is a directory")
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent):
        raise InvalidRequestError(f"--output {path}: directory {parent} does not exist")
    if not os.access(path if os.path.exists(path) else parent, os.W_OK):
        raise InvalidRequestError(f"--output {path}: permission denied")


class ResultSink:
    """Where results go as their requests finish: a flushed JSONL row each (--output) or their
    text on stdout, and one stderr line per failed request; a progress bar for several."""

    def __init__(self, output, total: int, quiet: bool = False):
        """quiet: write nothing at all (a tensor-parallel rank other than 0)."""
        self.single, self.quiet = total == 1, quiet
        self.file = None
        if output:
            try:
                self.file = open(output, "w", encoding="utf-8")
            except OSError as e:
                raise InvalidRequestError(f"cannot write --output {output}: {e}") from None
        self.bar = None if quiet else progress_bar(total)
        self.finished = self.failed = 0

    def __call__(self, r):
        """engine.generate's progress callback: one finished Result."""
        self._write(
            {
                "id": r.request_id,
                "prompt": r.prompt,
                "text": r.text,
                "token_ids": r.token_ids,
                "finish_reason": r.finish_reason,
                "error": r.error,
                "stats": r.stats.to_dict(),
            },
            r.error,
            r.text if self.single else f"[{r.request_id}] {r.text}",
        )

    def reject(self, index, prompt, error: str):
        """A request that failed validation (never ran)."""
        self._write(
            {
                "id": index,
                "prompt": prompt,
                "text": None,
                "token_ids": [],
                "finish_reason": "error",
                "error": error,
                "stats": None,
            },
            error,
            None,
        )

    def _write(self, row, error, text):
        self.finished += 1
        if error is not None:
            self.failed += 1
            self._print(f"specdec: error: {error}", sys.stderr)
        if self.file is not None:
            self.file.write(json.dumps(row, ensure_ascii=False) + "\n")
            self.file.flush()
        elif error is None:
            self._print(text, sys.stdout)
        if self.bar is not None:
            self.bar.update(1)

    def _print(self, line, file):
        if self.quiet:
            return
        if self.bar is not None:  # above the bar, never onto its line
            self.bar.write(line, file=file)
        else:
            print(line, file=file, flush=True)

    def close(self):
        if self.bar is not None:
            self.bar.close()
            self.bar = None
        if self.file is not None:
            self.file.close()
            self.file = None


def read_prompts(args) -> tuple[list, dict]:
    """-> (prompts, {index: error} of the prompts that are not a non-empty string). A file
    that is not JSON lines with a 'prompt' field is bad input as a whole."""
    if args.prompt is not None:
        prompts = [args.prompt]
    else:
        try:
            with open(args.prompts, encoding="utf-8") as f:
                lines = [(n, line) for n, line in enumerate(f, 1) if line.strip()]
        except OSError as e:
            raise InvalidRequestError(f"cannot read --prompts file: {e}") from None
        except UnicodeDecodeError as e:
            raise InvalidRequestError(f"--prompts {args.prompts} is not UTF-8 text: {e}") from None
        prompts = []
        for n, line in lines:
            try:
                prompts.append(json.loads(line)["prompt"])
            except (json.JSONDecodeError, KeyError, TypeError, IndexError) as e:
                raise InvalidRequestError(
                    f"--prompts {args.prompts} line {n}: each line must be a JSON object "
                    f"with a 'prompt' field ({type(e).__name__}: {e})"
                ) from None
        if not prompts:
            raise InvalidRequestError(f"--prompts {args.prompts} holds no prompt")
    rejected = {}
    for i, p in enumerate(prompts):
        if not isinstance(p, str):
            rejected[i] = (
                f"request {i}: the prompt must be a string, got {type(p).__name__} "
                f"{json.dumps(p):.40}"
            )
        elif not p.strip():
            rejected[i] = f"request {i}: empty prompt"
    return prompts, rejected


def encode(tokenizer, text: str, chat_template: bool) -> list:
    try:
        if not chat_template:
            return tokenizer.encode(text, add_special_tokens=True)
        return tokenizer.apply_chat_template([{"role": "user", "content": text}])
    except ValueError as e:
        raise InvalidRequestError(
            f"{e} (--no-chat-template)" if chat_template else str(e)
        ) from None
    except (
        Exception
    ) as e:  # a chat template's raise_exception (jinja2 TemplateError), tokenizer errors
        raise InvalidRequestError(f"cannot tokenize the prompt: {type(e).__name__}: {e}") from None


def progress_bar(total: int):
    if total < 2:
        return None
    from tqdm import tqdm

    return tqdm(total=total, desc="requests", unit="req", file=sys.stderr)
