"""The OpenAI-compatible HTTP API (FastAPI): /v1/completions, /v1/chat/completions,
/v1/responses, /v1/models (and /v1/models/{id}), /tokenize, /detokenize, /health, /metrics.
Request bodies are the pydantic models of `api_schema.py` (FastAPI validates them and lists them
in /openapi.json).
Handlers translate HTTP <-> `GatewayCore`; the exception handlers at the bottom are the one place
errors become status codes and OpenAI error bodies."""

from __future__ import annotations

import asyncio
import json
import logging
import sys
import time
import uuid
from collections.abc import AsyncIterator, Callable

import grpc
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException

from splitserve.common import tracing
from splitserve.common.grpc_server import StatusError
from splitserve.engine.prompts import PromptError
from splitserve.engine.sampling_params import SamplingParams
from splitserve.gateway.api_errors import from_validation
from splitserve.gateway.api_schema import ChatBody, CompletionBody
from splitserve.gateway.generation import (
    GatewayCore,
    Generation,
    GenerationRequest,
    collect,
)
from splitserve.gateway.metrics import CONTENT_TYPE, route_span
from splitserve.gateway.openai_protocol import (
    DEFAULT_COMPLETION_MAX_TOKENS,
    ChatFormat,
    CommonOptions,
    CompletionFormat,
    CompletionRequest,
    Envelope,
    RequestError,
    error_body,
    param_of,
    parse_chat,
    parse_completion,
)
from splitserve.gateway.responses_api import ResponsesBody, ResponsesFormat, parse_responses
from splitserve.gateway.tokens_api import TokenRoutes
from splitserve.gateway.tools.hooks import ToolOutputs

logger = logging.getLogger(__name__)

Format = CompletionFormat | ChatFormat
# nginx's status for "the client closed the connection first"; only the metrics see it.
CLIENT_CLOSED_REQUEST = 499
_HTTP_STATUS = {
    grpc.StatusCode.UNAVAILABLE: 503,
    grpc.StatusCode.DEADLINE_EXCEEDED: 504,
    grpc.StatusCode.RESOURCE_EXHAUSTED: 429,
}
# The client's region, for routing it to pods nearby (gRPC: metadata of the same name).
REGION_HEADER = "x-splitserve-region"
ENDPOINTS = (
    "/v1/completions",
    "/v1/chat/completions",
    "/v1/models",
    "/v1/responses",
    "/tokenize",
    "/detokenize",
    "/health",
    "/metrics",
)
# Traced when tracing is on.
GENERATION_ENDPOINTS = ("/v1/completions", "/v1/chat/completions", "/v1/responses")


class ClientDisconnected(Exception):
    """The client went away before the response started; nobody reads what we answer."""


def create_app(core: GatewayCore) -> FastAPI:
    app = FastAPI(title="splitserve gateway", docs_url=None, redoc_url=None)
    routes = _Routes(core)
    app.add_api_route("/v1/completions", routes.completions, methods=["POST"])
    app.add_api_route("/v1/chat/completions", routes.chat_completions, methods=["POST"])
    app.add_api_route("/v1/responses", routes.responses, methods=["POST"])
    app.add_api_route("/v1/models", routes.models, methods=["GET"])
    app.add_api_route("/v1/models/{model_id:path}", routes.model, methods=["GET"])
    TokenRoutes(core).add_to(app)
    app.add_api_route("/health", routes.health, methods=["GET"])
    app.add_api_route("/metrics", routes.metrics, methods=["GET"])
    _add_error_handlers(app)
    app.add_middleware(_CountRequests, core=core)  # type: ignore[arg-type]
    return app


class _Routes:
    def __init__(self, core: GatewayCore) -> None:
        self.core = core
        self.created = int(time.time())

    async def completions(self, body: CompletionBody, request: Request) -> Response:
        core = self.core
        with tracing.child_span("gateway.validate", None):
            parsed = parse_completion(body, core.model_name)
        with tracing.child_span("gateway.tokenize", None):
            prompts = [
                core.encode(p, parsed.add_special_tokens) if isinstance(p, str) else p
                for p in parsed.prompts
            ]
        params = parsed.options.params(DEFAULT_COMPLETION_MAX_TOKENS)
        request_id = f"cmpl-{uuid.uuid4().hex}"
        generation = await _start(
            core,
            GenerationRequest(
                request_id,
                prompts,
                params,
                parsed.options.priority,
                parsed.options.prompt_cache_key,
            ),
            "prompt",
            request.headers.get(REGION_HEADER, ""),
        )
        envelope = Envelope(request_id, core.model_name, int(time.time()))
        fmt = CompletionFormat(
            envelope,
            params.logprobs is not None,
            parsed.options,
            generation.usage.prompt_tokens,
            _echo_texts(core, parsed, prompts, params),
        )
        return await _respond(request, generation, fmt, parsed.options)

    async def chat_completions(self, body: ChatBody, request: Request) -> Response:
        core = self.core
        with tracing.child_span("gateway.validate", None):
            parsed = parse_chat(body, core.model_name)
        try:
            with tracing.child_span("gateway.tokenize", None):
                prompt = core.encode_chat(parsed.messages, parsed.add_generation_prompt)
        except ValueError as error:  # a template that rejects the conversation
            raise RequestError(str(error), "messages") from None
        # Unset max_tokens means "until the context is full", as OpenAI and vLLM do for chat.
        params = parsed.options.params(max(core.max_model_len - len(prompt), 1))
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        generation = await _start(
            core,
            GenerationRequest(
                request_id,
                [prompt],
                params,
                parsed.options.priority,
                parsed.options.prompt_cache_key,
            ),
            "messages",
            request.headers.get(REGION_HEADER, ""),
        )
        envelope = Envelope(request_id, core.model_name, int(time.time()))
        tools = ToolOutputs.for_request(parsed.tools)  # tool calling hook (tools.py)
        fmt = ChatFormat(
            envelope, parsed.logprobs, parsed.options, tools, generation.usage.prompt_tokens
        )
        return await _respond(request, generation, fmt, parsed.options)

    async def responses(self, body: ResponsesBody, request: Request) -> Response:
        core = self.core
        with tracing.child_span("gateway.validate", None):
            parsed = parse_responses(body, core.model_name)
        try:
            with tracing.child_span("gateway.tokenize", None):
                prompt = core.encode_chat(parsed.messages)
        except ValueError as error:  # a template that rejects the conversation
            raise RequestError(str(error), "input") from None
        params = parsed.params(max(core.max_model_len - len(prompt), 1))
        request_id = f"resp_{uuid.uuid4().hex}"
        generation = await _start(
            core,
            GenerationRequest(request_id, [prompt], params),
            "input",
            request.headers.get(REGION_HEADER, ""),
        )
        fmt = ResponsesFormat(request_id, core.model_name, parsed)
        if not body.stream:
            sequences = await _unless_disconnected(request, collect(generation), generation)
            _annotate_usage(generation)
            return JSONResponse(fmt.response(sequences[0], generation.usage))
        first = await _unless_disconnected(request, anext(generation), generation)
        return _EventStream(_response_events(fmt, generation, first), generation.cancel)

    async def models(self) -> dict:
        return {"object": "list", "data": [self._card()]}

    async def model(self, model_id: str) -> JSONResponse:
        if model_id != self.core.model_name:
            message = f"The model {model_id!r} does not exist; this server serves " + repr(
                self.core.model_name
            )
            body = error_body(message, "invalid_request_error", "model", "model_not_found")
            return JSONResponse(body, status_code=404)
        return JSONResponse(self._card())

    def _card(self) -> dict:
        card = {
            "id": self.core.model_name,
            "object": "model",
            "created": self.created,
            "owned_by": "splitserve",
        }
        max_model_len = self.core.decode_pool.max_model_len
        if max_model_len is not None:
            card["max_model_len"] = max_model_len
        return card

    async def health(self) -> JSONResponse:
        core = self.core
        is_ok = bool(core.decode_pool.available())
        body = {
            "status": "ok" if is_ok else "unavailable",
            "model": core.model_name,
            "workers": {  # the older word: clients and scripts read this key
                pool.role: {pod.address: pod.is_available for pod in pool.pods}
                for pool in _pools(core)
            },
            # The gateway must never load model code: a test and an operator can check.
            "torch_imported": "torch" in sys.modules,
        }
        return JSONResponse(body, status_code=200 if is_ok else 503)

    async def metrics(self) -> Response:
        return Response(self.core.metrics.render(_pools(self.core)), media_type=CONTENT_TYPE)


def _pools(core: GatewayCore) -> list:
    return [pool for pool in (core.decode_pool, core.prefill_pool) if pool is not None]


def _echo_texts(
    core: GatewayCore, parsed: CompletionRequest, prompts: list[list[int]], params: SamplingParams
) -> list[str]:
    """Each choice's prompt text for `echo` (a token-id prompt decoded); [] without echo."""
    if not parsed.echo:
        return []
    texts = [
        given if isinstance(given, str) else core.tokenizer.decode(ids, params.skip_special_tokens)
        for given, ids in zip(parsed.prompts, prompts)
    ]
    return [text for text in texts for _ in range(params.n)]


async def _start(
    core: GatewayCore, request: GenerationRequest, prompt_param: str, client_region: str = ""
) -> Generation:
    tracing.current_span().set_attribute(tracing.REQUEST_ID, request.request_id)
    try:
        # Not current while it runs: the decode calls started in there are the request's
        # children, beside the route span, not under it.
        with route_span(core.metrics, request) as observe:
            generation = await core.start(request, client_region)
            observe(generation)
            return generation
    except PromptError as error:
        raise RequestError(str(error), prompt_param, error.code) from None


async def _respond(
    request: Request, generation: Generation, fmt: Format, options: CommonOptions
) -> Response:
    if not options.stream:
        sequences = await _unless_disconnected(request, collect(generation), generation)
        _annotate_usage(generation)
        return JSONResponse(fmt.response(sequences, generation.usage))
    # Wait for the first chunk before answering 200: a request the pod rejects still gets
    # its 400, and the headers go out together with the first token.
    first = await _unless_disconnected(request, anext(generation), generation)
    events = _events(generation, first, fmt, options.include_usage)
    return _EventStream(events, on_close=generation.cancel)


async def _unless_disconnected(request: Request, awaitable, generation: Generation):
    """Awaits `awaitable`, cancelling the generation (so the pods abort and free their
    blocks) if the client goes away first."""
    work = asyncio.ensure_future(awaitable)
    watcher = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        await asyncio.wait([work, watcher], return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not work.done():
            generation.cancel()
            work.cancel()
    if not work.done():
        raise ClientDisconnected()
    return work.result()


async def _wait_for_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _events(
    generation: Generation, first, fmt: Format, include_usage: bool
) -> AsyncIterator[str]:
    yield _sse(fmt.chunk(first))
    try:
        async for chunk in generation:
            yield _sse(fmt.chunk(chunk))
    except (ValueError, StatusError) as error:
        # The 200 went out with the first chunk: the error can only travel as an event.
        logger.warning("stream %s failed: %s", fmt.envelope.request_id, error)
        _, body = _error_response(error)
        yield _sse(body)
    else:
        _annotate_usage(generation)
        if include_usage:
            yield _sse(fmt.usage_chunk(generation.usage))
    yield "data: [DONE]\n\n"


async def _response_events(
    fmt: ResponsesFormat, generation: Generation, first
) -> AsyncIterator[str]:
    """The Responses API's events, each named in its `event:` line as OpenAI sends them."""
    try:
        async for event in fmt.events(generation, first):
            yield f"event: {event['type']}\n" + _sse(event)
    except (ValueError, StatusError) as error:
        logger.warning("stream %s failed: %s", fmt.response_id, error)
        _, body = _error_response(error)
        yield "event: error\n" + _sse({"type": "error", **body["error"]})
    else:
        _annotate_usage(generation)


def _annotate_usage(generation: Generation) -> None:
    """The request span (current while a handler or its stream runs) gets the token counts."""
    span = tracing.current_span()
    if span.is_recording():
        usage = generation.usage
        span.set_attribute(tracing.INPUT_TOKENS, usage.prompt_tokens)
        span.set_attribute(tracing.OUTPUT_TOKENS, usage.completion_tokens)
        span.set_attribute(tracing.CACHED_TOKENS, usage.cached_tokens)


def _sse(payload: dict) -> str:
    return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n"


class _EventStream(StreamingResponse):
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


# ---- errors ---------------------------------------------------------------------------------


def _error_response(error: Exception) -> tuple[int, dict]:
    if isinstance(error, ValueError):
        code = error.code if isinstance(error, RequestError) else "invalid_value"
        return 400, error_body(str(error), "invalid_request_error", param_of(error), code)
    if isinstance(error, StatusError):
        status = _HTTP_STATUS.get(error.code, 502)
        return status, error_body(str(error), "server_error", None, error.code.name.lower())
    raise TypeError(f"no HTTP mapping for {type(error).__name__}")


def _add_error_handlers(app: FastAPI) -> None:
    async def known(request: Request, error: Exception) -> JSONResponse:
        status, body = _error_response(error)
        return JSONResponse(body, status_code=status)

    async def validation(request: Request, error: RequestValidationError) -> JSONResponse:
        status, body = _error_response(from_validation(error.errors(), error.body))
        return JSONResponse(body, status_code=status)

    async def http(request: Request, error: HTTPException) -> JSONResponse:
        kind = "invalid_request_error" if error.status_code < 500 else "server_error"
        body = error_body(str(error.detail), kind, None, None)
        return JSONResponse(body, status_code=error.status_code, headers=error.headers)

    async def disconnected(request: Request, error: ClientDisconnected) -> Response:
        return Response(status_code=CLIENT_CLOSED_REQUEST)

    for error_class in (ValueError, StatusError):
        app.add_exception_handler(error_class, known)
    app.add_exception_handler(ClientDisconnected, disconnected)
    app.add_exception_handler(RequestValidationError, validation)
    app.add_exception_handler(HTTPException, http)


class _CountRequests:
    """ASGI middleware counting responses by endpoint and status (streams count at their
    start), and, with tracing on, wrapping each generation request in its server span (a
    child of the client's `traceparent`, when it sent one), current until the response's
    last byte. A plain ASGI wrapper, not BaseHTTPMiddleware, which would buffer the streams."""

    def __init__(self, app, core: GatewayCore) -> None:
        self.app = app
        self.core = core

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope.get("path", "")
        endpoint = path if path in ENDPOINTS else "other"  # bounded label values
        span = tracing.NO_SPAN
        if tracing.is_enabled() and path in GENERATION_ENDPOINTS:
            span = _server_span(scope, endpoint)

        async def counting_send(message) -> None:
            if message["type"] == "http.response.start":
                self.core.metrics.requests.labels(endpoint, str(message["status"])).inc()
                span.set_attribute("http.response.status_code", message["status"])
                if message["status"] >= 500:  # a 4xx is the client's error, not the span's
                    span.set_status(tracing.Status(tracing.StatusCode.ERROR))
            await send(message)

        with tracing.span_scope(span), tracing.use_span(span):
            await self.app(scope, receive, counting_send)


def _server_span(scope, endpoint: str) -> tracing.Span:
    headers = {key.decode("latin-1"): value.decode("latin-1") for key, value in scope["headers"]}
    return tracing.start_span(
        f"POST {endpoint}",
        tracing.context_from_headers(headers),
        {"http.request.method": scope.get("method", ""), "url.path": endpoint},
        tracing.SpanKind.SERVER,
    )
