"""Drafters: what proposes each step's draft tree to the engine (specdec.engine).

    from specdec.drafters import PlainDrafter, EagleDrafter
    engine = Engine(model, tok, drafter=EagleDrafter(head), tree="dynamic:5,8,32")

base.py holds the interface (`Drafter`, `Proposal`); one module per drafter. Names are
imported lazily (drafting.py imports base.py, and the EAGLE drafter imports drafting.py).
"""
import importlib

_LAZY = {"Drafter": "base", "Proposal": "base", "PlainDrafter": "plain", "EagleDrafter": "eagle"}

__all__ = sorted(_LAZY)


def __getattr__(name):
    if name in _LAZY:
        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
