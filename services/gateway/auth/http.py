"""The HTTP side of the gate: an ASGI middleware in front of every route.

In order, for each request:
1. A body larger than `max_body_bytes`, not UTF-8, or with a JSON escape of a lone surrogate
   ("\\ud800", which no tokenizer can take) is a 400; the body is read whole here (request
   bodies are small) and replayed to the route.
2. Paths other than OPEN_PATHS (and /metrics with --metrics-public) need a key: none or an
   unknown one is a 401 with OpenAI's error body.
3. The tenant's limits, checked and charged in one round trip to Redis: over one is a 429
   with Retry-After and OpenAI's rate_limit_exceeded body. On a generation path
   (CHARGED_PATHS) that happens once the request core knows the prompt (`Caller.charge`, so
   tokens per minute are checked in the same round trip); a generation request answered
   before that (a 400) is admitted as its response starts, and a 429 replaces it if refused.
   Elsewhere it happens before the route runs (requests and concurrent requests).
4. The route runs with the caller current (`gate.current_caller`); its response carries the
   x-ratelimit-* headers, and its concurrent slot is given back once the last byte is sent,
   in the background.

A plain ASGI wrapper, not BaseHTTPMiddleware, which would buffer the streams.
"""

from __future__ import annotations

import json
import re

from splitserve.gateway.api.messages_format import MESSAGES_PATHS, anthropic_error
from splitserve.gateway.auth.gate import Caller, Gate, Unauthenticated
from splitserve.gateway.auth.limits import LimitExceeded
from splitserve.gateway.errors import error_body

OPEN_PATHS = frozenset({"/health"})
# The routes that reach GatewayCore.start, which charges the caller (api/http_app.py's
# GENERATION_ENDPOINTS).
CHARGED_PATHS = frozenset(
    {"/v1/completions", "/v1/chat/completions", "/v1/responses", "/v1/messages"}
)
_KEY_HEADERS = frozenset({b"authorization", b"x-api-key"})
DEFAULT_MAX_BODY_BYTES = 8 * 1024 * 1024
_BODY_METHODS = frozenset({"POST", "PUT", "PATCH"})
# \uD800-\uDFFF as a JSON escape, not itself escaped (an odd number of backslashes before it).
_SURROGATE_ESCAPE = re.compile(rb"(?<!\\)(?:\\\\)*\\u[dD][89a-fA-F][0-9a-fA-F]{2}")


class BadBody(ValueError):
    def __init__(self, message: str, code: str) -> None:
        super().__init__(message)
        self.code = code


class GateMiddleware:
    def __init__(
        self,
        app,
        gate: Gate,
        max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
        charged_paths: frozenset[str] = CHARGED_PATHS,
    ) -> None:
        self.app = app
        self.gate = gate
        self.max_body_bytes = max_body_bytes
        self.charged_paths = charged_paths

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope.get("path", "")
        if scope.get("method") in _BODY_METHODS:
            try:
                body = await self._read_body(scope, receive)
            except BadBody as error:
                await _send_error(send, path, 400, str(error), "invalid_request_error", error.code)
                return
            receive = _replay(body, receive)
        if self._is_open(path):
            await self.app(scope, receive, send)
            return
        try:
            key = self.gate.authenticate(_key_headers(scope))
            if path in self.charged_paths:
                caller = self.gate.defer(key)  # admitted by its charge, tokens known
            else:
                caller = await self.gate.admit(key)
        except Unauthenticated as error:
            kind, code = "invalid_request_error", error.openai_code
            await _send_error(send, path, 401, str(error), kind, code)
            return
        except LimitExceeded as error:
            self.gate.metrics.tenant_requests(key.tenant, "429").inc()
            await send_rate_limited(send, path, error)
            return
        await self._serve(scope, receive, send, caller)

    def _is_open(self, path: str) -> bool:
        if self.gate.is_open or path in OPEN_PATHS:
            return True
        return path == "/metrics" and self.gate.metrics_public

    async def _serve(self, scope, receive, send, caller: Caller) -> None:
        path = scope.get("path", "")
        is_replaced = False  # a 429 went out in place of the route's response

        async def send_with_headers(message) -> None:
            nonlocal is_replaced
            if is_replaced:
                return
            if message["type"] == "http.response.start":
                try:
                    await Gate.settle(caller)  # a deferred caller answered before its charge
                except LimitExceeded as error:
                    is_replaced = True
                    self.gate.metrics.tenant_requests(caller.tenant, "429").inc()
                    await send_rate_limited(send, path, error)
                    return
                status = str(message["status"])
                self.gate.metrics.tenant_requests(caller.tenant, status).inc()
                extra = [(k.encode(), v.encode()) for k, v in caller.headers.items()]
                message = {**message, "headers": [*message.get("headers", ()), *extra]}
            await send(message)

        token = Gate.enter_context(caller)
        try:
            await self.app(scope, receive, send_with_headers)
        finally:
            Gate.leave_context(token)
            Gate.release(caller)

    async def _read_body(self, scope, receive) -> bytes:
        """The whole body; raises BadBody past the size or for text no tokenizer can take."""
        declared = next((v for k, v in scope["headers"] if k == b"content-length"), None)
        if declared is not None and declared.isdigit() and int(declared) > self.max_body_bytes:
            raise self._too_large()
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                break  # the client went away: the route sees it as it would have
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_body_bytes:
                raise self._too_large()
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        _check_text(body)
        return body

    def _too_large(self) -> BadBody:
        return BadBody(
            f"the request body is larger than this server's limit of {self.max_body_bytes} "
            "bytes (--max-request-bytes)",
            "request_too_large",
        )


def _key_headers(scope) -> dict[str, str]:
    """The headers that may carry a key (lower-case names), the others left undecoded."""
    return {
        name.decode("latin-1").lower(): value.decode("latin-1")
        for name, value in scope["headers"]
        if name.lower() in _KEY_HEADERS
    }


def _check_text(body: bytes) -> None:
    if body.isascii():
        if _SURROGATE_ESCAPE.search(body) is None:
            return
    else:
        try:
            body.decode("utf-8")
        except UnicodeDecodeError as error:
            raise BadBody(
                f"the request body is not valid UTF-8 (byte {error.start})", "invalid_encoding"
            ) from None
        if _SURROGATE_ESCAPE.search(body) is None:
            return
    # Escaped pairs (an emoji as "\ud83d\ude00") are fine: only a string holding a lone
    # surrogate once decoded is refused.
    try:
        parsed = json.loads(body)
    except ValueError:
        return  # not JSON: the route says so
    if _has_lone_surrogate(parsed):
        raise BadBody(
            "the request body holds a lone UTF-16 surrogate (\\ud800-\\udfff): not valid text",
            "invalid_encoding",
        )


def _has_lone_surrogate(value: object) -> bool:
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            try:
                item.encode("utf-8")
            except UnicodeEncodeError:
                return True
        elif isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return False


def _replay(body: bytes, receive):
    sent = False

    async def replay():
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()  # after the body: the disconnect, when it comes

    return replay


async def send_rate_limited(send, path: str, error: LimitExceeded) -> None:
    """A 429 before the route ran: the x-ratelimit-* headers go with it here."""
    headers = {**error.rate_headers, **error.retry_after}
    await _send_error(send, path, 429, str(error), error.kind, "rate_limit_exceeded", headers)


def rate_limited_body(error: LimitExceeded) -> dict:
    """OpenAI's 429 body: the type names the limit ("requests", "tokens", ...)."""
    return error_body(str(error), error.kind, None, "rate_limit_exceeded")


async def _send_error(
    send,
    path: str,
    status: int,
    message: str,
    kind: str,
    code: str | None,
    headers: dict[str, str] | None = None,
) -> None:
    body = error_body(message, kind, None, code)
    if path in MESSAGES_PATHS:
        status, body = anthropic_error(status, body)
    payload = json.dumps(body).encode()
    raw_headers = [(b"content-type", b"application/json")]
    raw_headers += [(b"content-length", str(len(payload)).encode())]
    raw_headers += [(k.encode(), v.encode()) for k, v in (headers or {}).items()]
    await send({"type": "http.response.start", "status": status, "headers": raw_headers})
    await send({"type": "http.response.body", "body": payload})
