"""Render a checkpoint's chat template with jinja2 the way transformers'
`apply_chat_template` does: sandboxed environment, trim_blocks + lstrip_blocks,
loop controls, `raise_exception`, `strftime_now`, and a `tojson` that keeps non-ASCII."""
from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache

import jinja2
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment


class ChatTemplateError(ValueError):
    """The template raised (e.g. roles out of order) or does not compile."""


def _raise_exception(message: str):
    raise ChatTemplateError(message)


def _tojson(x, ensure_ascii: bool = False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@lru_cache(maxsize=8)
def _compile(source: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    try:
        return env.from_string(source)
    except jinja2.TemplateError as e:
        raise ChatTemplateError(f"chat template does not compile: {e}") from None


def render_chat_template(source: str, messages: list[dict], add_generation_prompt: bool = True,
                         special_tokens: dict[str, str] | None = None,
                         **kwargs: object) -> str:
    """Return the prompt string for `messages`. Pure: mutates nothing."""
    try:
        return _compile(source).render(messages=messages,
                                       add_generation_prompt=add_generation_prompt,
                                       **(special_tokens or {}), **kwargs)
    except jinja2.TemplateError as e:
        raise ChatTemplateError(f"chat template failed: {e}") from None
