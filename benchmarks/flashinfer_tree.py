"""FlashInfer's equivalent of tree_verify, for timing beside ours (optional: never a dependency).

BatchPrefillWithPagedKVCacheWrapper with a custom mask over the same paged cache: request b
has T query rows over context + T keys (its prefix, then the tree nodes); the mask row of
node i allows the whole prefix and the tree nodes set in tree_mask row i.
"""

import torch

from specdec_kernels.reference import unpack_tree_mask

WORKSPACE_BYTES = 256 * 2**20


def flashinfer_tree_verify(args, block_size, sm_scale):
    """fn(*args) -> out [B * T, Hq, D] running FlashInfer on tree_verify's arguments
    (q, k_cache, v_cache, block_table, cache_lens, num_nodes, tree_mask), planned for these
    shapes, block tables and masks (any bitwise copy of args may be passed to fn).
    Raises ImportError when flashinfer is not installed."""
    import flashinfer

    q, k_cache, v_cache, block_table, cache_lens, num_nodes, tree_mask = args
    B, T, Hq, D = q.shape
    Hkv = k_cache.shape[2]
    dev = q.device
    kv_lens = (cache_lens + num_nodes).long().cpu()
    pages = (kv_lens + block_size - 1) // block_size
    page_indptr = torch.cat([torch.zeros(1, dtype=torch.long), pages.cumsum(0)]).int()
    page_indices = torch.cat([block_table[b, : int(pages[b])].cpu() for b in range(B)]).int()
    last_page_len = (kv_lens - (pages - 1) * block_size).int()
    qo_indptr = torch.arange(0, (B + 1) * T, T, dtype=torch.int32)
    tree_bits = unpack_tree_mask(tree_mask, T).cpu()
    masks = []
    for b in range(B):
        c, n = int(cache_lens[b]), int(num_nodes[b])
        m = torch.zeros(T, c + n, dtype=torch.bool)
        m[:, :c] = True
        m[:, c:] = tree_bits[b, :, :n]
        m[n:] = False
        masks.append(m.flatten())
    workspace = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=dev)
    wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(workspace, "NHD")
    wrapper.plan(
        qo_indptr.to(dev),
        page_indptr.to(dev),
        page_indices.to(dev),
        last_page_len.to(dev),
        Hq,
        Hkv,
        D,
        block_size,
        custom_mask=torch.cat(masks).to(dev),
        causal=False,
        sm_scale=sm_scale,
        q_data_type=q.dtype,
        kv_data_type=k_cache.dtype,
    )

    def fn(q, k_cache, v_cache, *rest):
        return wrapper.run(q.view(B * T, Hq, D), (k_cache, v_cache))

    return fn
