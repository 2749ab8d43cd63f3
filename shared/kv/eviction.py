"""Which free block is evicted next, under a retention policy.

A request's cached blocks carry what it asked of them (`Retention`): a rank (higher ranks are
kept longer; lower ones are evicted first) that holds for a soft window after the block was
freed. When the window has run out the block counts as expired, whatever its rank, and goes
before every block still inside its window: retention decays to nothing instead of pinning
memory (a hard pin would strand blocks nobody returns to). A block shared by requests keeps the
most any of them asked (highest rank, longest window) until it is evicted.

Tenants (a request's `cache_salt`) may be held to a quota: the most cached free blocks one
tenant keeps in the pool. Blocks carry their tenant in their retention (a salted block is only
ever held by its tenant's requests), and a tenant over its quota loses its own blocks first.

Eviction order, as `FreeBlocks.pop` applies it:

1. blocks no hash can hit (fresh ones in id order; freed ones most recently freed first);
2. cached blocks of tenants over their quota, least recently freed first;
3. expired cached blocks, least recently freed first;
4. cached blocks by rank, lowest first, least recently freed first within a rank.

With every block at the default `Retention()` (rank 0, endless window) this is plain LRU: the
engine's "lru" policy. Each (rank, window) pair is one LRU queue, so every step is
O(blocks moved x pairs in use), never O(free blocks).
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from splitserve.engine.kv.block import Block, FreeBlockQueue


@dataclass(frozen=True, slots=True)
class Retention:
    rank: int = 0
    window_s: float = math.inf
    # The tenant whose cache salt the block's hash includes ("" for unsalted prompts, which
    # every tenant shares and no quota bounds).
    tenant: str = ""

    def merged(self, other: Retention | None) -> Retention:
        if other is None or other == self:
            return self
        return Retention(
            max(self.rank, other.rank), max(self.window_s, other.window_s), self.tenant
        )


KEEP_LRU = Retention()


def retention_for(
    policy: str,
    priority: int,
    idle_ttl_s: float,
    window_s: float | None = None,
    tenant: str = "",
) -> Retention:
    """What a request's blocks get under `policy`: lru ignores both; idle_ttl keeps blocks for
    the request's window (`window_s`, else idle_ttl_s); priority also ranks them by the
    request's priority (lower priority value = more important, as for scheduling). The tenant
    (its cache salt) goes with every policy, for quotas."""
    if policy == "lru":
        return Retention(tenant=tenant) if tenant else KEEP_LRU
    window = idle_ttl_s if window_s is None else window_s
    rank = -priority if policy == "priority" else 0
    return Retention(rank, window, tenant)


class FreeBlocks:
    """The free blocks of one pool, in eviction order (see the module docstring)."""

    def __init__(self, blocks: Iterable[Block], tenant_quota: int | None = None) -> None:
        """`tenant_quota`: the most cached free blocks one salted tenant keeps (None: no
        quota)."""
        self._uncached = FreeBlockQueue(blocks)
        self._classes: dict[Retention, FreeBlockQueue] = {}
        self._num_cached = 0
        self.tenant_quota = tenant_quota
        self._tenant_blocks: dict[str, int] = {}  # salted tenant -> its cached free blocks
        # Why the latest `pop` took its block: "uncached", "quota", "expired" or "capacity".
        self.last_pop_reason = "uncached"

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
        if retention.tenant:
            self._tenant_blocks[retention.tenant] = self._tenant_blocks.get(retention.tenant, 0) + 1

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
        tenant = block.free_class.tenant
        if tenant:
            self._tenant_blocks[tenant] -= 1
            if not self._tenant_blocks[tenant]:
                del self._tenant_blocks[tenant]
        block.free_class = None

    def pop(self, now: float) -> Block:
        if len(self._uncached):
            self.last_pop_reason = "uncached"
            return self._uncached.popleft()
        over_quota = self._over_quota()
        retention = _next_class(
            {key: queue.peek() for key, queue in self._classes.items()}, now, over_quota
        )
        block = self._classes[retention].peek()
        self.last_pop_reason = _reason(block, retention, now, over_quota)
        self.remove(block)
        return block

    def _over_quota(self, counts: dict[str, int] | None = None) -> frozenset[str]:
        """The tenants keeping more cached free blocks than the quota (in `counts`, default
        the queue's own)."""
        counts = self._tenant_blocks if counts is None else counts
        if self.tenant_quota is None or not counts:
            return frozenset()
        return frozenset(t for t, n in counts.items() if n > self.tenant_quota)

    def __iter__(self) -> Iterator[Block]:
        """The blocks in the order `pop` would take them now (O(n log n); tests, debugging)."""
        return iter(self.order(time.monotonic()))

    def order(self, now: float) -> list[Block]:
        """The blocks in the order successive `pop(now)` calls would take them."""
        queues = {key: list(queue) for key, queue in self._classes.items()}
        counts = dict(self._tenant_blocks)
        result = list(self._uncached)
        while queues:
            over = self._over_quota(counts)
            key = _next_class({k: blocks[0] for k, blocks in queues.items()}, now, over)
            result.append(queues[key].pop(0))
            if key.tenant:
                counts[key.tenant] -= 1
            if not queues[key]:
                del queues[key]
        return result


def _reason(block: Block, key: Retention, now: float, over_quota: frozenset[str]) -> str:
    if key.tenant in over_quota:
        return "quota"
    return "expired" if block.freed_at + key.window_s <= now else "capacity"


def _next_class(
    fronts: dict[Retention, Block], now: float, over_quota: frozenset[str] = frozenset()
) -> Retention:
    """The class whose front block goes next."""
    if over_quota:
        over = [(block.freed_at, key) for key, block in fronts.items() if key.tenant in over_quota]
        if over:
            return min(over, key=lambda item: item[0])[1]
    expired = [
        (block.freed_at, key) for key, block in fronts.items()
        if block.freed_at + key.window_s <= now
    ]
    if expired:
        return min(expired, key=lambda item: item[0])[1]
    return min(fronts, key=lambda key: (key.rank, fronts[key].freed_at))
