"""Argument helpers the subcommands share (model placement flags, loading the model they name)
and the machine description the benchmarks record."""

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


def load_model_from_args(args):
    from ..loader import load_model, resolve_device, resolve_dtype

    device = resolve_device(args.device)
    return load_model(args.model, dtype=resolve_dtype(args.dtype, device), device=device)


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
