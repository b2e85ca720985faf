"""Shared by the integration tests: the default model's checkpoint directory (the vLLM tests'
model). The vLLM tests that need vLLM itself skip without it, naming the install line
(version.INSTALL_HINT); the ones that only write configs and checkpoints run everywhere."""

import pytest


@pytest.fixture(scope="module")
def model_dir():
    """The default model as the HF checkpoint directory vLLM reads (converted once)."""
    from specdec.models.loader import default_model_path, gguf_checkpoint_dir

    return gguf_checkpoint_dir(default_model_path())
