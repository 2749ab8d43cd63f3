"""The gateway's waiting room: a bounded FIFO per tenant and priority, served by strict
priority (vLLM's convention: a lower value first), then by weighted fair share between the
tenants of one priority.

Fair share is start-time fair queueing over virtual time: each tenant has a virtual clock that
advances by a served request's cost (prompt tokens plus max output tokens) over the tenant's
weight; the next request comes from the waiting tenant whose clock is furthest behind. A tenant
that was idle comes back at the virtual time, the clock the last served request started at:
ahead of a backlogged tenant by at most one request, never further, so idling banks no credit.
A flood from one tenant therefore only lengthens that tenant's own queue, and a tenant that
keeps under its share is served next whenever it asks.
"""

from __future__ import annotations

import itertools
import time
from collections import deque
from collections.abc import Callable, Collection
from dataclasses import dataclass, field


class QueueFull(Exception):
    """The tenant's queue at this priority holds its maximum already."""


@dataclass(eq=False)
class Waiter:
    """One queued request. `cost` is what serving it advances its tenant's clock by."""

    tenant: str
    priority: int
    cost: float
    enqueued_at: float = field(default_factory=time.monotonic)


@dataclass
class _Level:
    """The tenants' queues at one priority."""

    queues: dict[str, deque[Waiter]] = field(default_factory=dict)  # only non-empty ones
    clocks: dict[str, float] = field(default_factory=dict)  # tenant -> its virtual clock
    # The clock the last request served started at: where a tenant that was idle comes back.
    virtual_time: float = 0.0


class FairQueue:
    def __init__(
        self, max_per_tenant: int, weight_of: Callable[[str], float] | None = None
    ) -> None:
        self.max_per_tenant = max_per_tenant
        self._weight_of = weight_of or (lambda tenant: 1.0)
        self._levels: dict[int, _Level] = {}
        self._size = 0

    def __len__(self) -> int:
        return self._size

    def push(self, waiter: Waiter) -> None:
        """Queues `waiter` at the back of its tenant's queue; raises QueueFull."""
        level = self._levels.setdefault(waiter.priority, _Level())
        queue = level.queues.get(waiter.tenant)
        if queue is None:  # the tenant starts waiting: no further back than the last served
            clock = max(level.clocks.get(waiter.tenant, 0.0), level.virtual_time)
            level.clocks[waiter.tenant] = clock
            queue = level.queues[waiter.tenant] = deque()
        if len(queue) >= self.max_per_tenant:
            raise QueueFull()
        queue.append(waiter)
        self._size += 1

    def has_queued(self, tenant: str) -> bool:
        """Whether `tenant` has a request waiting here, at any priority."""
        return any(tenant in level.queues for level in self._levels.values())

    def peek(self, skip: Collection[str] = ()) -> Waiter | None:
        """The request `pop` would return, left in place."""
        level = self._first_level(skip)
        if level is None:
            return None
        return level.queues[self._next_tenant(level, skip)][0]

    def pop(self, skip: Collection[str] = ()) -> Waiter | None:
        """The next request to serve, or None if nothing waits; `skip`: tenants passed over
        this time (over their share of the rows)."""
        level = self._first_level(skip)
        if level is None:
            return None
        tenant = self._next_tenant(level, skip)
        waiter = level.queues[tenant].popleft()
        level.virtual_time = level.clocks[tenant]
        level.clocks[tenant] += waiter.cost / self._weight_of(tenant)
        self._drop_if_empty(level, tenant, waiter.priority)
        self._size -= 1
        return waiter

    def remove(self, waiter: Waiter) -> bool:
        """Takes a waiter out (its request was cancelled or timed out); False if not queued."""
        level = self._levels.get(waiter.priority)
        queue = level.queues.get(waiter.tenant) if level else None
        if level is None or queue is None or waiter not in queue:
            return False
        queue.remove(waiter)
        self._drop_if_empty(level, waiter.tenant, waiter.priority)
        self._size -= 1
        return True

    def ahead_of(self, waiter: Waiter, passed_over: Collection[str] = ()) -> int:
        """How many queued requests will be served before `waiter` if no other arrives: every
        one of a higher priority, and at its own the order `pop` would take, replayed on the
        tenants' clocks (each other tenant's requests while its clock, or at a tie its head's
        arrival, comes before `waiter`'s turn), none of those of `passed_over` (tenants over
        their share of the rows, which `pop` skips while `waiter`'s tenant is under its own).
        A tenant back from idling starts at the virtual time, ahead of a backlogged tenant
        whose last request was served: none of the backlog is ahead of its first request."""
        ahead = sum(
            len(queue)
            for priority, level in self._levels.items()
            if priority < waiter.priority
            for queue in level.queues.values()
        )
        level = self._levels.get(waiter.priority)
        if level is None:
            return ahead
        own = level.queues.get(waiter.tenant, deque())
        position = own.index(waiter) if waiter in own else len(own)
        turn = (self._turn_clock(level, waiter.tenant, own, position), waiter.enqueued_at)
        for tenant, queue in level.queues.items():
            if tenant != waiter.tenant and tenant not in passed_over:
                ahead += self._served_before(level, tenant, queue, turn)
        return ahead + position

    def _turn_clock(self, level: _Level, tenant: str, own: deque[Waiter], position: int) -> float:
        """`tenant`'s clock when its request at `position` reaches the head of its queue."""
        if tenant in level.queues:
            clock = level.clocks[tenant]
        else:  # not waiting yet: where `push` would start it
            clock = max(level.clocks.get(tenant, 0.0), level.virtual_time)
        served_first = sum(w.cost for w in itertools.islice(own, position))
        return clock + served_first / self._weight_of(tenant)

    def _served_before(
        self, level: _Level, tenant: str, queue: deque[Waiter], turn: tuple[float, float]
    ) -> int:
        """How many of `tenant`'s queued requests `pop` takes before a head whose (clock,
        arrival) is `turn`: `_next_tenant`'s order, the clock advancing as each is served."""
        clock, count = level.clocks[tenant], 0
        for waiter in queue:
            if (clock, waiter.enqueued_at) >= turn:
                break
            count += 1
            clock += waiter.cost / self._weight_of(tenant)
        return count

    def _first_level(self, skip: Collection[str]) -> _Level | None:
        for priority in sorted(self._levels):
            if any(tenant not in skip for tenant in self._levels[priority].queues):
                return self._levels[priority]
        return None

    def _next_tenant(self, level: _Level, skip: Collection[str]) -> str:
        # Ties go to the tenant whose head waited longest: FIFO between equals.
        return min(
            (tenant for tenant in level.queues if tenant not in skip),
            key=lambda t: (level.clocks[t], level.queues[t][0].enqueued_at),
        )

    def _drop_if_empty(self, level: _Level, tenant: str, priority: int) -> None:
        if not level.queues[tenant]:
            del level.queues[tenant]
        if not level.queues:  # nobody waits at this priority: clocks restart from 0 later
            del self._levels[priority]
