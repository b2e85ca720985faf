"""specdec's draft heads as checkpoint directories vLLM's own speculative methods load.

    export_head("smollm2-135m-instruct", "out/eagle")            # EAGLE-2 -> method "eagle"
    export_head("smollm2-135m-instruct-eagle3", "out/eagle3")    # EAGLE-3 -> method "eagle3"
    export_head("smollm2-135m-instruct-medusa", "out/medusa")    # Medusa  -> method "medusa"

A head is a shipped head's name or a directory `specdec train-head` wrote (EagleHead.save,
MedusaHeads.save). What differs between specdec's files and what vLLM 0.32 loads, and what the
export does about it (docs/integration.md, "In vLLM"):

- EAGLE-3: vLLM's auxiliary layer ids count the *input* of layer k (its `aux_hidden_states`
  are taken after layer k - 1), specdec's feature layers count layer outputs, so layer k is
  written as k + 1. A wrong id loads silently and drafts from the wrong features.
- EAGLE-2: vLLM's EAGLE-1/2 model (`EagleLlamaForCausalLM`) has no draft vocabulary and its
  loader rejects the head's `d2t`: the export drops it, so vLLM drafts over the full
  vocabulary through the target's lm_head (the head's hidden states are unchanged; only the
  final argmax may pick a token outside the draft vocabulary).
- Medusa: vLLM wants `MedusaModel` with `blocks.{k}.layers.{l}` keys and an lm_head in the
  checkpoint (it silently drops specdec's `heads.*`): the export renames the blocks and
  writes the target's lm_head as the one `lm_head` all heads share (specdec's heads share the
  target's). vLLM's truncated vocabulary (`token_map`) fails to load in 0.32, so the draft
  vocabulary is dropped as for EAGLE-2: the heads rank the full vocabulary.

Each export also writes `specdec_export.json`: the source head, the vLLM method and what was
mapped, for the record.
"""

import json
import os
from dataclasses import asdict, dataclass, field

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from specdec.errors import HeadMismatchError, ModelLoadError

EXPORT_RECORD = "specdec_export.json"
FORMAT_VERSION = 2  # of what export_head writes: cached exports of another version are redone


@dataclass(frozen=True)
class ExportedHead:
    """An exported head: its directory, the vLLM method that loads it, the depth it drafts
    by default (num_speculative_tokens) and notes on what the export changed."""

    path: str
    method: str  # "eagle", "eagle3" or "medusa"
    num_speculative_tokens: int
    source: str
    notes: list[str] = field(default_factory=list)


def resolve_head_dir(head: str) -> str:
    """A shipped head's name or a head directory -> its directory (ModelLoadError if none)."""
    from specdec.heads import resolve_head

    path = resolve_head(os.fspath(head))
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise ModelLoadError(
            f"head {head!r} is neither a shipped head ({', '.join(_shipped_names())}) nor a "
            "directory with a config.json"
        )
    return path


def _shipped_names() -> list[str]:
    from specdec.heads import shipped_heads

    return shipped_heads()


def head_kind(head_dir: str) -> str:
    """The vLLM method of a specdec head directory: "medusa", "eagle3" or "eagle"."""
    cfg = _read_json(os.path.join(head_dir, "config.json"), f"head {head_dir!r}")
    if "medusa_num_heads" in cfg:
        return "medusa"
    return "eagle3" if int(cfg.get("eagle_version", 2)) == 3 else "eagle"


def export_head(head: str, out_dir: str, model: str | None = None) -> ExportedHead:
    """Writes specdec head `head` (a shipped head's name or a directory) to out_dir as a vLLM
    checkpoint -> ExportedHead. model: the target (.gguf or HF checkpoint dir; default: the
    default model), whose shapes the head must match and whose lm_head Medusa's export
    copies. Raises ModelLoadError / HeadMismatchError (naming the head) on bad input."""
    head_dir = resolve_head_dir(head)
    target_dir = _target_dir(model)
    target_cfg = _read_json(os.path.join(target_dir, "config.json"), f"target {target_dir!r}")
    kind = head_kind(head_dir)
    cfg = _read_json(os.path.join(head_dir, "config.json"), f"head {head!r}")
    _check_shapes(head, cfg, target_cfg)
    weights = _read_head_weights(head_dir, head)
    if kind == "medusa":
        config, tensors, notes, depth = _medusa(head, cfg, weights, target_dir, target_cfg)
    else:
        config, tensors, notes, depth = _eagle(head, kind, cfg, weights, target_cfg)
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    weights_path = os.path.join(out_dir, "model.safetensors")
    save_file(
        {k: v.contiguous() for k, v in tensors.items()}, weights_path, metadata={"format": "pt"}
    )
    os.chmod(weights_path, 0o644)  # a checkpoint any user's server reads
    exported = ExportedHead(os.path.abspath(out_dir), kind, depth, head_dir, notes)
    with open(os.path.join(out_dir, EXPORT_RECORD), "w") as f:
        json.dump(asdict(exported), f, indent=2)
    return exported


# ---------------------------------------------------------------------- EAGLE-2 / EAGLE-3
def _eagle(head, kind, cfg, weights, target_cfg):
    config = {k: v for k, v in cfg.items() if k not in ("eagle_version", "draft_vocab_size")}
    config.setdefault("model_type", "llama")
    config["torch_dtype"] = _dtype_name(weights)
    notes = []
    tensors = dict(weights)
    if kind == "eagle3":
        layers = list((cfg.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids") or [])
        if not layers:
            raise ModelLoadError(
                f"EAGLE-3 head {head!r}: config.json lacks eagle_config."
                "eagle_aux_hidden_state_layer_ids (its feature layers)"
            )
        vllm_ids = [int(k) + 1 for k in layers]  # vLLM: the input of layer k + 1
        config["eagle_config"] = {
            **cfg["eagle_config"],
            "eagle_aux_hidden_state_layer_ids": vllm_ids,
        }
        config["eagle_aux_hidden_state_layer_ids"] = vllm_ids
        config["draft_vocab_size"] = int(weights["lm_head.weight"].shape[0])
        config["architectures"] = ["LlamaForCausalLMEagle3"]
        notes.append(f"auxiliary layer ids {layers} (layer outputs) -> {vllm_ids} (vLLM)")
    else:
        config["architectures"] = ["LlamaForCausalLM"]  # vLLM's EAGLEConfig makes it Eagle*
        if "d2t" in tensors:
            del tensors["d2t"]
            notes.append(
                f"draft vocabulary ({int(weights['d2t'].shape[0])} tokens) dropped: vLLM's "
                "EAGLE-1/2 model drafts over the full vocabulary through the target's lm_head"
            )
    config["vocab_size"] = int(target_cfg["vocab_size"])
    return config, tensors, notes, 4


# ---------------------------------------------------------------------- Medusa
def _medusa(head, cfg, weights, target_dir, target_cfg):
    num_heads = int(cfg["medusa_num_heads"])
    num_layers = int(cfg.get("medusa_num_layers", 1))
    tensors = {}
    for k in range(num_heads):
        for layer in range(num_layers):
            for kind in ("weight", "bias"):
                key = f"heads.{k}.{layer}.linear.{kind}"
                if key not in weights:
                    raise ModelLoadError(f"Medusa heads {head!r}: missing weight {key!r}")
                tensors[f"blocks.{k}.layers.{layer}.{kind}"] = weights[key]
    # in the target's own dtype: specdec's heads use the target's lm_head as it is
    lm_head = _target_lm_head(target_dir, target_cfg)
    vocab = int(target_cfg["vocab_size"])
    config = {
        "architectures": ["MedusaModel"],
        "model_type": "medusa",
        "hidden_size": int(cfg["hidden_size"]),
        "vocab_size": vocab,
        "num_heads": num_heads,
        "num_hidden_layers": num_layers,
        "medusa_fc_bias": True,
        "original_lm_head": True,  # one lm_head shared by every head, as specdec's
        "torch_dtype": _dtype_name(weights),
    }
    notes = [f"heads.K.L.linear -> blocks.K.layers.L; the target's lm_head ({vocab} rows)"]
    if "d2t" in weights:
        notes.append(
            f"draft vocabulary ({int(weights['d2t'].shape[0])} tokens) dropped: vLLM 0.32's "
            "Medusa loader rejects its own token_map ('weights were not initialized from "
            "checkpoint: token_map'), so the heads rank the full vocabulary"
        )
    tensors["lm_head.weight"] = lm_head
    return config, tensors, notes, num_heads


# ---------------------------------------------------------------------- helpers
def _target_dir(model: str | None) -> str:
    from specdec.models.loader import default_model_path, gguf_checkpoint_dir

    path = default_model_path() if model is None else os.fspath(model)
    if os.path.isfile(path) and path.endswith(".gguf"):
        return gguf_checkpoint_dir(path)
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise ModelLoadError(
            f"target {path!r} is neither a .gguf file nor a checkpoint directory with a config.json"
        )
    return path


def _read_json(path: str, what: str) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            cfg = json.load(f)
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"{what}: cannot read {os.path.basename(path)}: {e}") from None
    if not isinstance(cfg, dict):
        raise ModelLoadError(f"{what}: {os.path.basename(path)} must hold a JSON object")
    return cfg


def _check_shapes(head: str, cfg: dict, target_cfg: dict) -> None:
    for key in ("hidden_size", "vocab_size"):
        if cfg.get(key) != target_cfg.get(key):
            raise HeadMismatchError(
                f"head {head!r} has {key} {cfg.get(key)}, the target {target_cfg.get(key)}"
            )


def _read_head_weights(head_dir: str, head: str) -> dict:
    files = sorted(f for f in os.listdir(head_dir) if f.endswith(".safetensors"))
    if not files:
        raise ModelLoadError(f"head {head!r}: no *.safetensors next to its config.json")
    weights = {}
    try:
        for name in files:
            weights.update(load_file(os.path.join(head_dir, name)))
    except Exception as e:  # SafetensorError, OSError: truncated or corrupt files
        raise ModelLoadError(f"head {head!r}: cannot read its weights: {e}") from None
    return weights


def _target_lm_head(target_dir: str, target_cfg: dict) -> torch.Tensor:
    """The target's lm_head weight [V, dim] (its token embedding when they are tied)."""
    tied = target_cfg.get("tie_word_embeddings", False)
    wanted = ["lm_head.weight"] + (["model.embed_tokens.weight"] if tied else [])
    files = sorted(f for f in os.listdir(target_dir) if f.endswith(".safetensors"))
    for key in wanted:
        for name in files:
            with safe_open(os.path.join(target_dir, name), "pt") as f:
                if key in f.keys():
                    return f.get_tensor(key)
    raise ModelLoadError(f"target {target_dir!r}: no {' or '.join(wanted)} in its safetensors")


def _dtype_name(weights: dict) -> str:
    dtype = next(v.dtype for v in weights.values() if v.is_floating_point())
    return str(dtype).removeprefix("torch.")
