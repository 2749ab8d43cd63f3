"""When a decode pod refuses a request instead of queueing it (`OverloadBound`, `refusal`).

A request that can start at once is always taken. One that would have to wait (others are
queued ahead of it, the running batch is full, or its blocks would leave the running streams
no room to grow, so they would be preempted to make room) queues only while fewer than
`--max-waiting-requests` requests wait here; past that the pod answers RESOURCE_EXHAUSTED at
once, before any work (no block reserved, no prefill asked for), and the gateway routes the
request to another pod (services/gateway/generation.py) or tells the client to come back.

The rule reads the engine's stats snapshot (taken after every step, so at most a step old),
plus the calls this pod took that the snapshot does not show yet: a burst arriving between two
steps is bounded too. Torch-free.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from splitserve.engine.core import EngineStats


@dataclass(frozen=True)
class OverloadBound:
    # Requests that may wait here for blocks or a batch slot before new ones that would wait
    # too are refused (0: no bound, every request queues, as before the bound existed).
    max_waiting_requests: int = 0

    def __post_init__(self) -> None:
        if self.max_waiting_requests < 0:
            raise ValueError(
                f"--max-waiting-requests must be >= 0, got {self.max_waiting_requests}"
            )


@dataclass(frozen=True)
class PodRoom:
    """What the engine's snapshot says about room for one more request."""

    stats: EngineStats
    num_unseen: int  # calls taken here that the snapshot does not show yet
    block_size: int
    max_num_seqs: int
    # Blocks a position's block takes in the pool: one per layer group (shared/kv/groups.py).
    kv_groups: int = 1

    @property
    def num_waiting(self) -> int:
        return self.stats.num_waiting_for_admission + self.num_unseen

    def why_it_would_wait(self, num_tokens: int) -> str | None:
        """Why a request of `num_tokens` (prompt and resumed output) could not start at once,
        or None when it could."""
        stats = self.stats
        if stats.num_waiting_for_admission:
            return f"{stats.num_waiting_for_admission} requests are queued ahead of it"
        if stats.num_running >= self.max_num_seqs:
            return f"the running batch is full ({self.max_num_seqs} requests)"
        num_blocks = -(-num_tokens // self.block_size) * self.kv_groups
        # A running request needs at most one new block a step (in each group): keep that
        # many each, or admitting this one would preempt a running stream on its next token.
        room = stats.num_kv_blocks_free - stats.num_running * self.kv_groups
        if num_blocks > room:
            return (
                f"its {num_blocks} KV blocks exceed the {max(room, 0)} free blocks left beside "
                f"{stats.num_running} running requests"
            )
        return None


def refusal(bound: OverloadBound, room: PodRoom, num_tokens: int) -> str | None:
    """Why a request of `num_tokens` must be refused now, or None to take it."""
    limit = bound.max_waiting_requests
    if limit == 0 or room.num_waiting < limit:
        return None
    reason = room.why_it_would_wait(num_tokens)
    if reason is None:
        return None
    return (
        f"decode pod overloaded: {room.num_waiting} requests already wait here "
        f"(--max-waiting-requests {limit}) and this one would wait too: {reason}"
    )


def add_overload_flags(group: argparse._ArgumentGroup) -> None:
    group.add_argument(
        "--max-waiting-requests",
        type=int,
        default=OverloadBound().max_waiting_requests,
        metavar="N",
        help="refuse (RESOURCE_EXHAUSTED, before any work) a request that could not start at "
        "once while N requests already wait here for KV blocks or a batch slot; the gateway "
        "routes it elsewhere (0 = no bound: every request queues)",
    )


def overload_bound(args: argparse.Namespace) -> OverloadBound:
    return OverloadBound(args.max_waiting_requests)
