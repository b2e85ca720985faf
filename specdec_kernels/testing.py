"""Input generators and timing helpers shared by the tests and the benchmarks
(as ``flashinfer.testing``): random draft trees and block tables, and a timer that
measures device time on CUDA.

    from specdec_kernels.testing import random_trees, random_block_table, time_fn, rotated_inputs
    parents, num_nodes = random_trees(B, T, "bushy")                      # [B, T], [B]
    ms = time_fn(lambda: op(*args), warmup=3, iters=10) * 1e3              # same inputs every call
    sets = rotated_inputs(args, touched_bytes, device)                     # copies that defeat L2
    ms = time_fn(op, warmup=3, iters=50, device=device, inputs=sets) * 1e3  # op(*sets[i % n])

On CUDA every call is timed with its own pair of CUDA events and the median is taken.
A spin kernel queued before each group of calls lets the host enqueue the whole group
while the GPU waits, so the events measure device time, not Python / launch overhead
(an op that synchronises with the host, like the naive references, still pays for it).
"""

from __future__ import annotations

import math
import platform
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from ._library import value_checks_run

__all__ = [
    "KV_LAYOUTS",
    "TREE_KINDS",
    "free_device_bytes",
    "kv_layout",
    "l2_bytes",
    "measure_copy_bandwidth",
    "random_block_table",
    "random_parents",
    "random_root_paths",
    "random_trees",
    "rotated_inputs",
    "rotation_count",
    "time_fn",
    "value_checks_run",
]

Device = torch.device | str | None
Inputs = Sequence[Sequence[Any]] | Callable[[int], Sequence[Any]] | None


# --------------------------------------------------------------------------- trees and caches
TREE_KINDS = ("chain", "star", "deep", "bushy", "random", "single")


def random_parents(T: int, n: int, kind: str, gen: torch.Generator | None = None) -> torch.Tensor:
    """parents: [T] int32 of a tree with n valid nodes (padding -1), of the given shape."""
    p = torch.full((T,), -1, dtype=torch.int32)
    for i in range(1, n):
        if kind == "chain":
            p[i] = i - 1
        elif kind == "star":
            p[i] = 0
        elif kind == "deep":  # mostly a chain with a few side branches
            p[i] = (
                i - 1
                if torch.rand(1, generator=gen) < 0.8
                else int(torch.randint(0, i, (1,), generator=gen))
            )
        elif kind == "bushy":  # wide and shallow: parents among the first few nodes
            p[i] = int(torch.randint(0, max(1, min(i, 1 + i // 4)), (1,), generator=gen))
        else:
            p[i] = int(torch.randint(0, i, (1,), generator=gen))
    return p


def random_trees(
    B: int, T: int, kind: str = "random", gen: torch.Generator | None = None, full: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """parents: [B, T] int32, num_nodes: [B] int32 of random trees of one of TREE_KINDS
    (kind "single" gives one-node trees; full=True gives num_nodes == T)."""
    if kind == "single":
        n = torch.ones(B, dtype=torch.int32)
    elif full:
        n = torch.full((B,), T, dtype=torch.int32)
    else:
        n = torch.randint(1, T + 1, (B,), generator=gen, dtype=torch.int32)
    parents = torch.stack(
        [random_parents(T, int(n[b]), kind if kind != "single" else "chain", gen) for b in range(B)]
    )
    return parents, n


def random_root_paths(
    B: int, T: int, gen: torch.Generator | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """accepted_nodes int32 [B, T], num_accepted int32 [B]: the path from the root to a
    random node of a random tree; the padding past num_accepted is garbage the op must not read."""
    parents, num_nodes = random_trees(B, T, "random", gen)
    accepted = torch.randint(-5, 3 * T, (B, T), generator=gen, dtype=torch.int32)
    num_accepted = torch.empty(B, dtype=torch.int32)
    for b in range(B):
        node, path = int(torch.randint(0, int(num_nodes[b]), (1,), generator=gen)), []
        while node >= 0:
            path.append(node)
            node = int(parents[b, node])
        accepted[b, : len(path)] = torch.tensor(path[::-1], dtype=torch.int32)
        num_accepted[b] = len(path) - 1
    return accepted, num_accepted


def random_block_table(
    B: int, blocks_per_seq: int, num_blocks: int, gen: torch.Generator | None = None
) -> torch.Tensor:
    """block_table: [B, blocks_per_seq] int32, a random permutation of physical blocks,
    disjoint across requests."""
    assert num_blocks >= B * blocks_per_seq
    perm = torch.randperm(num_blocks, generator=gen)[: B * blocks_per_seq]
    return perm.view(B, blocks_per_seq).to(torch.int32)


# --------------------------------------------------------------------------- KV-cache layouts
# Each engine's own KV-cache allocation, and the views through which it passes its cache to
# the ops: the logical [*lead, num_blocks, block_size, Hkv, D] (lead: () or (L,) layers).
# Token pools need block size 1 (num_blocks = tokens); transformers has one block of S
# positions per request (num_blocks = B, block_size = S).
KV_LAYOUTS = (
    "contiguous",  # separate [NB, bs, Hkv, D] tensors
    "vllm_flash",  # vLLM FlashAttention: [2, NB, bs, Hkv, D], K = kv[0]
    "flashinfer_nhd",  # vLLM / FlashInfer NHD: [NB, 2, bs, Hkv, D], K = kv[:, 0]
    "flashinfer_hnd",  # FlashInfer HND: [NB, 2, Hkv, bs, D], K = kv[:, 0].transpose(1, 2)
    "sglang_pool",  # SGLang token pool [tokens, Hkv, D] per layer, K = pool.unsqueeze(1)
    "transformers",  # transformers [B, Hkv, S, D] per layer, K = cache.transpose(1, 2)
)


def kv_layout(
    name: str,
    lead: tuple[int, ...],
    num_blocks: int,
    block_size: int,
    Hkv: int,
    D: int,
    dtype: torch.dtype = torch.float32,
    device: Device = None,
) -> tuple[list[torch.Tensor], Callable[[list[torch.Tensor]], tuple[torch.Tensor, torch.Tensor]]]:
    """(tensors, views): the random tensors engine `name` allocates, and views(tensors) ->
    (k_cache, v_cache) of logical shape [*lead, num_blocks, block_size, Hkv, D] (no copy).
    views also applies to copies of the tensors (clone each), which the tests use."""
    NB, bs, H = num_blocks, block_size, Hkv

    def randn(*shape):
        return torch.randn(*lead, *shape, device=device).to(dtype)

    if name in ("vllm_flash", "flashinfer_nhd", "flashinfer_hnd"):
        at = 0 if name == "vllm_flash" else 1  # where the 2 (K or V) sits among the page dims
        hnd = name == "flashinfer_hnd"
        page = [NB, H, bs, D] if hnd else [NB, bs, H, D]
        page.insert(at, 2)

        def joint(ts):
            n = len(lead)
            k, v = ts[0].select(n + at, 0), ts[0].select(n + at, 1)
            return (k.transpose(-3, -2), v.transpose(-3, -2)) if hnd else (k, v)

        return [randn(*page)], joint
    shapes = {
        "contiguous": ((NB, bs, H, D), lambda t: t),
        "sglang_pool": ((NB, H, D), lambda t: t.unsqueeze(-3)),
        "transformers": ((NB, H, bs, D), lambda t: t.transpose(-3, -2)),
    }
    if name not in shapes:
        raise ValueError(f"layout must be one of {KV_LAYOUTS}, got {name!r}")
    if name == "sglang_pool" and bs != 1:
        raise ValueError(f"sglang_pool is a token pool: block_size must be 1, got {bs}")
    shape, view = shapes[name]
    return [randn(*shape), randn(*shape)], lambda ts: (view(ts[0]), view(ts[1]))


# --------------------------------------------------------------------------- timing
DEFAULT_L2_BYTES = 50 * 2**20  # H200; used when the device does not report its L2 size
EVENT_GROUP = 25  # calls queued behind one spin kernel
MAX_SPIN_S = 0.05
ROTATION_MAX_COPIES = 256
ROTATION_MAX_BYTES = 24 * 2**30  # device memory that all copies of one input set may take


def _is_cuda(device: Device) -> bool:
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
        events = [
            (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            for _ in range(n)
        ]
        for start, end in events:
            start.record()
            call(i)
            end.record()
            i += 1
        torch.cuda.synchronize()
        times += [start.elapsed_time(end) / 1e3 for start, end in events]
    return times


def time_fn(
    fn: Callable[..., Any],
    warmup: int = 3,
    iters: int = 10,
    device: Device = None,
    inputs: Inputs = None,
) -> float:
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


# The instruction sets CPU kernels' speed depends on (docs/cpu-decode-path.md): recorded beside
# every figure, as one "AMD EPYC" name covers several generations.
_ISA_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16")


def cpu_description() -> str:
    """The CPU as the figures need it: model name, family / model (one "AMD EPYC" name covers
    several generations) and the vector instruction sets, e.g.
    "AMD EPYC (family 23, model 49; avx2)"."""
    fields: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if not line.strip():
                    break  # the first CPU's block is enough
                key, _, value = line.partition(":")
                fields[key.strip()] = value.strip()
    except OSError:
        return platform.processor() or platform.machine()
    name = fields.get("model name") or platform.processor() or platform.machine()
    flags = set(fields.get("flags", "").split())
    isa = ", ".join(f for f in _ISA_FLAGS if f in flags) or "no avx2"
    family, model = fields.get("cpu family"), fields.get("model")
    where = f"family {family}, model {model}; " if family and model else ""
    return f"{name} ({where}{isa})"


def l2_bytes(device: Device) -> int | None:
    """Last-level cache the rotation must defeat: the GPU's L2 (None on CPU: no rotation)."""
    if not _is_cuda(device):
        return None
    size = getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 0)
    return size if size and size > 0 else DEFAULT_L2_BYTES


def rotation_count(touched_bytes: int, set_bytes: int, device: Device) -> int:
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


def rotated_inputs(
    args: Sequence[Any], touched_bytes: int, device: Device
) -> list[tuple[Any, ...]]:
    """[args, copy 1, copy 2, ...]: rotation_count copies of the argument tuple (tensors cloned,
    anything else shared). Copies are bitwise equal, so every call does the same work."""
    n = rotation_count(touched_bytes, _nbytes(args), device)
    clone = lambda a: a.clone() if isinstance(a, torch.Tensor) else a  # noqa: E731
    return [tuple(args)] + [tuple(clone(a) for a in args) for _ in range(n - 1)]


def measure_copy_bandwidth(device: Device, nbytes: int | None = None, iters: int = 20) -> float:
    """Device-to-device copy bandwidth in GB/s, counting the bytes read plus the bytes written
    (the same convention as the benchmarks' byte floors). On CUDA the buffers are 8x the L2
    (at least 1 GiB) so the copy streams from HBM; on CPU 256 MiB."""
    if nbytes is None:
        nbytes = max(2**30, 8 * l2_bytes(device)) if _is_cuda(device) else 2**28
    src = torch.empty(nbytes, dtype=torch.uint8, device=device).random_(0, 256)
    dst = torch.empty_like(src)
    t = time_fn(lambda: dst.copy_(src), warmup=3, iters=iters, device=device)
    return 2 * nbytes / t / 1e9


def free_device_bytes(device: Device) -> int | None:
    """Free device memory in bytes (CUDA, counting what torch's allocator caches but does not
    use), or None where unknown (CPU)."""
    if not _is_cuda(device):
        return None
    free, _ = torch.cuda.mem_get_info(device)
    return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
