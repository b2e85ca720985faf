"""specdec.integrations.transformers: speculative decoding of transformers models (float32, CPU).

Tiny random Llama / Mistral / Qwen2 models built by transformers itself: greedy output must
equal hf_model.generate's token for token (batch 1, and batch > 1 with a request taking a slot
freed mid-run); sampled output must follow transformers' own sampler (two-sample test, which
fails for a deliberately broken sampler); the verification attention must really be
tree_verify. The default model (SmolLM2-135M-Instruct, its cached HF conversion) with the
shipped EAGLE head: greedy output equal to hf_model.generate on 20 prompts.
"""

import pytest
import torch

pytest.importorskip("transformers")

import specdec_kernels.ops as ops  # noqa: E402
from specdec.drafters.eagle_head import EagleHead  # noqa: E402
from specdec.errors import HeadMismatchError, InvalidRequestError, InvalidTreeSpecError  # noqa: E402
from specdec.integrations.transformers import ATTENTION_NAME, HFTarget, generate  # noqa: E402
from specdec.runtime import engine as engine_module  # noqa: E402

from model_testing import (  # noqa: E402
    N_TOKENS,
    PROMPTS,
    always_accept,
    oracle_head,
    same_distribution_pvalue,
)

pytestmark = pytest.mark.usefixtures("single_thread")


def tiny_hf(kind="llama", vocab_size=32, layer_scale=0.005, seed=0):
    """A random 3-layer transformers model (as test_engine.tiny_model: layer_scale shrinks the
    layers' residual contribution, so the next token is predictable)."""
    from transformers import (
        LlamaConfig,
        LlamaForCausalLM,
        MistralConfig,
        MistralForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
    )

    config_cls, model_cls = {
        "llama": (LlamaConfig, LlamaForCausalLM),
        "mistral": (MistralConfig, MistralForCausalLM),
        "qwen2": (Qwen2Config, Qwen2ForCausalLM),
    }[kind]
    cfg = config_cls(
        vocab_size=vocab_size,
        hidden_size=32,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        intermediate_size=64,
        max_position_embeddings=256,
        tie_word_embeddings=False,
        rope_theta=1000.0,
    )
    model = model_cls(cfg).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.copy_(torch.randn(p.shape, generator=gen) * (0.5 if p.dim() > 1 else 0.1))
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.mul_(layer_scale)
            layer.mlp.down_proj.weight.mul_(layer_scale)
    model.generation_config.eos_token_id = None  # no EOS unless a test names one
    model.generation_config.pad_token_id = 0
    return model


def hf_greedy(hf_model, prompt, n, eos=None):
    """hf_model.generate's greedy continuation of one prompt (batch 1) -> generated ids."""
    ids = torch.tensor([prompt])
    out = hf_model.generate(ids, do_sample=False, max_new_tokens=n, eos_token_id=eos)
    gen = out[0, len(prompt) :].tolist()
    return gen[: gen.index(eos) + 1] if eos is not None and eos in gen else gen


@pytest.fixture(scope="module")
def llama():
    return tiny_hf("llama")


@pytest.mark.parametrize("kind", ["llama", "mistral", "qwen2"])
@pytest.mark.parametrize("drafter", ["plain", "oracle-eagle2", "random-eagle3"])
@pytest.mark.parametrize("tree", ["chain:4", "dynamic:4,3,10"])
def test_greedy_equals_hf_generate(kind, drafter, tree):
    """Batch 1 over PROMPTS: the ids hf_model.generate returns, exactly; full-strength layers
    for the EAGLE-3 head (features from three layers), so attention mistakes show."""
    hf_model = tiny_hf(kind, layer_scale=1.0 if drafter == "random-eagle3" else 0.005)
    target = HFTarget(hf_model)
    head = {
        "plain": None,
        "oracle-eagle2": oracle_head(target),
        "random-eagle3": EagleHead.random(target, version=3, seed=1),
    }[drafter]
    for prompt in PROMPTS:
        ids = torch.tensor([prompt])
        want = hf_model.generate(ids, do_sample=False, max_new_tokens=16)
        got, stats = generate(hf_model, ids, head=head, tree=tree, max_new_tokens=16)
        assert torch.equal(got, want), (prompt, got, want)
        assert stats["generated_tokens"] == 16
    assert hf_model.config._attn_implementation == "sdpa"  # restored after each call


def test_greedy_batch_with_freed_slot_equals_hf_generate(llama):
    """4 prompts of different lengths at batch_size 3: prompt 0 ends early on EOS and the
    last request takes its slot mid-run; each output is hf_model.generate's (batch 1, same
    EOS); drafts really were accepted."""
    eos = hf_greedy(llama, PROMPTS[0], 16)[3]  # prompt 0's 4th token ends it
    want = [p + hf_greedy(llama, p, 16, eos) for p in PROMPTS]
    assert len(want[0]) == len(PROMPTS[0]) + 4
    target = HFTarget(llama)
    got, stats = generate(
        llama,
        PROMPTS,
        head=oracle_head(target),
        tree="dynamic:4,3,10",
        max_new_tokens=16,
        batch_size=3,
        eos_token_id=eos,
    )
    assert got == want
    _, plain = generate(
        llama, PROMPTS, head=None, max_new_tokens=16, batch_size=3, eos_token_id=eos
    )
    assert stats["target_forwards"] < plain["target_forwards"]
    assert stats["mean_acceptance_length"] > 1.5


def test_wrong_tree_positions_are_caught(llama, monkeypatch):
    """A deliberately broken target (RoPE positions by node index, not tree depth) no longer
    matches hf_model.generate: the comparison above can fail."""
    from specdec.integrations import transformers as integration

    real = integration.HFTarget._run

    def by_index(self, tokens, positions, meta, feature_layers):
        if meta.mode == "verify" and not meta.packed:
            positions = positions[:, :1] + torch.arange(positions.shape[1])
        return real(self, tokens, positions, meta, feature_layers)

    monkeypatch.setattr(integration.HFTarget, "_run", by_index)
    want = [p + hf_greedy(llama, p, 16) for p in PROMPTS]
    got, _ = generate(
        llama,
        PROMPTS,
        head=oracle_head(HFTarget(llama)),
        tree="dynamic:4,3,10",
        max_new_tokens=16,
        batch_size=1,
    )
    assert got != want


def test_tensor_batch_pads_like_hf_generate(llama):
    """A [B, S] batch whose rows end at different lengths comes back as hf_model.generate's
    tensor: prompt + generated, padded with pad_token_id after EOS."""
    prompts = torch.tensor([PROMPTS[0], [9, 8, 7, 6, 5]])
    eos = hf_greedy(llama, PROMPTS[0], 12)[2]
    want = llama.generate(prompts, do_sample=False, max_new_tokens=12, eos_token_id=eos)
    got, _ = generate(
        llama,
        prompts,
        head=oracle_head(HFTarget(llama)),
        tree="chain:3",
        max_new_tokens=12,
        eos_token_id=eos,
    )
    assert torch.equal(got, want)


def test_verification_attention_is_tree_verify(llama, monkeypatch):
    """The HF layers' attention during a speculative step is torch.ops.specdec.tree_verify,
    once per layer per target forward, through the registered attention function."""
    calls = []
    real = ops.tree_verify

    def counting(q, *args):
        calls.append(q.shape)
        return real(q, *args)

    monkeypatch.setattr(ops, "tree_verify", counting)
    _, stats = generate(
        llama, [PROMPTS[0]], head=oracle_head(HFTarget(llama)), tree="chain:3", max_new_tokens=8
    )
    verify_forwards = stats["target_forwards"]
    layers = llama.config.num_hidden_layers
    assert verify_forwards >= 1 and len(calls) >= layers * verify_forwards
    assert any(shape[1] == 4 for shape in calls)  # a 4-node chain verified in one call
    from transformers import AttentionInterface

    assert ATTENTION_NAME in AttentionInterface()


# ---------------------------------------------------------------------- distribution
N_SEEDS = 3000
SAMPLING = {"t1": dict(temperature=1.0), "top_p": dict(temperature=0.7, top_p=0.9)}


@pytest.fixture(scope="module")
def small_vocab():
    return tiny_hf("llama", vocab_size=16, layer_scale=0.01, seed=3)


@pytest.fixture(scope="module")
def hf_samples(small_vocab):
    """transformers' own sampler: N_SEEDS continuations of N_TOKENS tokens."""
    out = {}
    torch.manual_seed(0)
    for key, params in SAMPLING.items():
        ids = small_vocab.generate(
            torch.tensor([[1, 2, 3]]),
            do_sample=True,
            top_k=0,
            max_new_tokens=N_TOKENS,
            num_return_sequences=N_SEEDS,
            **params,
        )
        out[key] = ids[:, 3:]
    return out


def sampled(hf_model, head, tree, params):
    ids, _ = generate(
        hf_model,
        [[1, 2, 3]] * N_SEEDS,
        head=head,
        tree=tree,
        seed=0,
        max_new_tokens=N_TOKENS,
        batch_size=250,
        **params,
    )
    return torch.tensor(ids)[:, 3:]


@pytest.mark.parametrize("sampling", list(SAMPLING))
def test_sampled_speculative_follows_hf_sampling(small_vocab, hf_samples, sampling):
    head = oracle_head(HFTarget(small_vocab))
    spec = sampled(small_vocab, head, "dynamic:3,3,8", SAMPLING[sampling])
    assert same_distribution_pvalue(spec, hf_samples[sampling]) > 1e-3


def test_broken_sampler_is_detected(small_vocab, hf_samples, monkeypatch):
    class BrokenOps:
        def __getattr__(self, name):
            return always_accept if name == "tree_rejection_sample" else getattr(ops, name)

    monkeypatch.setattr(engine_module, "ops", BrokenOps())
    spec = sampled(small_vocab, oracle_head(HFTarget(small_vocab)), "dynamic:3,3,8", SAMPLING["t1"])
    assert same_distribution_pvalue(spec, hf_samples["t1"]) < 1e-6


# ---------------------------------------------------------------------- errors
@pytest.mark.parametrize(
    "kwargs, error, words",
    [
        (dict(input_ids=torch.tensor([[1.0, 2.0]])), InvalidRequestError, "input_ids"),
        (dict(input_ids=[]), InvalidRequestError, "input_ids"),
        (dict(input_ids=[[1, 2], [3, 99]]), InvalidRequestError, "input_ids[1]"),
        (dict(input_ids=[[1, 2]], head=42), InvalidRequestError, "head"),
        (dict(input_ids=[[1, 2]], head="/nonexistent"), InvalidRequestError, "head"),
        (dict(input_ids=[[1, 2]], tree="bogus"), InvalidTreeSpecError, "tree"),
        (dict(input_ids=[[1, 2]], max_new_tokens=0), InvalidRequestError, "max_new_tokens"),
        (dict(input_ids=[[1, 2]], top_p=0.0), InvalidRequestError, "top_p"),
        (dict(input_ids=[[1, 2]], eos_token_id="x"), InvalidRequestError, "eos_token_id"),
    ],
)
def test_bad_arguments_raise_clear_errors(llama, kwargs, error, words):
    with pytest.raises(error, match=__import__("re").escape(words)):
        generate(llama, **{"head": None, **kwargs})
    assert llama.config._attn_implementation == "sdpa"


def test_mismatched_head_is_rejected(llama, small_vocab):
    head = EagleHead.random(HFTarget(small_vocab), seed=0)  # vocabulary 16, llama has 32
    with pytest.raises(HeadMismatchError, match="vocabulary"):
        generate(llama, [[1, 2]], head=head)


def test_unsupported_model_is_rejected():
    with pytest.raises(InvalidRequestError, match="hf_model"):
        generate(torch.nn.Linear(2, 2), [[1]])


# ---------------------------------------------------------------------- the default model
QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain recursion to a child.",
    "Give me three tips for better sleep.",
    "What is 17 times 23?",
    "Translate 'good morning' into Spanish.",
    "Summarise the plot of Romeo and Juliet in two sentences.",
    "Write a Python function that reverses a string.",
    "Why is the sky blue?",
    "Suggest a name for a pet turtle.",
    "What are the benefits of regular exercise?",
    "Compose a short email declining a meeting invitation.",
    "List the planets of the solar system.",
    "How do I make a cup of tea?",
    "What is the difference between weather and climate?",
    "Describe a sunset in one sentence.",
    "Give an example of a metaphor.",
    "What does a compiler do?",
    "Write a limerick about a cat.",
    "How many days are there in a leap year?",
]


@pytest.mark.slow
def test_default_model_with_shipped_head_equals_hf_generate():
    """SmolLM2-135M-Instruct loaded by transformers (float32), the shipped EAGLE head
    (head="auto"), 20 chat prompts x 16 tokens: greedy ids equal hf_model.generate's."""
    from specdec.bench.hf import load_hf
    from specdec.models.loader import load_model

    hf_model = load_hf(None, torch.float32, "cpu")
    _, tok = load_model()
    prompts = [tok.apply_chat_template([{"role": "user", "content": q}]) for q in QUESTIONS]
    eos = hf_model.generation_config.eos_token_id
    eos = [eos] if isinstance(eos, int) else list(eos)
    want = []
    with torch.inference_mode():
        for p in prompts:
            out = hf_model.generate(torch.tensor([p]), do_sample=False, max_new_tokens=16)
            gen = out[0, len(p) :].tolist()
            cut = next((i + 1 for i, t in enumerate(gen) if t in eos), len(gen))
            want.append(p + gen[:cut])
    got, stats = generate(hf_model, prompts, max_new_tokens=16, batch_size=10)
    assert got == want
    assert stats["mean_acceptance_length"] > 1.5  # the shipped head drafted (not plain)
