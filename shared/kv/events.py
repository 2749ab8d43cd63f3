"""What a pod's prefix cache gained or lost, for the Redis index the gateway routes by.

The block pool records one event per change and the engine drains them each step
(`BlockPool.take_events`); publishing them is the service's job. Every hash appears in exactly
one `BlockStored` when it enters the cache and one `BlockRemoved` when it leaves, in order.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TypeAlias

from shared.kv.block_hash import BlockHash


@dataclass(frozen=True, slots=True)
class BlockStored:
    # A chain: block_hashes[i] is the parent of block_hashes[i + 1].
    block_hashes: list[BlockHash]
    # The hash before block_hashes[0] in its sequence; None when it is the first block.
    parent_block_hash: BlockHash | None
    # The tokens of the stored blocks, block_size per hash, in order.
    token_ids: list[int]
    block_size: int


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    block_hashes: list[BlockHash]


KVCacheEvent: TypeAlias = BlockStored | BlockRemoved
