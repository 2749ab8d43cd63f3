"""The gate every request passes, whichever API it came by: its key turned into a tenant, the
tenant's request and concurrency limits checked (`Gate.admit`), and, once the request core
knows the prompt, its tokens counted and its cache salt set (`Caller.charge`).

The admitted caller is a context variable for the rest of the request (`current_caller`): the
request core reads it without knowing which front end set it, and a request with none (no key
file: the gateway is open) goes through as before.
"""

from __future__ import annotations

import dataclasses
import logging
import uuid
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import grpc
from prometheus_client import CollectorRegistry, Counter

from splitserve.common.grpc_server import StatusError
from splitserve.engine.kv.block_hash import tenant_cache_salt
from splitserve.gateway.auth.keys import ApiKey, KeyRing, api_key_from_headers
from splitserve.gateway.auth.limits import LimitExceeded, RateLimiter, WindowUse

if TYPE_CHECKING:
    from splitserve.gateway.core import GenerationRequest

logger = logging.getLogger(__name__)


class Unauthenticated(StatusError):
    """No key, or a key not in the file: HTTP 401, gRPC UNAUTHENTICATED."""

    def __init__(self, message: str, code: str) -> None:
        super().__init__(grpc.StatusCode.UNAUTHENTICATED, message)
        self.openai_code = code


@dataclass
class Caller:
    """One admitted request: its tenant, and what its limits said (for the response's
    x-ratelimit-* headers). `charge` may run once per request."""

    key: ApiKey
    request_id: str
    limiter: RateLimiter
    metrics: TenantMetrics
    holds_slot: bool = False  # a concurrent slot was taken
    slot_in_redis: bool = False
    headers: dict[str, str] = field(default_factory=dict)

    @property
    def tenant(self) -> str:
        return self.key.tenant

    async def charge(self, request: GenerationRequest) -> GenerationRequest:
        """`request` with its tenant's cache salt, once its tokens (every prompt's tokens and
        every sequence's max_tokens) fit the tenant's tokens per minute; raises
        LimitExceeded."""
        params = request.params
        num_prompt_tokens = sum(len(prompt) for prompt in request.prompts)
        num_tokens = num_prompt_tokens + len(request.prompts) * params.n * params.max_tokens
        limit = self.key.limits.tokens_per_minute
        if limit is not None:
            use = await self.limiter.add(self.tenant, "tokens", num_tokens, limit)
            self.headers.update(rate_headers("tokens", use))
            if use.retry_after_s:
                raise self.refused("tokens", f"{num_tokens} tokens asked", use.retry_after_s)
        self.metrics.tokens.labels(self.tenant).inc(num_tokens)
        salt = tenant_cache_salt(self.tenant, params.cache_salt)
        return dataclasses.replace(request, params=dataclasses.replace(params, cache_salt=salt))

    def refused(self, kind: str, detail: str, retry_after_s: float) -> LimitExceeded:
        limit = getattr(self.key.limits, _LIMIT_FIELDS[kind])
        unit = "concurrent requests" if kind == "concurrent_requests" else f"{kind} per minute"
        error = LimitExceeded(
            kind,
            f"Rate limit reached for tenant {self.tenant!r} on {unit}: limit {limit}, {detail}. "
            f"Please try again in {_duration(retry_after_s)}.",
            retry_after_s,
        )
        error.rate_headers = dict(self.headers)
        self.metrics.limited.labels(self.tenant, kind).inc()
        return error


_LIMIT_FIELDS = {
    "requests": "requests_per_minute",
    "tokens": "tokens_per_minute",
    "concurrent_requests": "concurrent_requests",
}
_caller: ContextVar[Caller | None] = ContextVar("splitserve_caller", default=None)


def current_caller() -> Caller | None:
    """The request's admitted caller; None when the gateway runs without keys."""
    return _caller.get()


class TenantMetrics:
    """Per-tenant series; the tenant label takes only the key file's tenants."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.requests = Counter(
            "splitserve_tenant_requests",
            "Authenticated requests by tenant and HTTP status (gRPC: its status code's name).",
            ["tenant", "status"],
            registry=registry,
        )
        self.tokens = Counter(
            "splitserve_tenant_charged_tokens",
            "Prompt tokens plus max output tokens admitted, by tenant (what tokens per minute "
            "counts).",
            ["tenant"],
            registry=registry,
        )
        self.limited = Counter(
            "splitserve_tenant_rate_limited",
            "Requests refused by a tenant limit (requests, tokens, concurrent_requests).",
            ["tenant", "limit"],
            registry=registry,
        )
        self.unauthenticated = Counter(
            "splitserve_unauthenticated_requests",
            "Requests refused for no key or an unknown key.",
            registry=registry,
        )


class Gate:
    """Keys (None: the gateway is open to anyone who reaches it), limits and the tenant
    metrics. One per gateway process, for HTTP and gRPC alike."""

    def __init__(
        self,
        keys: KeyRing | None,
        registry: CollectorRegistry,
        redis_url: str | None = None,
        metrics_public: bool = False,
    ) -> None:
        self.keys = keys
        self.metrics_public = metrics_public or keys is None
        self.metrics = TenantMetrics(registry)
        self.limiter = RateLimiter(redis_url) if keys is not None else None
        if keys is not None:
            logger.info(
                "API keys required: %d keys of %d tenants; /metrics is %s",
                len(keys),
                len(keys.tenants),
                "public" if metrics_public else "guarded",
            )

    @property
    def is_open(self) -> bool:
        return self.keys is None

    async def close(self) -> None:
        if self.limiter is not None:
            await self.limiter.close()

    def authenticate(self, headers: Mapping[str, str]) -> ApiKey:
        """The key the headers (lower-case names) present; raises Unauthenticated."""
        assert self.keys is not None, "authenticate only a gate with keys"
        presented = api_key_from_headers(headers)
        if presented is None:
            self.metrics.unauthenticated.inc()
            raise Unauthenticated(
                "You didn't provide an API key. Send it as 'Authorization: Bearer YOUR_KEY' "
                "(or 'x-api-key: YOUR_KEY').",
                "missing_api_key",
            )
        key = self.keys.lookup(presented)
        if key is None:
            self.metrics.unauthenticated.inc()
            raise Unauthenticated("Incorrect API key provided.", "invalid_api_key")
        return key

    async def admit(self, key: ApiKey) -> Caller:
        """A caller within its requests per minute and concurrent requests (a slot taken:
        `release` it when the response is done); raises LimitExceeded."""
        assert self.limiter is not None, "admit only through a gate with keys"
        caller = Caller(key, uuid.uuid4().hex, self.limiter, self.metrics)
        limits = key.limits
        if limits.requests_per_minute is not None:
            use = await self.limiter.add(key.tenant, "requests", 1, limits.requests_per_minute)
            caller.headers.update(rate_headers("requests", use))
            if use.retry_after_s:
                raise caller.refused("requests", "1 more asked", use.retry_after_s)
        if limits.concurrent_requests is not None:
            taken, in_redis = await self.limiter.enter(
                key.tenant, caller.request_id, limits.concurrent_requests
            )
            if not taken:
                raise caller.refused("concurrent_requests", "all in use", 1.0)
            caller.holds_slot, caller.slot_in_redis = True, in_redis
        return caller

    async def release(self, caller: Caller) -> None:
        if caller.holds_slot:
            caller.holds_slot = False
            await caller.limiter.leave(caller.tenant, caller.request_id, caller.slot_in_redis)

    @staticmethod
    def enter_context(caller: Caller) -> object:
        """Makes `caller` the current one; returns the token for `leave_context`."""
        return _caller.set(caller)

    @staticmethod
    def leave_context(token: object) -> None:
        _caller.reset(token)  # type: ignore[arg-type]


def rate_headers(kind: str, use: WindowUse) -> dict[str, str]:
    """OpenAI's x-ratelimit-{limit,remaining,reset}-{requests,tokens} headers."""
    return {
        f"x-ratelimit-limit-{kind}": str(use.limit),
        f"x-ratelimit-remaining-{kind}": str(use.remaining),
        f"x-ratelimit-reset-{kind}": _duration(use.reset_s),
    }


def _duration(seconds: float) -> str:
    """As OpenAI writes durations: "250ms", "1.5s", "6m0s"."""
    if seconds < 1:
        return f"{max(1, round(seconds * 1000))}ms"
    if seconds < 60:
        return f"{seconds:.3g}s"
    minutes, rest = divmod(int(round(seconds)), 60)
    return f"{minutes}m{rest}s"


@asynccontextmanager
async def grpc_caller(gate: Gate | None, context) -> AsyncIterator[None]:
    """The gate for one gRPC call: its metadata's key (`authorization: Bearer KEY` or
    `x-api-key`), its tenant's limits, the caller current for the block. Raises
    Unauthenticated (UNAUTHENTICATED) or LimitExceeded (RESOURCE_EXHAUSTED, with
    `retry-after` in the trailing metadata)."""
    if gate is None or gate.is_open:
        yield
        return
    metadata = context.invocation_metadata() or ()
    key = gate.authenticate({k.lower(): v for k, v in metadata if isinstance(v, str)})
    try:
        caller = await gate.admit(key)
    except LimitExceeded as error:
        gate.metrics.requests.labels(key.tenant, "RESOURCE_EXHAUSTED").inc()
        context.set_trailing_metadata(tuple(error.retry_after.items()))
        raise
    token = Gate.enter_context(caller)
    status = "OK"
    try:
        yield
    except LimitExceeded as error:
        status = "RESOURCE_EXHAUSTED"
        context.set_trailing_metadata(tuple(error.retry_after.items()))
        raise
    except BaseException as error:
        status = error.code.name if isinstance(error, StatusError) else "ERROR"
        raise
    finally:
        gate.metrics.requests.labels(key.tenant, status).inc()
        Gate.leave_context(token)
        await gate.release(caller)
