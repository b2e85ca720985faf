"""`export_head` and `specdec export-head`: every shipped head (and a head as train-head
writes it) becomes the checkpoint vLLM's own method loads, with vLLM's names and conventions.
Whether vLLM then drafts with it exactly is test_engine.py's part."""

import json
import os

import pytest
import torch
from safetensors.torch import load_file

from specdec.cli import main
from specdec.errors import HeadMismatchError, ModelLoadError
from specdec.heads import DEFAULT_HEAD, DEFAULT_MEDUSA, EAGLE3_HEAD, resolve_head
from specdec.integrations.vllm import export_head


def _read(path):
    with open(os.path.join(path, "config.json")) as f:
        return json.load(f), load_file(os.path.join(path, "model.safetensors"))


def test_eagle2_drops_the_draft_vocabulary(tmp_path):
    out = export_head(DEFAULT_HEAD, tmp_path / "e2")
    cfg, w = _read(out.path)
    src = load_file(os.path.join(resolve_head(DEFAULT_HEAD), "model.safetensors"))
    assert out.method == "eagle" and cfg["architectures"] == ["LlamaForCausalLM"]
    assert "d2t" in src and "d2t" not in w and "draft_vocab_size" not in cfg
    assert any("dropped" in n for n in out.notes)
    for k, v in w.items():  # every other weight as trained, under the official EAGLE names
        assert torch.equal(v, src[k]), k


def test_eagle3_layer_ids_count_layer_inputs(tmp_path):
    out = export_head(EAGLE3_HEAD, tmp_path / "e3")
    cfg, w = _read(out.path)
    with open(os.path.join(resolve_head(EAGLE3_HEAD), "config.json")) as f:
        ours = json.load(f)["eagle_config"]["eagle_aux_hidden_state_layer_ids"]
    want = [k + 1 for k in ours]  # specdec's [1, 14, 26] are vLLM's [2, 15, 27]
    assert out.method == "eagle3" and cfg["architectures"] == ["LlamaForCausalLMEagle3"]
    assert cfg["eagle_aux_hidden_state_layer_ids"] == want
    assert cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == want
    assert cfg["draft_vocab_size"] == w["lm_head.weight"].shape[0] == w["d2t"].shape[0]


def test_medusa_keys_and_lm_head(tmp_path, model_dir):
    out = export_head(DEFAULT_MEDUSA, tmp_path / "m")
    cfg, w = _read(out.path)
    src = load_file(os.path.join(resolve_head(DEFAULT_MEDUSA), "model.safetensors"))
    target = load_file(os.path.join(model_dir, "model.safetensors"))
    assert out.method == "medusa" and out.num_speculative_tokens == cfg["num_heads"] == 4
    assert cfg["architectures"] == ["MedusaModel"] and cfg["original_lm_head"]
    assert not any(k.startswith("heads.") for k in w) and "token_map" not in w
    for k in range(4):
        assert torch.equal(w[f"blocks.{k}.layers.0.weight"], src[f"heads.{k}.0.linear.weight"])
        assert torch.equal(w[f"blocks.{k}.layers.0.bias"], src[f"heads.{k}.0.linear.bias"])
    assert torch.equal(w["lm_head.weight"], target["model.embed_tokens.weight"])  # tied


def test_a_trained_head_directory_exports(tmp_path):
    """What `specdec train-head` writes (EagleHead.save) exports like a shipped head."""
    from specdec.drafters.eagle_head import load_head
    from specdec.models.loader import load_model

    model, _ = load_model()
    head = load_head(resolve_head(EAGLE3_HEAD), model)
    head.save(str(tmp_path / "trained"))
    out = export_head(str(tmp_path / "trained"), tmp_path / "out")
    assert out.method == "eagle3"
    assert _read(out.path)[0]["eagle_aux_hidden_state_layer_ids"] == [
        k + 1 for k in head.feature_layers
    ]


def test_bad_heads_are_named(tmp_path, model_dir):
    with pytest.raises(ModelLoadError, match="'no-such-head' is neither a shipped head"):
        export_head("no-such-head", tmp_path / "x")
    cfg = json.load(open(os.path.join(resolve_head(DEFAULT_HEAD), "config.json")))
    wrong = tmp_path / "wrong"
    wrong.mkdir()
    (wrong / "config.json").write_text(json.dumps({**cfg, "hidden_size": 64}))
    with pytest.raises(HeadMismatchError, match="hidden_size 64, the target 576"):
        export_head(str(wrong), tmp_path / "y")
    (wrong / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match="no \\*.safetensors"):
        export_head(str(wrong), tmp_path / "z")
    with pytest.raises(ModelLoadError, match="neither a .gguf file nor a checkpoint"):
        export_head(DEFAULT_HEAD, tmp_path / "w", model=str(tmp_path))


def test_cli_export_head(tmp_path, capsys):
    main(["export-head", EAGLE3_HEAD, "--format", "vllm", "--out", str(tmp_path / "c")])
    printed = capsys.readouterr().out
    assert '"method": "eagle3"' in printed and str(tmp_path / "c") in printed
    assert os.path.isfile(tmp_path / "c" / "model.safetensors")
    with pytest.raises(SystemExit) as e:
        main(["export-head", "no-such-head", "--format", "vllm", "--out", str(tmp_path / "d")])
    assert e.value.code == 2 and "no-such-head" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        main(["export-head", DEFAULT_HEAD, "--format", "onnx", "--out", str(tmp_path / "e")])
    assert e.value.code == 2
