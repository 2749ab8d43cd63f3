"""A pod's side of the Redis registry: its registry flags, and the `RegistryPublisher` that
heartbeats its `PodRecord` and publishes its prefix-cache events into its block SETs, one per
tier (the layout is services/common/registry_schema.py's).

    every publish_interval:   take_kv_events() ─▶ one pipeline: SADD / SREM runs, PEXPIRE,
                              and each run XADDed to the block-event stream (gateways' index)
    every heartbeat_interval: HEARTBEAT_SCRIPT (fence, record, registry, TTLs)
                              ─▶ RESYNC: snapshot_cached_blocks() ─▶ MULTI: DEL, SADD all,
                                 XADD resync, EXEC

Redis trouble never reaches serving: a failed write is logged (once per outage), the events
taken meanwhile are dropped, and the next heartbeat that gets through resyncs from a snapshot,
which is how the index refills after Redis restarts empty.

Flags (the Helm chart renders them as spelled here) and their defaults: `--redis-url`
($REDIS_URL, else no registry; password: services/common/redis_auth.py), `--region` / `--zone`
($SPLITSERVE_REGION / $SPLITSERVE_ZONE, else the node's topology labels when `--node-name`
($NODE_NAME) is given, else ""), `--advertise-host` (the address others dial for this pod's
gRPC: $POD_IP, else the bind host made reachable).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from redis.exceptions import RedisError

from splitserve.common.redis_auth import add_redis_password_flag
from splitserve.common.registry_schema import (
    BLOCK_EVENTS_MAXLEN,
    DEREGISTER_SCRIPT,
    EVENT_RESYNC,
    HEARTBEAT_FENCED,
    HEARTBEAT_RESYNC,
    HEARTBEAT_SCRIPT,
    SENTINEL,
    BlockEvent,
    PodRecord,
    RegistryKeys,
    connect,
)
from splitserve.engine.kv.events import BlockRemoved, BlockStored, KVCacheEvent
from splitserve.engine.kv.tiers import Tier
from splitserve.pod.addresses import reachable_host

if TYPE_CHECKING:
    from splitserve.engine.async_llm import AsyncLLM
    from splitserve.pod.server import PodCore

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
    pod with the same pod id) always outranks an older one, with no Redis round trip."""
    return time.time_ns() // 1000


def event_commands(events: list[KVCacheEvent]) -> list[tuple[str, Tier, list[bytes]]]:
    """("sadd" | "srem", tier, hashes) runs in event order: consecutive events of one kind and
    tier merge, and the order between them is kept (a hash removed and stored again ends up
    stored)."""
    commands: list[tuple[str, Tier, list[bytes]]] = []
    for event in events:
        if isinstance(event, BlockStored):
            name = "sadd"
        elif isinstance(event, BlockRemoved):
            name = "srem"
        else:
            raise AssertionError(f"unknown KV cache event {event!r}")
        if not event.block_hashes:
            continue
        if commands and commands[-1][:2] == (name, event.tier):
            commands[-1][2].extend(event.block_hashes)
        else:
            commands.append((name, event.tier, list(event.block_hashes)))
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
        self.pod_id, self.generation = first.pod_id, first.generation
        self.blocks_key = self.keys.blocks(self.pod_id, self.generation)
        self.tier_keys = dict(zip(Tier, self.keys.tier_blocks(self.pod_id, self.generation)))
        self.is_fenced = False  # a newer process owns the pod id: stop writing
        self._is_synced = False  # the block SET matches the cache (else resync first)
        self._is_redis_down = False
        self._is_closing = False
        self._task: asyncio.Task | None = None
        self._num_events = 0  # entries this generation XADDed to the block-event stream

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
            self.keys.generation(self.pod_id),
            self.keys.pod(self.pod_id),
            self.keys.pods,
            *self.tier_keys.values(),
        ]
        await self.client.eval(DEREGISTER_SCRIPT, len(keys), *keys, self.generation, self.pod_id)

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
            self.keys.generation(self.pod_id),
            self.keys.pod(self.pod_id),
            self.keys.pods,
            *self.tier_keys.values(),
        ]
        ttl_ms = int(self.settings.ttl_s * 1000)
        fields = [item for pair in record.to_fields().items() for item in pair]
        args = [self.generation, ttl_ms, self.pod_id, *fields]
        status = await self.client.eval(HEARTBEAT_SCRIPT, len(keys), *keys, *args)
        if status == HEARTBEAT_FENCED:
            logger.error(
                "pod id %s is registered by a newer process; this one stops publishing",
                self.pod_id,
            )
            self.is_fenced = True
        elif status == HEARTBEAT_RESYNC or not self._is_synced:
            await self.resync()

    async def resync(self) -> None:
        """Replaces every tier's block SET with a snapshot of the cache, atomically
        (MULTI/EXEC)."""
        by_tier = await self.llm.snapshot_cached_blocks()
        pipe = self.client.pipeline(transaction=True)
        pipe.delete(*self.tier_keys.values())
        pipe.sadd(self.blocks_key, SENTINEL)
        for tier, hashes in by_tier.items():
            key = self.tier_keys[tier]
            for start in range(0, len(hashes), SNAPSHOT_CHUNK):
                pipe.sadd(key, *hashes[start : start + SNAPSHOT_CHUNK])
            pipe.pexpire(key, int(self.settings.ttl_s * 1000))
        pipe.pexpire(self.blocks_key, int(self.settings.ttl_s * 1000))
        self._add_event(pipe, EVENT_RESYNC, Tier.DEVICE, [])
        await pipe.execute()
        self._is_synced = True
        logger.info(
            "published cached block hashes to Redis: %s",
            ", ".join(f"{len(hashes)} {tier.label}" for tier, hashes in by_tier.items()),
        )

    async def publish_events(self) -> None:
        """Every event since the last call in one pipelined round trip (none: no trip)."""
        events = self.llm.take_kv_events()
        if not self._is_synced:
            return  # the coming resync's snapshot covers these
        commands = event_commands(events)
        if not commands:
            return
        pipe = self.client.pipeline(transaction=False)
        for name, tier, hashes in commands:
            getattr(pipe, name)(self.tier_keys[tier], *hashes)
            self._add_event(pipe, name, tier, hashes)
        # A SET that Redis lost is re-created here without a TTL: give it one.
        for tier in {tier for _, tier, _ in commands}:
            pipe.pexpire(self.tier_keys[tier], int(self.settings.ttl_s * 1000))
        await pipe.execute()

    def _add_event(self, pipe, op: str, tier: Tier, hashes: list[bytes]) -> None:
        """Queues one block-event stream entry on `pipe`, after the SET change it mirrors.
        A pipeline that fails leaves a gap in the sequence numbers, which readers notice."""
        self._num_events += 1
        event = BlockEvent(self.pod_id, self.generation, self._num_events, op, tier, tuple(hashes))
        pipe.xadd(
            self.keys.block_events,
            event.to_fields(),
            maxlen=BLOCK_EVENTS_MAXLEN,
            approximate=True,
        )

    def _redis_failed(self, error: Exception) -> None:
        self._is_synced = False  # events taken during the outage are gone: resync after it
        if not self._is_redis_down:
            logger.warning("Redis is unreachable (%s); serving goes on, index paused", error)
        self._is_redis_down = True

    def _redis_is_back(self) -> None:
        if self._is_redis_down:
            logger.warning("Redis is reachable again; index resynced")
        self._is_redis_down = False


# ---- flags, and starting the publisher ------------------------------------------------------


@dataclass(frozen=True)
class Place:
    region: str
    zone: str


def add_registry_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("registry (Redis)")
    group.add_argument(
        "--redis-url",
        default=os.environ.get("REDIS_URL") or None,
        help="register here and publish prefix-cache events (default: $REDIS_URL, else none)",
    )
    add_redis_password_flag(group)
    group.add_argument("--region", default=os.environ.get("SPLITSERVE_REGION", ""))
    group.add_argument("--zone", default=os.environ.get("SPLITSERVE_ZONE", ""))
    group.add_argument(
        "--node-name",
        default=os.environ.get("NODE_NAME") or None,
        help="Kubernetes node: its topology labels fill an empty --region/--zone",
    )
    group.add_argument(
        "--advertise-host",
        default=os.environ.get("POD_IP") or None,
        help="the address others dial for this pod's gRPC (default: $POD_IP, else --host)",
    )


def pod_place(args: argparse.Namespace) -> Place:
    """--region/--zone, with the node's topology labels filling whichever is empty."""
    region, zone = args.region or "", args.zone or ""
    if (region and zone) or not args.node_name:
        return Place(region, zone)
    try:
        # optional: the kubernetes client, only wanted with --node-name
        from splitserve.pod.topology import discover_topology
    except ImportError:
        return Place(region, zone)
    try:
        topology = discover_topology(args.node_name)
    except Exception as error:  # the Kubernetes API is optional: any failure keeps ""
        logger.warning("no topology labels for node %s: %s", args.node_name, error)
        return Place(region, zone)
    return Place(region or topology.region, zone or topology.zone)


def advertise_address(args: argparse.Namespace, port: int) -> str:
    return f"{args.advertise_host or reachable_host(args.host)}:{port}"


async def start_registry(
    args: argparse.Namespace, core: PodCore, port: int
) -> RegistryPublisher | None:
    """Starts heartbeating and publishing when --redis-url is set; None otherwise."""
    if not args.redis_url:
        return None
    address = advertise_address(args, port)
    generation = new_generation()
    node = args.node_name or address.rsplit(":", 1)[0]

    def record() -> PodRecord:
        stats = core.stats()
        identity = stats.identity
        tiers = stats.engine.kv_tiers
        return PodRecord(
            pod_id=identity.pod_id,
            role=identity.role,
            address=address,
            generation=generation,
            model=identity.model_name,
            kv_address=identity.kv_address,
            kv_transport=identity.kv_transport,
            region=identity.region,
            zone=identity.zone,
            node=node,
            block_size=stats.block_size,
            hash_namespace=core.llm.config.cache.hash_namespace,
            tensor_parallel_size=core.llm.config.parallel.tensor_parallel_size,
            pipeline_parallel_size=core.llm.config.parallel.pipeline_parallel_size,
            load=stats.load,
            recent_ttft_s=core.metrics.recent_ttft.value or 0.0,
            recent_itl_s=core.metrics.recent_itl.value or 0.0,
            prefill_s_per_token=tiers.prefill_s_per_token,
            host_load_s_per_block=tiers.load_s_per_block.get(Tier.HOST.label, 0.0),
            disk_load_s_per_block=tiers.load_s_per_block.get(Tier.DISK.label, 0.0),
            lora_adapters=",".join(stats.lora_adapters),
            resident_lora_adapters=",".join(stats.lora.resident_adapters if stats.lora else ()),
        )

    publisher = RegistryPublisher(connect(args.redis_url), core.llm, record)
    await publisher.start()
    logger.info("registering in Redis as %s (generation %d)", address, generation)
    return publisher
