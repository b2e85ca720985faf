"""Shared by the vLLM integration tests: the default model's checkpoint directory. Tests
that need vLLM itself skip without it, naming the install line (version.INSTALL_HINT); the
ones that only write configs and checkpoints run everywhere. Whether vLLM is installed is read
from the package metadata (version.installed_version), not importlib's find_spec: pytest puts
tests/integrations on sys.path, where this directory passes for a namespace package "vllm"."""

import pytest


@pytest.fixture(scope="module")
def model_dir():
    """The default model as the HF checkpoint directory vLLM reads (converted once)."""
    from specdec.loader import default_model_path, gguf_checkpoint_dir

    return gguf_checkpoint_dir(default_model_path())
