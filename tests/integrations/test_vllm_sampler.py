"""specdec's rejection sampling inside vLLM (sampler.py) against vLLM's own, on the inputs
vLLM's RejectionSampler hands it: greedy output token-identical to vLLM's CPU kernels, and
sampled output distributed as the target processed the way vLLM processes it (temperature,
top-k, top-p through RejectionSampler.forward), a deliberately wrong sampler failing the same
statistical test (tests/ops/test_rejection_stats.py's idiom)."""

import pytest
import scipy.stats
import torch

from specdec.integrations.vllm.version import INSTALL_HINT, installed_version

pytestmark = pytest.mark.skipif(
    installed_version() is None, reason=f"vLLM is not installed: {INSTALL_HINT}"
)

N = 20_000  # independent copies of one problem, one call
V, K = 12, 3
P_MIN_EXACT, P_MAX_WRONG = 1e-3, 1e-6


@pytest.fixture(scope="module")
def vllm_sampling():
    """vLLM's rejection_sampler module with the CPU platform's kernels registered (as in a
    worker), and specdec's sampler module; vLLM's own function restored afterwards."""
    from vllm.platforms import current_platform
    from vllm.v1.sample import rejection_sampler

    from specdec.integrations.vllm import sampler

    current_platform.register_triton_kernel_overrides()
    own = rejection_sampler.rejection_sample
    yield rejection_sampler, own, sampler
    rejection_sampler.rejection_sample = own


def _metadata(B, temperature=None, top_k=None, top_p=None, generators=None):
    from specdec.bench.vllm import sampling_metadata

    return sampling_metadata(B, temperature, top_k, top_p, generators)


def _greedy_inputs(num_draft_tokens, vocab, gen):
    n = sum(num_draft_tokens)
    logits = torch.randn(n, vocab, generator=gen) * 2
    best = logits.argmax(-1)
    guess = torch.randint(vocab, (n,), generator=gen)
    drafts = torch.where(torch.rand(n, generator=gen) < 0.6, best, guess).to(torch.int32)
    cu = torch.cumsum(torch.tensor(num_draft_tokens, dtype=torch.int32), 0, dtype=torch.int32)
    bonus = torch.randint(vocab, (len(num_draft_tokens), 1), generator=gen)
    return drafts, list(num_draft_tokens), max(num_draft_tokens), cu, None, logits, bonus


@pytest.mark.parametrize(
    "num_draft_tokens",
    [[4] * 6, [1], [4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4] * 3, [3, 0, 1, 3, 2], [0, 2], [0] * 3],
    ids=["uniform", "one-draft", "batch-36", "mixed", "with-empty", "no-drafts"],
)
def test_greedy_equals_vllm(vllm_sampling, num_draft_tokens, _fresh_seed):
    _, own, sampler = vllm_sampling
    gen = torch.Generator().manual_seed(_fresh_seed)
    for _ in range(20):
        args = _greedy_inputs(num_draft_tokens, 500, gen)
        meta = _metadata(len(num_draft_tokens))
        assert torch.equal(sampler.rejection_sample(*args, meta), own(*args, meta))


def test_placeholder_drafts_are_never_accepted(vllm_sampling, _fresh_seed):
    """vLLM schedules -1 placeholder drafts for a request it has no drafts for yet: the row
    ends before its first placeholder, as vLLM's own kernels (a -1 never matches)."""
    _, own, sampler = vllm_sampling
    gen = torch.Generator().manual_seed(_fresh_seed)
    for _ in range(10):
        drafts, counts, k, cu, _, logits, bonus = _greedy_inputs([3, 3, 2], 50, gen)
        drafts[1:3] = -1  # request 0 from its second draft
        drafts[3:6] = -1  # request 1 entirely
        args = (drafts, counts, k, cu, None, logits, bonus)
        got = sampler.rejection_sample(*args, _metadata(3))
        assert torch.equal(got, own(*args, _metadata(3)))
        assert (got[0, 2:] == -1).all() and got[1, 0] == logits[3].argmax() and got[1, 1] == -1


def _spec_metadata(num_draft_tokens, drafts):
    from vllm.v1.spec_decode.metadata import SpecDecodeMetadata

    n = torch.tensor(num_draft_tokens)
    starts = torch.cumsum(n + 1, 0) - (n + 1)  # each request's first logits row
    targets = torch.cat([s + torch.arange(k) for s, k in zip(starts.tolist(), num_draft_tokens)])
    return SpecDecodeMetadata(
        draft_token_ids=drafts,
        num_draft_tokens=list(num_draft_tokens),
        cu_num_draft_tokens=torch.cumsum(n, 0).to(torch.int32),
        cu_num_sampled_tokens=torch.cumsum(n + 1, 0).to(torch.int32),
        target_logits_indices=targets.to(torch.int32),
        bonus_logits_indices=(starts + n).to(torch.int32),
        logits_indices=torch.arange(int((n + 1).sum()), dtype=torch.int32),
    )


def _sample_copies(layout, seed):
    """N copies of one chain problem through vLLM's RejectionSampler.forward (temperature
    0.8, top-k 6, top-p 0.9) with whichever rejection_sample is installed -> (output
    [N, K + 1], the K + 1 logits rows, the drafts). layout "uniform": every copy drafts K
    tokens; "mixed": every other copy K - 1 (specdec's padded layout)."""
    from vllm.v1.sample.rejection_sampler import RejectionSampler
    from vllm.v1.sample.sampler import Sampler

    gen = torch.Generator().manual_seed(seed)
    rows = torch.randn(K + 1, V, generator=gen)
    drafts = rows[:K].argsort(dim=-1, descending=True)[:, 1]  # each the 2nd likeliest token
    counts = [K if layout == "uniform" or i % 2 == 0 else K - 1 for i in range(N)]
    logits = torch.cat([torch.cat((rows[:k], rows[K:])) for k in counts])  # k drafts + bonus
    flat = torch.cat([drafts[:k] for k in counts]).to(torch.int32)
    meta = _metadata(N, temperature=0.8, top_k=6, top_p=0.9)
    out = RejectionSampler(Sampler())(_spec_metadata(counts, flat), None, logits, meta)
    return out.sampled_token_ids, rows, drafts


# (temperature, top-k or None, top-p) of the sampled requests
SAMPLING = (0.8, 6, 0.9)


def _processed(rows, sampling=SAMPLING):
    """The target distribution of each row as vLLM processes it: / temperature, top-k, top-p."""
    from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p

    n = len(rows)
    temperature, top_k, top_p = sampling
    k = None if top_k is None else torch.full((n,), top_k)
    x = apply_top_k_top_p(rows / temperature, k, torch.full((n,), top_p))
    return torch.softmax(x.double(), dim=-1)


def _pvalue(samples, probs):
    if (samples < 0).any():  # a position left empty where a token is due
        return 0.0
    counts = torch.bincount(samples.long(), minlength=V).double()
    support = probs > 0
    if counts[~support].sum() > 0:
        return 0.0
    obs, exp = counts[support], probs[support] / probs[support].sum() * len(samples)
    return float(scipy.stats.chisquare(obs.numpy(), exp.numpy()).pvalue)


def _fit(out, rows, drafts):
    """p-values: the first token against the target at the root; the second, given the first
    draft was accepted, against the target after it."""
    p = _processed(rows)
    first = _pvalue(out[:, 0], p[0])
    second = _pvalue(out[out[:, 0] == drafts[0], 1], p[1])
    return first, second


def _wrong_rejection_sample(
    draft_token_ids,
    num_draft_tokens,
    max_spec_len,
    cu,
    draft_probs,
    target_logits,
    bonus_token_ids,
    sampling_metadata,
    **_,
):
    """A plausible mistake: a rejected draft is replaced by a sample of the target itself,
    not of the residual (the target without the rejected token), so the token is over-drawn."""
    probs = torch.softmax(target_logits.float(), dim=-1)
    out = torch.full((len(num_draft_tokens), max_spec_len + 1), -1, dtype=torch.int32)
    start = 0
    for b, k in enumerate(num_draft_tokens):
        for j in range(k + 1):
            if j == k:
                out[b, j] = int(bonus_token_ids[b, 0])
                break
            x = int(draft_token_ids[start + j])
            if torch.rand(()) < probs[start + j, x]:
                out[b, j] = x
                continue
            out[b, j] = int(torch.multinomial(probs[start + j], 1))
            break
        start += k
    return out


@pytest.fixture
def installed(vllm_sampling):
    """specdec's sampler installed as the plugin installs it, vLLM's restored afterwards."""
    module, own, sampler = vllm_sampling
    own_expand = module.expand_batch_to_tokens
    sampler.install()
    yield module
    module.rejection_sample, module.expand_batch_to_tokens = own, own_expand


@pytest.mark.parametrize("layout", ["uniform", "mixed"])
def test_sampled_distribution_is_the_targets(installed, layout, _fresh_seed):
    first, second = _fit(*_sample_copies(layout, _fresh_seed))
    assert first > P_MIN_EXACT and second > P_MIN_EXACT, (first, second)


def test_vllm_kernels_pass_the_same_test(installed, vllm_sampling, _fresh_seed):
    """The test's own check: vLLM's rejection kernels pass it (given sampling parameters
    expanded correctly, see test_parameters_are_expanded_per_draft)."""
    installed.rejection_sample = vllm_sampling[1]
    first, second = _fit(*_sample_copies("uniform", _fresh_seed))
    assert first > P_MIN_EXACT and second > P_MIN_EXACT, (first, second)


def test_a_wrong_sampler_fails_the_same_test(installed, _fresh_seed):
    installed.rejection_sample = _wrong_rejection_sample
    first, _ = _fit(*_sample_copies("uniform", _fresh_seed))
    assert first < P_MAX_WRONG, first


def test_parameters_are_expanded_per_draft(installed):
    """Per-request temperature / top-k / top-p repeated for each draft token, as vLLM's
    rejection sampler asks (vLLM 0.32's CPU kernel returns uninitialised memory for float and
    int32 inputs: sampler.py's docstring)."""
    cu = torch.tensor([3, 3, 5], dtype=torch.int32)
    temperature = torch.tensor([0.5, 0.7, 0.0])
    got = installed.expand_batch_to_tokens(temperature, cu, 5, replace_from=0, replace_to=1)
    assert torch.equal(got, torch.tensor([0.5, 0.5, 0.5, 1.0, 1.0]))
    top_k = torch.tensor([6, 9, 2], dtype=torch.int32)
    assert torch.equal(
        installed.expand_batch_to_tokens(top_k, cu, 5),
        torch.tensor([6, 6, 6, 2, 2], dtype=torch.int32),
    )


def test_seeded_requests_repeat(vllm_sampling):
    """A request with a seed (vLLM's per-request generator) draws its uniforms from it: the
    same seed gives the same tokens."""
    _, _, sampler = vllm_sampling
    gen = torch.Generator().manual_seed(0)
    args = _greedy_inputs([3, 3], 50, gen)

    def run():
        g = {0: torch.Generator().manual_seed(7), 1: torch.Generator().manual_seed(8)}
        return sampler.rejection_sample(*args, _metadata(2, temperature=1.0, generators=g))

    assert torch.equal(run(), run())


# Trees inside vLLM's step (trees.py): root -> a, b (siblings: the root's two likeliest
# tokens), a -> c (the likeliest after a); vLLM's draft tokens are the nodes a, b, c in
# topological order and its logits rows the nodes' (the last, node c's, its bonus row).
TREE = [-1, 0, 0, 1]


@pytest.fixture
def tree_step():
    from specdec.integrations.vllm import trees

    saved = dict(trees._step)
    yield trees
    trees._step.clear()
    trees._step.update(saved)


def _tree_copies(trees, seed, sampling):
    """N copies of the TREE problem through vLLM's RejectionSampler.forward in a tree step
    (sampling: temperature, top-k, top-p) -> (output [N, 4], the 4 logits rows, (a, b, c))."""
    from vllm.v1.sample.rejection_sampler import RejectionSampler
    from vllm.v1.sample.sampler import Sampler

    gen = torch.Generator().manual_seed(seed)
    rows = torch.randn(len(TREE), V, generator=gen)
    order = rows.argsort(dim=-1, descending=True)
    nodes = (int(order[0, 0]), int(order[0, 1]), int(order[1, 0]))
    drafts = torch.tensor(nodes * N, dtype=torch.int32)
    trees._step["parents"] = {b: TREE for b in range(N)}
    temperature, top_k, top_p = sampling
    meta = _metadata(N, temperature=temperature, top_k=top_k, top_p=top_p)
    spec = _spec_metadata([len(TREE) - 1] * N, drafts)
    out = RejectionSampler(Sampler())(spec, None, rows.repeat(N, 1), meta)
    trees._step["parents"] = {}
    return out.sampled_token_ids, rows, nodes


def _tree_fit(out, rows, nodes, sampling):
    """p-values of every emitted position against the target at the node it follows: the
    first token at the root, the next after a, after b (a sibling's path) and after a-c.
    A position with fewer than 500 samples (a path the sampler never takes) fails."""
    a, b, c = nodes
    p = _processed(rows, sampling)
    cases = {
        "first": (out[:, 0], p[0]),
        "after a": (out[out[:, 0] == a, 1], p[1]),
        "after b": (out[out[:, 0] == b, 1], p[2]),
        "after a, c": (out[(out[:, 0] == a) & (out[:, 1] == c), 2], p[3]),
    }
    return {k: _pvalue(s, q) if len(s) >= 500 else 0.0 for k, (s, q) in cases.items()}


TREE_SAMPLING = pytest.mark.parametrize(
    "sampling", [SAMPLING, (1.0, None, 0.9)], ids=["t0.8-topk-topp", "t1-topp"]
)


@TREE_SAMPLING
def test_tree_step_samples_the_targets_distribution(installed, tree_step, sampling, _fresh_seed):
    out, rows, nodes = _tree_copies(tree_step, _fresh_seed, sampling)
    pvalues = _tree_fit(out, rows, nodes, sampling)
    assert min(pvalues.values()) > P_MIN_EXACT, pvalues


@TREE_SAMPLING
def test_a_tree_step_sampled_as_chains_fails_the_same_test(
    installed, tree_step, monkeypatch, sampling, _fresh_seed
):
    """A plausible mistake: the drafted parents never reach the sampler, so the siblings are
    verified as one chain (a -> b -> c) and b's path is never emitted."""
    monkeypatch.setattr(tree_step, "write_step_trees", lambda parents: None)
    out, rows, nodes = _tree_copies(tree_step, _fresh_seed, sampling)
    pvalues = _tree_fit(out, rows, nodes, sampling)
    assert min(pvalues.values()) < P_MAX_WRONG, pvalues


def test_ragged_tree_step_walks_as_the_padded_layout(vllm_sampling, tree_step, _fresh_seed):
    """Trees of several sizes and a request without drafts (an arrival) in one step: the
    walks per draft count over vLLM's rows in place (or gathered) give the padded layout's
    accepted nodes, counts and tokens (chain_batch, node k holding the bonus token)."""
    _, _, sampler = vllm_sampling
    step_trees = {0: [-1, 0, 0, 1], 1: [-1, 0], 3: [-1, 0, 1, 1, 0], 4: [-1, 0, 0, 2]}
    counts = [3, 1, 0, 4, 3]  # the 3-node trees not consecutive: their rows gathered
    B, K = len(counts), max(counts)
    gen = torch.Generator().manual_seed(_fresh_seed)
    for _ in range(20):
        drafts, _, _, cu, _, logits, bonus = _greedy_inputs(counts, 8, gen)
        tree_step._step["parents"] = step_trees
        got = sampler.rejection_sample(drafts, counts, K, cu, None, logits, bonus, _metadata(B))
        got_nodes, got_accepted = tree_step._step["accepted"]
        padded = sampler.chain_batch(drafts, counts, K, None, logits, bonus)
        tree_step.write_step_trees(padded.parents)
        nodes, accepted, tokens = padded.walk(
            torch.zeros(B), torch.zeros(B, dtype=torch.int32), torch.ones(B), torch.zeros(B, K + 2)
        )
        assert torch.equal(got, tokens)
        assert torch.equal(got_nodes, nodes) and torch.equal(got_accepted, accepted)
