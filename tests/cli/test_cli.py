"""The `specdec generate` command: in-process through main([...]) and once as a subprocess."""

import json
import os
import re
import shutil
import subprocess
import sys

import pytest
import torch

import specdec
import specdec_kernels
from specdec.cli import main

from model_testing import write_tiny_checkpoint

FAST = ["--max-new-tokens", "4", "--method", "eagle", "--tree", "chain:2"]


pytestmark = pytest.mark.usefixtures("single_thread")


def generate(*argv):
    main(["generate", *argv])


def test_generate_default_model_with_shipped_head(capsys):
    generate("--prompt", "What is 2 + 2?", *FAST)
    out, err = capsys.readouterr()
    assert "mean acceptance length" in out and "tokens/s" in out and "eagle-2 chain:2" in out
    assert "warning" not in err  # the default model's head ships with the package


def test_default_method_is_eagle_ngram_adaptive_and_dtype_flag(capsys):
    """The defaults are the fastest exact method measured (docs/benchmarks.md)."""
    generate(
        "--prompt",
        "What is 2 + 2?",
        "--max-new-tokens",
        "4",
        "--dtype",
        "float32",
        "--device",
        "cpu",
    )
    out, _ = capsys.readouterr()
    assert "eagle+ngram:1-4 adaptive:6,8,32" in out and "mean acceptance length" in out


def test_model_without_shipped_head_falls_back_to_random_head(capsys):
    from specdec.models.loader import default_model_path, gguf_checkpoint_dir

    generate(
        "--prompt", "What is 2 + 2?", "--model", gguf_checkpoint_dir(default_model_path()), *FAST
    )
    out, err = capsys.readouterr()
    assert "mean acceptance length" in out
    assert "randomly initialised head" in err and len(err.strip().splitlines()) == 1


def test_prompts_file_output_and_saved_head(tmp_path, capsys):
    from specdec.drafters.eagle_head import EagleHead
    from specdec.models.loader import load_model

    model, _ = load_model()
    head_dir = tmp_path / "head"
    EagleHead.random(model, seed=5).save(str(head_dir))
    prompts = tmp_path / "in.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in ("Hi!", "Name a fruit.")))
    out_file = tmp_path / "out.jsonl"
    for method in ("plain", "eagle"):
        generate(
            "--prompts",
            str(prompts),
            "--output",
            str(out_file),
            "--method",
            method,
            "--head",
            str(head_dir),
            "--batch-size",
            "1",
            *FAST,
        )
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
    from specdec.drafters.eagle_head import EagleHead
    from specdec.models.config import ModelArgs
    from specdec.models.llama import Transformer

    other = Transformer(
        ModelArgs(
            vocab_size=49152,
            dim=64,
            n_layers=1,
            n_heads=2,
            n_kv_heads=1,
            head_dim=32,
            hidden_dim=128,
        )
    )
    EagleHead.random(other).save(str(tmp_path / "small_head"))
    return str(tmp_path / "small_head")


def bad_arch_dir(tmp_path):
    d = tmp_path / "gpt2"
    d.mkdir()
    (d / "config.json").write_text(
        json.dumps({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]})
    )
    return str(d)


BAD_INPUTS = {
    "unknown model dir": lambda t: ["--prompt", "hi", "--model", str(t / "nope")],
    "unsupported architecture": lambda t: ["--prompt", "hi", "--model", bad_arch_dir(t)],
    "head of the wrong size": lambda t: ["--prompt", "hi", "--head", write_head_of_wrong_size(t)],
    "head dir without config": lambda t: ["--prompt", "hi", "--head", str(t)],
    "prompt longer than the cache": lambda t: [
        "--prompt",
        "tell me a long story " * 10,
        "--max-seq-len",
        "16",
    ],
    "empty prompt": lambda t: ["--prompt", "   "],
    "empty prompt in file": lambda t: ["--prompts", write(t / "p.jsonl", '{"prompt": ""}\n')],
    "prompts file without prompt field": lambda t: [
        "--prompts",
        write(t / "p.jsonl", '{"text": "x"}\n'),
    ],
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
    roots = {
        os.path.dirname(os.path.dirname(os.path.abspath(m.__file__)))
        for m in (specdec, specdec_kernels)
    }
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([*roots, os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run(
        [sys.executable, "-m", "specdec", "generate", "--prompt", "Hello!", *FAST],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
        cwd=tmp_path,
    )  # `-m` puts the cwd first: not the checkout's sources
    assert proc.returncode == 0, proc.stderr
    assert "mean acceptance length" in proc.stdout


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "model")


TINY = ["--no-chat-template", "--max-new-tokens", "6", "--method", "plain"]


def tiny_generate(tiny, *argv):
    main(["generate", "--model", tiny, *TINY, *argv])


def copy_tiny(tiny, dst, drop=(), corrupt=None):
    shutil.copytree(tiny, dst)
    for name in drop:
        os.remove(os.path.join(dst, name))
    if corrupt:
        with open(os.path.join(dst, corrupt), "r+b") as f:
            f.truncate(os.path.getsize(os.path.join(dst, corrupt)) // 2)
    return str(dst)


def gguf_file(t, name, content):
    (t / name).write_bytes(content)
    return str(t / name)


def head_dir(t, tiny, config=None, weights=None):
    from specdec.drafters.eagle_head import EagleHead
    from specdec.models.loader import load_model

    model, _ = load_model(tiny)
    d = t / "head"
    EagleHead.random(model).save(str(d))
    if callable(config):
        config = json.dumps(config(json.loads((d / "config.json").read_text())))
    if config is not None:
        (d / "config.json").write_text(config)
    if weights is not None:
        (d / "model.safetensors").write_bytes(weights)
    return str(d)


def default_gguf_head(n):
    from specdec.models.loader import default_model_path

    with open(default_model_path(), "rb") as f:
        return f.read(n)


# case -> (flags, a phrase the one error line must hold); the tiny model unless --model says
# otherwise
FILE_AND_BOUND_ERRORS = {
    "empty gguf": (
        lambda t, m: ["--model", gguf_file(t, "e.gguf", b"")],
        "not a readable GGUF file",
    ),
    "corrupt gguf": (
        lambda t, m: ["--model", gguf_file(t, "c.gguf", b"GGUF" + bytes(range(256)) * 4)],
        "not a readable GGUF file",
    ),
    "truncated gguf": (
        lambda t, m: ["--model", gguf_file(t, "t.gguf", default_gguf_head(1 << 20))],
        "not a readable GGUF file",
    ),
    "corrupt safetensors": (
        lambda t, m: ["--model", copy_tiny(m, t / "m", corrupt="model.safetensors")],
        "cannot read",
    ),
    "no tokenizer files": (
        lambda t, m: ["--model", copy_tiny(m, t / "m", drop=["tokenizer.json"])],
        "has no tokenizer.json",
    ),
    "corrupt tokenizer": (
        lambda t, m: ["--model", copy_tiny(m, t / "m", corrupt="tokenizer.json")],
        "cannot load the tokenizer",
    ),
    "non-UTF-8 prompts file": (
        lambda t, m: ["--prompts", write_bytes(t / "p.jsonl", b'{"prompt": "\xff\xfe"}\n')],
        "not UTF-8",
    ),
    "huge seed": (lambda t, m: ["--prompt", "w1", "--seed", str(2**70)], "seed must be an integer"),
    "head with bad config.json": (
        lambda t, m: ["--method", "eagle", "--head", head_dir(t, m, config="{oops")],
        "cannot read config.json",
    ),
    "head with a config of wrong types": (
        lambda t, m: [
            "--method",
            "eagle",
            "--head",
            head_dir(t, m, config=lambda c: {**c, "num_attention_heads": "four"}),
        ],
        "invalid config.json",
    ),
    "head with corrupt safetensors": (
        lambda t, m: ["--method", "eagle", "--head", head_dir(t, m, weights=b"\x10" + bytes(100))],
        "cannot read its weights",
    ),
    "output into a missing directory": (
        lambda t, m: ["--output", str(t / "nope" / "out.jsonl")],
        "does not exist",
    ),
    "output onto a directory": (lambda t, m: ["--output", str(t)], "is a directory"),
    "huge batch size": (lambda t, m: ["--batch-size", "100000000"], "GiB"),
    "non-string prompt": (
        lambda t, m: ["--prompts", write(t / "p.jsonl", '{"prompt": 123}\n')],
        "request 0: the prompt must be a string, got int 123",
    ),
    "dynamic tree larger than the cache": (
        lambda t, m: ["--method", "eagle", "--tree", "dynamic:100,100,10000"],
        "10000 nodes, more than the cache allows (at most 255",
    ),
    "chain larger than the cache": (
        lambda t, m: ["--method", "eagle", "--tree", "chain:100000"],
        "100001 nodes, more than the cache allows",
    ),
    "adaptive tree larger than the cache": (
        lambda t, m: ["--method", "eagle", "--tree", "adaptive:100,100,10000"],
        "10000 nodes, more than the cache allows",
    ),
}


def write_bytes(path, data):
    path.write_bytes(data)
    return str(path)


@pytest.mark.parametrize("case", list(FILE_AND_BOUND_ERRORS))
def test_bad_files_and_bounds_are_one_error_line(case, tiny, tmp_path, capsys, monkeypatch):
    """Bad input a user can give the CLI: each one line and exit code 2, never a traceback."""
    monkeypatch.setenv("SPECDEC_CACHE_DIR", str(tmp_path / "cache"))  # GGUF conversions land here
    monkeypatch.setattr(
        "specdec.speculation.policy.CostModel.measure", lambda *a, **k: pytest.fail("measured")
    )
    flags, phrase = FILE_AND_BOUND_ERRORS[case]
    argv = flags(tmp_path, tiny)
    if "--prompt" not in argv and "--prompts" not in argv:
        argv = ["--prompt", "w1 w2 w3", *argv]
    with pytest.raises(SystemExit) as exc:
        tiny_generate(tiny, *argv)  # the case's own flags win
    _, err = capsys.readouterr()
    assert exc.value.code == 2, err
    lines = [line for line in err.strip().splitlines() if "warning" not in line]
    assert len(lines) == 1 and lines[0].startswith("specdec: error: "), err
    assert phrase in lines[0] and "Traceback" not in err and "longer than the cache" not in err


def read_rows(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_failing_prompts_finish_alone(tiny, tmp_path, capsys):
    """Invalid prompts among valid ones: reported together first (stderr line + row with
    finish_reason "error"), the others complete as they would alone, exit code 1."""
    good = ["w1 w2 w3", "w4 w5"]
    lines = [
        {"prompt": good[0]},
        {"prompt": 123},
        {"prompt": "  "},
        {"prompt": " ".join(["w7"] * 40)},
        {"prompt": good[1]},
    ]
    prompts = write(tmp_path / "p.jsonl", "".join(json.dumps(x) + "\n" for x in lines))
    out = tmp_path / "out.jsonl"
    with pytest.raises(SystemExit) as exc:
        tiny_generate(
            tiny,
            "--prompts",
            prompts,
            "--output",
            str(out),
            "--max-seq-len",
            "32",
            "--batch-size",
            "2",
        )
    assert exc.value.code == 1
    _, err = capsys.readouterr()
    errors = [line for line in err.splitlines() if "specdec: error" in line]
    assert [e.split(":")[2].strip() for e in errors] == ["request 1", "request 2", "request 3"]
    # on a line of its own: the bar is cleared (\r) or ended (\n) first, never written onto
    assert all(
        err[m.start() - 1] in "\r\n" for m in re.finditer("specdec: error", err) if m.start()
    ), err
    assert "Traceback" not in err
    rows = read_rows(out)
    assert [r["id"] for r in rows[:3]] == [1, 2, 3]  # before any generated row
    assert all(
        r["finish_reason"] == "error" and r["error"] and r["token_ids"] == [] for r in rows[:3]
    )
    assert "must be a string" in rows[0]["error"] and "empty prompt" in rows[1]["error"]
    assert "longer than the cache" in rows[2]["error"]
    done = {r["id"]: r for r in rows[3:]}
    assert sorted(done) == [0, 4] and all(
        r["finish_reason"] == "length" and r["error"] is None for r in done.values()
    )
    alone = tmp_path / "alone.jsonl"
    tiny_generate(
        tiny,
        "--prompts",
        write(tmp_path / "g.jsonl", "".join(json.dumps({"prompt": p}) + "\n" for p in good)),
        "--output",
        str(alone),
        "--max-seq-len",
        "32",
        "--batch-size",
        "2",
    )
    assert [r["token_ids"] for r in sorted(read_rows(alone), key=lambda r: r["id"])] == [
        done[0]["token_ids"],
        done[4]["token_ids"],
    ]


def poison_forward(monkeypatch, at_call, action):
    """Runs action(out, slots) on the target's `at_call`-th verify forward (0-based)."""
    from specdec.models.llama import Transformer

    calls = [0]
    forward = Transformer.forward

    def patched(self, tokens, cache, slots, *args, **kw):
        out = forward(self, tokens, cache, slots, *args, **kw)
        if calls[0] == at_call:
            action(out, slots)
        calls[0] += 1
        return out

    monkeypatch.setattr(Transformer, "forward", patched)


def test_nan_logits_fail_one_request(tiny, tmp_path, capsys, monkeypatch):
    prompts = write(
        tmp_path / "p.jsonl",
        "".join(json.dumps({"prompt": f"w{i} w{i + 1}"}) + "\n" for i in range(3)),
    )
    clean = tmp_path / "clean.jsonl"
    tiny_generate(tiny, "--prompts", prompts, "--output", str(clean), "--batch-size", "3")

    def nan_in_slot_1(out, slots):
        out.logits[slots == 1] = float("nan")

    poison_forward(monkeypatch, 2, nan_in_slot_1)
    out = tmp_path / "out.jsonl"
    with pytest.raises(SystemExit) as exc:
        tiny_generate(tiny, "--prompts", prompts, "--output", str(out), "--batch-size", "3")
    assert exc.value.code == 1
    _, err = capsys.readouterr()
    errors = [line for line in err.splitlines() if "specdec: error" in line]
    assert len(errors) == 1 and errors[0].startswith(
        "specdec: error: request 1: sampling failed:"
    ), err
    rows = {r["id"]: r for r in read_rows(out)}
    assert rows[1]["finish_reason"] == "error" and "NaN" in rows[1]["error"]
    expected = {r["id"]: r for r in read_rows(clean)}
    for i in (0, 2):
        assert (
            rows[i]["token_ids"] == expected[i]["token_ids"]
            and rows[i]["finish_reason"] == "length"
        )


def test_ctrl_c_keeps_finished_results(tiny, tmp_path, capsys, monkeypatch):
    """Results are written (flushed) as requests finish; Ctrl-C exits 130 with them kept."""
    prompts = write(
        tmp_path / "p.jsonl", "".join(json.dumps({"prompt": f"w{i} w3"}) + "\n" for i in range(3))
    )
    out = tmp_path / "out.jsonl"
    seen = []

    def interrupt(out_, slots):
        seen.append(read_rows(out))  # already on disk while the run goes on
        raise KeyboardInterrupt

    poison_forward(monkeypatch, 7, interrupt)  # batch 1, 6 tokens: request 0 ends at call 4
    with pytest.raises(SystemExit) as exc:
        tiny_generate(tiny, "--prompts", prompts, "--output", str(out))
    assert exc.value.code == 130
    _, err = capsys.readouterr()
    assert (
        err.strip().splitlines()[-1] == f"specdec: interrupted: 1 of 3 requests finished (in {out})"
    )
    assert "Traceback" not in err
    (row,) = read_rows(out)
    assert seen == [[row]] and row["id"] == 0 and len(row["token_ids"]) == 6


def test_crash_keeps_finished_results(tiny, tmp_path, monkeypatch):
    prompts = write(
        tmp_path / "p.jsonl", "".join(json.dumps({"prompt": f"w{i} w3"}) + "\n" for i in range(3))
    )
    out = tmp_path / "out.jsonl"

    def crash(out_, slots):
        raise RuntimeError("boom")

    poison_forward(monkeypatch, 7, crash)
    with pytest.raises(RuntimeError, match="boom"):
        tiny_generate(tiny, "--prompts", prompts, "--output", str(out))
    assert [r["id"] for r in read_rows(out)] == [0]


def test_output_path_checked_before_loading(tiny, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(
        "specdec.cli.generate.load_model_from_args", lambda args: pytest.fail("loaded the model")
    )
    with pytest.raises(SystemExit) as exc:
        tiny_generate(tiny, "--prompt", "w1", "--output", str(tmp_path / "missing" / "o.jsonl"))
    assert exc.value.code == 2
