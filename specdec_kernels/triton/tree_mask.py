"""build_tree_mask in Triton: one program per request walks its nodes in order.

The whole [T, mask_words] mask tile and the depth vector live in registers: row i is
row parents[i] (selected by a masked reduction, no global read-after-write) with
bit i added, so the walk needs no barrier between nodes.
"""

import torch
import triton
import triton.language as tl

from ._index import index32


@triton.jit
def _tree_mask_kernel(
    parents_ptr,
    num_nodes_ptr,
    mask_ptr,
    depth_ptr,
    T,
    mask_words,
    T_PAD: tl.constexpr,
    WORDS_PAD: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    n = tl.minimum(tl.load(num_nodes_ptr + b), T)  # unvalidated (GPU) input: stay in the row
    rows = tl.arange(0, T_PAD)
    words = tl.arange(0, WORDS_PAD)
    one = tl.full([WORDS_PAD], 1, tl.int64)
    # root: only its own bit, depth 0
    tile = tl.where((rows[:, None] == 0) & (words[None, :] == 0), 1, 0).to(tl.int64)
    depth = tl.zeros([T_PAD], tl.int32)
    for i in range(1, n):
        p = tl.load(parents_ptr + b * T + i)
        sel = rows == p  # an invalid parent selects no row: the node gets only its own bit
        parent_row = tl.sum(tl.where(sel[:, None], tile, 0), axis=0)  # exactly one row selected
        own = tl.where(words == i // 64, one << (i % 64), 0)  # bit 63 lands on the sign bit
        tile = tl.where((rows == i)[:, None], (parent_row | own)[None, :], tile)
        depth = tl.where(rows == i, tl.sum(tl.where(sel, depth, 0)) + 1, depth)
    tile = tl.where((rows < n)[:, None], tile, 0)  # padded rows: all zero, depth 0
    out = mask_ptr + b * T * mask_words + rows[:, None] * mask_words + words[None, :]
    tl.store(out, tile, mask=(rows[:, None] < T) & (words[None, :] < mask_words))
    tl.store(depth_ptr + b * T + rows, depth, mask=rows < T)


@torch.library.custom_op("specdec_triton::build_tree_mask", mutates_args=())
def build_tree_mask(
    parents: torch.Tensor, num_nodes: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """parents: int [B, T], num_nodes: int [B] -> (tree_mask int64 [B, T, ceil(T/64)], depth int32
    [B, T]).

    A custom op, so torch.compile treats the launch as one opaque call."""
    B, T = parents.shape
    mask_words = (T + 63) // 64
    parents = index32(parents)
    num_nodes = index32(num_nodes)
    mask = torch.empty(B, T, mask_words, dtype=torch.int64, device=parents.device)
    depth = torch.empty(B, T, dtype=torch.int32, device=parents.device)
    _tree_mask_kernel[(B,)](
        parents,
        num_nodes,
        mask,
        depth,
        T,
        mask_words,
        T_PAD=triton.next_power_of_2(T),
        WORDS_PAD=triton.next_power_of_2(mask_words),
    )
    return mask, depth


@build_tree_mask.register_fake
def _(parents, num_nodes):
    B, T = parents.shape
    return (
        parents.new_empty(B, T, (T + 63) // 64, dtype=torch.int64),
        parents.new_empty(B, T, dtype=torch.int32),
    )
