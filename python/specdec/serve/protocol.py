"""Request bodies of the OpenAI endpoints -> what the engine runs, or an APIError.

    parse_json(body bytes) -> dict
    parse_chat(body, served) / parse_completion(body, served) -> GenerationRequest

Every field the server takes is checked here, before anything reaches the engine: its type,
its range, and the context it leaves for the completion. A field of the OpenAI API the server
does not implement is accepted only at the value that asks for nothing (its default: `logprobs`
false, `tools` [] or null, ...) and refused with a 400 naming it otherwise; a field the API does
not have at all is refused too (docs/serving.md, "Request fields"). Nothing is silently ignored.
"""

import json
import math
from dataclasses import dataclass

from specdec import InvalidRequestError, SamplingParams
from specdec.serve.errors import APIError, bad_request

MAX_STOP_STRINGS = 16  # each is searched for in the decoded reply after every token
COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's legacy completions default
MAX_TEMPERATURE = 2.0  # OpenAI's range: [0, 2]
ROLES = ("system", "developer", "user", "assistant")  # developer: OpenAI's newer name for system

# fields both endpoints implement
COMMON_FIELDS = (
    "model",
    "stream",
    "stream_options",
    "max_tokens",
    "temperature",
    "top_p",
    "top_k",
    "seed",
    "stop",
    "n",
    "ignore_eos",
    "user",
)
CHAT_FIELDS = frozenset((*COMMON_FIELDS, "messages", "max_completion_tokens"))
COMPLETION_FIELDS = frozenset((*COMMON_FIELDS, "prompt"))

# OpenAI fields not implemented: the values that ask for nothing (anything else is a 400)
_PENALTIES = {
    "presence_penalty": (None, 0),
    "frequency_penalty": (None, 0),
    "logit_bias": (None, {}),
}
NEUTRAL_CHAT = {
    **_PENALTIES,
    "logprobs": (None, False),
    "top_logprobs": (None, 0),
    "tools": (None, []),
    "tool_choice": (None, "none"),
    "parallel_tool_calls": (None, True, False),  # without tools it has nothing to act on
    "functions": (None, []),
    "function_call": (None, "none"),
    "response_format": (None, {"type": "text"}),
    "modalities": (None, ["text"]),
    "audio": (None,),
    "prediction": (None,),
    "reasoning_effort": (None,),
    "verbosity": (None,),
    "web_search_options": (None,),
    "service_tier": (None, "auto", "default"),
    "store": (None, False),
    "metadata": (None, {}),
    "prompt_cache_key": (None,),
    "prompt_cache_options": (None,),
    "prompt_cache_retention": (None,),
    "moderation": (None,),
    "safety_identifier": (None,),
}
NEUTRAL_COMPLETION = {
    **_PENALTIES,
    "logprobs": (None,),
    "echo": (None, False),
    "best_of": (None, 1),
    "suffix": (None,),
}
# message keys besides role and content (what the openai client writes when a reply object is
# sent back as a message): accepted when they carry nothing
NEUTRAL_MESSAGE = {
    "name": (None,),
    "refusal": (None,),
    "tool_calls": (None, []),
    "function_call": (None,),
    "audio": (None,),
    "annotations": (None, []),
}


@dataclass(frozen=True)
class ServedModel:
    """What request parsing needs to know about the model behind the server."""

    name: str  # the `model` requests must name (--served-model-name)
    tokenizer: object  # specdec.tokenizer.Tokenizer
    context: int  # positions per request: prompt + completion tokens
    vocab_size: int


@dataclass
class GenerationRequest:
    """One checked request: its prompt's token ids and how to sample the completion."""

    endpoint: str  # "chat" | "completion"
    prompt_ids: list
    params: SamplingParams
    stream: bool
    include_usage: bool  # stream_options.include_usage: a last chunk with the usage counts


def parse_json(body: bytes) -> dict:
    """The request body as a JSON object (NaN / Infinity refused: they are not JSON)."""

    def no_constants(name):
        raise ValueError(f"{name} is not valid JSON")

    try:
        value = json.loads(body, parse_constant=no_constants)
    except RecursionError:
        raise bad_request("invalid JSON body: nested too deeply") from None
    except ValueError as e:  # JSONDecodeError, UnicodeDecodeError
        raise bad_request(f"invalid JSON body: {e}") from None
    if not isinstance(value, dict):
        raise bad_request(f"the request body must be a JSON object, got {_json_type(value)}")
    return value


def parse_chat(body: dict, served: ServedModel) -> GenerationRequest:
    """POST /v1/chat/completions: messages rendered through the model's chat template."""
    _check_fields(body, CHAT_FIELDS, NEUTRAL_CHAT)
    _check_model(body, served)
    messages = _messages(body.get("messages"))
    try:
        prompt_ids = served.tokenizer.apply_chat_template(messages)
    except Exception as e:  # no template (ValueError), a template's raise_exception (jinja2)
        raise bad_request(
            f"cannot apply the model's chat template to messages: {type(e).__name__}: {e}",
            "messages",
        ) from None
    if body.get("max_tokens") is not None and body.get("max_completion_tokens") is not None:
        raise bad_request(
            "max_tokens and max_completion_tokens are both set: give one "
            "(max_completion_tokens is OpenAI's newer name)",
            "max_tokens",
        )
    field = "max_tokens"
    if body.get("max_completion_tokens") is not None:
        field = "max_completion_tokens"
    return _request("chat", body, served, prompt_ids, "messages", field, default_max=None)


def parse_completion(body: dict, served: ServedModel) -> GenerationRequest:
    """POST /v1/completions: a raw prompt (text, tokenized with the tokenizer's special tokens
    as `specdec generate --no-chat-template` does, or token ids)."""
    _check_fields(body, COMPLETION_FIELDS, NEUTRAL_COMPLETION)
    _check_model(body, served)
    prompt_ids = _prompt(body.get("prompt"), served, "prompt")
    return _request(
        "completion",
        body,
        served,
        prompt_ids,
        "prompt",
        "max_tokens",
        default_max=COMPLETIONS_DEFAULT_MAX_TOKENS,
    )


# ---------------------------------------------------------------------- the shared fields
def _request(endpoint, body, served, prompt_ids, prompt_field, max_field, default_max):
    n = len(prompt_ids)
    room = served.context - n
    if room < 1:
        raise bad_request(
            f"{prompt_field}: the prompt is {n} tokens, which leaves no room for a completion "
            f"in this server's context of {served.context} tokens per request (prompt + "
            "completion)",
            prompt_field,
            "context_length_exceeded",
        )
    max_tokens = _int(body, max_field, lo=1)
    if max_tokens is None:
        max_tokens = room if default_max is None else min(default_max, room)
    elif max_tokens > room:
        raise bad_request(
            f"{max_field} ({max_tokens}) plus the prompt ({n} tokens) is more than this "
            f"server's context of {served.context} tokens per request: at most {room}",
            max_field,
            "context_length_exceeded",
        )
    temperature = _number(body, "temperature", 0.0, MAX_TEMPERATURE, default=1.0)
    top_p = _number(body, "top_p", 0.0, 1.0, default=1.0, lo_open=True)
    top_k = _int(body, "top_k", lo=-1, hi=served.vocab_size)
    seed = _int(body, "seed", lo=-(2**63), hi=2**64 - 1)
    n_choices = _int(body, "n", lo=1)
    if n_choices is not None and n_choices > 1:
        raise bad_request(f"n = {n_choices} is not supported: one choice per request (n = 1)", "n")
    _string(body, "user")
    stream = _bool(body, "stream", False)
    include_usage = _stream_options(body.get("stream_options"), stream)
    params = SamplingParams(
        temperature=temperature,
        top_k=0 if top_k in (None, -1) else top_k,  # -1: vLLM's "off"
        top_p=top_p,
        seed=seed,
        max_new_tokens=max_tokens,
        stop=_stop(body.get("stop")),
        ignore_eos=_bool(body, "ignore_eos", False),
    )
    try:
        params.validate()
    except InvalidRequestError as e:  # the checks above cover it; the engine's word is final
        raise bad_request(str(e)) from None
    return GenerationRequest(endpoint, list(prompt_ids), params, stream, include_usage)


def _check_fields(body: dict, supported: frozenset, neutral: dict):
    unknown = [k for k in body if k not in supported and k not in neutral]
    if unknown:
        names = ", ".join(repr(k) for k in unknown)
        raise bad_request(f"unrecognized request argument(s): {names}", unknown[0])
    for name, allowed in neutral.items():
        if name in body and not _is_neutral(body[name], allowed):
            shown = ", ".join("null" if a is None else json.dumps(a) for a in allowed)
            raise bad_request(
                f"{name} is not supported by this server (accepted only as {shown}); got "
                f"{json.dumps(body[name])[:80]}",
                name,
            )


def _check_model(body, served: ServedModel):
    model = body.get("model")
    if model is None:
        return
    if not isinstance(model, str):
        raise bad_request(f"model must be a string, got {_json_type(model)}", "model")
    if model != served.name:
        raise APIError(
            404,
            f"the model {model!r} does not exist: this server serves {served.name!r}",
            "model",
            "model_not_found",
        )


def _messages(value) -> list:
    if value is None:
        raise bad_request("missing required parameter: 'messages'", "messages")
    if not isinstance(value, list):
        raise bad_request(f"messages must be a list, got {_json_type(value)}", "messages")
    if not value:
        raise bad_request("messages must be a non-empty list", "messages")
    out = []
    for i, m in enumerate(value):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise bad_request(
                f"{where} must be an object with 'role' and 'content', got {_json_type(m)}", where
            )
        if "role" not in m:
            raise bad_request(f"{where} has no 'role'", f"{where}.role")
        role = m["role"]
        if role in ("tool", "function"):
            raise bad_request(
                f"{where}.role {role!r} is not supported: this server has no tool or function "
                "calls",
                f"{where}.role",
            )
        if not isinstance(role, str) or role not in ROLES:
            raise bad_request(
                f"{where}.role must be one of {', '.join(ROLES)}; got {json.dumps(role)[:40]}",
                f"{where}.role",
            )
        for key in m:
            if key in ("role", "content"):
                continue
            if key not in NEUTRAL_MESSAGE or not _is_neutral(m[key], NEUTRAL_MESSAGE[key]):
                raise bad_request(
                    f"{where}.{key} is not supported by this server", f"{where}.{key}"
                )
        if "content" not in m:
            raise bad_request(f"{where} has no 'content'", f"{where}.content")
        role = "system" if role == "developer" else role
        out.append({"role": role, "content": _content(m["content"], where)})
    return out


def _content(content, where: str) -> str:
    """A message's text: a string, or a list of text parts (joined by newlines)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_request(
            f"{where}.content must be a string or a list of text parts, got {_json_type(content)}",
            f"{where}.content",
        )
    if not content:
        raise bad_request(f"{where}.content must not be an empty list", f"{where}.content")
    texts = []
    for j, part in enumerate(content):
        at = f"{where}.content[{j}]"
        if not isinstance(part, dict):
            raise bad_request(f"{at} must be an object, got {_json_type(part)}", at)
        kind = part.get("type")
        if kind != "text":
            raise bad_request(
                f"{at}.type {json.dumps(kind)[:40]} is not supported: text parts only", f"{at}.type"
            )
        extra = [k for k in part if k not in ("type", "text")]
        if extra:
            key = f"{at}.{extra[0]}"
            raise bad_request(f"{key} is not supported by this server", key)
        if not isinstance(part.get("text"), str):
            raise bad_request(f"{at}.text must be a string", f"{at}.text")
        texts.append(part["text"])
    return "\n".join(texts)


def _prompt(value, served: ServedModel, where: str) -> list:
    """A completion prompt: text, token ids, or a list holding one of them."""
    if value is None:
        raise bad_request("missing required parameter: 'prompt'", "prompt")
    if isinstance(value, str):
        if not value:
            raise bad_request("prompt must not be empty", "prompt")
        try:
            ids = served.tokenizer.encode(value, add_special_tokens=True)
        except Exception as e:
            raise bad_request(
                f"cannot tokenize the prompt: {type(e).__name__}: {e}", "prompt"
            ) from None
        if not ids:
            raise bad_request("the prompt tokenizes to no token", "prompt")
        return ids
    if not isinstance(value, list):
        raise bad_request(
            f"prompt must be a string, a list of token ids, or a list holding one of them; got "
            f"{_json_type(value)}",
            "prompt",
        )
    if not value:
        raise bad_request("prompt must not be empty", "prompt")
    if all(_is_int(t) for t in value):
        bad = next((t for t in value if not 0 <= t < served.vocab_size), None)
        if bad is not None:
            raise bad_request(
                f"prompt token id {bad} is out of range: ids must be in [0, {served.vocab_size})",
                "prompt",
            )
        return list(value)
    if all(isinstance(p, (str, list)) for p in value):
        if len(value) > 1:
            raise bad_request(
                f"prompt holds {len(value)} prompts: one prompt per request is supported",
                "prompt",
            )
        if isinstance(value[0], list) and not all(_is_int(t) for t in value[0]):
            raise bad_request("prompt: a list of token ids must hold integers only", "prompt")
        return _prompt(value[0], served, where)
    raise bad_request(
        "prompt must be a string, a list of token ids, or a list holding one of them", "prompt"
    )


def _stop(value) -> tuple:
    if value is None:
        return ()
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise bad_request(
            f"stop must be a string or a list of strings, got {_json_type(value)}", "stop"
        )
    if len(stops) > MAX_STOP_STRINGS:
        raise bad_request(f"stop holds {len(stops)} strings: at most {MAX_STOP_STRINGS}", "stop")
    if any(not s for s in stops):
        raise bad_request("stop strings must not be empty", "stop")
    return tuple(stops)


def _stream_options(value, stream: bool) -> bool:
    """-> include_usage."""
    if value is None:
        return False
    if not stream:
        raise bad_request("stream_options is only allowed when stream is true", "stream_options")
    if not isinstance(value, dict):
        raise bad_request(
            f"stream_options must be an object, got {_json_type(value)}", "stream_options"
        )
    extra = [k for k in value if k != "include_usage"]
    if extra:
        raise bad_request(
            f"stream_options.{extra[0]} is not supported by this server (include_usage only)",
            f"stream_options.{extra[0]}",
        )
    return bool(_bool(value, "include_usage", False, where="stream_options."))


# ---------------------------------------------------------------------- typed fields
def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _is_neutral(value, allowed: tuple) -> bool:
    for a in allowed:
        if a is None or isinstance(a, bool):
            if value is a:
                return True
        elif _is_number(a):
            if _is_number(value) and value == a:
                return True
        elif value == a:
            return True
    return False


def _int(body, name, lo=None, hi=None, where=""):
    v = body.get(name)
    if v is None:
        return None
    if not _is_int(v):
        raise bad_request(f"{where}{name} must be an integer, got {_json_type(v)}", where + name)
    if (lo is not None and v < lo) or (hi is not None and v > hi):
        bounds = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
        raise bad_request(f"{where}{name} must be {bounds}, got {v}", where + name)
    return v


def _number(body, name, lo, hi, default, lo_open=False):
    v = body.get(name)
    if v is None:
        return default
    if not _is_number(v) or not math.isfinite(v):
        raise bad_request(f"{name} must be a number, got {_json_type(v)}", name)
    if v < lo or v > hi or (lo_open and v == lo):
        interval = f"{'(' if lo_open else '['}{lo:g}, {hi:g}]"
        raise bad_request(f"{name} must be in {interval}, got {v}", name)
    return float(v)


def _bool(body, name, default, where=""):
    v = body.get(name)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise bad_request(f"{where}{name} must be true or false, got {_json_type(v)}", where + name)
    return v


def _string(body, name):
    v = body.get(name)
    if v is not None and not isinstance(v, str):
        raise bad_request(f"{name} must be a string, got {_json_type(v)}", name)
    return v


def _json_type(v) -> str:
    """How JSON names v's type, with the value when it is short."""
    if v is None:
        return "null"
    if isinstance(v, bool):
        return f"boolean {json.dumps(v)}"
    if isinstance(v, (int, float)):
        return f"number {v!r}"
    if isinstance(v, str):
        return f"string {json.dumps(v)[:40]}"
    if isinstance(v, list):
        return "an array"
    return "an object"
