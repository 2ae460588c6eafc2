"""Chat prompts: render a model's Jinja chat template the way transformers' `apply_chat_template` does."""

from __future__ import annotations

import json
from datetime import datetime
from typing import Any, Sequence

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

from magicdec.errors import InvalidRequestError
from magicdec.loading.tokenizer import Tokenizer


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, separators=None,
            sort_keys: bool = False) -> str:
    # transformers' tojson: unlike Jinja's own, it does not escape HTML characters.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


class ChatTemplate:
    """A compiled chat template with the tokenizer's special tokens (sandboxed, as transformers renders it)."""

    def __init__(self, source: str, tokenizer: Tokenizer):
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        self.template = env.from_string(source)
        self.special = {"bos_token": tokenizer.bos_token or "", "eos_token": tokenizer.eos_token or ""}

    def render(self, messages: Sequence[dict[str, str]], add_generation_prompt: bool = True) -> str:
        """The prompt text for `messages` ({"role", "content"} dicts); a template error is an invalid request."""
        try:
            return self.template.render(messages=list(messages), add_generation_prompt=add_generation_prompt,
                                        **self.special)
        except jinja2.TemplateError as e:
            raise InvalidRequestError(f"the chat template rejected the messages: {e}") from None
