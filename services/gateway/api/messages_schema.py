"""The bodies of Anthropic's Messages API (POST /v1/messages and /v1/messages/count_tokens) as
strict pydantic models, served in /openapi.json: content blocks, tools, tool choices, and the
fields this server does not honour (`UNSUPPORTED`: a 400 naming the field unless neutral).

The same rules as the OpenAI bodies (api/fields.py): strict types, unknown fields refused, the
rules that need more than a type checked in api/messages.py.
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

from pydantic import ConfigDict, Field

from splitserve.gateway.api.cache_options import CacheControl
from splitserve.gateway.api.fields import bookkeeping_field, doc_field, unsupported_field
from splitserve.gateway.strict_model import StrictModel

_CACHE_CONTROL_DOC = (
    'Keep the prompt cached for ttl ("5m" default, or "1h"): a soft window on the decode pod.'
)
# Block kinds of Anthropic's API this text-only server cannot read; refused by name.
UNREADABLE_BLOCKS = (
    "image",
    "document",
    "search_result",
    "thinking",
    "redacted_thinking",
    "server_tool_use",
    "web_search_tool_result",
    "container_upload",
)
# What each field may be, for errors at the field itself (errors.from_validation).
EXPECTED_SHAPES = {
    "system": "a string or a list of text blocks",
    "content": "a string or a list of content blocks (text, tool_use, tool_result)",
    "messages[].content": "a string or a list of content blocks (text, tool_use, tool_result)",
    "tools": "a non-empty array of tools {name, description, input_schema}",
    "tools[].name": "1 to 64 letters, digits, '_' or '-'",
    "tool_choice": 'an object with "type" auto, any, tool (with "name") or none',
    "stop_sequences": "a list of strings",
}


class TextBlock(StrictModel):
    type: Literal["text"]
    text: str
    cache_control: CacheControl | None = doc_field(_CACHE_CONTROL_DOC)
    citations: list[Any] | None = doc_field("Echoed from an earlier answer; ignored.")


class ToolUseBlock(StrictModel):
    """An earlier assistant turn's tool call."""

    type: Literal["tool_use"]
    id: str = Field(description="The call's id, which a later tool_result names.")
    name: str
    input: dict[str, Any] = Field(description="The call's arguments.")
    cache_control: CacheControl | None = doc_field(_CACHE_CONTROL_DOC)


class ToolResultBlock(StrictModel):
    """A tool's result, in the user turn after the call."""

    type: Literal["tool_result"]
    tool_use_id: str = Field(json_schema_extra={"minLength": 1})
    content: str | list[TextBlock] | None = None
    is_error: bool | None = doc_field("The tool failed: the result says how.")
    cache_control: CacheControl | None = doc_field(_CACHE_CONTROL_DOC)


class UnreadableBlock(StrictModel):
    """A block kind the model cannot read (images, documents, thinking, server tools):
    declared so that its 400 names it."""

    model_config = ConfigDict(extra="allow")
    type: Literal[UNREADABLE_BLOCKS] = Field(  # type: ignore[valid-type]
        description="Not supported: this server's model reads text only."
    )


ContentBlock = Annotated[
    TextBlock | ToolUseBlock | ToolResultBlock | UnreadableBlock, Field(discriminator="type")
]


class AnthropicMessage(StrictModel):
    role: Literal["user", "assistant"]
    content: str | list[ContentBlock]


class AnthropicTool(StrictModel):
    name: str = Field(
        pattern=r"^[A-Za-z0-9_-]{1,64}$", description="1 to 64 letters, digits, '_' or '-'."
    )
    description: str | None = doc_field("What the tool does (in the prompt).")
    input_schema: dict[str, Any] = Field(
        description='JSON schema of the input, "type": "object"; it must compile in the grammar '
        'engine (tool_choice "any" and "tool" are enforced with it).'
    )
    type: Literal["custom"] | None = doc_field('Only "custom" (client tools).')
    cache_control: CacheControl | None = doc_field(_CACHE_CONTROL_DOC)


class _ChoiceBase(StrictModel):
    disable_parallel_tool_use: bool | None = doc_field("At most one tool_use in the answer.")


class ToolChoiceAuto(_ChoiceBase):
    type: Literal["auto"]


class ToolChoiceAny(_ChoiceBase):
    type: Literal["any"]


class ToolChoiceTool(_ChoiceBase):
    type: Literal["tool"]
    name: str


class ToolChoiceNone(StrictModel):
    type: Literal["none"]


ToolChoice = Annotated[
    ToolChoiceAuto | ToolChoiceAny | ToolChoiceTool | ToolChoiceNone, Field(discriminator="type")
]


class Metadata(StrictModel):
    user_id: str | None = doc_field(
        "An end-user (or session) id: requests sharing it are routed to the same decode pod, "
        "for its prefix cache; does not change the output."
    )


class OutputFormat(StrictModel):
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema", description="The answer's JSON schema.")


class OutputConfig(StrictModel):
    format: OutputFormat | None = doc_field(
        "Structured output: the answer matches this JSON schema (enforced by a grammar)."
    )
    effort: Literal["low", "medium", "high", "xhigh", "max"] | None = bookkeeping_field(
        "How much effort to spend (not a reasoning model)."
    )


class ConversationFields(StrictModel):
    """What /v1/messages and /v1/messages/count_tokens share: the prompt."""

    model: str | None = doc_field("The served model's id (GET /v1/models); may be left out.")
    messages: list[AnthropicMessage] = Field(
        description="The conversation: user and assistant turns (non-empty).",
        json_schema_extra={"minItems": 1},
    )
    system: str | list[TextBlock] | None = doc_field("The system prompt.")
    tools: list[AnthropicTool] | None = Field(
        None, min_length=1, description="Tools the model may call (rendered into the prompt)."
    )
    tool_choice: ToolChoice | None = doc_field(
        "auto (default), any or tool (a call enforced by a grammar), none."
    )
    cache_control: CacheControl | None = doc_field(
        "A cache_control marker for the whole request: " + _CACHE_CONTROL_DOC
    )
    output_config: OutputConfig | None = None
    thinking: Any = unsupported_field('extended thinking ({"type": "disabled"} only)')
    mcp_servers: Any = unsupported_field("MCP servers")
    context_management: Any = unsupported_field("context management")
    container: Any = unsupported_field("code execution containers")

    UNSUPPORTED: ClassVar[dict[str, tuple[object, ...]]] = {
        "thinking": (None, {"type": "disabled"}),
        "mcp_servers": (None, []),
        "context_management": (None,),
        "container": (None,),
    }


class MessagesBody(ConversationFields):
    max_tokens: int = Field(
        description="Tokens to generate at most (required).", json_schema_extra={"minimum": 1}
    )
    stop_sequences: list[str] | None = doc_field("Strings that end the answer (not included).")
    stream: bool | None = doc_field("Answer with Anthropic's server-sent events.")
    temperature: float | None = doc_field("0 is greedy; default 1.", minimum=0, maximum=1)
    top_p: float | None = doc_field("Nucleus sampling mass.", exclusiveMinimum=0, maximum=1)
    top_k: int | None = doc_field("Keep the k likeliest tokens; 0 is off.", minimum=0)
    metadata: Metadata | None = None
    service_tier: Literal["auto", "standard_only"] | None = bookkeeping_field("The tier.")
    speed: Literal["standard", "fast"] | None = bookkeeping_field("The speed mode.")
    inference_geo: str | None = bookkeeping_field("The region to serve in.")
    user_profile_id: str | None = bookkeeping_field("A user profile to attribute it to.")
    workspace_id: str | None = bookkeeping_field("A workspace.")
    diagnostics: Any = unsupported_field("request diagnostics")

    UNSUPPORTED: ClassVar[dict[str, tuple[object, ...]]] = {
        **ConversationFields.UNSUPPORTED,
        "diagnostics": (None,),
    }


class CountTokensBody(ConversationFields):
    """The prompt of a /v1/messages request, counted as that request would count it."""
