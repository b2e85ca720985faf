"""specdec.envs: the engine's environment variables, and the one of oneDNN's it sets."""

import os

import pytest

from specdec import envs


def test_every_variable_parses_when_unset(monkeypatch):
    for name in envs.environment_variables:
        monkeypatch.delenv(name, raising=False)
        getattr(envs, name)  # no error: each has its default


def test_unknown_name_is_an_attribute_error():
    with pytest.raises(AttributeError, match="SPECDEC_NO_SUCH"):
        envs.SPECDEC_NO_SUCH  # noqa: B018


def test_onednn_primitive_cache_bounded_unless_set(monkeypatch):
    monkeypatch.delenv("ONEDNN_PRIMITIVE_CACHE_CAPACITY", raising=False)
    envs.bound_onednn_primitive_cache()

    assert os.environ["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] == str(envs.SERVE_ONEDNN_PRIMITIVE_CACHE)
    monkeypatch.setenv("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "7")
    envs.bound_onednn_primitive_cache()
    assert os.environ["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] == "7"  # the user's choice stands
