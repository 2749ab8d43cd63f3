"""The gate every request passes, whichever API it came by: its key turned into a tenant, then
the tenant's limits checked and charged in one round trip to Redis. A generation request is
admitted once the request core knows its prompt (`Gate.defer`, then `Caller.charge`: requests,
tokens and concurrent requests together, and its cache salt set); any other request before its
route runs (`Gate.admit`: requests and concurrent requests). A deferred request that ends
before its charge (a 400) is admitted then (`Gate.settle`): counted, or refused in its place.

The caller is a context variable for the rest of the request (`current_caller`): the
request core reads it without knowing which front end set it, and a request with none (no key
file: the gateway is open) goes through as before.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import uuid
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager, suppress
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import grpc
from prometheus_client import CollectorRegistry, Counter

from splitserve.common.grpc_server import StatusError
from splitserve.engine.kv.block_hash import tenant_cache_salt
from splitserve.gateway.auth.keys import ApiKey, KeyRing, api_key_from_headers
from splitserve.gateway.auth.limits import Admission, Ask, LimitExceeded, RateLimiter, WindowUse

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
    """One authenticated request: its tenant, whether its limits were checked yet, and what
    they said (for the response's x-ratelimit-* headers). `charge` may run once per request."""

    key: ApiKey
    request_id: str  # names its concurrent slot
    limiter: RateLimiter
    metrics: TenantMetrics
    is_admitted: bool = False  # its limits were checked and charged
    holds_slot: bool = False  # a concurrent slot was taken
    is_released: bool = False  # its response is done (a slot taken after is given back)
    slot_in_redis: bool = False
    headers: dict[str, str] = field(default_factory=dict)

    @property
    def tenant(self) -> str:
        return self.key.tenant

    def charge_soon(self, request: GenerationRequest) -> tuple[GenerationRequest, PendingCharge]:
        """`request` with its tenant's cache salt, and the check of its limits, started: its
        tokens (every prompt's tokens and every sequence's max_tokens) against the tenant's
        tokens per minute and, if the caller was deferred, its requests per minute and
        concurrent requests too (one round trip). `PendingCharge.wait` raises LimitExceeded.
        Whether the request may be sent before the check answers: `PendingCharge.may_overlap`
        (headroom.py)."""
        params = request.params
        num_prompt_tokens = sum(len(prompt) for prompt in request.prompts)
        num_tokens = num_prompt_tokens + len(request.prompts) * params.n * params.max_tokens
        may_overlap = self.limiter.headroom.has_room(self.tenant, num_tokens)
        self.metrics.tenant_checks(self.tenant, may_overlap).inc()
        pending = PendingCharge(asyncio.ensure_future(self._charge(num_tokens)), may_overlap)
        salt = tenant_cache_salt(self.tenant, params.cache_salt)
        salted = dataclasses.replace(request, params=dataclasses.replace(params, cache_salt=salt))
        return salted, pending

    async def _charge(self, num_tokens: int) -> None:
        limits = self.key.limits
        if not self.is_admitted:
            await self.admit(num_tokens)
        elif limits.tokens_per_minute is not None:  # admitted before its route ran
            ask = Ask(num_tokens=num_tokens, tokens_per_minute=limits.tokens_per_minute)
            self._take(await self.limiter.admit(self.tenant, self.request_id, ask), num_tokens)
        if self.is_released:  # its response ended while this check was under way
            Gate.release(self)
        self.metrics.tenant_tokens(self.tenant).inc(num_tokens)

    async def admit(self, num_tokens: int | None = None, takes_slot: bool = True) -> None:
        """Checks and charges the caller's limits (its tokens per minute only with
        `num_tokens`; `takes_slot` False: the running count checked, no slot taken); raises
        LimitExceeded."""
        assert not self.is_admitted, "a caller is admitted once"
        limits = self.key.limits
        ask = Ask(
            limits.requests_per_minute,
            num_tokens or 0,
            limits.tokens_per_minute if num_tokens is not None else None,
            limits.concurrent_requests,
            takes_slot,
        )
        admission = await self.limiter.admit(self.tenant, self.request_id, ask)
        self.is_admitted = True
        self.holds_slot, self.slot_in_redis = admission.holds_slot, admission.slot_in_redis
        self._take(admission, num_tokens or 0)

    def _take(self, admission: Admission, num_tokens: int) -> None:
        """The admission's headers kept; raises LimitExceeded if it refused."""
        if admission.requests is not None:
            self.headers.update(rate_headers("requests", admission.requests))
        if admission.tokens is not None:
            self.headers.update(rate_headers("tokens", admission.tokens))
        if admission.refused is not None:
            detail = _REFUSAL_DETAILS[admission.refused].format(num_tokens=num_tokens)
            raise self.refused(admission.refused, detail, admission.retry_after_s)

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
        self.metrics.tenant_limited(self.tenant, kind).inc()
        return error


class PendingCharge:
    """A request's limits being checked in the background (`Caller.charge_soon`). The task
    runs to its end even if whoever waits is cancelled: a slot it takes is then given back
    by the caller's release."""

    def __init__(self, task: asyncio.Future[None], may_overlap: bool) -> None:
        self._task = task
        self.may_overlap = may_overlap  # the request may be sent before the check answers

    @property
    def refused(self) -> bool:
        """Answered already, with a refusal."""
        return (
            self._task.done() and not self._task.cancelled() and self._task.exception() is not None
        )

    async def wait(self) -> None:
        """Raises LimitExceeded if the check refused."""
        await asyncio.shield(self._task)

    async def settle(self) -> None:
        """Waits for the check whatever it says (an error on its way out wins over a
        refusal: the caller is admitted either way, so nothing charges it twice)."""
        with suppress(LimitExceeded):
            await asyncio.shield(self._task)


_REFUSAL_DETAILS = {
    "requests": "1 more asked",
    "tokens": "{num_tokens} tokens asked",
    "concurrent_requests": "all in use",
}
_LIMIT_FIELDS = {
    "requests": "requests_per_minute",
    "tokens": "tokens_per_minute",
    "concurrent_requests": "concurrent_requests",
}
_caller: ContextVar[Caller | None] = ContextVar("splitserve_caller", default=None)
# Concurrent slots' names: this process's own prefix, then a count (cheaper than a uuid each).
_REQUEST_PREFIX = uuid.uuid4().hex[:16]
_request_numbers = itertools.count()


def current_caller() -> Caller | None:
    """The request's admitted caller; None when the gateway runs without keys."""
    return _caller.get()


class TenantMetrics:
    """Per-tenant series; the tenant label takes only the key file's tenants. A series is
    looked up once (`labels` validates and locks each time), then kept."""

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
        self.checks = Counter(
            "splitserve_tenant_limit_checks",
            "Generation requests' limit checks by tenant and when they ran: beside the "
            "routing and prefill (overlapped: the tenant had room) or before (before_send).",
            ["tenant", "when"],
            registry=registry,
        )
        self.unauthenticated = Counter(
            "splitserve_unauthenticated_requests",
            "Requests refused for no key or an unknown key.",
            registry=registry,
        )
        self._series: dict[tuple[str, ...], Counter] = {}

    def tenant_requests(self, tenant: str, status: str) -> Counter:
        return self._get(self.requests, ("requests", tenant, status))

    def tenant_tokens(self, tenant: str) -> Counter:
        return self._get(self.tokens, ("tokens", tenant))

    def tenant_checks(self, tenant: str, overlapped: bool) -> Counter:
        when = "overlapped" if overlapped else "before_send"
        return self._get(self.checks, ("checks", tenant, when))

    def tenant_limited(self, tenant: str, kind: str) -> Counter:
        return self._get(self.limited, ("limited", tenant, kind))

    def _get(self, counter: Counter, key: tuple[str, ...]) -> Counter:
        series = self._series.get(key)
        if series is None:  # bounded: tenants of the key file, statuses, limit kinds
            series = self._series[key] = counter.labels(*key[1:])
        return series


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

    def defer(self, key: ApiKey) -> Caller:
        """A caller whose limits are checked when its tokens are known (`Caller.charge`), or,
        if it ends before that, by `settle`; `release` it when the response is done."""
        assert self.limiter is not None, "callers only through a gate with keys"
        request_id = f"{_REQUEST_PREFIX}-{next(_request_numbers)}"
        return Caller(key, request_id, self.limiter, self.metrics)

    async def admit(self, key: ApiKey) -> Caller:
        """A caller within its requests per minute and concurrent requests, checked and
        charged now (a slot taken: `release` it when the response is done); raises
        LimitExceeded."""
        caller = self.defer(key)
        await caller.admit()
        return caller

    @staticmethod
    async def settle(caller: Caller) -> None:
        """Admits a deferred caller that ended before its charge (a request refused as
        malformed is still a request): its requests per minute charged, its concurrent
        requests checked (no slot taken, it is done); raises LimitExceeded."""
        if not caller.is_admitted:
            await caller.admit(takes_slot=False)

    @staticmethod
    def release(caller: Caller) -> None:
        """Gives its concurrent slot back, in the background (no response waits on it)."""
        caller.is_released = True
        if caller.holds_slot:
            caller.holds_slot = False
            caller.limiter.leave_soon(caller.tenant, caller.request_id, caller.slot_in_redis)

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
    caller = gate.defer(key)  # admitted by its charge: every method here generates
    token = Gate.enter_context(caller)
    status = "OK"
    try:
        try:
            yield
        except Exception:
            await Gate.settle(caller)  # refused in its error's place, else counted
            raise
        await Gate.settle(caller)
    except LimitExceeded as error:
        status = "RESOURCE_EXHAUSTED"
        context.set_trailing_metadata(tuple(error.retry_after.items()))
        raise
    except BaseException as error:
        status = error.code.name if isinstance(error, StatusError) else "ERROR"
        raise
    finally:
        gate.metrics.tenant_requests(key.tenant, status).inc()
        Gate.leave_context(token)
        Gate.release(caller)
