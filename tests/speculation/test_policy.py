"""Adaptive speculation: the cost model, the policy's choices, and exactness in the engine
(greedy == plain token for token; sampled follows the target's distribution)."""

import numpy as np
import pytest
import torch

from specdec.drafters.base import Proposal
from specdec.drafters.eagle_head import EagleHead
from specdec.runtime.engine import Engine
from specdec.speculation.cost_model import CostModel
from specdec.speculation.policy import (
    BUCKET_PRIOR,
    CALIBRATION_PRIOR,
    DECAY,
    MAX_PROBE,
    MEASURE_MARGIN,
    REMEASURE_STEPS,
    Policy,
    _bands,
)
from specdec.speculation.trees import TreeSpec

from model_testing import (
    CHEAP_VERIFY,
    PROMPTS,
    SAMPLING,
    first_tokens,
    oracle_head,
    run,
    same_distribution_pvalue,
    tiny_model,
)

pytestmark = pytest.mark.usefixtures("single_thread")

SPEC = TreeSpec.parse("adaptive:4,3,10")
# every drafted node costs as much as a whole forward: speculation never pays
DEAR_VERIFY = CostModel(1, [1, 2, 4, 10], [1.0, 2.0, 4.0, 10.0], [0.5, 1.0, 1.5, 2.0])
# the start-up timed bigger trees dear (noise, or a loop unlike the steps)
STEEP_VERIFY = CostModel(1, [1, 2, 4, 10], [1.0, 1.3, 1.9, 3.7], [0.02, 0.04, 0.06, 0.08])


def drafted(parents: list, confidence: list) -> Proposal:
    """One step's draft trees as Policy.observe reads them: parents [B][T] (every node
    real), confidence [B][T] (the root's 1); the tokens do not matter to the policy."""
    B, T = len(parents), len(parents[0])
    return Proposal(
        torch.full((B, T), 5),
        torch.tensor(parents, dtype=torch.int32),
        torch.full((B,), T, dtype=torch.int32),
        None,
        torch.tensor(confidence),
    )


def test_cost_model_interpolates_and_extrapolates():
    c = CostModel(1, [1, 2, 4], [1.0, 1.5, 2.5], [0.1, 0.3])
    assert (
        c.verify(1) == 1.0
        and c.verify(3) == pytest.approx(2.0)
        and c.verify(6) == pytest.approx(3.5)
    )
    assert c.draft(0) == 0.0 and c.draft(2) == 0.3 and c.draft(4) == pytest.approx(0.7)


def test_draft_cost_is_linear_in_a_levels_width():
    """Level 2 costs 0.3 s when it expands TOPK = 3 nodes and 0.1 s for one (draft_narrow_s);
    two nodes: halfway. Without a timed narrow curve the width does not change the cost."""
    c = CostModel(1, [1, 2], [1.0, 1.0], [0.1, 0.4, 0.6], draft_narrow_s=[0.1, 0.2, 0.25])
    p = Policy(c, SPEC)
    assert p.draft_cost(1) == pytest.approx(0.1) and p.draft_cost(0) == 0.0
    assert p.draft_cost(2, [3]) == pytest.approx(0.4) and p.draft_cost(2, [1]) == pytest.approx(0.2)
    assert p.draft_cost(2, [2]) == pytest.approx(0.3)
    assert p.draft_cost(3, [1, 3]) == pytest.approx(0.4)  # 0.1 + 0.1 + level 3's 0.2
    assert p.draft_cost(3) == pytest.approx(0.6)  # no widths recorded: TOPK wide
    wide = Policy(CostModel(1, [1, 2], [1.0, 1.0], [0.1, 0.4, 0.6]), SPEC)
    assert wide.draft_cost(2, [1]) == wide.draft_cost(2, [3]) == pytest.approx(0.4)


# verify costs the same for any tree (1 s); a draft level 0.1 s per frontier node it expands
WIDTH_PRICED = CostModel(
    1,
    [1, 2, 4, 10],
    [1.0, 1.0, 1.0, 1.0],
    [0.01, 0.31, 0.61, 0.91],
    draft_narrow_s=[0.01, 0.11, 0.21, 0.31],
)


def test_policy_expands_only_the_frontier_nodes_that_pay():
    """A level costs 0.1 s a frontier node (a step ~1 s). One sure frontier node (0.9) and two
    unsure ones (0.05): expanding the sure one alone pays best; three sure ones: all three. A
    head whose best children have been unsure at depth 2 (recorded by node_value) gets no
    second level."""
    p = Policy(WIDTH_PRICED, SPEC)
    p.new_step([0])
    one_sure = torch.tensor([[0.9, 0.05, 0.05]])
    assert p.expand_width(1, one_sure, one_sure) == 1 and p.widths == [1]
    p.new_step([0])
    all_sure = torch.tensor([[0.9, 0.9, 0.9]])
    assert p.expand_width(1, all_sure, all_sure) == 3 and p.widths == [3]
    assert p.expand(1, all_sure, all_sure)
    unsure_children = torch.full((1, 1, 3), 0.002).log()
    for _ in range(200):
        p.node_value(one_sure[:, :1], unsure_children, depth=2, children=True)
    p.new_step([0])
    assert p.expand_width(1, one_sure, one_sure) == 0 and p.widths == []


def test_policy_prices_draft_levels_by_their_measured_time():
    """The cost model's level 2 is 0.1 s one node wide; the steps measure it at 0.4 s (cold
    caches): draft_cost follows (bounded per level), and a level that paid at 0.1 s no
    longer does."""
    p = Policy(WIDTH_PRICED, SPEC)
    p.new_step([0])
    frontier = torch.tensor([[0.3, 0.01, 0.01]])
    assert p.expand_width(1, frontier, frontier) == 1
    for _ in range(300):
        p.observe_level(0.4, 1, 1)
    assert p.level_factor() == pytest.approx(4.0, rel=1e-3)
    assert p.draft_cost(2, [1]) == pytest.approx(0.01 + 0.4, rel=1e-3)
    p.new_step([0])
    assert p.expand_width(1, frontier, frontier) == 0
    p.observe_level(100.0, 1, 1)  # one stalled level moves the factor by a bounded amount
    assert p.level_factor() == pytest.approx(4.0, rel=1e-3)


def test_cost_model_measure_times_every_size():
    """Real timings: which sizes get measured depends on the machine's load (measuring stops
    once a tree costs more than depth + 1 plain steps), but always a prefix of the sizes."""
    model = tiny_model()
    cost = CostModel.measure(model, EagleHead.random(model, seed=0), SPEC, batch_size=2, repeats=1)
    sizes = [1, 2, 3, 4, 5, 6, 7, 8, 10]  # every size up to EVERY_SIZE_UP_TO, then the total
    assert cost.verify_tokens == sizes[: len(cost.verify_tokens)] and cost.verify_tokens
    assert len(cost.verify_s) == len(cost.verify_tokens) and len(cost.draft_s) == SPEC.depth
    assert all(t > 0 for t in cost.verify_s + cost.draft_s)


def test_cost_model_measure_stops_where_a_tree_cannot_pay(monkeypatch):
    """A fake clock (no wall-clock dependence) and an engine's own target forward (an engine
    hosting the drafter, as vLLM's: no specdec model): verify costs T seconds for T nodes, so
    the measuring stops at the first size dearer than depth + 1 = 5 plain steps (6 nodes),
    at every measured batch size, and verify() extrapolates."""
    import specdec.speculation.cost_model as cost_model_module

    def fake_median_time(fn, repeats, device):
        return float(fn.nodes) if hasattr(fn, "nodes") else 0.5  # a draft: 0.5 s

    calls = []

    def target_forward(B, T):
        calls.append((B, T))

        def forward():
            pass

        forward.nodes = T
        return forward

    monkeypatch.setattr(cost_model_module, "median_time", fake_median_time)
    head = EagleHead.random(tiny_model(), seed=0)
    cost = CostModel.measure(
        None, head, SPEC, batch_size=2, repeats=1, target_forward=target_forward
    )
    assert cost.verify_tokens == [1, 2, 3, 4, 5, 6]
    assert cost.verify_s == [1.0, 2.0, 3.0, 4.0, 5.0, 6.0]
    assert cost.verify(10) == pytest.approx(10.0) and cost.draft_s == [0.5] * SPEC.depth
    assert calls == [(2, T) for T in range(1, 7)] + [(1, T) for T in range(1, 7)]
    assert cost.verify(10, batch=1) == pytest.approx(10.0)


def test_policy_sizes_the_tree_by_value_over_cost():
    cheap, dear = Policy(CHEAP_VERIFY, SPEC), Policy(DEAR_VERIFY, SPEC)
    confident = torch.tensor([[0.9, 0.05, 0.01]]).log()
    v = cheap.node_value(None, confident, depth=1)
    torch.testing.assert_close(v, torch.tensor([[0.9, 0.05, 0.01]]))  # ratio starts at 1
    assert cheap.size(v, 1) == 3  # +0.01 tokens for +0.01 s of a 1 s step pays
    assert dear.size(v, 1) == 1  # a likely node is worth doubling the step, two are not
    unsure = dear.node_value(None, torch.tensor([[0.3, 0.05, 0.01]]).log(), depth=1)
    assert dear.size(unsure, 1) == 0  # verify the root alone: a plain step
    assert cheap.expand(1, v, v) and not dear.expand(1, v, v)
    # children values are bounded by their parent's
    kids = cheap.node_value(v, torch.full((1, 3, 3), 0.5).log(), depth=2)
    assert (kids <= v[..., None]).all()


def test_sizes_after_a_stop_is_the_stop_options_size():
    """At batch 1, sizes() after expand_width chose to stop reuses that choice's "stop here"
    size: the same as computing it afresh, for any values and costs."""
    g = torch.Generator().manual_seed(0)
    stops = 0
    for cost in (CHEAP_VERIFY, DEAR_VERIFY, STEEP_VERIFY, WIDTH_PRICED):
        for _ in range(40):
            p = Policy(cost, SPEC)
            p.new_step([0])
            values = torch.rand(1, 3, generator=g) ** 2
            if p.expand_width(1, values, values) == 0:
                stops += 1
                assert p._stopped is not None
                reused = p.sizes(values, 1)
                p._stopped = None
                assert torch.equal(reused, p.sizes(values, 1))
                other = values * 0.5  # other values: computed, not reused
                p.expand_width(1, values, values)
                q = Policy(cost, SPEC)
                q.new_step([0])
                assert torch.equal(p.sizes(other, 1), q.sizes(other, 1))
    assert stops >= 20


def test_local_values_on_the_host_are_node_values():
    """Policy.local_values (numpy, any depths in one call) gives node_value's float32 values
    bitwise, with learnt ratios per depth and band (confidences at band edges included); a
    depth past the statistics' takes the deepest."""
    g = torch.Generator().manual_seed(1)
    p = Policy(CHEAP_VERIFY, SPEC)
    p.accepted = torch.rand(p.accepted.shape, generator=g, dtype=torch.float64).numpy() * 3
    p.confidence = torch.rand(p.confidence.shape, generator=g, dtype=torch.float64).numpy() + 1
    edges = torch.tensor([0.05, 0.15, 0.35, 0.65, 1.0])
    logprob = torch.cat((torch.rand(1, 60, generator=g), edges[None]), 1).log()
    conf = logprob.float().exp()
    for d in range(1, SPEC.depth + 1):
        want = p.node_value(None, logprob, depth=d)
        got = p.local_values(conf.numpy(), np.full(conf.shape, d))
        assert got.dtype == np.float32 and torch.equal(torch.from_numpy(got), want)
    depths = torch.randint(1, SPEC.depth + 3, conf.shape, generator=g).numpy()
    mixed = p.local_values(conf.numpy(), depths)
    for d in range(1, SPEC.depth + 3):
        at = depths == d
        want = p.node_value(None, logprob, depth=min(d, SPEC.depth)).numpy()[at]
        assert (mixed[at] == want).all()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float64])
def test_policy_takes_values_in_any_float_dtype(dtype):
    """Values from a drafter that keeps them in bf16 (numpy has no bf16) size the tree as
    the same numbers in float32 do."""
    values = torch.tensor([[0.875, 0.25, 0.0625], [0.5, 0.125, 0.03125]])  # exact in bf16
    p, q = Policy(CHEAP_VERIFY, SPEC), Policy(CHEAP_VERIFY, SPEC)
    assert torch.equal(p.sizes(values.to(dtype), 1), q.sizes(values, 1))
    assert (p.prefix_values(values.to(dtype)) == q.prefix_values(values)).all()


def test_policy_learns_acceptance_and_falls_back_with_probes():
    """A head that is confident but never right: the ratio drops, the steps go plain, and a
    probe step comes at least every MAX_PROBE steps."""
    p = Policy(CHEAP_VERIFY, SPEC)
    d = drafted([[-1, 0, 1]], [[1.0, 0.9, 0.9]])
    depth = torch.tensor([[0, 1, 2]])
    rejected = torch.tensor([[0, -1, -1]]), torch.tensor([0])
    assert p.speculate()  # no evidence yet
    for _ in range(40):
        p.size(torch.tensor([[0.9, 0.8]]), 2)
        p.observe(d, depth, *rejected)
    assert p.spec_rate() < p.plain_rate()
    assert p.ratio(1, 0.9) < 0.2
    decisions = [p.speculate() for _ in range(4 * MAX_PROBE)]
    assert sum(decisions) >= 3 and not all(decisions)
    gaps = [
        j - i
        for i, j in zip(
            [k for k, x in enumerate(decisions) if x], [k for k, x in enumerate(decisions) if x][1:]
        )
    ]
    assert max(gaps) <= MAX_PROBE


def test_policy_calibrates_each_confidence_band():
    """A head that under-states its top child (confidence 0.5, always accepted) and
    over-states the runner-up (0.3, never accepted): each is valued by its own band's record,
    so the runner-up is worth little and a tree keeps one child. One ratio per depth (1.23
    here: accepted 1 a step over confidence 0.8) would value the runner-up at 0.37, worth its
    10% more verify time."""
    p = Policy(CostModel(1, [1, 2, 4, 10], [1.0, 1.1, 1.3, 1.9], [0.02, 0.04, 0.06, 0.08]), SPEC)
    d = drafted([[-1, 0, 0]], [[1.0, 0.5, 0.3]])
    depth = torch.tensor([[0, 1, 1]])
    first_child_accepted = torch.tensor([[0, 1, -1]]), torch.tensor([1])
    children = torch.tensor([[0.5, 0.3]]).log()
    for _ in range(60):
        p.size(p.node_value(None, children, depth=1), 1)
        p.observe(d, depth, *first_child_accepted)
    values = p.node_value(None, children, depth=1)
    assert values[0, 0] > 0.9 and values[0, 1] < 0.1
    assert p.ratio(1, 0.5) > 1.5 and p.ratio(1, 0.3) < 0.3
    assert p.size(values, 1) == 1


def test_a_node_is_valued_in_the_band_it_is_learnt_in():
    """A draft's confidence is float32; one at an edge's float32 value (0.35 rounds down to
    0.34999999) must fall in the same band when node_value values it (a tensor) as when
    observe learns from it (on the host, in float64). Here it is always accepted: once learnt,
    its value is ~0.9, not the untouched neighbouring band's 0.35."""
    edge = torch.tensor(0.35, dtype=torch.float32)
    near = torch.stack([edge, edge.nextafter(torch.tensor(0.0)), edge.nextafter(torch.tensor(1.0))])
    assert torch.equal(_bands(near), torch.from_numpy(_bands(near.double().numpy())))
    p = Policy(CostModel(1, [1, 2, 4, 10], [1.0, 1.1, 1.3, 1.9], [0.02, 0.04, 0.06, 0.08]), SPEC)
    d = drafted([[-1, 0]], [[1.0, float(edge)]])
    for _ in range(60):
        p.observe(d, torch.tensor([[0, 1]]), torch.tensor([[0, 1]]), torch.tensor([1]))
    assert p.node_value(None, edge.log()[None, None], depth=1)[0, 0] > 0.7


@pytest.mark.parametrize("batch_size", [1, 3])
@pytest.mark.parametrize(
    "cost", [CHEAP_VERIFY, DEAR_VERIFY, None], ids=["cheap", "dear", "measured"]
)
def test_greedy_adaptive_equals_plain(batch_size, cost):
    model = tiny_model()
    plain, _ = run(model, None, "chain:1", batch_size)
    adaptive, stats = run(model, oracle_head(model), "adaptive:4,3,10", batch_size, cost_model=cost)
    assert adaptive == plain
    if cost is CHEAP_VERIFY:
        assert stats.mean_acceptance_length > 1.5
    if cost is DEAR_VERIFY:
        assert stats.nodes_verified < 1.2 * stats.target_forwards  # (nearly) always plain


@pytest.fixture(scope="module")
def small_vocab_model():
    return tiny_model(vocab_size=16, layer_scale=0.01, seed=3)


@pytest.mark.parametrize("sampling", list(SAMPLING))
def test_sampled_adaptive_follows_target(small_vocab_model, sampling):
    plain = first_tokens(small_vocab_model, None, "chain:1", SAMPLING[sampling])
    spec = first_tokens(
        small_vocab_model,
        oracle_head(small_vocab_model),
        "adaptive:3,3,8",
        SAMPLING[sampling],
        cost_model=CHEAP_VERIFY,
    )
    assert same_distribution_pvalue(spec, plain) > 1e-3


# live occupancy: verifying a tree is nearly free for one request, but with four
# requests in the batch every node costs as much as a whole forward (a compute-bound machine)
LOAD = CostModel(
    4,
    [1, 2, 4, 10],
    [1.0, 2.0, 4.0, 10.0],
    [0.5, 1.0, 1.5, 2.0],
    others=[
        dict(
            batch_size=1,
            verify_tokens=[1, 2, 4, 10],
            verify_s=[0.25, 0.2525, 0.255, 0.2625],
            draft_s=[0.005, 0.01, 0.015, 0.02],
        )
    ],
)


def test_cost_model_interpolates_over_batch_sizes():
    assert LOAD.verify(4) == LOAD.verify(4, 4) == 4.0 and LOAD.verify(4, 1) == 0.255
    assert LOAD.verify(4, 2) == pytest.approx(0.255 + (4.0 - 0.255) / 3)  # linear in the batch
    assert (
        LOAD.verify(4, 8) == 4.0
        and LOAD.draft(2, 1) == 0.01
        and LOAD.draft(2, 3) == pytest.approx(0.01 + (1.0 - 0.01) * 2 / 3)
    )
    assert CHEAP_VERIFY.verify(4, 7) == CHEAP_VERIFY.verify(4)  # one batch size measured: that one


def test_measure_covers_smaller_batch_sizes():
    model = tiny_model()
    cost = CostModel.measure(model, EagleHead.random(model, seed=0), SPEC, batch_size=8, repeats=1)
    assert cost.batch_size == 8 and [o["batch_size"] for o in cost.others] == [1, 4]
    assert cost.verify(1, 1) == cost.others[0]["verify_s"][0]


def _half_accepted_chain(p: Policy, steps: int, before_step=None) -> None:
    """`steps` speculative steps of 2-node chains whose draft is accepted every other step;
    before_step(i), if given, runs before step i."""
    d = drafted([[-1, 0]], [[1.0, 0.5]])
    for i in range(steps):
        if before_step is not None:
            before_step(i)
        p.size(torch.tensor([[0.5]]), 1)
        ok = i % 2 == 0
        p.observe(
            d, torch.tensor([[0, 1]]), torch.tensor([[0, 1 if ok else -1]]), torch.tensor([int(ok)])
        )


def test_policy_follows_live_occupancy():
    """Same values, same statistics: one request gets a big tree, a full batch a plain step;
    and the plain / speculative decision follows the occupancy too."""
    p = Policy(LOAD, SPEC)
    v = p.node_value(None, torch.tensor([[0.9, 0.6, 0.3]]).log(), depth=1)
    p.batch = 1
    assert p.size(v, 1) == 3
    p.batch = 4
    assert p.size(v, 1) == 1 or p.size(v, 1) == 0
    assert p.size(p.node_value(None, torch.tensor([[0.3, 0.05, 0.01]]).log(), depth=1), 1) == 0
    # a head accepted half the time on 2-node chains: pays alone, not in a full batch; the
    # occupancy moves between steps, each step's time is priced at its own
    _half_accepted_chain(p, 40, lambda i: setattr(p, "batch", 1 + 3 * (i % 2)))
    p.batch = 1
    assert p.spec_rate() > p.plain_rate() and p.speculate()
    p.batch = 4
    assert p.spec_rate() < p.plain_rate() and not p.speculate()


def test_engine_trees_shrink_under_load():
    """The engine tells the policy the step's occupancy: a lone request verifies bigger trees
    than the same request among three others; outputs stay exact either way."""
    model = tiny_model()
    lone, lone_stats = run(
        model, oracle_head(model), "adaptive:4,3,10", 4, cost_model=LOAD, prompts=PROMPTS[:1]
    )
    full, full_stats = run(model, oracle_head(model), "adaptive:4,3,10", 4, cost_model=LOAD)
    plain, _ = run(model, None, "chain:1", 4)
    assert full == plain and lone[0] == plain[0]
    assert lone_stats.nodes_per_step > 2.0 and full_stats.nodes_per_step < 1.2


# per request: every extra node costs 0.3 of a plain step (the packed forward
# computes the real nodes only), drafting is nearly free
PER_NODE = CostModel(2, [1, 2, 4, 10], [1.0, 1.3, 1.9, 3.7], [0.02, 0.04, 0.06, 0.08])


def test_policy_sizes_each_request_from_its_own_values():
    """A confident and an unsure request in one batch: per request, the confident one gets
    its whole tree and the unsure one the root only; the batch-level rule (the mean) gives
    both the same size."""
    values = torch.tensor([[0.95, 0.9, 0.85], [0.1, 0.05, 0.01]])
    p = Policy(PER_NODE, SPEC)
    p.batch = 2
    assert p.sizes(values, 1).tolist() == [3, 0]
    assert p.sizes(values.flip(0), 1).tolist() == [0, 3]  # rows are independent of order
    batch_level = Policy(PER_NODE, SPEC, per_request=False)
    batch_level.batch = 2
    assert batch_level.sizes(values, 1).tolist() == [3, 3]
    # one request alone: both rules agree (and agree with size())
    for v in values:
        assert p.sizes(v[None], 1).tolist() == batch_level.sizes(v[None], 1).tolist()
        assert p.sizes(v[None], 1).item() == p.size(v[None], 1)
    # ties and a row with fewer real candidates (padding 0): each row keeps a prefix
    sizes = p.sizes(torch.tensor([[0.9, 0.9, 0.0], [0.9, 0.9, 0.9]]), 1)
    assert sizes.tolist() == [2, 3]


def test_greedy_adaptive_per_request_equals_plain_with_mixed_sizes(monkeypatch):
    """Per-request sizes in a batch of 3 (the oracle head is sure of some requests and not of
    others): exact, and the rows' trees did differ within steps (root-only rows included)."""
    model = tiny_model()
    plain, _ = run(model, None, "chain:1", 3)
    chosen = []
    sizes = Policy.sizes

    def spy(self, values, levels):
        chosen.append(sizes(self, values, levels).tolist())
        return torch.tensor(chosen[-1])

    monkeypatch.setattr(Policy, "sizes", spy)
    adaptive, _ = run(model, oracle_head(model), "adaptive:4,3,10", 3, cost_model=PER_NODE)
    assert adaptive == plain
    assert any(min(c) < max(c) for c in chosen) and any(0 in c and max(c) > 0 for c in chosen)


def test_policy_learns_each_requests_record():
    """Same confidences, different track records: the request whose drafts keep failing
    gets a smaller tree than the one whose drafts are accepted (shared per-depth statistics
    alone cannot tell them apart); a new request in the slot starts afresh."""
    p = Policy(PER_NODE, SPEC)
    p.batch, p.slots = 2, [0, 1]
    d = drafted([[-1, 0, 1]] * 2, [[1.0, 0.6, 0.6]] * 2)
    depth = torch.tensor([[0, 1, 2]] * 2)
    # slot 0: both drafts accepted; slot 1: the first rejected
    accepted = torch.tensor([[0, 1, 2], [0, -1, -1]]), torch.tensor([2, 0])
    values = torch.tensor([[0.6, 0.36], [0.6, 0.36]])
    assert p.sizes(values, 2).tolist()[0] == p.sizes(values, 2).tolist()[1]  # no record yet
    for _ in range(10):
        p.sizes(values, 2)
        p.observe(d, depth, *accepted, slots=[0, 1])
    assert p.request_factor(0) > 1 > p.request_factor(1)
    sizes = p.sizes(p.node_value(None, torch.tensor([[0.6, 0.6]] * 2).log(), depth=1), 1)
    assert sizes[0] > sizes[1]
    p.start([1])
    assert p.request_factor(1) == 1.0
    # a lone request keeps no record: with no batch-mates there is nothing to tell apart
    lone = drafted([[-1, 0, 1]], [[1.0, 0.6, 0.6]])
    p.observe(lone, depth[:1], accepted[0][:1], accepted[1][:1], slots=[1])
    assert 1 not in p.request_stats


# float32 SmolLM2-135M on 2 shared CPU cores (seconds): a 2-node verify costs 6% more than a
# plain step, 4 nodes a steep 65% more; each further draft level a head pass over 8 nodes
STEEP = CostModel(
    1,
    [1, 2, 4, 8, 16, 32],
    [0.079, 0.084, 0.130, 0.166, 0.165, 0.194],
    [0.0014, 0.0077, 0.0139, 0.0197, 0.0256, 0.0319],
)


# what simulate() drives: trees of the root's children only
ONE_LEVEL = TreeSpec("adaptive", 1, 8, 32)


def simulate(policy, confidence, accepts, steps: int):
    """Drives policy for `steps` steps of a head whose best draft on step i has confidence(i)
    and, if verified, is accepted iff accepts(i). -> (speculative steps, their sizes, the
    run's tokens per second by the cost model over plain decoding's)."""
    K = policy.spec.topk
    spec_steps, sizes, tokens, seconds = 0, [], 0, 0.0
    for i in range(steps):
        if not policy.speculate():
            tokens, seconds = tokens + 1, seconds + policy.cost.verify(1)
            continue
        c = confidence(i)
        probs = torch.tensor([c] + [0.005] * (K - 1))  # the rest of the mass: a long tail
        v = policy.node_value(None, probs.log()[None], depth=1)
        assert not policy.expand(1, v, v)  # the simulated head drafts one level
        n = int(policy.sizes(v, 1)[0])
        sizes.append(n)
        ok = n > 0 and accepts(i)
        d = drafted([[-1, 0][: n + 1]], [[1.0, c][: n + 1]])
        policy.observe(
            d,
            torch.tensor([[0, 1]])[:, : n + 1],
            torch.tensor([[0, 1 if ok else -1]])[:, : n + 1],
            torch.tensor([int(ok)]),
            slots=[0],
        )
        spec_steps += 1
        tokens += 1 + ok
        seconds += policy.cost.draft(1) + policy.cost.verify(n + 1)
    return spec_steps, sizes, tokens / seconds * policy.cost.verify(1)


def test_policy_speculates_with_a_small_tree_despite_unlucky_probes():
    """Every other step the head is sure (0.7, accepted 2 times in 3), in between unsure
    (0.02: verify the root alone). Speculating earns (1.67 + 1) tokens per (85.4 + 80.4) ms,
    26% above plain's 1 / 79 ms; bigger trees do not pay. The first step is an unsure one,
    and so is every probe after it (their intervals are even): judged by those steps alone,
    speculation looked no better than plain and the policy decoded plainly for good."""
    p = Policy(STEEP, ONE_LEVEL)
    p.batch, p.slots = 1, [0]
    spec_steps, sizes, speedup = simulate(
        p, lambda i: 0.02 if i % 2 == 0 else 0.7, lambda i: i % 6 != 1, 200
    )
    assert spec_steps >= 0.9 * 200 and speedup > 1.2
    assert set(sizes) == {0, 1}
    assert p.spec_rate() > p.plain_rate()


@pytest.mark.parametrize("accepted_every", [20, 0])
def test_policy_loses_little_when_speculation_does_not_pay(accepted_every):
    """The same costs, a sure-looking head (0.5) accepted 5% of the time or never: 1-node
    trees lose to plain. Trying speculation again as the evidence ages costs little: the
    run stays within 3% of plain decoding."""
    p = Policy(STEEP, ONE_LEVEL)
    p.batch, p.slots = 1, [0]
    accepts = lambda i: accepted_every and i % accepted_every == accepted_every - 1  # noqa: E731
    _, _, speedup = simulate(p, lambda i: 0.5, accepts, 400)
    assert speedup > 0.97


def test_policy_prices_rule_one_by_measured_step_times():
    """1.5 tokens per 1.06 s by the cost model: speculation pays 1.4x. Measured, a speculative
    step takes twice its prediction (what start-up timing misses: sampling, bookkeeping,
    ragged trees): it loses, and the steps go plain. Plain steps measured as slow as
    speculative ones restore it; one stalled step moves the factor by a bounded amount."""
    p = Policy(CHEAP_VERIFY, SPEC)
    _half_accepted_chain(p, 40)
    assert p.calibration(True) == 1.0 and p.speculate()
    predicted = p.predicted_step_s(1, 2)
    assert predicted == pytest.approx(CHEAP_VERIFY.draft(1) + CHEAP_VERIFY.verify(2))
    for _ in range(60):
        p.observe_time(2.0 * predicted, True, 1, 2)
    assert p.calibration(True) == pytest.approx(2.0, rel=0.05)
    assert p.spec_rate() < p.plain_rate()
    assert sum(p.speculate() for _ in range(40)) <= 40 // 4 + 1  # the probes only
    for _ in range(60):
        p.observe_time(2.0 * CHEAP_VERIFY.verify(1), False, 0, 1)
    assert p.spec_rate_bound() > p.spec_rate() > p.plain_rate() and p.speculate()
    # clipped: a step 1000x its prediction counts as 2x, in the kind's ratio over every
    # occupancy and in its bucket's, whose prior is the former
    q = Policy(CHEAP_VERIFY, SPEC)
    q.observe_time(1000.0 * predicted, True, 1, 2)
    prior = DECAY * CALIBRATION_PRIOR
    overall = (prior + 2.0) / (prior + 1.0)
    assert q.calibration(True) == pytest.approx((2.0 + BUCKET_PRIOR * overall) / (1 + BUCKET_PRIOR))
    q.batch = 8  # no evidence of its own
    assert q.calibration(True) == pytest.approx(overall)


def _run_at(p: Policy, batch: int, steps: int, plain_ratio: float, spec_ratio: float) -> list:
    """`steps` steps at occupancy `batch` whose measured seconds are plain_ratio (spec_ratio)
    times the cost model's for a plain step (a 1-level, 2-node speculative one). -> the
    speculate() decisions."""
    decisions = []
    for _ in range(steps):
        p.new_step(list(range(batch)))
        speculative = p.speculate()
        decisions.append(speculative)
        levels, nodes = (1, 2) if speculative else (0, 1)
        ratio = spec_ratio if speculative else plain_ratio
        p.observe_time(ratio * p.predicted_step_s(levels, nodes), speculative, levels, nodes)
    return decisions


def test_policy_prices_each_occupancy_by_its_own_steps():
    """Speculation earns 1.4x plain by the cost model. At batch 1 a plain step takes 1.2x
    its prediction (the engine's forward is slower than the one timed), at batch 8 0.6x
    (it batches better): speculation pays at 1 and loses at 8. Priced with one ratio per
    kind, the plain steps at 8 were priced at batch 1's and never run: at 8 the policy
    speculated on every step. Per occupancy, plain is measured at 8 and wins there, and
    batch 1's price is left as it was."""
    p = Policy(CHEAP_VERIFY, SPEC)
    _half_accepted_chain(p, 40)
    first = _run_at(p, 1, 60, plain_ratio=1.2, spec_ratio=1.0)
    assert sum(first[-40:]) >= 38  # speculating (a measuring plain step at most)
    p.batch = 1
    one = p.calibration(False)
    assert 1.15 < one < 1.2  # three plain steps measured, shrunk to the overall ratio
    at_eight = _run_at(p, 8, 40, plain_ratio=0.6, spec_ratio=1.0)
    assert not at_eight[0]  # plain unmeasured at 8, speculation within the margin: measured
    assert sum(at_eight[-30:]) <= 3  # plain, but for the probes
    assert p.calibration(False) == pytest.approx(0.6, rel=0.1)
    assert p.spec_rate_bound() < p.plain_rate()
    p.batch = 1
    assert p.calibration(False) == pytest.approx(one, rel=0.05)  # moved by its prior only
    assert p.spec_rate() > p.plain_rate()
    assert sum(_run_at(p, 1, 20, plain_ratio=1.2, spec_ratio=1.0)) >= 19


def test_policy_measures_plain_steps_only_where_their_price_matters():
    """A measuring plain step runs only for an engine that reports step times, where
    plain's price at the occupancy is unmeasured or stale, and while speculation wins by
    less than MEASURE_MARGIN; it leaves the probes alone."""
    p = Policy(CHEAP_VERIFY, SPEC)
    _half_accepted_chain(p, 40)
    # the first step: no step time reported yet, nothing to calibrate; then three
    # measuring plain steps (MIN_MEASURED)
    first = _run_at(p, 1, 5, plain_ratio=1.0, spec_ratio=1.0)
    assert first == [True, False, False, False, True]
    assert p.plain_streak == 0 and p.probe == 4
    # stale: REMEASURE_STEPS steps since the last plain one (one of them above)
    ages = _run_at(p, 1, REMEASURE_STEPS, plain_ratio=1.0, spec_ratio=1.0)
    assert ages == [True] * (REMEASURE_STEPS - 1) + [False]
    # speculation wins by more than the margin (its steps measured at half the cost
    # model's at batch 1, and priced so at 4 by the kind's overall ratio): plain steps at 4
    # are not measured
    q = Policy(CHEAP_VERIFY, SPEC)
    _half_accepted_chain(q, 40)
    _run_at(q, 1, 80, plain_ratio=1.0, spec_ratio=0.5)
    q.batch = 4
    assert q.spec_rate() > MEASURE_MARGIN * q.plain_rate()
    assert _run_at(q, 4, 5, plain_ratio=1.0, spec_ratio=0.5) == [True] * 5


def test_engine_reports_every_step_time(monkeypatch):
    """The engine times each verify step, whole, and tells the policy its kind and shape
    (by default when it measured the cost model itself); a policy told not to calibrate
    ignores its draft levels' times too."""
    calls, levels = [], []
    real, real_level = Policy.observe_time, Policy.observe_level

    def record(self, seconds, speculative, levels, nodes):
        calls.append((seconds, speculative, levels, nodes))
        real(self, seconds, speculative, levels, nodes)

    def record_level(self, *args):
        real_level(self, *args)
        levels.append(self.level_ratios[1])

    monkeypatch.setattr(Policy, "observe_time", record)
    monkeypatch.setattr(Policy, "observe_level", record_level)
    model = tiny_model()
    # a cost model passed in: its choices stay reproducible, nothing is measured
    run(model, oracle_head(model), "adaptive:4,3,10", 1, cost_model=CHEAP_VERIFY)
    assert calls == []
    assert levels and set(levels) == {CALIBRATION_PRIOR}  # levels timed, not counted
    levels.clear()
    _, stats = run(
        model, oracle_head(model), "adaptive:4,3,10", 1, cost_model=CHEAP_VERIFY, calibrate=True
    )
    assert len(calls) == stats.target_forwards  # batch 1: a forward per step (prefills apart)
    assert all(s > 0 and n >= 1 for s, _, _, n in calls)
    assert all((lv >= 1) == spec for _, spec, lv, _ in calls)
    assert any(spec and n > 1 for _, spec, _, n in calls)
    assert levels and levels[-1] != CALIBRATION_PRIOR  # calibrating: the levels count


def test_measured_costs_are_priced_by_their_lower_convex_envelope():
    """A slow point (a verify of 2 nodes timed +1.2 ms over 1 node, as under load) is dropped
    to the envelope, and so is a dip (verify(16) < verify(8)): a bigger tree never costs less,
    and one more node never costs less than the one before. Already convex, non-decreasing
    curves are unchanged; so are one-point curves."""
    from specdec.speculation.cost_model import cost_curve

    sizes = [1, 2, 4, 8, 16, 32]
    measured = [8.19, 9.42, 9.85, 10.57, 14.82, 20.93]  # a start-up timing on a 2-core Zen 3, ms
    curve = cost_curve(sizes, measured)
    assert curve[0] == 8.19 and curve[3] == 10.57 and curve[5] == 20.93
    assert curve[1] == pytest.approx(8.19 + (10.57 - 8.19) / 7)  # on the chord 1 -> 8
    steps = [(b - a) / (x1 - x0) for a, b, x0, x1 in zip(curve, curve[1:], sizes, sizes[1:])]
    assert all(s2 >= s1 - 1e-12 for s1, s2 in zip(steps, steps[1:])) and steps[0] >= 0
    assert all(c <= m + 1e-12 for c, m in zip(curve, measured))  # never above a measurement
    dip = cost_curve([1, 2, 3, 4], [79.0, 84.0, 170.0, 165.0])
    assert dip == pytest.approx([79.0, 84.0, 124.5, 165.0])
    assert cost_curve([1, 2, 4], [1.0, 2.0, 4.0]) == [1.0, 2.0, 4.0]
    assert cost_curve([1, 2, 3], [5.0, 5.0, 6.0]) == [5.0, 5.0, 6.0]
    assert cost_curve([1], [3.0]) == [3.0] and cost_curve([], []) == []


def test_cost_model_is_timed_as_generate_runs_steps(monkeypatch):
    """The engine measures its cost model inside modules_unchanged (as generate() runs its
    steps: the modules checked once, not at every forward), so a verify of one node is priced
    at what a step pays, not with each forward's module checks on top."""
    from specdec.drafters.eagle import EagleDrafter

    seen = []
    measure = EagleDrafter.measure_cost

    def spy(self, target, tree, batch_size):
        seen.append("_unchanged_kinds" in target.__dict__)
        return measure(self, target, tree, batch_size)

    monkeypatch.setattr(EagleDrafter, "measure_cost", spy)
    model = tiny_model()
    Engine(model, head=oracle_head(model), tree="adaptive:2,2,4", max_seq_len=64)
    assert seen == [True] and "_unchanged_kinds" not in model.__dict__


def test_observe_rejects_a_node_deeper_than_the_spec():
    """A tried node past the spec's depth has no statistics to learn into: a clear error, not
    a count in another depth's cells."""
    p = Policy(CHEAP_VERIFY, SPEC)
    T = SPEC.depth + 2  # a chain: its last node at depth SPEC.depth + 1
    d = drafted([list(range(-1, T - 1))], [[1.0] + [0.9] * (T - 1)])
    depth = torch.arange(T)[None]
    path = torch.arange(T, dtype=torch.int32)[None]
    with pytest.raises(IndexError, match="depth 5 > the spec's 4"):
        p.observe(d, depth, path, torch.tensor([T - 1]))
    within = drafted([list(range(-1, T - 2))], [[1.0] + [0.9] * (T - 2)])
    p.observe(within, depth[:, :-1], path[:, :-1], torch.tensor([T - 2]))  # at the spec's depth
    assert p.accepted[SPEC.depth - 1].sum() > p.confidence[SPEC.depth - 1].sum() > 0


def test_policy_probes_rarely_at_high_occupancy():
    """32 requests a step: a 2-node tree per request costs 1.2x a plain step and confirms
    1.078 tokens per request (one draft in 13 accepted), so speculation loses ~10%. A step's
    tokens are a mean over 32 requests and barely move: the bound's prior variance is one
    request's over 32. With one request's prior at every occupancy the bound stayed wide while
    the evidence aged, and ~15% of the steps speculated."""
    B = 32
    cost = CostModel(B, [1, 2], [1.0, 1.2], [0.001])
    p = Policy(cost, ONE_LEVEL, calibrate=False)
    d = drafted([[-1, 0]] * B, [[1.0, 0.5]] * B)
    depth = torch.tensor([[0, 1]] * B)
    speculative = 0
    steps = 600
    for i in range(steps):
        p.new_step(list(range(B)))
        if not p.speculate():
            continue
        speculative += 1
        p.sizes(torch.full((B, 1), 0.5), 1)
        ok = torch.tensor([(r + i) % 13 == 0 for r in range(B)])
        accepted = torch.stack([torch.zeros(B, dtype=torch.long), torch.where(ok, 1, -1)], 1)
        p.observe(d, depth, accepted, ok.long())
    assert p.spec_rate() < 0.92 * p.plain_rate()
    assert speculative <= 0.08 * steps
