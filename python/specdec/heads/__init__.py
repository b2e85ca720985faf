"""EAGLE and Medusa heads shipped with the package (package data), a directory per target."""

import os

DEFAULT_HEAD = "smollm2-135m-instruct"  # trained for the default model (see its CARD.md)
DEFAULT_MEDUSA = "smollm2-135m-instruct-medusa"  # Medusa heads for it (see its CARD.md)


def shipped_head_path(model_path: str | None = None) -> str | None:
    """The shipped head directory for a target: the default model (model_path None) has
    one; other models have none (None)."""
    if model_path is not None:
        return None
    path = os.path.join(os.path.dirname(__file__), DEFAULT_HEAD)
    return path if os.path.isfile(os.path.join(path, "config.json")) else None


def shipped_medusa_path(model_path: str | None = None) -> str | None:
    """The shipped Medusa heads directory for a target (as shipped_head_path)."""
    if model_path is not None:
        return None
    path = os.path.join(os.path.dirname(__file__), DEFAULT_MEDUSA)
    return path if os.path.isfile(os.path.join(path, "config.json")) else None
