"""What a request asks of its tenant's limits and what a check found: the per-minute windows'
arithmetic and the admission the gate turns into headers, whichever store counted.

The per-minute limits are sliding windows approximated from two fixed one-minute windows (as
Cloudflare's and nginx's limiters do): what a tenant used is `current + previous * (1 -
elapsed / 60)`, so a burst at a window's edge is not allowed twice.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

WINDOW_S = 60.0


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
    slot_in_redis: bool  # where the slot is (or the counts were) kept: a lease from Redis
    num_running: int = 0  # the tenant's concurrent requests found, before this one


UNCHECKED = Admission(None, 0.0, None, None, holds_slot=False, slot_in_redis=False)


def window_index(now: float) -> int:
    """The fixed one-minute window `now` (time.time()) falls in."""
    return int(now // WINDOW_S)


def previous_weight(now: float) -> float:
    """How much of the previous window still counts at `now`."""
    return 1.0 - (now % WINDOW_S) / WINDOW_S


def window_use(limit: int, cur: float, prev: float, amount: int, now: float) -> WindowUse:
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


def admission(
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
        requests = window_use(ask.requests_per_minute, counts[0], counts[1], 1, now)
    if ask.tokens_per_minute is not None:
        tokens = window_use(ask.tokens_per_minute, counts[2], counts[3], ask.num_tokens, now)
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
