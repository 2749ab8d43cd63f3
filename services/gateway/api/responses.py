"""OpenAI's Responses API (POST /v1/responses) for text in and text out: a chat completion with
one choice under the Responses shapes. `input` (a string or message items) and `instructions`
become the conversation; the answer is one assistant message of `output_text`, or, streamed, the
events response.created ... response.output_text.delta ... response.completed.

Nothing is stored: `previous_response_id`, background runs and tools are not served (400s).
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import Field

from splitserve.common import tracing
from splitserve.common.grpc_server import StatusError
from splitserve.engine.sampling_params import SamplingParams
from splitserve.engine.structured_output.spec import StructuredOutput
from splitserve.gateway.api.fields import SamplingKwargs, check_unsupported, validate_body
from splitserve.gateway.api.format import cached_details
from splitserve.gateway.api.respond import (
    EventStream,
    annotate_usage,
    encode_conversation,
    error_response,
    sse,
    start_generation,
    unless_disconnected,
)
from splitserve.gateway.core import GatewayCore, GenerationRequest, ServedModels, served_models
from splitserve.gateway.errors import RequestError
from splitserve.gateway.generation import Generation, collect
from splitserve.gateway.outputs import CollectedSequence, SequenceChunk, Usage
from splitserve.gateway.strict_model import StrictModel
from splitserve.gateway.structured.constraints import closed_objects

logger = logging.getLogger(__name__)


class InputText(StrictModel):
    type: Literal["input_text", "output_text", "text"] = Field(
        description="Text parts only: the model reads text."
    )
    text: str
    annotations: list[Any] | None = None  # on an earlier answer's output_text; ignored


class InputMessage(StrictModel):
    type: Literal["message"] | None = None
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[InputText]
    id: str | None = None  # on an earlier answer's message item; ignored
    status: str | None = None


class TextFormat(StrictModel):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None
    description: str | None = None


class TextOptions(StrictModel):
    format: TextFormat | None = Field(None, description="text, json_object or json_schema.")
    verbosity: Literal["medium"] | None = None


class ResponsesBody(StrictModel):
    input: str | list[InputMessage] = Field(
        description="A user text, or message items (user, system, developer, assistant)."
    )
    model: str | None = Field(None, description="The served model's id; may be left out.")
    instructions: str | None = Field(None, description="A system message put first.")
    max_output_tokens: int | None = Field(
        None,
        description="Tokens to generate (default: the rest of the context).",
        json_schema_extra={"minimum": 1},
    )
    temperature: float | None = Field(None, json_schema_extra={"minimum": 0, "maximum": 2})
    top_p: float | None = Field(None, json_schema_extra={"exclusiveMinimum": 0, "maximum": 1})
    stream: bool | None = Field(None, description="Answer with server-sent events.")
    text: TextOptions | None = Field(None, description="The output's format.")
    user: str | None = Field(None, description="Accepted; does not change the output.")
    metadata: dict[str, str] | None = Field(None, description="Echoed back in the response.")
    store: bool | None = Field(None, description="Only false: nothing is stored.")
    service_tier: Literal["auto", "default"] | None = None
    truncation: Literal["disabled"] | None = None
    parallel_tool_calls: bool | None = None
    include: list[str] | None = Field(None, description="Only empty.")
    previous_response_id: str | None = Field(None, description="Not supported: nothing stored.")
    background: bool | None = Field(None, description="Not supported: false only.")
    tools: list[Any] | None = Field(None, description="Not supported: empty only.")
    tool_choice: Any = Field(None, description="Not supported.")
    reasoning: Any = Field(None, description="Not supported: not a reasoning model.")
    top_logprobs: int | None = Field(None, description="Not supported.")
    max_tool_calls: int | None = Field(None, description="Not supported.")
    prompt: Any = Field(None, description="Not supported: stored prompts.")

    UNSUPPORTED: ClassVar[dict[str, tuple[object, ...]]] = {
        "store": (None, False),
        "include": (None, []),
        "previous_response_id": (None,),
        "background": (None, False),
        "tools": (None, []),
        "tool_choice": (None,),
        "reasoning": (None,),
        "top_logprobs": (None,),
        "max_tool_calls": (None,),
        "prompt": (None,),
    }


@dataclass(frozen=True)
class ResponsesRequest:
    body: ResponsesBody
    messages: list[dict[str, str]]
    sampling: SamplingKwargs  # all but max_tokens
    lora_name: str | None = None  # the LoRA adapter "model" named; None: the base model

    def params(self, default_max_tokens: int) -> SamplingParams:
        max_tokens = self.body.max_output_tokens
        if max_tokens is None:
            max_tokens = default_max_tokens
        try:
            return SamplingParams(max_tokens=max_tokens, **self.sampling)
        except ValueError as error:
            name = str(error).split(" ", 1)[0]
            param = "max_output_tokens" if name == "max_tokens" else name
            raise RequestError(str(error).replace("max_tokens", param, 1), param) from None


def parse_responses(raw: object, model_name: str | ServedModels) -> ResponsesRequest:
    body = validate_body(ResponsesBody, raw)
    check_unsupported(body)
    lora_name = served_models(model_name).lora_name(body.model)
    sampling: SamplingKwargs = {}
    if body.temperature is not None:
        sampling["temperature"] = body.temperature
    if body.top_p is not None:
        sampling["top_p"] = body.top_p
    output = _structured_output(body.text)
    if output is not None:  # compiled once, by the request core (a 400 naming "text")
        sampling["structured_output"] = output
    return ResponsesRequest(body, _messages(body), sampling, lora_name)


def _messages(body: ResponsesBody) -> list[dict[str, str]]:
    messages = [{"role": "system", "content": body.instructions}] if body.instructions else []
    if isinstance(body.input, str):
        return [*messages, {"role": "user", "content": body.input}]
    if not body.input:
        raise RequestError("input must not be empty", "input")
    for item in body.input:
        content = item.content
        if not isinstance(content, str):
            content = "\n".join(part.text for part in content)
        role = "system" if item.role == "developer" else item.role
        messages.append({"role": role, "content": content})
    return messages


def _structured_output(text: TextOptions | None) -> StructuredOutput | None:
    if text is None or text.format is None or text.format.type == "text":
        return None
    if text.format.type == "json_object":
        return StructuredOutput("json_object")
    if text.format.schema_ is None:
        raise RequestError("text.format.schema is required with type json_schema", "text")
    return StructuredOutput.json_schema(closed_objects(text.format.schema_))


# ---- the route ------------------------------------------------------------------------------


class ResponsesRoutes:
    def __init__(self, core: GatewayCore) -> None:
        self.core = core

    def add_to(self, app: FastAPI) -> None:
        app.add_api_route("/v1/responses", self.responses, methods=["POST"])

    async def responses(self, body: ResponsesBody, request: Request) -> Response:
        core = self.core
        with tracing.child_span("gateway.validate", None):
            parsed = parse_responses(body, core.served_models())
        with tracing.child_span("gateway.tokenize", None):
            prompt = encode_conversation(core, parsed.messages, "input")
        params = parsed.params(max(core.max_model_len - len(prompt), 1))
        request_id = f"resp_{uuid.uuid4().hex}"
        generation_request = GenerationRequest(
            request_id, [prompt], params, structured_output_param="text", lora_name=parsed.lora_name
        )
        generation = await start_generation(core, generation_request, "input", request)
        fmt = ResponsesFormat(request_id, parsed.lora_name or core.model_name, parsed)
        if not body.stream:
            sequences = await unless_disconnected(request, collect(generation), generation)
            annotate_usage(generation)
            return JSONResponse(fmt.response(sequences[0], generation.usage))
        first = await unless_disconnected(request, anext(generation), generation)
        return EventStream(_events(fmt, generation, first), generation.cancel)


async def _events(
    fmt: ResponsesFormat, generation: Generation, first: SequenceChunk
) -> AsyncIterator[str]:
    """The Responses API's events, each named in its `event:` line as OpenAI sends them."""
    try:
        async for event in fmt.events(generation, first):
            yield f"event: {event['type']}\n" + sse(event)
    except (ValueError, StatusError) as error:
        logger.warning("stream %s failed: %s", fmt.response_id, error)
        _, body = error_response(error)
        yield "event: error\n" + sse({"type": "error", **body["error"]})
    else:
        annotate_usage(generation)


# ---- formatting -----------------------------------------------------------------------------


@dataclass
class ResponsesFormat:
    """The response object and its stream of events for one request."""

    response_id: str
    model: str
    request: ResponsesRequest
    created_at: int = field(default_factory=lambda: int(time.time()))
    _sequence_number: int = 0

    @property
    def message_id(self) -> str:
        return "msg_" + self.response_id.removeprefix("resp_")

    def response(self, sequence: CollectedSequence, usage: Usage) -> dict:
        return self._object(sequence.text, sequence.finish_reason, usage)

    async def events(self, generation: Generation, first: SequenceChunk) -> AsyncIterator[dict]:
        """Every event of the stream, `first` (already received) included; raises what the
        generation raises."""
        yield self._event("response.created", response=self._object("", None, None))
        yield self._event("response.in_progress", response=self._object("", None, None))
        yield self._event("response.output_item.added", output_index=0, item=self._item(None))
        yield self._event("response.content_part.added", **self._part_at(), part=_text_part(""))
        text, finish_reason = "", None
        chunk: SequenceChunk | None = first
        while chunk is not None:
            text += chunk.text
            finish_reason = chunk.finish_reason or finish_reason
            if chunk.text:
                yield self._event(
                    "response.output_text.delta", **self._part_at(), delta=chunk.text, logprobs=[]
                )
            chunk = await anext(generation, None)
        yield self._event("response.output_text.done", **self._part_at(), text=text, logprobs=[])
        yield self._event("response.content_part.done", **self._part_at(), part=_text_part(text))
        yield self._event("response.output_item.done", output_index=0, item=self._item(text))
        done = self._object(text, finish_reason, generation.usage)
        kind = "response.completed" if done["status"] == "completed" else "response.incomplete"
        yield self._event(kind, response=done)

    def _event(self, kind: str, **fields: object) -> dict:
        event = {"type": kind, "sequence_number": self._sequence_number, **fields}
        self._sequence_number += 1
        return event

    def _part_at(self) -> dict[str, object]:
        return {"item_id": self.message_id, "output_index": 0, "content_index": 0}

    def _item(self, text: str | None) -> dict:
        """The assistant message item; None: still being written."""
        return {
            "type": "message",
            "id": self.message_id,
            "status": "in_progress" if text is None else "completed",
            "role": "assistant",
            "content": [] if text is None else [_text_part(text)],
        }

    def _object(self, text: str, finish_reason: str | None, usage: Usage | None) -> dict:
        """The response object: in progress without usage, else completed or incomplete."""
        body = self.request.body
        status = "in_progress"
        if usage is not None:
            status = "incomplete" if finish_reason == "length" else "completed"
        return {
            "id": self.response_id,
            "object": "response",
            "created_at": self.created_at,
            "status": status,
            "error": None,
            "incomplete_details": (
                {"reason": "max_output_tokens"} if status == "incomplete" else None
            ),
            "instructions": body.instructions,
            "max_output_tokens": body.max_output_tokens,
            "model": self.model,
            "output": [] if usage is None else [self._item(text)],
            "parallel_tool_calls": True,
            "temperature": body.temperature,
            "top_p": body.top_p,
            "tool_choice": "auto",
            "tools": [],
            "text": {"format": _format_json(body.text)},
            "metadata": body.metadata or {},
            "store": False,
            "usage": None if usage is None else _usage(usage),
        }


def _format_json(text: TextOptions | None) -> dict:
    if text is None or text.format is None:
        return {"type": "text"}
    return text.format.model_dump(by_alias=True, exclude_none=True)


def _text_part(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": []}


def _usage(usage: Usage) -> dict:
    return {
        "input_tokens": usage.prompt_tokens,
        "input_tokens_details": cached_details(usage),
        "output_tokens": usage.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": usage.total_tokens,
    }
