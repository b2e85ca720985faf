"""tree_verify (cpp and triton backends) against the float64 reference.

The reference runs in float64 on the same (already rounded) inputs, so the tolerances
below only cover the kernel's float32 accumulation and the rounding of its output.
"""

import pytest
import torch

import specdec_kernels as sk
from specdec_kernels import reference
from specdec_kernels.testing import TREE_KINDS, random_block_table, random_trees
from specdec_kernels.testing import value_checks_run as _value_checks_run

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}  # atol = rtol


def make_case(
    B,
    T,
    Hq,
    Hkv,
    D,
    block_size,
    dtype,
    device,
    kind="random",
    cache_lens=None,
    max_context=40,
    full=False,
):
    """Random inputs of tree_verify as a dict of its arguments (sm_scale random too).

    Each request owns one spare block past its last position, block-table entries it
    does not own are -1, and the cache holds blocks nobody owns: all random data.
    """
    parents, num_nodes = random_trees(B, T, kind, full=full)
    tree_mask, _ = reference.build_tree_mask(parents, num_nodes)
    if cache_lens is None:
        cache_lens = torch.randint(0, max_context + 1, (B,))
    cache_lens = torch.as_tensor(cache_lens, dtype=torch.int32)
    used = (cache_lens + num_nodes + block_size - 1) // block_size
    blocks_per_seq = int(used.max()) + 1
    num_blocks = B * blocks_per_seq + 2
    block_table = random_block_table(B, blocks_per_seq, num_blocks)
    for b in range(B):
        block_table[b, int(used[b]) + 1 :] = -1
    return dict(
        q=torch.randn(B, T, Hq, D).to(dtype).to(device),
        k_cache=torch.randn(num_blocks, block_size, Hkv, D).to(dtype).to(device),
        v_cache=torch.randn(num_blocks, block_size, Hkv, D).to(dtype).to(device),
        block_table=block_table.to(device),
        cache_lens=cache_lens.to(device),
        num_nodes=num_nodes.to(device),
        tree_mask=tree_mask.to(device),
        sm_scale=float(torch.empty(1).uniform_(0.3, 1.5)) * D**-0.5,
    )


def reference_out(case):
    """float64 reference on the same rounded inputs."""
    c = {k: v.cpu() if torch.is_tensor(v) else v for k, v in case.items()}
    return reference.tree_verify(
        c["q"].double(),
        c["k_cache"].double(),
        c["v_cache"].double(),
        c["block_table"],
        c["cache_lens"],
        c["num_nodes"],
        c["tree_mask"],
        c["sm_scale"],
    )


def check(case, backend):
    out = sk.tree_verify(**case, backend=backend)
    q = case["q"]
    assert out.shape == q.shape and out.dtype == q.dtype and out.device == q.device
    want = reference_out(case)
    tol = TOL[q.dtype]
    torch.testing.assert_close(out.cpu().double(), want, atol=tol, rtol=tol)
    for b, n in enumerate(case["num_nodes"].tolist()):  # padded rows: exactly zero
        assert (out[b, n:] == 0).all()
    return out


@pytest.mark.parametrize("kind", TREE_KINDS)
def test_tree_kinds(kind, device, backend):
    """T = 70 crosses the 64-bit word boundary of tree_mask."""
    check(make_case(3, 70, 8, 2, 64, 4, torch.float32, device, kind), backend)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(
    "Hq, Hkv", [(4, 4), (8, 4), (8, 2), (8, 1)], ids=["mha", "gqa2", "gqa4", "mqa"]
)
@pytest.mark.parametrize("D", [40, 64, 128])
def test_dtypes_heads_dims(dtype, Hq, Hkv, D, device, backend):
    block_size = int(torch.tensor([1, 4, 16])[torch.randint(0, 3, ())])
    check(make_case(2, 12, Hq, Hkv, D, block_size, dtype, device), backend)


@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize("context", ["zero", "random"])
def test_block_sizes_and_empty_prefix(block_size, context, device, backend):
    lens = [0, 0, 0] if context == "zero" else None
    check(make_case(3, 9, 4, 2, 32, block_size, torch.float32, device, cache_lens=lens), backend)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_prefill_chains(dtype, device, backend):
    """Prefill chunks as chains of 150 nodes, 9 query / 3 KV heads: key tiles past a row panel's
    last node are skipped by the CPU kernel, and tiles straddle the prefix (cache_lens 37, 100)
    or hold only tree columns (0)."""
    case = make_case(
        3, 150, 9, 3, 64, 16, dtype, device, "chain", cache_lens=[0, 37, 100], full=True
    )
    check(case, backend)


def test_long_context_uneven_lengths(device, backend):
    """Few (request, KV head) pairs over long contexts: the kernel may split the positions
    across threads; one request far shorter than the other (empty splits)."""
    check(
        make_case(2, 24, 4, 1, 64, 16, torch.float32, device, cache_lens=[1100, 3], full=True),
        backend,
    )


def test_bf16_long_context(device, backend):
    check(make_case(1, 40, 8, 2, 128, 16, torch.bfloat16, device, cache_lens=[700]), backend)


ISA_LEVEL = {"DEFAULT": 0, "NO AVX": 0, "AVX2": 1, "AVX512": 2, "ZVECTOR": 0, "VSX": 0}


def _cpu_flags() -> set:
    try:
        with open("/proc/cpuinfo") as f:
            return set(f.read().split())
    except OSError:
        return set()


def _cpu_has_avx512_bf16():
    return "avx512_bf16" in _cpu_flags()


def _cpu_has_amx():
    return {"amx_tile", "amx_bf16"} <= _cpu_flags()


def _skip_unless_isa(isa, device):
    """Skips unless the C++ CPU kernel can run build `isa` (a set_cpu_isa value) here."""
    if device.type != "cpu":
        pytest.skip("CPU kernel builds")
    need = {"baseline": 0, "avx2": 1, "avx512": 2, "avx512bf16": 2, "amx": 2}[isa]
    if ISA_LEVEL.get(torch.backends.cpu.get_cpu_capability(), 0) < need:
        pytest.skip(f"this CPU cannot run the {isa} build")
    if isa in ("avx512bf16", "amx") and not _cpu_has_avx512_bf16():
        pytest.skip("this CPU has no AVX512-BF16")
    if isa == "amx" and not _cpu_has_amx():
        pytest.skip("this CPU has no AMX-BF16")


@pytest.mark.parametrize("isa", ["amx", "avx512bf16", "avx512", "avx2", "baseline"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_cpu_isa_builds(isa, dtype, device, cpu_isa):
    """The C++ CPU kernel is compiled for AVX-512 (+ a bf16 dot-product build and an AMX tile
    build for bfloat16), AVX2 and the baseline ISA and runs the widest the CPU has;
    set_cpu_isa caps it so the narrower builds are tested too (40 nodes x 4 query heads per
    KV head: two row blocks)."""
    _skip_unless_isa(isa, device)
    cpu_isa(isa)
    assert sk.cpu_isa() == isa
    check(make_case(2, 40, 8, 2, 40, 4, dtype, device, cache_lens=[300, 7]), "cpp")


FEW_ROWS_SHAPES = [(1, 9, 3, 64), (2, 8, 2, 40), (1, 32, 4, 128), (1, 2, 1, 8), (1, 4, 4, 300)]


@pytest.mark.parametrize("T, Hq, Hkv, D", FEW_ROWS_SHAPES)
def test_few_query_rows_long_context(T, Hq, Hkv, D, device, backend):
    """A plain decode step (T = 1) and a 2-node tree ask at most 8 query rows per KV head
    (the CPU kernel then runs its lanes over head dims): contexts of many 64-position key
    tiles, uneven, one empty; D = 300 is past that kernel's limit (the panel kernel runs).
    float16: the CPU kernel keeps float32 on the panel kernels (row-invariant numerics)."""
    case = make_case(3, T, Hq, Hkv, D, 16, torch.float16, device, cache_lens=[1000, 130, 0])
    check(case, backend)


def _plain_step_of(case, b, node, parents):
    """The T = 1 call plain decoding makes for tree node `node` of request b: the node's
    ancestors' K / V moved to the positions after the prefix (as compact_kv leaves them once
    they are accepted), the node's query alone, cache_lens = prefix + depth."""
    path = [node]
    while parents[path[-1]] >= 0:
        path.append(int(parents[path[-1]]))
    path.reverse()
    c, blocks = int(case["cache_lens"][b]), case["block_table"][b].long()
    block_size = case["k_cache"].shape[1]
    k, v = case["k_cache"].clone(), case["v_cache"].clone()
    for depth, src in enumerate(path):
        sp, dp = c + src, c + depth
        for cache, orig in ((k, case["k_cache"]), (v, case["v_cache"])):
            cache[blocks[dp // block_size], dp % block_size] = orig[
                blocks[sp // block_size], sp % block_size
            ]
    one = torch.ones(1, dtype=torch.int32)
    return dict(
        case,
        q=case["q"][b : b + 1, node : node + 1].contiguous(),
        k_cache=k,
        v_cache=v,
        block_table=case["block_table"][b : b + 1],
        cache_lens=torch.tensor([c + len(path) - 1], dtype=torch.int32),
        num_nodes=one,
        tree_mask=torch.ones(1, 1, 1, dtype=torch.int64),
    )


# Prefixes whose tree positions [c, c + 8) hold no 64-position tile boundary (and so no split
# boundary either): 5 (one tile), 300 (2 splits of 256 at 2 threads), 710 (3), 1500 (6).
@pytest.mark.parametrize("ctx", [5, 300, 710, 1500])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("isa", ["avx512", "baseline"])  # avx512: the widest the CPU has, <= it
def test_node_output_is_the_plain_steps(ctx, dtype, threads, isa, device, cpu_isa):
    """Greedy speculation reproduces plain decoding only if a tree node's attention is
    bitwise what the plain step that later decodes its token computes: the same query over
    the prefix and the node's ancestors, moved into place. The C++ CPU kernel gives every
    node of a random tree those bits: its few-rows kernel (a plain step: 3 rows per KV head
    here) computes a row as the panel kernel (a tree of 8: 24 rows) does, and its key
    segments are fixed positions, whatever the batch (2 here, 1 in the plain step) or the
    threads. bfloat16 on an AVX512-BF16 CPU is the exception (its vdpbf16ps kernels: the build
    is capped at AVX-512 here), and so is a node whose ancestors straddle a 64-position tile
    boundary inside the tree (see tree_verify.cpp)."""
    if device.type != "cpu":
        pytest.skip("the CPU kernel's property")
    cpu_isa(isa)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for _ in range(3):
            tree = make_case(2, 8, 9, 3, 64, 16, dtype, device, cache_lens=[ctx, ctx + 1])
            parents, _ = random_trees(1, 8, "random", full=True)  # one shape for both
            tree["tree_mask"], _ = reference.build_tree_mask(
                parents.repeat(2, 1), torch.full((2,), 8, dtype=torch.int32)
            )
            tree["num_nodes"] = torch.full((2,), 8, dtype=torch.int32)
            whole = sk.tree_verify(**tree, backend="cpp")
            for b in range(2):
                for node in range(8):
                    plain = sk.tree_verify(
                        **_plain_step_of(tree, b, node, parents[0]), backend="cpp"
                    )
                    assert torch.equal(whole[b, node], plain[0, 0]), (b, node, parents[0].tolist())
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("threads", [1, 2])
def test_prefill_rows_are_the_plain_steps(threads, device, cpu_isa):
    """A prefill chunk's rows are split into blocks of 128 query rows, taken by whichever
    thread is free: every row must still get the bits of the plain step that decodes its
    token (a chain: its nodes sit where they will stay). 60 nodes x 3 query heads per KV head
    = 180 rows, two blocks, node 42 straddling them; float32 on the AVX-512 build."""
    if device.type != "cpu":
        pytest.skip("the CPU kernel's property")
    cpu_isa("avx512")
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        case = make_case(1, 60, 9, 3, 64, 16, torch.float32, device, "chain", [37], full=True)
        whole = sk.tree_verify(**case, backend="cpp")
        chain = torch.arange(60) - 1
        for node in range(60):
            plain = sk.tree_verify(**_plain_step_of(case, 0, node, chain), backend="cpp")
            assert torch.equal(whole[0, node], plain[0, 0]), node
    finally:
        torch.set_num_threads(before)


def test_node_output_check_can_fail(device):
    """The check above detects a node whose attention differs: the plain step of node 2 run
    with the tree's row 1 query is a different output."""
    if device.type != "cpu":
        pytest.skip("the CPU kernel's property")
    tree = make_case(1, 4, 9, 3, 64, 16, torch.float32, device, cache_lens=[100])
    parents = torch.tensor([-1, 0, 1, 0])
    tree["tree_mask"], _ = reference.build_tree_mask(parents[None], torch.tensor([4]))
    tree["num_nodes"] = torch.tensor([4], dtype=torch.int32)
    whole = sk.tree_verify(**tree, backend="cpp")
    plain = _plain_step_of(tree, 0, 2, parents)
    assert torch.equal(whole[0, 2], sk.tree_verify(**plain, backend="cpp")[0, 0])
    plain["q"] = tree["q"][:, 1:2].contiguous()
    assert not torch.equal(whole[0, 2], sk.tree_verify(**plain, backend="cpp")[0, 0])


@pytest.mark.parametrize("isa", ["avx512bf16", "avx512", "avx2", "baseline"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("T, Hq, Hkv, D", FEW_ROWS_SHAPES[:3])
def test_few_query_rows_cpu_builds(T, Hq, Hkv, D, isa, dtype, device, cpu_isa):
    _skip_unless_isa(isa, device)
    cpu_isa(isa)
    check(make_case(2, T, Hq, Hkv, D, 16, dtype, device, cache_lens=[700, 65]), "cpp")


@pytest.mark.parametrize("rows", range(1, 9))
@pytest.mark.parametrize("block_size, D", [(16, 64), (12, 64), (1, 64), (16, 160)])
def test_bf16_few_rows_dot_product_build(rows, block_size, D, device, cpu_isa):
    """bf16 with head dims a multiple of 32 and <= 8 query rows per KV head takes the
    vdpbf16ps few-rows kernel (one instantiation per row count; full trees of `rows` nodes,
    group size 1, so the tree mask hides columns): every row count, block sizes a power of two
    (shift and mask) and not, tiles and splits of long uneven contexts (keys past a tile's
    last group of 16), head dims of an odd number of 32-dim chunks (the even / odd output
    order put back)."""
    _skip_unless_isa("avx512bf16", device)
    cpu_isa("avx512bf16")
    case = make_case(
        2, rows, 2, 2, D, block_size, torch.bfloat16, device, cache_lens=[600, 37], full=True
    )
    check(case, "cpp")


def _check_against_float_build(case, isa, cpu_isa):
    """A bf16 case under the build `isa` selects: against the reference (check), and against
    the float build (set_cpu_isa("avx512")) within bf16 tolerance."""
    cpu_isa(isa)
    out = check(case, "cpp")
    cpu_isa("avx512")
    flt = check(case, "cpp")
    tol = TOL[torch.bfloat16]
    torch.testing.assert_close(out.double(), flt.double(), atol=tol, rtol=tol)


@pytest.mark.parametrize("D", [35, 128])
def test_bf16_dot_product_build(D, device, cpu_isa):
    """The vdpbf16ps build pairs head dims (odd D: a zero partner) and key positions (a
    tile of odd length: a zero partner), and rounds the probabilities to bf16: against the
    reference and against the float build (set_cpu_isa("avx512")), rows padded to 32
    (group 3, 7 nodes: 21 rows), positions split across tasks (one long request)."""
    _skip_unless_isa("avx512bf16", device)
    case = make_case(2, 7, 6, 2, D, 4, torch.bfloat16, device, cache_lens=[777, 12], full=True)
    _check_against_float_build(case, "avx512bf16", cpu_isa)


def test_amx_runs_where_the_cpu_has_it(device, cpu_isa):
    """A CPU with AMX-BF16 runs the AMX build unless capped: Linux must grant the tile state
    (arch_prctl), and a refusal would silently leave the bf16 panels on vdpbf16ps."""
    _skip_unless_isa("amx", device)
    cpu_isa(None)
    assert sk.cpu_isa() == "amx"


@pytest.mark.parametrize(
    "T, Hq, Hkv, D, block_size, lens",
    [
        (150, 9, 3, 64, 16, [0, 37, 100]),  # prefill chains: skipped panels, 16-row tails
        (9, 6, 2, 128, 12, [777, 5, 0]),  # K staged (16 positions may straddle blocks)
        (7, 6, 2, 96, 1, [300, 64, 31]),  # token pool; 3 pairs of 16 head dims
        (20, 16, 2, 64, 128, [1000, 129, 2]),  # vLLM's block size, 8 query heads per KV head
        (11, 4, 2, 35, 16, [70, 3, 0]),  # D not a multiple of 32: the vdpbf16ps build
    ],
)
def test_bf16_amx_build(T, Hq, Hkv, D, block_size, lens, device, cpu_isa):
    """The AMX build against the reference and against the float build: K read in place
    (block sizes a multiple of 16) or staged, tiles of odd length (their last 32-key step
    padded), 16- and 32-row panels, segments split across tasks, prefill chains."""
    _skip_unless_isa("amx", device)
    kind = "chain" if T == 150 else "random"
    case = make_case(3, T, Hq, Hkv, D, block_size, torch.bfloat16, device, kind, lens, full=True)
    _check_against_float_build(case, "amx", cpu_isa)


def test_bf16_amx_ignores_what_the_cache_holds_past_a_tile(device, cpu_isa):
    """The AMX build reads whole 16-position K blocks in place: positions past the context
    (here NaN and inf, as an uninitialised cache may hold) must not reach any output."""
    _skip_unless_isa("amx", device)
    case = make_case(2, 5, 6, 2, 64, 32, torch.bfloat16, device, cache_lens=[41, 3], full=True)
    want = reference_out(case)  # (the reference would carry the NaN: it reads every position)
    for cache in (case["k_cache"], case["v_cache"]):
        for b, length in enumerate((case["cache_lens"] + case["num_nodes"]).tolist()):
            for pos in range(length, 64):
                blk = int(case["block_table"][b, pos // 32])
                if blk >= 0:
                    cache[blk, pos % 32] = float("nan") if pos % 2 else float("inf")
    cpu_isa("amx")
    out = sk.tree_verify(**case, backend="cpp")
    tol = TOL[torch.bfloat16]
    torch.testing.assert_close(out.cpu().double(), want, atol=tol, rtol=tol)


@pytest.mark.parametrize("isa", ["amx", "avx512bf16", "avx512"])
def test_a_call_does_not_see_an_earlier_calls_values(isa, device, cpu_isa, single_thread):
    """The CPU kernel's per-thread buffers outlive a call and move with its row count: a call
    whose queries are NaN (so are its buffers) must leave later calls of other shapes exact
    (the AMX build once multiplied stale pairs past a tile's end by zero V columns: NaN)."""
    _skip_unless_isa(isa, device)
    cpu_isa(isa)  # (one thread: its buffers serve every call)
    for T in (9, 20):
        case = make_case(2, T, 9, 3, 64, 16, torch.bfloat16, device, cache_lens=[33, 5], full=True)
        for poison_T in (150, 40, 11):
            poison = make_case(
                1, poison_T, 9, 3, 64, 16, torch.bfloat16, device, "chain", [77], full=True
            )
            poison["q"] = torch.full_like(poison["q"], float("nan"))
            sk.tree_verify(**poison, backend="cpp")
            check(case, "cpp")


def test_contiguous_per_sequence_cache(device, backend):
    """num_blocks = B, block_size = S, block_table = arange(B)[:, None]: a dense [B, S] cache."""
    B, T, S = 3, 10, 57
    case = make_case(B, T, 8, 2, 64, 4, torch.float32, device)
    case["k_cache"] = torch.randn(B, S, 2, 64, device=device)
    case["v_cache"] = torch.randn(B, S, 2, 64, device=device)
    case["block_table"] = torch.arange(B, dtype=torch.int32, device=device)[:, None]
    case["cache_lens"] = torch.tensor([S - T, 0, 20], dtype=torch.int32, device=device)
    check(case, backend)


def test_non_contiguous_q(device, backend):
    case = make_case(2, 11, 8, 2, 64, 4, torch.float32, device)
    case["q"] = case["q"].transpose(1, 2).contiguous().transpose(1, 2)  # [B, T, Hq, D] view
    assert not case["q"].is_contiguous()
    check(case, backend)


def test_arbitrary_masks(device, backend):
    """Any bit pattern is honoured: bits at or past num_nodes are ignored, and a row that
    sees no key at all (empty prefix, no bit) is zero."""
    B, T = 3, 70
    case = make_case(B, T, 4, 2, 64, 4, torch.float32, device, cache_lens=[0, 0, 13])
    mask = torch.randint(-(2**63), 2**63 - 1, (B, T, 2), dtype=torch.int64)
    mask[:, 5] = 0  # node 5 sees nothing of the tree; with cache_lens 0 it sees no key
    case["tree_mask"] = mask.to(device)
    out = check(case, backend)
    n = case["num_nodes"].tolist()
    for b in range(2):
        if n[b] > 5:
            assert (out[b, 5] == 0).all()


def test_negative_and_default_scale(device, backend):
    case = make_case(2, 8, 4, 2, 64, 4, torch.float32, device)
    case["sm_scale"] = -0.2
    check(case, backend)
    case.pop("sm_scale")
    out = sk.tree_verify(**case, backend=backend)
    torch.testing.assert_close(
        out, sk.tree_verify(**case, sm_scale=64**-0.5, backend=backend), atol=0, rtol=0
    )


# --------------------------------------------------------------------------- bad inputs


def _bad(case_name, device):
    """A valid small case, then broken as named; returns the argument dict."""
    c = make_case(2, 6, 4, 2, 16, 4, torch.float32, device, cache_lens=[5, 9])
    if case_name == "q_dtype":
        c["q"] = c["q"].double()
    elif case_name == "cache_dtype":
        c["k_cache"] = c["k_cache"].half()
    elif case_name == "q_rank":
        c["q"] = c["q"][0]
    elif case_name == "cache_rank":
        c["k_cache"] = c["k_cache"][0]
    elif case_name == "batch":
        c["cache_lens"] = torch.cat([c["cache_lens"], c["cache_lens"][:1]])
    elif case_name == "block_table_batch":
        c["block_table"] = c["block_table"][:1]
    elif case_name == "tree_size":
        c["tree_mask"] = c["tree_mask"][:, :5]
    elif case_name == "head_dim":
        c["k_cache"] = c["k_cache"][..., :8].contiguous()
        c["v_cache"] = c["v_cache"][..., :8].contiguous()
    elif case_name == "v_shape":
        c["v_cache"] = c["v_cache"][:, :, :1].contiguous()
    elif case_name == "heads":
        c["q"] = torch.randn(2, 6, 3, 16, device=device)
    elif case_name == "strided_last_dim":  # any other strides are fine (test_layouts.py)
        c["k_cache"] = torch.cat([c["k_cache"], c["k_cache"]], dim=-1)[..., ::2]
    elif case_name == "mask_words":
        c["tree_mask"] = torch.cat([c["tree_mask"], c["tree_mask"]], dim=2)
    elif case_name == "mask_dtype":
        c["tree_mask"] = c["tree_mask"].int()
    elif case_name == "index_dtype":
        c["block_table"] = c["block_table"].float()
    elif case_name == "scale":
        c["sm_scale"] = float("inf")
    elif case_name == "zero_nodes":
        c["num_nodes"][1] = 0
    elif case_name == "too_many_nodes":
        c["num_nodes"][1] = 7
    elif case_name == "negative_cache_len":
        c["cache_lens"][0] = -1
    elif case_name == "block_out_of_range":
        c["block_table"][1, 0] = c["k_cache"].shape[0]
    elif case_name == "negative_block":
        c["block_table"][0, 1] = -1
    elif case_name == "beyond_owned_blocks":
        c["cache_lens"][0] = c["block_table"].shape[1] * 4
    return c


SHAPE_CASES = [
    ("q_dtype", r"q must be float32, float16 or bfloat16"),
    ("cache_dtype", r"k_cache dtype \(Half\) must match q dtype"),
    ("q_rank", r"q must be \[B, T, Hq, D\]"),
    ("cache_rank", r"k_cache must be \[num_blocks, block_size, Hkv, D\]"),
    ("batch", r"cache_lens.size\(0\) must equal the batch size B of q"),
    ("block_table_batch", r"block_table.size\(0\) must equal the batch size B of q"),
    ("tree_size", r"tree_mask.size\(1\) must equal the tree size T of q"),
    ("head_dim", r"k_cache.size\(3\) must equal the head dim D of q"),
    ("v_shape", r"v_cache shape .* must equal k_cache shape"),
    ("heads", r"Hq \(3\) must be a multiple of the number of KV heads Hkv \(2\)"),
    ("strided_last_dim", r"k_cache must have a contiguous last dimension"),
    ("mask_words", r"tree_mask.size\(2\) must equal ceil\(T / 64\)"),
    ("mask_dtype", r"tree_mask must be int64"),
    ("index_dtype", r"block_table must be an int32 or int64 tensor"),
    ("scale", r"sm_scale must be finite"),
]
VALUE_CASES = [
    ("zero_nodes", r"num_nodes\[1\] = 0 is out of range \[1, T = 6\]"),
    ("too_many_nodes", r"num_nodes\[1\] = 7 is out of range \[1, T = 6\]"),
    ("negative_cache_len", r"cache_lens\[0\] = -1 must be >= 0"),
    ("block_out_of_range", r"block_table\[1, 0\] = \d+ is out of range \[0, num_blocks"),
    ("negative_block", r"block_table\[0, 1\] = -1 is out of range"),
    ("beyond_owned_blocks", r"cache_lens \+ num_nodes of request 0 reaches position"),
]


@pytest.mark.parametrize("case_name, match", SHAPE_CASES, ids=[c for c, _ in SHAPE_CASES])
def test_bad_shapes_and_dtypes(case_name, match, device, backend):
    with pytest.raises(RuntimeError, match=match):
        sk.tree_verify(**_bad(case_name, device), backend=backend)


@pytest.mark.parametrize("case_name, match", VALUE_CASES, ids=[c for c, _ in VALUE_CASES])
def test_bad_values(case_name, match, device, backend):
    if not _value_checks_run(device):
        pytest.skip("value checks on CUDA tensors run only with SPECDEC_VALIDATE=1 (documented)")
    with pytest.raises(RuntimeError, match=match):
        sk.tree_verify(**_bad(case_name, device), backend=backend)


def test_mixed_devices(device, backend):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device to mix devices")
    c = _bad("none", device)
    other = "cpu" if device.type == "cuda" else "cuda"
    c["block_table"] = c["block_table"].to(other)
    with pytest.raises(RuntimeError, match=r"block_table must be on the same device as q"):
        sk.tree_verify(**c, backend=backend)


# --------------------------------------------------------------------------- torch integration
def _op_args(case):
    return (
        case["q"],
        case["k_cache"],
        case["v_cache"],
        case["block_table"],
        case["cache_lens"],
        case["num_nodes"],
        case["tree_mask"],
        case["sm_scale"],
    )


def test_opcheck(device):
    case = make_case(2, 9, 4, 2, 32, 4, torch.float32, device)
    torch.library.opcheck(torch.ops.specdec.tree_verify, _op_args(case))


def test_torch_compile_fullgraph(device):
    case = make_case(2, 9, 4, 2, 32, 4, torch.float32, device)

    @torch.compile(fullgraph=True)
    def layer(q, k_cache, v_cache, block_table, cache_lens, num_nodes, tree_mask):
        out = torch.ops.specdec.tree_verify(
            q * 2.0,
            k_cache,
            v_cache,
            block_table,
            cache_lens,
            num_nodes,
            tree_mask,
            0.5 * case["sm_scale"],
        )
        return out + 1.0

    got = layer(*_op_args(case)[:-1])
    want = torch.ops.specdec.tree_verify(*_op_args(case)) + 1.0
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_cpu_isa_names_are_checked(cpu_isa):
    with pytest.raises(RuntimeError, match="SPECDEC_CPU_ISA must be amx, avx512bf16, avx512"):
        cpu_isa("avx1024")
    cpu_isa("avx2")
    assert sk.cpu_isa() in ("avx2", "baseline")
