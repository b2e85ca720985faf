"""Tokenizer: a `tokenizers` tokenizer plus the checkpoint's Jinja chat template.

Reads a Hugging Face tokenizer directory (tokenizer.json, tokenizer_config.json, optional
chat_template.jinja and generation_config.json) without needing transformers; the chat
template is rendered the way transformers' apply_chat_template renders it.
"""

import json
import os
from datetime import datetime

import jinja2
import tokenizers
from jinja2.sandbox import ImmutableSandboxedEnvironment

SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token")


class Tokenizer:
    def __init__(
        self,
        tokenizer: tokenizers.Tokenizer,
        chat_template: str | None,
        special_tokens: dict,
        eos_token_ids: set,
    ):
        """special_tokens: {"bos_token": "<s>", ...} (strings or None); eos_token_ids: ids that end
        a reply."""
        self._tok = tokenizer
        self._template = _compile(chat_template) if chat_template else None
        self.special_tokens = special_tokens
        bos = special_tokens.get("bos_token")
        self.bos_token_id = tokenizer.token_to_id(bos) if bos else None
        self.eos_token_ids = set(eos_token_ids)
        self.vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)

    @classmethod
    def from_dir(cls, path: str) -> "Tokenizer":
        tok = tokenizers.Tokenizer.from_file(os.path.join(path, "tokenizer.json"))
        config = _read_json(os.path.join(path, "tokenizer_config.json"))
        special = {k: _content(config.get(k)) for k in SPECIAL_TOKEN_KEYS}
        template = config.get("chat_template")
        jinja_file = os.path.join(path, "chat_template.jinja")  # where transformers 5 saves it
        if os.path.exists(jinja_file):
            with open(jinja_file, encoding="utf-8") as f:
                template = f.read()
        if isinstance(template, list):  # named templates: [{"name": "default", "template": ...}]
            template = {t["name"]: t["template"] for t in template}.get("default")
        eos = _as_list(_read_json(os.path.join(path, "generation_config.json")).get("eos_token_id"))
        if special["eos_token"] and tok.token_to_id(special["eos_token"]) is not None:
            eos.append(tok.token_to_id(special["eos_token"]))
        return cls(tok, template, special, set(eos))

    def encode(self, text: str, add_special_tokens=False) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids, skip_special_tokens=True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def render_chat(self, messages: list[dict], add_generation_prompt=True) -> str:
        if self._template is None:
            raise ValueError("this model has no chat template; pass a raw prompt instead")
        return self._template.render(
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            **{k: v or "" for k, v in self.special_tokens.items()},
        )

    def apply_chat_template(self, messages: list[dict], add_generation_prompt=True) -> list[int]:
        return self.encode(
            self.render_chat(messages, add_generation_prompt), add_special_tokens=False
        )


def _compile(template: str) -> jinja2.Template:
    """The environment transformers renders chat templates in (sandboxed, trimmed blocks)."""
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
    )

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(
            x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
        )

    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(template)


def _read_json(path):
    if not os.path.exists(path):
        return {}
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def _content(token):
    """A special token as tokenizer_config.json writes it: a string or an AddedToken dict."""
    return token.get("content") if isinstance(token, dict) else token


def _as_list(x):
    return [] if x is None else list(x) if isinstance(x, (list, tuple)) else [x]
