"""The `specdec generate` command: in-process through main([...]) and once as a subprocess."""
import json
import os
import subprocess
import sys

import pytest
import torch

import specdec
import specdec_kernels
from specdec.cli import main

FAST = ["--max-new-tokens", "4", "--tree", "chain:2"]


pytestmark = pytest.mark.usefixtures("single_thread")


def generate(*argv):
    main(["generate", *argv])


def test_generate_default_model_with_shipped_head(capsys):
    generate("--prompt", "What is 2 + 2?", *FAST)
    out, err = capsys.readouterr()
    assert "mean acceptance length" in out and "tokens/s" in out and "eagle-2 chain:2" in out
    assert "warning" not in err  # the default model's head ships with the package


def test_default_tree_is_adaptive_and_dtype_flag(capsys):
    generate("--prompt", "What is 2 + 2?", "--max-new-tokens", "4", "--dtype", "float32", "--device", "cpu")
    out, _ = capsys.readouterr()
    assert "eagle-2 adaptive:6,8,32" in out and "mean acceptance length" in out


def test_model_without_shipped_head_falls_back_to_random_head(capsys):
    from specdec.loader import default_model_path, gguf_checkpoint_dir

    generate("--prompt", "What is 2 + 2?", "--model", gguf_checkpoint_dir(default_model_path()), *FAST)
    out, err = capsys.readouterr()
    assert "mean acceptance length" in out
    assert "randomly initialised head" in err and len(err.strip().splitlines()) == 1


def test_prompts_file_output_and_saved_head(tmp_path, capsys):
    from specdec.eagle import EagleHead
    from specdec.loader import load_model

    model, _ = load_model()
    head_dir = tmp_path / "head"
    EagleHead.random(model, seed=5).save(str(head_dir))
    prompts = tmp_path / "in.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in ("Hi!", "Name a fruit.")))
    out_file = tmp_path / "out.jsonl"
    for method in ("plain", "eagle"):
        generate("--prompts", str(prompts), "--output", str(out_file), "--method", method,
                 "--head", str(head_dir), "--batch-size", "1", *FAST)
        rows = [json.loads(line) for line in out_file.read_text().splitlines()]
        assert [r["prompt"] for r in rows] == ["Hi!", "Name a fruit."]
        for r in rows:
            assert len(r["token_ids"]) <= 4 and isinstance(r["text"], str)
            assert r["stats"]["generated_tokens"] == len(r["token_ids"])
        if method == "plain":
            plain_ids = [r["token_ids"] for r in rows]
    assert [r["token_ids"] for r in rows] == plain_ids  # greedy: EAGLE output == plain output
    out, err = capsys.readouterr()
    assert "randomly" not in err and out.count("mean acceptance length") == 2


def write_head_of_wrong_size(tmp_path):
    from specdec.config import ModelArgs
    from specdec.eagle import EagleHead
    from specdec.model import Transformer

    other = Transformer(ModelArgs(vocab_size=49152, dim=64, n_layers=1, n_heads=2, n_kv_heads=1,
                                  head_dim=32, hidden_dim=128))
    EagleHead.random(other).save(str(tmp_path / "small_head"))
    return str(tmp_path / "small_head")


def bad_arch_dir(tmp_path):
    d = tmp_path / "gpt2"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}))
    return str(d)


BAD_INPUTS = {
    "unknown model dir": lambda t: ["--prompt", "hi", "--model", str(t / "nope")],
    "unsupported architecture": lambda t: ["--prompt", "hi", "--model", bad_arch_dir(t)],
    "head of the wrong size": lambda t: ["--prompt", "hi", "--head", write_head_of_wrong_size(t)],
    "head dir without config": lambda t: ["--prompt", "hi", "--head", str(t)],
    "prompt longer than the cache": lambda t: ["--prompt", "tell me a long story " * 10, "--max-seq-len", "16"],
    "empty prompt": lambda t: ["--prompt", "   "],
    "empty prompt in file": lambda t: ["--prompts", write(t / "p.jsonl", '{"prompt": ""}\n')],
    "prompts file without prompt field": lambda t: ["--prompts", write(t / "p.jsonl", '{"text": "x"}\n')],
    "missing prompts file": lambda t: ["--prompts", str(t / "missing.jsonl")],
    "negative temperature": lambda t: ["--prompt", "hi", "--temperature", "-1"],
    "top-p out of range": lambda t: ["--prompt", "hi", "--top-p", "0"],
    "negative top-k": lambda t: ["--prompt", "hi", "--top-k", "-3"],
    "zero max new tokens": lambda t: ["--prompt", "hi", "--max-new-tokens", "0"],
    "bad tree": lambda t: ["--prompt", "hi", "--tree", "chain:0"],
    "bad batch size": lambda t: ["--prompt", "hi", "--batch-size", "0"],
    "bad adaptive bounds": lambda t: ["--prompt", "hi", "--tree", "adaptive:3,0,8"],
    "unknown device": lambda t: ["--prompt", "hi", "--device", "tpu:9"],
}
if not torch.cuda.is_available():
    BAD_INPUTS["cuda without a GPU"] = lambda t: ["--prompt", "hi", "--device", "cuda"]


def write(path, text):
    path.write_text(text)
    return str(path)


@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_bad_input_is_one_error_line(case, tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        generate("--max-new-tokens", "2", *BAD_INPUTS[case](tmp_path))  # the case's own flags win
    assert exc.value.code == 2
    _, err = capsys.readouterr()
    lines = [line for line in err.strip().splitlines() if "warning" not in line]
    assert len(lines) == 1 and lines[0].startswith("specdec: error: "), err
    assert "Traceback" not in err


def test_subprocess_entry_point(tmp_path):
    roots = {os.path.dirname(os.path.dirname(os.path.abspath(m.__file__))) for m in (specdec, specdec_kernels)}
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([*roots, os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-m", "specdec.cli", "generate", "--prompt", "Hello!", *FAST],
                          capture_output=True, text=True, env=env, timeout=600,
                          cwd=tmp_path)  # `-m` puts the cwd first: not the checkout's sources
    assert proc.returncode == 0, proc.stderr
    assert "mean acceptance length" in proc.stdout
