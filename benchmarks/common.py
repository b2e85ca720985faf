"""Shared helpers of the microbenchmarks: timing, a plain-text table, JSON output.

Usage from a benchmark script:
    from common import time_fn, print_table, write_json
    ms = time_fn(lambda: op(*args), warmup=3, iters=10) * 1e3
"""
import datetime
import json
import os
import platform
import statistics
import subprocess
import time

import torch


def _sync(device):
    if device is not None and torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def time_fn(fn, warmup=3, iters=10, device=None):
    """Median wall time of fn() in seconds.

    device: where fn's work runs; "cuda" (or a CUDA torch.device) times each call with
    CUDA events, anything else with time.perf_counter. The median resists the
    outliers of a machine shared with other jobs.
    """
    for _ in range(warmup):
        fn()
    _sync(device)
    times = []
    if device is not None and torch.device(device).type == "cuda":
        for _ in range(iters):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
    else:
        for _ in range(iters):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _fmt(v):
    if isinstance(v, float):
        return f"{v:.3f}" if abs(v) < 1e4 else f"{v:.3g}"
    return str(v)


def print_table(rows, columns):
    """Prints rows (list of dicts) as an aligned text table of the given columns (keys)."""
    cells = [[_fmt(r.get(c, "")) for c in columns] for r in rows]
    widths = [max([len(c)] + [len(row[i]) for row in cells]) for i, c in enumerate(columns)]
    print("  ".join(c.rjust(w) for c, w in zip(columns, widths)))
    print("  ".join("-" * w for w in widths))
    for row in cells:
        print("  ".join(v.rjust(w) for v, w in zip(row, widths)))


def _cpu_model():
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _git_commit():
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                             cwd=os.path.dirname(os.path.abspath(__file__)), timeout=10)
        return out.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def machine_info(device=None):
    """Where the numbers were measured: platform, CPU model, threads, torch (and GPU) versions."""
    info = {
        "platform": platform.platform(),
        "cpu": _cpu_model(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
    }
    if device is not None and torch.device(device).type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
        info["cuda"] = torch.version.cuda
    return info


def write_json(path, rows, meta=None):
    """Writes {"meta": machine/date/commit + meta, "rows": rows} to path (parents created)."""
    meta = dict(meta or {})
    full = {
        "machine": machine_info(meta.pop("device", None)),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "git_commit": _git_commit(),
        **meta,
    }
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump({"meta": full, "rows": rows}, f, indent=2)
        f.write("\n")
    print(f"wrote {path}")
