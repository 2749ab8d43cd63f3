"""The KV cache API of a model whose layers mix windows and full attention: one
`KVCacheManager` per layer group (shared/kv/groups.py), all drawing from one block pool.

The scheduler and the engine talk to it as to a `KVCacheManager`: a request is admitted,
grows and is freed in every group at once, and a step either gets blocks in all of them or in
none. A prefix hit counts only as far as every group still holds it: the full-attention groups
every block of the prefix, a window group the blocks its layers read from the first position
after it (`KVCacheManager.num_unread_blocks`). Group 0's blocks are the request's `block_ids`,
the ones the prefix index hears about; the other groups' tables travel beside them
(`get_group_block_ids`), and a page transfer moves every group's blocks in group order
(`page_block_ids`).
"""

from __future__ import annotations

from dataclasses import dataclass

from splitserve.engine.config import CacheConfig
from splitserve.engine.kv.block import Block
from splitserve.engine.kv.block_hash import BlockHash
from splitserve.engine.kv.block_pool import BlockPool
from splitserve.engine.kv.events import KVCacheEvent
from splitserve.engine.kv.groups import KVGroups
from splitserve.engine.kv.manager import (
    NO_COMPUTED_BLOCKS,
    ComputedBlocks,
    KVCacheManager,
    PrefixCacheStats,
    Request,
)


@dataclass(frozen=True, slots=True)
class GroupedComputedBlocks(ComputedBlocks):
    """Group 0's hit (the fields it inherits) and each later group's part of it, in order."""

    group_hits: tuple[ComputedBlocks, ...] = ()


class GroupedKVManager:
    def __init__(
        self,
        groups: KVGroups,
        num_blocks: int,
        block_size: int,
        enable_caching: bool = True,
        hash_namespace: str = CacheConfig.hash_namespace,
        tenant_quota: int | None = None,
    ) -> None:
        pool = BlockPool(num_blocks, enable_caching, tenant_quota)
        self.groups = groups
        self.managers = [
            KVCacheManager(
                num_blocks,
                block_size,
                enable_caching,
                hash_namespace,
                sliding_window=window,
                block_pool=pool,
                hash_salt=f"group{index}".encode() if index else b"",
            )
            for index, window in enumerate(groups.group_windows)
        ]
        self.block_size = block_size
        self.block_pool = pool
        self.enable_caching = enable_caching
        self.lower_tiers = None

    @classmethod
    def from_config(
        cls, groups: KVGroups, cache_config: CacheConfig, num_blocks: int
    ) -> GroupedKVManager:
        return cls(
            groups,
            num_blocks,
            cache_config.block_size,
            enable_caching=cache_config.enable_prefix_caching,
            hash_namespace=cache_config.hash_namespace,
            tenant_quota=cache_config.tenant_quota_blocks(num_blocks),
        )

    @property
    def _first(self) -> KVCacheManager:
        return self.managers[0]

    @property
    def num_blocks(self) -> int:
        return self.block_pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.block_pool.num_free_blocks

    @property
    def usage(self) -> float:
        return self.block_pool.usage

    @property
    def prefix_cache_stats(self) -> PrefixCacheStats:
        return self._first.prefix_cache_stats

    @property
    def num_groups(self) -> int:
        """Blocks a position's block takes: one in each group."""
        return len(self.managers)

    def get_computed_blocks(self, request: Request) -> ComputedBlocks:
        """The longest prefix hit every group still holds (module docstring). A request whose
        pages will be exported takes whole hits in the window groups too: its pages go to a
        decode pod, which caches every block it receives."""
        first = self._first.get_computed_blocks(request)
        if not first.blocks:
            return NO_COMPUTED_BLOCKS
        exporting = getattr(request, "export_kv_from_block", None) is not None
        others = self.managers[1:]
        found = [manager.lookup_blocks(request, len(first.blocks)) for manager in others]
        last_missing = [_last_missing(blocks) for blocks in found]
        for num_blocks in range(len(first.blocks), 0, -1):
            hits = []
            for manager, blocks, missing in zip(others, found, last_missing):
                skipped = 0 if exporting else manager.num_unread_blocks(num_blocks)
                if missing[num_blocks - 1] >= skipped:
                    break
                held = tuple(block for block in blocks[skipped:num_blocks] if block is not None)
                hits.append(ComputedBlocks(held, num_blocks * self.block_size, (), (), skipped))
            else:
                return GroupedComputedBlocks(
                    first.blocks[:num_blocks], num_blocks * self.block_size, group_hits=tuple(hits)
                )
        return NO_COMPUTED_BLOCKS

    def can_allocate(
        self, request: Request, num_new_tokens: int, computed: ComputedBlocks | None = None
    ) -> bool:
        return self._num_free_needed(request, num_new_tokens, self._parts(computed)) is not None

    def allocate_slots(
        self, request: Request, num_new_tokens: int, computed: ComputedBlocks | None = None
    ) -> bool:
        """Every group's slots, or none. Every group's hit is taken before any group takes new
        blocks: a new block is the oldest free one, which may be another group's hit."""
        parts = self._parts(computed)
        new_blocks = self._num_free_needed(request, num_new_tokens, parts)
        if new_blocks is None:
            return False
        for manager, part in zip(self.managers, parts):
            manager.take_hit(request, part)
        for manager, num_blocks in zip(self.managers, new_blocks):
            manager.take_new_blocks(request, num_blocks)
        return True

    def _num_free_needed(
        self, request: Request, num_new_tokens: int, parts: list[ComputedBlocks]
    ) -> list[int] | None:
        """Each group's new blocks, or None when they and the hits revived from the free queue
        do not fit in the free blocks together."""
        new_blocks = [
            manager.num_new_blocks(request, num_new_tokens, part)
            for manager, part in zip(self.managers, parts)
        ]
        revived = sum(1 for part in parts for block in part.blocks if block.ref_cnt == 0)
        if sum(new_blocks) + revived > self.block_pool.num_free_blocks:
            return None
        return new_blocks

    def cache_blocks(self, request: Request, num_computed_tokens: int) -> None:
        for manager in self.managers:
            manager.cache_blocks(request, num_computed_tokens)

    def free(self, request: Request) -> None:
        for manager in self.managers:
            manager.free(request)

    def release_out_of_window(self, request: Request, num_settled_tokens: int) -> int:
        return sum(
            manager.release_out_of_window(request, num_settled_tokens) for manager in self.managers
        )

    def num_held_blocks(self, request_id: str) -> int:
        return sum(manager.num_held_blocks(request_id) for manager in self.managers)

    def held_blocks_by_group(self, request_id: str) -> list[int]:
        return [manager.num_held_blocks(request_id) for manager in self.managers]

    def get_block_ids(self, request_id: str) -> list[int]:
        return self._first.get_block_ids(request_id)

    def get_group_block_ids(self, request_id: str) -> tuple[list[int], ...]:
        return tuple(manager.get_block_ids(request_id) for manager in self.managers[1:])

    def page_block_ids(self, request_id: str, first_block: int) -> list[int]:
        return [
            block_id
            for manager in self.managers
            for block_id in manager.get_block_ids(request_id)[first_block:]
        ]

    def take_events(self) -> list[KVCacheEvent]:
        return self.block_pool.take_events()

    def cached_block_hashes(self) -> list[BlockHash]:
        return self.block_pool.cached_block_hashes()

    def reset_prefix_cache(self) -> bool:
        return self.block_pool.reset_prefix_cache()

    def _parts(self, computed: ComputedBlocks | None) -> list[ComputedBlocks]:
        """Each group's share of a hit (none without one)."""
        if computed is None or not computed.blocks:
            return [NO_COMPUTED_BLOCKS] * len(self.managers)
        assert isinstance(computed, GroupedComputedBlocks), "hits come from get_computed_blocks"
        first = ComputedBlocks(computed.blocks, computed.num_tokens)
        return [first, *computed.group_hits]


def _last_missing(blocks: list[Block | None]) -> list[int]:
    """Per prefix length i + 1: the index of the last block missing among blocks[: i + 1]
    (-1: none), so whether a group holds blocks[skipped:n] is one comparison."""
    last = -1
    out = []
    for index, block in enumerate(blocks):
        if block is None:
            last = index
        out.append(last)
    return out
