"""tree_verify in Triton: flash-decoding over a paged KV cache with a packed tree mask.

Grid: (B * Hkv, query-row blocks, prefix splits). The query rows of a program are
the T * group (node, query head) pairs that share one KV head (GQA), so each K/V
tile, gathered through the block table, is loaded once for all of them. Keys are
the prefix (positions < cache_lens, visible to every valid node) then the tree
segment (cache_lens + j, visible to node i iff bit j of tree_mask row i). Online
softmax in base 2 with fp32 accumulation; each split writes its partial
(unnormalised out, max, sum of exponentials) and a merge kernel combines them,
or, with a single split, the program normalises and writes the output directly.
Rows of padded nodes, or with no key at all, come out zero.
"""

import math

import torch
import triton
import triton.language as tl

from ._index import index32


@triton.jit
def _dot(a, b, PREC: tl.constexpr, UPCAST: tl.constexpr):
    """a @ b with fp32 accumulation; UPCAST feeds fp32 operands (the CPU interpreter
    computes bf16 dots on the raw uint16 storage, so it needs them upcast)."""
    if UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    return tl.dot(a, b, input_precision=PREC)


@triton.jit
def _attend(
    q,
    m_i,
    l_i,
    acc,
    k_ptr,
    v_ptr,
    bt_ptr,
    tm_ptr,
    b,
    kvh,
    lo,
    hi,
    c,
    node,
    row_ok,
    d,
    d_ok,
    stride_kb,
    stride_kr,
    stride_kh,
    stride_vb,
    stride_vr,
    stride_vh,
    num_blocks,
    block_size,
    max_blocks,
    T,
    mask_words32,
    qk_scale,
    IS_TREE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PREC: tl.constexpr,
    UPCAST: tl.constexpr,
):
    """Online softmax of the query tile q [BM, BD] over key positions [lo, hi)."""
    for start in range(lo, hi, BLOCK_N):
        pos = start + tl.arange(0, BLOCK_N)
        pos_ok = pos < hi  # hi <= max_blocks * block_size, so the block table read stays in row b
        # Block ids are clamped like the reference's gather: unvalidated (GPU) bad ids give
        # wrong numbers, never an out-of-bounds read.
        blk = tl.load(bt_ptr + b * max_blocks + pos // block_size, mask=pos_ok, other=0).to(
            tl.int64
        )
        blk = tl.minimum(tl.maximum(blk, 0), num_blocks - 1)
        # Offsets through the caches' strides (int64): any layout with a contiguous last dim.
        row = (pos % block_size).to(tl.int64)
        k_off = (blk * stride_kb + row * stride_kr + kvh * stride_kh)[:, None] + d[None, :]
        v_off = (blk * stride_vb + row * stride_vr + kvh * stride_vh)[:, None] + d[None, :]
        kv_ok = pos_ok[:, None] & d_ok[None, :]
        k = tl.load(k_ptr + k_off, mask=kv_ok, other=0.0)
        s = _dot(q, tl.trans(k), PREC, UPCAST) * qk_scale  # [BM, BN], log2 units
        allowed = row_ok[:, None] & pos_ok[None, :]
        if IS_TREE:
            j = pos - c  # tree node of each key
            # the mask viewed as int32 words [B, T, mask_words32]: bit j of a row is bit j % 32
            # of word j // 32
            words = tl.load(
                tm_ptr + (b * T + node)[:, None] * mask_words32 + (j // 32)[None, :],
                mask=allowed,
                other=0,
            )
            allowed = allowed & (((words >> (j % 32)[None, :]) & 1) != 0)
        s = tl.where(allowed, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # fully masked so far: no NaN
        alpha = tl.math.exp2(m_i - m_safe)
        p = tl.math.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_ptr + v_off, mask=kv_ok, other=0.0)
        acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, PREC, UPCAST)
        m_i = m_new
    return m_i, l_i, acc


@triton.jit
def _tree_verify_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    bt_ptr,
    cache_lens_ptr,
    num_nodes_ptr,
    tm_ptr,
    out_ptr,
    part_acc_ptr,
    part_ml_ptr,
    qk_scale,
    T,
    Hq,
    Hkv,
    D,
    stride_qb,
    stride_qt,
    stride_qh,
    stride_kb,
    stride_kr,
    stride_kh,
    stride_vb,
    stride_vr,
    stride_vh,
    num_blocks,
    block_size,
    max_blocks,
    max_positions,
    mask_words32,
    CHUNK,
    GROUP: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PREC: tl.constexpr,
    UPCAST: tl.constexpr,
):
    b = (tl.program_id(0) // Hkv).to(tl.int64)
    kvh = tl.program_id(0) % Hkv
    split = tl.program_id(2)
    # int64, and bounded to the max_positions = max_blocks * block_size positions the block
    # table row maps: unvalidated (GPU) cache_lens / num_nodes can neither overflow c + n nor
    # index past the row.
    n = tl.minimum(tl.maximum(tl.load(num_nodes_ptr + b), 0), T)
    c = tl.minimum(tl.maximum(tl.load(cache_lens_ptr + b).to(tl.int64), 0), max_positions)

    rows = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)  # (node, head in group) pairs
    node = rows // GROUP
    head = kvh * GROUP + rows % GROUP
    row_ok = (node < n) & (rows < T * GROUP)
    d = tl.arange(0, BLOCK_D)
    d_ok = d < D
    q_row = (b * T + node) * Hq + head  # row of out (contiguous) viewed as [B * T * Hq, D]
    q_off = b * stride_qb + node.to(tl.int64) * stride_qt + head.to(tl.int64) * stride_qh
    q = tl.load(
        q_ptr + q_off[:, None] + d[None, :], mask=row_ok[:, None] & d_ok[None, :], other=0.0
    )

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    lo = split * CHUNK
    hi = lo + CHUNK
    m_i, l_i, acc = _attend(
        q,
        m_i,
        l_i,
        acc,
        k_ptr,
        v_ptr,
        bt_ptr,
        tm_ptr,
        b,
        kvh,
        lo,
        tl.minimum(hi, c),
        c,
        node,
        row_ok,
        d,
        d_ok,
        stride_kb,
        stride_kr,
        stride_kh,
        stride_vb,
        stride_vr,
        stride_vh,
        num_blocks,
        block_size,
        max_blocks,
        T,
        mask_words32,
        qk_scale,
        False,
        BLOCK_N,
        PREC,
        UPCAST,
    )
    m_i, l_i, acc = _attend(
        q,
        m_i,
        l_i,
        acc,
        k_ptr,
        v_ptr,
        bt_ptr,
        tm_ptr,
        b,
        kvh,
        tl.maximum(lo, c),
        tl.minimum(tl.minimum(hi, c + n), max_positions),
        c,
        node,
        row_ok,
        d,
        d_ok,
        stride_kb,
        stride_kr,
        stride_kh,
        stride_vb,
        stride_vr,
        stride_vh,
        num_blocks,
        block_size,
        max_blocks,
        T,
        mask_words32,
        qk_scale,
        True,
        BLOCK_N,
        PREC,
        UPCAST,
    )

    io_ok = (rows < T * GROUP)[:, None] & d_ok[None, :]
    if NUM_SPLITS == 1:
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]  # no key: acc is 0, out 0
        tl.store(
            out_ptr + q_row[:, None] * D + d[None, :], out.to(out_ptr.dtype.element_ty), mask=io_ok
        )
    else:
        part = q_row * NUM_SPLITS + split  # [B * T * Hq, NUM_SPLITS] partials
        tl.store(part_acc_ptr + part[:, None] * D + d[None, :], acc, mask=io_ok)
        tl.store(part_ml_ptr + part * 2, m_i, mask=rows < T * GROUP)
        tl.store(part_ml_ptr + part * 2 + 1, l_i, mask=rows < T * GROUP)


@triton.jit
def _merge_kernel(
    part_acc_ptr,
    part_ml_ptr,
    out_ptr,
    D,
    NUM_SPLITS: tl.constexpr,
    S_PAD: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """One program per output row: combines the NUM_SPLITS partials of that row."""
    row = tl.program_id(0).to(tl.int64)
    s = tl.arange(0, S_PAD)
    s_ok = s < NUM_SPLITS
    d = tl.arange(0, BLOCK_D)
    d_ok = d < D
    part = row * NUM_SPLITS + s
    m = tl.load(part_ml_ptr + part * 2, mask=s_ok, other=float("-inf"))
    sums = tl.load(part_ml_ptr + part * 2 + 1, mask=s_ok, other=0.0)
    acc = tl.load(
        part_acc_ptr + part[:, None] * D + d[None, :], mask=s_ok[:, None] & d_ok[None, :], other=0.0
    )
    m_max = tl.max(m, 0)
    w = tl.math.exp2(m - tl.where(m_max == float("-inf"), 0.0, m_max))  # empty splits weigh 0
    total = tl.sum(w * sums, 0)
    out = tl.sum(w[:, None] * acc, 0) / tl.where(total > 0, total, 1.0)
    tl.store(out_ptr + row * D + d, out.to(out_ptr.dtype.element_ty), mask=d_ok)


def _launch_config(device, D, S_max, programs):
    """-> (BLOCK_N, NUM_SPLITS, CHUNK, num_warps).

    Splits fill the GPU when B * Hkv * row blocks is small and the context long
    (each split keeps >= 4 tiles). Under the CPU interpreter the targets are tiny
    so that short test contexts exercise the split-and-merge path too.
    """
    if device.type == "cuda":
        block_n = 64 if D <= 128 else 32
        target = 2 * torch.cuda.get_device_properties(device).multi_processor_count
        num_warps = 4 if D <= 64 else 8
    else:
        block_n, target, num_warps = 16, 8, 4
    splits = max(1, min(triton.cdiv(S_max, 4 * block_n), triton.cdiv(target, programs)))
    chunk = triton.cdiv(triton.cdiv(S_max, splits), block_n) * block_n
    return block_n, triton.cdiv(S_max, chunk), chunk, num_warps


@torch.library.custom_op("specdec_triton::tree_verify", mutates_args=())
def tree_verify(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    cache_lens: torch.Tensor,
    num_nodes: torch.Tensor,
    tree_mask: torch.Tensor,
    sm_scale: float,
) -> torch.Tensor:
    """q: [B, T, Hq, D]; k_cache, v_cache: [num_blocks, block_size, Hkv, D] (any views with a
    contiguous last dim, validated: read through their strides, never copied);
    block_table: int [B, max_blocks]; cache_lens, num_nodes: int [B];
    tree_mask: int64 [B, T, ceil(T/64)]  ->  [B, T, Hq, D] in q's dtype, contiguous.

    A custom op, so torch.compile treats the launches as one opaque call."""
    B, T, Hq, D = q.shape
    num_blocks, block_size, Hkv, _ = k_cache.shape
    max_blocks = block_table.shape[1]
    mask_words = tree_mask.shape[2]
    group = Hq // Hkv
    block_m = min(64, max(16, triton.next_power_of_2(T * group)))
    m_blocks = triton.cdiv(T * group, block_m)
    block_n, splits, chunk, num_warps = _launch_config(
        q.device, D, max_blocks * block_size, B * Hkv * m_blocks
    )
    block_d = max(16, triton.next_power_of_2(D))
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)  # contiguous, as the fake says
    if splits > 1:
        part_acc = torch.empty(B * T * Hq, splits, D, dtype=torch.float32, device=q.device)
        part_ml = torch.empty(B * T * Hq, splits, 2, dtype=torch.float32, device=q.device)
    else:
        part_acc = part_ml = out  # unused
    _tree_verify_kernel[(B * Hkv, m_blocks, splits)](
        q,
        k_cache,
        v_cache,
        index32(block_table),
        index32(cache_lens),
        index32(num_nodes),
        tree_mask.contiguous().view(torch.int32),
        out,
        part_acc,
        part_ml,
        float(sm_scale) * math.log2(math.e),
        T,
        Hq,
        Hkv,
        D,
        *q.stride()[:3],
        *k_cache.stride()[:3],
        *v_cache.stride()[:3],
        num_blocks,
        block_size,
        max_blocks,
        max_blocks * block_size,
        2 * mask_words,  # the kernel reads the int64 words as int32 pairs
        chunk,
        GROUP=group,
        NUM_SPLITS=splits,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_D=block_d,
        PREC="ieee" if q.dtype == torch.float32 else "tf32",
        UPCAST=q.device.type != "cuda" and q.dtype == torch.bfloat16,
        num_warps=num_warps,
    )
    if splits > 1:
        _merge_kernel[(B * T * Hq,)](
            part_acc,
            part_ml,
            out,
            D,
            NUM_SPLITS=splits,
            S_PAD=triton.next_power_of_2(splits),
            BLOCK_D=block_d,
        )
    return out


@tree_verify.register_fake
def _(q, k_cache, v_cache, block_table, cache_lens, num_nodes, tree_mask, sm_scale):
    return torch.empty_like(q, memory_format=torch.contiguous_format)
