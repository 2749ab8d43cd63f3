"""Which free block is evicted next, under a retention policy.

A request's cached blocks carry what it asked of them (`Retention`): a rank (higher ranks are
kept longer; lower ones are evicted first) that holds for a soft window after the block was
freed. When the window has run out the block counts as expired, whatever its rank, and goes
before every block still inside its window: retention decays to nothing instead of pinning
memory (a hard pin would strand blocks nobody returns to). A block shared by requests keeps the
most any of them asked (highest rank, longest window) until it is evicted.

Eviction order, as `FreeBlocks.pop` applies it:

1. blocks no hash can hit (fresh ones in id order; freed ones most recently freed first);
2. expired cached blocks, least recently freed first;
3. cached blocks by rank, lowest first, least recently freed first within a rank.

With every block at the default `Retention()` (rank 0, endless window) this is plain LRU: the
engine's "lru" policy. Each (rank, window) pair is one LRU queue, so every step is
O(blocks moved x pairs in use), never O(free blocks).
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from shared.kv.block import Block, FreeBlockQueue


@dataclass(frozen=True, slots=True)
class Retention:
    rank: int = 0
    window_s: float = math.inf

    def merged(self, other: Retention | None) -> Retention:
        if other is None or other == self:
            return self
        return Retention(max(self.rank, other.rank), max(self.window_s, other.window_s))


KEEP_LRU = Retention()


def retention_for(
    policy: str, priority: int, idle_ttl_s: float, window_s: float | None = None
) -> Retention:
    """What a request's blocks get under `policy`: lru ignores both; idle_ttl keeps blocks for
    the request's window (`window_s`, else idle_ttl_s); priority also ranks them by the
    request's priority (lower priority value = more important, as for scheduling)."""
    if policy == "lru":
        return KEEP_LRU
    window = idle_ttl_s if window_s is None else window_s
    rank = -priority if policy == "priority" else 0
    return Retention(rank, window)


class FreeBlocks:
    """The free blocks of one pool, in eviction order (see the module docstring)."""

    def __init__(self, blocks: Iterable[Block]) -> None:
        self._uncached = FreeBlockQueue(blocks)
        self._classes: dict[Retention, FreeBlockQueue] = {}
        self._num_cached = 0

    def __len__(self) -> int:
        return len(self._uncached) + self._num_cached

    def __contains__(self, block: Block) -> bool:
        return block.prev_free is not None

    def push_uncached(self, block: Block) -> None:
        """A block no hash points to: reused before any cached block."""
        block.free_class = None
        self._uncached.appendleft(block)

    def push_cached(self, block: Block, now: float) -> None:
        retention = block.retention or KEEP_LRU
        block.free_class, block.freed_at = retention, now
        queue = self._classes.get(retention)
        if queue is None:
            queue = self._classes[retention] = FreeBlockQueue()
        queue.append(block)
        self._num_cached += 1

    def remove(self, block: Block) -> None:
        """Takes a free block out (a prefix-cache hit revives it)."""
        if block.free_class is None:
            self._uncached.remove(block)
            return
        queue = self._classes[block.free_class]
        queue.remove(block)
        self._num_cached -= 1
        if not len(queue):
            del self._classes[block.free_class]
        block.free_class = None

    def pop(self, now: float) -> Block:
        if len(self._uncached):
            return self._uncached.popleft()
        retention = _next_class(
            {key: queue.peek() for key, queue in self._classes.items()}, now
        )
        block = self._classes[retention].peek()
        self.remove(block)
        return block

    def __iter__(self) -> Iterator[Block]:
        """The blocks in the order `pop` would take them now (O(n log n); tests, debugging)."""
        return iter(self.order(time.monotonic()))

    def order(self, now: float) -> list[Block]:
        """The blocks in the order successive `pop(now)` calls would take them."""
        queues = {key: list(queue) for key, queue in self._classes.items()}
        result = list(self._uncached)
        while queues:
            key = _next_class({k: blocks[0] for k, blocks in queues.items()}, now)
            result.append(queues[key].pop(0))
            if not queues[key]:
                del queues[key]
        return result


def _next_class(fronts: dict[Retention, Block], now: float) -> Retention:
    """The class whose front block goes next."""
    expired = [
        (block.freed_at, key) for key, block in fronts.items()
        if block.freed_at + key.window_s <= now
    ]
    if expired:
        return min(expired, key=lambda item: item[0])[1]
    return min(fronts, key=lambda key: (key.rank, fronts[key].freed_at))
