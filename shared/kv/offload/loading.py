"""One request's cached blocks coming back from the lower tiers: the contract between the
scheduler (which starts a load at admission and schedules the request once it is in) and the
offloader's load thread (which copies the blocks into the pool). Torch-free.

Cancellation is safe at any moment: the load thread copies each block under `lock` after
checking `cancelled`, so once `finish` returns, nothing writes into the request's blocks any
more, and the blocks it did not load are simply computed again.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from dataclasses import dataclass

from splitserve.engine.kv.block_hash import BlockHash
from splitserve.engine.kv.tiers import Tier


@dataclass(frozen=True, slots=True)
class LoadItem:
    block_hash: BlockHash
    block_id: int  # the pool block it is copied into (allocated to the request)
    tier: Tier  # where the lookup found it


class LoadJob:
    def __init__(self, request_id: str, items: list[LoadItem], timeout_s: float) -> None:
        self.request_id = request_id
        self.items = items
        self.started_at = time.monotonic()
        self.deadline = self.started_at + timeout_s
        self.lock = threading.Lock()
        self.cancelled = False
        # Written by the load thread under `lock`; read after `finish`.
        self.num_loaded = 0
        self.loaded_by_tier: Counter[Tier] = Counter()
        self.finished_at: float | None = None
        self._done = threading.Event()

    @property
    def is_done(self) -> bool:
        return self._done.is_set()

    def is_due(self, now: float) -> bool:
        """Whether the scheduler should take it now: loaded, or past its deadline."""
        return self.is_done or now >= self.deadline

    def wait(self, timeout_s: float) -> bool:
        return self._done.wait(timeout_s)

    def finish(self) -> int:
        """Stops the load where it stands (a no-op once done); the leading blocks loaded."""
        with self.lock:
            self.cancelled = True
            return self.num_loaded

    # ---- the load thread's side -----------------------------------------------------------

    def record_loaded(self, tier: Tier) -> None:
        """Called under `lock` after a block's copy landed."""
        self.num_loaded += 1
        self.loaded_by_tier[tier] += 1

    def mark_done(self) -> None:
        self.finished_at = time.monotonic()
        self._done.set()
