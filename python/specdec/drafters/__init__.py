"""Drafters: what proposes each step's draft tree to the engine (specdec.runtime.engine).

    from specdec.drafters import PlainDrafter, EagleDrafter, NgramDrafter, MedusaDrafter
    engine = Engine(model, tok, drafter=NgramDrafter(max_n=4, min_n=1), tree="chain:6")

base.py holds the interface (`Drafter`, `Proposal`); one module per drafter. Names are
imported lazily: a drafter's module (the EAGLE one imports the head, drafting and the ops)
loads only when it is used.
"""

import importlib

_LAZY = {
    "Drafter": "base",
    "Proposal": "base",
    "PlainDrafter": "plain",
    "EagleDrafter": "eagle",
    "NgramDrafter": "ngram",
    "MergedDrafter": "merged",
    "DraftModelDrafter": "draft_model",
    "MedusaDrafter": "medusa",
}

__all__ = sorted(_LAZY)


def __getattr__(name):
    if name in _LAZY:
        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
