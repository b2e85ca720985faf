"""Arguments the subcommands share: where and in which dtype the model runs (and loading the
model they name), and which drafter runs (turned into a Drafter by specdec.drafters.choice)."""

import argparse

from specdec.drafters.choice import METHODS


def add_model_placement_arguments(p):
    p.add_argument(
        "--device", default="auto", help="cpu, cuda, cuda:N (default: cuda when available)"
    )
    p.add_argument(
        "--dtype",
        choices=("auto", "float32", "bfloat16", "float16"),
        default="auto",
        help="model dtype (default auto: bfloat16 on GPUs and CPUs with native bf16, else float32)",
    )
    p.add_argument(
        "--compile",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="run the verify step through torch.compile (default: SPECDEC_COMPILE, else off); "
        "faster steps, but compiling costs minutes per tree size on CPU",
    )


def load_model_from_args(args):
    from specdec.models.loader import load_model, resolve_device, resolve_dtype
    from specdec.runtime.compiled_step import configure

    device = resolve_device(args.device)
    dtype = resolve_dtype(args.dtype, device)
    model, tokenizer = load_model(args.model, dtype=dtype, device=device)
    configure(model, getattr(args, "compile", None))  # the Engines built on it keep the choice
    return model, tokenizer


# The default method: the fastest exact one measured on the reference machine class
# (docs/benchmarks.md, end to end: EAGLE + n-gram with adaptive trees)
DEFAULT_METHOD = "eagle+ngram"


def add_drafter_arguments(p, default_method: str = DEFAULT_METHOD):
    p.add_argument(
        "--method",
        choices=METHODS,
        default=default_method,
        help="the drafter: plain (none), eagle (an EAGLE head), medusa (Medusa heads), draft (a "
        "standalone draft model, --draft-model), ngram (prompt lookup over the request's own "
        "tokens), eagle+ngram (one tree merging both) (default %(default)s)",
    )
    p.add_argument(
        "--head",
        metavar="PATH",
        help="EAGLE head directory, or the name of a shipped one (specdec.heads; e.g. "
        "smollm2-135m-instruct-eagle3); default: the model's shipped head",
    )
    p.add_argument(
        "--medusa",
        metavar="PATH",
        help="Medusa heads directory (default: the model's shipped heads)",
    )
    p.add_argument(
        "--draft-model",
        metavar="PATH|self:N",
        help="draft: a Llama-family checkpoint (.gguf or HF dir) with the target's tokenizer, or "
        "self:N, the target's first N layers (shares its weights)",
    )
    p.add_argument(
        "--ngram-max",
        type=int,
        default=4,
        metavar="N",
        help="ngram: longest suffix n-gram looked up (default %(default)s)",
    )
    p.add_argument(
        "--ngram-min",
        type=int,
        default=1,
        metavar="N",
        help="ngram: shortest suffix n-gram looked up (default %(default)s)",
    )


def add_tree_argument(p):
    """--tree: the drafters' tree (generate, serve)."""
    p.add_argument(
        "--tree",
        default="adaptive",
        help="chain:K, dynamic:DEPTH,TOPK,TOTAL or adaptive[:DEPTH,TOPK,TOTAL] (default "
        "%(default)s: depth and size chosen each step from this machine's measured costs); for "
        "ngram, TOPK bounds the branches (earlier occurrences of the matched n-gram)",
    )
