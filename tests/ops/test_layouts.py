"""tree_verify and compact_kv on each engine's real KV-cache layout, read through strides.

Every layout is built the way its engine allocates it (one joint tensor or separate ones,
NHD or HND pages, a token pool, the transformers cache), filled with random data, and
passed to the ops as the logical [num_blocks, block_size, Hkv, D] view (with a leading
layer dim for compact_kv). The oracle is the float64 reference on contiguous copies.
q is a slice of a fused QKV projection output (not contiguous). Memory nobody owns is
NaN, so a kernel that reads through the wrong strides shows up as NaN or a mismatch.
"""

import importlib.util

import pytest
import torch

import specdec_kernels as sk
from specdec_kernels import reference
from specdec_kernels.testing import (
    KV_LAYOUTS,
    kv_layout,
    random_block_table,
    random_root_paths,
    random_trees,
)

HAVE_TRITON = importlib.util.find_spec("triton") is not None
TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}  # atol = rtol, as in test_tree_verify.py


def _backends():
    out = ["cpp", "reference"]
    if HAVE_TRITON:
        out.insert(1, "triton")
    return out


def _geometry(layout, B, ends, block_size):
    """(num_blocks, block_size, block_table) for requests whose positions end at `ends`."""
    if layout == "transformers":  # one block of S positions per request
        S = int(ends.max()) + 3
        return B, S, torch.arange(B, dtype=torch.int32)[:, None]
    if layout == "sglang_pool":  # req_to_token rows: a token slot per position
        block_size = 1
    used = (ends + block_size - 1) // block_size
    per_seq = int(used.max()) + 1
    num_blocks = B * per_seq + 3  # blocks nobody owns
    table = random_block_table(B, per_seq, num_blocks)
    return num_blocks, block_size, table


def _unowned(table, num_blocks):
    """[num_blocks] bool: blocks no block_table row lists (the reference gathers whole rows)."""
    unowned = torch.ones(num_blocks, dtype=torch.bool)
    unowned[table.flatten().long()] = False
    return unowned


# --------------------------------------------------------------------------- tree_verify
def make_verify_case(layout, dtype, device, B=2, T=7, Hq=6, Hkv=2, D=32, block_size=4, ctx=30):
    """Inputs of tree_verify in `layout`, q sliced from a fused QKV output, unowned blocks NaN."""
    parents, num_nodes = random_trees(B, T, "random")
    tree_mask, _ = reference.build_tree_mask(parents, num_nodes)
    cache_lens = torch.randint(0, ctx + 1, (B,), dtype=torch.int32)
    ends = cache_lens + num_nodes
    NB, bs, table = _geometry(layout, B, ends, block_size)
    tensors, views = kv_layout(layout, (), NB, bs, Hkv, D, dtype, device)
    k, v = views(tensors)
    unowned = _unowned(table, NB)  # poisoned through the logical views
    k[unowned.to(device)] = float("nan")
    v[unowned.to(device)] = float("nan")
    qkv = torch.randn(B, T, (Hq + 2 * Hkv) * D).to(dtype).to(device)
    qkv[..., Hq * D :] = float("nan")  # the K / V parts of the projection
    q = qkv[..., : Hq * D].view(B, T, Hq, D)
    return dict(
        q=q,
        k_cache=k,
        v_cache=v,
        block_table=table.to(device),
        cache_lens=cache_lens.to(device),
        num_nodes=num_nodes.to(device),
        tree_mask=tree_mask.to(device),
        sm_scale=D**-0.5,
    )


def verify_oracle(case):
    """float64 reference on contiguous copies, NaN-poisoned blocks zeroed (never attended)."""
    c = {k: v.cpu() if torch.is_tensor(v) else v for k, v in case.items()}
    k, v = (c[n].contiguous().double().nan_to_num(0.0) for n in ("k_cache", "v_cache"))
    return reference.tree_verify(
        c["q"].contiguous().double(),
        k,
        v,
        c["block_table"],
        c["cache_lens"],
        c["num_nodes"],
        c["tree_mask"],
        c["sm_scale"],
    )


def check_verify(case, backend):
    out = sk.tree_verify(**case, backend=backend)
    q = case["q"]
    assert out.shape == q.shape and out.dtype == q.dtype and out.device == q.device
    tol = TOL[q.dtype]
    torch.testing.assert_close(out.cpu().double(), verify_oracle(case), atol=tol, rtol=tol)
    for b, n in enumerate(case["num_nodes"].tolist()):
        assert (out[b, n:] == 0).all()  # padded rows


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("layout", KV_LAYOUTS)
@pytest.mark.parametrize("backend", _backends())
def test_tree_verify_layouts(backend, layout, dtype, device):
    case = make_verify_case(layout, dtype, device)
    check_verify(case, backend)


@pytest.mark.parametrize("isa", ["baseline", "avx2", "avx512", "avx512bf16"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_tree_verify_cpu_isa_builds_hnd(isa, dtype, device, cpu_isa):
    """Every CPU build (vector width, bf16 dot products) stages HND tiles through strides;
    a long context splits the positions across tasks."""
    if device.type != "cpu":
        pytest.skip("CPU kernel builds")
    cpu_isa(isa)  # capped to what the CPU has
    case = make_verify_case("flashinfer_hnd", dtype, device, B=1, Hkv=1, Hq=3, D=40, ctx=700)
    check_verify(case, "cpp")


def test_tree_verify_q_as_permuted_view(device):
    """q may be any view with a contiguous last dim; the output is contiguous anyway."""
    case = make_verify_case("flashinfer_hnd", torch.float32, device)
    B, T, Hq, D = case["q"].shape
    case["q"] = torch.randn(T, Hq, B, D, device=device).permute(2, 0, 1, 3)
    out = sk.tree_verify(**case)
    assert out.is_contiguous()
    torch.testing.assert_close(out.cpu().double(), verify_oracle(case), atol=1e-5, rtol=1e-5)


# --------------------------------------------------------------------------- compact_kv
def make_compact_case(layout, dtype, device, lead, layer=None, B=3, T=9, Hkv=2, D=16, bs=4):
    """Caches in `layout` with leading dims `lead`; the op gets every layer, or only
    layer `layer` (a 4-D view) when given."""
    paths, num_accepted = random_root_paths(B, T)
    cache_lens = torch.randint(0, 20, (B,), dtype=torch.int32)
    ends = cache_lens + T
    NB, bs, table = _geometry(layout, B, ends, bs)
    tensors, views = kv_layout(layout, lead, NB, bs, Hkv, D, dtype, device)

    def op_views(ts):
        k, v = views(ts)
        return (k, v) if layer is None else (k[layer], v[layer])

    return dict(
        tensors=tensors,
        op_views=op_views,
        args=(
            table.to(device),
            cache_lens.to(device),
            paths.to(device),
            num_accepted.to(device),
        ),
    )


def check_compact(case, backend):
    tensors, op_views, args = case["tensors"], case["op_views"], case["args"]
    # Expected: the reference on contiguous copies, written back through the views into a
    # copy of everything the engine allocated: all else must stay bit-identical.
    want = [t.clone() for t in tensors]
    wk, wv = op_views(want)
    ck, cv = wk.contiguous().cpu(), wv.contiguous().cpu()
    reference.compact_kv(ck, cv, *(a.cpu() for a in args))
    wk.copy_(ck)
    wv.copy_(cv)
    k, v = op_views(tensors)
    sk.compact_kv(k, v, *args, backend=backend)
    for got, exp in zip(tensors, want, strict=True):
        assert torch.equal(got.view(-1).view(torch.uint8), exp.view(-1).view(torch.uint8))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("layers", ["all", "one"])
@pytest.mark.parametrize("layout", KV_LAYOUTS)
@pytest.mark.parametrize("backend", _backends())
def test_compact_kv_layouts(backend, layout, layers, dtype, device):
    """ "all": a [L, ...] view of every layer (the joint tensors' [:, 0] with any layer stride);
    "one": layer 1 of a 3-layer allocation, as a 4-D view: layers 0 and 2 stay untouched."""
    layer = None if layers == "all" else 1
    check_compact(make_compact_case(layout, dtype, device, (3,), layer), backend)


def test_compact_kv_moves_rows_at_all(device):
    """The layout tests can fail: a path that moves rows changes the cache."""
    case = make_compact_case("flashinfer_hnd", torch.float32, device, (2,))
    before = [t.clone() for t in case["tensors"]]
    check_compact(case, "cpp")
    assert any(not torch.equal(a, b) for a, b in zip(case["tensors"], before, strict=True))


# --------------------------------------------------------------------------- bad strides
def _verify_args(device, **edit):
    case = make_verify_case("contiguous", torch.float32, device)
    case.update(edit)
    return case


@pytest.mark.parametrize("name", ["q", "k_cache", "v_cache"])
@pytest.mark.parametrize("backend", _backends())
def test_tree_verify_last_dim_not_contiguous(name, backend, device):
    case = _verify_args(device)
    t = case[name]
    case[name] = torch.randn(*t.shape[:-1], 2 * t.shape[-1], device=device)[..., ::2]
    with pytest.raises(RuntimeError, match=f"{name} must have a contiguous last dimension"):
        sk.tree_verify(**case, backend=backend)


def _compact_inputs(device, k, v):
    B = 1
    table = torch.zeros(B, 4, dtype=torch.int32, device=device)
    table[0] = torch.arange(4)
    paths = torch.tensor([[0, 2, -1]], dtype=torch.int32, device=device)
    return (k, v, table, torch.zeros(B, dtype=torch.int32, device=device), paths,
            torch.ones(B, dtype=torch.int32, device=device))  # fmt: skip


@pytest.mark.parametrize("backend", _backends())
def test_compact_kv_bad_strides(backend, device):
    x = torch.randn(4, 2, 3, 8, device=device)
    # K heads {0, 1} and V heads {1, 2} of one tensor: moving K would overwrite V's head 1.
    with pytest.raises(RuntimeError, match="k_cache and v_cache overlap in memory"):
        sk.compact_kv(*_compact_inputs(device, x[:, :, 0:2], x[:, :, 1:3]), backend=backend)
    # A broadcast cache: one element under many indices.
    y = torch.randn(4, 2, 1, 8, device=device).expand(4, 2, 2, 8)
    with pytest.raises(RuntimeError, match="k_cache must not overlap itself"):
        sk.compact_kv(*_compact_inputs(device, y, x[:, :, :2].clone()), backend=backend)
    # Last dim strided.
    z = torch.randn(4, 2, 2, 16, device=device)[..., ::2]
    with pytest.raises(RuntimeError, match="v_cache must have a contiguous last dimension"):
        sk.compact_kv(*_compact_inputs(device, x[:, :, :2].clone(), z), backend=backend)
    # Interleaved halves of one joint tensor are fine (they never share an element).
    kv = torch.randn(4, 2, 2, 2, 8, device=device)
    sk.compact_kv(*_compact_inputs(device, kv[:, 0], kv[:, 1]), backend=backend)


def test_negative_strides_cannot_reach_the_ops():
    """The C++ check rejects negative strides by name; PyTorch cannot even build such a view
    today, so this pins that assumption (flip copies)."""
    x = torch.randn(4, 2, 2, 8)
    with pytest.raises(RuntimeError):
        x.as_strided((4, 2, 2, 8), (-32, 16, 8, 1), 96)


# --------------------------------------------------------------------------- fake kernels
def test_opcheck_on_views(device):
    """The Meta / fake kernels agree with the real ones on strided views (torch.compile sees
    the same checks and a contiguous tree_verify output)."""
    case = make_verify_case("flashinfer_hnd", torch.float32, device)
    case["k_cache"] = case["k_cache"].nan_to_num(0.0)  # opcheck compares outputs with NaN
    case["v_cache"] = case["v_cache"].nan_to_num(0.0)
    torch.library.opcheck(torch.ops.specdec.tree_verify, tuple(case.values()))
    c = make_compact_case("flashinfer_hnd", torch.float32, device, (2,))
    k, v = c["op_views"](c["tensors"])
    torch.library.opcheck(torch.ops.specdec.compact_kv, (k, v, *c["args"]))


@pytest.mark.parametrize("layout", ["contiguous", "flashinfer_hnd"])
def test_compact_kv_long_overlapping_path(layout, device):
    """A 148-node path shifted down by one (every step overlaps the next source) crosses the
    CPU kernel's 64-position chunks and many blocks."""
    T, bs = 150, 4
    case = make_compact_case(layout, torch.float32, device, (2,), B=1, T=T, bs=bs)
    table, cache_lens, _, _ = case["args"]
    path = torch.tensor([[0, *range(2, T), -1]], dtype=torch.int32, device=device)  # [1, T]
    case["args"] = (
        table,
        cache_lens,
        path,
        torch.tensor([T - 2], dtype=torch.int32, device=device),
    )
    check_compact(case, "cpp")
