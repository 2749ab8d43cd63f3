"""Which tenants had room under their limits at their last check on this gateway replica.

A generation request of such a tenant has its limits checked while it is already routed and
prefilled (core.py: the check's round trip to Redis is off the path to its first token; a
refusal then aborts the pods' work and answers 429 before any byte went out). A tenant near
or over a limit, or not checked in the last FRESH_S, is checked before anything is sent, so
a tenant hammering past its limits costs the pods nothing.

What "room" means: after its last check, at least ROOM_FRACTION of each limit was left, for
the tokens after this request's own. With several replicas the others' use since then is
unknown; FRESH_S bounds how stale the view may be, and the check itself still decides.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

ROOM_FRACTION = 0.1
FRESH_S = 10.0


@dataclass(frozen=True, slots=True)
class _Room:
    checked_at: float  # time.monotonic()
    fraction_left: float  # of requests per minute and concurrent requests, the smaller
    tokens_left: float | None  # None: tokens per minute unlimited
    tokens_limit: int


class Headroom:
    """Fed by every admission (`note`), asked before a generation request is sent."""

    def __init__(self) -> None:
        self._rooms: dict[str, _Room] = {}  # tenants are bounded by the key file

    def note(
        self,
        tenant: str,
        refused: bool,
        fractions_left: list[float],
        tokens_left: float | None,
        tokens_limit: int,
    ) -> None:
        """What an admission found: refused, or each checked limit's fraction left after it
        (requests, concurrent requests) and the tokens left."""
        if refused:
            self._rooms.pop(tenant, None)
            return
        fraction = min(fractions_left, default=1.0)
        self._rooms[tenant] = _Room(time.monotonic(), fraction, tokens_left, tokens_limit)

    def has_room(self, tenant: str, num_tokens: int) -> bool:
        """The tenant had room for `num_tokens` more at a check within FRESH_S."""
        room = self._rooms.get(tenant)
        if room is None or time.monotonic() - room.checked_at > FRESH_S:
            return False
        if room.fraction_left < ROOM_FRACTION:
            return False
        if room.tokens_left is None:
            return True
        return room.tokens_left - num_tokens >= ROOM_FRACTION * room.tokens_limit
