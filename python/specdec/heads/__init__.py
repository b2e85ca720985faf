"""EAGLE and Medusa heads shipped with the package (package data), a directory per target."""

import os

DEFAULT_HEAD = "smollm2-135m-instruct"  # trained for the default model (see its CARD.md)
DEFAULT_MEDUSA = "smollm2-135m-instruct-medusa"  # Medusa heads for it (see its CARD.md)
EAGLE3_HEAD = "smollm2-135m-instruct-eagle3"  # its EAGLE-3 head (see its CARD.md)

_HERE = os.path.dirname(__file__)


def _shipped(name: str) -> str | None:
    """The directory of shipped head `name`, or None when there is no such head."""
    path = os.path.join(_HERE, name)
    return path if os.path.isfile(os.path.join(path, "config.json")) else None


def shipped_head_path(model_path: str | None = None) -> str | None:
    """The shipped head directory for a target: the default model (model_path None) has
    one; other models have none (None)."""
    return None if model_path is not None else _shipped(DEFAULT_HEAD)


def shipped_medusa_path(model_path: str | None = None) -> str | None:
    """The shipped Medusa heads directory for a target (as shipped_head_path)."""
    return None if model_path is not None else _shipped(DEFAULT_MEDUSA)


def shipped_heads() -> list[str]:
    """The names of the shipped head directories (each has a config.json and a CARD.md)."""
    return sorted(name for name in os.listdir(_HERE) if _shipped(name))


def resolve_head(path: str) -> str:
    """A --head value: an existing directory is itself; otherwise the name of a shipped head
    (`specdec generate --head smollm2-135m-instruct-eagle3`) is its directory; anything else
    is returned as given (loading it then names what is missing)."""
    if os.path.isdir(path) or os.sep in path:
        return path
    return _shipped(path) or path
