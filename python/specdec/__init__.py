"""specdec: exact speculative decoding (EAGLE heads, tree drafting) on the specdec_kernels ops.

    from specdec import load_model, Engine, Request, SamplingParams, EagleHead
    model, tok = load_model()
    engine = Engine(model, tok, head=EagleHead.random(model), tree="dynamic:5,8,32")
    # prompt lookup: engine = Engine(model, tok, drafter=NgramDrafter(max_n=4), tree="chain:6")
    results, stats = engine.generate([Request(tok.apply_chat_template([...]))])

Names are imported lazily, so `import specdec` (and the CLI's argument parsing) does not
build or load the C++ ops until a model is used.
"""

import importlib

from specdec.errors import (
    HeadMismatchError,
    InvalidRequestError,
    InvalidTreeSpecError,
    ModelLoadError,
    SpecdecError,
)

_LAZY = {
    "Engine": "runtime.engine",
    "Request": "runtime.requests",
    "Result": "runtime.requests",
    "SamplingParams": "runtime.requests",
    "RequestHandle": "runtime.engine",
    "EagleHead": "drafters.eagle_head",
    "load_head": "drafters.eagle_head",
    "TreeSpec": "speculation.trees",
    "Stats": "runtime.stats",
    "Drafter": "drafters",
    "PlainDrafter": "drafters",
    "EagleDrafter": "drafters",
    "NgramDrafter": "drafters",
    "Transformer": "models.llama",
    "ModelArgs": "models.config",
    "load_model": "models.loader",
    "gguf_checkpoint_dir": "models.loader",
    "Tokenizer": "models.tokenizer",
}

__all__ = sorted(_LAZY) + [
    "HeadMismatchError",
    "InvalidRequestError",
    "InvalidTreeSpecError",
    "ModelLoadError",
    "SpecdecError",
]


def __getattr__(name):
    if name in _LAZY:
        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
