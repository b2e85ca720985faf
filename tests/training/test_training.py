"""specdec.training.eagle: self-distillation shards, the differentiable head pass, training, resume,
loading."""

import json
import os
import types

import pytest
import torch

import specdec_kernels.ops as ops
from specdec.drafters.eagle_head import EagleHead, eagle3_feature_layers, load_head
from specdec.errors import InvalidRequestError
from specdec.heads import DEFAULT_HEAD, EAGLE3_HEAD
from specdec.training.data import data_feature_layers, generate_batch, generate_shards, load_shards
from specdec.training.eagle import head_loss, head_train_forward, make_batch, train_head

from model_testing import TRAIN_EOS, TRAIN_PROMPTS

EOS, PROMPTS = TRAIN_EOS, TRAIN_PROMPTS


pytestmark = pytest.mark.usefixtures("single_thread")


@pytest.mark.parametrize("version", [2, 3])
def test_train_forward_matches_cached_head(request, version):
    """The SDPA training pass computes what the engine's paged-cache pass computes (EAGLE-3:
    fc over the fused features at committed positions, its own output at draft nodes)."""
    target = request.getfixturevalue("target" if version == 2 else "target3")
    head = EagleHead.random(target, version=version, seed=3)
    with torch.no_grad():  # non-trivial attention / MLP contributions
        for p in head.parameters():
            p.add_(torch.randn(p.shape) * 0.1)
    S = 9
    tokens = torch.randint(1, 48, (1, S))
    features = torch.randn(1, S, 32 * (3 if version == 3 else 1))
    with torch.no_grad():
        ours, second = head_train_forward(head, tokens, features, steps=2)
        cache = head.new_cache(1, 16)
        slots = torch.zeros(1, dtype=torch.long)
        parents = torch.arange(-1, S - 1, dtype=torch.int32)[None]
        num = torch.tensor([S], dtype=torch.int32)
        mask, depth = ops.build_tree_mask(parents, num)
        ref = head(tokens, features, cache, slots, cache.cache_lens[slots], 0, num, mask, depth)
    torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-5)

    # training-time test: pass 2 at position t is the depth-1 draft node drafted after
    # committing positions 0..t-1: token t + 1 with the head's own feature pred_1[t - 1]
    one = torch.ones(1, dtype=torch.int32)
    node_mask, _ = ops.build_tree_mask(torch.full((1, 1), -1, dtype=torch.int32), one)
    for t in (1, 4, S - 1):
        cache = head.new_cache(1, 16)
        with torch.no_grad():
            n = torch.tensor([t], dtype=torch.int32)
            chain_mask, chain_depth = ops.build_tree_mask(parents[:, :t].contiguous(), n)
            head(
                tokens[:, :t],
                features[:, :t],
                cache,
                slots,
                cache.cache_lens[slots],
                0,
                n,
                chain_mask,
                chain_depth,
            )
            cache.cache_lens[0] = t
            draft = head(
                tokens[:, t : t + 1],
                ours[:, t - 1 : t],
                cache,
                slots,
                cache.cache_lens[slots],
                0,
                one,
                node_mask,
                torch.tensor([[t]]),
            )
        torch.testing.assert_close(second[:, t], draft[:, 0], rtol=1e-5, atol=1e-5)


def test_shards_hold_the_targets_greedy_answers_and_features(target, data_dir):
    seqs = load_shards(data_dir)
    assert sorted(os.listdir(data_dir)) == [
        "manifest.json",
        "shard_00000.safetensors",
        "shard_00001.safetensors",
    ]
    assert [p for _, _, p in seqs] == [len(p) for p in PROMPTS]
    for (tokens, hidden, p), prompt in zip(seqs, PROMPTS):
        assert tokens[:p].tolist() == prompt and len(tokens) > p and hidden.dtype == torch.bfloat16
        assert len(tokens) == p + 12 or tokens[-1] == EOS
        cache = target.new_cache(1, 64)
        out = target.prefill([tokens], cache, torch.zeros(1, dtype=torch.long))
        # greedy: each generated token is the argmax after its prefix
        assert torch.equal(target.lm_head(out.hidden[0][p - 1 : -1]).argmax(-1), tokens[p:])
        torch.testing.assert_close(
            hidden.float(), out.hidden[0], rtol=1e-2, atol=2e-2
        )  # bf16 storage


def test_shards_resume_and_refuse_other_settings(target, data_dir, tmp_path):
    tok = types.SimpleNamespace(eos_token_ids={EOS})
    path = str(tmp_path)
    generate_shards(
        target, tok, PROMPTS, path, batch_size=3, max_new_tokens=12, max_shards=1, progress=False
    )
    assert not os.path.exists(os.path.join(path, "shard_00001.safetensors"))
    generate_shards(target, tok, PROMPTS, path, batch_size=3, max_new_tokens=12, progress=False)
    for a, b in zip(load_shards(path), load_shards(data_dir)):
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    with pytest.raises(InvalidRequestError, match="different settings"):
        generate_shards(target, tok, PROMPTS, path, batch_size=2, max_new_tokens=12, progress=False)


def test_batch_alignment(data_dir):
    """Position t reads (token t + 1, feature t), predicts feature t + 1 and token t + 2,
    scored from the prediction of the first generated token on."""
    seqs = load_shards(data_dir)[:2]
    tok_in, feat_in, feat_out, labels, mask = make_batch(seqs)
    tokens, hidden, p = seqs[0]
    n = len(tokens) - 2
    assert torch.equal(tok_in[0, :n], tokens[1:-1]) and torch.equal(labels[0, :n], tokens[2:])
    assert torch.equal(feat_in[0, 1], hidden[1].float()) and torch.equal(
        feat_out[0, 1], hidden[2].float()
    )
    assert mask[0].nonzero().flatten().tolist() == list(range(p - 2, n))


def _train(target, data_dir, out, **kw):
    kw = {
        "epochs": 8,
        "batch_size": 2,
        "lr": 3e-3,
        "checkpoint_every": 5,
        "save_dtype": torch.float32,
        "progress": False,
        **kw,
    }
    return train_head(target, load_shards(data_dir), out, **kw)


def test_training_decreases_loss_resumes_and_loads(target, data_dir, tmp_path):
    straight = str(tmp_path / "straight")
    log = _train(target, data_dir, straight)
    assert len(log) == 16
    first = sum(r["loss"] for r in log[:3]) / 3
    last = sum(r["loss"] for r in log[-3:]) / 3
    assert last < 0.8 * first, (first, last)

    resumed = str(tmp_path / "resumed")
    part = _train(target, data_dir, resumed, max_steps=7)  # "interrupted" after 7 steps
    assert len(part) == 7 and not os.path.exists(os.path.join(resumed, "model.safetensors"))
    rest = _train(target, data_dir, resumed)
    assert [r["step"] for r in rest] == list(range(8, 17))
    assert [r["loss"] for r in part + rest] == pytest.approx([r["loss"] for r in log], rel=1e-5)

    a, b = load_head(straight, target), load_head(resumed, target)
    assert a.version == 2
    for (name, x), y in zip(a.state_dict().items(), b.state_dict().values()):
        torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-6, msg=name)
    # the loaded head computes what training optimised: its top-1 accuracy on the data is high
    tok_in, feat_in, _, labels, mask = make_batch(load_shards(data_dir))
    with torch.no_grad():
        pred = a.logits(head_train_forward(a, tok_in, feat_in)[0]).argmax(-1)
    assert (pred[mask] == labels[mask]).float().mean() > 0.5


def test_training_time_test_and_bf16_output(target, data_dir, tmp_path):
    out = str(tmp_path / "bf16")
    log = _train(
        target,
        data_dir,
        out,
        epochs=1,
        save_dtype=torch.bfloat16,
        val_seqs=load_shards(data_dir)[:2],
        ttt_steps=2,
    )
    assert all(len(r["acc_by_depth"]) == 2 for r in log[:-1])  # training-time test: depths 1 and 2
    with open(os.path.join(out, "training.json")) as f:
        held_out = json.load(f)["held_out"]
    assert (
        held_out == [log[-1]]
        and held_out[0]["epoch"] == 1.0
        and 0 <= held_out[0]["val"]["top1"] <= 1
    )
    from safetensors.torch import load_file

    weights = load_file(os.path.join(out, "model.safetensors"))
    assert {w.dtype for w in weights.values()} == {torch.bfloat16}
    assert load_head(out, target).fc.weight.dtype == torch.float32  # loaded in the target's dtype


@pytest.mark.parametrize("perturb", [0.0, 0.3])
def test_distribution_token_loss_is_cross_entropy_to_the_targets_distribution(
    target, data_dir, monkeypatch, perturb
):
    """token_loss "distribution": cross-entropy of the head's logits against softmax(feature
    t + 1 @ lm_head rows) over every scored position (float64 oracle here). A head that
    reproduces the target's feature reaches the distribution's entropy (its minimum) and no
    feature loss; a perturbed one pays more than the entropy."""
    import specdec.training.eagle as train_mod

    batch = make_batch(load_shards(data_dir))
    _, _, feat_out, labels, mask = batch
    gen = torch.Generator().manual_seed(1)
    pred = feat_out + perturb * torch.randn(feat_out.shape, generator=gen)
    monkeypatch.setattr(train_mod, "head_train_forward", lambda *a, **k: [pred])
    head = EagleHead.random(target).float()
    vocab = torch.unique(labels[mask])[:-2]  # two labels outside: "distribution" keeps them
    loss, fl, tl, _ = head_loss(head, batch, vocab, 0.0, token_loss="distribution")

    w = target.output.weight[vocab].double()
    p = torch.softmax(feat_out[mask].double() @ w.T, -1)
    log_q = torch.log_softmax(pred[mask].double() @ w.T, -1)
    want = -(p * log_q).sum(-1).mean()
    entropy = -(p * p.log()).sum(-1).mean()
    torch.testing.assert_close(tl.double(), want, rtol=1e-5, atol=1e-6)
    if perturb == 0.0:
        torch.testing.assert_close(tl.double(), entropy, rtol=1e-5, atol=1e-6)
        assert fl.item() == 0.0
    else:
        assert tl.item() > entropy.item() + 1e-3 and fl.item() > 0
    torch.testing.assert_close(loss, 1.0 * fl + 0.1 * tl)
    # the label loss on the same prediction is another number (positions outside vocab left out)
    _, _, tl_label, _ = head_loss(head, batch, vocab, 0.0)
    assert abs(tl_label.item() - tl.item()) > 1e-3


def test_fine_tuning_from_a_head_with_the_distribution_loss(target, data_dir, tmp_path):
    """init_head starts from a trained head's weights: with no learning rate the result is that
    head, and the first step's loss is below a random start's; training.json records the
    loss and the start."""
    base = str(tmp_path / "base")
    _train(target, data_dir, base)
    frozen = str(tmp_path / "frozen")
    kw = {"epochs": 1, "token_loss": "distribution"}
    log = _train(target, data_dir, frozen, init_head=base, lr=0.0, **kw)
    a, b = load_head(base, target), load_head(frozen, target)
    for (name, x), y in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(x, y), name
    cold = _train(target, data_dir, str(tmp_path / "cold"), lr=0.0, **kw)
    assert log[0]["loss"] < 0.9 * cold[0]["loss"], (log[0], cold[0])
    tuned = str(tmp_path / "tuned")
    _train(target, data_dir, tuned, init_head=base, **kw)
    with open(os.path.join(tuned, "training.json")) as f:
        summary = json.load(f)
    assert summary["token_loss"] == "distribution" and summary["init_head"] == base
    assert any(
        not torch.equal(x, y) for x, y in zip(a.parameters(), load_head(tuned, target).parameters())
    )


def test_token_loss_and_init_head_are_checked(target, target3, data_dir, data_dir3, tmp_path):
    seqs = load_shards(data_dir)
    with pytest.raises(InvalidRequestError, match="token_loss must be one of"):
        train_head(target, seqs, str(tmp_path / "a"), token_loss="soft", progress=False)
    with pytest.raises(InvalidRequestError, match="with version 2"):
        train_head(
            target3,
            load_shards(data_dir3, features="aux"),
            str(tmp_path / "b"),
            version=3,
            token_loss="distribution",
            progress=False,
        )
    v3 = str(tmp_path / "v3")
    EagleHead.random(target3, version=3).save(v3)
    with pytest.raises(InvalidRequestError, match="is an EAGLE-3 head"):
        train_head(
            target3, load_shards(data_dir3), str(tmp_path / "c"), init_head=v3, progress=False
        )


def test_draft_vocabulary_is_the_most_frequent_tokens_and_drafts_only_them(
    target, data_dir, tmp_path
):
    out = str(tmp_path / "reduced")
    seqs = load_shards(data_dir)
    _train(target, data_dir, out, epochs=1, draft_vocab=6)
    counts = torch.bincount(torch.cat([t[p:].long() for t, _, p in seqs]), minlength=48)
    want = torch.sort(torch.argsort(-counts, stable=True)[:6]).values
    with open(os.path.join(out, "config.json")) as f:
        assert json.load(f)["draft_vocab_size"] == 6
    head = load_head(out, target)
    ids = head.draft_to_target(torch.arange(6))
    assert torch.equal(ids, want)
    torch.testing.assert_close(head.draft_lm_weight, target.output.weight[want])
    hidden = torch.randn(5, 32)
    full = head.logits(hidden)  # over target ids: -inf outside the draft vocabulary
    assert torch.isinf(full[:, [i for i in range(48) if i not in want.tolist()]]).all()
    torch.testing.assert_close(full[:, want], target.lm_head(hidden)[:, want])


@pytest.mark.parametrize("name, version", [(DEFAULT_HEAD, 2), (EAGLE3_HEAD, 3)])
def test_shipped_heads_draft_for_the_default_model(name, version):
    """The packaged heads (the default EAGLE-2 one and the EAGLE-3 one) load for the default
    model, by name too, stay small, and predict the model's own greedy continuation far better
    than chance (a random head scores ~0)."""
    from specdec.heads import resolve_head, shipped_head_path, shipped_heads
    from specdec.models.loader import load_model

    assert name in shipped_heads() and shipped_head_path() == resolve_head(DEFAULT_HEAD)
    path = resolve_head(name)
    assert os.path.isdir(path) and os.path.isfile(os.path.join(path, "CARD.md"))
    assert os.path.getsize(os.path.join(path, "model.safetensors")) <= 25 * 2**20
    model, tok = load_model()
    head = load_head(path, model)
    assert head.version == version
    ids = tok.apply_chat_template(
        [{"role": "user", "content": "Write a short story about a robot who learns to paint."}]
    )
    ((tokens, hidden, aux),) = generate_batch(
        model, [ids], 24, tok.eos_token_ids, feature_layers=head.feature_layers
    )
    features = aux if version == 3 else hidden
    tok_in, feat_in, _, labels, mask = make_batch([(tokens, features, len(ids))])
    with torch.no_grad():
        pred = head.logits(head_train_forward(head, tok_in, feat_in)[0]).argmax(-1)
    assert (pred[mask] == labels[mask]).float().mean() > 0.2


def test_resolve_head_names_and_paths(tmp_path):
    from specdec.heads import resolve_head

    assert resolve_head(str(tmp_path)) == str(tmp_path)  # a directory is itself
    assert resolve_head("no-such-head") == "no-such-head"  # left for load_head to report
    assert resolve_head("a/b") == "a/b"  # a path is never taken for a name


def test_prompt_datasets():
    """MT-bench first turns (evaluation) and ShareGPT first turns (training) never overlap;
    the ShareGPT list is prefix-stable in n (data runs can be extended)."""
    from specdec.datasets import mtbench_prompts, sharegpt_prompts

    mt = mtbench_prompts()
    assert len(mt) == 80 and all(isinstance(p, str) and p for p in mt)
    assert mtbench_prompts(3) == mt[:3]
    share = sharegpt_prompts(50, seed=0)
    assert len(set(share)) == 50 and not set(share) & set(mt)
    assert sharegpt_prompts(20, seed=0) == share[:20] and sharegpt_prompts(20, seed=1) != share[:20]


# ---------------------------------------------------------------------- EAGLE-3
@pytest.fixture(scope="module")
def target3():
    """A 3-layer target (EAGLE-3 fuses three distinct layers: 0, 1, 2 here)."""
    from model_testing import tiny_model

    return tiny_model(vocab_size=48, layer_scale=0.2).requires_grad_(False)


@pytest.fixture(scope="module")
def data_dir3(target3, tmp_path_factory):
    path = str(tmp_path_factory.mktemp("shards3"))
    generate_shards(
        target3,
        types.SimpleNamespace(eos_token_ids={EOS}),
        PROMPTS * 3,
        path,
        batch_size=4,
        max_new_tokens=16,
        progress=False,
        feature_layers=eagle3_feature_layers(3),
    )
    return path


def test_eagle3_shards_hold_the_feature_layers_outputs(target3, data_dir3):
    layers = eagle3_feature_layers(3)
    assert data_feature_layers(data_dir3) == list(layers) == [0, 1, 2]
    hidden = load_shards(data_dir3)
    aux = load_shards(data_dir3, features="aux")
    for (tokens, h, p), (tokens2, a, p2) in zip(hidden, aux):
        assert torch.equal(tokens, tokens2) and p == p2 and a.shape == (len(tokens), 3 * 32)
        cache = target3.new_cache(1, 64)
        out = target3.prefill([tokens], cache, torch.zeros(1, dtype=torch.long), layers)
        torch.testing.assert_close(h.float(), out.hidden[0], rtol=1e-2, atol=2e-2)
        torch.testing.assert_close(a.float(), out.aux[0], rtol=1e-2, atol=2e-2)


def test_hidden_only_shards_refuse_eagle3_features(data_dir):
    assert data_feature_layers(data_dir) == []
    with pytest.raises(InvalidRequestError, match="--features eagle3"):
        load_shards(data_dir, features="aux")
    with pytest.raises(InvalidRequestError, match="features must be"):
        load_shards(data_dir, features="bogus")


@pytest.fixture(scope="module")
def eagle3_trained(target3, data_dir3, tmp_path_factory):
    """(head directory, training log) of a small EAGLE-3 training (3-pass TTT, 12 tokens)."""
    out = str(tmp_path_factory.mktemp("eagle3"))
    seqs = load_shards(data_dir3, features="aux")
    log = train_head(
        target3,
        seqs,
        out,
        epochs=8,
        batch_size=2,
        lr=3e-3,
        save_dtype=torch.float32,
        progress=False,
        ttt_steps=3,
        version=3,
        draft_vocab=12,
        feature_layers=data_feature_layers(data_dir3),
        val_seqs=seqs[:4],
    )
    return out, log


def test_eagle3_training_learns_loads_and_drafts_exactly(target3, data_dir3, eagle3_trained):
    """A few steps of EAGLE-3 training (3-pass training-time test) reduce the loss; the saved
    head loads with load_head as an EAGLE-3 head over the data's draft vocabulary and
    predicts the data far better than a random head; the engine's greedy output with it
    equals plain decoding at batch 1 and with a request joining a freed slot."""
    from model_testing import run

    out, log = eagle3_trained
    seqs = load_shards(data_dir3, features="aux")
    steps = [r for r in log if "step" in r]
    assert len(steps) == 48 and all(len(r["acc_by_depth"]) == 3 for r in steps)
    assert all(r["feature_loss"] == 0 for r in steps)  # EAGLE-3: token loss only
    first = sum(r["loss"] for r in steps[:3]) / 3
    last = sum(r["loss"] for r in steps[-3:]) / 3
    assert last < 0.7 * first, (first, last)
    with open(os.path.join(out, "training.json")) as f:
        summary = json.load(f)
    assert summary["eagle_version"] == 3 and summary["feature_layers"] == [0, 1, 2]
    assert len(summary["held_out"][-1]["val"]["top1_by_depth"]) == 3

    head = load_head(out, target3)
    assert head.version == 3 and head.feature_layers == (0, 1, 2)
    assert head.draft_vocab_size == 12
    counts = torch.bincount(torch.cat([t[p:] for t, _, p in seqs]), minlength=48)
    want = torch.sort(torch.argsort(-counts, stable=True)[:12]).values
    assert torch.equal(head.draft_to_target(torch.arange(12)), want)

    def top1(h):
        tok_in, feat_in, _, labels, mask = make_batch(seqs)
        with torch.no_grad():
            pred = h.logits(head_train_forward(h, tok_in, feat_in)[0]).argmax(-1)
        return (pred[mask] == labels[mask]).float().mean().item()

    random_head = EagleHead.random(target3, version=3, seed=0, draft_vocab_size=12)
    random_head.d2t.copy_(want - torch.arange(12))
    trained, untrained = top1(head), top1(random_head)
    assert trained > untrained + 0.25, (trained, untrained)

    prompts = PROMPTS  # the training prompts: the head knows these answers
    for batch_size in (1, 3):  # 3 slots, 4 requests: one joins a freed slot
        plain, _ = run(target3, None, "chain:1", batch_size, prompts=prompts)
        spec, stats = run(target3, head, "chain:3", batch_size, prompts=prompts)
        assert spec == plain
        assert stats.mean_acceptance_length > 1.2  # the trained drafts do get accepted


@pytest.mark.parametrize("tree", ["chain:3", "dynamic:3,3,8"])
def test_sampled_output_with_a_trained_eagle3_head_follows_plain(target3, eagle3_trained, tree):
    """Sampled drafts from the trained head's 12-token draft vocabulary (draft_probs zero
    outside it): the output distribution is plain decoding's (two-sample test)."""
    from model_testing import SAMPLING, first_tokens, same_distribution_pvalue

    head = load_head(eagle3_trained[0], target3)
    plain = first_tokens(target3, None, "chain:1", SAMPLING["t1"])
    spec = first_tokens(target3, head, tree, SAMPLING["t1"])
    assert same_distribution_pvalue(spec, plain) > 1e-3


def test_eagle3_training_refuses_hidden_only_features(target3, data_dir3, tmp_path):
    with pytest.raises(InvalidRequestError, match="features of width 96"):
        train_head(target3, load_shards(data_dir3), str(tmp_path), version=3, progress=False)
    with pytest.raises(InvalidRequestError, match="ttt_steps"):
        train_head(target3, load_shards(data_dir3), str(tmp_path), ttt_steps=0, progress=False)


def test_cli_train_eagle_version_3(
    target, target3, data_dir, data_dir3, tmp_path, monkeypatch, capsys
):
    from specdec.cli import main

    def cli(model, data, out):
        monkeypatch.setattr("specdec.models.loader.load_model", lambda *a, **k: (model, None))
        main(
            ["train-head", "--eagle-version", "3", "--ttt-steps", "2", "--draft-vocab", "10",
             "--output", out, "--data-dir", data, "--stage", "train", "--epochs", "1",
             "--batch-size", "2", "--dtype", "float32", "--no-progress"]
        )  # fmt: skip

    out = str(tmp_path / "cli3")
    cli(target3, data_dir3, out)
    head = load_head(out, target3)
    assert head.version == 3 and head.draft_vocab_size == 10
    with open(os.path.join(out, "training.json")) as f:
        summary = json.load(f)
    assert summary["ttt_steps"] == 2 and summary["noise"] == 0.0  # EAGLE-3's default
    with pytest.raises(SystemExit):
        cli(target, data_dir, str(tmp_path / "refused"))  # hidden-only data
    assert "holds no EAGLE-3 features: generate it with --features eagle3" in (
        capsys.readouterr().err
    )
