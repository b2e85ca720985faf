"""Argument helpers the subcommands share (model placement flags, loading the model they name)
and the machine description the benchmarks record."""

import argparse
import datetime
import os
import platform
import subprocess


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
    from ..compiled_step import configure
    from ..loader import load_model, resolve_device, resolve_dtype

    device = resolve_device(args.device)
    dtype = resolve_dtype(args.dtype, device)
    model, tokenizer = load_model(args.model, dtype=dtype, device=device)
    configure(model, getattr(args, "compile", None))  # the Engines built on it keep the choice
    return model, tokenizer


def machine_info(device) -> dict:
    """Where and when the figures come from: CPU / GPU model, date, commit, versions."""
    import torch

    cpu = platform.processor()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(
                (line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu
            )
    except OSError:
        pass
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            cwd=os.path.dirname(os.path.abspath(__file__)),
            timeout=10,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        commit = ""
    info = {
        "machine": f"{cpu}, {os.cpu_count()} logical CPUs",
        "date": datetime.date.today().isoformat(),
        "commit": commit or None,
        "torch": torch.__version__,
    }
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
    return info


def warm_up(engine, prompt_ids: list) -> None:
    """One short request on the longest prompt before a timed run: the decode path's first
    calls, and the weight layouts that prompt's prefill takes (oneDNN's past
    SPECDEC_TILED_ROWS rows, packed on first use) are paid here, not by whichever method is
    timed first on the shared model."""
    from ..engine import Request, SamplingParams

    engine.generate([Request(list(max(prompt_ids, key=len)), SamplingParams(max_new_tokens=2))])
