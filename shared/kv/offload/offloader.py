"""The engine's side of the offload tiers: writing evicted blocks down, finding blocks in the
lower tiers, loading them back, and the events and counters the pod publishes.

    pool evicts (engine thread) ─▶ save_evicted: copy into host ──(pushed out, reused)──▶ disk
    admission (engine thread)   ─▶ tier_of(hash) for the prefix past the pool's hits
                                ─▶ start_load ─▶ load thread: host / disk ─▶ the request's blocks

Host-tier writes are synchronous (a memcpy per block, while the block's KV is still there);
disk writes go through the disk store's writer thread. Which blocks reach the disk is gated by
reuse (`disk_min_hits`): a one-shot prompt's blocks stay in host memory until pushed out and
never churn the disk. Without a host tier, evicted blocks go straight to disk under the same gate.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections import Counter
from dataclasses import dataclass, field

import torch

from splitserve.engine.kv.block_hash import BlockHash
from splitserve.engine.kv.block_pool import EvictedBlock
from splitserve.engine.kv.events import BlockRemoved, BlockStored, KVCacheEvent
from splitserve.engine.kv.offload.costs import TierCosts
from splitserve.engine.kv.offload.disk_store import DiskBlockStore
from splitserve.engine.kv.offload.host_store import HostBlockStore, Spilled
from splitserve.engine.kv.offload.layout import BlockLayout, pool_block
from splitserve.engine.kv.offload.loading import LoadItem, LoadJob
from splitserve.engine.kv.tiers import Tier

logger = logging.getLogger(__name__)


@dataclass
class OffloadCounters:
    """Cumulative, for the pod's metrics."""

    host_writes: int = 0  # blocks written into the host tier (the disk store counts its own)
    load_hits: Counter[Tier] = field(default_factory=Counter)  # blocks loaded from each tier
    load_failures: int = 0  # loads that ended short of their blocks (missing, bad, late)
    num_loads: int = 0  # loads that brought at least one block
    load_seconds_total: float = 0.0  # their durations, summed


class KVOffloader:
    def __init__(
        self,
        kv_cache: torch.Tensor,
        layout: BlockLayout,
        host: HostBlockStore | None,
        disk: DiskBlockStore | None,
        disk_min_hits: int = 1,
        load_timeout_s: float = 2.0,
    ) -> None:
        if host is None and disk is None:
            raise ValueError("an offloader needs a host or a disk tier")
        self.kv_cache = kv_cache
        self.layout = layout
        self.host = host
        self.disk = disk
        self.disk_min_hits = disk_min_hits
        self.load_timeout_s = load_timeout_s
        self.counters = OffloadCounters()
        self.costs = TierCosts()
        self._events: list[KVCacheEvent] = []
        self._jobs: queue.Queue[LoadJob | None] = queue.Queue()
        self._thread = threading.Thread(target=self._load_loop, name="kv-loader", daemon=True)
        self._thread.start()

    # ---- writing down (engine thread, from BlockPool.eviction_sink) --------------------------

    def save_evicted(self, evicted: list[EvictedBlock]) -> None:
        stored: list[BlockHash] = []
        removed: list[BlockHash] = []
        for block in evicted:
            source = pool_block(self.kv_cache, block.block_id)
            if self.host is not None:
                is_new, spilled = self.host.save(block.block_hash, source, block.num_hits)
                if is_new:
                    stored.append(block.block_hash)
                removed.extend(self._spill(spilled))
            elif block.num_hits >= self.disk_min_hits:
                self._write_to_disk(block.block_hash, source.clone())
        self.counters.host_writes += len(stored)
        if removed:
            self._events.append(BlockRemoved(removed, Tier.HOST))
        if stored:
            self._events.append(BlockStored(stored, None, [], self.layout.block_size, Tier.HOST))

    def _spill(self, spilled: list[Spilled]) -> list[BlockHash]:
        for block in spilled:
            if block.data is not None:
                self._write_to_disk(block.block_hash, block.data)
        return [block.block_hash for block in spilled]

    def _write_to_disk(self, block_hash: BlockHash, data: torch.Tensor) -> None:
        if self.disk is not None:
            self.disk.write_async(block_hash, data)

    # ---- lookup (engine thread) --------------------------------------------------------------

    def tier_of(self, block_hash: BlockHash) -> Tier | None:
        """The fastest lower tier holding the block, or None."""
        if self.host is not None and block_hash in self.host:
            return Tier.HOST
        if self.disk is not None and block_hash in self.disk:
            return Tier.DISK
        return None

    # ---- loading back ------------------------------------------------------------------------

    def start_load(self, request_id: str, items: list[LoadItem]) -> LoadJob:
        job = LoadJob(request_id, items, self.load_timeout_s)
        self._jobs.put(job)
        return job

    def record_finished(self, job: LoadJob, num_loaded: int) -> None:
        """The scheduler took the job's result (engine thread): count it."""
        for tier, count in job.loaded_by_tier.items():
            self.counters.load_hits[tier] += count
        if num_loaded < len(job.items):
            self.counters.load_failures += 1
        if job.finished_at is not None and job.loaded_by_tier:
            seconds = job.finished_at - job.started_at
            self.counters.num_loads += 1
            self.counters.load_seconds_total += seconds
            self.costs.record_load(max(job.loaded_by_tier), seconds, num_loaded)

    def _load_loop(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            try:
                self._load(job)
            except Exception:  # a failed load falls back to recompute; never kill the thread
                logger.exception("KV load for %s failed", job.request_id)
            finally:
                job.mark_done()

    def _load(self, job: LoadJob) -> None:
        for item in job.items:
            # Disk reads happen outside the job's lock (they are the slow part); the copy into
            # the pool happens under it, after checking the scheduler has not given up.
            data = self.disk.read(item.block_hash) if item.tier == Tier.DISK and self.disk else None
            with job.lock:
                if job.cancelled or not self._copy_in(item, data):
                    return
                job.record_loaded(item.tier)

    def _copy_in(self, item: LoadItem, disk_data: torch.Tensor | None) -> bool:
        destination = pool_block(self.kv_cache, item.block_id)
        if item.tier == Tier.HOST:
            return self.host is not None and self.host.load_into(item.block_hash, destination)
        if disk_data is None:
            return False
        destination.copy_(disk_data)
        return True

    # ---- events and lifetime -----------------------------------------------------------------

    def take_events(self) -> list[KVCacheEvent]:
        events, self._events = self._events, []
        if self.disk is not None:
            stored, removed = self.disk.take_events()
            if removed:
                events.append(BlockRemoved(removed, Tier.DISK))
            if stored:
                events.append(BlockStored(stored, None, [], self.layout.block_size, Tier.DISK))
        return events

    def cached_block_hashes(self) -> dict[Tier, list[BlockHash]]:
        """Every hash each lower tier holds now (for an index rebuilt from scratch)."""
        hashes: dict[Tier, list[BlockHash]] = {}
        if self.host is not None:
            hashes[Tier.HOST] = self.host.hashes()
        if self.disk is not None:
            hashes[Tier.DISK] = self.disk.hashes()
        return hashes

    def close(self) -> None:
        self._jobs.put(None)
        self._thread.join(timeout=10)
        if self.disk is not None:
            self.disk.close()
