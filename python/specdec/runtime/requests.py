"""A request's life in the engine: what is asked (Request, SamplingParams), what it gives
back (Result), and the engine's record of it while it waits and runs (_Seq); the handle a
caller holds is the engine's RequestHandle (Engine.submit)."""

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from specdec.errors import InvalidRequestError
from specdec.runtime.stats import Stats


@dataclass
class SamplingParams:
    temperature: float = 0.0  # 0 = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1 = off
    seed: int | None = None  # None: drawn from torch's global RNG
    max_new_tokens: int = 128
    stop: tuple[str, ...] = ()  # stop strings (need a tokenizer)
    ignore_eos: bool = False

    def validate(self) -> None:
        t = self.temperature
        if not isinstance(t, (int, float)) or not (t >= 0 and t < float("inf")):
            raise InvalidRequestError(f"temperature must be a finite number >= 0, got {t!r}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise InvalidRequestError(
                f"top_k must be an integer >= 0 (0 disables it), got {self.top_k!r}"
            )
        if not isinstance(self.top_p, (int, float)) or not 0 < self.top_p <= 1:
            raise InvalidRequestError(
                f"top_p must be in (0, 1] (1 disables it), got {self.top_p!r}"
            )
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise InvalidRequestError(
                f"max_new_tokens must be an integer >= 1, got {self.max_new_tokens!r}"
            )
        # the range torch.Generator.manual_seed accepts
        if self.seed is not None and (
            not isinstance(self.seed, int) or not -(2**63) <= self.seed < 2**64
        ):
            raise InvalidRequestError(
                f"seed must be an integer in [-2**63, 2**64), got {self.seed!r}"
            )


@dataclass
class Request:
    prompt_ids: list[int]
    params: SamplingParams = field(default_factory=SamplingParams)
    id: object = None  # defaults to the request's index in the submitted list
    prompt: str | None = None  # the original text, echoed in the Result


@dataclass
class Result:
    request_id: object
    prompt: str | None
    prompt_ids: list[int]
    token_ids: list[int]  # generated tokens (an EOS that ended the request included)
    text: str | None  # decoded (stop string cut off); None without a tokenizer or tokens
    finish_reason: str  # "eos" | "stop" | "length" | "error"
    stats: Stats
    error: str | None = None  # finish_reason "error": what went wrong (this request only)


@dataclass(eq=False)
class _Seq:
    """A request while it waits and runs."""

    req: Request
    slot: int
    generator: torch.Generator | None
    stats: Stats
    arrival: float
    first_token_time: float = 0.0
    tokens: list = field(default_factory=list)
    finish_reason: str | None = None
    text: str | None = None
    error: str | None = None
    on_finish: Callable | None = None  # callable(result)
    owner: object = None  # the Run that submitted it (None: submit())
    handle: Any = None  # its engine.RequestHandle, once submitted
