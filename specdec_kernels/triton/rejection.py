"""tree_rejection_sample in Triton: one program per request does the whole tree walk on device.

The program scans the nodes in index order (a walk visits increasing ids, and
the children of the current node u are tried in index order): a node whose
parent is the current u is its next child to test. Per visited node, the
processed target distribution p_u is kept as a few scalars (max logit, argmax,
1/temperature, a logit threshold tau with p_u(t) = 0 below it, normaliser Z):

  * top-k / top-p thresholds are found without sorting, by bisection over the
    order-preserving integer keys of the fp32 logits (each step one pass over
    V). It converges to an actual logit, so the tie-inclusive kept sets of
    reference.process_logits come out exactly: top-k keeps logit >= the k-th
    largest logit, top-p keeps logit >= the smallest logit whose strictly larger
    logits hold less than top_p of the (top-k renormalised) mass.
  * acceptance tests read single entries (logit of the drafted token).
  * the residual stays implicit for point-mass drafts: p_u minus the rejected
    tokens (at most T, kept in registers) and its running mass. With
    draft_probs it is max(r / sum(r) - q, 0), materialised in a [B, V] fp32
    scratch row.
  * the bonus token is a chunked inverse-CDF scan of the residual.

Every loop has a bound known on device; nothing syncs with the host. Uniform
consumption matches the reference exactly (uniforms[b, c] for child c,
uniforms[b, T] for the bonus), so all backends agree given the same uniforms.
"""

import torch
import triton
import triton.language as tl

from ._index import index32

# Bisection steps: the keys of two fp32 values differ by < 2^32, so 33 halvings
# always reach a single key; converged steps are skipped.
_BISECT_STEPS = tl.constexpr(33)


@triton.jit
def _key(x):
    """fp32 -> int64 key with the same order (negative floats: flip the magnitude bits)."""
    bits = x.to(tl.int32, bitcast=True)
    return tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF).to(tl.int64)


@triton.jit
def _unkey(k):
    """Inverse of _key (k within the keys of two non-NaN floats)."""
    k32 = k.to(tl.int32)
    return tl.where(k32 >= 0, k32, k32 ^ 0x7FFFFFFF).to(tl.float32, bitcast=True)


@triton.jit
def _load_logits(row_ptr, offs, V):
    return tl.load(row_ptr + offs, mask=offs < V, other=float("-inf")).to(tl.float32)


@triton.jit
def _prob(x, t, mx, amax, inv_t, tau, Z, greedy):
    """p_u at token(s) t with logit(s) x: one-hot argmax if greedy, else the kept softmax."""
    e = tl.math.exp2((x - mx) * inv_t)
    soft = tl.where(x >= tau, e, 0.0) / Z
    return tl.where(greedy, (t == amax).to(tl.float32), soft)


@triton.jit
def _count_ge(row_ptr, V, thr, BLOCK_V: tl.constexpr):
    cnt = 0
    for start in range(0, V, BLOCK_V):
        x = _load_logits(row_ptr, start + tl.arange(0, BLOCK_V), V)
        cnt += tl.sum((x >= thr).to(tl.int32), 0)
    return cnt


@triton.jit
def _mass_above(row_ptr, V, thr, tau, mx, inv_t, BLOCK_V: tl.constexpr):
    """Sum of the unnormalised kept mass exp2((x - mx) * inv_t) over x > thr, x >= tau."""
    s = 0.0
    for start in range(0, V, BLOCK_V):
        x = _load_logits(row_ptr, start + tl.arange(0, BLOCK_V), V)
        e = tl.math.exp2((x - mx) * inv_t)
        s += tl.sum(tl.where((x > thr) & (x >= tau), e, 0.0), 0)
    return s


@triton.jit
def _node_dist(row_ptr, V, temp, top_k, top_p, BLOCK_V: tl.constexpr):
    """Scalars describing p_u of one logits row [V]: (mx, amax, inv_t, tau, Z, greedy, bad);
    bad: the row has a NaN or +inf or only -inf (the reference raises on such a row)."""
    mx = float("-inf")
    mn = float("inf")
    amax = 0
    n_bad = 0
    for start in range(0, V, BLOCK_V):
        offs = start + tl.arange(0, BLOCK_V)
        x = _load_logits(row_ptr, offs, V)
        n_bad += tl.sum(((x != x) | (x == float("inf"))).to(tl.int32), 0)
        cmax = tl.max(x, 0)
        carg = start + tl.argmax(x, 0, tie_break_left=True)
        amax = tl.where(cmax > mx, carg, amax)  # strict: earlier chunks win ties
        mx = tl.maximum(mx, cmax)
        mn = tl.minimum(mn, tl.min(tl.where(offs < V, x, float("inf")), 0))
    greedy = temp == 0.0
    inv_t = 1.4426950408889634 / tl.where(greedy, 1.0, temp)  # greedy: unused, kept finite
    tau = mn  # everything kept
    if (not greedy) and (top_k > 0) and (top_k < V):
        lo = _key(mn)  # count(x >= mn) = V >= top_k
        hi = _key(mx)
        for _ in range(_BISECT_STEPS):
            if lo < hi:
                mid = lo + (hi - lo + 1) // 2
                if _count_ge(row_ptr, V, _unkey(mid), BLOCK_V) >= top_k:
                    lo = mid
                else:
                    hi = mid - 1
        tau = _unkey(lo)  # the k-th largest logit
    if (not greedy) and (top_p < 1.0):
        budget = top_p * _mass_above(row_ptr, V, float("-inf"), tau, mx, inv_t, BLOCK_V)
        lo = _key(tau)
        hi = _key(mx)  # nothing lies above mx: mass 0 < budget
        for _ in range(_BISECT_STEPS):
            if lo < hi:
                mid = lo + (hi - lo) // 2
                if _mass_above(row_ptr, V, _unkey(mid), tau, mx, inv_t, BLOCK_V) < budget:
                    hi = mid
                else:
                    lo = mid + 1
        tau = _unkey(hi)
    Z = 1.0  # greedy: unused
    if not greedy:
        Z = _mass_above(row_ptr, V, float("-inf"), tau, mx, inv_t, BLOCK_V)
    return mx, amax, inv_t, tau, Z, greedy, (n_bad > 0) | (mx == float("-inf"))


@triton.jit
def _residual(
    row_ptr,
    scratch_ptr,
    offs,
    V,
    mx,
    amax,
    inv_t,
    tau,
    Z,
    greedy,
    explicit,
    rej,
    n_rej,
    HAS_DP: tl.constexpr,
):
    """The residual r at tokens offs [BLOCK_V]: the scratch row once materialised, else p_u
    with the n_rej rejected point-mass tokens rej[:n_rej] zeroed. 0 outside [0, V)."""
    ok = offs < V
    r = tl.where(
        ok, _prob(_load_logits(row_ptr, offs, V), offs, mx, amax, inv_t, tau, Z, greedy), 0.0
    )
    if HAS_DP:
        r = tl.where(explicit, tl.load(scratch_ptr + offs, mask=ok, other=0.0), r)
    else:
        slots = tl.arange(0, rej.shape[0])
        for j in range(n_rej):  # usually 0 or 1: cheaper than a [BLOCK_V, T] compare
            r = tl.where(offs == tl.sum(tl.where(slots == j, rej, 0), 0), 0.0, r)
    return r


@triton.jit
def _update_residual(
    row_ptr,
    scratch_ptr,
    q_ptr,
    V,
    sum_r,
    mx,
    amax,
    inv_t,
    tau,
    Z,
    greedy,
    explicit,
    rej,
    BLOCK_V: tl.constexpr,
):
    """scratch <- max(r / sum_r - q, 0) over [V]; returns its sum."""
    new_sum = 0.0
    for start in range(0, V, BLOCK_V):
        offs = start + tl.arange(0, BLOCK_V)
        ok = offs < V
        r = _residual(
            row_ptr, scratch_ptr, offs, V, mx, amax, inv_t, tau, Z, greedy, explicit, rej, 0, True
        )
        q = tl.load(q_ptr + offs, mask=ok, other=0.0).to(tl.float32)
        r = tl.where(ok, tl.maximum(r / sum_r - q, 0.0), 0.0)
        tl.store(scratch_ptr + offs, r, mask=ok)  # each thread rewrites only what it read
        new_sum += tl.sum(r, 0)
    tl.debug_barrier()  # later single-entry reads come from other threads
    return new_sum


@triton.jit
def _sample_residual(
    row_ptr,
    scratch_ptr,
    V,
    u,
    mx,
    amax,
    inv_t,
    tau,
    Z,
    greedy,
    explicit,
    rej,
    n_rej,
    HAS_DP: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    """Inverse CDF of r at u: the first t with cumsum(r)[t] > u * sum(r), else the last
    token with mass (u * sum rounded up to the total)."""
    total = 0.0
    for start in range(0, V, BLOCK_V):
        r = _residual(
            row_ptr,
            scratch_ptr,
            start + tl.arange(0, BLOCK_V),
            V,
            mx,
            amax,
            inv_t,
            tau,
            Z,
            greedy,
            explicit,
            rej,
            n_rej,
            HAS_DP,
        )
        total += tl.sum(r, 0)
    target = u * total
    running = 0.0
    found = V
    last = -1
    for start in range(0, V, BLOCK_V):
        offs = start + tl.arange(0, BLOCK_V)
        r = _residual(
            row_ptr,
            scratch_ptr,
            offs,
            V,
            mx,
            amax,
            inv_t,
            tau,
            Z,
            greedy,
            explicit,
            rej,
            n_rej,
            HAS_DP,
        )
        cum = running + tl.cumsum(r, 0)
        found = tl.minimum(found, tl.min(tl.where((cum > target) & (offs < V), offs, V), 0))
        last = tl.maximum(last, tl.max(tl.where(r > 0, offs, -1), 0))
        running += tl.sum(r, 0)
    return tl.where(found < V, found, last)


@triton.jit
def _rejection_kernel(
    logits_ptr,
    tokens_ptr,
    parents_ptr,
    num_nodes_ptr,
    dp_ptr,
    temp_ptr,
    top_k_ptr,
    top_p_ptr,
    unif_ptr,
    scratch_ptr,
    acc_nodes_ptr,
    num_acc_ptr,
    out_tok_ptr,
    bad_ptr,
    T,
    V,
    HAS_DP: tl.constexpr,
    T_PAD: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    n = tl.minimum(tl.maximum(tl.load(num_nodes_ptr + b), 1), T)  # unvalidated (GPU) input
    temp = tl.load(temp_ptr + b)
    top_k = tl.load(top_k_ptr + b)
    top_p = tl.load(top_p_ptr + b)
    logits_b = logits_ptr + b * T * V
    scratch = scratch_ptr + b * V
    slots = tl.arange(0, T_PAD)
    no_rej = tl.full([T_PAD], -1, tl.int32)

    u = tl.program_id(0) * 0  # current node (int32)
    mx, amax, inv_t, tau, Z, greedy, bad = _node_dist(logits_b, V, temp, top_k, top_p, BLOCK_V)
    bad_node = tl.where(bad, 0, -1)  # first visited node with a bad row
    sum_r = 1.0  # mass of the residual
    explicit = u != 0  # residual materialised in scratch (draft_probs after a rejection)
    rej = no_rej  # point-mass tokens rejected at u
    n_rej = u
    depth = u + 1  # nodes on the accepted path
    tl.store(acc_nodes_ptr + b * T, 0)
    for c in range(1, n):
        if tl.load(parents_ptr + b * T + c) == u:  # next child of the current node
            x = tl.load(tokens_ptr + b * T + c)
            # An out-of-range token (unvalidated GPU input) is never read, and never accepted.
            x_ok = (x >= 0) & (x < V)
            x = tl.where(x_ok, x, 0)
            row_u = logits_b + u.to(tl.int64) * V
            r_x = _prob(tl.load(row_u + x).to(tl.float32), x, mx, amax, inv_t, tau, Z, greedy)
            if HAS_DP:
                q_row = dp_ptr + (b * T + u) * V
                q_x = tl.load(q_row + x).to(tl.float32)
                r_x = tl.where(explicit, tl.load(scratch + x), r_x)
            else:
                q_x = 1.0
                r_x = tl.where(tl.sum((rej == x).to(tl.int32), 0) > 0, 0.0, r_x)
            r_x = tl.where(x_ok, r_x, 0.0)
            if tl.load(unif_ptr + b * (T + 1) + c) * q_x * sum_r < r_x:  # accept c
                tl.store(acc_nodes_ptr + b * T + depth, c)
                tl.store(out_tok_ptr + b * T + depth - 1, x)
                depth += 1
                u = c + u * 0
                mx, amax, inv_t, tau, Z, greedy, bad = _node_dist(
                    logits_b + u.to(tl.int64) * V, V, temp, top_k, top_p, BLOCK_V
                )
                bad_node = tl.where(bad & (bad_node < 0), u, bad_node)
                sum_r = 1.0
                explicit = u < 0
                rej = no_rej
                n_rej = u * 0
            else:
                if HAS_DP:
                    sum_r = _update_residual(
                        row_u,
                        scratch,
                        q_row,
                        V,
                        sum_r,
                        mx,
                        amax,
                        inv_t,
                        tau,
                        Z,
                        greedy,
                        explicit,
                        rej,
                        BLOCK_V,
                    )
                    explicit = sum_r > 0
                elif r_x > 0:
                    rej = tl.where(slots == n_rej, x, rej)
                    n_rej += 1
                    sum_r -= r_x
                if not sum_r > 0:  # all mass lost (inconsistent drafts / rounding): back to p_u
                    sum_r = 1.0
                    explicit = u < 0
                    rej = no_rej
                    n_rej = u * 0
    row_u = logits_b + u.to(tl.int64) * V
    bonus = _sample_residual(
        row_u,
        scratch,
        V,
        tl.load(unif_ptr + b * (T + 1) + T),
        mx,
        amax,
        inv_t,
        tau,
        Z,
        greedy,
        explicit,
        rej,
        n_rej,
        HAS_DP,
        BLOCK_V,
    )
    tl.store(out_tok_ptr + b * T + depth - 1, bonus)
    tl.store(num_acc_ptr + b, depth - 1)
    tl.store(bad_ptr + b, bad_node)


@torch.library.custom_op("specdec_triton::tree_rejection_sample", mutates_args=())
def tree_rejection_sample(
    target_logits: torch.Tensor,
    draft_tokens: torch.Tensor,
    parents: torch.Tensor,
    num_nodes: torch.Tensor,
    draft_probs: torch.Tensor | None,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    uniforms: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """target_logits: [B, T, V]; draft_tokens, parents: int [B, T]; num_nodes: int [B];
    draft_probs: [B, T, V] or None; temperature, top_p: float [B]; top_k: int [B];
    uniforms: float [B, T + 1]  ->  (accepted_nodes int32 [B, T], num_accepted int32 [B],
    output_tokens int32 [B, T]), -1 padded.

    A custom op, so torch.compile treats the launch as one opaque call."""
    B, T, V = target_logits.shape
    dev = target_logits.device
    i32 = index32
    f32 = lambda t: t.to(torch.float32).contiguous()  # noqa: E731
    accepted = torch.full((B, T), -1, dtype=torch.int32, device=dev)
    out_tokens = torch.full((B, T), -1, dtype=torch.int32, device=dev)
    num_accepted = torch.empty(B, dtype=torch.int32, device=dev)
    bad_node = torch.empty(B, dtype=torch.int32, device=dev)
    has_dp = draft_probs is not None
    dp = draft_probs.contiguous() if has_dp else target_logits
    scratch = torch.empty(B if has_dp else 1, V, dtype=torch.float32, device=dev)
    block_v = min(triton.next_power_of_2(V), 4096 if dev.type == "cuda" else 1024)
    _rejection_kernel[(B,)](
        target_logits.contiguous(),
        i32(draft_tokens),
        i32(parents),
        i32(num_nodes),
        dp,
        f32(temperature),
        i32(top_k),
        f32(top_p),
        f32(uniforms),
        scratch,
        accepted,
        num_accepted,
        out_tokens,
        bad_node,
        T,
        V,
        HAS_DP=has_dp,
        T_PAD=triton.next_power_of_2(T),
        BLOCK_V=block_v,
        num_warps=8,
    )
    if _check_values(dev):
        _raise_on_bad_rows(bad_node)
    return accepted, num_accepted, out_tokens


@tree_rejection_sample.register_fake
def _(
    target_logits,
    draft_tokens,
    parents,
    num_nodes,
    draft_probs,
    temperature,
    top_k,
    top_p,
    uniforms,
):
    B, T, _ = target_logits.shape
    new = lambda *shape: target_logits.new_empty(shape, dtype=torch.int32)  # noqa: E731
    return new(B, T), new(B), new(B, T)


def _check_values(device):
    """Like the C++ checks: value checks always on CPU, on CUDA only with SPECDEC_VALIDATE=1
    (they sync with the host)."""
    from .._library import value_checks_run  # the process-wide flag C++ reads too

    return value_checks_run(device)


def _raise_on_bad_rows(bad_node):
    """bad_node int32 [B]: first visited node of each request whose logits row is bad, or -1."""
    bad = bad_node.cpu()
    for b in range(bad.shape[0]):
        if int(bad[b]) >= 0:
            raise RuntimeError(
                f"target_logits[{b}, {int(bad[b])}] has NaN, +inf or only -inf "
                "entries (a row the rejection walk visits must have a finite "
                "maximum)"
            )
