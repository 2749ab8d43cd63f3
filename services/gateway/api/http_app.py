"""The OpenAI-compatible HTTP API (FastAPI): the app, with the routes of every endpoint
(/v1/completions, /v1/chat/completions, /v1/responses, /v1/models and /v1/models/{id},
/tokenize, /detokenize, and Anthropic's /v1/messages: each in its module of `api/`) and /health
and /metrics. Request bodies are the endpoints' pydantic models (FastAPI validates them and
lists them in /openapi.json).
The exception handlers here are the one place errors become status codes and OpenAI error
bodies (`respond.error_response`; Anthropic's bodies on /v1/messages, `messages_format`)."""

from __future__ import annotations

import sys
import time
from collections.abc import Mapping

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CollectorRegistry
from starlette.exceptions import HTTPException

from splitserve.common import tracing
from splitserve.common.grpc_server import StatusError
from splitserve.gateway import server_timing
from splitserve.gateway.admission.controller import AdmissionRefused
from splitserve.gateway.api.chat import ChatRoutes
from splitserve.gateway.api.completions import CompletionRoutes
from splitserve.gateway.api.lora_adapters import LoRAAdapterRoutes
from splitserve.gateway.api.messages import MessagesRoutes, MessagesSettings
from splitserve.gateway.api.messages_format import MESSAGES_PATHS, anthropic_error
from splitserve.gateway.api.messages_schema import EXPECTED_SHAPES
from splitserve.gateway.api.models import ModelRoutes
from splitserve.gateway.api.respond import ClientDisconnected, error_response
from splitserve.gateway.api.responses import ResponsesRoutes
from splitserve.gateway.api.tokenize import TokenRoutes
from splitserve.gateway.auth.gate import Gate
from splitserve.gateway.auth.http import DEFAULT_MAX_BODY_BYTES, GateMiddleware, rate_limited_body
from splitserve.gateway.auth.limits import LimitExceeded
from splitserve.gateway.core import GatewayCore
from splitserve.gateway.errors import error_body, from_validation
from splitserve.gateway.generation import PodRefused
from splitserve.gateway.metrics import CONTENT_TYPE
from splitserve.gateway.routing.pods import PodPool

# nginx's status for "the client closed the connection first"; only the metrics see it.
CLIENT_CLOSED_REQUEST = 499
ENDPOINTS = (
    "/v1/completions",
    "/v1/chat/completions",
    "/v1/models",
    "/v1/responses",
    "/v1/load_lora_adapter",
    "/v1/unload_lora_adapter",
    *MESSAGES_PATHS,
    "/tokenize",
    "/detokenize",
    "/health",
    "/metrics",
)
# Traced when tracing is on.
GENERATION_ENDPOINTS = ("/v1/completions", "/v1/chat/completions", "/v1/responses", "/v1/messages")
ENDPOINT_ROUTES = (
    CompletionRoutes,
    ChatRoutes,
    ResponsesRoutes,
    ModelRoutes,
    TokenRoutes,
    LoRAAdapterRoutes,
)


def create_app(
    core: GatewayCore,
    messages: MessagesSettings | None = None,
    gate: Gate | None = None,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    send_server_timing: bool = False,
) -> FastAPI:
    """`gate`: keys, tenants and limits (auth/); None = open to anyone, as without a key file.
    `send_server_timing`: generation responses carry the gateway's and the pods' share of the time
    to their start (server_timing.py)."""
    app = FastAPI(title="splitserve gateway", docs_url=None, redoc_url=None)
    for routes in ENDPOINT_ROUTES:
        routes(core).add_to(app)
    MessagesRoutes(core, messages).add_to(app)
    server = _ServerRoutes(core)
    app.add_api_route("/health", server.health, methods=["GET"])
    app.add_api_route("/metrics", server.metrics, methods=["GET"])
    _add_error_handlers(app)
    gate = gate or Gate(None, CollectorRegistry())
    app.add_middleware(GateMiddleware, gate=gate, max_body_bytes=max_body_bytes)
    # outermost: counts the gate's refusals too, and its clock starts before the gate's work
    app.add_middleware(_CountRequests, core=core, send_server_timing=send_server_timing)
    return app


class _ServerRoutes:
    """What the server says of itself: whether it can serve, and its metrics."""

    def __init__(self, core: GatewayCore) -> None:
        self.core = core

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


def _pools(core: GatewayCore) -> list[PodPool]:
    return [pool for pool in (core.decode_pool, core.prefill_pool) if pool is not None]


# ---- errors ---------------------------------------------------------------------------------

# The error body's type of an admission refusal, by its status (its code is the reason).
_REFUSAL_TYPES = {429: "rate_limit_error", 503: "overloaded_error", 408: "timeout_error"}


def _add_error_handlers(app: FastAPI) -> None:
    async def known(request: Request, error: Exception) -> JSONResponse:
        headers = error.retry_after if isinstance(error, PodRefused) else None  # come back
        return _error_json(request, *error_response(error), headers)

    async def validation(request: Request, error: Exception) -> JSONResponse:
        assert isinstance(error, RequestValidationError), "registered for it alone"
        shapes = EXPECTED_SHAPES if request.url.path in MESSAGES_PATHS else None
        problem = from_validation(error.errors(), error.body, shapes)
        return _error_json(request, *error_response(problem))

    async def http(request: Request, error: Exception) -> JSONResponse:
        assert isinstance(error, HTTPException), "registered for it alone"
        kind = "invalid_request_error" if error.status_code < 500 else "server_error"
        body = error_body(str(error.detail), kind, None, None)
        return _error_json(request, error.status_code, body, error.headers)

    async def limited(request: Request, error: Exception) -> JSONResponse:
        assert isinstance(error, LimitExceeded), "registered for it alone"
        return _error_json(request, 429, rate_limited_body(error), error.retry_after)

    async def refused(request: Request, error: Exception) -> JSONResponse:
        assert isinstance(error, AdmissionRefused), "registered for it alone"
        body = error_body(str(error), _REFUSAL_TYPES[error.http_status], None, error.reason)
        return _error_json(request, error.http_status, body, error.retry_after)

    async def disconnected(request: Request, error: Exception) -> Response:
        return Response(status_code=CLIENT_CLOSED_REQUEST)

    for error_class in (ValueError, StatusError):
        app.add_exception_handler(error_class, known)
    app.add_exception_handler(LimitExceeded, limited)  # a tenant's tokens per minute
    app.add_exception_handler(AdmissionRefused, refused)  # overload control
    app.add_exception_handler(ClientDisconnected, disconnected)
    app.add_exception_handler(RequestValidationError, validation)
    app.add_exception_handler(HTTPException, http)


def _error_json(
    request: Request, status: int, body: dict, headers: Mapping[str, str] | None = None
) -> JSONResponse:
    """An error's response: OpenAI's body, or Anthropic's on its endpoints."""
    if request.url.path in MESSAGES_PATHS:
        status, body = anthropic_error(status, body)
    return JSONResponse(body, status_code=status, headers=headers)


class _CountRequests:
    """ASGI middleware counting responses by endpoint and status (streams count at their
    start), timing each generation request's start (server_timing.py: observed, and sent as a
    Server-Timing header when `send_server_timing`), and, with tracing on, wrapping each generation
    request in its server span (a child of the client's `traceparent`, when it sent one),
    current until the response's last byte. A plain ASGI wrapper, not BaseHTTPMiddleware,
    which would buffer the streams."""

    def __init__(self, app, core: GatewayCore, send_server_timing: bool = False) -> None:
        self.app = app
        self.core = core
        self.send_server_timing = send_server_timing

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope.get("path", "")
        endpoint = path if path in ENDPOINTS else "other"  # bounded label values
        span = tracing.NO_SPAN
        is_generation = path in GENERATION_ENDPOINTS
        if is_generation and tracing.is_enabled():
            span = _server_span(scope, endpoint)

        async def counting_send(message) -> None:
            if message["type"] == "http.response.start":
                if is_generation:
                    message = self._timed(clock, message)
                self.core.metrics.requests.labels(endpoint, str(message["status"])).inc()
                span.set_attribute("http.response.status_code", message["status"])
                if message["status"] >= 500:  # a 4xx is the client's error, not the span's
                    span.set_status(tracing.Status(tracing.StatusCode.ERROR))
            await send(message)

        with (
            server_timing.request_clock() as clock,
            tracing.span_scope(span),
            tracing.use_span(span),
        ):
            await self.app(scope, receive, counting_send)

    def _timed(self, clock: server_timing.RequestClock, start: dict) -> dict:
        """`start` (http.response.start) observed, with the Server-Timing header if asked."""
        headers = list(start.get("headers", ()))
        is_stream = server_timing.is_event_stream(headers)
        split = server_timing.split_at_start(clock, is_stream, time.monotonic())
        self.core.metrics.gateway_time.observe(split.gateway_s)
        if not self.send_server_timing:
            return start
        return {**start, "headers": [*headers, (server_timing.HEADER, split.header_value())]}


def _server_span(scope, endpoint: str) -> tracing.Span:
    headers = {key.decode("latin-1"): value.decode("latin-1") for key, value in scope["headers"]}
    return tracing.start_span(
        f"POST {endpoint}",
        tracing.context_from_headers(headers),
        {"http.request.method": scope.get("method", ""), "url.path": endpoint},
        tracing.SpanKind.SERVER,
    )
