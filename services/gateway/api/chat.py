"""POST /v1/chat/completions: the body (`ChatBody`, its messages), its parsing into engine terms
(the tool calling hooks of `tools/` on the way), the route, and the chat completion objects and
chunks it answers with (`ChatFormat`).

The body's models check types (strictly: "max_tokens": "10" is refused) and refuse unknown
fields; the rules that need more than a type are here, and sampling ranges are SamplingParams'
alone, so every error is a 400 whose message starts with the parameter's name. The body is read
as its models throughout: nothing is turned back into JSON to be read again.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

from fastapi import FastAPI, Request
from fastapi.responses import Response
from pydantic import Field, JsonValue

from splitserve.common import tracing
from splitserve.engine.sampling_params import MAX_LOGPROBS
from splitserve.gateway.api.cache_options import CacheControl
from splitserve.gateway.api.fields import (
    CommonOptions,
    SamplingFields,
    apply_cache_retention,
    apply_structured_output,
    check_unsupported,
    common_options,
    doc_field,
    sampling_kwargs,
    unsupported_field,
    validate_body,
)
from splitserve.gateway.api.format import (
    ChoicesFormat,
    choice_json,
    clamp_logprob,
    usage_json,
)
from splitserve.gateway.api.respond import encode_conversation, respond, start_choices
from splitserve.gateway.bounds import CHAT_ROLES
from splitserve.gateway.core import GatewayCore, ServedModels
from splitserve.gateway.errors import RequestError
from splitserve.gateway.outputs import CollectedSequence, SequenceChunk, Usage
from splitserve.gateway.strict_model import StrictModel
from splitserve.gateway.tools.hooks import (
    ToolOutputs,
    ToolRequest,
    prepare_chat,
    render_tool_turns,
)
from splitserve.gateway.tools.schema import (
    TOOL_CALL_ID_DESCRIPTION,
    TOOL_CALLS_DESCRIPTION,
    ToolCall,
    ToolFields,
)
from splitserve.v1 import generate_pb2

_CACHE_CONTROL_DOC = 'Keep the prompt cached for ttl ("5m" default, or "1h"), a soft window.'


class TextPart(StrictModel):
    type: Literal["text"] = Field(description="Only text parts: the model reads text only.")
    text: str
    cache_control: CacheControl | None = doc_field(_CACHE_CONTROL_DOC)


class ChatMessage(StrictModel):
    # A str checked in bounds.py (its 400 names the roles), listed as an enum in the schema
    # so clients and generators built from /openapi.json know them.
    role: str = Field(
        description="Who wrote the message.",
        json_schema_extra={"enum": list[JsonValue](sorted(CHAT_ROLES))},
    )
    content: str | list[TextPart] | None = None
    name: str | None = doc_field("A participant's name (not rendered by every template).")
    tool_calls: list[ToolCall] | None = doc_field(TOOL_CALLS_DESCRIPTION)
    tool_call_id: str | None = doc_field(TOOL_CALL_ID_DESCRIPTION)
    cache_control: CacheControl | None = doc_field(_CACHE_CONTROL_DOC)
    # What the openai client echoes back from an earlier answer's message; ignored.
    refusal: str | None = None
    annotations: Any = None
    audio: Any = None
    function_call: Any = None
    reasoning_content: str | None = None


class ChatBody(SamplingFields, ToolFields):
    messages: list[ChatMessage] = Field(
        description="The conversation so far (non-empty).", json_schema_extra={"minItems": 1}
    )
    max_completion_tokens: int | None = doc_field(
        "Tokens to generate (default: the rest of the context).", minimum=1
    )
    max_tokens: int | None = doc_field("The older name of max_completion_tokens.", minimum=1)
    logprobs: bool | None = doc_field("Return the generated tokens' logprobs.")
    top_logprobs: int | None = doc_field(
        "Top alternatives per token (needs logprobs).", minimum=0, maximum=MAX_LOGPROBS
    )
    add_generation_prompt: bool | None = doc_field(
        "vLLM's extension: end the rendered prompt with the assistant's header (default true)."
    )

    modalities: list[Literal["text"]] | None = doc_field('Only ["text"].')
    audio: Any = unsupported_field("audio output")
    prediction: Any = unsupported_field("predicted outputs")
    web_search_options: Any = unsupported_field("web search")
    reasoning_effort: str | None = unsupported_field("reasoning effort (not a reasoning model)")
    verbosity: str | None = unsupported_field("verbosity")
    functions: Any = unsupported_field("the deprecated functions; use tools")
    function_call: Any = unsupported_field("the deprecated function_call; use tool_choice")
    echo: bool | None = unsupported_field("vLLM's chat echo (false only)")
    continue_final_message: bool | None = unsupported_field("false only")
    chat_template: str | None = unsupported_field("the model's own template is used")
    chat_template_kwargs: dict[str, Any] | None = unsupported_field("template arguments")

    UNSUPPORTED: ClassVar[dict[str, tuple[object, ...]]] = {
        **SamplingFields.UNSUPPORTED,
        "audio": (None,),
        "prediction": (None,),
        "web_search_options": (None,),
        "reasoning_effort": (None,),
        "verbosity": (None,),
        "functions": (None,),
        "function_call": (None,),
        "echo": (None, False),
        "continue_final_message": (None, False),
        "chat_template": (None,),
        "chat_template_kwargs": (None, {}),
    }


# ---- parsing --------------------------------------------------------------------------------


@dataclass(frozen=True)
class ChatRequest:
    messages: list[dict[str, str]]
    options: CommonOptions
    logprobs: bool = False
    add_generation_prompt: bool = True
    tools: ToolRequest | None = None  # tools, tool_choice, parallel_tool_calls (tools/)


def parse_chat(raw: object, model_name: str | ServedModels) -> ChatRequest:
    body = validate_body(ChatBody, raw)
    check_unsupported(body)
    sampling = sampling_kwargs(body)
    structured_output_param = apply_structured_output(sampling, body)
    logprobs = bool(body.logprobs)
    top_logprobs = body.top_logprobs
    if top_logprobs is not None and not logprobs:
        raise RequestError("top_logprobs requires logprobs to be true", "top_logprobs")
    if top_logprobs is not None and not 0 <= top_logprobs <= MAX_LOGPROBS:
        raise RequestError(
            f"top_logprobs must be in [0, {MAX_LOGPROBS}], got {top_logprobs}", "top_logprobs"
        )
    if logprobs:
        sampling["logprobs"] = top_logprobs or 0
    max_tokens = body.max_completion_tokens
    if max_tokens is None:
        max_tokens = body.max_tokens
    # Tool calling hook (tools/hooks.py): the tools into the system prompt, and the grammar
    # that enforces a call into `sampling`.
    messages, tools = prepare_chat(
        lambda name: getattr(body, name, None), chat_messages(body.messages), sampling
    )
    if tools is not None and tools.is_enforced:
        structured_output_param = "tools"
    apply_cache_retention(sampling, body, _cache_controls(body.messages))
    options = common_options(body, model_name, sampling, max_tokens, structured_output_param)
    return ChatRequest(
        messages,
        options,
        logprobs,
        add_generation_prompt=body.add_generation_prompt is not False,
        tools=tools,
    )


def chat_messages(messages: list[ChatMessage]) -> list[dict[str, str]]:
    """Each message's role and text, tool calls and results written as text (tools/)."""
    if not messages:
        raise RequestError("messages must not be empty", "messages")
    return render_tool_turns(messages, [_message(message) for message in messages])


def _message(message: ChatMessage) -> dict[str, str]:
    content = message.content
    if isinstance(content, list):  # content parts: only text can reach a text-only model
        content = "\n".join(part.text for part in content)
    return {"role": message.role, "content": content or ""}


def _cache_controls(messages: list[ChatMessage]) -> list[CacheControl | None]:
    """The `cache_control` markers of the messages and of their content parts."""
    markers = [message.cache_control for message in messages]
    for message in messages:
        if isinstance(message.content, list):
            markers += [part.cache_control for part in message.content]
    return markers


# ---- the route ------------------------------------------------------------------------------


class ChatRoutes:
    def __init__(self, core: GatewayCore) -> None:
        self.core = core

    def add_to(self, app: FastAPI) -> None:
        app.add_api_route("/v1/chat/completions", self.chat_completions, methods=["POST"])

    async def chat_completions(self, body: ChatBody, request: Request) -> Response:
        core = self.core
        with tracing.child_span("gateway.validate", None):
            parsed = parse_chat(body, core.served_models())
        with tracing.child_span("gateway.tokenize", None):
            prompt = encode_conversation(
                core, parsed.messages, "messages", parsed.add_generation_prompt
            )
        options = parsed.options
        # Unset max_tokens means "until the context is full", as OpenAI and vLLM do for chat.
        default_max_tokens = max(core.max_model_len - len(prompt), 1)
        started = await start_choices(
            core, options, [prompt], default_max_tokens, "chatcmpl-", "messages", request
        )
        generation = started.generation
        fmt = ChatFormat(
            started.envelope,
            options,
            logprobs=parsed.logprobs,
            num_prompt_tokens=generation.usage.prompt_tokens,
            tools=ToolOutputs.for_request(parsed.tools),  # tool calling hook (tools/hooks.py)
        )
        return await respond(request, generation, fmt, options)


# ---- formatting -----------------------------------------------------------------------------


@dataclass
class ChatFormat(ChoicesFormat):
    """Chat completion objects and chunks for one request."""

    chunk_object = "chat.completion.chunk"
    tools: ToolOutputs | None = None  # answers read for tool calls (tools/); None: text
    _started: set[int] = field(default_factory=set)  # choices whose role was sent

    def chunk(self, chunk: SequenceChunk) -> dict:
        delta: dict[str, object] = {"content": chunk.text}
        finish_reason = chunk.finish_reason
        if self.tools is not None:  # tool calling hook: content and tool_calls deltas
            delta, finish_reason = self.tools.delta(chunk.index, chunk.text, finish_reason)
        if chunk.index not in self._started:
            self._started.add(chunk.index)
            delta = {"role": "assistant", **delta}
        choice = choice_json(chunk, {"delta": delta}, self._logprobs(chunk.logprobs), self.options)
        choice["finish_reason"] = finish_reason
        return self._wrap_chunk(choice, chunk)

    def response(self, sequences: list[CollectedSequence], usage: Usage) -> dict:
        choices = [self._message_choice(sequence) for sequence in sequences]
        return self.envelope.wrap("chat.completion", choices, usage=usage_json(usage))

    def _message_choice(self, sequence: CollectedSequence) -> dict:
        message: dict[str, object] = {"role": "assistant", "content": sequence.text}
        finish_reason = sequence.finish_reason
        if self.tools is not None:  # tool calling hook: content and tool_calls
            message, finish_reason = self.tools.message(sequence.text, finish_reason)
        logprobs = self._logprobs(sequence.logprobs)
        choice = choice_json(sequence, {"message": message}, logprobs, self.options)
        choice["finish_reason"] = finish_reason
        return choice

    def _logprobs(self, entries: list[generate_pb2.TokenLogprob]) -> dict | None:
        if not self.logprobs:
            return None
        return {"content": [_chat_logprob(entry) for entry in entries]}


def _chat_logprob(entry: generate_pb2.TokenLogprob) -> dict:
    return {
        "token": entry.token,
        "logprob": clamp_logprob(entry.logprob),
        "bytes": list(entry.token.encode("utf-8")),
        "top_logprobs": [
            {
                "token": alt.token,
                "logprob": clamp_logprob(alt.logprob),
                "bytes": list(alt.token.encode("utf-8")),
            }
            for alt in entry.top
        ],
    }
