"""EAGLE heads: the official checkpoint layouts (EAGLE-1/2 and EAGLE-3) load into a head
whose forward matches an independent float64 implementation of the published layer."""

import json

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file

import specdec_kernels.ops as ops
from specdec.drafters.base import Proposal, Setup, StepResult
from specdec.drafters.eagle import BACKLOG_SLACK, EagleDrafter
from specdec.drafters.eagle_head import EagleHead, load_head
from specdec.errors import HeadMismatchError, ModelLoadError
from specdec.models.config import ModelArgs
from specdec.models.llama import Transformer
from specdec.speculation.trees import TreeSpec

from model_testing import sampling

DIM, HEADS, KV_HEADS, HEAD_DIM, HIDDEN, VOCAB = 32, 4, 2, 8, 48, 40


@pytest.fixture(scope="module")
def target():
    args = ModelArgs(
        vocab_size=VOCAB,
        dim=DIM,
        n_layers=4,
        n_heads=4,
        n_kv_heads=2,
        head_dim=8,
        hidden_dim=64,
        tie_word_embeddings=False,
    )
    model = Transformer(args).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.5)
    return model


def official_checkpoint(version, draft_vocab=VOCAB, dim=DIM, fc_in=None):
    """Random weights under the official EAGLE names, and the config.json next to them."""
    g = torch.Generator().manual_seed(version)

    def r(*shape):
        return torch.randn(*shape, generator=g) * 0.3

    pre = "midlayer." if version == 3 else "layers.0."
    attn_in = 2 * dim if version == 3 else dim
    sd = {
        "fc.weight": r(dim, fc_in or (3 if version == 3 else 2) * dim),
        f"{pre}self_attn.q_proj.weight": r(HEADS * HEAD_DIM, attn_in),
        f"{pre}self_attn.k_proj.weight": r(KV_HEADS * HEAD_DIM, attn_in),
        f"{pre}self_attn.v_proj.weight": r(KV_HEADS * HEAD_DIM, attn_in),
        f"{pre}self_attn.o_proj.weight": r(dim, HEADS * HEAD_DIM),
        f"{pre}mlp.gate_proj.weight": r(HIDDEN, dim),
        f"{pre}mlp.up_proj.weight": r(HIDDEN, dim),
        f"{pre}mlp.down_proj.weight": r(dim, HIDDEN),
        f"{pre}post_attention_layernorm.weight": 1 + r(dim),
    }
    if version == 3:
        ids = torch.randperm(VOCAB, generator=g)[:draft_vocab].sort().values
        sd.update(
            {
                "midlayer.input_layernorm.weight": 1 + r(dim),
                "midlayer.hidden_norm.weight": 1 + r(dim),
                "norm.weight": 1 + r(dim),
                "lm_head.weight": r(draft_vocab, dim),
                "d2t": ids - torch.arange(draft_vocab),
                "t2d": torch.zeros(VOCAB, dtype=torch.bool).index_fill(0, ids, True),
            }
        )
    else:
        sd["fc.bias"] = r(dim)
        sd["embed_tokens.weight"] = r(VOCAB, dim)  # shipped by EAGLE-1; the target's is used
    cfg = {
        "architectures": ["LlamaForCausalLMEagle3" if version == 3 else "LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": dim,
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS,
        "head_dim": HEAD_DIM,
        "intermediate_size": HIDDEN,
        "num_hidden_layers": 1,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "vocab_size": VOCAB,
        "hidden_act": "silu",
        "torch_dtype": "float16",
    }
    if version == 3:
        cfg["draft_vocab_size"] = draft_vocab
    return sd, cfg


def write_checkpoint(path, sd, cfg, fmt):
    path.mkdir(exist_ok=True)
    (path / "config.json").write_text(json.dumps(cfg))
    if fmt == "bin":
        torch.save(sd, path / "pytorch_model.bin")
    else:
        save_file(sd, str(path / "model.safetensors"))
    return str(path)


def rms(x, w, eps=1e-6):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def reference_head(sd, version, target, tokens, features):
    """The published EAGLE layer in float64 over one causal sequence.
    tokens: [S]; features: [S, F] -> (hidden [S, dim], logits [S, V] over target ids)."""
    sd = {k: v.double() for k, v in sd.items()}
    pre = "midlayer." if version == 3 else "layers.0."

    def w(name):
        return sd[pre + name + ".weight"]

    emb = target.tok_embeddings.weight.double()[tokens]
    S = len(tokens)
    if version == 3:
        x = features.double() @ sd["fc.weight"].T
        attn_in = torch.cat((rms(emb, w("input_layernorm")), rms(x, w("hidden_norm"))), -1)
    else:
        x = torch.cat((emb, features.double()), -1) @ sd["fc.weight"].T + sd.get("fc.bias", 0)
        attn_in = x  # no input_layernorm in the first EAGLE layer
    q = (attn_in @ w("self_attn.q_proj").T).view(S, HEADS, HEAD_DIM).transpose(0, 1)
    k = (attn_in @ w("self_attn.k_proj").T).view(S, KV_HEADS, HEAD_DIM).transpose(0, 1)
    v = (attn_in @ w("self_attn.v_proj").T).view(S, KV_HEADS, HEAD_DIM).transpose(0, 1)
    inv = 1.0 / (10000.0 ** (torch.arange(0, HEAD_DIM, 2, dtype=torch.float64) / HEAD_DIM))
    ang = torch.arange(S, dtype=torch.float64)[:, None] * inv
    cos, sin = torch.cat((ang, ang), -1).cos(), torch.cat((ang, ang), -1).sin()

    def rot(t):
        return torch.cat((-t[..., HEAD_DIM // 2 :], t[..., : HEAD_DIM // 2]), -1)

    q, k = q * cos + rot(q) * sin, k * cos + rot(k) * sin
    k, v = k.repeat_interleave(HEADS // KV_HEADS, 0), v.repeat_interleave(HEADS // KV_HEADS, 0)
    attn = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(0, 1).reshape(S, -1)
    x = x + attn @ w("self_attn.o_proj").T
    h = rms(x, w("post_attention_layernorm"))
    h = x + (F.silu(h @ w("mlp.gate_proj").T) * (h @ w("mlp.up_proj").T)) @ w("mlp.down_proj").T
    if version < 3:
        return h, h @ target.output.weight.double().T
    draft = rms(h, sd["norm.weight"]) @ sd["lm_head.weight"].T
    logits = torch.full((S, VOCAB), float("-inf"), dtype=torch.float64)
    logits[:, torch.arange(draft.shape[1]) + sd["d2t"].long()] = draft
    return h, logits


def run_head_chain(head, tokens, features):
    """The head over one causal sequence, through its paged cache and tree_verify."""
    S = len(tokens)
    cache = head.new_cache(1, 64)
    parents = torch.arange(-1, S - 1, dtype=torch.int32)[None]
    num_nodes = torch.tensor([S], dtype=torch.int32)
    mask, depth = ops.build_tree_mask(parents, num_nodes)
    zero = torch.zeros(1, dtype=torch.int32)
    with torch.no_grad():
        h = head(
            tokens[None], features[None], cache, torch.tensor([0]), zero, 0, num_nodes, mask, depth
        )
        return h[0], head.logits(h[0])


def check_against_reference(head, sd, version, target):
    S = 11
    tokens = torch.randint(0, VOCAB, (S,))
    features = torch.randn(S, (3 if version == 3 else 1) * DIM)
    h, logits = run_head_chain(head, tokens, features)
    ref_h, ref_logits = reference_head(sd, version, target, tokens, features)
    torch.testing.assert_close(h.double(), ref_h, atol=1e-4, rtol=1e-4)
    finite = torch.isfinite(ref_logits)
    assert torch.equal(torch.isfinite(logits), finite)
    torch.testing.assert_close(logits.double()[finite], ref_logits[finite], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("fmt", ["bin", "safetensors"])
def test_official_eagle2_checkpoint(target, tmp_path, fmt):
    sd, cfg = official_checkpoint(2)
    head = load_head(write_checkpoint(tmp_path / "h", sd, cfg, fmt), target)
    assert head.version == 2 and head.feature_layers == () and head.fc.bias is not None
    check_against_reference(head, sd, 2, target)


@pytest.mark.parametrize("fmt", ["bin", "safetensors"])
def test_official_eagle3_checkpoint_reduced_vocab(target, tmp_path, fmt):
    sd, cfg = official_checkpoint(3, draft_vocab=24)
    head = load_head(write_checkpoint(tmp_path / "h", sd, cfg, fmt), target)
    assert head.version == 3 and head.draft_vocab_size == 24
    assert head.feature_layers == (0, 1, 3)  # tiny target: first / middle / last layer
    check_against_reference(head, sd, 3, target)


@pytest.mark.parametrize("version", [2, 3])
def test_ragged_batch_is_packed_and_matches_the_reference(target, tmp_path, version):
    """The engine's catch-up: causal sequences of different lengths in one padded [B, M]
    call (packed: the per-token work on the real rows only). Each request's rows match the
    float64 layer over its own sequence; padding rows are zeros and write no cache row."""
    sd, cfg = official_checkpoint(version)
    head = load_head(write_checkpoint(tmp_path / "h", sd, cfg, "safetensors"), target)
    counts = [11, 3, 1, 7]
    B, M = len(counts), max(counts)
    tokens = torch.randint(0, VOCAB, (B, M))
    features = torch.randn(B, M, (3 if version == 3 else 1) * DIM)
    cache = head.new_cache(B, 64)
    poison = float("nan")
    cache.k.fill_(poison), cache.v.fill_(poison)
    num_nodes = torch.tensor(counts, dtype=torch.int32)
    parents = torch.arange(-1, M - 1, dtype=torch.int32).expand(B, M).contiguous()
    mask, depth = ops.build_tree_mask(parents, num_nodes)
    lens = torch.zeros(B, dtype=torch.int32)
    slots = torch.arange(B)
    with torch.no_grad():
        h = head(tokens, features, cache, slots, lens, 0, num_nodes, mask, depth)
    for b, n in enumerate(counts):
        ref_h, _ = reference_head(sd, version, target, tokens[b, :n], features[b, :n])
        torch.testing.assert_close(h[b, :n].double(), ref_h, atol=1e-4, rtol=1e-4)
        assert (h[b, n:] == 0).all()
        rows, _ = cache.rows(slots[b : b + 1], torch.arange(64)[None])
        written = ~cache.k[0].reshape(-1, KV_HEADS, HEAD_DIM)[rows[:64]].isnan().all(-1).all(-1)
        assert written.tolist() == [i < n for i in range(64)]


@pytest.mark.parametrize("version", [2, 3])
def test_own_format_roundtrip(target, tmp_path, version):
    head = EagleHead.random(
        target, version=version, seed=7, draft_vocab_size=30 if version == 3 else None
    )
    head.save(str(tmp_path / "h"))
    loaded = load_head(str(tmp_path / "h"), target)
    tokens, features = (
        torch.randint(0, VOCAB, (6,)),
        torch.randn(6, (3 if version == 3 else 1) * DIM),
    )
    for a, b in zip(
        run_head_chain(head, tokens, features), run_head_chain(loaded, tokens, features)
    ):
        torch.testing.assert_close(a, b, atol=0, rtol=0)
    check_against_reference(loaded, head.official_state_dict(), version, target)


def test_mismatched_heads_raise(target, tmp_path):
    sd, cfg = official_checkpoint(2, dim=48)  # hidden size 48 vs the target's 32
    with pytest.raises(HeadMismatchError, match="fc.weight"):
        load_head(
            write_checkpoint(tmp_path / "a", sd, {**cfg, "hidden_size": 48}, "safetensors"), target
        )
    sd, cfg = official_checkpoint(2)
    with pytest.raises(HeadMismatchError, match="vocabulary"):
        load_head(
            write_checkpoint(tmp_path / "b", sd, {**cfg, "vocab_size": 50}, "safetensors"), target
        )
    sd, cfg = official_checkpoint(3, fc_in=2 * DIM)  # EAGLE-3 fc must fuse 3 features
    with pytest.raises(HeadMismatchError, match="fc.weight"):
        load_head(write_checkpoint(tmp_path / "c", sd, cfg, "safetensors"), target)
    sd, cfg = official_checkpoint(3)
    cfg["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": [1, 2, 9]}  # the target has 4 layers
    with pytest.raises(HeadMismatchError, match="feature layers"):
        load_head(write_checkpoint(tmp_path / "d", sd, cfg, "safetensors"), target)


def test_broken_checkpoints_raise(target, tmp_path):
    with pytest.raises(ModelLoadError, match="config.json"):
        load_head(str(tmp_path), target)
    sd, cfg = official_checkpoint(2)
    del sd["layers.0.mlp.up_proj.weight"]
    with pytest.raises(ModelLoadError, match="missing"):
        load_head(write_checkpoint(tmp_path / "a", sd, cfg, "safetensors"), target)
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match="safetensors"):
        load_head(str(tmp_path / "b"), target)


# ---------------------------------------------------------------------- the drafter's backlog
def started_drafter(target, head, max_backlog, prompt, first, hidden):
    """An EagleDrafter over two slots with `prompt` started in slot 1 (its target features
    `hidden` [len(prompt), dim], `first` the first generated token)."""
    drafter = EagleDrafter(head, max_backlog=max_backlog)
    drafter.setup(Setup(target, TreeSpec.parse("chain:3"), 2, 64, 16, torch.device("cpu")))
    slot = torch.tensor([1])
    empty = hidden.new_zeros(len(prompt), 0)
    drafter.start(slot, [prompt], torch.tensor([first]), [hidden], [empty], [True])
    return drafter


def plain_step(drafter, token, feature):
    """A step that drafted nothing for slot 1 (adaptive mode's plain step): `token` emitted."""
    drafter.commit(
        torch.tensor([1]),
        Proposal(torch.tensor([[token]]), torch.tensor([[-1]], dtype=torch.int32), None),
        StepResult(
            torch.zeros(1, 1, dtype=torch.int32),
            torch.zeros(1, dtype=torch.int32),
            torch.tensor([[token]], dtype=torch.int32),
            feature.view(1, 1, -1),
            feature.new_zeros(1, 1, 0),
            [True],
        ),
    )


@pytest.mark.parametrize("max_backlog, length", [(4, 20), (9, 20), (4, 40)])
def test_backlog_cap_restarts_the_head_from_the_last_pairs(target, max_backlog, length):
    """A drafted step, then plain steps past the cap: the next catch-up runs only the last
    max_backlog (token, feature) pairs and drafts exactly as a head started afresh on them (a
    stale cache row left in place, or the pairs cut elsewhere, changes the drafting state).
    The queue itself stays within BACKLOG_SLACK times the cap over a long plain streak."""
    torch.manual_seed(0)
    head = EagleHead.random(target, version=2, seed=3)
    with torch.no_grad():  # weights large enough for the context to move the drafts
        for p in head.parameters():
            p.mul_(5)
    L = length  # tokens: prompt 0..5, first token 6, then steps 7..L-1
    tokens = torch.randint(0, VOCAB, (L,))
    feats = torch.randn(L, DIM)
    slot = torch.tensor([1])
    capped = started_drafter(target, head, max_backlog, tokens[:6], int(tokens[6]), feats[:6])
    uncapped = started_drafter(target, head, None, tokens[:6], int(tokens[6]), feats[:6])
    for d in (capped, uncapped):
        with torch.no_grad():
            d.propose(slot, tokens[6:7], sampling([0.0]))  # the prompt's catch-up: 6 cache rows
        for i in range(7, L):  # the root alone accepted, then plain steps
            plain_step(d, int(tokens[i]), feats[i - 1])
    queued = sum(len(t) for t, _ in capped.pending[1])
    assert queued == capped.queued[1] <= BACKLOG_SLACK * max_backlog
    # queued: (tokens[t + 1], feats[t]) for 6 <= t < L - 1; the cap keeps the last max_backlog
    kept = slice(L - 1 - max_backlog, L - 1)
    fresh = started_drafter(
        target,
        head,
        None,
        torch.cat((tokens[:1], tokens[L - max_backlog : L - 1])),
        int(tokens[L - 1]),
        feats[kept],
    )
    with torch.no_grad():
        got = capped.propose(slot, tokens[L - 1 : L], sampling([0.0]))
        want = fresh.propose(slot, tokens[L - 1 : L], sampling([0.0]))
        uncapped.propose(slot, tokens[L - 1 : L], sampling([0.0]))
    assert int(capped.cache.cache_lens[1]) == max_backlog
    assert int(uncapped.cache.cache_lens[1]) == L - 1
    torch.testing.assert_close(capped.draft_hidden[1], fresh.draft_hidden[1])
    assert torch.equal(got.tokens, want.tokens)
    # the cap matters: the whole context gives another drafting state
    assert not torch.allclose(capped.draft_hidden[1], uncapped.draft_hidden[1], rtol=1e-3)


def test_backlog_cap_is_checked():
    with pytest.raises(ValueError, match="max_backlog"):
        EagleDrafter(None, max_backlog=0)
