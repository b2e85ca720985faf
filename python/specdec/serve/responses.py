"""OpenAI response bodies: completions, their stream chunks, usage, the model list.

    chat:        chat.completion        / chat.completion.chunk (delta.role, delta.content)
    completions: text_completion        / text_completion chunks (text)

Streams are server-sent events, one `data: {json}` per chunk and `data: [DONE]` last
(docs/serving.md, "Streaming").
"""

import json

# engine finish reasons -> OpenAI's (eos: the model ended its reply)
FINISH_REASONS = {"eos": "stop", "stop": "stop", "length": "length"}
DONE = b"data: [DONE]\n\n"


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def completion(endpoint, response_id, created, model, text, finish_reason, usage_counts) -> dict:
    if endpoint == "chat":
        choice = {
            "index": 0,
            "message": {"role": "assistant", "content": text},
            "logprobs": None,
            "finish_reason": finish_reason,
        }
        kind = "chat.completion"
    else:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
        kind = "text_completion"
    return {
        "id": response_id,
        "object": kind,
        "created": created,
        "model": model,
        "choices": [choice],
        "usage": usage_counts,
    }


class ChunkWriter:
    """The SSE chunks of one streamed response. include_usage: every chunk carries "usage":
    null and a last chunk (no choices) the counts, as OpenAI's stream_options asks."""

    def __init__(self, endpoint: str, response_id: str, created: int, model: str, include_usage):
        self.endpoint, self.include_usage = endpoint, include_usage
        self.kind = "chat.completion.chunk" if endpoint == "chat" else "text_completion"
        self.head = {"id": response_id, "object": self.kind, "created": created, "model": model}

    def role(self) -> bytes:
        """A chat stream's first chunk (sent with the first token)."""
        return self._choice({"role": "assistant", "content": ""}, None)

    def text(self, text: str) -> bytes:
        return self._choice({"content": text} if self.endpoint == "chat" else text, None)

    def finish(self, finish_reason: str) -> bytes:
        return self._choice({} if self.endpoint == "chat" else "", finish_reason)

    def usage(self, counts: dict) -> bytes:
        return event({**self.head, "choices": [], "usage": counts})

    def _choice(self, content, finish_reason) -> bytes:
        if self.endpoint == "chat":
            choice = {"index": 0, "delta": content, "logprobs": None}
        else:
            choice = {"index": 0, "text": content, "logprobs": None}
        choice["finish_reason"] = finish_reason
        chunk = {**self.head, "choices": [choice]}
        if self.include_usage:
            chunk["usage"] = None
        return event(chunk)


def event(payload: dict) -> bytes:
    """One server-sent event."""
    return (
        b"data: "
        + json.dumps(payload, ensure_ascii=False, separators=(",", ":")).encode()
        + b"\n\n"
    )


def model_list(model: dict) -> dict:
    return {"object": "list", "data": [model]}
