"""Shared helpers of the microbenchmarks: tables, JSON with machine info, one benchmark run.

The timing helpers and the input generators live in the package, shared with the tests
(specdec_kernels.testing: time_fn, rotated_inputs, measure_copy_bandwidth, random_trees, ...).

Usage from a benchmark script:
    from common import BenchRun, bench_parser, goal_status
    from specdec_kernels.testing import random_trees, rotated_inputs, time_fn
    run = BenchRun(bench_parser(__doc__).parse_args(), "tree_verify")
    run.add(row); run.finish(columns)      # printed table + benchmarks/out/<op>_<device>.json
"""

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys

import torch

# The benchmarks run from a plain checkout too: the repository root (specdec_kernels) goes on
# the path when this module is imported; an installed specdec_kernels comes first.
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:
    sys.path.append(_ROOT)

from specdec_kernels.testing import (  # noqa: E402,F401  (re-exported for the scripts)
    _is_cuda,
    cpu_description,
    free_device_bytes,
    l2_bytes,
    measure_copy_bandwidth,
    rotated_inputs,
    rotation_count,
    time_fn,
)


def goal_status(ok):
    """The goal column: "pass", "FAIL", or "n/a" when the goal does not apply (ok is None)."""
    return "n/a" if ok is None else ("pass" if ok else "FAIL")


def _fmt(v):
    if isinstance(v, float):
        return f"{v:.3f}" if abs(v) < 1e4 else f"{v:.3g}"
    return "-" if v is None else str(v)


def print_table(rows, columns):
    """Prints rows (list of dicts) as an aligned text table of the given columns (keys)."""
    cells = [[_fmt(r.get(c, "")) for c in columns] for r in rows]
    widths = [max([len(c)] + [len(row[i]) for row in cells]) for i, c in enumerate(columns)]
    print("  ".join(c.rjust(w) for c, w in zip(columns, widths)))
    print("  ".join("-" * w for w in widths))
    for row in cells:
        print("  ".join(v.rjust(w) for v, w in zip(row, widths)))


def _git(*args):
    try:
        out = subprocess.run(
            ["git", *args],
            capture_output=True,
            text=True,
            cwd=os.path.dirname(os.path.abspath(__file__)),
            timeout=10,
        )
        return out.stdout.rstrip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def _load_average():
    try:
        return list(os.getloadavg())
    except OSError:
        return None


def machine_info(device=None):
    """Where the numbers were measured: platform, CPU model, threads, load, torch (and GPU)
    versions."""
    info = {
        "platform": platform.platform(),
        "cpu": cpu_description(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "load_average_1_5_15min": _load_average(),
        "torch": torch.__version__,
    }
    if _is_cuda(device):
        props = torch.cuda.get_device_properties(device)
        info["gpu"] = torch.cuda.get_device_name(device)
        info["cuda"] = torch.version.cuda
        info["gpu_memory_bytes"] = props.total_memory
        info["l2_bytes"] = l2_bytes(device)
        info["sm_count"] = props.multi_processor_count
    return info


def write_json(path, rows, meta=None):
    """Writes {"meta": machine/date/commit + meta, "rows": rows} to path (parents created).

    Benchmarks call it after every row too, so a run cut short still leaves its figures."""
    meta = dict(meta or {})
    full = {
        "machine": machine_info(meta.get("device")),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "git_commit": _git("rev-parse", "HEAD"),
        "git_modified_files": (_git("status", "--porcelain", "--untracked-files=no") or "").split(
            "\n"
        ),
        **meta,
    }
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump({"meta": full, "rows": rows}, f, indent=2)
        f.write("\n")


# --------------------------------------------------------------------------- one benchmark run
def bench_parser(doc):
    """The options every benchmark takes; doc: the script's module docstring."""
    ap = argparse.ArgumentParser(
        description=doc, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--quick", action="store_true", help="a few small shapes: a smoke test")
    ap.add_argument("--device", default="cpu", help="cpu or cuda")
    ap.add_argument(
        "--backends",
        default=None,
        help="comma list of cpp,triton (default: cpp on CPU, cpp,triton on CUDA)",
    )
    ap.add_argument(
        "--threads", type=int, default=None, help="torch CPU threads (default: torch's)"
    )
    ap.add_argument(
        "--json", default=None, help="output path (default benchmarks/out/<op>_<device>.json)"
    )
    return ap


class BenchRun:
    """Rows of one benchmark run: printed as they come and rewritten to JSON after each row.

    Applies --threads, seeds torch, resolves the backends and measures the copy bandwidth
    that the rows' bandwidth fractions refer to."""

    def __init__(self, opts, op, meta=None):
        if opts.threads:
            torch.set_num_threads(opts.threads)
        torch.manual_seed(0)
        self.device = torch.device(opts.device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        default = "cpp,triton" if self.device.type == "cuda" else "cpp"
        self.backends = (opts.backends or default).split(",")
        if self.device.type == "cpu" and "triton" in self.backends:
            os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton's first import
        self.path = opts.json or os.path.join(
            os.path.dirname(os.path.abspath(__file__)), "out", f"{op}_{self.device.type}.json"
        )
        self.copy_gbps = measure_copy_bandwidth(self.device)
        self.meta = {
            "op": op,
            "device": str(self.device),
            "backends": self.backends,
            "quick": opts.quick,
            "copy_GBps": self.copy_gbps,
            "copy_bandwidth_note": "device-to-device copy, bytes read + bytes written",
            **(meta or {}),
        }
        self.rows = []
        print(
            f"{op} on {self.device}: copy bandwidth {self.copy_gbps:.1f} GB/s (read + write)",
            flush=True,
        )

    def bandwidth(self, prefix, floor_bytes, seconds):
        """{prefix}_GBps and {prefix}_frac_copy_bw of an op that must move floor_bytes."""
        gbps = floor_bytes / seconds / 1e9
        return {f"{prefix}_GBps": gbps, f"{prefix}_frac_copy_bw": gbps / self.copy_gbps}

    def time_backends(self, row, op, sets, naive_s, floor_bytes, warmup, iters, unit="us"):
        """Times op(*inputs, backend=b) over the rotated input sets for every backend: row
        gets {b}_{unit}, {b}_speedup (against naive_s seconds; None when the naive run was
        skipped) and the bandwidth columns. Returns {backend: fn} for per-op extra columns."""
        per_second = {"us": 1e6, "ms": 1e3}[unit]
        fns = {}
        for b in self.backends:
            fns[b] = fn = lambda *a, b=b: op(*a, backend=b)  # noqa: E731
            t = time_fn(fn, warmup, iters, self.device, sets)
            row[f"{b}_{unit}"] = t * per_second
            row[f"{b}_speedup"] = naive_s / t if naive_s else None
            row.update(self.bandwidth(b, floor_bytes, t))
        return fns

    def add(self, row):
        self.rows.append(row)
        print("  " + ", ".join(f"{k}={_fmt(v)}" for k, v in row.items()), flush=True)
        write_json(self.path, self.rows, self.meta)

    def finish(self, columns):
        """Prints the summary table of the given columns (those some row has) and keeps them in
        the JSON meta, for render_results.py."""
        self.meta["columns"] = [c for c in columns if any(c in r for r in self.rows)]
        print()
        print_table(self.rows, self.meta["columns"])
        write_json(self.path, self.rows, self.meta)
        print(f"wrote {self.path}")


def use_tiles(on: bool) -> None:
    """The CPU decode path's bf16 products over the weights' tiles where SPECDEC_TILED_ROWS=auto
    takes them (on), or never (oneDNN's layout)."""
    if on:
        os.environ.pop("SPECDEC_TILED_ROWS", None)
    else:
        os.environ["SPECDEC_TILED_ROWS"] = "0"


# The CPU decode path's variants, each a configure_decode_path tuple: (prepacked linears,
# layer ops, decode_layer, tiles for few rows, the blocks as one decode_layers call).
DECODE_PATHS = {
    "eager": (False, False, False, False, False),
    "prepacked": (True, False, False, False, False),
    "prepacked+layer_ops": (True, True, False, False, False),
    "prepacked+decode_layer": (True, True, True, False, False),
    "tiles+decode_layer": (True, True, True, True, False),
    "tiles+decode_layers": (True, True, True, True, True),
}


def configure_decode_path(
    model, packed: bool, fused: bool, layer: bool, tiles: bool, layers: bool
) -> None:
    """One variant of the CPU decode path on model: prepacked linears, the layer ops, each
    block as one decode_layer call, tiles for few rows (use_tiles), the blocks as one
    decode_layers call (a DECODE_PATHS tuple), through the engine's one switch."""
    from specdec import cpu

    use_tiles(tiles)
    cpu.configure(
        model, prepack=packed, layer_ops_setting=fused, decode_layer=layer, decode_layers=layers
    )
