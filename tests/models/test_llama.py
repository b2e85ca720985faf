"""The target model: tree verification against sequential decoding, and exactness against
transformers.

float32 throughout (tree_verify has no float64 path): logits of the same computation done in a
different order agree to ~1e-5, so comparisons use atol = rtol = 1e-4.
"""

import pytest
import torch

import specdec_kernels as sk
from specdec.models.config import ModelArgs
from specdec.models.llama import Transformer
from specdec.models.loader import (
    default_model_path,
    gguf_checkpoint_dir,
    load_checkpoint_dir,
    load_model,
)
from specdec_kernels.testing import random_parents

TOL = dict(atol=1e-4, rtol=1e-4)


@pytest.fixture
def transformers():
    return pytest.importorskip(
        "transformers", reason="pip install .[hf] for the transformers comparisons"
    )


POISON = -7.0  # cache value no write should leave behind where nothing was written


def tiny_args(**kw):
    args = dict(
        vocab_size=97,
        dim=64,
        n_layers=2,
        n_heads=4,
        n_kv_heads=2,
        head_dim=16,
        hidden_dim=96,
        norm_eps=1e-5,
        rope_theta=10000.0,
        tie_word_embeddings=False,
        attention_bias=True,
    )
    return ModelArgs(**{**args, **kw})


def random_model(args):
    """A Transformer with every parameter random (norm weights and biases included)."""
    model = Transformer(args).requires_grad_(False)
    for p in model.parameters():
        p.normal_(0.0, 0.3) if p.dim() == 1 else p.normal_(0.0, p.shape[-1] ** -0.5)
    return model


def single_node_step(model, cache, slots, tokens):
    """One plain decode step (one-node trees) for tokens [B]; commits them. -> logits [B, V]."""
    B = len(tokens)
    parents = torch.full((B, 1), -1, dtype=torch.int32)
    num_nodes = torch.ones(B, dtype=torch.int32)
    tree_mask, depth = sk.build_tree_mask(parents, num_nodes)
    out = model(tokens[:, None], cache, slots, num_nodes, tree_mask, depth)
    cache.cache_lens[slots] += 1
    return out.logits[:, 0]


def path_to(parents, i):
    """Node indices root..i of a tree given as a parents list."""
    path = [i]
    while parents[path[-1]] >= 0:
        path.append(int(parents[path[-1]]))
    return path[::-1]


# ------------------------------------------------------------------ tree verification
@pytest.mark.parametrize("kinds", [("chain", "chain"), ("random", "bushy"), ("deep", "star")])
def test_tree_forward_matches_sequential_paths(kinds):
    """One forward over padded trees (B = 2, different cache lens, shuffled blocks) gives, at every
    node, the logits of decoding its root-to-node path one token at a time; node KV lands at
    cache_lens + i with the KV of the token at cache_lens + depth; nothing else is written."""
    model = random_model(tiny_args())
    V, T = model.args.vocab_size, 9
    prompts = [torch.randint(0, V, (n,)) for n in (13, 30)]
    num_nodes = torch.tensor([T - 2, T], dtype=torch.int32)  # request 0 is padded
    parents = torch.stack([random_parents(T, int(n), kind) for n, kind in zip(num_nodes, kinds)])
    tokens = torch.randint(0, V, (2, T))

    cache = model.new_cache(num_slots=3, max_seq_len=48, block_size=4, shuffle_blocks=True)
    cache.k.fill_(POISON)
    cache.v.fill_(POISON)
    slots = torch.tensor([2, 0])  # non-trivial slot order; slot 1 stays unused
    model.prefill(prompts, cache, slots)
    tree_mask, depth = sk.build_tree_mask(parents, num_nodes)
    out = model(tokens, cache, slots, num_nodes, tree_mask, depth, feature_layers=(0,))
    assert out.logits.shape == (2, T, V) and out.hidden.shape == (2, T, model.args.dim)
    assert out.aux.shape == (2, T, model.args.dim)
    assert cache.cache_lens[slots].tolist() == [13, 30]  # forward does not commit

    for b, slot in enumerate(slots.tolist()):
        n, c = int(num_nodes[b]), len(prompts[b])
        for i in range(n):
            path = path_to(parents[b].tolist(), i)
            ref_cache = model.new_cache(num_slots=1, max_seq_len=48, block_size=4)
            ref_slot = torch.tensor([0])
            model.prefill([prompts[b]], ref_cache, ref_slot)
            for node in path:
                logits = single_node_step(model, ref_cache, ref_slot, tokens[b, node : node + 1])
            torch.testing.assert_close(out.logits[b, i], logits[0], **TOL)
            # node i's K/V, written at c + i, is what sequential decoding wrote at c + depth
            rows, _ = cache.rows(torch.tensor([slot]), torch.tensor([[c + i]]))
            ref_rows, _ = ref_cache.rows(ref_slot, torch.tensor([[c + len(path) - 1]]))
            for kv, ref_kv in ((cache.k, ref_cache.k), (cache.v, ref_cache.v)):
                torch.testing.assert_close(
                    kv.flatten(1, 2)[:, rows], ref_kv.flatten(1, 2)[:, ref_rows], **TOL
                )
        # everything past the prompt and the valid nodes of this slot is untouched
        unwritten, _ = cache.rows(torch.tensor([slot]), torch.arange(c + n, cache.capacity)[None])
        assert (cache.k.flatten(1, 2)[:, unwritten] == POISON).all()
        assert (cache.v.flatten(1, 2)[:, unwritten] == POISON).all()
    assert (
        cache.k.flatten(1, 2)[:, cache.rows(torch.tensor([1]), torch.arange(48)[None])[0]] == POISON
    ).all()


def test_tree_forward_is_sensitive_to_positions_and_mask():
    """The comparison above can fail: rotating star-tree nodes at cache_lens + i (not + depth), or
    letting siblings see each other (a chain mask), changes the logits past the first child."""
    model = random_model(tiny_args())
    T = 5
    tokens = torch.randint(0, model.args.vocab_size, (1, T))
    num_nodes = torch.tensor([T], dtype=torch.int32)
    star = torch.tensor([[-1, 0, 0, 0, 0]], dtype=torch.int32)
    chain = torch.arange(-1, T - 1, dtype=torch.int32)[None]

    def run(parents_for_mask, depth_override=None):
        cache = model.new_cache(num_slots=1, max_seq_len=32, block_size=4)
        slot = torch.tensor([0])
        model.prefill(
            [
                torch.randint(
                    0, model.args.vocab_size, (7,), generator=torch.Generator().manual_seed(0)
                )
            ],
            cache,
            slot,
        )
        tree_mask, depth = sk.build_tree_mask(parents_for_mask, num_nodes)
        return model(
            tokens,
            cache,
            slot,
            num_nodes,
            tree_mask,
            depth if depth_override is None else depth_override,
        ).logits[0]

    right = run(star)
    wrong_positions = run(star, torch.arange(T, dtype=torch.int32)[None])
    wrong_mask = run(chain, sk.build_tree_mask(star, num_nodes)[1])
    for wrong in (wrong_positions, wrong_mask):
        torch.testing.assert_close(wrong[:2], right[:2], **TOL)
        assert not torch.allclose(wrong[2:], right[2:], atol=1e-2), "nodes 2.. should differ"


def test_prefill_matches_decode_and_features():
    """prefill's last logits, hidden states and aux features equal token-by-token decoding."""
    model = random_model(tiny_args(n_layers=3))
    prompt = torch.randint(0, model.args.vocab_size, (11,))
    cache = model.new_cache(num_slots=1, max_seq_len=16, block_size=4, shuffle_blocks=True)
    slot = torch.tensor([0])
    pre = model.prefill([prompt], cache, slot, feature_layers=(0, 2))
    assert pre.aux[0].shape == (11, 2 * model.args.dim) and pre.hidden[0].shape == (
        11,
        model.args.dim,
    )

    cache.reset(slot)
    parents, num_nodes = torch.tensor([[-1]], dtype=torch.int32), torch.ones(1, dtype=torch.int32)
    tree_mask, depth = sk.build_tree_mask(parents, num_nodes)
    for s, tok in enumerate(prompt.tolist()):
        out = model(
            torch.tensor([[tok]]), cache, slot, num_nodes, tree_mask, depth, feature_layers=(0, 2)
        )
        cache.cache_lens[slot] += 1
        torch.testing.assert_close(out.hidden[0, 0], pre.hidden[0][s], **TOL)
        torch.testing.assert_close(out.aux[0, 0], pre.aux[0][s], **TOL)
    torch.testing.assert_close(out.logits[0, 0], pre.logits[0], **TOL)
    torch.testing.assert_close(model.lm_head(pre.hidden[0][-1]), pre.logits[0], **TOL)


def test_flat_block_parameter_names_still_load():
    """TransformerBlock's parameters before it had Attention / FeedForward submodules
    (layers.i.wqkv,
    .wo, .w13, .w2: what loader.py builds, older training checkpoints) load into the nested ones."""
    model = random_model(tiny_args())
    nested = {
        "attention.wqkv": "wqkv",
        "attention.wo": "wo",
        "feed_forward.w13": "w13",
        "feed_forward.w2": "w2",
    }
    flat = {}
    for name, p in model.state_dict().items():
        for new, old in nested.items():
            name = name.replace(f".{new}.", f".{old}.")
        flat[name] = p.clone()
    assert "layers.1.wqkv.bias" in flat and "layers.1.w13.weight" in flat
    fresh = Transformer(model.args)
    fresh.load_state_dict(flat, strict=True)
    for (n1, p1), (n2, p2) in zip(model.state_dict().items(), fresh.state_dict().items()):
        assert n1 == n2 and torch.equal(p1, p2), n1


# ------------------------------------------------------------------ transformers, tiny models
HF_CONFIGS = {
    "llama-llama3-rope": (
        "LlamaConfig",
        dict(
            rope_scaling=dict(
                rope_type="llama3",
                factor=8.0,
                low_freq_factor=1.0,
                high_freq_factor=4.0,
                original_max_position_embeddings=64,
            ),
            tie_word_embeddings=False,
        ),
    ),
    "llama-linear-rope-tied": (
        "LlamaConfig",
        dict(rope_scaling=dict(rope_type="linear", factor=2.5), tie_word_embeddings=True),
    ),
    "qwen2-qkv-bias": ("Qwen2Config", dict(tie_word_embeddings=False)),
    "mistral": ("MistralConfig", dict(sliding_window=256, tie_word_embeddings=False)),
}


@pytest.mark.parametrize("name", sorted(HF_CONFIGS))
def test_tiny_hf_checkpoints_match_transformers(name, tmp_path, transformers):
    """A random HF model saved with save_pretrained loads with our loader and gives its logits
    (prefill's last position, then a chain verified in one forward)."""
    cls_name, extra = HF_CONFIGS[name]
    config = getattr(transformers, cls_name)(
        vocab_size=101,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        rope_theta=5000.0,
        rms_norm_eps=1e-5,
        **extra,
    )
    hf = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        for (
            p
        ) in hf.parameters():  # transformers zero-inits biases and ones-inits norms: randomise all
            p.normal_(0.0, 0.3) if p.dim() == 1 else p.normal_(0.0, p.shape[-1] ** -0.5)
    hf.save_pretrained(tmp_path)
    model = load_checkpoint_dir(str(tmp_path))
    assert model.args.attention_bias == (cls_name == "Qwen2Config")

    seq = torch.randint(0, 101, (1, 90))  # reaches positions where every rope variant differs
    with torch.no_grad():
        ref = hf(seq).logits[0]
    S, T = 80, seq.shape[1] - 80
    cache = model.new_cache(num_slots=1, max_seq_len=128, block_size=8, shuffle_blocks=True)
    slot = torch.tensor([0])
    pre = model.prefill([seq[0, :S]], cache, slot)
    torch.testing.assert_close(pre.logits[0], ref[S - 1], **TOL)
    parents = torch.arange(-1, T - 1, dtype=torch.int32)[None]
    num_nodes = torch.tensor([T], dtype=torch.int32)
    tree_mask, depth = sk.build_tree_mask(parents, num_nodes)
    out = model(seq[:, S:], cache, slot, num_nodes, tree_mask, depth)
    torch.testing.assert_close(out.logits[0], ref[S:], **TOL)


# ------------------------------------------------------------------ transformers, the default model
PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain gravity to a child.",
    "List three prime numbers.",
    "What is 17 * 23?",
    "Translate 'good morning' into Spanish.",
    "Who wrote Hamlet?",
    "Give me a tip for learning Python.",
    "What does a CPU do?",
    "Name a famous painting.",
    "Why is the sky blue?",
    "How many legs does a spider have?",
    "Suggest a name for a cat.",
    "What is photosynthesis?",
    "Tell me a short joke.",
    "What is the boiling point of water?",
    "Describe a rainbow in one sentence.",
    "What is machine learning?",
    "Recommend a book for a long flight.",
    "How do I make a cup of tea?",
]
NEW_TOKENS = 16


def greedy(model, tokenizer, prompt_ids, max_new_tokens):
    """Plain greedy decoding with our model: prefill, then one-node trees; stops after an EOS."""
    cache = model.new_cache(num_slots=1, max_seq_len=len(prompt_ids) + max_new_tokens)
    slot = torch.tensor([0])
    out = [int(model.prefill([torch.tensor(prompt_ids)], cache, slot).logits[0].argmax())]
    while len(out) < max_new_tokens and out[-1] not in tokenizer.eos_token_ids:
        out.append(int(single_node_step(model, cache, slot, torch.tensor(out[-1:])).argmax()))
    return out


@pytest.mark.slow
def test_default_model_greedy_matches_transformers(capsys, transformers):
    """Greedy decoding of the default model (float32, CPU) reproduces transformers' generate token
    for
    token on 20 chat prompts. (Speed is the benchmarks' business: `specdec bench` times our plain
    loop against HF generate.)"""
    model, tokenizer = load_model()
    hf = transformers.LlamaForCausalLM.from_pretrained(
        gguf_checkpoint_dir(default_model_path()), dtype=torch.float32
    ).eval()
    eos = sorted(tokenizer.eos_token_ids)
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": p}]) for p in PROMPTS]

    def hf_greedy(ids):
        out = hf.generate(
            torch.tensor([ids]),
            max_new_tokens=NEW_TOKENS,
            do_sample=False,
            eos_token_id=eos,
            pad_token_id=eos[0],
        )
        return out[0, len(ids) :].tolist()

    ours = [greedy(model, tokenizer, ids, NEW_TOKENS) for ids in prompts]
    theirs = [hf_greedy(ids) for ids in prompts]

    mismatches = [(PROMPTS[i], a, b) for i, (a, b) in enumerate(zip(ours, theirs)) if a != b]
    assert not mismatches, f"{len(mismatches)}/{len(PROMPTS)} prompts differ: {mismatches[:3]}"
    with capsys.disabled():
        print(
            f"\n[greedy vs transformers] {len(PROMPTS)}/{len(PROMPTS)} identical, "
            f"{sum(map(len, ours))} tokens"
        )
    assert "Paris" in tokenizer.decode(ours[0])
