"""Anthropic's Messages API beside OpenAI's: POST /v1/messages and /v1/messages/count_tokens.

A Messages request is parsed into what a chat completion would be (the same request core, chat
template, tool calling hooks of `tools/` and grammars), so routing, migration and P/D work as
for /v1/chat/completions:
- `system` (a string or text blocks) is the system message. With the gateway's
  `--strip-system-line-prefix P`, a first line starting with P is dropped (Claude Code's
  per-request `x-anthropic-billing-header: ...` line would otherwise change the prompt's first
  block and defeat prefix caching).
- Turns are user or assistant. An assistant's `tool_use` blocks become its tool calls, a user's
  `tool_result` blocks become tool turns (tools/prompt.py renders both as text), in order.
- `tools` (`input_schema`) and `tool_choice` become OpenAI's: auto -> auto, any -> required,
  tool -> the named function, none -> none; `disable_parallel_tool_use` -> one call at most.
- `output_config.format` (a JSON schema) constrains the answer as `response_format` does.
- `cache_control` on the request, system blocks, content blocks and tools sets the retention
  window (api/cache_options.py); `metadata.user_id` routes a user's requests to the same decode
  pod (as OpenAI's `prompt_cache_key`), for its prefix cache.
The prompt's pieces: api/messages_prompt.py; the answer's objects and events, and this
endpoint's error bodies: api/messages_format.py.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from splitserve.common import tracing
from splitserve.engine.sampling_params import SamplingParams
from splitserve.engine.structured_output.spec import StructuredOutput
from splitserve.gateway.api.cache_options import cache_retention_s
from splitserve.gateway.api.fields import SamplingKwargs, check_unsupported, validate_body
from splitserve.gateway.api.messages_format import MESSAGES_PATHS, MessageFormat, message_events
from splitserve.gateway.api.messages_prompt import (
    anthropic_words,
    cache_controls,
    chat_turns,
    openai_tool_fields,
    system_messages,
)
from splitserve.gateway.api.messages_schema import (
    ConversationFields,
    CountTokensBody,
    MessagesBody,
)
from splitserve.gateway.api.respond import (
    EventStream,
    annotate_usage,
    encode_conversation,
    start_generation,
    unless_disconnected,
)
from splitserve.gateway.core import (
    GatewayCore,
    GenerationRequest,
    ServedModels,
    served_models,
)
from splitserve.gateway.errors import RequestError, param_of
from splitserve.gateway.generation import collect
from splitserve.gateway.structured.constraints import closed_objects
from splitserve.gateway.tools.hooks import ToolError, ToolRequest, prepare_chat

MESSAGES_PATH, COUNT_TOKENS_PATH = MESSAGES_PATHS


@dataclass(frozen=True)
class MessagesSettings:
    """The operator's options for this endpoint (gateway flags)."""

    # A system prompt whose first line starts with one of these loses that line.
    strip_system_line_prefixes: tuple[str, ...] = ()


@dataclass(frozen=True)
class Conversation:
    """A Messages prompt in chat terms."""

    messages: list[dict[str, str]]  # role and text, tools section and tool turns rendered
    tools: ToolRequest | None
    sampling: SamplingKwargs  # the tool grammar and the cache window, when asked for
    has_cache_control: bool
    lora_name: str | None = None  # the LoRA adapter "model" named; None: the base model


@dataclass(frozen=True)
class MessagesRequest:
    conversation: Conversation
    params: SamplingParams
    stream: bool
    stop_sequences: tuple[str, ...]
    user_id: str | None


# ---- parsing --------------------------------------------------------------------------------


def parse_conversation(
    body: ConversationFields, model_name: str | ServedModels, settings: MessagesSettings
) -> Conversation:
    check_unsupported(body)
    lora_name = served_models(model_name).lora_name(body.model)
    messages = system_messages(body, settings.strip_system_line_prefixes)
    messages += chat_turns(body.messages)
    sampling: SamplingKwargs = {}
    try:
        messages, tools = prepare_chat(openai_tool_fields(body), messages, sampling)
    except ToolError as error:
        raise RequestError(anthropic_words(str(error)), error.param) from None
    output = _output_format(body)
    if output is not None:
        if "structured_output" in sampling:
            raise RequestError(
                "output_config.format cannot be combined with tool_choice any or tool",
                "output_config",
            )
        sampling["structured_output"] = output
    markers = cache_controls(body)
    window = cache_retention_s(None, markers)
    if window is not None:
        sampling["cache_retention_s"] = window
    return Conversation(messages, tools, sampling, any(markers), lora_name)


def _output_format(body: ConversationFields) -> StructuredOutput | None:
    config = body.output_config
    if config is None or config.format is None:
        return None
    return StructuredOutput.json_schema(closed_objects(config.format.schema_))


def parse_messages(
    raw: object, model_name: str | ServedModels, settings: MessagesSettings
) -> MessagesRequest:
    body = validate_body(MessagesBody, raw)
    conversation = parse_conversation(body, model_name, settings)
    if body.temperature is not None and not 0 <= body.temperature <= 1:
        raise RequestError(f"temperature must be in [0, 1], got {body.temperature}", "temperature")
    sampling = dict(conversation.sampling)
    for name in ("temperature", "top_p", "top_k"):
        if getattr(body, name) is not None:
            sampling[name] = getattr(body, name)
    stop_sequences = tuple(body.stop_sequences or ())
    if stop_sequences:
        sampling["stop"] = stop_sequences
    try:
        params = SamplingParams(max_tokens=body.max_tokens, **sampling)
    except ValueError as error:
        param = "stop_sequences" if param_of(error) == "stop" else param_of(error)
        raise RequestError(str(error), param) from None
    user_id = body.metadata.user_id if body.metadata is not None else None
    return MessagesRequest(conversation, params, bool(body.stream), stop_sequences, user_id)


def _constraint_param(conversation: Conversation) -> str:
    """The field a grammar that does not compile came from."""
    tools = conversation.tools
    return "tools" if tools is not None and tools.is_enforced else "output_config"


# ---- the routes -----------------------------------------------------------------------------


class MessagesRoutes:
    def __init__(self, core: GatewayCore, settings: MessagesSettings | None = None) -> None:
        self.core = core
        self.settings = settings or MessagesSettings()

    def add_to(self, app: FastAPI) -> None:
        app.add_api_route(MESSAGES_PATH, self.messages, methods=["POST"])
        app.add_api_route(COUNT_TOKENS_PATH, self.count_tokens, methods=["POST"])

    async def messages(self, body: MessagesBody, request: Request) -> Response:
        core = self.core
        with tracing.child_span("gateway.validate", None):
            parsed = parse_messages(body, core.served_models(), self.settings)
        with tracing.child_span("gateway.tokenize", None):
            prompt = encode_conversation(core, parsed.conversation.messages, "messages")
        request_id = f"msg_{uuid.uuid4().hex}"
        tools = parsed.conversation.tools
        generation_request = GenerationRequest(
            request_id,
            [prompt],
            parsed.params,
            prompt_cache_key=parsed.user_id,
            structured_output_param=_constraint_param(parsed.conversation),
            lora_name=parsed.conversation.lora_name,
        )
        generation = await start_generation(core, generation_request, "messages", request)
        fmt = MessageFormat(
            request_id,
            parsed.conversation.lora_name or core.model_name,
            tools,
            parsed.stop_sequences,
            parsed.conversation.has_cache_control,
        )
        if not parsed.stream:
            sequences = await unless_disconnected(request, collect(generation), generation)
            annotate_usage(generation)
            return JSONResponse(fmt.message(sequences[0], generation.usage))
        first = await unless_disconnected(request, anext(generation), generation)
        return EventStream(message_events(fmt, generation, first), generation.cancel)

    async def count_tokens(self, body: CountTokensBody) -> dict:
        """The prompt's tokens, as /v1/messages would send it to the pods."""
        conversation = parse_conversation(body, self.core.served_models(), self.settings)
        prompt = encode_conversation(self.core, conversation.messages, "messages")
        return {"input_tokens": len(prompt)}
