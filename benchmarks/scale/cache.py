"""A simulated pod's prefix cache: block hashes in LRU order, with the events an engine's block
pool would record, for the real `RegistryPublisher` to publish (it calls `take_kv_events` and
`snapshot_cached_blocks`, exactly the two `AsyncLLM` methods it uses)."""

from __future__ import annotations

import collections
from collections.abc import Sequence

from splitserve.engine.kv.block_hash import BlockHash
from splitserve.engine.kv.events import BlockRemoved, BlockStored, KVCacheEvent
from splitserve.engine.kv.tiers import Tier


class SimCache:
    """Device-tier blocks only. Owned by one event loop; no locking.

    Order: least recently used first. A chain is touched tail first, so its parents are more
    recent than its tail and eviction takes tails before parents, as the engine's free queue
    does: what a pod holds of any chain stays a prefix of it."""

    def __init__(self, capacity_blocks: int, block_size: int = 16) -> None:
        if capacity_blocks < 1:
            raise ValueError("capacity_blocks must be >= 1")
        self.capacity_blocks = capacity_blocks
        self.block_size = block_size
        self._blocks: collections.OrderedDict[BlockHash, None] = collections.OrderedDict()
        self._events: list[KVCacheEvent] = []
        self.num_stored = 0  # blocks ever stored (new to the cache), for the event rate
        self.num_removed = 0

    def __len__(self) -> int:
        return len(self._blocks)

    def __contains__(self, block_hash: BlockHash) -> bool:
        return block_hash in self._blocks

    def cached_prefix(self, hashes: Sequence[BlockHash]) -> int:
        """How many leading `hashes` the cache holds."""
        for index, block_hash in enumerate(hashes):
            if block_hash not in self._blocks:
                return index
        return len(hashes)

    def store(self, hashes: Sequence[BlockHash]) -> None:
        """A prompt's chain was computed here: keep it, most recent, evicting LRU tails."""
        new = [h for h in hashes if h not in self._blocks]
        for block_hash in reversed(hashes):
            self._blocks[block_hash] = None
            self._blocks.move_to_end(block_hash)
        if new:
            self._events.append(BlockStored(list(new), None, [], self.block_size))
            self.num_stored += len(new)
        self._evict_over_capacity(set(hashes))

    def _evict_over_capacity(self, keep: set[BlockHash]) -> None:
        evicted: list[BlockHash] = []
        while len(self._blocks) > self.capacity_blocks:
            block_hash = next(iter(self._blocks))
            if block_hash in keep and len(keep) >= self.capacity_blocks:
                break  # a prompt larger than the cache keeps what it can
            del self._blocks[block_hash]
            evicted.append(block_hash)
        if evicted:
            self._events.append(BlockRemoved(evicted))
            self.num_removed += len(evicted)

    # ---- what RegistryPublisher calls (AsyncLLM's interface) ---------------------------------

    def take_kv_events(self) -> list[KVCacheEvent]:
        events, self._events = self._events, []
        return events

    async def snapshot_cached_blocks(self) -> dict[Tier, list[BlockHash]]:
        self._events = []  # the snapshot covers them, as the engine's does
        return {Tier.DEVICE: list(self._blocks)}
