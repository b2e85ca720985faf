"""speculative_config: the dict vLLM takes for each hosted method, the options it carries for
the plugin, and clear errors for everything else. Runs without vLLM."""

import os

import pytest

from specdec.errors import InvalidRequestError
from specdec.heads import EAGLE3_HEAD
from specdec.integrations.vllm import speculative_config, version
from specdec.integrations.vllm.config import NGRAM_PROPOSER, OPTIONS_KEY, export_cached


@pytest.mark.parametrize("method", ["eagle", "eagle3", "medusa"])
def test_head_methods_point_at_an_export(method, tmp_path):
    cfg = speculative_config(method, export_dir=str(tmp_path / method))
    assert cfg == {"method": method, "model": str(tmp_path / method), "num_speculative_tokens": 4}
    assert os.path.isfile(os.path.join(cfg["model"], "model.safetensors"))


def test_eagle_with_an_eagle3_head_is_eagle3(tmp_path):
    cfg = speculative_config("eagle", head=EAGLE3_HEAD, export_dir=str(tmp_path / "e"))
    assert cfg["method"] == "eagle3"
    with pytest.raises(InvalidRequestError, match="is a medusa head"):
        speculative_config("eagle", head="smollm2-135m-instruct-medusa")


def test_ngram_is_the_custom_class_proposer():
    assert speculative_config("ngram", num_speculative_tokens=3) == {
        "method": "custom_class",
        "model": NGRAM_PROPOSER,
        "num_speculative_tokens": 3,
    }
    cfg = speculative_config("ngram", ngram_max=3, ngram_min=2, sampler="specdec")
    assert cfg[OPTIONS_KEY] == {"sampler": "specdec", "ngram_max": 3, "ngram_min": 2}


def test_exports_are_reused_until_the_head_changes(tmp_path):
    first = export_cached(_head_copy(tmp_path), export_dir=str(tmp_path / "out"))
    stamp = os.stat(os.path.join(first.path, "model.safetensors")).st_mtime_ns
    again = export_cached(str(tmp_path / "head"), export_dir=str(tmp_path / "out"))
    assert again == first
    assert os.stat(os.path.join(again.path, "model.safetensors")).st_mtime_ns == stamp
    os.utime(tmp_path / "head" / "config.json", ns=(1, 1))  # the head changed
    export_cached(str(tmp_path / "head"), export_dir=str(tmp_path / "out"))
    assert os.stat(os.path.join(first.path, "model.safetensors")).st_mtime_ns != stamp


def _head_copy(tmp_path) -> str:
    import shutil

    from specdec.heads import resolve_head

    return shutil.copytree(resolve_head(EAGLE3_HEAD), tmp_path / "head")


@pytest.mark.parametrize(
    "method, options, message",
    [
        ("plain", {}, "without a speculative_config"),
        ("eagle+ngram", {"tree": False}, "trees only"),
        ("draft", {}, "draft_model"),
        ("lookahead", {}, "unknown method 'lookahead'"),
        ("medusa", {"tree": "adaptive"}, "unknown option"),
        ("eagle", {"tree": "dynamic:9"}, "tree"),
        ("ngram", {"head": "x"}, "unknown option"),
        ("ngram", {"num_speculative_tokens": 0}, "num_speculative_tokens must be an integer"),
        ("ngram", {"ngram_min": 5, "ngram_max": 2}, "ngram_min"),
        ("ngram", {"sampler": "fast"}, "sampler must be one of"),
        ("medusa", {"num_speculative_tokens": 5}, "exceeds the 4 Medusa heads"),
    ],
)
def test_bad_methods_and_options(method, options, message):
    with pytest.raises(InvalidRequestError, match=message):
        speculative_config(method, **options)


def test_an_untested_vllm_is_refused(monkeypatch):
    monkeypatch.setattr(version, "installed_version", lambda: "0.40.1")
    with pytest.raises(version.VllmVersionError, match=r"vLLM 0.40.1 is installed.*0.32"):
        speculative_config("ngram")
    assert version.is_supported("0.32.0") and version.is_supported("0.32.3+cpu")
    assert not version.is_supported("0.31.9") and not version.is_supported("garbage")
