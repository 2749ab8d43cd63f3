"""What every HTTP generation endpoint does around the request core: encode a conversation (one
the chat template rejects a 400), start the generation under a fresh id (a bad prompt a 400
naming the endpoint's prompt field), answer whole or as server-sent events, cancel
the pods' calls when the client goes away, and turn an error into its status and OpenAI body
(`error_response`: the one mapping, for the exception handlers and for a stream's error event).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Protocol, TypeVar

import grpc
from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from splitserve.common import tracing
from splitserve.common.grpc_server import StatusError
from splitserve.engine.prompts import PromptError
from splitserve.engine.sampling_params import SamplingParams
from splitserve.gateway.admission.slo import requested_slo
from splitserve.gateway.api.fields import CommonOptions
from splitserve.gateway.api.format import Envelope
from splitserve.gateway.core import GatewayCore, GenerationRequest
from splitserve.gateway.errors import RequestError, error_body, param_of
from splitserve.gateway.generation import Generation, collect
from splitserve.gateway.outputs import CollectedSequence, SequenceChunk, Usage

logger = logging.getLogger(__name__)

# The client's region, for routing it to pods nearby (gRPC: metadata of the same name).
REGION_HEADER = "x-splitserve-region"
_HTTP_STATUS = {
    grpc.StatusCode.UNAVAILABLE: 503,
    grpc.StatusCode.DEADLINE_EXCEEDED: 504,
    grpc.StatusCode.RESOURCE_EXHAUSTED: 429,
}
T = TypeVar("T")


class ClientDisconnected(Exception):
    """The client went away before the response started; nobody reads what we answer."""


class ChoicesFormat(Protocol):
    """A chat or completion request's objects and chunks (api/chat.py, api/completions.py)."""

    @property
    def request_id(self) -> str: ...

    def chunk(self, chunk: SequenceChunk) -> dict: ...

    def usage_chunk(self, usage: Usage) -> dict: ...

    def response(self, sequences: list[CollectedSequence], usage: Usage) -> dict: ...


def error_response(error: Exception) -> tuple[int, dict]:
    """An error as its HTTP status and OpenAI error body."""
    if isinstance(error, ValueError):
        code = error.code if isinstance(error, RequestError) else "invalid_value"
        status = 404 if code == "model_not_found" else 400  # as OpenAI answers it
        return status, error_body(str(error), "invalid_request_error", param_of(error), code)
    if isinstance(error, StatusError):
        status = _HTTP_STATUS.get(error.code, 502)
        return status, error_body(str(error), "server_error", None, error.code.name.lower())
    raise TypeError(f"no HTTP mapping for {type(error).__name__}")


def encode_conversation(
    core: GatewayCore,
    messages: list[dict[str, str]],
    messages_param: str,
    add_generation_prompt: bool = True,
) -> list[int]:
    """`core.encode_chat`, a conversation the chat template rejects reported as a 400 naming
    the endpoint's `messages_param`."""
    try:
        return core.encode_chat(messages, add_generation_prompt)
    except ValueError as error:
        raise RequestError(str(error), messages_param) from None


async def start_generation(
    core: GatewayCore, request: GenerationRequest, prompt_param: str, http: Request
) -> Generation:
    """`core.start`, a bad prompt reported as a 400 naming the endpoint's `prompt_param`."""
    try:
        slo = requested_slo(http.headers)
        starting = core.start(request, http.headers.get(REGION_HEADER, ""), slo)
        if core.admission is None:
            return await starting
        # It may wait in admission's queue: a client that goes away leaves it at once.
        return await unless_disconnected(http, starting)
    except PromptError as error:
        raise RequestError(str(error), prompt_param, error.code) from None


@dataclass(frozen=True)
class StartedChoices:
    """A chat or completion request once its generation has started."""

    generation: Generation
    params: SamplingParams
    envelope: Envelope  # its fresh id, the model, the time: what each object repeats


async def start_choices(
    core: GatewayCore,
    options: CommonOptions,
    prompts: list[list[int]],
    default_max_tokens: int,
    id_prefix: str,
    prompt_param: str,
    http: Request,
) -> StartedChoices:
    """Starts `prompts` with `options`' params (`default_max_tokens` where the body set none)
    under a fresh id starting with `id_prefix`; a bad prompt is a 400 naming `prompt_param`."""
    params = options.params(default_max_tokens)
    request_id = f"{id_prefix}{uuid.uuid4().hex}"
    generation_request = options.generation_request(request_id, prompts, params)
    generation = await start_generation(core, generation_request, prompt_param, http)
    envelope = Envelope(request_id, options.model, int(time.time()))
    return StartedChoices(generation, params, envelope)


async def respond(
    http: Request, generation: Generation, fmt: ChoicesFormat, options: CommonOptions
) -> Response:
    """A chat or completion answer: one JSON object, or a stream of chunks."""
    if not options.stream:
        sequences = await unless_disconnected(http, collect(generation), generation)
        annotate_usage(generation)
        return JSONResponse(fmt.response(sequences, generation.usage))
    # Wait for the first chunk before answering 200: a request the pod rejects still gets
    # its 400, and the headers go out together with the first token.
    first = await unless_disconnected(http, anext(generation), generation)
    events = _choice_events(generation, first, fmt, options.include_usage)
    return EventStream(events, on_close=generation.cancel)


async def unless_disconnected(
    http: Request, awaitable: Awaitable[T], generation: Generation | None = None
) -> T:
    """Awaits `awaitable`, given up (ClientDisconnected) if the client goes away first; the
    generation, if any, is then cancelled too (so the pods abort and free their blocks)."""
    work = asyncio.ensure_future(awaitable)
    watcher = asyncio.ensure_future(_wait_for_disconnect(http))
    try:
        await asyncio.wait([work, watcher], return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not work.done():
            if generation is not None:
                generation.cancel()
            work.cancel()
    if not work.done() or work.cancelled():
        raise ClientDisconnected()
    return work.result()


async def _wait_for_disconnect(http: Request) -> None:
    while (await http.receive())["type"] != "http.disconnect":
        pass


async def _choice_events(
    generation: Generation, first: SequenceChunk, fmt: ChoicesFormat, include_usage: bool
) -> AsyncIterator[str]:
    yield sse(fmt.chunk(first))
    try:
        async for chunk in generation:
            yield sse(fmt.chunk(chunk))
    except (ValueError, StatusError) as error:
        # The 200 went out with the first chunk: the error can only travel as an event.
        logger.warning("stream %s failed: %s", fmt.request_id, error)
        _, body = error_response(error)
        yield sse(body)
    else:
        annotate_usage(generation)
        if include_usage:
            yield sse(fmt.usage_chunk(generation.usage))
    yield "data: [DONE]\n\n"


def annotate_usage(generation: Generation) -> None:
    """The request span (current while a handler or its stream runs) gets the token counts."""
    span = tracing.current_span()
    if span.is_recording():
        usage = generation.usage
        span.set_attribute(tracing.INPUT_TOKENS, usage.prompt_tokens)
        span.set_attribute(tracing.OUTPUT_TOKENS, usage.completion_tokens)
        span.set_attribute(tracing.CACHED_TOKENS, usage.cached_tokens)


def sse(payload: dict) -> str:
    return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n"


class EventStream(StreamingResponse):
    """Server-sent events whose `on_close` always runs, however the response ends: a client
    that disconnects gets the stream task cancelled, and `on_close` cancels the pods' calls."""

    def __init__(self, events: AsyncIterator[str], on_close: Callable[[], None]) -> None:
        super().__init__(
            events,
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
        self._on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()
