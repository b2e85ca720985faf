"""Plain PyTorch references of the specdec ops.

They are the test oracle (called on float64 inputs) and the "naive PyTorch"
baseline of the microbenchmarks (called on the benchmark's own dtypes). They are
written for readability, following the contract in docs/ops.md word for word;
they do not validate their inputs (the public wrappers do, through C++).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

Tensor = torch.Tensor

__all__ = [
    "build_tree_mask",
    "unpack_tree_mask",
    "tree_verify",
    "process_logits",
    "tree_rejection_sample",
    "compact_kv",
    "rms_norm",
    "add_rms_norm",
    "rotate_half",
    "apply_rope",
    "rope_qkv",
    "silu_and_mul",
    "decode_layer",
    "decode_layers",
]


# --------------------------------------------------------------------------- masks
def build_tree_mask(parents: Tensor, num_nodes: Tensor) -> tuple[Tensor, Tensor]:
    """parents: [B, T] int, num_nodes: [B] int
    -> (tree_mask: [B, T, ceil(T/64)] int64, depth: [B, T] int32).

    Bit j of row i is set iff node j is node i or one of its ancestors; rows of
    padded nodes (i >= num_nodes[b]) are all zero and have depth 0.
    """
    B, T = parents.shape
    mask_words = (T + 63) // 64
    anc = torch.zeros(B, T, mask_words * 64, dtype=torch.bool)
    depth = torch.zeros(B, T, dtype=torch.int32)
    for b in range(B):
        for i in range(int(num_nodes[b])):
            p = int(parents[b, i])
            if p >= 0:
                anc[b, i] = anc[b, p]
                depth[b, i] = depth[b, p] + 1
            anc[b, i, i] = True
    words = anc.view(B, T, mask_words, 64).to(torch.int64)
    mask = torch.zeros(B, T, mask_words, dtype=torch.int64)
    for bit in range(64):  # bit 63 lands on the sign bit, as in the packed int64 contract
        mask |= words[..., bit] << bit
    return mask.to(parents.device), depth.to(parents.device)


def unpack_tree_mask(tree_mask: Tensor, T: int) -> Tensor:
    """tree_mask: [B, T, mask_words] int64 -> [B, T, T] bool (entry [b, i, j] is bit j of row i)."""
    bits = torch.arange(64, device=tree_mask.device)
    unpacked = (tree_mask[..., None] >> bits) & 1  # [B, T, mask_words, 64]
    return unpacked.flatten(-2)[..., :T].bool()


# --------------------------------------------------------------------------- attention
def tree_verify(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    block_table: Tensor,
    cache_lens: Tensor,
    num_nodes: Tensor,
    tree_mask: Tensor,
    sm_scale: float,
) -> Tensor:
    """Gather + dense mask + SDPA.

    q: [B, T, Hq, D]; k_cache, v_cache: [num_blocks, block_size, Hkv, D];
    block_table: [B, max_blocks] int; cache_lens, num_nodes: [B] int;
    tree_mask: [B, T, ceil(T/64)] int64  ->  [B, T, Hq, D] in q's dtype.
    """
    B, T, Hq, D = q.shape
    num_blocks, block_size, Hkv, _ = k_cache.shape
    S = block_table.shape[1] * block_size
    blocks = block_table.long().clamp(
        0, num_blocks - 1
    )  # unowned entries (e.g. -1) are never attended
    k = k_cache[blocks].reshape(B, S, Hkv, D)
    v = v_cache[blocks].reshape(B, S, Hkv, D)

    pos = torch.arange(S, device=q.device)[None, None, :]  # [1, 1, S]
    c = cache_lens.long()[:, None, None]
    n = num_nodes.long()[:, None, None]
    node = pos - c  # tree node index of each position
    in_tree = (node >= 0) & (node < n)
    tree_bits = unpack_tree_mask(tree_mask, T)  # [B, T, T]
    tree_ok = torch.gather(tree_bits, 2, node.clamp(0, T - 1).expand(B, T, S)) & in_tree
    mask = (pos < c) | tree_ok  # [B, T, S]
    row_valid = torch.arange(T, device=q.device)[None, :] < num_nodes.long()[:, None]
    mask &= row_valid[..., None]
    has_key = mask.any(-1)  # rows with nothing to attend to return zeros
    mask[..., 0] |= ~has_key

    out = F.scaled_dot_product_attention(
        q.transpose(1, 2),
        k.transpose(1, 2),
        v.transpose(1, 2),
        attn_mask=mask[:, None],
        scale=sm_scale,
        enable_gqa=Hq != Hkv,
    ).transpose(1, 2)
    return out.masked_fill(~has_key[..., None, None], 0).to(q.dtype)


# --------------------------------------------------------------------------- sampling
def process_logits(
    logits: Tensor,
    temperature: float | Tensor,
    top_k: int | Tensor,
    top_p: float | Tensor,
) -> Tensor:
    """logits: [..., V] of one request -> the processed target distribution [..., V].

    temperature 0: one-hot on the argmax (ties to the lowest id). Otherwise
    softmax(logits / temperature), then top-k (keep t iff fewer than k tokens have a
    strictly larger logit; 0 = off), renormalise, then top-p (keep t iff the
    tokens strictly more probable than t hold less than top_p of the mass;
    1.0 = off), renormalise. Both filters keep ties, so they are sort-free.
    """
    temperature, top_k, top_p = float(temperature), int(top_k), float(top_p)
    if temperature == 0.0:
        return F.one_hot(logits.argmax(-1), logits.shape[-1]).to(logits.dtype)
    probs = torch.softmax(logits / temperature, dim=-1)
    if 0 < top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        probs = torch.where(logits >= kth, probs, 0)
        probs = probs / probs.sum(-1, keepdim=True)
    if top_p < 1.0:
        asc, _ = torch.sort(probs, dim=-1)
        cum = torch.cumsum(asc, dim=-1)
        idx = (
            torch.searchsorted(asc, probs, right=True) - 1
        )  # last sorted slot holding a value <= p_t
        mass_above = cum[..., -1:] - torch.gather(cum, -1, idx)
        probs = torch.where(mass_above < top_p, probs, 0)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def _sample(dist, u):
    """Inverse CDF over the (unnormalised) dist [V]: the first t with cumsum[t] > u * sum."""
    cum = torch.cumsum(dist, 0)
    hit = torch.nonzero(cum > u * cum[-1])
    if len(hit) == 0:  # u * sum rounded up to the total: take the last token with mass
        return int(torch.nonzero(dist > 0)[-1])
    return int(hit[0])


def tree_rejection_sample(
    target_logits: Tensor,
    draft_tokens: Tensor,
    parents: Tensor,
    num_nodes: Tensor,
    draft_probs: Tensor | None,
    temperature: Tensor,
    top_k: Tensor,
    top_p: Tensor,
    uniforms: Tensor,
) -> tuple[Tensor, Tensor, Tensor]:
    """Exact multi-draft speculative sampling over trees (SpecInfer / EAGLE rule).

    target_logits: [B, T, V]; draft_tokens, parents: [B, T] int; num_nodes: [B] int;
    draft_probs: [B, T, V] or None (deterministic drafts: point masses);
    temperature, top_p: [B] float; top_k: [B] int; uniforms: [B, T + 1] float in [0, 1).
    -> accepted_nodes: [B, T] int32, num_accepted: [B] int32, output_tokens: [B, T] int32.

    Uniform consumption: the acceptance test of draft node c uses uniforms[b, c];
    the bonus token uses uniforms[b, T]. At the current node u with residual r
    (initially the processed target distribution p_u), child c (token x, tried in
    index order) is accepted iff uniforms[b, c] * q(x) * sum(r) < r(x), where
    q = draft_probs[b, u] or a point mass on x (q(x) = 1). On rejection
    r <- max(r / sum(r) - q, 0) (point mass: r(x) <- 0); should r lose all its
    mass (only possible with inconsistent draft_probs) it is reset to p_u. The
    walk ends at a leaf or when every child is rejected; the bonus token is then
    the inverse CDF of r at uniforms[b, T]. Greedy requests (temperature 0) use
    p_u = one-hot(argmax), which makes this rule accept exactly the child whose
    token is the argmax and emit the argmax as bonus. Probabilities, residuals and the
    CDF are float64 whatever the logits' dtype, as in the C++ kernel (the CUDA and Triton
    kernels compute in float32: they agree unless a uniform falls within float32 rounding
    of a decision boundary).
    """
    B, T, V = target_logits.shape
    accepted_nodes = torch.full((B, T), -1, dtype=torch.int32)
    output_tokens = torch.full((B, T), -1, dtype=torch.int32)
    num_accepted = torch.zeros(B, dtype=torch.int32)
    for b in range(B):
        n = int(num_nodes[b])
        children = [[] for _ in range(n)]
        for c in range(1, n):
            children[int(parents[b, c])].append(c)

        def target(node, b=b):  # request b of this iteration
            # in float64 whatever the logits' dtype, as the C++ kernel computes the
            # probabilities (a bf16 softmax and CDF would round them: a uniform near a
            # boundary would then pick the neighbouring token)
            logits = target_logits[b, node].double()
            if torch.isnan(logits).any() or not torch.isfinite(logits.max()):
                raise RuntimeError(f"target_logits[{b}, {node}] has NaN, +inf or only -inf entries")
            return process_logits(logits, temperature[b], top_k[b], top_p[b])

        u, path, toks = 0, [0], []
        p = target(0)
        r = p.clone()
        while True:
            nxt = None
            for c in children[u]:
                x = int(draft_tokens[b, c])
                q_x = 1.0 if draft_probs is None else float(draft_probs[b, u, x])
                if float(uniforms[b, c]) * q_x * float(r.sum()) < float(r[x]):
                    nxt = c
                    break
                if draft_probs is None:
                    r[x] = 0
                else:
                    r = torch.clamp(r / r.sum() - draft_probs[b, u].to(r.dtype), min=0)
                if not float(r.sum()) > 0:
                    r = p.clone()
            if nxt is None:
                break
            u = nxt
            path.append(u)
            toks.append(int(draft_tokens[b, u]))
            p = target(u)
            r = p.clone()
        toks.append(_sample(r, float(uniforms[b, T])))
        k = len(path)
        accepted_nodes[b, :k] = torch.tensor(path, dtype=torch.int32)
        output_tokens[b, :k] = torch.tensor(toks, dtype=torch.int32)
        num_accepted[b] = k - 1
    dev = target_logits.device
    return accepted_nodes.to(dev), num_accepted.to(dev), output_tokens.to(dev)


# --------------------------------------------------------------------------- compaction
def compact_kv(
    k_cache: Tensor,
    v_cache: Tensor,
    block_table: Tensor,
    cache_lens: Tensor,
    accepted_nodes: Tensor,
    num_accepted: Tensor,
) -> None:
    """In place: move logical position cache_lens[b] + accepted_nodes[b, k] to cache_lens[b] + k.

    k_cache, v_cache: [num_blocks, block_size, Hkv, D] or [L, num_blocks, block_size, Hkv, D].
    All sources are read before any destination is written, so overlaps are safe.
    """
    k = k_cache if k_cache.dim() == 5 else k_cache.unsqueeze(0)
    v = v_cache if v_cache.dim() == 5 else v_cache.unsqueeze(0)
    block_size = k.shape[2]
    for b in range(block_table.shape[0]):
        m = int(num_accepted[b]) + 1
        src = int(cache_lens[b]) + accepted_nodes[b, :m].long()
        dst = int(cache_lens[b]) + torch.arange(m, device=src.device)
        sb, so = block_table[b].long()[src // block_size], src % block_size
        db, do = block_table[b].long()[dst // block_size], dst % block_size
        for cache in (k, v):
            cache[:, db, do] = cache[:, sb, so].clone()


# --------------------------------------------------------------------------- layer ops
# The elementwise pieces of a Llama block as transformers computes them (the eager model,
# specdec.models.llama, calls these; the CPU decode path's C++ layer ops reproduce them).


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """x: [..., dim]; weight: [dim] -> weight * (x * rsqrt(mean(x^2) + eps)), normalised in
    float32 and rounded to x's dtype before the weight (transformers' LlamaRMSNorm)."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def add_rms_norm(x: Tensor, residual: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """-> (x + residual, rms_norm(x + residual)): a residual add and the next norm."""
    total = x + residual
    return total, rms_norm(total, weight, eps)


def rotate_half(x: Tensor) -> Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x: [B, T, H, D]; cos, sin: [B, T, 1, D] -> x rotated, [B, T, H, D]."""
    return x * cos + rotate_half(x) * sin


def rope_qkv(
    qkv: Tensor, cos: Tensor, sin: Tensor, num_q_heads: int, num_kv_heads: int
) -> tuple[Tensor, Tensor, Tensor]:
    """qkv: [B, T, (Hq + 2 * Hkv) * D], the fused projection; cos, sin: [B, T, 1, D] ->
    q: [B, T, Hq, D] and k: [B, T, Hkv, D] rotated, v: [B, T, Hkv, D]."""
    B, T, width = qkv.shape
    D = width // (num_q_heads + 2 * num_kv_heads)
    q, k, v = qkv.split([num_q_heads * D, num_kv_heads * D, num_kv_heads * D], dim=-1)
    q = apply_rope(q.reshape(B, T, num_q_heads, D), cos, sin)
    k = apply_rope(k.reshape(B, T, num_kv_heads, D), cos, sin)
    return q, k, v.reshape(B, T, num_kv_heads, D)


def silu_and_mul(x: Tensor) -> Tensor:
    """x: [..., 2 * H] = [gate, up] -> silu(gate) * up, [..., H] (SwiGLU)."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


TILE_OUTPUTS = 64  # output rows per tile of pack_linear_tiles' layout


def pack_linear_tiles(weight: Tensor) -> Tensor:
    """weight: [N, K] (K even) -> its tiles [ceil(N / 64), K / 2, 64, 2], contiguous:
    tiles[t, k2, j, p] = weight[64 t + j, 2 k2 + p], output rows past N zero (the layout of
    tiled_linear, csrc/cpu/tiled_linear.cpp)."""
    N, K = weight.shape
    if K % 2:
        raise ValueError(f"weight must have an even in_features, got shape {tuple(weight.shape)}")
    num_tiles = -(-N // TILE_OUTPUTS)
    padded = F.pad(weight.detach(), (0, 0, 0, num_tiles * TILE_OUTPUTS - N))
    return padded.view(num_tiles, TILE_OUTPUTS, K // 2, 2).permute(0, 2, 1, 3).contiguous()


def unpack_linear_tiles(weight_tiles: Tensor, out_features: int) -> Tensor:
    """The inverse of pack_linear_tiles -> [out_features, K]."""
    num_tiles, pairs = weight_tiles.shape[:2]
    weight = weight_tiles.permute(0, 2, 1, 3).reshape(num_tiles * TILE_OUTPUTS, 2 * pairs)
    return weight[:out_features]


def tiled_linear(
    x: Tensor, weight_tiles: Tensor, out_features: int, bias: Tensor | None = None
) -> Tensor:
    """x: [..., K] @ the tiled weight^T (+ bias) -> [..., out_features]: float64 products and
    sums, bias added before the one rounding to x's dtype."""
    weight = unpack_linear_tiles(weight_tiles, out_features)
    y = F.linear(x.double(), weight.double(), None if bias is None else bias.double())
    return y.to(x.dtype)


def decode_layer(
    x: Tensor,
    attention_norm_weight: Tensor,
    ffn_norm_weight: Tensor,
    eps: float,
    wqkv: Tensor,
    wqkv_bias: Tensor | None,
    wo: Tensor,
    w13: Tensor,
    w2: Tensor,
    cos: Tensor,
    sin: Tensor,
    num_q_heads: int,
    num_kv_heads: int,
    k_cache: Tensor,
    v_cache: Tensor,
    rows: Tensor,
    picked: Tensor | None,
    packed: bool,
    block_table: Tensor,
    cache_lens: Tensor,
    num_nodes: Tensor,
    tree_mask: Tensor,
    sm_scale: float,
) -> Tensor:
    """One Llama decoder layer of a verify step over the paged cache (the model's
    TransformerBlock: pre-norm attention then SwiGLU MLP, residuals), writing the new tokens'
    K/V into k_cache / v_cache [num_blocks, block_size, Hkv, D] (contiguous) at `rows`.

    x: [B, M, dim] the new tokens (nodes 0..M-1 of trees of T = M nodes), or with `packed`
    [1, N, dim] the real nodes only, node picked[i] of the flattened [B, T] trees; weights
    [out, in]; cos, sin: [B, M, 1, D]; rows: int64 [N] physical cache rows of the tokens
    written (without packed: of the entries `picked` of the flattened [B * M] tokens, all when
    picked is None) -> [B, M, dim] (packed: [1, N, dim])."""
    B, M, _ = x.shape
    qkv = F.linear(rms_norm(x, attention_norm_weight, eps), wqkv, wqkv_bias)
    q, k, v = rope_qkv(qkv, cos, sin, num_q_heads, num_kv_heads)
    D = q.shape[-1]
    k_rows, v_rows = k.reshape(-1, num_kv_heads, D), v.reshape(-1, num_kv_heads, D)
    if picked is not None and not packed:
        k_rows, v_rows = k_rows[picked], v_rows[picked]
    k_cache.view(-1, num_kv_heads, D).index_copy_(0, rows, k_rows.to(k_cache.dtype))
    v_cache.view(-1, num_kv_heads, D).index_copy_(0, rows, v_rows.to(v_cache.dtype))
    if packed:
        assert picked is not None
        tree_batch, T = tree_mask.shape[:2]
        q_tree = q.new_zeros(tree_batch * T, num_q_heads, D).index_copy_(0, picked, q[0])
        q = q_tree.view(tree_batch, T, num_q_heads, D)
    out = tree_verify(q, k_cache, v_cache, block_table, cache_lens, num_nodes, tree_mask, sm_scale)
    if packed:
        out = out.reshape(-1, num_q_heads, D)[picked][None]
    total, normed = add_rms_norm(x, F.linear(out.reshape(B, M, -1), wo), ffn_norm_weight, eps)
    return total + F.linear(silu_and_mul(F.linear(normed, w13)), w2)


def decode_layers(
    x: Tensor,
    attention_norm_weights: list[Tensor],
    ffn_norm_weights: list[Tensor],
    eps: float,
    wqkv: list[Tensor],
    wqkv_bias: list[Tensor | None],
    wo: list[Tensor],
    w13: list[Tensor],
    w2: list[Tensor],
    cos: Tensor,
    sin: Tensor,
    num_q_heads: int,
    num_kv_heads: int,
    k_cache: Tensor,
    v_cache: Tensor,
    first_layer: int,
    rows: Tensor,
    picked: Tensor | None,
    packed: bool,
    block_table: Tensor,
    cache_lens: Tensor,
    num_nodes: Tensor,
    tree_mask: Tensor,
    sm_scale: float,
) -> Tensor:
    """decode_layer for layers first_layer .. first_layer + len(wqkv) - 1 in turn, entry i of
    each weight list for layer first_layer + i, whose K/V go to k_cache / v_cache
    [num_layers, num_blocks, block_size, Hkv, D] at index first_layer + i -> x's shape."""
    for i in range(len(wqkv)):
        x = decode_layer(
            x,
            attention_norm_weights[i],
            ffn_norm_weights[i],
            eps,
            wqkv[i],
            wqkv_bias[i],
            wo[i],
            w13[i],
            w2[i],
            cos,
            sin,
            num_q_heads,
            num_kv_heads,
            k_cache[first_layer + i],
            v_cache[first_layer + i],
            rows,
            picked,
            packed,
            block_table,
            cache_lens,
            num_nodes,
            tree_mask,
            sm_scale,
        )
    return x
