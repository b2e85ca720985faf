"""The llama.cpp baseline: the bf16 GGUF writer (runs everywhere: it needs only the gguf
package) and run_llamacpp itself (skipped where llama-cpp-python is not installed, as in CI)."""

import os

import gguf
import numpy as np
import pytest
import torch

from specdec.bench import llamacpp as llamacpp_baseline
from specdec.bench.e2e import run_ours
from specdec.bench.llamacpp import bf16_gguf_path, write_bf16_gguf

Q = gguf.GGMLQuantizationType


def tiny_gguf(path, seed=0):
    """A small llama-ish GGUF: a Q8_0 embedding, a Q4_1 matrix, an F32 norm, and metadata of
    every kind the real one has (strings, string / int arrays, bools, floats, ints)."""
    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(path, "llama")
    w.add_name("tiny")
    w.add_uint32("llama.block_count", 1)
    w.add_float32("llama.rope.freq_base", 10000.0)
    w.add_bool("tokenizer.ggml.add_bos_token", False)
    w.add_token_list(["<a>", "b", "c"])
    w.add_token_types([1, 3, 1])
    w.add_file_type(int(gguf.LlamaFileType.MOSTLY_Q4_1))
    for name, shape, qtype in (
        ("token_embd.weight", (8, 64), Q.Q8_0),
        ("blk.0.ffn_down.weight", (16, 64), Q.Q4_1),
        ("blk.0.attn_norm.weight", (64,), Q.F32),
    ):
        values = rng.standard_normal(shape).astype(np.float32)
        w.add_tensor(name, gguf.quants.quantize(values, qtype), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def fields(reader):
    return {k: (f.types, f.contents()) for k, f in reader.fields.items()}


def test_bf16_gguf_round_trips(tmp_path):
    """Read back: the same tensors (names, shapes), the quantized ones as BF16 holding exactly
    torch's bf16 rounding of the dequantized values (what our bf16 model multiplies), F32
    norms unchanged, and every metadata key/value equal but the file type."""
    src, dst = str(tmp_path / "tiny.Q4_1.gguf"), str(tmp_path / "tiny.bf16.gguf")
    tiny_gguf(src)
    write_bf16_gguf(src, dst)
    a, b = gguf.GGUFReader(src), gguf.GGUFReader(dst)
    assert [t.name for t in a.tensors] == [t.name for t in b.tensors]
    for x, y in zip(a.tensors, b.tensors):
        assert list(x.shape) == list(y.shape), x.name
        expected = gguf.quants.dequantize(x.data, x.tensor_type)
        got = gguf.quants.dequantize(y.data, y.tensor_type)
        if x.tensor_type == Q.F32:
            assert y.tensor_type == Q.F32
            np.testing.assert_array_equal(got, expected)
        else:
            assert y.tensor_type == Q.BF16, x.name
            ours = torch.from_numpy(expected).to(torch.bfloat16).float().numpy()
            np.testing.assert_array_equal(got, ours)
            assert not np.array_equal(got, expected)  # the rounding did happen (test can fail)
    fa, fb = fields(a), fields(b)
    assert fb.pop("general.file_type")[1] == int(gguf.LlamaFileType.MOSTLY_BF16)
    fa.pop("general.file_type")
    assert fa == fb


def test_bf16_gguf_is_cached(tmp_path, monkeypatch):
    """Written once into $SPECDEC_CACHE_DIR; rewritten only when the source GGUF changes."""
    monkeypatch.setenv("SPECDEC_CACHE_DIR", str(tmp_path / "cache"))
    src = str(tmp_path / "tiny.Q4_1.gguf")
    tiny_gguf(src)
    calls = []
    write = llamacpp_baseline.write_bf16_gguf
    monkeypatch.setattr(
        llamacpp_baseline, "write_bf16_gguf", lambda *a: (calls.append(a), write(*a))
    )
    out = bf16_gguf_path(src)
    assert out == str(tmp_path / "cache" / "tiny.Q4_1.bf16.gguf") and os.path.isfile(out)
    assert bf16_gguf_path(src) == out and len(calls) == 1
    tiny_gguf(src, seed=1)
    os.utime(src, ns=(0, 12345))  # a changed source (new mtime)
    bf16_gguf_path(src)
    assert len(calls) == 2
    assert not [f for f in os.listdir(tmp_path / "cache") if ".tmp" in f]


def test_missing_llama_cpp_says_how_to_install(monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # import fails
    with pytest.raises(llamacpp_baseline.LlamaCppMissingError, match=r"specdec\[llamacpp\]"):
        llamacpp_baseline.import_llama_cpp()


# ---------------------------------------------------------------------- with llama.cpp
@pytest.fixture(scope="module")
def default_bf16():
    pytest.importorskip("llama_cpp")
    from specdec.models.loader import default_model_path, load_model

    model, tok = load_model(dtype=torch.float32)
    return bf16_gguf_path(default_model_path()), model, tok


def test_run_llamacpp_greedy(default_bf16):
    """llama.cpp's greedy decoding from the bf16 GGUF stops at EOS or max_new_tokens, its
    first token is our float32 plain loop's (same weights; one step, so bf16 rounding has not
    compounded), and prompt lookup does not change greedy output. Skipped without llama_cpp
    (CI), by design."""
    path, model, tok = default_bf16
    prompts = [
        tok.apply_chat_template([{"role": "user", "content": p}])
        for p in ("What is 2+2?", "Name a colour.")
    ]
    eos = tok.eos_token_ids
    r = llamacpp_baseline.run_llamacpp(path, prompts, 12, 0.0, 1, None, 0, eos)
    assert r["num_requests"] == 2 and r["tokens_per_s"] > 0
    ours = run_ours(model, tok, None, "chain:1", prompts, 0.0, 1, 12, 0)["outputs"]
    for out, mine in zip(r["outputs"], ours):
        assert 1 <= len(out) <= 12
        assert all(t not in eos for t in out[:-1])
        assert out[0] == mine[0]
    lookup = llamacpp_baseline.run_llamacpp(path, prompts, 12, 0.0, 1, 4, 0, eos)
    assert lookup["outputs"] == r["outputs"]  # prompt lookup is exact under greedy


class CharTokenizer:
    eos_token_ids = {1}

    def apply_chat_template(self, messages, add_generation_prompt=True):
        return [2] + [3 + ord(c) % 29 for c in messages[-1]["content"]]

    def decode(self, ids, skip_special_tokens=True):
        return " ".join(map(str, ids))


def test_bench_rows_join_batch1(monkeypatch):
    """run_bench's llama.cpp rows (run_llamacpp faked, so this runs without llama_cpp): each
    GGUF plain and, greedy only, with prompt lookup, fed our prompt ids, token count, threads
    and EOS ids; speedups against llama.cpp bf16 recorded. The fake "Q4_1" decodes other
    tokens, which same_tokens_as_plain reports (the exactness column can fail)."""
    from specdec.bench.e2e import run_bench

    from model_testing import tiny_model

    model, tok, prompts = tiny_model(), CharTokenizer(), ["abc", "hello"]
    prompt_ids = [tok.apply_chat_template([{"role": "user", "content": p}]) for p in prompts]
    plain = run_ours(model, tok, None, "chain:1", prompt_ids, 0.0, 1, 5, 0)["outputs"]
    calls = []

    def fake(path, ids, n, temp, threads, lookup, seed, eos):
        calls.append((path, ids, n, temp, threads, lookup, eos))
        outs = [list(o) for o in plain] if path == "bf16.gguf" else [[4] * n for _ in ids]
        return {
            "generated_tokens": 10,
            "tokens_per_s": 50.0,
            "mean_acceptance_length": None,
            "outputs": outs,
        }

    monkeypatch.setattr(llamacpp_baseline, "run_llamacpp", fake)
    result = run_bench(
        model,
        tok,
        None,
        prompts,
        max_new_tokens=5,
        temperatures=(0.0, 1.0),
        batch_sizes=(),
        log=lambda m: None,
        hostile=False,
        llamacpp_ggufs={"bf16": "bf16.gguf", "Q4_1": "q.gguf"},
    )
    greedy, sampled = result["batch1"]["0.0"], result["batch1"]["1.0"]
    assert list(greedy) == [
        "llama.cpp bf16",
        "llama.cpp bf16 + prompt lookup",
        "llama.cpp Q4_1",
        "llama.cpp Q4_1 + prompt lookup",
        "plain",
    ]
    assert list(sampled) == ["llama.cpp bf16", "llama.cpp Q4_1", "plain"]
    threads = torch.get_num_threads()
    assert all(c[1] == prompt_ids and c[2] == 5 and c[4] == threads for c in calls)
    assert all(c[6] == {1} for c in calls)
    assert [c[5] for c in calls] == [None, 10, None, 10, None, None]
    assert greedy["llama.cpp bf16"]["same_tokens_as_plain"] == 1.0
    assert greedy["llama.cpp Q4_1"]["same_tokens_as_plain"] == 0.0
    assert greedy["plain"]["speedup_vs_llamacpp_bf16"] == pytest.approx(
        greedy["plain"]["tokens_per_s"] / 50.0
    )


def test_bench_ggufs_skips_with_one_line_without_llama_cpp(monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "llama_cpp", None)
    lines = []
    assert llamacpp_baseline.bench_ggufs(None, log=lines.append) is None
    assert len(lines) == 1 and "pip install 'specdec[llamacpp]'" in lines[0]
