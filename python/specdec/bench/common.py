"""What the benchmarks share: the machine description they record beside their figures, and
the engine warm-up before timing."""

import datetime
import os
import subprocess


def machine_info(device) -> dict:
    """Where and when the figures come from: CPU / GPU model, date, commit, versions."""
    import torch

    from specdec_kernels.testing import cpu_description

    cpu = cpu_description()
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
        "torch_threads": torch.get_num_threads(),
        # the machine's load when the run started: figures from a busy machine are flagged
        "load_average_1_5_15min": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
    }
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
    return info


def warm_up(engine, prompt_ids: list) -> None:
    """One short request on the longest prompt before a timed run: the decode path's first
    calls, and the weight layouts that prompt's prefill takes (oneDNN's past
    SPECDEC_TILED_ROWS rows, packed on first use) are paid here, not by whichever method is
    timed first on the shared model."""
    from specdec.runtime.requests import Request, SamplingParams

    engine.generate([Request(list(max(prompt_ids, key=len)), SamplingParams(max_new_tokens=2))])
