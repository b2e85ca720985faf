"""The `specdec` command line: one module of specdec.cli per subcommand.

    specdec generate --prompt "Why is the sky blue?"            # default model + its EAGLE head
    specdec generate --prompts in.jsonl --output out.jsonl --method plain --batch-size 4
    specdec bench --quick
    specdec train-head --help

Each subcommand is a module of specdec.cli with add_arguments(parser) and run(args) -> exit
code, imported only when it is the one asked for (so `specdec generate` never imports the
benchmark or training code). Entry points import the library, never the reverse: nothing in
specdec imports this module. Bad input of any kind (a SpecdecError) is one line on stderr and
exit code 2, never a traceback; Ctrl-C is one line and exit code 130.
"""

import argparse
import importlib
import sys

from specdec.errors import SpecdecError

# name -> (module implementing it, one-line help)
SUBCOMMANDS = {
    "generate": ("specdec.cli.generate", "generate text, speculatively (EAGLE) or plainly"),
    "train-head": (
        "specdec.cli.train_head",
        "train an EAGLE head (or Medusa heads, --kind medusa) by self-distillation",
    ),
    "bench": (
        "specdec.cli.bench",
        "end-to-end benchmark on MT-bench prompts: HF generate, prompt lookup, "
        "plain, EAGLE chain / tree",
    ),
    "export-head": (
        "specdec.cli.export_head",
        "write a head (EAGLE-2/3, Medusa) as a checkpoint another engine loads (vLLM)",
    ),
    "serve": (
        "specdec.cli.serve",
        "an OpenAI-compatible HTTP server (chat / completions, streaming) on the online engine",
    ),
}


def build_parser(argv=None) -> argparse.ArgumentParser:
    """The parser, with the arguments of the subcommand named in argv (default sys.argv[1:])
    only: the other subcommands' modules are not imported."""
    argv = sys.argv[1:] if argv is None else argv
    chosen = next((a for a in argv if not a.startswith("-")), None)
    parser = argparse.ArgumentParser(prog="specdec", description="Exact speculative decoding.")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (module, help_text) in SUBCOMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        if name == chosen:
            app = importlib.import_module(module)
            app.add_arguments(p)
            p.set_defaults(run=app.run)
    return parser


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser(argv).parse_args(argv)
    try:
        code = args.run(args)
    except SpecdecError as e:
        print(f"specdec: error: {e}", file=sys.stderr)
        code = 2
    except KeyboardInterrupt:  # before generation started (loading, measuring)
        print("specdec: interrupted", file=sys.stderr)
        code = 130
    if code:
        raise SystemExit(code)


if __name__ == "__main__":
    main()
