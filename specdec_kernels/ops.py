"""Python entry points of the specdec ops.

Each function validates through the C++ checks (so every backend is protected the
same way) and runs one backend:
  "cpp"        torch.ops.specdec.<op>: the C++ CPU kernel on CPU tensors, the CUDA C++ kernel
               on CUDA tensors
  "triton"     the Triton kernel (GPU, or CPU tensors under TRITON_INTERPRET=1)
  "reference"  the plain PyTorch reference (specdec_kernels.reference)
backend=None picks $SPECDEC_BACKEND if set, else "cpp" (see envs.py).

Shapes are written ``name: [B, T, Hq, D] dtype``: B requests, T tree nodes (padded),
Hq / Hkv query / KV heads, D head size, V vocabulary size, L layers.
"""

from __future__ import annotations

import types
from collections.abc import Sequence
from typing import Literal

import torch

from . import envs, reference

Backend = Literal["cpp", "triton", "reference"]
Generator = torch.Generator | Sequence[torch.Generator] | None

BACKENDS: tuple[str, ...] = ("cpp", "triton", "reference")


def _backend(backend: str | None) -> str:
    backend = backend or envs.SPECDEC_BACKEND or "cpp"
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    return backend


def _triton() -> types.ModuleType:
    from . import triton as triton_kernels  # imported lazily: triton is optional

    return triton_kernels


def build_tree_mask(
    parents: torch.Tensor, num_nodes: torch.Tensor, *, backend: Backend | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Ancestor bit masks and depths of padded draft trees.

    Args:
        parents: [B, T] int32 (or int64); parents[b, 0] == -1, 0 <= parents[b, i] < i.
        num_nodes: [B] int32 (or int64), each in [1, T].
        backend: "cpp", "triton" or "reference" (default $SPECDEC_BACKEND or "cpp").

    Returns:
        tree_mask: [B, T, ceil(T/64)] int64; bit j of row i set iff node j is i or an
            ancestor of i (padded rows zero).
        depth: [B, T] int32; use cache_lens + depth as RoPE positions.
    """
    backend = _backend(backend)
    if backend == "cpp":
        return torch.ops.specdec.build_tree_mask(parents, num_nodes)
    torch.ops.specdec._check_build_tree_mask(parents, num_nodes)
    if backend == "triton":
        return _triton().build_tree_mask(parents, num_nodes)
    return reference.build_tree_mask(parents, num_nodes)


def tree_verify(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    cache_lens: torch.Tensor,
    num_nodes: torch.Tensor,
    tree_mask: torch.Tensor,
    sm_scale: float | None = None,
    *,
    backend: Backend | None = None,
) -> torch.Tensor:
    """Tree attention of the verification pass over a paged KV cache.

    Args:
        q: [B, T, Hq, D] float32, float16 or bfloat16; any view with a contiguous last dim
            (e.g. a slice of the fused QKV output).
        k_cache: [num_blocks, block_size, Hkv, D], q's dtype, Hq % Hkv == 0; holds the
            prefix at logical positions < cache_lens[b] and tree node i at cache_lens[b] + i.
            Any view with a contiguous last dim (NHD / HND pages, half of a joint KV tensor,
            a token pool as block size 1: docs/ops.md, Layouts); read in place.
        v_cache: [num_blocks, block_size, Hkv, D], like k_cache (its own strides).
        block_table: [B, max_blocks] int32 (or int64); logical position p of request b is
            row p % block_size of block block_table[b, p // block_size].
        cache_lens: [B] int32 (or int64), the prefix length of each request.
        num_nodes: [B] int32 (or int64), valid tree nodes per request.
        tree_mask: [B, T, ceil(T/64)] int64, from build_tree_mask.
        sm_scale: softmax scale, default D ** -0.5.
        backend: "cpp", "triton" or "reference" (default $SPECDEC_BACKEND or "cpp").

    Returns:
        [B, T, Hq, D] in q's dtype, contiguous; rows i >= num_nodes[b] are zero.

    Any head dim D >= 1 is accepted. The CUDA C++ kernel pads D to 32 / 64 / 128 / 256 / 512
    in its tiled kernel; D > 512 runs a slower generic CUDA kernel (no K/V reuse across the
    query heads of a KV head).
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


def make_uniforms(
    B: int, T: int, device: torch.device | str, generator: Generator = None
) -> torch.Tensor:
    """The uniforms of tree_rejection_sample: [B, T + 1] float32 in [0, 1), on device.

    Args:
        generator: None (global RNG), a torch.Generator, or a list of B generators
            (one stream per request, so a request's samples do not depend on its batch).
    """
    if isinstance(generator, (list, tuple)):
        if len(generator) != B:
            raise ValueError(f"generator list must have B = {B} entries, got {len(generator)}")
        rows = [torch.rand(T + 1, generator=g, device=g.device) for g in generator]
        return torch.stack(rows).to(device)
    return torch.rand(B, T + 1, generator=generator, device=device)


def tree_rejection_sample(
    target_logits: torch.Tensor,
    draft_tokens: torch.Tensor,
    parents: torch.Tensor,
    num_nodes: torch.Tensor,
    draft_probs: torch.Tensor | None = None,
    temperature: torch.Tensor | None = None,
    top_k: torch.Tensor | None = None,
    top_p: torch.Tensor | None = None,
    uniforms: torch.Tensor | None = None,
    *,
    generator: Generator = None,
    backend: Backend | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Exact speculative acceptance over a batch of draft trees (chains are trees).

    Args:
        target_logits: [B, T, V] float, the target's logits at each node.
        draft_tokens: [B, T] int32 (or int64), each node's token (node 0 unused).
        parents: [B, T] int32 (or int64), as in build_tree_mask.
        num_nodes: [B] int32 (or int64).
        draft_probs: [B, T, V] float, the draft distribution at each node from which its
            children were sampled, or None for point-mass (top-k) drafts.
        temperature: [B] float, 0 = greedy (default all 0).
        top_k: [B] int, 0 = off (default).
        top_p: [B] float, 1.0 = off (default).
        uniforms: [B, T + 1] float in [0, 1); drawn with `generator` (make_uniforms) when None.
        generator: see make_uniforms.
        backend: "cpp", "triton" or "reference" (default $SPECDEC_BACKEND or "cpp").

    Returns:
        accepted_nodes: [B, T] int32, the accepted root path starting at 0, then -1.
        num_accepted: [B] int32, accepted drafts (root excluded).
        output_tokens: [B, T] int32, the accepted draft tokens then the bonus token, then -1.
        See reference.tree_rejection_sample for the exact rule and which uniform each
        decision consumes.
    """
    if target_logits.dim() != 3:  # the defaults below need B; same wording as the C++ check
        raise RuntimeError(
            f"target_logits must be [B, T, V], got shape {list(target_logits.shape)}"
        )
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
    args = (
        target_logits,
        draft_tokens,
        parents,
        num_nodes,
        draft_probs,
        temperature,
        top_k,
        top_p,
        uniforms,
    )
    backend = _backend(backend)
    if backend == "cpp":
        return torch.ops.specdec.tree_rejection_sample(*args)
    torch.ops.specdec._check_tree_rejection_sample(*args)
    if backend == "triton":
        return _triton().tree_rejection_sample(*args)
    return reference.tree_rejection_sample(*args)


def compact_kv(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    cache_lens: torch.Tensor,
    accepted_nodes: torch.Tensor,
    num_accepted: torch.Tensor,
    *,
    backend: Backend | None = None,
) -> None:
    """In place, move the accepted path's KV to contiguous positions, all layers at once.

    Logical position cache_lens[b] + accepted_nodes[b, k] moves to cache_lens[b] + k,
    k = 0 .. num_accepted[b].

    Args:
        k_cache: [num_blocks, block_size, Hkv, D] or [L, num_blocks, block_size, Hkv, D],
            modified in place; any view with a contiguous last dim that does not overlap
            itself (docs/ops.md, Layouts).
        v_cache: same shape and dtype as k_cache (its own strides), not overlapping k_cache,
            modified in place.
        block_table: [B, max_blocks] int32 (or int64).
        cache_lens: [B] int32 (or int64).
        accepted_nodes: [B, T] int32 (or int64), the root path starting with 0, -1 padded.
        num_accepted: [B] int32 (or int64).
        backend: "cpp", "triton" or "reference" (default $SPECDEC_BACKEND or "cpp").
    """
    args = (k_cache, v_cache, block_table, cache_lens, accepted_nodes, num_accepted)
    backend = _backend(backend)
    if backend == "cpp":
        return torch.ops.specdec.compact_kv(*args)
    torch.ops.specdec._check_compact_kv(*args)
    if backend == "triton":
        return _triton().compact_kv(*args)
    return reference.compact_kv(*args)


# --------------------------------------------------------------------------- layer ops
# The elementwise pieces of a Llama block for the CPU decode path (specdec.cpu.layer_ops): C++
# CPU kernels ("cpp") and the references; no CUDA or Triton kernels (on GPUs torch.compile
# fuses these). Outputs are new contiguous tensors in the input dtype, rounded per op as the
# references (transformers) round them.
LayerBackend = Literal["cpp", "reference"]


def _layer_backend(backend: str | None, name: str) -> str:
    backend = _backend(backend)
    if backend == "triton":
        raise NotImplementedError(f"{name} has no Triton kernel (backends: cpp, reference)")
    return backend


def _on_meta(*tensors: torch.Tensor) -> list[torch.Tensor]:
    """Data-free copies, so the C++ checks (run by the meta kernels) validate the reference
    backend's inputs too."""
    return [t.to("meta") for t in tensors]


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, *, backend: LayerBackend | None = None
) -> torch.Tensor:
    """RMSNorm as transformers' LlamaRMSNorm.

    Args:
        x: [..., dim] float32, float16 or bfloat16.
        weight: [dim], x's dtype.
        eps: >= 0.

    Returns:
        [..., dim]: weight * (x * rsqrt(mean(x^2) + eps)), normalised in float32.
    """
    if _layer_backend(backend, "rms_norm") == "cpp":
        return torch.ops.specdec.rms_norm(x, weight, eps)
    torch.ops.specdec.rms_norm(*_on_meta(x, weight), eps)
    return reference.rms_norm(x, weight, eps)


def add_rms_norm(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    *,
    backend: LayerBackend | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """A residual add and the following RMSNorm.

    Args:
        x, residual: [..., dim], the same shape and dtype (float32, float16 or bfloat16).
        weight: [dim], x's dtype.
        eps: >= 0.

    Returns:
        sum: [..., dim] x + residual (rounded to the dtype); normed: rms_norm(sum).
    """
    if _layer_backend(backend, "add_rms_norm") == "cpp":
        return torch.ops.specdec.add_rms_norm(x, residual, weight, eps)
    torch.ops.specdec.add_rms_norm(*_on_meta(x, residual, weight), eps)
    return reference.add_rms_norm(x, residual, weight, eps)


def rope_qkv(
    qkv: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    num_q_heads: int,
    num_kv_heads: int,
    *,
    backend: LayerBackend | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Splits a fused q/k/v projection into heads and applies rotary embeddings to q and k.

    Args:
        qkv: [B, T, (num_q_heads + 2 * num_kv_heads) * D], D even.
        cos, sin: [B, T, 1, D], qkv's dtype (as transformers computes them: float32 cos /
            sin of position * inv_freq, rounded to the dtype).
        num_q_heads, num_kv_heads: >= 1.

    Returns:
        q: [B, T, num_q_heads, D], k: [B, T, num_kv_heads, D], both rotated
        (x * cos + rotate_half(x) * sin); v: [B, T, num_kv_heads, D].
    """
    if _layer_backend(backend, "rope_qkv") == "cpp":
        return torch.ops.specdec.rope_qkv(qkv, cos, sin, num_q_heads, num_kv_heads)
    torch.ops.specdec.rope_qkv(*_on_meta(qkv, cos, sin), num_q_heads, num_kv_heads)
    return reference.rope_qkv(qkv, cos, sin, num_q_heads, num_kv_heads)


def silu_and_mul(x: torch.Tensor, *, backend: LayerBackend | None = None) -> torch.Tensor:
    """SwiGLU's gate.

    Args:
        x: [..., 2 * H] = [gate, up], float32, float16 or bfloat16.

    Returns:
        [..., H]: silu(gate) * up.
    """
    if _layer_backend(backend, "silu_and_mul") == "cpp":
        return torch.ops.specdec.silu_and_mul(x)
    torch.ops.specdec.silu_and_mul(*_on_meta(x))
    return reference.silu_and_mul(x)


def pack_linear_tiles(weight: torch.Tensor) -> torch.Tensor:
    """A linear weight laid out once for tiled_linear.

    Args:
        weight: [out_features, in_features] bfloat16, in_features even.

    Returns:
        [ceil(out_features / 64), in_features / 2, 64, 2] contiguous: tile t holds output rows
        64 t .. 64 t + 63 (zero past out_features), input pairs outermost, so one 64-byte load
        is 16 outputs x 2 inputs.
    """
    return reference.pack_linear_tiles(weight)


def tiled_linear(
    x: torch.Tensor,
    weight_tiles: torch.Tensor,
    out_features: int,
    bias: torch.Tensor | None = None,
    *,
    backend: LayerBackend | None = None,
) -> torch.Tensor:
    """x @ weight^T (+ bias) for the few rows of a decode step, over the weight's tiles.

    Args:
        x: [..., in_features] bfloat16 (any rows; fastest against oneDNN at 1-8).
        weight_tiles: pack_linear_tiles(weight) of a [out_features, in_features] bf16 weight.
        out_features: the weight's output rows.
        bias: [out_features] bfloat16 or None.

    Returns:
        [..., out_features] bfloat16: float32 accumulation, bias added in float32, one rounding.
    """
    if _layer_backend(backend, "tiled_linear") == "cpp":
        return torch.ops.specdec.tiled_linear(x, weight_tiles, out_features, bias)
    metas = _on_meta(x, weight_tiles, *([] if bias is None else [bias]))
    torch.ops.specdec.tiled_linear(metas[0], metas[1], out_features, *metas[2:])
    return reference.tiled_linear(x, weight_tiles, out_features, bias)
