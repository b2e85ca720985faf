"""`specdec export-head NAME|DIR --format vllm --out DIR`: a specdec head (a shipped head's
name or a directory `specdec train-head` wrote) as a checkpoint directory vLLM's own
speculative methods load (export.py says what changes on the way).

    specdec export-head smollm2-135m-instruct-eagle3 --format vllm --out heads/eagle3
    vllm serve MODEL_DIR --speculative-config \\
        '{"method": "eagle3", "model": "heads/eagle3", "num_speculative_tokens": 4}'

Prints the directory, the vLLM method and the speculative config to pass; needs no vLLM.
"""

import json

FORMATS = ("vllm",)


def add_arguments(p) -> None:
    p.add_argument(
        "head",
        metavar="NAME|DIR",
        help="a shipped head (smollm2-135m-instruct, smollm2-135m-instruct-eagle3, "
        "smollm2-135m-instruct-medusa) or a head directory (EAGLE-2/3 or Medusa)",
    )
    p.add_argument(
        "--format", choices=FORMATS, required=True, help="the engine to export for: vllm"
    )
    p.add_argument("--out", metavar="DIR", required=True, help="the directory to write")
    p.add_argument(
        "--model",
        metavar="PATH",
        help="the target the head drafts for: .gguf or HF checkpoint dir (default: "
        "SmolLM2-135M-Instruct); its shapes are checked and Medusa's export copies its lm_head",
    )


def run(args) -> int:
    from specdec.integrations.vllm.export import export_head

    exported = export_head(args.head, args.out, args.model)
    config = {
        "method": exported.method,
        "model": exported.path,
        "num_speculative_tokens": exported.num_speculative_tokens,
    }
    print(f"wrote {exported.path} (vLLM method {exported.method!r})")
    for note in exported.notes:
        print(f"  {note}")
    print(f"speculative config: {json.dumps(config)}")
    return 0
