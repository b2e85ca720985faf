"""PagedKVCache.rows: the physical rows of logical positions, through the block table."""

import torch

from specdec.models.cache import PagedKVCache


def reference_rows(cache, slots, positions):
    out = []
    for s, pos in zip(slots.tolist(), positions.tolist()):
        for p in pos:
            block = int(cache.block_table[s, p // cache.block_size])
            out.append(block * cache.block_size + p % cache.block_size)
    return torch.tensor(out)


def test_rows_follow_the_block_table_and_pick_the_valid_entries():
    torch.manual_seed(0)
    cache = PagedKVCache(1, 1, 4, num_slots=3, max_seq_len=40, block_size=8, shuffle_blocks=True)
    slots = torch.tensor([2, 0])
    positions = torch.tensor([[5, 6, 7, 8, 9], [31, 32, 33, 34, 35]])
    rows, picked = cache.rows(slots, positions)
    assert picked is None and torch.equal(rows, reference_rows(cache, slots, positions))

    valid = torch.tensor([[True, True, True, False, False], [True] * 5])
    rows, picked = cache.rows(slots, positions, valid)
    assert picked.tolist() == [0, 1, 2, 5, 6, 7, 8, 9]
    assert torch.equal(rows, reference_rows(cache, slots, positions).flatten()[picked])


def test_all_valid_entries_need_no_selection():
    """A mask with every entry valid (a batch-1 tree always) gives picked None, so no layer
    copies its K / V rows through a selection that keeps them all."""
    cache = PagedKVCache(1, 1, 4, num_slots=2, max_seq_len=32, block_size=4, shuffle_blocks=True)
    slots, positions = torch.tensor([1]), torch.tensor([[3, 4, 5]])
    rows, picked = cache.rows(slots, positions, torch.ones(1, 3, dtype=torch.bool))
    assert picked is None and torch.equal(rows, reference_rows(cache, slots, positions))
