"""Tier 2: cached KV blocks in host memory beyond the engine's pool, least recently used out.

One preallocated slab of `capacity` blocks (pinned on a CUDA machine, so copies to and from the
GPU run at full bus speed and can overlap compute), a hash -> slot map in LRU order. The engine
thread writes blocks in as the pool evicts them; the load thread copies them back out. One lock
covers the map and the slab's slots: a slot is never reused while a load reads it.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass

import torch

from splitserve.engine.kv.block_hash import BlockHash
from splitserve.engine.kv.offload.layout import BlockLayout


@dataclass(slots=True)
class _Entry:
    slot: int
    num_hits: int  # prefix-cache hits the block served, in the pool and here


@dataclass(frozen=True, slots=True)
class Spilled:
    """A block pushed out of the host store: its KV (a copy) when the disk tier wants it."""

    block_hash: BlockHash
    num_hits: int
    data: torch.Tensor | None


class HostBlockStore:
    def __init__(
        self, capacity_blocks: int, layout: BlockLayout, spill_min_hits: int | None = None
    ) -> None:
        """`spill_min_hits`: blocks pushed out with at least this many hits keep their data in
        `Spilled` (for the disk tier); None: none do."""
        if capacity_blocks < 1:
            raise ValueError(f"capacity_blocks must be >= 1, got {capacity_blocks}")
        self.layout = layout
        self.capacity_blocks = capacity_blocks
        self.spill_min_hits = spill_min_hits
        pin = torch.cuda.is_available()
        self.slab = torch.empty(
            (capacity_blocks, *layout.block_shape), dtype=layout.torch_dtype, pin_memory=pin
        )
        self._entries: OrderedDict[BlockHash, _Entry] = OrderedDict()
        self._free_slots = list(range(capacity_blocks - 1, -1, -1))
        self.lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, block_hash: BlockHash) -> bool:
        return block_hash in self._entries

    def hashes(self) -> list[BlockHash]:
        with self.lock:
            return list(self._entries)

    def save(
        self, block_hash: BlockHash, source: torch.Tensor, num_hits: int
    ) -> tuple[bool, list[Spilled]]:
        """Copies `source` (one block) in under `block_hash`, pushing out the least recently
        used block when full. Returns (whether the hash is new here, what was pushed out). A
        hash already here is only marked recently used: its KV is the same by construction."""
        with self.lock:
            entry = self._entries.get(block_hash)
            if entry is not None:
                entry.num_hits = max(entry.num_hits, num_hits)
                self._entries.move_to_end(block_hash)
                return False, []
            spilled = [] if self._free_slots else [self._push_out_oldest()]
            slot = self._free_slots.pop()
            self.slab[slot].copy_(source)
            self._entries[block_hash] = _Entry(slot, num_hits)
            return True, spilled

    def load_into(self, block_hash: BlockHash, destination: torch.Tensor) -> bool:
        """Copies the block into `destination` (a block of the pool); False if it is gone."""
        with self.lock:
            entry = self._entries.get(block_hash)
            if entry is None:
                return False
            destination.copy_(self.slab[entry.slot])
            entry.num_hits += 1
            self._entries.move_to_end(block_hash)
            return True

    def _push_out_oldest(self) -> Spilled:
        block_hash, entry = self._entries.popitem(last=False)
        self._free_slots.append(entry.slot)
        wanted = self.spill_min_hits is not None and entry.num_hits >= self.spill_min_hits
        data = self.slab[entry.slot].clone() if wanted else None
        return Spilled(block_hash, entry.num_hits, data)
