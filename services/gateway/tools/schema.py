"""The tool-calling fields of a chat completion body as pydantic models, for the request
schemas (/openapi.json) to declare: `tools`, `tool_choice`, and the `tool_calls` of an earlier
assistant message. They check shapes and types only; `request.py` checks the rest (unique
names, a named choice that is among the tools, parameter schemas the grammar engine compiles)
and `tools.prepare_chat` reads these models as it reads plain JSON.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")


class FunctionDefinition(_Strict):
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


class FunctionTool(_Strict):
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: FunctionName


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class CalledFunction(_Strict):
    name: str
    arguments: str = Field(description="The arguments as a JSON text.")


class ToolCall(_Strict):
    id: str
    type: Literal["function"] = "function"
    function: CalledFunction


# Descriptions of the body's fields, for the request models that declare them.
TOOLS_DESCRIPTION = (
    "Functions the model may call (see docs/tool_calling.md): rendered into the system "
    "prompt; calls come back in message.tool_calls."
)
TOOL_CHOICE_DESCRIPTION = (
    'none, auto (the default with tools), required, or {"type": "function", "function": '
    '{"name": ...}}; required and a named function are enforced with a grammar.'
)
PARALLEL_DESCRIPTION = "Whether one answer may make several calls (default true)."
TOOL_CALLS_DESCRIPTION = "An assistant's earlier tool calls (content may then be null)."
TOOL_CALL_ID_DESCRIPTION = "The call a tool message answers (required on role tool)."
