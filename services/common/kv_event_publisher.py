"""A pod's side of the Redis registry: heartbeats its `PodRecord` (with its load) and publishes
its prefix-cache events into its block SET (layout in services/common/registry.py).

    every publish_interval:   take_kv_events() ─▶ one pipeline: SADD / SREM runs, PEXPIRE
    every heartbeat_interval: HEARTBEAT_SCRIPT (fence, record, registry, TTLs)
                              ─▶ RESYNC: snapshot_cached_blocks() ─▶ MULTI: DEL, SADD all, EXEC

Redis trouble never reaches serving: a failed write is logged (once per outage), the events
taken meanwhile are dropped, and the next heartbeat that gets through resyncs from a snapshot,
which is how the index refills after Redis restarts empty.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from redis.exceptions import RedisError

from services.common.registry import (
    DEREGISTER_SCRIPT,
    HEARTBEAT_FENCED,
    HEARTBEAT_RESYNC,
    HEARTBEAT_SCRIPT,
    SENTINEL,
    PodRecord,
    RegistryKeys,
)
from shared.kv.events import BlockRemoved, BlockStored, KVCacheEvent

if TYPE_CHECKING:
    from shared.async_llm import AsyncLLM

logger = logging.getLogger(__name__)

SNAPSHOT_CHUNK = 4096  # hashes per SADD when resyncing
# How long close() waits for the publishing loop to end before deregistering anyway.
CLOSE_TIMEOUT_S = 2.0


@dataclass(frozen=True)
class PublisherSettings:
    ttl_s: float = 3.0  # a pod that stops heartbeating leaves the registry after this
    heartbeat_interval_s: float = 0.5
    publish_interval_s: float = 0.02  # events reach Redis this long after the step at most

    def __post_init__(self) -> None:
        if not 0 < self.heartbeat_interval_s < self.ttl_s:
            raise ValueError("heartbeat_interval_s must be > 0 and below ttl_s")
        if self.publish_interval_s <= 0:
            raise ValueError("publish_interval_s must be > 0")


def new_generation() -> int:
    """A fencing token: microseconds since the epoch, so a process started later (a restarted
    pod with the same worker id) always outranks an older one, with no Redis round trip."""
    return time.time_ns() // 1000


def event_commands(events: list[KVCacheEvent]) -> list[tuple[str, list[bytes]]]:
    """("sadd" | "srem", hashes) runs in event order: consecutive events of one kind merge, and
    the order between kinds is kept (a hash removed and stored again ends up stored)."""
    commands: list[tuple[str, list[bytes]]] = []
    for event in events:
        if isinstance(event, BlockStored):
            name = "sadd"
        elif isinstance(event, BlockRemoved):
            name = "srem"
        else:
            raise AssertionError(f"unknown KV cache event {event!r}")
        if not event.block_hashes:
            continue
        if commands and commands[-1][0] == name:
            commands[-1][1].extend(event.block_hashes)
        else:
            commands.append((name, list(event.block_hashes)))
    return commands


class RegistryPublisher:
    """Runs beside one pod's engine on its event loop: `start()`, then `close()` at shutdown.

    `record()` is called at every heartbeat for the pod's current record (load included)."""

    def __init__(
        self,
        client,
        llm: AsyncLLM,
        record: Callable[[], PodRecord],
        keys: RegistryKeys | None = None,
        settings: PublisherSettings | None = None,
    ) -> None:
        self.client = client
        self.llm = llm
        self.keys = keys or RegistryKeys()
        self.settings = settings or PublisherSettings()
        self._record = record
        first = record()
        self.worker_id, self.generation = first.worker_id, first.generation
        self.blocks_key = self.keys.blocks(self.worker_id, self.generation)
        self.is_fenced = False  # a newer process owns the worker id: stop writing
        self._is_synced = False  # the block SET matches the cache (else resync first)
        self._is_redis_down = False
        self._is_closing = False
        self._task: asyncio.Task | None = None

    async def start(self) -> None:
        self.llm.take_kv_events()  # starts the keeping; the first resync covers what came before
        self._task = asyncio.create_task(self._run(), name="registry-publisher")

    async def close(self) -> None:
        """Stops publishing and takes the pod out of the registry at once (best effort)."""
        self._is_closing = True
        if self._task is not None:
            # The flag ends the loop even if the redis client swallows the cancellation (it
            # can, mid-command, turning it into a connection error the loop survives).
            self._task.cancel()
            await asyncio.wait([self._task], timeout=CLOSE_TIMEOUT_S)
        if not self.is_fenced:
            try:
                await self._deregister()
            except RedisError as error:
                logger.info("could not deregister from Redis: %s", error)
        await self.client.aclose()

    async def _deregister(self) -> None:
        keys = [
            self.keys.generation(self.worker_id),
            self.keys.pod(self.worker_id),
            self.keys.pods,
            self.blocks_key,
        ]
        await self.client.eval(DEREGISTER_SCRIPT, len(keys), *keys, self.generation, self.worker_id)

    async def _run(self) -> None:
        next_heartbeat = 0.0
        while not self.is_fenced and not self._is_closing:
            try:
                if time.monotonic() >= next_heartbeat:
                    next_heartbeat = time.monotonic() + self.settings.heartbeat_interval_s
                    await self.heartbeat()
                    self._redis_is_back()
                await self.publish_events()
            except (RedisError, OSError) as error:
                self._redis_failed(error)
            await asyncio.sleep(self.settings.publish_interval_s)

    async def heartbeat(self) -> None:
        record = self._record()
        keys = [
            self.keys.generation(self.worker_id),
            self.keys.pod(self.worker_id),
            self.keys.pods,
            self.blocks_key,
        ]
        ttl_ms = int(self.settings.ttl_s * 1000)
        fields = [item for pair in record.to_fields().items() for item in pair]
        args = [self.generation, ttl_ms, self.worker_id, *fields]
        status = await self.client.eval(HEARTBEAT_SCRIPT, len(keys), *keys, *args)
        if status == HEARTBEAT_FENCED:
            logger.error(
                "worker id %s is registered by a newer process; this one stops publishing",
                self.worker_id,
            )
            self.is_fenced = True
        elif status == HEARTBEAT_RESYNC or not self._is_synced:
            await self.resync()

    async def resync(self) -> None:
        """Replaces the block SET with a snapshot of the cache, atomically (MULTI/EXEC)."""
        hashes = await self.llm.snapshot_cached_blocks()
        pipe = self.client.pipeline(transaction=True)
        pipe.delete(self.blocks_key)
        pipe.sadd(self.blocks_key, SENTINEL)
        for start in range(0, len(hashes), SNAPSHOT_CHUNK):
            pipe.sadd(self.blocks_key, *hashes[start : start + SNAPSHOT_CHUNK])
        pipe.pexpire(self.blocks_key, int(self.settings.ttl_s * 1000))
        await pipe.execute()
        self._is_synced = True
        logger.info("published %d cached block hashes to Redis", len(hashes))

    async def publish_events(self) -> None:
        """Every event since the last call in one pipelined round trip (none: no trip)."""
        events = self.llm.take_kv_events()
        if not self._is_synced:
            return  # the coming resync's snapshot covers these
        commands = event_commands(events)
        if not commands:
            return
        pipe = self.client.pipeline(transaction=False)
        for name, hashes in commands:
            getattr(pipe, name)(self.blocks_key, *hashes)
        # A SET that Redis lost is re-created here without a TTL: give it one.
        pipe.pexpire(self.blocks_key, int(self.settings.ttl_s * 1000))
        await pipe.execute()

    def _redis_failed(self, error: Exception) -> None:
        self._is_synced = False  # events taken during the outage are gone: resync after it
        if not self._is_redis_down:
            logger.warning("Redis is unreachable (%s); serving goes on, index paused", error)
        self._is_redis_down = True

    def _redis_is_back(self) -> None:
        if self._is_redis_down:
            logger.warning("Redis is reachable again; index resynced")
        self._is_redis_down = False
