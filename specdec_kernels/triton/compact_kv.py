"""compact_kv in Triton: one launch moves the accepted path of every request, all layers, K and V.

Grid: (2 * L, B, row chunks). A program copies one chunk of the Hkv * D row of
each accepted node, in increasing k. The caches are addressed through their strides
(layer, block, row in block, head; the last dim contiguous), so NHD and HND pages,
halves of joint KV tensors and token pools (block size 1) are moved in place.
Node ids increase along a root path, so the source cache_lens + a[k] >= the
destination cache_lens + k: a destination is never a later step's source (it lies
below it), and a source is only overwritten by a later step, after this program has read it.
The copy is bitwise (the cache is viewed as integers of its element size), so
any element dtype works and NaN payloads survive.
"""

import torch
import triton
import triton.language as tl

from ._index import index32

_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


@triton.jit
def _copy_path(
    cache_ptr,
    s_l,
    s_b,
    s_r,
    s_h,
    layer,
    bt_ptr,
    acc_ptr,
    b,
    c,
    na,
    num_blocks,
    block_size,
    D,
    max_blocks,
    max_positions,
    T,
    cols,
    col_mask,
):
    """Copies rows cache_lens + accepted[k] -> cache_lens + k (k = 1..na) of one layer.

    cols: element indices into the Hkv * D row, mapped to (head, dim) through the strides."""
    base = cache_ptr + layer * s_l
    col_off = (cols // D) * s_h + cols % D
    for k in range(1, na + 1):
        src = c + tl.load(acc_ptr + b * T + k)
        dst = c + k
        # Unvalidated (GPU) inputs: a position outside the block table row, or a block id
        # outside the cache, skips the step instead of reading or writing out of bounds.
        ok = (
            (src != dst) & (src >= 0) & (src < max_positions) & (dst >= 0) & (dst < max_positions)
        )  # max_positions = max_blocks * block_size
        if ok:
            src_blk = tl.load(bt_ptr + b * max_blocks + src // block_size).to(tl.int64)
            dst_blk = tl.load(bt_ptr + b * max_blocks + dst // block_size).to(tl.int64)
            if (src_blk >= 0) & (src_blk < num_blocks) & (dst_blk >= 0) & (dst_blk < num_blocks):
                src_row = src_blk * s_b + (src % block_size) * s_r
                dst_row = dst_blk * s_b + (dst % block_size) * s_r
                vals = tl.load(base + src_row + col_off, mask=col_mask)
                tl.store(base + dst_row + col_off, vals, mask=col_mask)


@triton.jit
def _compact_kv_kernel(
    k_ptr,
    v_ptr,
    bt_ptr,
    cache_lens_ptr,
    acc_ptr,
    num_acc_ptr,
    k_sl,
    k_sb,
    k_sr,
    k_sh,
    v_sl,
    v_sb,
    v_sr,
    v_sh,
    num_blocks,
    block_size,
    D,
    ROW,
    max_blocks,
    max_positions,
    T,
    BLOCK: tl.constexpr,
):
    pid = tl.program_id(0)
    layer = (pid // 2).to(tl.int64)
    b = tl.program_id(1).to(tl.int64)
    cols = tl.program_id(2).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    col_mask = cols < ROW
    c = tl.load(cache_lens_ptr + b).to(tl.int64)  # c + node may pass 2^31 - 1
    na = tl.minimum(tl.maximum(tl.load(num_acc_ptr + b), 0), T - 1)
    if pid % 2 == 0:
        _copy_path(
            k_ptr,
            k_sl,
            k_sb,
            k_sr,
            k_sh,
            layer,
            bt_ptr,
            acc_ptr,
            b,
            c,
            na,
            num_blocks,
            block_size,
            D,
            max_blocks,
            max_positions,
            T,
            cols,
            col_mask,
        )
    else:
        _copy_path(
            v_ptr,
            v_sl,
            v_sb,
            v_sr,
            v_sh,
            layer,
            bt_ptr,
            acc_ptr,
            b,
            c,
            na,
            num_blocks,
            block_size,
            D,
            max_blocks,
            max_positions,
            T,
            cols,
            col_mask,
        )


@torch.library.custom_op("specdec_triton::compact_kv", mutates_args=("k_cache", "v_cache"))
def compact_kv(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    cache_lens: torch.Tensor,
    accepted_nodes: torch.Tensor,
    num_accepted: torch.Tensor,
) -> None:
    """In place. k_cache, v_cache: [num_blocks, block_size, Hkv, D] or [L, num_blocks, block_size,
    Hkv, D] (any non-overlapping views with a contiguous last dim, validated; never copied);
    block_table: int [B, max_blocks]; cache_lens, num_accepted: int [B];
    accepted_nodes: int [B, T].

    A custom op (declared as mutating the caches), so torch.compile treats the launch as
    one opaque call and orders it correctly against reads of the caches."""
    k = k_cache if k_cache.dim() == 5 else k_cache.unsqueeze(0)
    v = v_cache if v_cache.dim() == 5 else v_cache.unsqueeze(0)
    L, num_blocks, block_size, H, D = k.shape
    bits = _BITS[k.element_size()]
    B, max_blocks = block_table.shape
    T = accepted_nodes.shape[1]
    ROW = H * D
    BLOCK = min(triton.next_power_of_2(ROW), 1024)
    grid = (2 * L, B, triton.cdiv(ROW, BLOCK))
    _compact_kv_kernel[grid](
        k.view(bits),
        v.view(bits),
        index32(block_table),
        index32(cache_lens),
        index32(accepted_nodes),
        index32(num_accepted),
        *k.stride()[:4],
        *v.stride()[:4],
        num_blocks,
        block_size,
        D,
        ROW,
        max_blocks,
        max_blocks * block_size,
        T,
        BLOCK=BLOCK,
    )
