"""Tool calling in /v1/chat/completions: the hooks the chat endpoint (api/chat.py) calls.

- `prepare_chat` (parsing): the tool fields validated (`request.py`), the tools written
  into the system prompt (`prompt.py`), and the constraint that enforces a call set on
  the sampling parameters.
- `render_tool_turns` (parsing): earlier assistant calls and `role: "tool"` results as text.
- `ToolOutputs` (formatting): each choice's text read back as content and `tool_calls`
  (`calls.py`), as a message or as stream deltas, and `finish_reason: "tool_calls"`
  when an answer that ended normally made calls.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from splitserve.gateway.bounds import MAX_TOOLS, check_count
from splitserve.gateway.tools.calls import ToolCallParser, assemble
from splitserve.gateway.tools.prompt import render_tool_turns, with_tools_prompt
from splitserve.gateway.tools.request import (
    ToolError,
    ToolRequest,
    constraint,
    parse_tool_request,
)

__all__ = ["ToolError", "ToolOutputs", "ToolRequest", "prepare_chat", "render_tool_turns"]

# Request fields that constrain the answer themselves (the OpenAI API's and vLLM's spellings).
_OUTPUT_FIELDS = (
    "response_format",
    "structured_outputs",
    "guided_json",
    "guided_regex",
    "guided_choice",
    "guided_grammar",
)


def prepare_chat(
    raw: Callable[[str], object], messages: list[dict[str, str]], sampling: dict[str, object]
) -> tuple[list[dict[str, str]], ToolRequest | None]:
    """The messages to render (with the tools section) and the request's tools, from the
    body's fields (`raw(name)`: a field's value, its model (`schema.py`) or plain JSON, None if
    absent), read as they are: no trip back to JSON. Sets `sampling["structured_output"]` when
    the tool choice must be enforced. Raises ToolError (HTTP 400 naming the field)."""
    check_count("tools", raw("tools"), MAX_TOOLS)
    request = parse_tool_request(raw("tools"), raw("tool_choice"), raw("parallel_tool_calls"))
    if request is None:
        return messages, None
    output = constraint(request)
    if output is not None:
        other = _output_field(raw, sampling)
        if other is not None:
            raise ToolError(
                f"tool_choice {_choice_text(request)} constrains the answer to tool calls and "
                f"cannot be combined with {other}",
                "tool_choice",
            )
        sampling["structured_output"] = output
    return with_tools_prompt(messages, request), request


def _output_field(raw: Callable[[str], object], sampling: dict[str, object]) -> str | None:
    for name in _OUTPUT_FIELDS:
        value = raw(name)
        # response_format as its model or as JSON; "text" constrains nothing.
        kind = value.get("type") if isinstance(value, dict) else getattr(value, "type", None)
        if value is not None and not (name == "response_format" and kind == "text"):
            return name
    return "structured_outputs" if sampling.get("structured_output") is not None else None


def _choice_text(request: ToolRequest) -> str:
    if request.choice == "function":
        return f"naming {request.function_name!r}"
    if request.choice == "auto":
        return '"auto" with a strict tool'
    return repr(request.choice)


@dataclass
class ToolOutputs:
    """One chat request's answers read for tool calls, choice by choice."""

    request: ToolRequest
    _parsers: dict[int, ToolCallParser] = field(default_factory=dict)  # choice index -> parser

    @classmethod
    def for_request(cls, request: ToolRequest | None) -> ToolOutputs | None:
        """None when answers are plain text (no tools, or tool_choice "none")."""
        return cls(request) if request is not None and request.is_parsed else None

    def delta(self, index: int, text: str, finish_reason: str | None) -> tuple[dict, str | None]:
        """The stream delta's fields (`content`, `tool_calls`; role aside) for a chunk of
        choice `index`, and the chunk's finish reason."""
        parser = self._parsers.setdefault(index, ToolCallParser(self.request))
        piece = parser.feed(text)
        if finish_reason is not None:
            piece.extend(parser.finish())
        fields: dict[str, object] = {}
        if piece.content:
            fields["content"] = piece.content
        if piece.tool_calls:
            fields["tool_calls"] = piece.tool_calls
        return fields, _finish_reason(parser, finish_reason)

    def message(self, text: str, finish_reason: str | None) -> tuple[dict, str | None]:
        """The message of a whole answer, and its finish reason."""
        parser = ToolCallParser(self.request)
        answer = assemble(parser.feed(text).extend(parser.finish()))
        message: dict[str, object] = {"role": "assistant", "content": answer.content}
        if answer.tool_calls:
            message["tool_calls"] = answer.tool_calls
        return message, _finish_reason(parser, finish_reason)


def _finish_reason(parser: ToolCallParser, finish_reason: str | None) -> str | None:
    # "length" stays: the calls were cut short, and the client should know.
    return "tool_calls" if finish_reason == "stop" and parser.has_calls else finish_reason
