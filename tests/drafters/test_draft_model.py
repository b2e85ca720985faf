"""The standalone draft model drafter (specdec.drafters.draft_model) and its self:N variant.

The target as its own draft model must get every greedy draft accepted (any slip in the draft
cache, its catch-up or its compaction shows as a rejection); a random draft model of another
shape must stay exact (greedy identical to plain, sampled distributed as plain); self:N must
share the target's tensors; the compaction must matter (a drafter that skips it loses
acceptance on trees)."""

import copy

import pytest
import torch

from specdec.drafters.base import root_only
from specdec.drafters.draft_model import DraftModelDrafter
from specdec.errors import InvalidRequestError
from specdec.models.config import ModelArgs
from specdec.models.llama import Transformer
from specdec.runtime.engine import Engine
from specdec.runtime.requests import Request, SamplingParams

from model_testing import CHEAP_VERIFY, PROMPTS, SAMPLING, run, same_distribution_pvalue, tiny_model

pytestmark = pytest.mark.usefixtures("single_thread")

TREES = ["chain:4", "dynamic:4,3,10", "adaptive:4,3,10"]


@pytest.fixture(scope="module")
def model():
    """Full-strength random layers: the next token depends on the whole context, so a stale
    or misplaced KV entry in the draft cache changes the draft model's predictions."""
    return tiny_model(layer_scale=1.0, seed=1)


def other_shape_draft(vocab_size=32, seed=7):
    """A random draft model unlike the target (2 layers, dim 16, one KV head) but for the
    vocabulary."""
    args = ModelArgs(
        vocab_size=vocab_size,
        dim=16,
        n_layers=2,
        n_heads=2,
        n_kv_heads=1,
        head_dim=8,
        hidden_dim=32,
        tie_word_embeddings=True,
        max_position_embeddings=256,
    )
    torch.manual_seed(seed)
    m = Transformer(args).eval()
    with torch.no_grad():
        for p in m.parameters():
            p.normal_(0, 0.5)
    return m


def run_draft(model, drafter, tree, batch_size, params=None, prompts=PROMPTS, **kw):
    if tree.startswith("adaptive"):
        kw.setdefault("cost_model", CHEAP_VERIFY)  # speculation pays: trees are drafted
    eng = Engine(model, drafter=drafter, tree=tree, batch_size=batch_size, max_seq_len=96, **kw)
    results, stats = eng.generate(
        [Request(p, params or SamplingParams(max_new_tokens=24)) for p in prompts]
    )
    return [r.token_ids for r in results], stats


@pytest.fixture(scope="module")
def plain(model):
    return run(model, None, "chain:1", 1)[0]


# ---------------------------------------------------------------------- the target drafts itself
@pytest.mark.parametrize("same_object", [True, False])
@pytest.mark.parametrize("batch_size", [1, 3])
def test_target_as_its_own_draft_accepts_every_greedy_draft(model, plain, same_object, batch_size):
    draft = model if same_object else copy.deepcopy(model)
    out, stats = run_draft(model, DraftModelDrafter(draft), "chain:4", batch_size)
    assert out == plain
    hist = stats.first_rejection_hist  # steps by accepted drafts
    # every step accepts all 4 drafts but possibly each request's last (its cache / token
    # limit truncates the tree)
    assert hist[4] >= stats.target_forwards - len(PROMPTS)
    assert stats.mean_acceptance_length > 4.5


class EveryOtherStepPlain(DraftModelDrafter):
    """Proposes the root alone every other step without running the draft model, as the
    engine does on adaptive mode's plain steps: the emitted tokens pile up as pending."""

    steps = 0

    def propose(self, slots, roots, sampling, policy=None):
        self.steps += 1
        if self.steps % 2:
            return root_only(roots)
        return super().propose(slots, roots, sampling, policy)


def test_catch_up_after_plain_steps(model, plain):
    """The target as its own draft still drafts perfectly after plain steps: the catch-up runs
    every token emitted since the draft model last ran, in order."""
    out, stats = run_draft(model, EveryOtherStepPlain(model), "chain:4", 3)
    assert out == plain
    hist = stats.first_rejection_hist
    assert hist[0] + hist[4] >= stats.target_forwards - len(PROMPTS)  # plain or all accepted
    assert hist[4] >= stats.target_forwards // 2 - len(PROMPTS)


# ---------------------------------------------------------------------- exactness
@pytest.mark.parametrize("draft_kind", ["other-shape", "perturbed-target"])
@pytest.mark.parametrize("tree", TREES)
@pytest.mark.parametrize("batch_size", [1, 3])
def test_greedy_random_draft_model_equals_plain(model, plain, draft_kind, tree, batch_size):
    """batch_size 3 < 4 prompts: the last request takes a slot freed mid-run (its draft cache
    is reset and refilled)."""
    if draft_kind == "other-shape":
        draft = other_shape_draft()
    else:  # the target's weights with other layers: right often, not always
        draft = tiny_model(layer_scale=1.0, seed=1)
        with torch.no_grad():
            draft.layers[-1].feed_forward.w2.weight.mul_(0.5)
    out, stats = run_draft(model, DraftModelDrafter(draft), tree, batch_size)
    assert out == plain
    if draft_kind == "perturbed-target":
        assert stats.mean_acceptance_length > 1.5  # drafts were really accepted


def test_sampled_request_independent_of_batch(model):
    """Sampled chain drafts draw from the request's own generator."""
    drafter = DraftModelDrafter(other_shape_draft())
    params = SamplingParams(temperature=0.9, top_p=0.95, seed=1234, max_new_tokens=16)
    eng = Engine(model, drafter=drafter, tree="chain:3", batch_size=3, max_seq_len=96)
    alone, _ = eng.generate([Request(PROMPTS[2], params)])
    mates = [
        Request(p, SamplingParams(temperature=1.0, seed=i, max_new_tokens=20))
        for i, p in enumerate(PROMPTS)
    ]
    mixed, _ = eng.generate(mates[:2] + [Request(PROMPTS[2], params)] + mates[2:])
    assert mixed[2].token_ids == alone[0].token_ids


# ---------------------------------------------------------------------- sampled: follows the target
N_SEEDS = 2000
N_TOKENS = 3


def sampled_tokens(target, drafter, tree, params):
    eng = Engine(target, drafter=drafter, tree=tree, batch_size=250, max_seq_len=32)
    reqs = [
        Request([1, 2, 3], SamplingParams(**params, seed=s, max_new_tokens=N_TOKENS))
        for s in range(N_SEEDS)
    ]
    results, stats = eng.generate(reqs)
    return torch.tensor([r.token_ids for r in results]), stats


@pytest.fixture(scope="module")
def sampling_models():
    """A small-vocabulary target and a draft that agrees with it only in part (the same
    weights, layers ten times stronger): the draft distribution differs from the target's."""
    return tiny_model(vocab_size=16, layer_scale=0.01, seed=3), tiny_model(
        vocab_size=16, layer_scale=0.1, seed=3
    )


@pytest.fixture(scope="module")
def plain_samples(sampling_models):
    target, _ = sampling_models
    return {
        key: sampled_tokens(target, None, "chain:1", params)[0] for key, params in SAMPLING.items()
    }


@pytest.mark.parametrize(
    "sampling,tree", [("t1", "chain:3"), ("filtered", "chain:3"), ("t1", "dynamic:3,3,8")]
)
def test_sampled_draft_model_follows_target(sampling_models, plain_samples, sampling, tree):
    """chain: drafts sampled from the draft model's distribution, passed as draft_probs;
    dynamic: top-k drafts, point masses."""
    target, draft = sampling_models
    spec, stats = sampled_tokens(target, DraftModelDrafter(draft), tree, SAMPLING[sampling])
    assert same_distribution_pvalue(spec, plain_samples[sampling]) > 1e-3
    assert stats.mean_acceptance_length > 1.1  # drafts were accepted


def test_draft_probs_unlike_the_drafts_are_detected(sampling_models, plain_samples, monkeypatch):
    """Broken: the chain drafts are the argmax while draft_probs claims they were sampled from
    the draft distribution. (Dropping draft_probs altogether would stay exact: the drafts are
    then verified as point masses, which only accepts less.)"""
    from specdec.drafters import draft_model

    monkeypatch.setattr(draft_model, "sample_rows", lambda probs, generators: probs.argmax(-1))
    target, draft = sampling_models
    spec, _ = sampled_tokens(target, DraftModelDrafter(draft), "chain:3", SAMPLING["t1"])
    assert same_distribution_pvalue(spec, plain_samples["t1"]) < 1e-6


# ---------------------------------------------------------------------- self:N
def test_self_draft_shares_the_target_storage(model):
    drafter = DraftModelDrafter.self_draft(model, 2)
    net = drafter.net
    assert len(net.layers) == 2 and net.n_layers == 2
    target_ptrs = {p.data_ptr() for p in model.parameters()}
    assert all(p.data_ptr() in target_ptrs for p in net.parameters())
    pairs = [
        (net.tok_embeddings.weight, model.tok_embeddings.weight),
        (net.norm.weight, model.norm.weight),
        (net.output.weight, model.output.weight),
    ] + [
        (a, b)
        for i in range(2)
        for a, b in zip(net.layers[i].parameters(), model.layers[i].parameters())
    ]
    assert all(a.data_ptr() == b.data_ptr() for a, b in pairs)


@pytest.mark.parametrize("n", [1, 3])
@pytest.mark.parametrize("tree", TREES)
def test_self_draft_equals_plain(model, plain, n, tree):
    drafter = DraftModelDrafter.self_draft(model, n)
    out, stats = run_draft(model, drafter, tree, 3)
    assert out == plain
    if n == 3:  # all the target's layers: the greedy chain is always right
        assert stats.mean_acceptance_length > (4.5 if tree == "chain:4" else 2.5)


def test_self_draft_cache_has_n_layers(model):
    drafter = DraftModelDrafter.self_draft(model, 2)
    Engine(model, drafter=drafter, tree="chain:3", batch_size=2, max_seq_len=64)
    assert drafter.cache.k.shape[0] == 2


# ---------------------------------------------------------------------- the compaction matters
def test_skipping_the_compaction_loses_acceptance(model, plain, monkeypatch):
    """On a tree the accepted nodes' KV sits at scattered scratch positions: a drafter that
    only advanced cache_lens would draft from the wrong keys. (On a chain the compaction is the
    identity: node d already sits at its final position.)"""
    from specdec.drafters import draft_model

    tree = "dynamic:4,3,10"
    _, good = run_draft(model, DraftModelDrafter(model), tree, 1)

    real_ops = draft_model.ops

    class NoCompaction:
        def __getattr__(self, name):
            skip = name == "compact_kv"
            return (lambda *a, **k: None) if skip else getattr(real_ops, name)

    monkeypatch.setattr(draft_model, "ops", NoCompaction())
    out, broken = run_draft(model, DraftModelDrafter(model), tree, 1)
    assert out == plain  # still exact: only the speed suffers
    assert broken.mean_acceptance_length < good.mean_acceptance_length - 0.5


# ---------------------------------------------------------------------- errors
def test_vocabulary_mismatch_is_rejected(model):
    drafter = DraftModelDrafter(other_shape_draft(vocab_size=40))
    with pytest.raises(InvalidRequestError, match="--draft-model.*40 tokens.*32"):
        Engine(model, drafter=drafter, tree="chain:3")


@pytest.mark.parametrize("n", [0, 4, -1, 2.0, True])
def test_self_draft_layers_out_of_range(model, n):
    with pytest.raises(InvalidRequestError, match=r"self:N: N must be an integer in \[1, 3\]"):
        DraftModelDrafter.self_draft(model, n)


@pytest.mark.parametrize("spec", ["self:0", "self:9", "self:", "self:x", "self:-1"])
def test_draft_model_argument(model, spec):
    with pytest.raises(InvalidRequestError, match="--draft-model"):
        DraftModelDrafter.from_arg(spec, model)


def test_not_a_model():
    with pytest.raises(InvalidRequestError, match="--draft-model"):
        DraftModelDrafter("model.gguf")


def test_topk_beyond_the_vocabulary(model):
    from specdec.errors import InvalidTreeSpecError

    with pytest.raises(InvalidTreeSpecError, match="TOPK"):
        Engine(model, drafter=DraftModelDrafter(model), tree="dynamic:2,33,40")


# ---------------------------------------------------------------------- cost model
def test_measure_cost_fills_draft_times(model):
    from specdec.speculation.trees import TreeSpec

    drafter = DraftModelDrafter.self_draft(model, 2)
    cost = drafter.measure_cost(model, TreeSpec.parse("adaptive:3,2,6"), 2)
    assert len(cost.draft_s) == 3 and all(t > 0 for t in cost.draft_s)
    assert cost.verify_s[0] > 0 and cost.others and all(len(o["draft_s"]) == 3 for o in cost.others)


# ---------------------------------------------------------------------- the command line
def test_cli_method_draft_self(capsys, tmp_path):
    import json

    from specdec.cli import main

    out = tmp_path / "out.jsonl"
    main(
        [
            "generate",
            "--prompt",
            "What is 2 + 2?",
            "--method",
            "draft",
            "--draft-model",
            "self:30",
            "--tree",
            "chain:2",
            "--max-new-tokens",
            "6",
            "--dtype",
            "float32",
            "--output",
            str(out),
        ]
    )
    assert "draft self:30 chain:2" in capsys.readouterr().out
    row = json.loads(out.read_text())
    assert row["token_ids"] and row["stats"]["mean_acceptance_length"] > 2.0


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--method", "draft"], "--method draft needs --draft-model PATH|self:N"),
        (
            ["--method", "draft", "--draft-model", "self:31"],
            "--draft-model self:N: N must be an integer in [1, 30]",
        ),
        (["--method", "draft", "--draft-model", "/nonexistent"], "--draft-model /nonexistent"),
    ],
)
def test_cli_draft_errors(capsys, argv, message):
    from specdec.cli import main

    with pytest.raises(SystemExit) as e:
        main(["generate", "--prompt", "hi", *argv])
    err = capsys.readouterr().err
    assert e.value.code == 2 and message in err and len(err.strip().splitlines()) == 1
