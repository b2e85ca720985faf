"""compact_kv (cpp and triton backends) against the reference, plus an independent oracle.

compact_kv is a pure move, so results are compared bitwise: the kernel runs on the
native dtype, the reference on float64 copies (exact for fp32 / fp16 / bf16).
"""

import pytest
import torch

import specdec_kernels as sk
from specdec_kernels import reference
from specdec_kernels.testing import random_block_table, random_root_paths
from specdec_kernels.testing import value_checks_run as _value_checks_run

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def make_problem(
    B=3, T=7, L=None, dtype=torch.float32, block_size=4, Hkv=2, D=8, blocks_per_seq=6, device="cpu"
):
    """Random paged caches ([NB, bs, Hkv, D], or [L, NB, bs, Hkv, D] when L is given) with
    spare blocks, random cache_lens leaving room for the T tree nodes, random root paths."""
    num_blocks = B * blocks_per_seq + 3
    shape = (num_blocks, block_size, Hkv, D) if L is None else (L, num_blocks, block_size, Hkv, D)
    capacity = blocks_per_seq * block_size
    return {
        "k_cache": torch.randn(shape).to(dtype).to(device),
        "v_cache": torch.randn(shape).to(dtype).to(device),
        "block_table": random_block_table(B, blocks_per_seq, num_blocks).to(device),
        "cache_lens": torch.randint(0, capacity - T + 1, (B,), dtype=torch.int32).to(device),
        **dict(
            zip(("accepted_nodes", "num_accepted"), (t.to(device) for t in random_root_paths(B, T)))
        ),
    }


ARG_ORDER = ("k_cache", "v_cache", "block_table", "cache_lens", "accepted_nodes", "num_accepted")


def op_args(p):
    return tuple(p[name] for name in ARG_ORDER)


def run_kernel(p, backend):
    """Runs the kernel on clones; returns (k_cache, v_cache) after the move."""
    k, v = p["k_cache"].clone(), p["v_cache"].clone()
    sk.compact_kv(k, v, *op_args(p)[2:], backend=backend)
    return k, v


def run_reference(p):
    k, v = p["k_cache"].cpu().double(), p["v_cache"].cpu().double()
    rest = [t.cpu() for t in op_args(p)[2:]]
    reference.compact_kv(k, v, *rest)
    return k, v


def check_against_reference(p, backend):
    k, v = run_kernel(p, backend)
    want_k, want_v = run_reference(p)
    assert k.dtype == p["k_cache"].dtype and k.shape == p["k_cache"].shape
    assert torch.equal(k.cpu().double(), want_k)  # whole caches: untouched rows included
    assert torch.equal(v.cpu().double(), want_v)
    return k, v


def slot(p, b, pos):
    """(block, offset) of logical position pos of request b."""
    bs = p["k_cache"].shape[-3]
    return int(p["block_table"][b, pos // bs]), pos % bs


def expected_by_hand(p, cache):
    """Independent oracle: destination slots get their source rows, all other slots unchanged."""
    src_cache = cache if cache.dim() == 5 else cache.unsqueeze(0)
    out = src_cache.clone()
    for b in range(p["block_table"].shape[0]):
        c = int(p["cache_lens"][b])
        for k in range(int(p["num_accepted"][b]) + 1):
            sb, so = slot(p, b, c + int(p["accepted_nodes"][b, k]))
            db, do = slot(p, b, c + k)
            out[:, db, do] = src_cache[:, sb, so]  # sources are read from the original cache
    return out.view_as(cache)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("L", [None, 3], ids=["4d", "5d_L3"])
def test_matches_reference(L, dtype, device, backend):
    p = make_problem(B=4, T=7, L=L, dtype=dtype, device=device)
    k, v = check_against_reference(p, backend)
    assert torch.equal(k, expected_by_hand(p, p["k_cache"]))
    assert torch.equal(v, expected_by_hand(p, p["v_cache"]))


def test_overlapping_move(device, backend):
    """accepted [0, 2, 3]: 2 -> 1 and 3 -> 2, where 2 is both a source and a destination."""
    p = make_problem(B=2, T=6, L=2, device=device)
    p["accepted_nodes"][0, :3] = torch.tensor([0, 2, 3], dtype=torch.int32)
    p["num_accepted"][0] = 2
    k, v = check_against_reference(p, backend)
    c = int(p["cache_lens"][0])
    for new, old in ((k, p["k_cache"]), (v, p["v_cache"])):
        rows = lambda cache, pos: cache[(slice(None),) + slot(p, 0, c + pos)]  # noqa: E731
        assert torch.equal(rows(new, 0), rows(old, 0))  # the root stays
        assert torch.equal(rows(new, 1), rows(old, 2))
        assert torch.equal(rows(new, 2), rows(old, 3))
        assert torch.equal(rows(new, 3), rows(old, 3))  # the last source is left as it was


def test_nothing_accepted_is_a_no_op(device, backend):
    p = make_problem(B=3, T=5, L=2, dtype=torch.float16, device=device)
    p["num_accepted"].zero_()
    p["accepted_nodes"][:, 0] = 0
    k, v = check_against_reference(p, backend)
    assert torch.equal(k, p["k_cache"]) and torch.equal(v, p["v_cache"])


def test_long_paths_across_blocks(device, backend):
    """Whole-tree chains (every node accepted but the padding) spanning several blocks."""
    p = make_problem(
        B=2,
        T=20,
        L=2,
        dtype=torch.bfloat16,
        block_size=3,
        Hkv=3,
        D=5,
        blocks_per_seq=12,
        device=device,
    )
    p["accepted_nodes"] = torch.arange(20, dtype=torch.int32).repeat(2, 1).to(device)
    p["accepted_nodes"][1, 5:] = p["accepted_nodes"][1, 5:] + 1  # skips node 5 ...
    p["num_accepted"] = torch.tensor([19, 18], dtype=torch.int32, device=device)  # ... ends at 19
    check_against_reference(p, backend)


def test_int64_indices_and_wide_rows(device, backend):
    """int64 index tensors; a row (Hkv * D = 1200 elements) wider than one Triton block."""
    p = make_problem(B=2, T=6, dtype=torch.float32, Hkv=3, D=400, device=device)
    for name in ("block_table", "cache_lens", "accepted_nodes", "num_accepted"):
        p[name] = p[name].long()
    check_against_reference(p, backend)


def _set(name, index, value):
    def edit(p):
        p[name][index] = value

    return edit


VALUE_CASES = [
    ("root_not_first", _set("accepted_nodes", (1, 0), 2), r"accepted_nodes\[1, 0\] must be 0"),
    (
        "non_increasing",
        lambda p: (
            p["accepted_nodes"][0, :3].copy_(torch.tensor([0, 3, 3])),
            p["num_accepted"][0].fill_(2),
        ),
        r"accepted_nodes\[0, 2\] = 3 is not a valid root path",
    ),
    (
        "node_beyond_T",
        lambda p: p["accepted_nodes"][0, :2].copy_(torch.tensor([0, 7])),
        r"accepted_nodes\[0, 1\] = 7 is not a valid root path",
    ),
    (
        "num_accepted_negative",
        _set("num_accepted", 2, -1),
        r"num_accepted\[2\] = -1 is out of range",
    ),
    ("num_accepted_T", _set("num_accepted", 0, 7), r"num_accepted\[0\] = 7 is out of range"),
    ("negative_cache_len", _set("cache_lens", 1, -2), r"cache_lens\[1\] = -2 must be >= 0"),
    (
        "block_out_of_range",
        lambda p: p["block_table"][0].fill_(10_000),
        r"block_table\[0, \d+\] = 10000",
    ),
    ("path_beyond_table", _set("cache_lens", 0, 6 * 4 - 1), r"block_table row owns"),
]


@pytest.mark.parametrize("case, edit, match", VALUE_CASES, ids=[c[0] for c in VALUE_CASES])
def test_bad_values(case, edit, match, device, backend):
    if not _value_checks_run(device):
        pytest.skip("value checks on CUDA tensors run only with SPECDEC_VALIDATE=1 (documented)")
    p = make_problem(B=3, T=7, device=device)
    p["accepted_nodes"][:, :2] = torch.tensor([0, 1], dtype=torch.int32)  # a path of length >= 2
    p["num_accepted"] = torch.ones(3, dtype=torch.int32, device=device)
    edit(p)
    with pytest.raises(RuntimeError, match=match):
        run_kernel(p, backend)


def _shifted_heads(p):
    """K = heads 0-1 and V = heads 1-2 of one [..., 3, D] tensor: V's head 0 is K's head 1."""
    x = torch.cat([p["k_cache"], p["k_cache"][..., :1, :]], -2)
    p.update(k_cache=x[..., :2, :], v_cache=x[..., 1:, :])


SHAPE_CASES = [
    ("kv_shape", lambda p: p.update(v_cache=p["v_cache"][:, :2].contiguous()), r"v_cache shape"),
    ("kv_dtype", lambda p: p.update(v_cache=p["v_cache"].half()), r"v_cache dtype"),
    (
        "cache_rank",
        lambda p: p.update(k_cache=p["k_cache"][0, 0], v_cache=p["v_cache"][0, 0]),
        r"k_cache must be \[num_blocks, block_size, Hkv, D\]",
    ),
    (  # any other strides are fine (test_layouts.py)
        "strided_last_dim",
        lambda p: p.update(k_cache=torch.cat([p["k_cache"], p["k_cache"]], -1)[..., ::2]),
        r"k_cache must have a contiguous last dimension",
    ),
    (  # a broadcast head: one element under two indices
        "self_overlapping",
        lambda p: p.update(v_cache=p["v_cache"][..., :1, :].expand_as(p["v_cache"])),
        r"v_cache must not overlap itself",
    ),
    ("kv_overlap", lambda p: _shifted_heads(p), r"k_cache and v_cache overlap in memory"),
    ("same_tensor", lambda p: p.update(v_cache=p["k_cache"]), r"must be different tensors"),
    (
        "block_table_dtype",
        lambda p: p.update(block_table=p["block_table"].float()),
        r"block_table must be an int32 or int64",
    ),
    (
        "cache_lens_dtype",
        lambda p: p.update(cache_lens=p["cache_lens"].float()),
        r"cache_lens must be an int32 or int64",
    ),
    (
        "accepted_dtype",
        lambda p: p.update(accepted_nodes=p["accepted_nodes"].to(torch.int16)),
        r"accepted_nodes must be an int32 or int64",
    ),
    (
        "num_accepted_dtype",
        lambda p: p.update(num_accepted=p["num_accepted"].float()),
        r"num_accepted must be an int32 or int64",
    ),
    (
        "accepted_rank",
        lambda p: p.update(accepted_nodes=p["accepted_nodes"][0]),
        r"accepted_nodes must have 2 dimensions",
    ),
    ("cache_lens_B", lambda p: p.update(cache_lens=p["cache_lens"][:2]), r"cache_lens.size\(0\)"),
    (
        "num_accepted_B",
        lambda p: p.update(num_accepted=p["num_accepted"][:2]),
        r"num_accepted.size\(0\)",
    ),
]


@pytest.mark.parametrize("case, edit, match", SHAPE_CASES, ids=[c[0] for c in SHAPE_CASES])
def test_bad_shapes_and_dtypes(case, edit, match, device, backend):
    p = make_problem(B=3, T=7, L=2, device=device)
    edit(p)
    with pytest.raises(RuntimeError, match=match):
        sk.compact_kv(*op_args(p), backend=backend)


def _op(backend):
    """The registered op of a backend (the Triton kernels are custom ops of their own)."""
    if backend == "triton":
        import specdec_kernels.triton  # noqa: F401  (registers torch.ops.specdec_triton)

        return torch.ops.specdec_triton.compact_kv
    return torch.ops.specdec.compact_kv


def test_opcheck(device, backend):
    p = make_problem(B=3, T=7, L=2, dtype=torch.float16, device=device)
    torch.library.opcheck(_op(backend), op_args(p))


def test_torch_compile_fullgraph(device, backend):
    p = make_problem(B=3, T=7, L=2, device=device)

    @torch.compile(fullgraph=True)
    def step(k_cache, v_cache, block_table, cache_lens, accepted_nodes, num_accepted):
        sk.compact_kv(
            k_cache, v_cache, block_table, cache_lens, accepted_nodes, num_accepted, backend=backend
        )
        return k_cache * 2.0, v_cache + 1.0  # reads after the in-place move must see it

    k, v = p["k_cache"].clone(), p["v_cache"].clone()
    got_k, got_v = step(k, v, *op_args(p)[2:])
    want_k, want_v = (t.to(device, k.dtype) for t in run_reference(p))
    assert torch.equal(k, want_k) and torch.equal(v, want_v)
    assert torch.equal(got_k, want_k * 2.0)
    torch.testing.assert_close(got_v, want_v + 1.0)
