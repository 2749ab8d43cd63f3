"""Chat templates: the Jinja program a model ships to turn a conversation into prompt text.

Rendered the way Hugging Face transformers renders them (same Jinja options, same helpers, same
variables), so a prompt built here is byte-for-byte the prompt the model was tuned on. The
environment is sandboxed and immutable because the template comes from a model file, which we
treat as untrusted input.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment


class ChatTemplate:
    """A compiled chat template plus the special-token strings it may refer to."""

    def __init__(self, source: str, special_tokens: Mapping[str, str] | None = None) -> None:
        # special_tokens: template variable -> token text, e.g. {"bos_token": "<s>"}.
        self.source = source
        self._special_tokens = dict(special_tokens or {})
        self._template = _environment().from_string(source)

    def render(
        self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True
    ) -> str:
        """The prompt text for `messages`; bad messages raise `ValueError` starting "messages"."""
        checked = validate_messages(messages)
        try:
            return self._template.render(
                messages=checked,
                add_generation_prompt=add_generation_prompt,
                tools=None,
                documents=None,
                **self._special_tokens,
            )
        except jinja2.TemplateError as exc:
            # Templates reject conversations they cannot express (say, two user turns in a row)
            # through raise_exception: that is the caller's input being wrong.
            raise ValueError(f"messages rejected by the chat template: {exc}") from exc


def validate_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Checks the OpenAI-style shape and returns plain-dict copies the template cannot mutate."""
    if isinstance(messages, str | bytes) or not isinstance(messages, Sequence):
        raise ValueError(f"messages must be a list of dicts, got {type(messages).__name__}")
    if not messages:
        raise ValueError("messages must not be empty")
    return [_validate_message(index, message) for index, message in enumerate(messages)]


def _validate_message(index: int, message: object) -> dict[str, Any]:
    if not isinstance(message, Mapping):
        raise ValueError(f"messages[{index}] must be a dict, got {type(message).__name__}")
    role = message.get("role")
    if not isinstance(role, str) or not role:
        raise ValueError(f"messages[{index}] needs a non-empty string 'role'")
    content = message.get("content")
    if not isinstance(content, str):
        raise ValueError(f"messages[{index}] needs a string 'content'")
    return dict(message)


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


def _tojson(
    value: object, indent: int | None = None, ensure_ascii: bool = False, sort_keys: bool = False
) -> str:
    # Jinja's own tojson escapes HTML characters (<, >, &), which would change the prompt.
    return json.dumps(value, indent=indent, ensure_ascii=ensure_ascii, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _environment() -> ImmutableSandboxedEnvironment:
    # trim_blocks/lstrip_blocks and loopcontrols are what transformers uses; templates are
    # written against them, so whitespace in the output depends on these exact options.
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env
