"""Per-tenant limits: requests per minute, tokens per minute, concurrent requests.

The per-minute limits are sliding windows approximated from two fixed one-minute windows (as
Cloudflare's and nginx's limiters do): what a tenant used is `current + previous * (1 -
elapsed / 60)`, so a burst at a window's edge is not allowed twice. Concurrent requests are a
sorted set of request ids scored by their start; an id left behind by a gateway that died is
dropped after STALE_AFTER_S.

Counters live in Redis when the gateway has one (`--redis-url`), each check-and-add one Lua
script, so every replica sees every replica's requests. When Redis cannot be reached the
limiter logs it once, counts in this process alone (limits then hold per replica) and tries
Redis again after REDIS_RETRY_S; it logs again when Redis is back.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field

import grpc
import redis.asyncio
import redis.exceptions

from splitserve.common.grpc_server import StatusError
from splitserve.common.redis_auth import redis_password

logger = logging.getLogger(__name__)

WINDOW_S = 60.0
STALE_AFTER_S = 3600.0  # a concurrent slot nobody released (its gateway died)
REDIS_RETRY_S = 5.0
REDIS_TIMEOUT_S = 0.25
# Requests wait up to REDIS_TIMEOUT_S for one of these rather than open more.
REDIS_MAX_CONNECTIONS = 32
_PREFIX = "splitserve:limits"

# KEYS: current window, previous window. ARGV: amount, limit, previous window's weight, ttl.
# -> {allowed (1/0), current, previous}
_ADD_SCRIPT = """
local cur = tonumber(redis.call('GET', KEYS[1]) or '0')
local prev = tonumber(redis.call('GET', KEYS[2]) or '0')
local amount = tonumber(ARGV[1])
if cur + prev * tonumber(ARGV[3]) + amount > tonumber(ARGV[2]) then return {0, cur, prev} end
cur = redis.call('INCRBY', KEYS[1], amount)
redis.call('EXPIRE', KEYS[1], ARGV[4])
return {1, cur, prev}
"""
# KEYS: the running set. ARGV: now, stale before, limit, request id, ttl. -> {allowed, running}
_ENTER_SCRIPT = """
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', ARGV[2])
local running = redis.call('ZCARD', KEYS[1])
if running >= tonumber(ARGV[3]) then return {0, running} end
redis.call('ZADD', KEYS[1], ARGV[1], ARGV[4])
redis.call('EXPIRE', KEYS[1], ARGV[5])
return {1, running + 1}
"""


@dataclass(frozen=True)
class WindowUse:
    """One per-minute limit after a check: what OpenAI's x-ratelimit-* headers say."""

    limit: int
    used: float  # in the sliding minute, this request included if it was allowed
    reset_s: float  # until the current window closes
    retry_after_s: float  # until this request would have fit (0 if it did)

    @property
    def remaining(self) -> int:
        return max(0, self.limit - math.ceil(self.used))


class LimitExceeded(StatusError):
    """A tenant over one of its limits: HTTP 429 (OpenAI's rate_limit_exceeded body, with
    Retry-After and x-ratelimit-* headers), gRPC RESOURCE_EXHAUSTED."""

    def __init__(self, kind: str, message: str, retry_after_s: float) -> None:
        super().__init__(grpc.StatusCode.RESOURCE_EXHAUSTED, message)
        self.kind = kind  # "requests", "tokens" or "concurrent_requests"
        self.retry_after_s = retry_after_s
        self.rate_headers: dict[str, str] = {}  # the x-ratelimit-* headers of the caller

    @property
    def retry_after(self) -> dict[str, str]:
        """The Retry-After header: whole seconds, at least 1."""
        return {"retry-after": str(max(1, math.ceil(self.retry_after_s)))}


def _window_use(limit: int, cur: float, prev: float, amount: int, now: float) -> WindowUse:
    elapsed = now % WINDOW_S
    weight = 1.0 - elapsed / WINDOW_S
    used = cur + prev * weight
    reset_s = WINDOW_S - elapsed
    if used + amount <= limit:
        return WindowUse(limit, used + amount, reset_s, 0.0)
    room = limit - cur - amount
    if room < 0 or prev <= 0:  # only the next window has room (if any ever will)
        wait = reset_s + (WINDOW_S * (1 - (limit - amount) / cur) if cur > 0 else 0.0)
    else:  # the previous window's share must shrink to `room`
        wait = WINDOW_S * (1 - room / prev) - elapsed
    return WindowUse(limit, used, reset_s, max(wait, 0.001))


@dataclass
class _LocalCounters:
    """This process's counters: the fallback while Redis is away, the store without one."""

    windows: dict[tuple[str, str, int], int] = field(default_factory=dict)
    running: dict[str, dict[str, float]] = field(default_factory=dict)

    def add(self, tenant: str, kind: str, amount: int, limit: int, now: float) -> WindowUse:
        index = int(now // WINDOW_S)
        cur = self.windows.get((tenant, kind, index), 0)
        prev = self.windows.get((tenant, kind, index - 1), 0)
        use = _window_use(limit, cur, prev, amount, now)
        if not use.retry_after_s:
            self.windows[(tenant, kind, index)] = cur + amount
            self._forget_before(index - 1)
        return use

    def enter(self, tenant: str, request_id: str, limit: int, now: float) -> int | None:
        """The number running with this one, or None if the limit is reached."""
        running = self.running.setdefault(tenant, {})
        if len(running) >= limit:
            return None
        running[request_id] = now
        return len(running)

    def leave(self, tenant: str, request_id: str) -> None:
        self.running.get(tenant, {}).pop(request_id, None)

    def _forget_before(self, index: int) -> None:
        if len(self.windows) > 4096:
            self.windows = {k: v for k, v in self.windows.items() if k[2] >= index}


class RateLimiter:
    """Checks and counts a tenant's use; the store is Redis (shared by every replica) or,
    without one or while it is down, this process."""

    def __init__(self, redis_url: str | None = None) -> None:
        self._redis = _connect(redis_url) if redis_url else None
        if self._redis is not None:  # by EVALSHA: the scripts travel once
            self._add_script = self._redis.register_script(_ADD_SCRIPT)
            self._enter_script = self._redis.register_script(_ENTER_SCRIPT)
        self._local = _LocalCounters()
        self._redis_down_until = 0.0
        self._is_degraded = False
        if self._redis is None:
            logger.info("rate limits count in this gateway alone (no --redis-url)")

    async def close(self) -> None:
        if self._redis is not None:
            await self._redis.aclose()

    async def add(self, tenant: str, kind: str, amount: int, limit: int) -> WindowUse:
        """Adds `amount` to the tenant's `kind` window if it stays within `limit`; the use
        after (retry_after_s > 0: refused, nothing added)."""
        now = time.time()
        client = self._client()
        if client is not None:
            index = int(now // WINDOW_S)
            keys = [self._key(tenant, kind, index), self._key(tenant, kind, index - 1)]
            weight = 1.0 - (now % WINDOW_S) / WINDOW_S
            args: list[str | int] = [amount, limit, repr(weight), int(2 * WINDOW_S) + 1]
            try:
                reply = await self._add_script(keys, args, client)
            except redis.exceptions.RedisError as error:
                self._redis_failed(error)
            else:
                self._redis_ok()
                allowed, cur, prev = reply
                # The window as the script found it: the same arithmetic then says the rest.
                return _window_use(limit, cur - amount if allowed else cur, prev, amount, now)
        return self._local.add(tenant, kind, amount, limit, now)

    async def enter(self, tenant: str, request_id: str, limit: int) -> tuple[bool, bool]:
        """Takes a concurrent slot: (taken, in Redis). A slot taken must be `leave`n."""
        now = time.time()
        client = self._client()
        if client is not None:
            key = f"{_PREFIX}:{{{tenant}}}:running"
            args: list[str | int] = [
                repr(now),
                repr(now - STALE_AFTER_S),
                limit,
                request_id,
                int(STALE_AFTER_S),
            ]
            try:
                allowed, _ = await self._enter_script([key], args, client)
            except redis.exceptions.RedisError as error:
                self._redis_failed(error)
            else:
                self._redis_ok()
                return bool(allowed), True
        return self._local.enter(tenant, request_id, limit, now) is not None, False

    async def leave(self, tenant: str, request_id: str, in_redis: bool) -> None:
        if not in_redis or self._redis is None:
            self._local.leave(tenant, request_id)
            return
        try:
            await self._redis.zrem(f"{_PREFIX}:{{{tenant}}}:running", request_id)
        except redis.exceptions.RedisError as error:
            # The slot stays counted until STALE_AFTER_S: a stricter limit, never a looser one.
            self._redis_failed(error)

    def _client(self) -> redis.asyncio.Redis | None:
        if self._redis is None or time.monotonic() < self._redis_down_until:
            return None
        return self._redis

    def _redis_failed(self, error: Exception) -> None:
        self._redis_down_until = time.monotonic() + REDIS_RETRY_S
        if not self._is_degraded:
            self._is_degraded = True
            logger.warning(
                "rate limits: Redis unreachable (%s); counting in this gateway alone, so limits "
                "hold per replica until it is back",
                error,
            )

    def _redis_ok(self) -> None:
        if self._is_degraded:
            self._is_degraded = False
            logger.warning("rate limits: Redis is back; limits hold across replicas again")

    @staticmethod
    def _key(tenant: str, kind: str, index: int) -> str:
        return f"{_PREFIX}:{{{tenant}}}:{kind}:{index}"


def _connect(url: str) -> redis.asyncio.Redis:
    """A client whose pool makes a burst of requests wait briefly for a connection (the
    default pool fails past its size); short timeouts, so a Redis that is down costs a request
    milliseconds (password as services/common/redis_auth.py says)."""
    pool = redis.asyncio.BlockingConnectionPool.from_url(
        url,
        password=redis_password(),
        max_connections=REDIS_MAX_CONNECTIONS,
        timeout=REDIS_TIMEOUT_S,
        socket_timeout=REDIS_TIMEOUT_S,
        socket_connect_timeout=REDIS_TIMEOUT_S,
    )
    return redis.asyncio.Redis(connection_pool=pool)
