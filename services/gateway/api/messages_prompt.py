"""A Messages request's prompt in chat terms, for api/messages.py: the system message (with
the operator's volatile first line dropped), the turns with their tool_use and tool_result
blocks as the chat tool hooks render tool calls and results (tools/prompt.py), the tools and
tool choice as OpenAI spells them, and the `cache_control` markers.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from splitserve.gateway.api.cache_options import CacheControl
from splitserve.gateway.api.messages_schema import (
    AnthropicMessage,
    ConversationFields,
    TextBlock,
    ToolChoiceAny,
    ToolChoiceAuto,
    ToolChoiceNone,
    ToolResultBlock,
    ToolUseBlock,
)
from splitserve.gateway.errors import RequestError
from splitserve.gateway.tools.hooks import render_tool_turns
from splitserve.gateway.tools.schema import CalledFunction, ToolCall


def system_messages(
    body: ConversationFields, strip_line_prefixes: Sequence[str]
) -> list[dict[str, str]]:
    """The system message (none for an empty system prompt), its first line dropped when it
    starts with one of `strip_line_prefixes`."""
    system = body.system
    if system is None:
        return []
    text = system if isinstance(system, str) else "\n".join(block.text for block in system)
    first_line, _, rest = text.partition("\n")
    if any(first_line.startswith(prefix) for prefix in strip_line_prefixes):
        text = rest
    return [{"role": "system", "content": text}] if text else []


@dataclass(frozen=True)
class _Turn:
    """What tools/prompt.render_tool_turns reads of a chat message."""

    role: str
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None


def chat_turns(messages: list[AnthropicMessage]) -> list[dict[str, str]]:
    """The conversation as chat messages: tool_use blocks as the assistant's tool calls, each
    tool_result block as a tool turn, written as text by the tool calling hooks."""
    if not messages:
        raise RequestError("messages must not be empty", "messages")
    turns: list[_Turn] = []
    texts: list[str] = []
    for i, message in enumerate(messages):
        content = message.content
        if isinstance(content, str):
            pairs = [(_Turn(message.role), content)]
        elif message.role == "assistant":
            pairs = [_assistant_turn(i, content)]
        else:
            pairs = _user_turns(i, content)
        turns += [turn for turn, _ in pairs]
        texts += [text for _, text in pairs]
    if messages[-1].role == "assistant":
        raise RequestError(
            f"messages[{len(messages) - 1}]: a final assistant turn (prefill) is not supported; "
            "end with a user turn",
            f"messages[{len(messages) - 1}]",
        )
    chat = [{"role": turn.role, "content": text} for turn, text in zip(turns, texts, strict=True)]
    return render_tool_turns(turns, chat)


def _assistant_turn(i: int, blocks: Sequence[object]) -> tuple[_Turn, str]:
    texts, calls = [], []
    for j, block in enumerate(blocks):
        if isinstance(block, TextBlock):
            texts.append(block.text)
        elif isinstance(block, ToolUseBlock):
            arguments = json.dumps(block.input, ensure_ascii=False)
            calls.append(
                ToolCall(id=block.id, function=CalledFunction(name=block.name, arguments=arguments))
            )
        else:
            _refuse_block(i, j, block, "assistant")
    return _Turn("assistant", tool_calls=calls or None), "\n".join(texts)


def _user_turns(i: int, blocks: Sequence[object]) -> list[tuple[_Turn, str]]:
    pairs: list[tuple[_Turn, str]] = []
    texts: list[str] = []
    for j, block in enumerate(blocks):
        if isinstance(block, TextBlock):
            texts.append(block.text)
        elif isinstance(block, ToolResultBlock):
            if not block.tool_use_id:
                where = f"messages[{i}].content[{j}].tool_use_id"
                raise RequestError(f"{where} must be a non-empty string", f"messages[{i}]")
            if texts:  # text before a result stays before it
                pairs.append((_Turn("user"), "\n".join(texts)))
                texts = []
            pairs.append((_Turn("tool", tool_call_id=block.tool_use_id), _result_text(block)))
        else:
            _refuse_block(i, j, block, "user")
    if texts or not pairs:
        pairs.append((_Turn("user"), "\n".join(texts)))
    return pairs


def _result_text(block: ToolResultBlock) -> str:
    content = block.content
    text = content if isinstance(content, str) else "\n".join(b.text for b in content or [])
    return f"Error: {text}" if block.is_error else text


def _refuse_block(i: int, j: int, block: object, role: str) -> None:
    kind = getattr(block, "type", "?")
    where = f"messages[{i}].content[{j}]"
    if kind in ("tool_use", "tool_result"):
        message = f"{where}: {kind} blocks cannot be in a {role} turn"
        raise RequestError(message, f"messages[{i}]")
    raise RequestError(
        f"{where}: {kind} blocks are not supported by this server (its model reads text only)",
        f"messages[{i}]",
        "unsupported_value",
    )


def openai_tool_fields(body: ConversationFields) -> Callable[[str], object]:
    """The body's tools and tool_choice as the tool calling hooks read them (OpenAI's)."""
    tools = None
    if body.tools is not None:
        tools = [
            {
                "type": "function",
                "function": {
                    "name": tool.name,
                    "description": tool.description,
                    "parameters": tool.input_schema,
                },
            }
            for tool in body.tools
        ]
    choice, parallel = body.tool_choice, None
    openai_choice: object = None
    if isinstance(choice, ToolChoiceNone):
        openai_choice = "none"
    elif choice is not None:
        parallel = False if choice.disable_parallel_tool_use else None
        if isinstance(choice, ToolChoiceAuto):
            openai_choice = "auto"
        elif isinstance(choice, ToolChoiceAny):
            openai_choice = "required"
        else:
            openai_choice = {"type": "function", "function": {"name": choice.name}}
    fields = {"tools": tools, "tool_choice": openai_choice, "parallel_tool_calls": parallel}
    return fields.get


def anthropic_words(message: str) -> str:
    """A tool calling hook's message in this API's terms."""
    return message.replace(".function.parameters", ".input_schema").replace(
        "names the function", "names the tool"
    )


def cache_controls(body: ConversationFields) -> list[CacheControl | None]:
    """The `cache_control` markers of the request, its system and content blocks, its tools."""
    markers: list[CacheControl | None] = [body.cache_control]
    if isinstance(body.system, list):
        markers += [block.cache_control for block in body.system]
    for message in body.messages:
        if not isinstance(message.content, str):
            markers += [getattr(block, "cache_control", None) for block in message.content]
    markers += [tool.cache_control for tool in body.tools or []]
    return markers
