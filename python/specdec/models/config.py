"""ModelArgs: the hyper-parameters of a Llama-family decoder, read from a Hugging Face config."""

from dataclasses import dataclass

from specdec.errors import ModelLoadError

# model_type -> whether q/k/v projections carry a bias
SUPPORTED_MODEL_TYPES = {"llama": False, "mistral": False, "qwen2": True}
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")
_REQUIRED_KEYS = (
    "vocab_size",
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "intermediate_size",
)


@dataclass
class ModelArgs:
    vocab_size: int
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    hidden_dim: int  # MLP intermediate size
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict | None = (
        None  # HF-style: {"rope_type": "linear" | "llama3", "factor": ..., ...}
    )
    tie_word_embeddings: bool = True
    attention_bias: bool = False  # q/k/v bias (Qwen2)
    max_position_embeddings: int = 8192

    @classmethod
    def from_hf_config(cls, cfg: dict) -> "ModelArgs":
        """From a config.json dict (transformers 4 `rope_theta`/`rope_scaling` or 5
        `rope_parameters`)."""
        model_type = cfg.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ModelLoadError(
                f"unsupported model_type {model_type!r}: specdec loads "
                f"{sorted(SUPPORTED_MODEL_TYPES)}"
            )
        _reject_unsupported(cfg)
        missing = [k for k in _REQUIRED_KEYS if k not in cfg]
        if missing:
            raise ModelLoadError(f"config.json lacks {missing}")
        n_heads = cfg["num_attention_heads"]
        theta, scaling = _rope(cfg)
        max_pos = cfg.get("max_position_embeddings", 8192)
        if cfg.get("sliding_window") and model_type == "mistral":
            # Attention is full within the window, so the model is exact up to that length.
            max_pos = min(max_pos, cfg["sliding_window"])
        return cls(
            vocab_size=cfg["vocab_size"],
            dim=cfg["hidden_size"],
            n_layers=cfg["num_hidden_layers"],
            n_heads=n_heads,
            n_kv_heads=cfg.get("num_key_value_heads") or n_heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // n_heads,
            hidden_dim=cfg["intermediate_size"],
            norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=theta,
            rope_scaling=scaling,
            tie_word_embeddings=cfg.get("tie_word_embeddings", False),
            attention_bias=SUPPORTED_MODEL_TYPES[model_type],
            max_position_embeddings=max_pos,
        )


def _reject_unsupported(cfg: dict) -> None:
    """Options that change the math in ways this model does not implement."""
    problems = []
    if cfg.get("hidden_act", "silu") != "silu":
        problems.append(f"hidden_act={cfg['hidden_act']!r} (only 'silu')")
    if cfg.get("mlp_bias"):
        problems.append("mlp_bias=True")
    if cfg.get("model_type") == "llama" and cfg.get("attention_bias"):
        problems.append("attention_bias=True (Llama puts a bias on o_proj too)")
    if cfg.get("model_type") == "qwen2" and cfg.get("use_sliding_window"):
        problems.append("use_sliding_window=True")
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    if rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0)) != 1.0:
        problems.append("partial_rotary_factor != 1")
    if problems:
        raise ModelLoadError("unsupported model configuration: " + "; ".join(problems))


def _rope(cfg: dict) -> tuple[float, dict | None]:
    """(rope_theta, rope_scaling or None) from either config format."""
    params = dict(cfg.get("rope_parameters") or {})
    theta = params.pop("rope_theta", None) or cfg.get("rope_theta", 10000.0)
    scaling = params or dict(cfg.get("rope_scaling") or {})
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ModelLoadError(
            f"unsupported rope type {rope_type!r}: specdec supports {SUPPORTED_ROPE_TYPES}"
        )
    if rope_type == "default":
        return float(theta), None
    scaling = {k: v for k, v in scaling.items() if k != "type"}
    scaling["rope_type"] = rope_type
    if rope_type == "llama3":
        scaling.setdefault(
            "original_max_position_embeddings", cfg.get("max_position_embeddings", 8192)
        )
    return float(theta), scaling
