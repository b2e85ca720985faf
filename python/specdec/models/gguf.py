"""One-time conversion of a Llama GGUF into a Hugging Face checkpoint directory.

Dequantises every tensor to float32 (gguf.quants), undoes llama.cpp's rotary permutation of the
q/k projections (as transformers' GGUF loader does), and writes model.safetensors, config.json,
generation_config.json, tokenizer.json and tokenizer_config.json. The result loads with
`LlamaForCausalLM.from_pretrained(dir)` and with specdec's own loader.
"""

import json
import os

import numpy as np
import torch
from safetensors.torch import save_file
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

from specdec.errors import ModelLoadError

# llama.cpp tensor names -> Hugging Face names ("blk.{i}." -> "model.layers.{i}.")
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
# Byte-level BPE pre-tokenisations that are plain GPT-2 ByteLevel splitting. ("smollm" splits digits
# one by one first, a no-op for its vocabulary, which has no merge involving a digit.)
_BYTE_LEVEL_PRE = ("gpt2", "default", "smollm")
# Control tokens that end a turn, in the chat formats we know of (llama.cpp's end-of-generation
# set).
_END_OF_TURN = ("<|endoftext|>", "<|im_end|>", "<|eot_id|>", "<|end|>", "<end_of_turn>", "</s>")
_CONTROL, _USER_DEFINED = 3, 4


def convert_gguf(gguf_path: str, out_dir: str):
    """Writes the Hugging Face checkpoint of `gguf_path` into `out_dir` (which must exist)."""
    from gguf import GGUFReader  # imported here: only a conversion needs it

    reader = GGUFReader(gguf_path)
    meta = _metadata(reader)
    arch = meta.get("general.architecture")
    if arch != "llama":
        raise ModelLoadError(
            f"{gguf_path}: GGUF architecture {arch!r} is not supported (only 'llama')"
        )
    config = _hf_config(meta, tied="output.weight" not in {t.name for t in reader.tensors})
    save_file(
        _state_dict(reader, config),
        os.path.join(out_dir, "model.safetensors"),
        metadata={"format": "pt"},
    )
    tokenizer, tok_config, eos_ids = _tokenizer(meta, gguf_path)
    tokenizer.save(os.path.join(out_dir, "tokenizer.json"))
    generation = {"bos_token_id": config["bos_token_id"], "eos_token_id": eos_ids}
    for name, obj in (
        ("config.json", config),
        ("tokenizer_config.json", tok_config),
        ("generation_config.json", generation),
    ):
        with open(os.path.join(out_dir, name), "w", encoding="utf-8") as f:
            json.dump(obj, f, indent=2, ensure_ascii=False)


def _metadata(reader) -> dict:
    """Scalar / string / array fields of the GGUF header as Python values."""
    return {
        name: field.contents()
        for name, field in reader.fields.items()
        if not name.startswith("GGUF.")
    }


def _f32(x) -> float:
    """A float32 header value in its shortest decimal form (9.99999974e-06 -> 1e-05)."""
    return float(str(np.float32(x)))


def _hf_config(meta: dict, tied: bool) -> dict:
    g = lambda key, default=None: meta.get(f"llama.{key}", default)  # noqa: E731
    n_heads = g("attention.head_count")
    dim = g("embedding_length")
    scaling = g("rope.scaling.type", "none")
    if scaling not in ("none", "linear"):
        raise ModelLoadError(f"GGUF rope scaling {scaling!r} is not supported (only linear)")
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": g("vocab_size") or len(meta["tokenizer.ggml.tokens"]),
        "hidden_size": dim,
        "intermediate_size": g("feed_forward_length"),
        "num_hidden_layers": g("block_count"),
        "num_attention_heads": n_heads,
        "num_key_value_heads": g("attention.head_count_kv", n_heads),
        "head_dim": g("rope.dimension_count", dim // n_heads),
        "hidden_act": "silu",
        "max_position_embeddings": g("context_length", 4096),
        "rms_norm_eps": _f32(g("attention.layer_norm_rms_epsilon", 1e-5)),
        "rope_theta": _f32(g("rope.freq_base", 10000.0)),
        "rope_scaling": {"rope_type": "linear", "factor": _f32(g("rope.scaling.factor"))}
        if scaling == "linear"
        else None,
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": tied,
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": meta.get("tokenizer.ggml.eos_token_id"),
        "torch_dtype": "float32",
    }


def _hf_name(name: str) -> str:
    if name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[name]
    parts = name.split(".")  # blk.{i}.{kind}.{weight|bias}
    if parts[0] != "blk" or parts[2] not in _LAYER_NAMES:
        raise ModelLoadError(f"unexpected GGUF tensor {name!r} for a llama model")
    return f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}.{parts[3]}"


def unpermute_rotary(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation (interleaved -> half-split rotary pairs).

    w: [n_heads * D, ...]; the same operation as transformers' `_reverse_permute_weights`.
    """
    half = w.shape[0] // n_heads // 2
    return w.reshape(n_heads, half, 2, *w.shape[1:]).swapaxes(2, 1).reshape(w.shape)


def _state_dict(reader, config) -> dict:
    from gguf.quants import dequantize

    heads = {"attn_q": config["num_attention_heads"], "attn_k": config["num_key_value_heads"]}
    out = {}
    for t in reader.tensors:
        # A copy: F32 tensors come back as read-only views of the memory-mapped file.
        w = np.array(dequantize(t.data, t.tensor_type), dtype=np.float32)
        kind = t.name.split(".")[2] if t.name.startswith("blk.") else None
        if kind in heads:
            w = unpermute_rotary(w, heads[kind])
        out[_hf_name(t.name)] = torch.from_numpy(np.ascontiguousarray(w))
    return out


def bytes_to_unicode() -> dict:
    """GPT-2's reversible byte -> printable character map of byte-level BPE vocabularies."""
    bs = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


def _tokenizer(meta: dict, gguf_path: str):
    """(tokenizers.Tokenizer, tokenizer_config dict, eos ids) from the GGUF's tokenizer metadata.

    Built as transformers' GGUF loader builds a byte-level BPE (GPT2Tokenizer + control tokens).
    """
    kind, pre = meta.get("tokenizer.ggml.model"), meta.get("tokenizer.ggml.pre", "default")
    if kind != "gpt2" or pre not in _BYTE_LEVEL_PRE:
        raise ModelLoadError(
            f"{gguf_path}: GGUF tokenizer {kind!r} / pre-tokenizer {pre!r} is not "
            f"supported (byte-level BPE with pre-tokenizer in {_BYTE_LEVEL_PRE})"
        )
    tokens, types = meta["tokenizer.ggml.tokens"], meta.get("tokenizer.ggml.token_type")
    types = types or [1] * len(tokens)
    spell = bytes_to_unicode()
    alphabet = set(spell.values())
    vocab = {
        (t if set(t) <= alphabet else "".join(spell[b] for b in t.encode("utf-8"))): i
        for i, t in enumerate(tokens)
    }
    merges = [tuple(m.split(" ")) for m in meta["tokenizer.ggml.merges"]]
    tok = Tokenizer(
        models.BPE(
            vocab=vocab,
            merges=merges,
            dropout=None,
            continuing_subword_prefix="",
            end_of_word_suffix="",
            fuse_unk=False,
        )
    )
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(
        [
            AddedToken(t, normalized=False, special=True)
            for t, k in zip(tokens, types)
            if k == _CONTROL and set(t) <= alphabet
        ]
    )
    tok.add_tokens(
        [
            AddedToken(t, normalized=False, special=False)
            for t, k in zip(tokens, types)
            if k == _USER_DEFINED
        ]
    )

    name = lambda key: tokens[meta[key]] if key in meta else None  # noqa: E731
    tok_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": name("tokenizer.ggml.bos_token_id"),
        "eos_token": name("tokenizer.ggml.eos_token_id"),
        "unk_token": name("tokenizer.ggml.unknown_token_id"),
        "pad_token": name("tokenizer.ggml.padding_token_id"),
        "add_bos_token": bool(meta.get("tokenizer.ggml.add_bos_token", False)),
        "chat_template": meta.get("tokenizer.chat_template"),
    }
    if tok_config["add_bos_token"] and tok_config["bos_token"]:
        bos = tok_config["bos_token"]
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos}:0 $A:0",
            pair=f"{bos}:0 $A:0 {bos}:1 $B:1",
            special_tokens=[(bos, meta["tokenizer.ggml.bos_token_id"])],
        )
    eos_ids = [meta["tokenizer.ggml.eos_token_id"]] if "tokenizer.ggml.eos_token_id" in meta else []
    eos_ids += [
        i
        for i, (t, k) in enumerate(zip(tokens, types))
        if k == _CONTROL and t in _END_OF_TURN and i not in eos_ids
    ]
    return tok, tok_config, eos_ids
