"""All KV blocks of one cache: allocation, reference counts, eviction, hash -> block.

A block is in exactly one of two states:

    allocated: ref_cnt > 0, not in the free queue
    free:      ref_cnt == 0, in the free queue (possibly still cached: it keeps its hash and
               can be revived by `touch` until `get_new_blocks` evicts it)

Which free block is evicted first follows the retention its holders asked for (LRU by
default; see shared/kv/eviction.py).

With caching on, the hash map and the blocks' `block_hash` fields are one bijection: a block
has a hash iff the map sends that hash to it. Every method is O(blocks it is handed), never
O(num_blocks), because the scheduler calls them every step. Not thread safe: the engine loop
owns the pool.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from splitserve.engine.kv.block import Block
from splitserve.engine.kv.block_hash import BlockHash
from splitserve.engine.kv.events import BlockRemoved, BlockStored, KVCacheEvent
from splitserve.engine.kv.eviction import KEEP_LRU, FreeBlocks, Retention


@dataclass(frozen=True, slots=True)
class EvictedBlock:
    """A cached block leaving the pool, handed to the eviction sink while its KV is still in
    the block (the block is reused only after the sink returns)."""

    block_id: int
    block_hash: BlockHash
    num_hits: int  # prefix-cache hits it served while cached
    retention: Retention


# Receives the cached blocks one `get_new_blocks` call evicts, before they are handed out:
# the offload tiers copy their KV out here (shared/kv/offload/).
EvictionSink = Callable[[list[EvictedBlock]], None]


class BlockPool:
    def __init__(
        self,
        num_blocks: int,
        enable_caching: bool = True,
        tenant_quota: int | None = None,
        eviction_sink: EvictionSink | None = None,
    ) -> None:
        """`tenant_quota`: the most cached free blocks one tenant (cache salt) keeps;
        `eviction_sink`: where evicted cached blocks go (None: they are simply dropped)."""
        if not isinstance(num_blocks, int) or num_blocks < 1:
            raise ValueError(f"num_blocks must be an int >= 1, got {num_blocks!r}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        # blocks[i].block_id == i; fresh blocks are handed out in id order.
        self.blocks = [Block(block_id) for block_id in range(num_blocks)]
        self.free_block_queue = FreeBlocks(self.blocks, tenant_quota)
        self._cached_blocks: dict[BlockHash, Block] = {}
        # Hashes cached with publish=False (a second layer group's, shared/kv/groups.py): in
        # the map like any other, in no event and no listing of what the pool holds.
        self._unpublished: set[BlockHash] = set()
        self._events: list[KVCacheEvent] = []
        self.eviction_sink = eviction_sink
        # (reason, retention rank) -> cached blocks evicted, for the pod's metrics; reason:
        # "quota" (its tenant kept more than its quota), "expired" (past its window) or
        # "capacity" (taken while still inside it).
        self.eviction_counts: Counter[tuple[str, int]] = Counter()

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_block_queue)

    @property
    def num_cached_blocks(self) -> int:
        """Blocks registered under a hash, allocated or free."""
        return len(self._cached_blocks)

    @property
    def usage(self) -> float:
        """Fraction of blocks held by requests (cached free blocks count as unused)."""
        return 1.0 - self.num_free_blocks / self.num_blocks

    def get_new_blocks(self, num_blocks: int, now: float | None = None) -> list[Block]:
        """Takes `num_blocks` blocks from the front of the eviction order (at `now`, default
        time.monotonic()), each with ref_cnt 1.

        A taken block that was still cached is evicted: its hash leaves the map, and one
        `BlockRemoved` event lists every hash this call evicted.
        """
        if not 0 <= num_blocks <= self.num_free_blocks:
            raise ValueError(
                f"num_blocks must be in [0, {self.num_free_blocks}] (the free blocks), "
                f"got {num_blocks}"
            )
        now = time.monotonic() if now is None else now
        blocks: list[Block] = []
        evicted: list[EvictedBlock] = []
        for _ in range(num_blocks):
            block = self.free_block_queue.pop(now)  # evicted before the next pop: its reason
            blocks.append(block)
            assert block.ref_cnt == 0, f"free block {block.block_id} has references"
            if block.block_hash is not None:
                evicted.append(self._evict(block))
            block.ref_cnt = 1
        if evicted:
            if self.eviction_sink is not None:
                self.eviction_sink(evicted)
            published = self._published([e.block_hash for e in evicted])
            if published:
                self._events.append(BlockRemoved(published))
        return blocks

    def touch(self, blocks: Iterable[Block]) -> None:
        """Adds a reference to each block (a prefix-cache hit); revives free ones."""
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_block_queue.remove(block)
            block.ref_cnt += 1
            block.num_hits += 1

    def free_blocks(
        self,
        blocks: Iterable[Block],
        retention: Retention = KEEP_LRU,
        now: float | None = None,
    ) -> None:
        """Drops a reference from each block, in the order given (evicted in that order), each
        block keeping the most `retention` any of its holders asked for.

        A block reaching ref_cnt 0 keeps its hash and goes to the back of its retention's
        queue, to be evicted last within it. A block without a hash is reused first instead:
        nothing can ever hit it, so reusing it first keeps every cached block alive longer.
        """
        queue = self.free_block_queue
        now = time.monotonic() if now is None else now
        for block in blocks:
            assert block.ref_cnt > 0, f"freeing block {block.block_id}, which is already free"
            block.ref_cnt -= 1
            if block.block_hash is not None:
                block.retention = retention.merged(block.retention)
            if block.ref_cnt:
                continue
            if block.block_hash is None:
                queue.push_uncached(block)
            else:
                queue.push_cached(block, now)

    def get_cached_block(self, block_hash: BlockHash) -> Block | None:
        return self._cached_blocks.get(block_hash)

    def cache_full_blocks(
        self,
        blocks: Sequence[Block],
        block_hashes: Sequence[BlockHash],
        parent_block_hash: BlockHash | None,
        token_ids: Sequence[int],
        block_size: int,
        publish: bool = True,
    ) -> None:
        """Registers blocks that just became full under their hashes (recording no event with
        `publish` False).

        `blocks[i]` holds `token_ids[i * block_size : (i + 1) * block_size]`, hashed
        `block_hashes[i]`; `parent_block_hash` precedes `block_hashes[0]` in the sequence (None
        for a sequence's first block). A hash another block already holds keeps that block:
        the new block stays unregistered and no event repeats the hash. Each run of newly
        registered blocks is one `BlockStored` event.
        """
        assert len(blocks) == len(block_hashes), "one hash per block"
        assert len(token_ids) == len(blocks) * block_size, "block_size tokens per block"
        if not self.enable_caching:
            return
        run_start = 0
        for index, (block, block_hash) in enumerate(zip(blocks, block_hashes)):
            assert block.block_hash is None, f"block {block.block_id} is already cached"
            if block_hash in self._cached_blocks:
                if publish:
                    self._record_stored(
                        block_hashes, run_start, index, parent_block_hash, token_ids, block_size
                    )
                run_start = index + 1
                continue
            block.block_hash = block_hash
            self._cached_blocks[block_hash] = block
        if not publish:
            self._unpublished.update(block.block_hash for block in blocks if block.block_hash)
            return
        self._record_stored(
            block_hashes, run_start, len(blocks), parent_block_hash, token_ids, block_size
        )

    def take_events(self) -> list[KVCacheEvent]:
        """Returns the events recorded since the last call, oldest first, and forgets them."""
        events, self._events = self._events, []
        return events

    def cached_block_hashes(self) -> list[BlockHash]:
        """Every hash the cache holds now (allocated or free): what an index rebuilt from
        scratch must list for this pool. O(num_cached_blocks): for rare resyncs, not steps."""
        if not self._unpublished:
            return list(self._cached_blocks)
        return [h for h in self._cached_blocks if h not in self._unpublished]

    def _published(self, hashes: list[BlockHash]) -> list[BlockHash]:
        """`hashes` less the unpublished ones, which leave the set (they are leaving the map)."""
        if not self._unpublished:
            return hashes
        published = [h for h in hashes if h not in self._unpublished]
        self._unpublished.difference_update(hashes)
        return published

    def reset_prefix_cache(self) -> bool:
        """Forgets every cached hash (e.g. after new weights); only when no block is in use.

        Returns False and changes nothing while any request holds blocks: their hashes would
        be registered again as they fill, mixing KV from before and after the reset.
        """
        if self.num_free_blocks != self.num_blocks:
            return False
        removed = self._published(list(self._cached_blocks))
        for block in self._cached_blocks.values():
            block.block_hash = None
            block.retention = None
            block.num_hits = 0
        self._cached_blocks.clear()
        if removed:
            self._events.append(BlockRemoved(removed))
        return True

    def _evict(self, block: Block) -> EvictedBlock:
        block_hash = block.block_hash
        assert block_hash is not None and self._cached_blocks.get(block_hash) is block, (
            f"hash map does not point to cached block {block.block_id}"
        )
        del self._cached_blocks[block_hash]
        retention = block.retention or KEEP_LRU
        self.eviction_counts[self.free_block_queue.last_pop_reason, retention.rank] += 1
        evicted = EvictedBlock(block.block_id, block_hash, block.num_hits, retention)
        block.block_hash = None
        block.retention = None
        block.num_hits = 0
        return evicted

    def _record_stored(
        self,
        block_hashes: Sequence[BlockHash],
        start: int,
        end: int,
        parent_block_hash: BlockHash | None,
        token_ids: Sequence[int],
        block_size: int,
    ) -> None:
        """One `BlockStored` for the registered run `block_hashes[start:end]`, if non-empty."""
        if start == end:
            return
        parent = block_hashes[start - 1] if start else parent_block_hash
        self._events.append(
            BlockStored(
                block_hashes=list(block_hashes[start:end]),
                parent_block_hash=parent,
                token_ids=list(token_ids[start * block_size : end * block_size]),
                block_size=block_size,
            )
        )
