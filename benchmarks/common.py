"""Shared helpers of the microbenchmarks: timing, input rotation, copy bandwidth, tables, JSON.

Usage from a benchmark script:
    from common import time_fn, rotated_inputs, print_table, write_json
    ms = time_fn(lambda: op(*args), warmup=3, iters=10) * 1e3            # same inputs every call
    sets = rotated_inputs(args, touched_bytes, device)                      # copies that defeat L2
    ms = time_fn(op, warmup=3, iters=50, device=device, inputs=sets) * 1e3  # call i: op(*sets[i % n])

On CUDA every call is timed with its own pair of CUDA events and the median is taken.
A spin kernel queued before each group of calls lets the host enqueue the whole group
while the GPU waits, so the events measure device time, not Python / launch overhead
(an op that synchronises with the host, like the naive references, still pays for it).
"""
import argparse
import datetime
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time

import torch

# The benchmarks run from a plain checkout: the repository root (specdec_kernels) and tests/
# (random trees and block tables) go on the path when this module is imported; an installed
# specdec_kernels comes first.
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
for _p in (os.path.join(_ROOT, "tests"), _ROOT):
    if _p not in sys.path:
        sys.path.append(_p)

DEFAULT_L2_BYTES = 50 * 2**20  # H200; used when the device does not report its L2 size
EVENT_GROUP = 25  # calls queued behind one spin kernel
MAX_SPIN_S = 0.05
ROTATION_MAX_COPIES = 256
ROTATION_MAX_BYTES = 24 * 2**30  # device memory that all copies of one input set may take


def _is_cuda(device):
    return device is not None and torch.device(device).type == "cuda"


def _sync(device):
    if _is_cuda(device):
        torch.cuda.synchronize(device)


def _caller(fn, inputs):
    """call(i): fn() without inputs, else fn(*inputs[i % n]) or fn(*inputs(i))."""
    if inputs is None:
        return lambda i: fn()
    if callable(inputs):
        return lambda i: fn(*inputs(i))
    return lambda i: fn(*inputs[i % len(inputs)])


_spin_cycles_per_s = None


def _spin(seconds):
    """Queues a GPU kernel that spins for about `seconds` (torch.cuda._sleep counts clock cycles,
    calibrated once with CUDA events)."""
    global _spin_cycles_per_s
    if not hasattr(torch.cuda, "_sleep") or seconds <= 0:
        return
    if _spin_cycles_per_s is None:
        cycles = 10**7
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(cycles)  # first call loads the kernel
        start.record()
        torch.cuda._sleep(cycles)
        end.record()
        end.synchronize()
        _spin_cycles_per_s = cycles / max(start.elapsed_time(end) / 1e3, 1e-6)
    torch.cuda._sleep(int(seconds * _spin_cycles_per_s))


def _time_cuda(call, start_index, iters):
    """Per-call CUDA-event times (seconds) of call(start_index), call(start_index + 1), ..."""
    t0 = time.perf_counter()
    call(start_index)
    torch.cuda.synchronize()
    wall_per_call = time.perf_counter() - t0  # host + device time of one call: what to queue ahead
    times, i = [], start_index + 1
    for first in range(0, iters, EVENT_GROUP):
        n = min(EVENT_GROUP, iters - first)
        _spin(min(MAX_SPIN_S, 1.5 * n * wall_per_call + 5e-4))
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                  for _ in range(n)]
        for start, end in events:
            start.record()
            call(i)
            end.record()
            i += 1
        torch.cuda.synchronize()
        times += [start.elapsed_time(end) / 1e3 for start, end in events]
    return times


def time_fn(fn, warmup=3, iters=10, device=None, inputs=None):
    """Median time of one call in seconds.

    fn: called as fn() when inputs is None, else as fn(*args) with args cycling through
    inputs: a list of argument tuples (call i uses inputs[i % len(inputs)]) or a callable
    i -> argument tuple (see rotated_inputs).
    device: where fn's work runs; a CUDA device times each call with CUDA events (see the
    module docstring), anything else with time.perf_counter. The median resists the
    outliers of a machine shared with other jobs.
    """
    call = _caller(fn, inputs)
    for i in range(warmup):
        call(i)
    _sync(device)
    if _is_cuda(device):
        return statistics.median(_time_cuda(call, warmup, iters))
    times = []
    for i in range(warmup, warmup + iters):
        t0 = time.perf_counter()
        call(i)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def l2_bytes(device):
    """Last-level cache the rotation must defeat: the GPU's L2 (None on CPU: no rotation)."""
    if not _is_cuda(device):
        return None
    size = getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 0)
    return size if size and size > 0 else DEFAULT_L2_BYTES


def rotation_count(touched_bytes, set_bytes, device):
    """How many copies of an input set to cycle through so that, between two uses of one copy,
    the other calls touch at least twice the L2 size (1 on CPU).

    touched_bytes: what one call reads and writes; set_bytes: what one copy allocates.
    Capped at ROTATION_MAX_COPIES and ROTATION_MAX_BYTES of copies in all.
    """
    l2 = l2_bytes(device)
    if l2 is None or touched_bytes >= 2 * l2:
        return 1
    n = 1 + math.ceil(2 * l2 / max(touched_bytes, 1))
    return max(1, min(n, ROTATION_MAX_COPIES, ROTATION_MAX_BYTES // max(set_bytes, 1)))


def _nbytes(args):
    return sum(a.numel() * a.element_size() for a in args if isinstance(a, torch.Tensor))


def rotated_inputs(args, touched_bytes, device):
    """[args, copy 1, copy 2, ...]: rotation_count copies of the argument tuple (tensors cloned,
    anything else shared). Copies are bitwise equal, so every call does the same work."""
    n = rotation_count(touched_bytes, _nbytes(args), device)
    clone = lambda a: a.clone() if isinstance(a, torch.Tensor) else a  # noqa: E731
    return [tuple(args)] + [tuple(clone(a) for a in args) for _ in range(n - 1)]


def measure_copy_bandwidth(device, nbytes=None, iters=20):
    """Device-to-device copy bandwidth in GB/s, counting the bytes read plus the bytes written
    (the same convention as the benchmarks' byte floors). On CUDA the buffers are 8x the L2
    (at least 1 GiB) so the copy streams from HBM; on CPU 256 MiB."""
    if nbytes is None:
        nbytes = max(2**30, 8 * l2_bytes(device)) if _is_cuda(device) else 2**28
    src = torch.empty(nbytes, dtype=torch.uint8, device=device).random_(0, 256)
    dst = torch.empty_like(src)
    t = time_fn(lambda: dst.copy_(src), warmup=3, iters=iters, device=device)
    return 2 * nbytes / t / 1e9


def free_device_bytes(device):
    """Free device memory in bytes (CUDA, counting what torch's allocator caches but does not
    use), or None where unknown (CPU)."""
    if not _is_cuda(device):
        return None
    free, _ = torch.cuda.mem_get_info(device)
    return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)


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


def _cpu_model():
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _git(*args):
    try:
        out = subprocess.run(["git", *args], capture_output=True, text=True,
                             cwd=os.path.dirname(os.path.abspath(__file__)), timeout=10)
        return out.stdout.rstrip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def _load_average():
    try:
        return list(os.getloadavg())
    except OSError:
        return None


def machine_info(device=None):
    """Where the numbers were measured: platform, CPU model, threads, load, torch (and GPU) versions."""
    info = {
        "platform": platform.platform(),
        "cpu": _cpu_model(),
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
        "git_modified_files": (_git("status", "--porcelain", "--untracked-files=no") or "").split("\n"),
        **meta,
    }
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump({"meta": full, "rows": rows}, f, indent=2)
        f.write("\n")


# --------------------------------------------------------------------------- one benchmark run
def bench_parser(doc):
    """The options every benchmark takes; doc: the script's module docstring."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="a few small shapes: a smoke test")
    ap.add_argument("--device", default="cpu", help="cpu or cuda")
    ap.add_argument("--backends", default=None,
                    help="comma list of cpp,triton (default: cpp on CPU, cpp,triton on CUDA)")
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    ap.add_argument("--json", default=None, help="output path (default benchmarks/out/<op>_<device>.json)")
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
        self.path = opts.json or os.path.join(os.path.dirname(os.path.abspath(__file__)), "out",
                                              f"{op}_{self.device.type}.json")
        self.copy_gbps = measure_copy_bandwidth(self.device)
        self.meta = {"op": op, "device": str(self.device), "backends": self.backends,
                     "quick": opts.quick, "copy_GBps": self.copy_gbps,
                     "copy_bandwidth_note": "device-to-device copy, bytes read + bytes written",
                     **(meta or {})}
        self.rows = []
        print(f"{op} on {self.device}: copy bandwidth {self.copy_gbps:.1f} GB/s (read + write)", flush=True)

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
