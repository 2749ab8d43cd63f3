"""Per-tenant limits: requests per minute, tokens per minute, concurrent requests.

Counters live in Redis when the gateway has one (`--redis-url`), so limits hold across every
replica. Each replica leases quota from them (lease.py): a request its lease covers is admitted
here, with no round trip; the requests that fall short in one turn of the event loop share one
call (lease_script.py: one atomic Lua script that admits each on its own, charging nothing for
one it refuses, and leases spare quota for what follows), and the calls of different tenants in
that turn share one pipeline (script_batch.py). A finished request's slot is given back to the
lease, not to Redis, unless the lease then holds more than it may keep. A background pass gives
back what a replica leased and does not use (lease.TEND_S).

When Redis cannot be reached the limiter logs it once, counts in this process alone (limits
then hold per replica; what a lease still holds is used first) and tries Redis again after
REDIS_RETRY_S; it logs again when Redis is back.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
import uuid
from contextlib import suppress

import grpc
import redis.asyncio
import redis.exceptions

from splitserve.common.grpc_server import StatusError
from splitserve.common.redis_auth import redis_password
from splitserve.gateway.auth.headroom import Headroom
from splitserve.gateway.auth.lease import TEND_S, TenantLease, Waiter
from splitserve.gateway.auth.lease_script import LEASE_SCRIPT, LeaseCall, LeaseReply
from splitserve.gateway.auth.local_counters import LocalCounters
from splitserve.gateway.auth.script_batch import ScriptBatcher
from splitserve.gateway.auth.windows import UNCHECKED, WINDOW_S, Admission, Ask, WindowUse

__all__ = ["WINDOW_S", "Admission", "Ask", "LimitExceeded", "RateLimiter", "WindowUse"]

logger = logging.getLogger(__name__)

REDIS_RETRY_S = 5.0
REDIS_TIMEOUT_S = 0.25
# Requests wait up to REDIS_TIMEOUT_S for one of these rather than open more.
REDIS_MAX_CONNECTIONS = 32


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


class RateLimiter:
    """Checks and counts a tenant's use; the store is Redis (shared by every replica, leased
    from by this one) or, without one or while it is down, this process."""

    def __init__(self, redis_url: str | None = None) -> None:
        self._redis = _connect(redis_url) if redis_url else None
        if self._redis is not None:  # by EVALSHA, pipelined: the script travels once
            self._script = ScriptBatcher(self._redis, LEASE_SCRIPT)
        self._replica_id = uuid.uuid4().hex  # names this replica's slots in Redis
        self._leases: dict[str, TenantLease] = {}  # tenants are bounded by the key file
        self._local = LocalCounters()
        self.headroom = Headroom()  # who may be checked while their request already runs
        self._redis_down_until = 0.0
        self._is_degraded = False
        self._calls: set[asyncio.Task[None]] = set()  # lease calls under way
        self._tending: asyncio.Task[None] | None = None
        if self._redis is None:
            logger.info("rate limits count in this gateway alone (no --redis-url)")

    async def close(self) -> None:
        """Gives back everything this replica leased, then closes the client."""
        if self._tending is not None:
            self._tending.cancel()
            with suppress(asyncio.CancelledError):
                await self._tending
        await self.drain()
        if self._redis is None:
            return
        if self._client() is not None:
            now = time.time()
            held = [lease for lease in self._leases.values() if lease.holds_anything]
            calls = [self._run(lease, lease.give_back_all_call(now)) for lease in held]
            await asyncio.gather(*calls)
        await self._redis.aclose()

    async def admit(self, tenant: str, request_id: str, ask: Ask) -> Admission:
        """Checks every limit `ask` names and, if all have room, charges them all and takes
        the slot (`request_id` names it): from this replica's lease, else in one call to
        Redis shared with the requests falling short at the same time, else (Redis away)
        this process's counters. Refused: nothing charged. An unlimited tenant costs nothing."""
        if ask.checks_nothing:
            return UNCHECKED
        admission = await self._admit(tenant, request_id, ask)
        _note_headroom(self.headroom, tenant, ask, admission)
        return admission

    async def _admit(self, tenant: str, request_id: str, ask: Ask) -> Admission:
        now = time.time()
        if self._redis is None:
            return self._local.admit(tenant, request_id, ask, now)
        lease = self._lease(tenant, ask)
        admission = lease.admit_locally(ask, now, time.monotonic())
        if admission is not None:
            return admission
        if self._client() is None:
            return self._local.admit(tenant, request_id, ask, now)
        loop = asyncio.get_running_loop()
        waiter = Waiter(ask, request_id, loop.create_future())
        lease.waiters.append(waiter)
        if not lease.is_calling:  # the first of this turn: call once the others joined
            lease.is_calling = True
            loop.call_soon(self._spawn, self._grant(lease))
        try:
            return await waiter.reply
        except asyncio.CancelledError:
            # Cancelled after its admission was set but before it resumed: nobody else
            # knows it holds a slot (`_answer` gives back only a cancelled waiter's).
            reply = waiter.reply
            if reply.done() and not reply.cancelled() and reply.result().holds_slot:
                self._release(tenant, request_id, reply.result().slot_in_redis)
            raise

    def _lease(self, tenant: str, ask: Ask) -> TenantLease:
        lease = self._leases.get(tenant)
        if lease is None:
            lease = self._leases[tenant] = TenantLease(tenant, self._replica_id)
        lease.learn_limits(ask)
        return lease

    async def _grant(self, lease: TenantLease) -> None:
        """One call for the requests waiting on `lease`; each hears its admission."""
        # A request cancelled while it waited (its client gone) is not charged for.
        waiters = [waiter for waiter in lease.waiters if not waiter.reply.cancelled()]
        lease.waiters = []
        now = time.time()
        call = lease.grant_call(waiters, now, time.monotonic())
        try:
            reply = await self._send(lease, call)
        except BaseException:
            for waiter in waiters:
                waiter.reply.cancel()
            raise
        try:
            if reply is None:  # Redis away: counted here alone
                for waiter in waiters:
                    fallback = self._local.admit(lease.tenant, waiter.request_id, waiter.ask, now)
                    self._answer(lease, waiter, fallback)
            else:
                asks = [waiter.ask for waiter in waiters]
                admissions = lease.finish_call(call, reply, asks, time.monotonic())
                for waiter, admission in zip(waiters, admissions, strict=True):
                    self._answer(lease, waiter, admission)
        finally:
            # Should the above fail, its requests fail rather than wait, and the tenant's
            # later requests are not left behind a call that never ends.
            for waiter in waiters:
                if not waiter.reply.done():
                    waiter.reply.cancel()
            lease.is_calling = False
            self._after_call(lease)

    def _answer(self, lease: TenantLease, waiter: Waiter, admission: Admission) -> None:
        if not waiter.reply.cancelled():
            waiter.reply.set_result(admission)
        elif admission.holds_slot:  # its caller is gone: nobody else will give it back
            self._release(lease.tenant, waiter.request_id, admission.slot_in_redis)

    def _after_call(self, lease: TenantLease) -> None:
        """The requests that arrived during a call: admitted from the fresh lease, else one
        more call; and the lease tended from now on."""
        waiting, lease.waiters = lease.waiters, []
        now, monotonic = time.time(), time.monotonic()
        for waiter in waiting:
            admission = lease.admit_locally(waiter.ask, now, monotonic)
            if admission is None:
                lease.waiters.append(waiter)
            else:
                self._answer(lease, waiter, admission)
        if lease.waiters:
            lease.is_calling = True
            self._spawn(self._grant(lease))
        elif lease.holds_anything and self._tending is None:
            self._tending = asyncio.get_running_loop().create_task(self._tend())

    async def _send(self, lease: TenantLease, call: LeaseCall) -> LeaseReply | None:
        """The script's reply; None when Redis failed or is resting after a failure (the
        lease's call marked failed)."""
        if self._client() is None:
            lease.call_failed()
            return None
        try:
            raw = await self._script.call(call.keys(), call.args())
        except redis.exceptions.RedisError as error:
            self._redis_failed(error)
            lease.call_failed()
            return None
        except BaseException:
            lease.call_failed()
            raise
        self._redis_ok()
        return LeaseReply.parse(raw)

    async def _run(self, lease: TenantLease, call: LeaseCall) -> None:
        """A call with no request waiting on it (giving back, renewing)."""
        reply = await self._send(lease, call)
        try:
            if reply is not None:
                lease.finish_call(call, reply, [], time.monotonic())
        finally:
            lease.is_calling = False
            self._after_call(lease)

    async def _tend(self) -> None:
        """Every TEND_S while a lease holds anything: what is due goes back or is renewed."""
        try:
            while any(lease.holds_anything for lease in self._leases.values()):
                await asyncio.sleep(TEND_S)
                if self._client() is None:
                    continue
                now, monotonic = time.time(), time.monotonic()
                leases = list(self._leases.values())
                calls = [(lease, lease.tend_call(now, monotonic)) for lease in leases]
                await asyncio.gather(*(self._run(lease, call) for lease, call in calls if call))
        finally:
            self._tending = None

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
        """Gives back a slot now: once this returns, a replica that finds the tenant at its
        limit has seen it (`leave_soon`: without waiting)."""
        self._release(tenant, request_id, in_redis)
        await self.drain()

    def leave_soon(self, tenant: str, request_id: str, in_redis: bool) -> None:
        """Gives back a slot: to this replica's lease, and from there to Redis in the
        background if the lease now holds more than it may keep. Needs a running loop."""
        self._release(tenant, request_id, in_redis)

    def _release(self, tenant: str, request_id: str, in_redis: bool) -> None:
        lease = self._leases.get(tenant)
        if not in_redis or lease is None:
            self._local.leave(tenant, request_id)
            return
        if lease.release():
            call = lease.tend_call(time.time(), time.monotonic())
            if call is not None:  # else the call under way settles the slots
                self._spawn(self._run(lease, call))

    async def drain(self) -> None:
        """Returns once the lease calls under way have answered (or Redis failed)."""
        while self._calls:
            await asyncio.gather(*map(asyncio.shield, list(self._calls)), return_exceptions=True)

    def _spawn(self, call) -> None:
        task = asyncio.get_running_loop().create_task(call)
        self._calls.add(task)  # the loop holds tasks weakly
        task.add_done_callback(self._calls.discard)

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
