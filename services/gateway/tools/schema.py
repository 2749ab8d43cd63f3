"""The tool-calling fields of a chat completion body as pydantic models: `ToolFields` (`tools`,
`tool_choice`, `parallel_tool_calls`), which the chat body declares (/openapi.json), and the
`tool_calls` of an earlier assistant message. The one place their shapes and types are checked
(the function-name rule included); `request.py` checks only what a shape cannot say (unique
names, a named choice that is among the tools, parameter schemas the grammar engine compiles).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from splitserve.gateway.strict_model import StrictModel


class FunctionDefinition(StrictModel):
    name: str = Field(
        pattern=r"^[A-Za-z0-9_-]{1,64}$", description="1 to 64 letters, digits, '_' or '-'."
    )
    description: str | None = Field(None, description="What the function does (in the prompt).")
    parameters: dict[str, Any] | None = Field(
        None,
        description='JSON schema of the arguments, "type": "object" (absent: no arguments). '
        "It must compile in the grammar engine: calls are enforced with it.",
    )
    strict: bool | None = Field(
        None, description='With tool_choice "auto", constrain the answer to text or valid calls.'
    )


class FunctionTool(StrictModel):
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(StrictModel):
    name: str


class NamedToolChoice(StrictModel):
    type: Literal["function"]
    function: FunctionName


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class CalledFunction(StrictModel):
    name: str
    arguments: str = Field(description="The arguments as a JSON text.")


class ToolCall(StrictModel):
    id: str
    type: Literal["function"] = "function"
    function: CalledFunction


class ToolFields(StrictModel):
    """The tool fields of a chat completion body."""

    tools: list[FunctionTool] | None = Field(
        None,
        min_length=1,
        description="Functions the model may call (see docs/tool_calling.md): rendered into "
        "the system prompt; calls come back in message.tool_calls.",
    )
    tool_choice: ToolChoice | None = Field(
        None,
        description='none, auto (the default with tools), required, or {"type": "function", '
        '"function": {"name": ...}}; required and a named function are enforced with a grammar.',
    )
    parallel_tool_calls: bool | None = Field(
        None, description="Whether one answer may make several calls (default true)."
    )


# Descriptions of a message's tool fields, for the message model that declares them.
TOOL_CALLS_DESCRIPTION = "An assistant's earlier tool calls (content may then be null)."
TOOL_CALL_ID_DESCRIPTION = "The call a tool message answers (required on role tool)."
