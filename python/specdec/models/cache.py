"""PagedKVCache: a static, paged KV cache with one fixed range of blocks per request slot."""

import torch
from torch import Tensor


class PagedKVCache:
    """k, v: [L, num_blocks, block_size, Hkv, D]; slot s (one request) owns a fixed range of blocks.

    block_table: int32 [num_slots, blocks_per_slot] maps a slot's logical block to a physical one;
    cache_lens: int32 [num_slots] counts the committed tokens of each slot. Logical position p of
    slot s lives at physical row block_table[s, p // block_size] * block_size + p % block_size.
    """

    def __init__(
        self,
        n_layers: int,
        n_kv_heads: int,
        head_dim: int,
        num_slots: int,
        max_seq_len: int,
        block_size: int = 16,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        shuffle_blocks: bool = False,
    ):
        blocks_per_slot = -(-max_seq_len // block_size)
        num_blocks = num_slots * blocks_per_slot
        shape = (n_layers, num_blocks, block_size, n_kv_heads, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        # Shuffled blocks exercise the block-table indirection (tests); order is irrelevant to
        # speed.
        order = torch.randperm(num_blocks) if shuffle_blocks else torch.arange(num_blocks)
        self.block_table = order.view(num_slots, blocks_per_slot).to(
            device=device, dtype=torch.int32
        )
        self.cache_lens = torch.zeros(num_slots, dtype=torch.int32, device=device)
        self.block_size = block_size
        self.capacity = blocks_per_slot * block_size

    def rows(
        self, slots: Tensor, positions: Tensor, valid: Tensor | None = None
    ) -> tuple[Tensor, Tensor | None]:
        """Physical rows of k[l].view(-1, Hkv, D) for logical positions; computed once per step.

        slots: int [B]; positions: int [B, T]; valid: bool [B, T] or None (all valid).
        Returns (rows int64 [N], picked int64 [N] or None): picked selects the valid entries of
        a [B * T, ...] flattening (None when all are valid).
        """
        positions = positions.long()
        blocks = self.block_table[slots.long()].long()  # [B, blocks_per_slot]
        # padded entries (dropped through `picked`) may lie past the slot's last block
        physical = torch.gather(
            blocks, 1, (positions // self.block_size).clamp(max=blocks.shape[1] - 1)
        )
        rows = (physical * self.block_size + positions % self.block_size).flatten()
        if valid is None:
            return rows, None
        picked = valid.flatten().nonzero().flatten()
        # every entry valid (a batch-1 tree always): no selection, so that no layer copies its
        # K / V rows through one that keeps them all
        if picked.numel() == rows.numel():
            return rows, None
        return rows[picked], picked

    def write_rows(
        self, layer: int, rows: Tensor, picked: Tensor | None, k: Tensor, v: Tensor
    ) -> None:
        """k, v: [B, T, Hkv, D] -> the rows of `rows(...)` (rows, picked as it returned) in layer
        `layer`."""
        k = k.reshape(-1, *k.shape[2:])
        v = v.reshape(-1, *v.shape[2:])
        if picked is not None:
            k, v = k.index_select(0, picked), v.index_select(0, picked)
        self.k[layer].view(-1, *k.shape[1:]).index_copy_(0, rows, k.to(self.k.dtype))
        self.v[layer].view(-1, *v.shape[1:]).index_copy_(0, rows, v.to(self.v.dtype))

    def write(
        self,
        layer: int,
        slots: Tensor,
        positions: Tensor,
        k: Tensor,
        v: Tensor,
        valid: Tensor | None = None,
    ) -> None:
        """slots: int [B]; positions: int [B, T] logical; k, v: [B, T, Hkv, D]; valid: bool [B, T]
        (skip padding)."""
        rows, picked = self.rows(slots, positions, valid)
        self.write_rows(layer, rows, picked, k, v)

    def reset(self, slots: Tensor) -> None:
        """slots: int [B] -> their cache_lens = 0 (the old K/V is overwritten as they refill)."""
        self.cache_lens[slots] = 0
