"""tree_rejection_sample (cpp and triton backends) against the float64 reference.

Given the same uniforms the op is deterministic, so the kernels must reproduce the
reference's accepted nodes and tokens exactly (the distributional exactness of the rule
itself is checked in test_rejection_stats.py).
"""

import pytest
import torch

import specdec_kernels as sk
from specdec_kernels import reference
from specdec_kernels.testing import TREE_KINDS, random_trees
from specdec_kernels.testing import value_checks_run as _value_checks_run

TEMPERATURES = (0.0, 0.5, 1.0, 2.0)
TOP_PS = (1.0, 0.99999, 0.95, 0.7, 0.3, 0.05)


def _draft_dist(logits, noise):
    """A draft distribution [..., V] correlated with the target's, so that walks go deep."""
    mix = torch.softmax(logits.float() + noise * torch.randn_like(logits.float()), -1)
    dirichlet = torch.distributions.Dirichlet(torch.full(logits.shape[-1:], 0.3)).sample(
        logits.shape[:-1]
    )
    return 0.5 * mix + 0.5 * dirichlet


def random_problem(
    B,
    T,
    V,
    kind,
    with_dp,
    logit_dtype=torch.float32,
    dp_dtype=torch.float32,
    temperatures=TEMPERATURES,
    full=False,
):
    """Inputs of one op call: a mixed batch of greedy / sampled requests with random filters.

    Logits have a per-request scale from 0.1 (flat) to 20 (peaked). Children of node u carry
    tokens drawn from the draft distribution at u (draft_probs[b, u], or a target-like
    distribution when the drafts are point masses), so acceptances are frequent.
    """
    parents, num_nodes = random_trees(B, T, kind, full=full)
    scale = 10 ** torch.empty(B, 1, 1).uniform_(-1, 1.3)
    logits = (torch.randn(B, T, V) * scale).to(logit_dtype)
    dist = _draft_dist(logits, noise=1.0)
    draft_tokens = torch.randint(0, V, (B, T), dtype=torch.int32)
    for b in range(B):
        for c in range(1, int(num_nodes[b])):
            draft_tokens[b, c] = int(torch.multinomial(dist[b, parents[b, c]], 1))
    pick = lambda options: torch.tensor(options)[torch.randint(0, len(options), (B,))]  # noqa: E731
    return dict(
        target_logits=logits,
        draft_tokens=draft_tokens,
        parents=parents,
        num_nodes=num_nodes,
        draft_probs=dist.to(dp_dtype) if with_dp else None,
        temperature=pick(temperatures).float(),
        top_k=pick((0, 0, 1, 3, 20, V, V + 5)).int(),
        top_p=pick(TOP_PS).float(),
        uniforms=torch.rand(B, T + 1),
    )


def run(args, device, backend):
    moved = {k: (v.to(device) if v is not None else None) for k, v in args.items()}
    out = sk.tree_rejection_sample(**moved, backend=backend)
    return [t.cpu() for t in out]


def run_reference(args):
    as64 = lambda t: t.double() if t is not None and t.is_floating_point() else t  # noqa: E731
    return reference.tree_rejection_sample(**{k: as64(v) for k, v in args.items()})


def assert_same(got, want, args):
    names = ("accepted_nodes", "num_accepted", "output_tokens")
    for name, g, w in zip(names, got, want):
        assert g.dtype == torch.int32 and g.shape == w.shape, name
        bad = (g != w).reshape(g.shape[0], -1).any(-1).nonzero().flatten().tolist()
        assert not bad, (
            f"{name} differs for requests {bad}: got {g[bad].tolist()}, "
            f"want {w[bad].tolist()}; temperature {args['temperature'][bad].tolist()}, "
            f"top_k {args['top_k'][bad].tolist()}, top_p {args['top_p'][bad].tolist()}"
        )


def argmax_walk(logits, draft_tokens, parents, num_nodes):
    """Independent greedy oracle: follow the first child whose token is the row's argmax."""
    B, T, _ = logits.shape
    acc = torch.full((B, T), -1, dtype=torch.int32)
    toks = torch.full((B, T), -1, dtype=torch.int32)
    num = torch.zeros(B, dtype=torch.int32)
    for b in range(B):
        u, k = 0, 0
        acc[b, 0] = 0
        while True:
            row = logits[b, u].float()
            a = int((row == row.max()).nonzero()[0])  # lowest id among the maxima
            toks[b, k] = a
            kids = [
                c
                for c in range(u + 1, int(num_nodes[b]))
                if int(parents[b, c]) == u and int(draft_tokens[b, c]) == a
            ]
            if not kids:
                break
            u, k = kids[0], k + 1
            acc[b, k] = u
        num[b] = k
    return acc, num, toks


@pytest.mark.parametrize("with_dp", [False, True], ids=["point_mass", "draft_probs"])
@pytest.mark.parametrize("kind", TREE_KINDS)
def test_matches_reference(kind, with_dp, device, backend):
    for full in (False, True, False):
        V = int(torch.randint(50, 301, ()))
        args = random_problem(16, 12, V, kind, with_dp, full=full)
        assert_same(run(args, device, backend), run_reference(args), args)


@pytest.mark.parametrize("dp_dtype", [None, torch.float16, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("logit_dtype", [torch.float16, torch.bfloat16])
def test_reduced_precision_inputs(logit_dtype, dp_dtype, device, backend):
    """Half logits (many ties) and draft_probs of any float dtype, read as they are."""
    args = random_problem(
        16,
        10,
        130,
        "random",
        dp_dtype is not None,
        logit_dtype=logit_dtype,
        dp_dtype=dp_dtype or torch.float32,
    )
    assert_same(run(args, device, backend), run_reference(args), args)


def test_tied_logits(device, backend):
    """Integer logits: top-k and top-p cut through runs of equal probabilities (ties are kept)."""
    args = random_problem(24, 8, 60, "bushy", True, temperatures=(0.5, 1.0, 2.0))
    args["target_logits"] = torch.randint(-4, 5, args["target_logits"].shape).float()
    assert_same(run(args, device, backend), run_reference(args), args)


def test_large_top_k_and_vocab(device, backend):
    """top_k above the heap limit of the C++ kernel (nth_element path) on a larger vocabulary."""
    args = random_problem(4, 6, 5000, "random", True, temperatures=(0.7, 1.3))
    args["top_k"] = torch.tensor([1500, 3000, 4999, 2048], dtype=torch.int32)
    assert_same(run(args, device, backend), run_reference(args), args)


@pytest.mark.parametrize("scale", [1e-3, 1.0, 1e3])
def test_logit_scales_and_masked_tokens(scale, device, backend):
    """Exact agreement at extreme logit scales, with -inf (masked) tokens in half the requests.

    The C++ kernel computes the probabilities with its own vectorised float64 exp: scale 1e-3
    puts every exponent near 0, scale 1e3 spreads them over [-1e4, 0] (underflow to 0, the
    subnormal range, exp(-inf) = 0), so any error above ~1 ulp would show as a different walk.
    """
    for V in (37, 1000):  # shorter than and several times the vector width
        args = random_problem(
            32, 10, V, "random", bool(torch.rand(()) < 0.5), temperatures=(0.5, 1.0, 2.0)
        )
        logits = torch.randn(32, 10, V) * scale
        masked = (torch.rand(32, 1, V) < 0.3) & (torch.arange(32) % 2 == 0)[:, None, None]
        masked = masked & (logits != logits.amax(-1, keepdim=True))  # keep each row's max finite
        args["target_logits"] = logits.masked_fill(masked, float("-inf"))
        assert_same(run(args, device, backend), run_reference(args), args)


ISA_LEVEL = {"DEFAULT": 0, "NO AVX": 0, "AVX2": 1, "AVX512": 2, "ZVECTOR": 0, "VSX": 0}


@pytest.mark.parametrize("isa", ["avx512", "avx2", "baseline"])
@pytest.mark.parametrize(
    "with_dp",
    [None, torch.float32, torch.float64, torch.bfloat16],
    ids=["point_mass", "dp_float32", "dp_float64", "dp_bfloat16"],
)
def test_cpu_isa_builds(isa, with_dp, device, cpu_isa):
    """The C++ CPU kernel is compiled for AVX-512, AVX2 and the baseline ISA (vector widths
    8, 4, 2 doubles) and runs the widest the CPU has; set_cpu_isa caps it so the narrower
    builds are tested too. float32 / float64 draft rows take the vector subtraction, other
    dtypes a scalar one; odd V leaves a partial vector at the end of every loop."""
    if device.type != "cpu":
        pytest.skip("CPU kernel builds")
    if (
        ISA_LEVEL.get(torch.backends.cpu.get_cpu_capability(), 0)
        < {"baseline": 0, "avx2": 1, "avx512": 2}[isa]
    ):
        pytest.skip(f"this CPU cannot run the {isa} build")
    cpu_isa(isa)
    for V in (131, 1027):
        args = random_problem(
            24, 10, V, "bushy", with_dp is not None, dp_dtype=with_dp or torch.float32
        )
        assert_same(run(args, device, "cpp"), run_reference(args), args)


@pytest.mark.parametrize("mode", ["greedy", "top_k_1", "tiny_top_p"])
@pytest.mark.parametrize("with_dp", [False, True], ids=["point_mass", "draft_probs"])
def test_greedy_is_argmax_walk(mode, with_dp, device, backend):
    """temperature 0, and sampling that keeps only the argmax, walk the argmax path."""
    B, T, V = 16, 12, 200
    args = random_problem(B, T, V, "random", with_dp)
    logits, parents, num_nodes = args["target_logits"], args["parents"], args["num_nodes"]
    # Point half of the drafts at the argmax of their parent's row so that walks go deep.
    for b in range(B):
        for c in range(1, int(num_nodes[b])):
            if torch.rand(()) < 0.5:
                args["draft_tokens"][b, c] = int(logits[b, parents[b, c]].argmax())
    args["temperature"] = torch.full((B,), 0.0 if mode == "greedy" else 0.8)
    args["top_k"] = torch.full((B,), 1 if mode == "top_k_1" else 0, dtype=torch.int32)
    args["top_p"] = torch.full((B,), 1e-3 if mode == "tiny_top_p" else 1.0)  # p_max >= 1 / V
    want = argmax_walk(logits, args["draft_tokens"], parents, num_nodes)
    assert (want[1] > 1).any()  # some walks do go deep
    assert_same(run(args, device, backend), want, args)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_greedy_ties_go_to_lowest_id(dtype, device, backend):
    V = 16
    logits = torch.randn(1, 3, V).clamp(-3, 3).to(dtype)
    logits[0, 0, [9, 4]] = 5.0  # root: argmax tie between 4 and 9 -> 4
    logits[0, 2, [11, 2, 7]] = 5.0  # node 2: tie between 2, 7 and 11 -> 2
    args = dict(
        target_logits=logits,
        draft_tokens=torch.tensor([[0, 9, 4]], dtype=torch.int32),
        parents=torch.tensor([[-1, 0, 0]], dtype=torch.int32),
        num_nodes=torch.tensor([3], dtype=torch.int32),
        draft_probs=None,
        temperature=torch.zeros(1),
        top_k=torch.zeros(1, dtype=torch.int32),
        top_p=torch.ones(1),
        uniforms=torch.rand(1, 4),
    )
    acc, num, toks = run(args, device, backend)
    assert acc.tolist() == [[0, 2, -1]] and num.tolist() == [1] and toks.tolist() == [[4, 2, -1]]


@pytest.mark.parametrize("isa", ["baseline", "avx2", "avx512"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_greedy_argmax_in_every_build(isa, dtype, device, cpu_isa):
    """The greedy walk's argmax runs in vectors (each lane keeps its first largest logit, the
    lanes' ties go to the lowest id): the maximum at the start, at lane and vector edges and
    in a partial last vector, tied with later ids and beside -inf entries, gives the scalar
    scan's index in every build; a NaN, +inf or all -inf row is refused."""
    if device.type != "cpu":
        pytest.skip("CPU kernel builds")
    if (
        ISA_LEVEL.get(torch.backends.cpu.get_cpu_capability(), 0)
        < {"baseline": 0, "avx2": 1, "avx512": 2}[isa]
    ):
        pytest.skip(f"this CPU cannot run the {isa} build")
    cpu_isa(isa)

    def argmax(row):
        args = dict(
            target_logits=row[None, None].to(dtype),
            draft_tokens=torch.zeros(1, 1, dtype=torch.int32),
            parents=torch.full((1, 1), -1, dtype=torch.int32),
            num_nodes=torch.ones(1, dtype=torch.int32),
            draft_probs=None,
            temperature=torch.zeros(1),
            top_k=torch.zeros(1, dtype=torch.int32),
            top_p=torch.ones(1),
            uniforms=torch.rand(1, 2),
        )
        return int(run(args, device, "cpp")[2][0, 0])

    for V in (1, 5, 16, 33, 1027):
        for at in sorted({0, 1, 3, 4, 7, 8, 15, 16, 31, 32, V // 2, V - 2, V - 1} & set(range(V))):
            row = torch.randn(V).clamp(-3, 3)
            row[torch.rand(V) < 0.2] = float("-inf")
            row[at] = 5.0
            row[at + 1 :: 7] = 5.0  # later ties: the first one wins
            assert argmax(row) == at, (V, at)
        for bad in (float("nan"), float("inf")):
            row = torch.randn(V)
            row[V - 1] = bad
            with pytest.raises(RuntimeError, match="NaN, \\+inf or only -inf"):
                argmax(row)
        with pytest.raises(RuntimeError, match="only -inf"):
            argmax(torch.full((V,), float("-inf")))


def test_outputs_are_consistent_root_paths(device, backend):
    """-1 padding, root paths that follow parents, tokens of the accepted nodes then a bonus.

    The logits of padding nodes (>= num_nodes) are NaN: the walk must never read them.
    """
    B, T, V = 32, 16, 100
    args = random_problem(B, T, V, "random", True)
    for b in range(B):
        args["target_logits"][b, int(args["num_nodes"][b]) :] = float("nan")
    acc, num, toks = run(args, device, backend)
    assert (num > 0).any() and (num == 0).any()
    for b in range(B):
        k = int(num[b])
        path = acc[b, : k + 1].tolist()
        assert path[0] == 0 and (acc[b, k + 1 :] == -1).all() and (toks[b, k + 1 :] == -1).all()
        for parent, child in zip(path, path[1:]):
            assert int(args["parents"][b, child]) == parent and child < int(args["num_nodes"][b])
        assert toks[b, :k].tolist() == [int(args["draft_tokens"][b, c]) for c in path[1:]]
        assert 0 <= int(toks[b, k]) < V


def test_single_node_samples_the_processed_root(device, backend):
    """One-node trees: the only output is the bonus token, the inverse CDF of the root row."""
    args = random_problem(64, 4, 80, "single", False, temperatures=(0.5, 1.0, 2.0))
    acc, num, toks = run(args, device, backend)
    assert (num == 0).all() and (acc[:, 1:] == -1).all() and (toks[:, 1:] == -1).all()
    for b in range(64):
        p = reference.process_logits(
            args["target_logits"][b, 0].double(),
            args["temperature"][b],
            args["top_k"][b],
            args["top_p"][b],
        )
        cdf = torch.cumsum(p, 0)
        want = int((cdf > float(args["uniforms"][b, 4]) * cdf[-1]).nonzero()[0])
        assert int(toks[b, 0]) == want


def _set(name, index, value):
    def edit(a):
        a[name] = a[name].clone()
        a[name][index] = value

    return edit


def _replace(names, fn):
    def edit(a):
        for name in names.split(","):
            a[name] = fn(a[name])

    return edit


# (case, edit of a valid B=2, T=5, V=32 problem, message pattern); value checks first.
VALUE_CASES = [
    ("zero_nodes", _set("num_nodes", 1, 0), r"num_nodes\[1\] = 0 is out of range"),
    ("too_many_nodes", _set("num_nodes", 0, 6), r"num_nodes\[0\] = 6 is out of range"),
    ("not_topological", _set("parents", (1, 2), 3), r"parents\[1, 2\] = 3 must satisfy"),
    ("root_has_parent", _set("parents", (0, 0), 0), r"parents\[0, 0\] must be -1"),
    (
        "token_too_large",
        _set("draft_tokens", (1, 3), 32),
        r"draft_tokens\[1, 3\] = 32 is out of range",
    ),
    (
        "token_negative",
        _set("draft_tokens", (0, 1), -1),
        r"draft_tokens\[0, 1\] = -1 is out of range",
    ),
    ("negative_temperature", _set("temperature", 1, -0.5), r"temperature\[1\]"),
    ("nan_temperature", _set("temperature", 0, float("nan")), r"temperature\[0\]"),
    ("negative_top_k", _set("top_k", 0, -1), r"top_k\[0\] = -1"),
    ("zero_top_p", _set("top_p", 1, 0.0), r"top_p\[1\]"),
    ("top_p_above_one", _set("top_p", 0, 1.5), r"top_p\[0\]"),
    ("uniform_one", _set("uniforms", (1, 2), 1.0), r"uniforms\[1, 2\]"),
    ("uniform_negative", _set("uniforms", (0, 5), -0.1), r"uniforms\[0, 5\]"),
    ("nan_logits_greedy", _set("target_logits", (1, 0, 7), float("nan")), r"target_logits\[1, 0\]"),
    (
        "nan_logits_sampled",
        _set("target_logits", (0, 0, 3), float("nan")),
        r"target_logits\[0, 0\]",
    ),
    ("inf_logits", _set("target_logits", (0, 0, 3), float("inf")), r"target_logits\[0, 0\]"),
    ("all_neg_inf_logits", _set("target_logits", (1, 0), float("-inf")), r"target_logits\[1, 0\]"),
]

SHAPE_CASES = [
    (
        "logits_dtype",
        _replace("target_logits", lambda t: t.double()),
        r"target_logits must be float32",
    ),
    (
        "logits_rank",
        _replace("target_logits", lambda t: t[0]),
        r"target_logits must be \[B, T, V\]",
    ),
    (
        "tokens_dtype",
        _replace("draft_tokens", lambda t: t.float()),
        r"draft_tokens must be an int32",
    ),
    ("tokens_T", _replace("draft_tokens", lambda t: t[:, :4]), r"draft_tokens.size\(1\)"),
    (
        "parents_B",
        _replace("parents,num_nodes", lambda t: t[:1]),
        r"parents.size\(0\) must equal the batch size B of target_logits",
    ),
    ("parents_rank", _replace("parents", lambda t: t[0]), r"parents must have 2 dimensions"),
    ("num_nodes_B", _replace("num_nodes", lambda t: t[:1]), r"num_nodes.size\(0\)"),
    ("draft_probs_V", _replace("draft_probs", lambda t: t[..., :31]), r"draft_probs shape"),
    (
        "draft_probs_dtype",
        _replace("draft_probs", lambda t: t.int()),
        r"draft_probs must be a floating",
    ),
    ("temperature_B", _replace("temperature", lambda t: t[:1]), r"temperature.size\(0\)"),
    ("top_k_dtype", _replace("top_k", lambda t: t.float()), r"top_k must be an int32"),
    ("top_p_rank", _replace("top_p", lambda t: t[:, None]), r"top_p must have 1 dimensions"),
    (
        "uniforms_T",
        _replace("uniforms", lambda t: t[:, :5]),
        r"uniforms.size\(1\) must equal T \+ 1",
    ),
]


def _small_valid_problem():
    args = random_problem(2, 5, 32, "chain", True, full=True)
    args["temperature"] = torch.tensor([0.7, 0.0])
    args["top_k"] = torch.zeros(2, dtype=torch.int32)
    args["top_p"] = torch.ones(2)
    return args


@pytest.mark.parametrize("case, edit, match", VALUE_CASES, ids=[c[0] for c in VALUE_CASES])
def test_bad_values(case, edit, match, device, backend):
    if not _value_checks_run(device):
        pytest.skip("value checks on CUDA tensors run only with SPECDEC_VALIDATE=1 (documented)")
    args = _small_valid_problem()
    run(args, device, backend)  # valid as generated
    edit(args)
    with pytest.raises(RuntimeError, match=match):
        run(args, device, backend)


BAD_LOGITS_CASES = [c[:2] for c in VALUE_CASES if "_logits" in c[0]]


@pytest.mark.parametrize("case, edit", BAD_LOGITS_CASES, ids=[c[0] for c in BAD_LOGITS_CASES])
def test_bad_logits_unchecked_fall_back(case, edit, device):
    """Without value checks (CUDA without SPECDEC_VALIDATE=1) the CUDA kernel raises nothing on
    a bad logits row (raising needs a host sync, which CUDA graphs forbid): its documented
    fallback (docs/ops.md, Bad input) gives a well-formed walk of in-range tokens."""
    if _value_checks_run(device):
        pytest.skip("values are checked on this device: test_bad_values covers it")
    args = _small_valid_problem()
    edit(args)
    accepted, num_accepted, tokens = run(args, device, "cpp")
    V = args["target_logits"].shape[-1]
    for b in range(accepted.shape[0]):
        k = int(num_accepted[b])
        assert 0 <= k < accepted.shape[1] and int(accepted[b, 0]) == 0
        assert ((tokens[b, : k + 1] >= 0) & (tokens[b, : k + 1] < V)).all()
        assert (accepted[b, k + 1 :] == -1).all() and (tokens[b, k + 1 :] == -1).all()


@pytest.mark.parametrize("case, edit, match", SHAPE_CASES, ids=[c[0] for c in SHAPE_CASES])
def test_bad_shapes_and_dtypes(case, edit, match, device, backend):
    args = _small_valid_problem()
    edit(args)
    with pytest.raises(RuntimeError, match=match):
        run(args, device, backend)


def test_opcheck(device):
    args = random_problem(6, 7, 40, "random", True)
    torch.library.opcheck(
        torch.ops.specdec.tree_rejection_sample, tuple(v.to(device) for v in args.values())
    )
    args["draft_probs"] = None
    torch.library.opcheck(
        torch.ops.specdec.tree_rejection_sample,
        tuple(v.to(device) if v is not None else None for v in args.values()),
    )


def test_torch_compile_fullgraph(device, backend):
    args = random_problem(6, 7, 40, "random", True)
    moved = {k: v.to(device) for k, v in args.items()}
    fn = torch.compile(lambda **a: sk.tree_rejection_sample(**a, backend=backend), fullgraph=True)
    got = [t.cpu() for t in fn(**moved)]
    assert_same(got, run_reference(args), args)
