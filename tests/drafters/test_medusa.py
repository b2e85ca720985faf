"""Medusa heads (specdec.drafters.medusa_heads), their drafter (specdec.drafters.medusa) and trainer
(specdec.training.medusa).

Greedy decoding with random heads must reproduce plain greedy decoding at batch 1 and 3 (a
slot reused) for chain, sparse-tree and adaptive trees; sampled decoding must follow the
target (two-sample test). "Oracle" heads of a model whose continuation is known accept long
drafts only if head k really drafts depth k from the last accepted node's hidden state
(heads shifted by one position get almost nothing accepted)."""

import os

import pytest
import torch
from test_drafters import N_SEEDS, REPEATING

from specdec.drafters import PlainDrafter
from specdec.drafters.medusa import MedusaDrafter, generic_prior, sparse_tree
from specdec.drafters.medusa_heads import MedusaHeads, load_medusa
from specdec.errors import HeadMismatchError, InvalidTreeSpecError, ModelLoadError
from specdec.runtime.engine import Engine
from specdec.runtime.requests import Request, SamplingParams
from specdec.training.data import load_shards
from specdec.training.medusa import evaluate_medusa, make_medusa_batch, train_medusa

from model_testing import (  # noqa: F401 (fixtures: tiny self-distillation shards)
    CHEAP_VERIFY,
    PROMPTS,
    SAMPLING,
    data_dir,
    run,
    same_distribution_pvalue,
    target,
    tiny_model,
)

pytestmark = pytest.mark.usefixtures("single_thread")

PERIOD = 8


@pytest.fixture(scope="module")
def model():
    return tiny_model()


def run_medusa(model, heads, tree, batch_size, prompts=PROMPTS, max_new_tokens=24, **kw):
    eng = Engine(
        model, drafter=MedusaDrafter(heads), tree=tree, batch_size=batch_size, max_seq_len=96, **kw
    )
    results, stats = eng.generate(
        [Request(p, SamplingParams(max_new_tokens=max_new_tokens)) for p in prompts]
    )
    return [r.token_ids for r in results], stats


# ---------------------------------------------------------------------- the sparse tree
def test_sparse_tree_takes_the_best_products_in_topological_order():
    acc = [[0.8, 0.1], [0.5, 0.3]]
    # values: (0)=.8 (0,0)=.4 (0,1)=.24 (1)=.1 (1,0)=.05 (1,1)=.03
    assert sparse_tree(acc, 4) == [(-1, 1, 0), (0, 2, 0), (0, 2, 1), (-1, 1, 1)]
    assert sparse_tree(acc, 10) == sparse_tree(acc, 6)  # only 6 paths exist
    assert sparse_tree([[0.9], [0.9], [0.9]], 5) == [(-1, 1, 0), (0, 2, 0), (1, 3, 0)]


# ---------------------------------------------------------------------- greedy: exact
@pytest.mark.parametrize(
    "tree,cost",
    [("chain:3", None), ("dynamic:3,3,10", None), ("adaptive:4,3,10", CHEAP_VERIFY)],
    ids=["chain", "tree", "adaptive"],
)
@pytest.mark.parametrize("batch_size", [1, 3])
def test_greedy_medusa_equals_plain(model, tree, cost, batch_size):
    """batch_size 3 < 4 prompts: the last request takes a slot freed mid-run (start resets it)."""
    plain, plain_stats = run(model, None, "chain:1", batch_size)
    heads = MedusaHeads.random(model, num_heads=4, num_layers=2, seed=1, scale=0.3)
    out, stats = run_medusa(model, heads, tree, batch_size, cost_model=cost)
    assert out == plain
    if tree.startswith("dynamic"):  # vocab 32, 3 candidates per head: some random drafts hit
        assert stats.target_forwards < plain_stats.target_forwards


# ---------------------------------------------------------------------- oracle heads
def one_hot_copying_model(period=PERIOD):
    """Greedy continuation t -> t + 1 (mod period for t < period), as
    test_drafters.copying_model, with one-hot embeddings (vocab = dim = 32): no layer
    contributes, so the final-norm hidden state of token t is c * e_t (c = sqrt(dim))."""
    model = tiny_model()
    V = model.args.vocab_size
    succ = torch.arange(1, V + 1)
    succ[period - 1], succ[V - 1] = 0, period
    with torch.no_grad():
        for layer in model.layers:
            layer.attention.wo.weight.zero_()
            layer.feed_forward.w2.weight.zero_()
        model.tok_embeddings.weight.copy_(torch.eye(V))
        model.output.weight.zero_()
        model.output.weight[succ] = 10 * torch.eye(V)
    return model, succ


def oracle_heads(model, succ, shift=0):
    """Head k maps c * e_t to c * e_t + 2c * e_{succ^(k + shift)(t)}: the lm_head then ranks
    succ^(k + shift + 1)(t) first, the token k + 1 + shift positions after t. shift 0 is right."""
    V, K = model.args.vocab_size, 4
    heads = MedusaHeads(model, num_heads=K)
    perm = torch.arange(V)
    with torch.no_grad():
        for _ in range(shift):
            perm = succ[perm]
        for k in range(K):
            perm = succ[perm]  # t -> succ^(k + 1 + shift)(t)
            heads.weight[k, 0].zero_()
            heads.weight[k, 0][perm, torch.arange(V)] = 2.0
    return heads


ORACLE_PROMPTS = [[0, 1, 2, 3], [9, 10], [20, 21, 22, 23, 24], [5]]  # both cycles of succ


@pytest.mark.parametrize("tree", ["chain:4", "dynamic:4,2,9", "adaptive:4,2,9"])
@pytest.mark.parametrize("batch_size", [1, 3])
def test_oracle_heads_accept_long_drafts(tree, batch_size):
    model, succ = one_hot_copying_model()
    params = SamplingParams(max_new_tokens=30)
    ref, plain_stats = run(
        model, None, "chain:1", batch_size, prompts=ORACLE_PROMPTS, params=params
    )
    assert ref[0][:6] == [4, 5, 6, 7, 0, 1]
    kw = {"cost_model": CHEAP_VERIFY} if tree.startswith("adaptive") else {}
    heads = oracle_heads(model, succ)
    out, stats = run_medusa(model, heads, tree, batch_size, ORACLE_PROMPTS, 30, **kw)
    assert out == ref
    assert stats.mean_acceptance_length > 3.5
    assert stats.target_forwards <= plain_stats.target_forwards / 3
    # heads one position off (head k drafting depth k + 1): exact, but nothing accepted
    heads = oracle_heads(model, succ, shift=1)
    out, stats = run_medusa(model, heads, tree, batch_size, ORACLE_PROMPTS, 30, **kw)
    assert out == ref
    assert stats.mean_acceptance_length < 1.2


def test_oracle_heads_learn_their_accuracy():
    """Always-right top-1 candidates: the estimated top-1 accuracy of every head rises from
    the prior towards 1, the rank-2 one falls, and the tree's top-1 chain ranks first."""
    model, succ = one_hot_copying_model()
    drafter = MedusaDrafter(oracle_heads(model, succ))
    eng = Engine(model, drafter=drafter, tree="dynamic:4,2,6", max_seq_len=128)
    eng.generate([Request([0, 1, 2], SamplingParams(max_new_tokens=100))])
    prior = generic_prior(4, 2)
    for row, before in zip(drafter.accuracy(), prior):
        assert row[0] > before[0] + 0.2 and row[1] < before[1]
    assert drafter.paths()[:4] == [(-1, 1, 0), (0, 2, 0), (1, 3, 0), (2, 4, 0)]


# ---------------------------------------------------------------------- sampled: follows the target
@pytest.mark.parametrize("sampling", list(SAMPLING))
def test_sampled_medusa_follows_target(sampling):
    model = tiny_model(vocab_size=16, layer_scale=0.01, seed=3)
    params = SAMPLING[sampling]

    def sample(drafter, tree):
        eng = Engine(model, drafter=drafter, tree=tree, batch_size=250, max_seq_len=32)
        reqs = [
            Request(REPEATING, SamplingParams(**params, seed=s, max_new_tokens=3))
            for s in range(N_SEEDS)
        ]
        results, stats = eng.generate(reqs)
        return torch.tensor([r.token_ids for r in results]), stats

    plain, _ = sample(PlainDrafter(), "chain:1")
    heads = MedusaHeads.random(model, num_heads=3, seed=2, scale=0.3)
    spec, stats = sample(MedusaDrafter(heads), "dynamic:3,3,8")
    assert same_distribution_pvalue(spec, plain) > 1e-3
    assert stats.mean_acceptance_length > 1.0  # drafts were accepted


# ---------------------------------------------------------------------- checkpoints
def test_save_load_round_trip_and_mismatch(model, tmp_path):
    heads = MedusaHeads.random(model, num_heads=3, num_layers=2, seed=4, scale=0.3)
    heads.set_draft_vocab(torch.arange(0, 32, 2))
    heads.head_accuracy = [[0.5, 0.1], [0.3, 0.1], [0.2, 0.1]]
    heads.save(str(tmp_path / "h"))
    back = load_medusa(str(tmp_path / "h"), model)
    assert (back.num_heads, back.num_layers, back.draft_vocab_size) == (3, 2, 16)
    assert back.head_accuracy == heads.head_accuracy
    h = torch.randn(5, model.args.dim)
    torch.testing.assert_close(back.logits(h), heads.logits(h))
    assert back.logits(h)[..., 1::2].isinf().all()  # outside the draft vocabulary

    other = tiny_model(vocab_size=48)
    with pytest.raises(HeadMismatchError, match="vocabulary 32"):
        load_medusa(str(tmp_path / "h"), other)
    with pytest.raises(ModelLoadError, match="no config.json"):
        load_medusa(str(tmp_path), model)


def test_tree_deeper_than_the_heads_is_rejected(model):
    heads = MedusaHeads.random(model, num_heads=2)
    with pytest.raises(InvalidTreeSpecError, match="these heads have 2"):
        Engine(model, drafter=MedusaDrafter(heads), tree="chain:3")
    # adaptive's depth is a bound: capped at the heads
    Engine(model, drafter=MedusaDrafter(heads), tree="adaptive:6,2,8", cost_model=CHEAP_VERIFY)


# ---------------------------------------------------------------------- training
def test_medusa_batch_offsets():
    tok = torch.arange(10, 20)
    hid = torch.arange(10.0)[:, None].expand(10, 4)
    hidden, labels = make_medusa_batch([(tok, hid, 6)], num_heads=2)
    # positions t = 5 .. 8 (prompt's last one on); head k labels token t + 1 + k
    assert hidden[:, 0].tolist() == [5, 6, 7, 8]
    assert labels.tolist() == [[17, 18], [18, 19], [19, -1], [-1, -1]]


def test_trainer_learns_and_writes_loadable_heads(target, data_dir, tmp_path):  # noqa: F811
    seqs = load_shards(data_dir)
    out = str(tmp_path / "medusa")
    kw = dict(num_heads=2, batch_size=2, lr=3e-2, save_dtype=torch.float32, progress=False)
    log = train_medusa(target, seqs, out, epochs=8, checkpoint_every=5, val_seqs=seqs, **kw)
    steps = [r for r in log if "loss" in r]
    assert len(steps) == 16
    assert sum(r["loss"] for r in steps[-3:]) < 0.8 * sum(r["loss"] for r in steps[:3])
    heads = load_medusa(out, target)
    assert heads.num_heads == 2 and len(heads.head_accuracy) == 2
    val = evaluate_medusa(heads, seqs)
    assert min(val["top1"]) > 0.3  # learned its (tiny, memorisable) data
    assert [r["val"]["top1"] for r in log if "val" in r][-1] == val["top1"]
    # resumable: an interrupted run continues from its checkpoint to the same heads
    part = str(tmp_path / "part")
    train_medusa(target, seqs, part, epochs=8, checkpoint_every=5, max_steps=7, **kw)
    assert not os.path.exists(os.path.join(part, "model.safetensors"))
    train_medusa(target, seqs, part, epochs=8, checkpoint_every=5, **kw)
    torch.testing.assert_close(load_medusa(part, target).weight, heads.weight)


def test_cli_train_kind_medusa(target, data_dir, tmp_path, monkeypatch):  # noqa: F811
    from specdec.cli import main

    monkeypatch.setattr("specdec.models.loader.load_model", lambda *a, **k: (target, None))
    out = str(tmp_path / "cli")
    main(
        ["train-head", "--kind", "medusa", "--medusa-heads", "3", "--output", out,
         "--data-dir", data_dir, "--stage", "train", "--epochs", "1", "--batch-size", "2",
         "--dtype", "float32", "--no-progress"]
    )  # fmt: skip
    assert load_medusa(out, target).num_heads == 3


# ---------------------------------------------------------------------- the shipped heads
@pytest.mark.slow
def test_shipped_heads_draft_for_the_default_model():
    """The packaged heads load for the default model (through the CLI's default), stay small,
    and float32 greedy decoding with them is plain decoding, with drafts accepted."""
    from specdec.heads import shipped_medusa_path
    from specdec.models.loader import load_model

    path = shipped_medusa_path()
    assert os.path.getsize(os.path.join(path, "model.safetensors")) <= 10 * 2**20
    model, tok = load_model()
    heads = load_medusa(path, model)
    assert heads.num_heads == 4 and heads.draft_vocab_size < model.args.vocab_size
    ids = tok.apply_chat_template(
        [{"role": "user", "content": "List three facts about the moon, one per line."}]
    )
    params = SamplingParams(max_new_tokens=32)
    plain, _ = Engine(model, tok, max_seq_len=256).generate([Request(ids, params)])
    eng = Engine(model, tok, drafter=MedusaDrafter(heads), tree="dynamic:4,4,16", max_seq_len=256)
    out, stats = eng.generate([Request(ids, params)])
    assert out[0].token_ids == plain[0].token_ids
    assert stats.mean_acceptance_length > 1.2
