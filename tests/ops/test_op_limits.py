"""Regression tests for the limits of the ops (docs/ops.md, Bad input), on every backend.

Each case once crashed, wrote out of bounds, silently truncated or returned NaN:
  1. compact_kv on a cache with block_size 0 died of SIGFPE;
  2. positions near 2^31 overflowed int32 inside the kernels (compact_kv wrote before k_cache);
  3. int64 index values past int32 were narrowed before the checks (2^32 became 0);
  4. a finite but huge sm_scale overflowed the float32 scores to NaN;
  5. the CUDA launchers divided by a zero size (Hq = 0), refused batches and layer counts past
     gridDim.y / z's 65535 and head dims past 256.
Cases that could crash the interpreter run in a subprocess.
"""

import os
import subprocess
import sys
import textwrap

import pytest
import torch

import specdec_kernels as sk
from specdec_kernels import reference
from specdec_kernels.testing import value_checks_run

INT32_MAX = 2**31 - 1


def _needs_value_checks(device):
    if not value_checks_run(device):
        pytest.skip("value checks on CUDA tensors run only with SPECDEC_VALIDATE=1 (documented)")


def run_isolated(code, timeout=120):
    """Runs `code` in a fresh interpreter: a crash (signal) is a failed test, not a dead run.
    It runs in this folder, so `python -c` (which puts its working directory first on sys.path)
    imports the installed package, not a checkout's specdec_kernels without its library."""
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        cwd=os.path.dirname(os.path.abspath(__file__)),
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert proc.returncode >= 0, f"killed by signal {-proc.returncode}:\n{proc.stderr[-2000:]}"
    return proc


# ---------------------------------------------------------------- 1. block_size 0
@pytest.mark.parametrize("backend_name", ["cpp", "triton", "reference"])
@pytest.mark.parametrize("layers", [None, 2])
def test_compact_kv_rejects_block_size_zero(backend_name, layers, device):
    if backend_name == "triton":
        pytest.importorskip("triton")
    shape = (4, 0, 2, 8) if layers is None else (layers, 4, 0, 2, 8)
    proc = run_isolated(f"""
        import os, torch, specdec_kernels as sk
        dev = "{device}"
        k = torch.randn({shape}, device=dev); v = torch.randn({shape}, device=dev)
        i32 = dict(dtype=torch.int32, device=dev)
        try:
            sk.compact_kv(k, v, torch.zeros(1, 4, **i32), torch.tensor([3], **i32),
                          torch.tensor([[0, 2, -1]], **i32), torch.tensor([1], **i32),
                          backend="{backend_name}")
        except RuntimeError as e:
            print("RuntimeError:", e)
        else:
            print("no error")
    """)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "RuntimeError:" in proc.stdout and "block_size >= 1" in proc.stdout, proc.stdout


def test_tree_verify_rejects_block_size_zero(device, backend):
    q = torch.randn(1, 2, 2, 8, device=device)
    k = torch.randn(4, 0, 2, 8, device=device)
    tree_mask, _ = sk.build_tree_mask(
        torch.tensor([[-1, 0]], dtype=torch.int32), torch.tensor([2], dtype=torch.int32)
    )
    i32 = dict(dtype=torch.int32, device=device)
    with pytest.raises(RuntimeError, match="block_size >= 1"):
        sk.tree_verify(
            q,
            k,
            k.clone(),
            torch.zeros(1, 4, **i32),
            torch.tensor([3], **i32),
            torch.tensor([2], **i32),
            tree_mask.to(device),
            backend=backend,
        )


# ---------------------------------------------------------------- 2. positions near 2^31
def _huge_position_cache(device, block_size=2**20, num_blocks=2, positions=2**31 + 2**20):
    """A cache whose block table row owns `positions` logical positions (all mapped to block 0
    or 1): enough to address positions past 2^31 - 1 with a few MB of memory."""
    max_blocks = -(-positions // block_size)
    k = torch.randn(num_blocks, block_size, 1, 1, device=device)
    table = (torch.arange(max_blocks, dtype=torch.int32) % num_blocks).unsqueeze(0)
    return k, k.clone(), table.to(device)


@pytest.mark.parametrize("cache_len", [INT32_MAX, INT32_MAX - 1])  # path [0, 2]: 2^31 + 1, 2^31
def test_compact_kv_rejects_positions_past_int32(cache_len, device, backend):
    _needs_value_checks(device)
    k, v, table = _huge_position_cache(device)
    k0, v0 = k.clone(), v.clone()
    i32 = dict(dtype=torch.int32, device=device)
    with pytest.raises(
        RuntimeError,
        match=r"cache_lens \+ accepted_nodes of request 0 reaches "
        r"position \d+, beyond the largest supported position",
    ):
        sk.compact_kv(
            k,
            v,
            table,
            torch.tensor([cache_len], **i32),
            torch.tensor([[0, 2, -1]], **i32),
            torch.tensor([1], **i32),
            backend=backend,
        )
    assert torch.equal(k, k0) and torch.equal(v, v0)  # nothing was written


def test_compact_kv_at_the_largest_position(device, backend):
    """The last valid position (2^31 - 1) is moved correctly: index math is 64-bit."""
    k, v, table = _huge_position_cache(device)
    cache_len = INT32_MAX - 2  # path [0, 2]: moves position 2^31 - 1 to 2^31 - 2
    i32 = dict(dtype=torch.int32, device=device)
    args = (
        table,
        torch.tensor([cache_len], **i32),
        torch.tensor([[0, 2, -1]], **i32),
        torch.tensor([1], **i32),
    )
    want_k, want_v = k.clone(), v.clone()
    reference.compact_kv(want_k, want_v, *args)
    sk.compact_kv(k, v, *args, backend=backend)
    assert torch.equal(k, want_k) and torch.equal(v, want_v)
    bs = k.shape[1]
    src, dst = INT32_MAX % bs, (INT32_MAX - 1) % bs  # both in block (2^31 - 1) // bs
    assert torch.equal(
        k[int(table[0, INT32_MAX // bs]), dst], k[int(table[0, INT32_MAX // bs]), src]
    )


def test_tree_verify_rejects_positions_past_int32(device, backend):
    _needs_value_checks(device)
    k, v, table = _huge_position_cache(device)
    parents = torch.tensor([[-1, 0, 1]], dtype=torch.int32)
    num_nodes = torch.tensor([3], dtype=torch.int32)
    tree_mask, _ = sk.build_tree_mask(parents, num_nodes)
    q = torch.randn(1, 3, 1, 1, device=device)
    i32 = dict(dtype=torch.int32, device=device)
    with pytest.raises(
        RuntimeError,
        match=r"cache_lens \+ num_nodes of request 0 reaches "
        r"position 2147483648",
    ):
        sk.tree_verify(
            q,
            k,
            v,
            table,
            torch.tensor([INT32_MAX - 1], **i32),
            num_nodes.to(device),
            tree_mask.to(device),
            backend=backend,
        )


# ---------------------------------------------------------------- 3. no silent narrowing
def _tree_problem(device, B=2, T=4, V=11):
    parents = torch.tensor([[-1, 0, 1, 1], [-1, 0, 0, 2]], dtype=torch.int64, device=device)
    num_nodes = torch.tensor([4, 4], dtype=torch.int64, device=device)
    return {
        "target_logits": torch.randn(B, T, V, device=device),
        "draft_tokens": torch.randint(0, V, (B, T), device=device),
        "parents": parents,
        "num_nodes": num_nodes,
        "draft_probs": None,
        "temperature": torch.tensor([0.0, 0.7], device=device),
        "top_k": torch.tensor([0, 5], device=device),
        "top_p": torch.tensor([1.0, 0.9], device=device),
        "uniforms": torch.rand(B, T + 1, device=device),
    }


WIDE = [  # (argument, index, value past int32, what the error names)
    ("parents", (0, 2), 2**32, r"parents\[0, 2\] = 4294967296"),
    ("parents", (1, 3), -(2**32) + 1, r"parents\[1, 3\] = -4294967295"),
    ("draft_tokens", (0, 1), 2**32 + 1, r"draft_tokens\[0, 1\] = 4294967297"),
    ("top_k", (1,), 2**32 + 1, r"top_k\[1\] = 4294967297"),
    ("num_nodes", (0,), 2**32 + 1, r"num_nodes\[0\] = 4294967297"),
]


@pytest.mark.parametrize("name, index, value, match", WIDE, ids=[f"{w[0]}{w[1]}" for w in WIDE])
def test_rejection_sample_checks_int64_before_narrowing(name, index, value, match, device, backend):
    _needs_value_checks(device)
    p = _tree_problem(device)
    p[name][index] = value
    with pytest.raises(RuntimeError, match=match):
        sk.tree_rejection_sample(**p, backend=backend)


@pytest.mark.parametrize(
    "name, match",
    [("parents", r"parents\[0, 3\] = 4294967297"), ("num_nodes", r"num_nodes\[1\] = 4294967300")],
)
def test_build_tree_mask_checks_int64_before_narrowing(name, match, device, backend):
    _needs_value_checks(device)
    parents = torch.tensor([[-1, 0, 1, 1], [-1, 0, 0, 2]], device=device)
    num_nodes = torch.tensor([4, 4], device=device)
    if name == "parents":
        parents[0, 3] = 2**32 + 1  # would wrap to 1, a valid parent
    else:
        num_nodes[1] = 2**32 + 4  # would wrap to 4, a valid count
    with pytest.raises(RuntimeError, match=match):
        sk.build_tree_mask(parents, num_nodes, backend=backend)


def _verify_problem(device, T=3):
    k = torch.randn(8, 4, 1, 8, device=device)
    parents = torch.tensor([[-1, 0, 1]], device=device)
    num_nodes = torch.tensor([T], device=device)
    tree_mask, _ = sk.build_tree_mask(parents, num_nodes)
    return {
        "q": torch.randn(1, T, 2, 8, device=device),
        "k_cache": k,
        "v_cache": k.clone(),
        "block_table": torch.arange(8, device=device).unsqueeze(0),
        "cache_lens": torch.tensor([5], device=device),
        "num_nodes": num_nodes,
        "tree_mask": tree_mask,
    }


@pytest.mark.parametrize(
    "name, index, value, match",
    [
        ("cache_lens", (0,), 2**32 + 5, r"cache_lens\[0\] = 4294967301"),
        ("block_table", (0, 1), 2**32 + 1, r"block_table\[0, 1\] = 4294967297"),
        ("num_nodes", (0,), 2**32 + 3, r"num_nodes\[0\] = 4294967299"),
    ],
)
def test_tree_verify_checks_int64_before_narrowing(name, index, value, match, device, backend):
    _needs_value_checks(device)
    p = _verify_problem(device)
    p[name][index] = value
    with pytest.raises(RuntimeError, match=match):
        sk.tree_verify(**p, backend=backend)


@pytest.mark.parametrize(
    "name, index, value, match",
    [
        ("cache_lens", (0,), 2**32 + 1, r"cache_lens\[0\] = 4294967297"),
        ("block_table", (0, 0), 2**32, r"block_table\[0, 0\] = 4294967296"),
        ("accepted_nodes", (0, 1), 2**32 + 2, r"accepted_nodes\[0, 1\] = 4294967298"),
        ("num_accepted", (0,), 2**32 + 1, r"num_accepted\[0\] = 4294967297"),
    ],
)
def test_compact_kv_checks_int64_before_narrowing(name, index, value, match, device, backend):
    _needs_value_checks(device)
    k = torch.randn(2, 8, 4, 2, 8, device=device)
    p = {
        "k_cache": k,
        "v_cache": k.clone(),
        "block_table": torch.arange(8, device=device).unsqueeze(0),
        "cache_lens": torch.tensor([3], device=device),
        "accepted_nodes": torch.tensor([[0, 2, -1]], device=device),
        "num_accepted": torch.tensor([1], device=device),
    }
    p[name][index] = value
    with pytest.raises(RuntimeError, match=match):
        sk.compact_kv(**p, backend=backend)


def test_narrowing_saturates():
    """Where values are not checked (CUDA), an int64 value past int32 saturates to an
    out-of-range value (which every kernel bounds) instead of wrapping to a valid one."""
    from specdec_kernels.triton._index import index32  # plain torch: no triton needed

    wide = torch.tensor([2**32, 2**32 + 1, -(2**32), 5, -1], dtype=torch.int64)
    assert index32(wide).tolist() == [INT32_MAX, INT32_MAX, -(2**31), 5, -1]
    assert index32(wide).dtype == torch.int32


# ---------------------------------------------------------------- 4. sm_scale
@pytest.mark.parametrize(
    "sm_scale", [1e39, 1e300, -1e39, 65536.0 * 1.0001, float("inf"), float("nan")]
)
def test_tree_verify_rejects_sm_scale_out_of_range(sm_scale, device, backend):
    p = _verify_problem(device)
    with pytest.raises(RuntimeError, match=r"sm_scale must be finite with \|sm_scale\| <= 65536"):
        sk.tree_verify(**p, sm_scale=sm_scale, backend=backend)


@pytest.mark.parametrize("sm_scale", [65536.0, -65536.0, 1e-30, 0.0])
def test_tree_verify_extreme_sm_scale_matches_reference(sm_scale, device, backend):
    """At the edges of the accepted range the output is finite and equals the float64
    reference (q is scaled down so that the scores stay in an ordinary range)."""
    p = _verify_problem(device)
    if abs(sm_scale) > 1:
        p["q"] = p["q"] / abs(sm_scale)
    got = sk.tree_verify(**p, sm_scale=sm_scale, backend=backend)
    want = reference.tree_verify(
        *(
            p[k].double() if k in ("q", "k_cache", "v_cache") else p[k]
            for k in (
                "q",
                "k_cache",
                "v_cache",
                "block_table",
                "cache_lens",
                "num_nodes",
                "tree_mask",
            )
        ),
        sm_scale,
    )
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got.double().cpu(), want.cpu(), rtol=1e-4, atol=1e-4)


# ---------------------------------------------------------------- 5. zero sizes, grid limits
# Shapes the checks accept that once broke the CUDA launchers: a zero-sized dimension made a
# grid dimension 0 or a divisor 0, and the batch or the layers sat on gridDim.y / z (<= 65535).
@pytest.mark.parametrize("backend", ["cpp", "reference"])  # Triton: ZeroDivisionError (open)
def test_tree_verify_zero_query_heads(device, backend):
    """q [B, T, 0, D] passes the checks (0 is a multiple of Hkv): an empty output, as on CPU.
    In a subprocess: the CUDA launcher once divided by group_size = 0 (SIGFPE)."""
    proc = run_isolated(f"""
        import torch, specdec_kernels as sk
        dev = "{device}"
        i32 = dict(dtype=torch.int32, device=dev)
        q = torch.randn(1, 2, 0, 8, device=dev)
        k = torch.randn(2, 4, 1, 8, device=dev)
        mask = torch.tensor([[[1], [3]]], dtype=torch.int64, device=dev)
        out = sk.tree_verify(q, k, torch.randn_like(k), torch.zeros(1, 2, **i32),
                             torch.tensor([3], **i32), torch.tensor([2], **i32), mask,
                             backend="{backend}")
        assert out.shape == (1, 2, 0, 8) and out.dtype == q.dtype, (out.shape, out.dtype)
        assert out.device == q.device, out.device
        print("empty output")
    """)
    assert "empty output" in proc.stdout, proc.stderr[-2000:]


def _verify_against_reference(B, T, Hq, Hkv, D, block_size, cache_lens, device, backend, tol):
    """Random chain trees of T nodes (the last request's tree one node short, so a row is
    padding) over a paged cache; the output against the float64 reference."""
    num_nodes = torch.full((B,), T, dtype=torch.int32)
    num_nodes[-1] = max(T - 1, 1)
    parents = torch.arange(-1, T - 1, dtype=torch.int32).expand(B, T).contiguous()
    tree_mask, _ = reference.build_tree_mask(parents, num_nodes)
    cache_lens = torch.as_tensor(cache_lens, dtype=torch.int32)
    max_blocks = (int((cache_lens + num_nodes).max()) + block_size - 1) // block_size
    num_blocks = B * max_blocks
    block_table = torch.randperm(num_blocks, dtype=torch.int32).view(B, max_blocks)
    p = {
        "q": torch.randn(B, T, Hq, D),
        "k_cache": torch.randn(num_blocks, block_size, Hkv, D),
        "v_cache": torch.randn(num_blocks, block_size, Hkv, D),
        "block_table": block_table,
        "cache_lens": cache_lens,
        "num_nodes": num_nodes,
        "tree_mask": tree_mask,
        "sm_scale": D**-0.5,
    }
    want = reference.tree_verify(
        *(p[k].double() if k in ("q", "k_cache", "v_cache") else p[k] for k in p)
    )
    got = sk.tree_verify(
        **{k: v.to(device) if torch.is_tensor(v) else v for k, v in p.items()}, backend=backend
    )
    assert got.shape == (B, T, Hq, D) and got.device.type == device.type
    torch.testing.assert_close(got.double().cpu(), want, rtol=tol, atol=tol)


@pytest.mark.parametrize("T, D", [(3, 512), (20, 300), (3, 513), (20, 1000)])
def test_tree_verify_head_dims_past_256(T, D, device):
    """Any head dim works in the C++ kernels, as the checks, the CPU kernel and the reference
    allow: on CUDA, D <= 512 takes the tiled kernel's widest instantiation (T = 20: 40 query
    rows per KV head, more than one row tile), larger D the generic kernel. Contexts of many
    key tiles (several splits on a GPU), one of them empty; GQA groups of 2."""
    _verify_against_reference(3, T, 4, 2, D, 16, [700, 45, 0], device, "cpp", 1e-4)


def test_tree_verify_batch_past_65535(device):
    """A batch past gridDim.y / z's 65535 (the CUDA kernel once had the batch on gridDim.z and
    refused it). C++ backend only: 65536 Triton programs are too slow under TRITON_INTERPRET."""
    B = 65536 + 3
    cache_lens = torch.randint(0, 6, (B,))
    _verify_against_reference(B, 1, 2, 1, 8, 4, cache_lens, device, "cpp", 1e-4)


def test_compact_kv_layers_past_65535(device):
    """More layers than gridDim.y's 65535 (the CUDA kernel once refused them): every layer's
    path is moved. Tiny rows keep the cache small; C++ backend against the reference."""
    L = 65535 + 2
    k = torch.randn(L, 2, 4, 1, 2, device=device)
    v = torch.randn(L, 2, 4, 1, 2, device=device)
    i32 = dict(dtype=torch.int32, device=device)
    args = (
        torch.tensor([[1, 0]], **i32),
        torch.tensor([1], **i32),
        torch.tensor([[0, 2, 3, -1]], **i32),
        torch.tensor([2], **i32),
    )
    want_k, want_v = k.clone(), v.clone()
    sk.compact_kv(want_k, want_v, *args, backend="reference")
    assert not torch.equal(want_k[-1], k[-1])  # the last layer has something to move
    sk.compact_kv(k, v, *args, backend="cpp")
    assert torch.equal(k, want_k) and torch.equal(v, want_v)
