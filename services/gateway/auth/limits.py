"""Per-tenant limits: requests per minute, tokens per minute, concurrent requests.

The per-minute limits are sliding windows approximated from two fixed one-minute windows (as
Cloudflare's and nginx's limiters do): what a tenant used is `current + previous * (1 -
elapsed / 60)`, so a burst at a window's edge is not allowed twice. Concurrent requests are a
sorted set of request ids scored by their start; an id left behind by a gateway that died is
dropped after STALE_AFTER_S.

A request's limits are checked and charged together, by one Lua script in one round trip
(`RateLimiter.admit`): every limit is read, the first over (requests, then concurrent requests,
then tokens) refuses and nothing is charged; else every window is charged and the slot taken.
The scripts of requests admitted in one turn of the event loop share one pipeline
(script_batch.py).
Counters live in Redis when the gateway has one (`--redis-url`), so every replica sees every
replica's requests. When Redis cannot be reached the limiter logs it once, counts in this
process alone (limits then hold per replica) and tries Redis again after REDIS_RETRY_S; it logs
again when Redis is back. A slot is given back in the background (`leave_soon`), its ZREMs
pipelined, so no response waits on Redis at its end.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from dataclasses import dataclass, field, replace

import grpc
import redis.asyncio
import redis.exceptions

from splitserve.common.grpc_server import StatusError
from splitserve.common.redis_auth import redis_password
from splitserve.gateway.auth.headroom import Headroom
from splitserve.gateway.auth.script_batch import ScriptBatcher

logger = logging.getLogger(__name__)

WINDOW_S = 60.0
STALE_AFTER_S = 3600.0  # a concurrent slot nobody released (its gateway died)
REDIS_RETRY_S = 5.0
REDIS_TIMEOUT_S = 0.25
# Requests wait up to REDIS_TIMEOUT_S for one of these rather than open more.
REDIS_MAX_CONNECTIONS = 32
_PREFIX = "splitserve:limits"
_WINDOW_TTL_S = int(2 * WINDOW_S) + 1  # a window is read as "previous" for one more minute

# KEYS: requests now, requests before, tokens now, tokens before (windows), the running set.
# ARGV: 1 previous window's weight, 2 window ttl, 3 requests limit, 4 tokens asked, 5 tokens
# limit, 6 concurrent limit (a limit of 0: unchecked), 7 now, 8 stale before, 9 request id,
# 10 running set ttl, 11 take a slot (1/0: check the running count only).
# -> {refused ('' or the limit's kind), requests now, before, tokens now, before, running}, the
# counts as found, before this request's charge.
_ADMIT_SCRIPT = """
local weight = tonumber(ARGV[1])
local requests_limit, tokens = tonumber(ARGV[3]), tonumber(ARGV[4])
local tokens_limit, running_limit = tonumber(ARGV[5]), tonumber(ARGV[6])
local counts = {0, 0, 0, 0}
local refused = ''
local function over(index, amount, limit)
  counts[index] = tonumber(redis.call('GET', KEYS[index]) or '0')
  counts[index + 1] = tonumber(redis.call('GET', KEYS[index + 1]) or '0')
  return counts[index] + counts[index + 1] * weight + amount > limit
end
if requests_limit > 0 and over(1, 1, requests_limit) then refused = 'requests' end
local running = 0
if running_limit > 0 then
  redis.call('ZREMRANGEBYSCORE', KEYS[5], '-inf', ARGV[8])
  running = redis.call('ZCARD', KEYS[5])
  if refused == '' and running >= running_limit then refused = 'concurrent_requests' end
end
if tokens_limit > 0 and over(3, tokens, tokens_limit) and refused == '' then
  refused = 'tokens'
end
if refused == '' then
  if requests_limit > 0 then
    redis.call('INCR', KEYS[1])
    redis.call('EXPIRE', KEYS[1], ARGV[2])
  end
  if tokens_limit > 0 then
    redis.call('INCRBY', KEYS[3], tokens)
    redis.call('EXPIRE', KEYS[3], ARGV[2])
  end
  if running_limit > 0 and ARGV[11] == '1' then
    redis.call('ZADD', KEYS[5], ARGV[7], ARGV[9])
    redis.call('EXPIRE', KEYS[5], ARGV[10])
  end
end
return {refused, counts[1], counts[2], counts[3], counts[4], running}
"""


@dataclass(frozen=True, slots=True)
class Ask:
    """What one request asks of its tenant's limits, checked and charged together; a None
    limit is not checked."""

    requests_per_minute: int | None = None  # one request asked
    num_tokens: int = 0
    tokens_per_minute: int | None = None
    concurrent_requests: int | None = None
    takes_slot: bool = True  # False: the running count is checked, no slot taken

    @property
    def checks_nothing(self) -> bool:
        return (
            self.requests_per_minute is None
            and self.tokens_per_minute is None
            and self.concurrent_requests is None
        )


@dataclass(frozen=True)
class WindowUse:
    """One per-minute limit after a check: what OpenAI's x-ratelimit-* headers say."""

    limit: int
    used: float  # in the sliding minute, this request included if it was charged
    reset_s: float  # until the current window closes
    retry_after_s: float  # until this request would have fit (0 if it did)

    @property
    def remaining(self) -> int:
        return max(0, self.limit - math.ceil(self.used))


@dataclass(frozen=True, slots=True)
class Admission:
    """What `RateLimiter.admit` found: charged in full, or refused with nothing charged."""

    refused: str | None  # the limit that refused: "requests", "concurrent_requests", "tokens"
    retry_after_s: float  # 0 when admitted
    requests: WindowUse | None  # None: requests per minute not checked
    tokens: WindowUse | None  # None: tokens per minute not checked
    holds_slot: bool  # a concurrent slot was taken: `leave` it
    slot_in_redis: bool  # where the slot is (or the counts were) kept
    num_running: int = 0  # the tenant's concurrent requests found, before this one


_UNCHECKED = Admission(None, 0.0, None, None, holds_slot=False, slot_in_redis=False)


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


def _admission(
    ask: Ask,
    refused: str | None,
    counts: tuple[float, float, float, float],
    now: float,
    in_redis: bool,
    num_running: int,
) -> Admission:
    """The headers' view of what the store found (`counts`: each window's current and
    previous count, before this request; `num_running`: its concurrent requests)."""
    requests = tokens = None
    if ask.requests_per_minute is not None:
        requests = _window_use(ask.requests_per_minute, counts[0], counts[1], 1, now)
    if ask.tokens_per_minute is not None:
        tokens = _window_use(ask.tokens_per_minute, counts[2], counts[3], ask.num_tokens, now)
    if refused is None:
        holds_slot = ask.concurrent_requests is not None and ask.takes_slot
        return Admission(None, 0.0, requests, tokens, holds_slot, in_redis, num_running)
    retry_after_s = 1.0  # concurrent requests: a slot may free at any moment
    if refused in ("requests", "tokens"):
        use = requests if refused == "requests" else tokens
        assert use is not None, "a window refused that was not checked"
        retry_after_s = max(use.retry_after_s, 0.001)
    # A window that had room was not charged either: its headers say so.
    if requests is not None and not requests.retry_after_s:
        requests = replace(requests, used=requests.used - 1)
    if tokens is not None and not tokens.retry_after_s:
        tokens = replace(tokens, used=tokens.used - ask.num_tokens)
    return Admission(refused, retry_after_s, requests, tokens, False, in_redis, num_running)


@dataclass
class _LocalCounters:
    """This process's counters: the fallback while Redis is away, the store without one."""

    windows: dict[tuple[str, str, int], int] = field(default_factory=dict)
    running: dict[str, dict[str, float]] = field(default_factory=dict)

    def admit(self, tenant: str, request_id: str, ask: Ask, now: float) -> Admission:
        """As the script does: every limit read, the first over refuses, else all charged."""
        index = int(now // WINDOW_S)
        weight = 1.0 - (now % WINDOW_S) / WINDOW_S
        counts = (
            self.windows.get((tenant, "requests", index), 0),
            self.windows.get((tenant, "requests", index - 1), 0),
            self.windows.get((tenant, "tokens", index), 0),
            self.windows.get((tenant, "tokens", index - 1), 0),
        )
        running = self.running.setdefault(tenant, {})
        refused = None
        limit = ask.requests_per_minute
        if limit is not None and counts[0] + counts[1] * weight + 1 > limit:
            refused = "requests"
        elif ask.concurrent_requests is not None and len(running) >= ask.concurrent_requests:
            refused = "concurrent_requests"
        elif (limit := ask.tokens_per_minute) is not None and (
            counts[2] + counts[3] * weight + ask.num_tokens > limit
        ):
            refused = "tokens"
        num_running = len(running)  # before this request's slot
        if refused is None:
            self._charge(tenant, request_id, ask, index, now)
        return _admission(ask, refused, counts, now, False, num_running)

    def _charge(self, tenant: str, request_id: str, ask: Ask, index: int, now: float) -> None:
        if ask.requests_per_minute is not None:
            key = (tenant, "requests", index)
            self.windows[key] = self.windows.get(key, 0) + 1
        if ask.tokens_per_minute is not None:
            key = (tenant, "tokens", index)
            self.windows[key] = self.windows.get(key, 0) + ask.num_tokens
        if ask.concurrent_requests is not None and ask.takes_slot:
            self.running[tenant][request_id] = now
        self._forget_before(index - 1)

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
        if self._redis is not None:  # by EVALSHA, pipelined: the script travels once
            self._admit_script = ScriptBatcher(self._redis, _ADMIT_SCRIPT)
        self._local = _LocalCounters()
        self.headroom = Headroom()  # who may be checked while their request already runs
        self._redis_down_until = 0.0
        self._is_degraded = False
        self._to_leave: list[tuple[str, str]] = []  # (tenant, request id): slots to give back
        self._leaving: asyncio.Task[None] | None = None
        if self._redis is None:
            logger.info("rate limits count in this gateway alone (no --redis-url)")

    async def close(self) -> None:
        """Gives back the slots still queued, then closes the client."""
        await self.drain()
        if self._redis is not None:
            await self._redis.aclose()

    async def admit(self, tenant: str, request_id: str, ask: Ask) -> Admission:
        """Checks every limit `ask` names and, if all have room, charges them all and takes
        the slot (`request_id` names it): one EVALSHA, or this process's counters while Redis
        is away. Refused: nothing charged. An unlimited tenant costs no round trip."""
        if ask.checks_nothing:
            return _UNCHECKED
        admission = await self._admit(tenant, request_id, ask)
        _note_headroom(self.headroom, tenant, ask, admission)
        return admission

    async def _admit(self, tenant: str, request_id: str, ask: Ask) -> Admission:
        now = time.time()
        if self._client() is not None:
            try:
                reply = await self._admit_script.call(
                    _script_keys(tenant, now), _script_args(request_id, ask, now)
                )
            except redis.exceptions.RedisError as error:
                self._redis_failed(error)
            else:
                self._redis_ok()
                refused = reply[0].decode() or None
                counts = (reply[1], reply[2], reply[3], reply[4])
                return _admission(ask, refused, counts, now, True, int(reply[5]))
        return self._local.admit(tenant, request_id, ask, now)

    async def add(self, tenant: str, kind: str, amount: int, limit: int) -> WindowUse:
        """One per-minute window alone ("requests": amount 1, or "tokens"): `admit` with that
        limit only; the use after (retry_after_s > 0: refused, nothing added)."""
        if kind == "requests":
            assert amount == 1, "a request counts one"
            use = (await self.admit(tenant, "", Ask(requests_per_minute=limit))).requests
        else:
            assert kind == "tokens", f"no {kind} window"
            ask = Ask(num_tokens=amount, tokens_per_minute=limit)
            use = (await self.admit(tenant, "", ask)).tokens
        assert use is not None, "the window asked is in the admission"
        return use

    async def enter(self, tenant: str, request_id: str, limit: int) -> tuple[bool, bool]:
        """Takes a concurrent slot alone: (taken, in Redis). A slot taken must be `leave`n."""
        admission = await self.admit(tenant, request_id, Ask(concurrent_requests=limit))
        return admission.holds_slot, admission.slot_in_redis

    async def leave(self, tenant: str, request_id: str, in_redis: bool) -> None:
        """Gives back a slot now (`leave_soon`: without waiting for Redis)."""
        if not in_redis or self._redis is None:
            self._local.leave(tenant, request_id)
            return
        self._to_leave.append((tenant, request_id))
        await self._give_back()

    def leave_soon(self, tenant: str, request_id: str, in_redis: bool) -> None:
        """Gives back a slot in the background: queued, and sent with the others queued by
        then in one pipeline. Needs a running event loop."""
        if not in_redis or self._redis is None:
            self._local.leave(tenant, request_id)
            return
        self._to_leave.append((tenant, request_id))
        if self._leaving is None:
            self._leaving = asyncio.get_running_loop().create_task(self._give_back_queued())

    async def drain(self) -> None:
        """Returns once the slots queued by `leave_soon` are given back (or Redis failed)."""
        if self._leaving is not None:
            await asyncio.shield(self._leaving)

    async def _give_back_queued(self) -> None:
        try:
            while self._to_leave:
                await self._give_back()
        finally:
            self._leaving = None

    async def _give_back(self) -> None:
        """One pipeline of ZREMs for the slots queued so far."""
        assert self._redis is not None, "slots in Redis need its client"
        slots, self._to_leave = self._to_leave, []
        pipeline = self._redis.pipeline(transaction=False)
        for tenant, request_id in slots:
            pipeline.zrem(_running_key(tenant), request_id)
        try:
            await pipeline.execute()
        except redis.exceptions.RedisError as error:
            # The slots stay counted until STALE_AFTER_S: a stricter limit, never a looser one.
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


def _note_headroom(headroom: Headroom, tenant: str, ask: Ask, admission: Admission) -> None:
    fractions = []
    if admission.requests is not None:
        fractions.append(admission.requests.remaining / max(1, admission.requests.limit))
    if ask.concurrent_requests is not None:
        slots_left = ask.concurrent_requests - admission.num_running - 1
        fractions.append(slots_left / max(1, ask.concurrent_requests))
    tokens = admission.tokens
    tokens_left = None if tokens is None else float(tokens.remaining)
    tokens_limit = 0 if tokens is None else tokens.limit
    headroom.note(tenant, admission.refused is not None, fractions, tokens_left, tokens_limit)


def _running_key(tenant: str) -> str:
    return f"{_PREFIX}:{{{tenant}}}:running"


def _script_keys(tenant: str, now: float) -> list[str]:
    """The admission script's KEYS: one hash tag per tenant, so one cluster slot."""
    index = int(now // WINDOW_S)
    base = f"{_PREFIX}:{{{tenant}}}"
    return [
        f"{base}:requests:{index}",
        f"{base}:requests:{index - 1}",
        f"{base}:tokens:{index}",
        f"{base}:tokens:{index - 1}",
        f"{base}:running",
    ]


def _script_args(request_id: str, ask: Ask, now: float) -> list[str | int]:
    return [
        repr(1.0 - (now % WINDOW_S) / WINDOW_S),
        _WINDOW_TTL_S,
        ask.requests_per_minute or 0,
        ask.num_tokens,
        ask.tokens_per_minute or 0,
        ask.concurrent_requests or 0,
        repr(now),
        repr(now - STALE_AFTER_S),
        request_id,
        int(STALE_AFTER_S),
        1 if ask.takes_slot else 0,
    ]


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
