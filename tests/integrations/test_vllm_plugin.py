"""The general plugin's hooks, without an engine: specdec's options moved from the
speculative config into vLLM's additional_config (checked first), and the rejection sampler
switched per engine config. test_engine.py runs them inside real engines."""

from types import SimpleNamespace

import pytest

from specdec.errors import InvalidRequestError
from specdec.integrations.vllm.plugin import move_specdec_options
from specdec.integrations.vllm.version import INSTALL_HINT, installed_version

needs_vllm = pytest.mark.skipif(
    installed_version() is None, reason=f"vLLM is not installed: {INSTALL_HINT}"
)


def test_options_move_to_additional_config():
    args = SimpleNamespace(
        speculative_config={"method": "ngram", "specdec": {"sampler": "specdec"}},
        additional_config={"other": 1, "specdec": {"ngram_max": 3}},
    )
    move_specdec_options(args)
    assert args.speculative_config == {"method": "ngram"}
    assert args.additional_config == {
        "other": 1,
        "specdec": {"ngram_max": 3, "sampler": "specdec"},
    }
    untouched = SimpleNamespace(speculative_config={"method": "ngram"}, additional_config={})
    move_specdec_options(untouched)
    assert untouched.additional_config == {}


@pytest.mark.parametrize(
    "options, message",
    [
        ({"trees": True}, "unknown option"),
        ({"tree": "adaptive", "sampler": "specdec"}, "must be true or false"),
        ({"tree": True, "drafter": "ngram", "tree_spec": "adaptive"}, "need sampler 'specdec'"),
        ({"tree": True, "sampler": "specdec"}, "trees need a drafter"),
        ({"sampler": "fast"}, "'vllm' or 'specdec'"),
        ("specdec", "must be a dict"),
    ],
)
def test_bad_options_are_named(options, message):
    args = SimpleNamespace(speculative_config={"specdec": options}, additional_config={})
    with pytest.raises(InvalidRequestError, match=message):
        move_specdec_options(args)


@needs_vllm
def test_sampler_follows_the_engine_config(monkeypatch):
    """A rejection sampler built for an engine whose config asks for specdec's sampler routes
    its forward through sampler.py (and only its own); vLLM's functions stay in place."""
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.sample import rejection_sampler
    from vllm.v1.sample.sampler import Sampler

    from specdec.integrations.vllm import plugin, sampler

    monkeypatch.delenv("SPECDEC_VLLM_SAMPLER", raising=False)
    own = rejection_sampler.rejection_sample
    plugin.register()
    plugin.register()  # vLLM may load plugins more than once in a process
    assert getattr(EngineArgs.create_speculative_config, "_specdec_hook", False)

    def build(config):
        with set_current_vllm_config(config):
            return rejection_sampler.RejectionSampler(Sampler())

    assert build(VllmConfig(additional_config={"specdec": {"sampler": "specdec"}})).specdec_sampler
    assert not build(VllmConfig()).specdec_sampler
    assert not rejection_sampler.RejectionSampler(Sampler()).specdec_sampler  # no config
    monkeypatch.setenv("SPECDEC_VLLM_SAMPLER", "1")
    assert build(VllmConfig()).specdec_sampler
    assert rejection_sampler.rejection_sample is own  # routed per forward call only
    with sampler.routed():
        assert rejection_sampler.rejection_sample is sampler.rejection_sample
    assert rejection_sampler.rejection_sample is own
