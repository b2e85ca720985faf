"""Host memory in 2 MB pages (specdec.cpu.host_memory): copies are bitwise, aligned and independent
of the original; an arena's tensors outlive it and their chunk; SPECDEC_HUGE_PAGES; a
PackedLinear's tiles live there and give the same bits as from 4 KB pages."""

import copy
import gc

import pytest
import torch
from test_packed_linear import linear

from specdec.cpu import host_memory
from specdec.cpu.host_memory import HUGE_PAGE, HugePageArena, huge_page_buffer
from specdec.cpu.packed_linear import PackedLinear

HAS_MMAP = hasattr(host_memory.mmap, "MAP_ANONYMOUS")
needs_mmap = pytest.mark.skipif(not HAS_MMAP, reason="no anonymous mmap on this OS")


@needs_mmap
def test_buffer_is_2mb_aligned_and_writable():
    buf = huge_page_buffer(3 * HUGE_PAGE + 5)
    assert buf.dtype == torch.uint8 and buf.numel() == 3 * HUGE_PAGE + 5
    assert buf.data_ptr() % HUGE_PAGE == 0
    buf.fill_(7)
    assert int(buf.sum()) == 7 * buf.numel()
    with pytest.raises(ValueError, match="nbytes"):
        huge_page_buffer(-1)


@needs_mmap
@pytest.mark.parametrize(
    "dtype,shape", [(torch.bfloat16, (7, 33, 64, 2)), (torch.float32, (3, 5)), (torch.int64, (9,))]
)
def test_arena_copy_is_bitwise_aligned_and_independent(dtype, shape):
    gen = torch.Generator().manual_seed(0)
    t = (torch.randn(shape, generator=gen) * 100).to(dtype)
    arena = HugePageArena(chunk_bytes=1 << 16)
    first = arena.copy(torch.ones(3, dtype=torch.uint8))  # the next copy starts past it
    got = arena.copy(t)
    assert got.dtype == t.dtype and got.shape == t.shape and got.is_contiguous()
    assert torch.equal(got.view(-1).view(torch.uint8), t.view(-1).view(torch.uint8))
    assert got.data_ptr() % 64 == 0 and got.data_ptr() != first.data_ptr()
    t.add_(1)  # the copy does not follow the original
    assert not torch.equal(got, t)
    assert torch.equal(first, torch.ones(3, dtype=torch.uint8))


@needs_mmap
def test_arena_tensors_outlive_the_arena_and_their_chunk():
    """Many copies over small chunks (several chunks, one tensor bigger than a chunk): every
    copy keeps its values after the arena, and its reference to the chunk, are gone."""
    gen = torch.Generator().manual_seed(1)
    originals = [torch.randn(n, generator=gen) for n in (100, 3000, 10, 5000, 700)]
    arena = HugePageArena(chunk_bytes=8192)
    copies = [arena.copy(t) for t in originals]
    del arena
    gc.collect()
    junk = [torch.randn(1 << 16) for _ in range(8)]  # reuse freed memory, if any was freed
    for t, c in zip(originals, copies):
        assert torch.equal(t, c)
    del junk


def test_setting_turns_it_off(monkeypatch):
    t = torch.randn(64)
    monkeypatch.setenv("SPECDEC_HUGE_PAGES", "0")
    assert not host_memory.enabled() and host_memory.streamed(t) is t
    monkeypatch.setenv("SPECDEC_HUGE_PAGES", "1")
    got = host_memory.streamed(t)
    assert host_memory.enabled() == host_memory.supported()
    assert (got is t) == (not host_memory.supported()) and torch.equal(got, t)
    assert host_memory.streamed(torch.empty(0)).numel() == 0


@pytest.mark.parametrize("rows", [1, 5])
def test_packed_tiles_in_huge_pages_give_the_same_bits(rows, monkeypatch):
    monkeypatch.setenv("SPECDEC_TILED_ROWS", "64")  # the tiles on every CPU
    lin = linear(96, 200, bias=True)
    x = torch.randn(2, rows, 96).to(torch.bfloat16)
    outs = {}
    for setting in ("0", "1"):
        monkeypatch.setenv("SPECDEC_HUGE_PAGES", setting)
        packed = PackedLinear.convert(copy.deepcopy(lin))
        with torch.no_grad():
            outs[setting] = packed(x)
        tiles = packed._pack._packed["tiles"]
        # in the arena: a view into a mapping of at least a chunk
        in_arena = tiles.untyped_storage().nbytes() >= host_memory.CHUNK_BYTES
        assert in_arena == (setting == "1" and host_memory.supported())
    assert torch.equal(outs["0"], outs["1"])
