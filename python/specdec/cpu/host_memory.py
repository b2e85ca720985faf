"""Host memory in 2 MB pages for what a CPU decode step streams in full every step: the bf16
linears' packed weights (specdec.cpu.packed_linear's tiles).

Why: a decode step on a CPU reads its ~270 MB of weights front to back, and from 4 KB pages
that stream pays a page walk every 4 KB and its hardware prefetch restarts at every page
boundary. On an AMD EPYC (Zen 4, 2 vCPUs) the 121 linears of a SmolLM2-135M step
over their tiles took 0.83-0.88x the time from 2 MB pages, a verify step 0.88-0.99x
(docs/cpu-decode-path.md; pair by pair, 1 and 2 threads). torch's CPU allocator
hands out 4 KB pages unless the kernel's transparent huge pages are in `always` mode; in the
usual `madvise` mode a region gets them only when asked.

`streamed(t)` copies a CPU tensor into an arena of anonymous mappings advised with
MADV_HUGEPAGE (chunks of CHUNK_BYTES, 2 MB aligned; each tensor 64-byte aligned in them) and
returns the copy, a view that keeps its chunk alive; a chunk is unmapped once its last view is
gone. Linux only, SPECDEC_HUGE_PAGES (auto: on where transparent huge pages are not `never`);
elsewhere the tensor is returned as it is. The copy is bitwise the tensor: no result changes.
"""

import mmap
import sys
import threading

import torch
from torch import Tensor

from specdec import envs

HUGE_PAGE = 2 << 20
CHUNK_BYTES = 64 << 20  # what one mapping holds; a tensor larger than this gets its own
ALIGN = 64  # bytes: every tensor starts on a cache line
THP_SETTING = "/sys/kernel/mm/transparent_hugepage/enabled"


def supported() -> bool:
    """Whether the OS can back an advised mapping with 2 MB pages (Linux transparent huge
    pages, mode `always` or `madvise`)."""
    if not sys.platform.startswith("linux") or not hasattr(mmap, "MADV_HUGEPAGE"):
        return False
    try:
        with open(THP_SETTING) as f:
            mode = f.read()
    except OSError:
        return False
    return "[never]" not in mode


def enabled() -> bool:
    """SPECDEC_HUGE_PAGES: on, off, or (auto) where supported()."""
    setting = envs.SPECDEC_HUGE_PAGES
    return supported() if setting == "auto" else bool(setting) and supported()


def _round_up(n: int, to: int) -> int:
    return (n + to - 1) // to * to


def huge_page_buffer(nbytes: int) -> Tensor:
    """uint8 [nbytes], 2 MB aligned, in an anonymous private mapping advised MADV_HUGEPAGE
    (its pages are faulted in, as 2 MB pages where the kernel has them, on first write). The
    tensor holds the mapping: it is unmapped when the tensor and its views are gone."""
    if nbytes < 0:
        raise ValueError(f"nbytes must be >= 0, got {nbytes}")
    size = _round_up(max(nbytes, 1), HUGE_PAGE) + HUGE_PAGE  # room to align the start
    region = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        region.madvise(mmap.MADV_HUGEPAGE)
    except (AttributeError, OSError):  # no transparent huge pages here: 4 KB pages, still valid
        pass
    whole = torch.frombuffer(region, dtype=torch.uint8)  # holds a reference to region
    start = (-whole.data_ptr()) % HUGE_PAGE
    return whole[start : start + nbytes]


class HugePageArena:
    """Bump allocation of long-lived tensors from huge_page_buffer chunks. Memory of a tensor
    that is dropped is not reused; its chunk is unmapped when all of the chunk's tensors are
    gone (they are views of it)."""

    def __init__(self, chunk_bytes: int = CHUNK_BYTES) -> None:
        self.chunk_bytes = chunk_bytes
        self._chunk: Tensor | None = None
        self._used = 0
        self._lock = threading.Lock()

    def copy(self, t: Tensor) -> Tensor:
        """A copy of t (any dtype and shape; contiguous) in the arena."""
        nbytes = t.numel() * t.element_size()
        with self._lock:
            if self._chunk is None or self._used + nbytes > self._chunk.numel():
                self._chunk = huge_page_buffer(max(self.chunk_bytes, _round_up(nbytes, ALIGN)))
                self._used = 0
            raw = self._chunk[self._used : self._used + nbytes]
            self._used = _round_up(self._used + nbytes, ALIGN)
        out = raw.view(t.dtype).view(t.shape)
        out.copy_(t)
        return out


_ARENA = HugePageArena()


def streamed(t: Tensor) -> Tensor:
    """t, copied into 2 MB pages when enabled() and t is a CPU tensor; else t itself."""
    if t.device.type != "cpu" or t.numel() == 0 or not enabled():
        return t
    return _ARENA.copy(t.contiguous())
