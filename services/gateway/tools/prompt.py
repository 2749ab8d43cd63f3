"""Tool use in the prompt, for a chat template without a tool section (SmolLM2's): the tools
and how to call them go into the system prompt, and the conversation's earlier calls and their
results become text the template renders like any other turn.

What the model reads:
- The system message gets, after its own text (or as the whole message when the conversation
  has none, which replaces the template's default system prompt), a section:

      # Tools
      You can call these tools. Each line is one tool as JSON: its name, what it does, and
      the JSON schema of its arguments.
      {"name": "get_weather", "description": "...", "parameters": {...}}
      <how to answer: only a call, only this tool's call, or text or a call>

  With tool_choice "none" nothing is added: the model answers in text.
- An assistant turn that made calls (`tool_calls`, content null) reads as the calls in the
  format the model is asked to answer in: `{"name": ..., "arguments": {...}}`, a JSON array
  of them for several, after the turn's text if it has any.
- A tool result (`role: "tool"` with `tool_call_id`) keeps its role (SmolLM2's template prints
  any role as `<|im_start|>tool`) and reads `Result of <name> (<tool_call_id>):` then the
  result, the name taken from the call of that id earlier in the conversation.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Protocol

from splitserve.gateway.tools.request import Tool, ToolError, ToolRequest
from splitserve.gateway.tools.schema import ToolCall

_SEPARATORS = (", ", ": ")  # as the grammar writes JSON, so examples and answers look alike
_CALL_FORMAT = '{"name": <tool name>, "arguments": <arguments object>}'


def _dumps(value: object) -> str:
    return json.dumps(value, ensure_ascii=False, separators=_SEPARATORS)


def tools_section(request: ToolRequest) -> str:
    lines = [
        "# Tools",
        "You can call these tools. Each line is one tool as JSON: its name, what it does, and "
        "the JSON schema of its arguments.",
        *(_dumps(_tool_card(tool)) for tool in request.tools),
        _instruction(request),
    ]
    return "\n".join(lines)


def _tool_card(tool: Tool) -> dict:
    card: dict = {"name": tool.name}
    if tool.description:
        card["description"] = tool.description
    card["parameters"] = tool.parameters
    return card


def _instruction(request: ToolRequest) -> str:
    several = (
        " To call several tools at once, reply with a JSON array of such objects."
        if request.allows_many
        else ""
    )
    if request.choice == "function":
        name = request.function_name
        return (
            f"Call the tool {name!r} now: reply with only the JSON object "
            f'{{"name": "{name}", "arguments": <arguments object>}}.'
        )
    if request.choice == "required":
        return f"Call a tool now: reply with only the JSON object {_CALL_FORMAT}.{several}"
    return (
        f"To call a tool, reply with only the JSON object {_CALL_FORMAT}.{several} "
        "If no tool is needed, reply in plain text."
    )


def with_tools_prompt(
    messages: list[dict[str, str]], request: ToolRequest | None
) -> list[dict[str, str]]:
    """`messages` with the tools section in the system message (a new first message when
    there is none); unchanged without tools or with tool_choice "none"."""
    if request is None or not request.is_parsed:
        return messages
    section = tools_section(request)
    if messages and messages[0]["role"] == "system":
        first = messages[0]
        content = f"{first['content']}\n\n{section}" if first["content"] else section
        return [{**first, "content": content}, *messages[1:]]
    return [{"role": "system", "content": section}, *messages]


# ---- earlier calls and results --------------------------------------------------------------


class Turn(Protocol):
    """What rendering reads of a chat message (the chat body's message model, validated)."""

    @property
    def role(self) -> str: ...

    @property
    def name(self) -> str | None: ...

    @property
    def tool_calls(self) -> list[ToolCall] | None: ...

    @property
    def tool_call_id(self) -> str | None: ...


def render_tool_turns(
    turns: Sequence[Turn], messages: list[dict[str, str]]
) -> list[dict[str, str]]:
    """`messages` (role and text content of each of `turns`, in order) with assistant calls
    and tool results written as text. The turns' shapes were checked by their models; what a
    shape cannot say (calls only on assistant turns, a result naming its call) raises
    ToolError naming the message."""
    names: dict[str, str] = {}  # tool_call_id -> function name, from earlier assistant turns
    rendered = []
    for i, (turn, message) in enumerate(zip(turns, messages, strict=True)):
        if turn.tool_calls:  # null and [] (as clients echo a message) mean no calls
            message = {**message, "content": _assistant_text(i, turn, message["content"], names)}
        elif message["role"] == "tool":
            message = {**message, "content": _tool_result_text(i, turn, message["content"], names)}
        rendered.append(message)
    return rendered


def _assistant_text(i: int, turn: Turn, content: str, names: dict[str, str]) -> str:
    where = f"messages[{i}]"
    if turn.role != "assistant":
        raise ToolError(f"{where}.tool_calls must be on an assistant message", where)
    calls = turn.tool_calls or []
    rendered = [_call(call, names) for call in calls]
    text = _dumps(rendered[0] if len(rendered) == 1 else rendered)
    return f"{content}\n{text}" if content else text


def _call(call: ToolCall, names: dict[str, str]) -> dict:
    names[call.id] = call.function.name
    return {"name": call.function.name, "arguments": _arguments(call.function.arguments)}


def _arguments(text: str) -> object:
    """The arguments as JSON when they are (they should be); else the string itself."""
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def _tool_result_text(i: int, turn: Turn, content: str, names: dict[str, str]) -> str:
    where = f"messages[{i}]"
    call_id = turn.tool_call_id
    if not call_id:
        raise ToolError(f"{where}.tool_call_id must be a non-empty string", where)
    name = names.get(call_id) or turn.name
    label = f"{name} ({call_id})" if name else call_id
    return f"Result of {label}:\n{content}"
