"""Typed errors of the specdec API.

Every user-facing failure (bad model path, mismatched head, bad request) raises a
subclass of SpecdecError; the CLI turns them into one line on stderr and exit code 2.
They also subclass ValueError, so callers that only know "bad input" still catch them.
"""


class SpecdecError(Exception):
    """Base class of every error the specdec API raises on bad input."""


class ModelLoadError(SpecdecError, ValueError):
    """Unknown model path, unreadable checkpoint or unsupported architecture."""


class HeadMismatchError(SpecdecError, ValueError):
    """An EAGLE head whose dimensions / vocabulary do not match the target model."""


class InvalidRequestError(SpecdecError, ValueError):
    """A generation request the engine cannot serve: empty prompt, prompt longer than
    the cache, or invalid sampling parameters; or engine arguments it cannot honour
    (batch_size < 1, caches larger than the free memory, an unwritable --output)."""


class InvalidTreeSpecError(SpecdecError, ValueError):
    """A malformed drafting-tree specification (e.g. `--tree chain:0`)."""
