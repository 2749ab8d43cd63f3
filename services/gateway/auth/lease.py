"""One gateway replica's lease on one tenant's limits: quota charged in Redis ahead of use,
admitted here without a round trip until it runs out.

    | charged in Redis by every replica                                   | room left |
    | admitted by the others | their unused leases | admitted here | left here |

A request is admitted here, on the event loop and with no I/O, when the lease covers all it
asks: one request and its tokens from this minute's leftovers, a free concurrent slot among
those this replica holds. Otherwise it waits for the next call (lease_script.py), which every
request that falls short in the same loop turn shares: the call gives the leftovers back,
admits each waiting request on its own, and leases spare quota sized to about LEASE_HORIZON_S
of this replica's recent use (never more than LEASE_FRACTION of what is left under a limit).
A finished request's slot stays held here for the next request, unless this replica then holds
more spare slots than LEASE_FRACTION of the free ones: then the excess goes back at once.

What goes back in the background (`tend_call`, every TEND_S): per-minute leftovers unused for
IDLE_S or whose minute has turned, spare slots beyond recent use; and held slots are renewed
before SLOT_LEASE_S. Nothing here touches Redis: the limiter (limits.py) sends the calls.
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
from dataclasses import dataclass, field

from splitserve.gateway.auth.lease_script import (
    LEASE_FRACTION,
    SLOT_LEASE_S,
    LeaseCall,
    LeaseReply,
    SlotAsk,
    TenantLimits,
    WaiterAsk,
)
from splitserve.gateway.auth.windows import Admission, Ask, admission, window_index

LEASE_HORIZON_S = 0.5  # a lease's spare is about this long of the replica's recent use
IDLE_S = 1.0  # per-minute leftovers unused this long go back
TEND_S = 0.5  # how often the background pass looks at the leases
RENEW_S = SLOT_LEASE_S / 3  # held slots are renewed this often, idle or not


class Recent:
    """What was used in the last LEASE_HORIZON_S, from two buckets of that length (as the
    sliding minute is from two windows)."""

    def __init__(self) -> None:
        self._start = 0.0  # time.monotonic() at the current bucket's start
        self._current = 0
        self._previous = 0

    def add(self, amount: int, now: float) -> None:
        self._roll(now)
        self._current += amount

    def amount(self, now: float) -> int:
        self._roll(now)
        weight = 1.0 - (now - self._start) / LEASE_HORIZON_S
        return math.ceil(self._current + self._previous * weight)

    def _roll(self, now: float) -> None:
        elapsed = now - self._start
        if elapsed >= 2 * LEASE_HORIZON_S:
            self._start, self._current, self._previous = now, 0, 0
        elif elapsed >= LEASE_HORIZON_S:
            self._start += LEASE_HORIZON_S
            self._current, self._previous = 0, self._current


@dataclass(slots=True)
class Waiter:
    """A request the lease could not cover, waiting for the next call."""

    ask: Ask
    request_id: str
    reply: asyncio.Future[Admission]


@dataclass
class TenantLease:
    """This replica's lease on one tenant. Only the limiter's event loop changes it; a call
    in flight (`is_calling`) has its fields as they were sent, so nothing is admitted here
    until its reply is in (`finish_call`)."""

    tenant: str
    replica_id: str
    limits: TenantLimits = field(default_factory=TenantLimits)
    window: int = -1  # the minute the per-minute leftovers are charged to
    requests_left: int = 0  # leased, not yet admitted
    tokens_left: int = 0
    # This replica's view of each window's count (its own leftovers not counted): as Redis had
    # it at the last call, plus what this replica admitted since. The headers come from it.
    requests_now_seen: int = 0
    requests_before_seen: int = 0
    tokens_now_seen: int = 0
    tokens_before_seen: int = 0
    num_slots_held: int = 0  # charged to this replica in Redis
    num_slots_in_use: int = 0  # by requests running here
    num_slots_elsewhere: int = 0  # held by the other replicas, at the last call
    last_used: float = 0.0  # time.monotonic() of the last admission
    renewed_at: float = 0.0  # time.monotonic() of the last call
    is_calling: bool = False  # a call is scheduled or in flight
    waiters: list[Waiter] = field(default_factory=list)
    recent_requests: Recent = field(default_factory=Recent)
    recent_tokens: Recent = field(default_factory=Recent)
    recent_slots: Recent = field(default_factory=Recent)

    @property
    def holds_anything(self) -> bool:
        return bool(self.requests_left or self.tokens_left or self.num_slots_held)

    def learn_limits(self, ask: Ask) -> None:
        """The limits `ask` names (a tenant's asks all carry the key file's values)."""
        limits = self.limits
        self.limits = TenantLimits(
            ask.requests_per_minute or limits.requests_per_minute,
            ask.tokens_per_minute or limits.tokens_per_minute,
            ask.concurrent_requests or limits.concurrent_requests,
        )

    def admit_locally(self, ask: Ask, now: float, monotonic: float) -> Admission | None:
        """Admitted from the lease and charged to it, or None: the lease falls short (or a
        call is under way) and the request must wait for a call."""
        if self.is_calling or self.waiters or not self._covers(ask, now):
            return None
        counts = (
            self.requests_now_seen,
            self.requests_before_seen,
            self.tokens_now_seen,
            self.tokens_before_seen,
        )
        num_running = self.num_slots_elsewhere + self.num_slots_in_use
        if ask.requests_per_minute is not None:
            self.requests_left -= 1
            self.requests_now_seen += 1
        if ask.tokens_per_minute is not None:
            self.tokens_left -= ask.num_tokens
            self.tokens_now_seen += ask.num_tokens
        self._note_use(ask, monotonic)
        return admission(ask, None, counts, now, True, num_running)

    def _covers(self, ask: Ask, now: float) -> bool:
        checks_window = ask.requests_per_minute is not None or ask.tokens_per_minute is not None
        if checks_window and self.window != window_index(now):
            return False  # the leftovers count in a minute that has turned
        if ask.requests_per_minute is not None and self.requests_left < 1:
            return False
        if ask.tokens_per_minute is not None and self.tokens_left < ask.num_tokens:
            return False
        free_slots = self.num_slots_held - self.num_slots_in_use
        return ask.concurrent_requests is None or free_slots >= 1

    def _note_use(self, ask: Ask, monotonic: float) -> None:
        self.last_used = monotonic
        if ask.requests_per_minute is not None:
            self.recent_requests.add(1, monotonic)
        if ask.tokens_per_minute is not None:
            self.recent_tokens.add(ask.num_tokens, monotonic)
        if ask.concurrent_requests is not None and ask.takes_slot:
            self.num_slots_in_use += 1
            self.recent_slots.add(1, monotonic)

    def grant_call(self, waiters: list[Waiter], now: float, monotonic: float) -> LeaseCall:
        """The call for `waiters`: every leftover given back, and as spare about what this
        replica used in the last LEASE_HORIZON_S, these requests included."""
        asks = tuple(_waiter_ask(waiter.ask) for waiter in waiters)
        num_requests = sum(ask.asks_request for ask in asks)
        num_tokens = sum(ask.num_tokens or 0 for ask in asks)
        num_slots = sum(ask.slot == SlotAsk.TAKE for ask in asks)
        recent_slots = self.recent_slots.amount(monotonic) + num_slots
        return self._call(
            now,
            returns_per_minute=True,
            spare_requests=self.recent_requests.amount(monotonic) + num_requests,
            spare_tokens=self.recent_tokens.amount(monotonic) + num_tokens,
            spare_slots=min(recent_slots, self.num_slots_in_use + num_slots),  # doubles at most
            waiters=asks,
        )

    def tend_call(self, now: float, monotonic: float) -> LeaseCall | None:
        """A call giving back what this replica holds and has not needed lately, renewing
        its slots; None when nothing is due (or a call is under way)."""
        if self.is_calling or self.waiters:
            return None
        has_leftovers = bool(self.requests_left or self.tokens_left)
        is_idle = monotonic - self.last_used >= IDLE_S
        returns = has_leftovers and (is_idle or self.window != window_index(now))
        spare_slots = min(self.spare_slots_allowed(), self.recent_slots.amount(monotonic))
        trims = self.num_slots_held > self.num_slots_in_use + spare_slots
        renews = self.num_slots_held > 0 and monotonic - self.renewed_at >= RENEW_S
        if not (returns or trims or renews):
            return None
        return self._call(now, returns, 0, 0, spare_slots)

    def give_back_all_call(self, now: float) -> LeaseCall:
        """The call a closing replica makes: every leftover and every slot given back."""
        return dataclasses.replace(self._call(now, True, 0, 0, 0), num_slots_in_use=0)

    def _call(
        self,
        now: float,
        returns_per_minute: bool,
        spare_requests: int,
        spare_tokens: int,
        spare_slots: int,
        waiters: tuple[WaiterAsk, ...] = (),
    ) -> LeaseCall:
        """The call, and the lease marked as calling; the leftovers returned leave it."""
        index = window_index(now)
        returned_requests = returned_tokens = 0
        if returns_per_minute:
            if self.window in (index, index - 1):  # older windows no longer count
                returned_requests, returned_tokens = self.requests_left, self.tokens_left
            self.requests_left = self.tokens_left = 0
        self.is_calling = True
        return LeaseCall(
            self.tenant,
            self.replica_id,
            now,
            self.limits,
            returned_requests,
            returned_tokens,
            self.window == index - 1,
            self.num_slots_in_use,
            spare_requests if self.limits.requests_per_minute else 0,
            spare_tokens if self.limits.tokens_per_minute else 0,
            spare_slots if self.limits.concurrent_requests else 0,
            waiters,
        )

    def finish_call(
        self, call: LeaseCall, reply: LeaseReply, asks: list[Ask], monotonic: float
    ) -> list[Admission]:
        """The lease as Redis left it, and each waiting request's admission (in `asks`'
        order, as the call sent them)."""
        requests_now, tokens_now = reply.requests_now, reply.tokens_now
        num_admitted_slots = 0
        admissions = []
        for ask, verdict in zip(asks, reply.verdicts, strict=True):
            counts = (requests_now, reply.requests_before, tokens_now, reply.tokens_before)
            num_running = reply.num_slots_elsewhere + call.num_slots_in_use + num_admitted_slots
            admissions.append(admission(ask, verdict, counts, call.now, True, num_running))
            if verdict is None:
                requests_now += 1 if ask.requests_per_minute is not None else 0
                tokens_now += ask.num_tokens if ask.tokens_per_minute is not None else 0
                num_admitted_slots += 1 if _takes_slot(ask) else 0
                self._note_use(ask, monotonic)
        self._settle(call, reply, requests_now, tokens_now, monotonic)
        return admissions

    def _settle(
        self,
        call: LeaseCall,
        reply: LeaseReply,
        requests_now: int,
        tokens_now: int,
        monotonic: float,
    ) -> None:
        # Leftovers a tend call kept are in Redis's counts: the view leaves them out.
        self.requests_now_seen = requests_now - self.requests_left
        self.tokens_now_seen = tokens_now - self.tokens_left
        self.requests_before_seen = reply.requests_before
        self.tokens_before_seen = reply.tokens_before
        self.window = window_index(call.now)
        self.requests_left += reply.spare_requests
        self.tokens_left += reply.spare_tokens
        if self.limits.concurrent_requests:
            self.num_slots_held = reply.num_slots_held
            self.num_slots_elsewhere = reply.num_slots_elsewhere
        self.renewed_at = monotonic
        self.is_calling = False

    def call_failed(self) -> None:
        """The call's outcome is unknown (Redis unreachable, or its reply lost): the
        leftovers it carried stay charged there (stricter, never looser). Slots: the call may
        have run and set this replica's count in Redis as low as the slots in use when it was
        sent (a trim), so only those in use are counted held (never more than Redis has), and
        the next tend renews, which writes the count again."""
        self.num_slots_held = min(self.num_slots_held, self.num_slots_in_use)
        self.renewed_at = -math.inf
        self.is_calling = False

    def release(self) -> bool:
        """A slot of this lease given back by its request; True when this replica now holds
        more spare slots than it may keep (`tend_call` gives them back)."""
        # At zero already: its replica gave every slot back as it closed.
        self.num_slots_in_use = max(0, self.num_slots_in_use - 1)
        return self.num_slots_held - self.num_slots_in_use > self.spare_slots_allowed()

    def spare_slots_allowed(self) -> int:
        """Slots this replica may hold beyond those in use: LEASE_FRACTION of the free ones
        (none as the tenant nears its limit, so another replica's next request finds it)."""
        limit = self.limits.concurrent_requests
        num_free = limit - self.num_slots_elsewhere - self.num_slots_in_use
        return max(0, math.floor(LEASE_FRACTION * num_free))


def _takes_slot(ask: Ask) -> bool:
    return ask.concurrent_requests is not None and ask.takes_slot


def _waiter_ask(ask: Ask) -> WaiterAsk:
    slot = SlotAsk.NONE
    if ask.concurrent_requests is not None:
        slot = SlotAsk.TAKE if ask.takes_slot else SlotAsk.CHECK
    num_tokens = ask.num_tokens if ask.tokens_per_minute is not None else None
    return WaiterAsk(ask.requests_per_minute is not None, num_tokens, slot)
