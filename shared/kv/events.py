"""What a pod's prefix cache gained or lost, for the Redis index the gateway routes by.

The block pool records one event per change and the engine drains them each step
(`BlockPool.take_events`); publishing them is the service's job. Every hash appears in exactly
one `BlockStored` when it enters the cache and one `BlockRemoved` when it leaves, in order,
per tier: a block written down to host memory (or disk) is stored in that tier while it may
still be, or again be, in the engine's pool (`shared/kv/tiers.py`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TypeAlias

from splitserve.engine.kv.block_hash import BlockHash
from splitserve.engine.kv.tiers import Tier


@dataclass(frozen=True, slots=True)
class BlockStored:
    # A chain: block_hashes[i] is the parent of block_hashes[i + 1].
    block_hashes: list[BlockHash]
    # The hash before block_hashes[0] in its sequence; None when it is the first block.
    parent_block_hash: BlockHash | None
    # The tokens of the stored blocks, block_size per hash, in order. Events of the lower tiers
    # carry only hashes (parent None, no tokens): the stores keep no tokens, and the index
    # needs none.
    token_ids: list[int]
    block_size: int
    tier: Tier = Tier.DEVICE


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    block_hashes: list[BlockHash]
    tier: Tier = Tier.DEVICE


KVCacheEvent: TypeAlias = BlockStored | BlockRemoved
