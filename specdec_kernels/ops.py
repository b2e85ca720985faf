"""Python entry points of the specdec ops.

Each function validates through the C++ checks (so every backend is protected the
same way) and runs one backend:
  "cpp"        torch.ops.specdec.<op>: the C++ CPU kernel on CPU tensors, the CUDA C++ kernel on CUDA tensors
  "triton"     the Triton kernel (GPU, or CPU tensors under TRITON_INTERPRET=1)
  "reference"  the plain PyTorch reference (specdec_kernels.reference)
backend=None picks $SPECDEC_BACKEND if set, else "cpp".
"""
import os

import torch

from . import reference

BACKENDS = ("cpp", "triton", "reference")


def _backend(backend):
    backend = backend or os.environ.get("SPECDEC_BACKEND") or "cpp"
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    return backend


def _triton():
    from . import triton as triton_kernels  # imported lazily: triton is optional

    return triton_kernels


def build_tree_mask(parents, num_nodes, *, backend=None):
    """Ancestor bit masks and depths of padded draft trees.

    parents: int32 [B, T] (parents[b, 0] == -1, 0 <= parents[b, i] < i);
    num_nodes: int [B] in [1, T].
    Returns tree_mask int64 [B, T, ceil(T/64)] (bit j of row i set iff node j is i
    or an ancestor of i) and depth int32 [B, T] (use cache_lens + depth as RoPE positions).
    """
    backend = _backend(backend)
    if backend == "cpp":
        return torch.ops.specdec.build_tree_mask(parents, num_nodes)
    torch.ops.specdec._check_build_tree_mask(parents, num_nodes)
    if backend == "triton":
        return _triton().build_tree_mask(parents, num_nodes)
    return reference.build_tree_mask(parents, num_nodes)


def tree_verify(q, k_cache, v_cache, block_table, cache_lens, num_nodes, tree_mask, sm_scale=None,
                *, backend=None):
    """Tree attention of the verification pass over a paged KV cache.

    q: [B, T, Hq, D]; k_cache, v_cache: [num_blocks, block_size, Hkv, D] (Hq % Hkv == 0),
    holding the prefix at logical positions < cache_lens[b] and tree node i at cache_lens[b] + i;
    block_table: int32 [B, max_blocks]; cache_lens, num_nodes: int [B];
    tree_mask: int64 [B, T, ceil(T/64)] from build_tree_mask; sm_scale defaults to D ** -0.5.
    Returns [B, T, Hq, D] in q's dtype; rows i >= num_nodes[b] are zero.
    """
    if sm_scale is None:
        sm_scale = q.shape[-1] ** -0.5
    args = (q, k_cache, v_cache, block_table, cache_lens, num_nodes, tree_mask, float(sm_scale))
    backend = _backend(backend)
    if backend == "cpp":
        return torch.ops.specdec.tree_verify(*args)
    torch.ops.specdec._check_tree_verify(*args)
    if backend == "triton":
        return _triton().tree_verify(*args)
    return reference.tree_verify(*args)


def make_uniforms(B, T, device, generator=None):
    """uniforms float32 [B, T + 1] in [0, 1).

    generator: None (global RNG), a torch.Generator, or a list of B generators
    (one stream per request, so a request's samples do not depend on its batch).
    """
    if isinstance(generator, (list, tuple)):
        if len(generator) != B:
            raise ValueError(f"generator list must have B = {B} entries, got {len(generator)}")
        rows = [torch.rand(T + 1, generator=g, device=g.device) for g in generator]
        return torch.stack(rows).to(device)
    return torch.rand(B, T + 1, generator=generator, device=device)


def tree_rejection_sample(target_logits, draft_tokens, parents, num_nodes, draft_probs=None,
                          temperature=None, top_k=None, top_p=None, uniforms=None, *,
                          generator=None, backend=None):
    """Exact speculative acceptance over a batch of draft trees (chains are trees).

    target_logits: [B, T, V] (the target's logits at each node); draft_tokens: int [B, T];
    parents: int32 [B, T]; num_nodes: int [B]; draft_probs: [B, T, V] or None (point-mass drafts);
    temperature: float [B] (0 = greedy, default 0); top_k: int [B] (0 = off, default);
    top_p: float [B] (1 = off, default); uniforms: float [B, T + 1] in [0, 1), drawn with
    `generator` (see make_uniforms) when None.
    Returns (accepted_nodes int32 [B, T], num_accepted int32 [B], output_tokens int32 [B, T]),
    padded with -1; see reference.tree_rejection_sample for the exact rule and which
    uniform each decision consumes.
    """
    if target_logits.dim() != 3:  # the defaults below need B; same wording as the C++ check
        raise RuntimeError(f"target_logits must be [B, T, V], got shape {list(target_logits.shape)}")
    B, T, _ = target_logits.shape
    dev = target_logits.device
    if temperature is None:
        temperature = torch.zeros(B, device=dev)
    if top_k is None:
        top_k = torch.zeros(B, dtype=torch.int32, device=dev)
    if top_p is None:
        top_p = torch.ones(B, device=dev)
    if uniforms is None:
        uniforms = make_uniforms(B, T, dev, generator)
    args = (target_logits, draft_tokens, parents, num_nodes, draft_probs, temperature, top_k, top_p,
            uniforms)
    backend = _backend(backend)
    if backend == "cpp":
        return torch.ops.specdec.tree_rejection_sample(*args)
    torch.ops.specdec._check_tree_rejection_sample(*args)
    if backend == "triton":
        return _triton().tree_rejection_sample(*args)
    return reference.tree_rejection_sample(*args)


def compact_kv(k_cache, v_cache, block_table, cache_lens, accepted_nodes, num_accepted, *,
               backend=None):
    """In place, move the accepted path's KV to contiguous positions, all layers at once.

    k_cache, v_cache: [num_blocks, block_size, Hkv, D] or [L, num_blocks, block_size, Hkv, D];
    block_table: int32 [B, max_blocks]; cache_lens: int [B];
    accepted_nodes: int [B, T] (root path, starting with 0, -1 padded); num_accepted: int [B].
    Logical position cache_lens[b] + accepted_nodes[b, k] moves to cache_lens[b] + k.
    """
    args = (k_cache, v_cache, block_table, cache_lens, accepted_nodes, num_accepted)
    backend = _backend(backend)
    if backend == "cpp":
        return torch.ops.specdec.compact_kv(*args)
    torch.ops.specdec._check_compact_kv(*args)
    if backend == "triton":
        return _triton().compact_kv(*args)
    return reference.compact_kv(*args)
