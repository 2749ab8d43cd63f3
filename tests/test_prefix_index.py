"""The gateway's event-fed prefix index (services/gateway/routing/prefix_index.py and
index_follower.py) against a real redis-server and real publishers (simulated pods' caches
behind the real `RegistryPublisher`): it follows store and remove events, catches up after a
missed range or a Redis restart, keeps tenants' salts and LoRA adapters apart, and lets the
router pick among hundreds of pods without a Redis lookup per request.
"""

from __future__ import annotations

import asyncio
import time

import pytest

from benchmarks.scale.cache import SimCache
from benchmarks.scale.sim_pod import SimPodSettings, close_pods, start_pods
from splitserve.common.redis_server import RedisServer
from splitserve.common.registry_schema import (
    EVENT_REMOVE,
    EVENT_STORE,
    BlockEvent,
    PodRecord,
    RegistryKeys,
    cached_prefixes,
    connect,
)
from splitserve.engine.kv.block_hash import cache_salt_keys, hash_full_blocks
from splitserve.engine.kv.events import BlockRemoved, BlockStored, KVCacheEvent
from splitserve.engine.kv.tiers import Tier
from splitserve.engine.lora.request import lora_hash_keys
from splitserve.gateway.routing.index_follower import IndexFollower
from splitserve.gateway.routing.pods import PodPool
from splitserve.gateway.routing.prefix_index import PrefixIndex
from splitserve.gateway.routing.router import Router, RouterSettings
from splitserve.pod.registry_publisher import PublisherSettings, RegistryPublisher, new_generation

BLOCK_SIZE = 16
FAST = PublisherSettings(ttl_s=5.0, heartbeat_interval_s=0.1, publish_interval_s=0.01)


@pytest.fixture(scope="module")
def redis_server():
    with RedisServer() as server:
        yield server


def _chain(first: int, num_blocks: int, extra_keys: tuple[str, ...] = ()) -> list[bytes]:
    tokens = [(first + 7 * i) % 32000 + 1 for i in range(num_blocks * BLOCK_SIZE)]
    return list(hash_full_blocks(tokens, BLOCK_SIZE, "", extra_keys))


async def _eventually(check, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.02)


def _event(pod_id: str, seq: int, op: str, hashes: list[bytes], tier=Tier.DEVICE) -> BlockEvent:
    return BlockEvent(pod_id, 1, seq, op, tier, tuple(hashes))


# ---- the index alone ---------------------------------------------------------------------------


def test_a_lookup_counts_each_pods_leading_run_by_its_fastest_tier():
    chain = _chain(1, 6)
    index = PrefixIndex()
    index.replace_pod("a", 1, {Tier.DEVICE: chain[:4]})
    index.replace_pod("b", 1, {Tier.DEVICE: chain[:2], Tier.HOST: chain[1:5]})
    index.replace_pod("c", 1, {Tier.DEVICE: chain[1:6]})  # no first block: no run at all
    index.replace_pod("old", 1, {Tier.DEVICE: chain})
    found = index.lookup(chain, {"a": 1, "b": 1, "c": 1, "old": 2})
    assert {pod: prefix.num_blocks_by_tier for pod, prefix in found.items()} == {
        "a": {Tier.DEVICE: 4},
        "b": {Tier.DEVICE: 2, Tier.HOST: 3},
    }
    # A snapshot names every tier, most empty (the fast path counts the run in its one
    # non-empty tier); a pod whose blocks went down a tier after the snapshot counts by tier.
    index.replace_pod("d", 1, {Tier.DEVICE: chain[:3], Tier.HOST: [], Tier.DISK: []})
    index.replace_pod("e", 1, {Tier.DEVICE: [], Tier.HOST: chain[:5], Tier.DISK: []})
    assert index.apply(_event("e", 1, EVENT_STORE, chain[:2], Tier.DISK))
    found = index.lookup(chain, {"d": 1, "e": 1})
    assert {pod: prefix.num_blocks_by_tier for pod, prefix in found.items()} == {
        "d": {Tier.DEVICE: 3},
        "e": {Tier.HOST: 5},  # the fastest tier holding each: host before disk
    }


def test_events_apply_in_sequence_and_a_gap_or_resync_asks_for_a_reread():
    chain = _chain(2, 4)
    index = PrefixIndex()
    assert not index.apply(_event("a", 1, EVENT_STORE, chain))  # unknown pod: read it first
    index.replace_pod("a", 1, {})
    assert index.apply(_event("a", 7, EVENT_STORE, chain))  # after a snapshot any seq goes
    assert index.apply(_event("a", 8, EVENT_REMOVE, chain[2:]))
    assert index.lookup(chain, {"a": 1})["a"].num_blocks == 2
    assert not index.apply(_event("a", 10, EVENT_REMOVE, chain))  # 9 was missed
    index.drop_pod("a")
    assert index.num_blocks == 0


# ---- following Redis ---------------------------------------------------------------------------


class _Pod:
    """A simulated pod's cache behind the real publisher."""

    def __init__(self, url: str, keys: RegistryKeys, pod_id: str) -> None:
        self.cache = SimCache(capacity_blocks=8, block_size=BLOCK_SIZE)
        self.generation = new_generation()
        self.pod_id = pod_id
        record = PodRecord(pod_id, "decode", f"{pod_id}:1", self.generation)
        self.publisher = RegistryPublisher(connect(url), self.cache, lambda: record, keys, FAST)


async def _started(url: str, keys: RegistryKeys, pod_id: str) -> _Pod:
    pod = _Pod(url, keys, pod_id)
    await pod.publisher.start()
    return pod


def _held(follower: IndexFollower, pod: _Pod, chain: list[bytes]) -> int:
    found = follower.index.lookup(chain, {pod.pod_id: pod.generation}).get(pod.pod_id)
    return 0 if found is None else found.num_blocks


def test_the_index_follows_a_publishers_stores_and_evictions(redis_server):
    keys = RegistryKeys("pi-follow")

    async def scenario() -> None:
        pod = await _started(redis_server.url, keys, "pod-f")
        follower = IndexFollower(connect(redis_server.url), keys)
        task = asyncio.create_task(follower.run_forever())
        try:
            await _eventually(lambda: follower.is_synced)
            follower.sync_pods([pod.publisher._record()])
            first, second = _chain(10, 6), _chain(20, 6)
            pod.cache.store(first)
            await _eventually(lambda: _held(follower, pod, first) == 6)
            await follower.client.xadd(keys.block_events, {"not": "ours"})  # skipped
            pod.cache.store(second)  # capacity 8: the first chain's tail is evicted
            await _eventually(lambda: _held(follower, pod, second) == 6)
            await _eventually(lambda: _held(follower, pod, first) == 2)
            assert follower.is_synced
        finally:
            task.cancel()
            await pod.publisher.close()
            await follower.client.aclose()
        await asyncio.gather(task, return_exceptions=True)
        assert not follower.is_synced  # stopped: the router must not read it

    asyncio.run(asyncio.wait_for(scenario(), 30))


def test_a_missed_range_of_events_is_caught_up_by_rereading_the_pod(redis_server):
    keys = RegistryKeys("pi-gap")

    async def scenario() -> None:
        pod = await _started(redis_server.url, keys, "pod-g")
        client = connect(redis_server.url)
        follower = IndexFollower(client, keys)
        try:
            await _eventually(lambda: pod.publisher._is_synced)
            await follower.resync()
            missed, seen = _chain(30, 3), _chain(40, 3)
            pod.cache.store(missed)
            await asyncio.sleep(0.2)  # published, then trimmed before the follower reads it
            await client.xtrim(keys.block_events, maxlen=0)
            pod.cache.store(seen)
            await asyncio.sleep(0.2)
            while await follower.follow(block_ms=50):
                pass
            assert _held(follower, pod, missed) == 3
            assert _held(follower, pod, seen) == 3
        finally:
            await pod.publisher.close()
            await client.aclose()

    asyncio.run(asyncio.wait_for(scenario(), 30))


def test_the_index_resyncs_after_redis_restarts_empty():
    keys = RegistryKeys("pi-restart")
    with RedisServer() as server:

        async def scenario() -> None:
            pod = await _started(server.url, keys, "pod-r")
            follower = IndexFollower(connect(server.url), keys)
            task = asyncio.create_task(follower.run_forever())
            try:
                before, after = _chain(50, 4), _chain(60, 3)
                pod.cache.store(before)
                await _eventually(lambda: follower.is_synced and _held(follower, pod, before))
                server.restart()  # empty: the pod resyncs its SETs, the follower its index
                await _eventually(lambda: not follower.is_synced)
                pod.cache.store(after)
                await _eventually(lambda: follower.is_synced, 15)
                await _eventually(lambda: _held(follower, pod, after) == 3, 15)
                assert _held(follower, pod, before) == 4
            finally:
                task.cancel()
                await pod.publisher.close()
                await follower.client.aclose()

        asyncio.run(asyncio.wait_for(scenario(), 60))


class _TieredCache:
    """What the publisher reads of an engine with offload tiers: events it is handed, in order,
    and a snapshot of what they left (the two `AsyncLLM` methods it calls)."""

    def __init__(self) -> None:
        self.events: list[KVCacheEvent] = []
        self.held: dict[Tier, set[bytes]] = {tier: set() for tier in Tier}

    def add(self, event: KVCacheEvent) -> None:
        self.events.append(event)
        change = set.update if isinstance(event, BlockStored) else set.difference_update
        change(self.held[event.tier], event.block_hashes)

    def take_kv_events(self) -> list[KVCacheEvent]:
        events, self.events = self.events, []
        return events

    async def snapshot_cached_blocks(self) -> dict[Tier, list[bytes]]:
        self.events = []
        return {tier: list(hashes) for tier, hashes in self.held.items()}


def test_the_index_answers_tiered_prefixes_as_the_redis_script_does(redis_server):
    keys = RegistryKeys("pi-tiers")
    chain = _chain(80, 6)

    async def scenario() -> tuple[dict, dict]:
        cache = _TieredCache()
        record = PodRecord("pod-t", "decode", "pod-t:1", new_generation())
        publisher = RegistryPublisher(connect(redis_server.url), cache, lambda: record, keys, FAST)
        await publisher.start()
        follower = IndexFollower(connect(redis_server.url), keys)
        task = asyncio.create_task(follower.run_forever())
        generations = {"pod-t": record.generation}
        try:
            await _eventually(lambda: follower.is_synced)
            follower.sync_pods([record])
            cache.add(BlockStored(chain[:4], None, [], BLOCK_SIZE))
            cache.add(BlockStored(chain[1:5], None, [], BLOCK_SIZE, Tier.HOST))
            cache.add(BlockStored(chain[5:], None, [], BLOCK_SIZE, Tier.DISK))
            cache.add(BlockRemoved(chain[2:4]))  # written down to host, freed from the pool
            await _eventually(lambda: "pod-t" in follower.index.lookup(chain, generations))
            await _eventually(
                lambda: follower.index.lookup(chain, generations)["pod-t"].num_blocks == 6
            )
            script = await cached_prefixes(
                follower.client, [(record.tier_blocks_keys(keys), chain)]
            )
            local = follower.index.lookup(chain, generations)["pod-t"]
            return script[0].num_blocks_by_tier, local.num_blocks_by_tier
        finally:
            task.cancel()
            await publisher.close()
            await follower.client.aclose()

    script, local = asyncio.run(asyncio.wait_for(scenario(), 30))
    assert (
        {tier: n for tier, n in script.items() if n}
        == local
        == {Tier.DEVICE: 2, Tier.HOST: 3, Tier.DISK: 1}
    )


# ---- routing by it -----------------------------------------------------------------------------

SIM = SimPodSettings(
    max_background_running=0,
    step_s=0.0,
    publisher=PublisherSettings(ttl_s=5.0, heartbeat_interval_s=0.2, publish_interval_s=0.02),
)


def _tokens(first: int, num_tokens: int) -> list[int]:
    return [(first + 7 * i) % 32000 + 1 for i in range(num_tokens)]


async def _evalsha_calls(url: str) -> int:
    client = connect(url)
    try:
        stats = await client.info("commandstats")
    finally:
        await client.aclose()
    return int(stats.get("cmdstat_evalsha", {}).get("calls", 0))


def test_tenants_salts_and_lora_adapters_stay_apart_in_the_index(redis_server):
    keys = RegistryKeys("pi-tenants")
    prompt = _tokens(70, 8 * BLOCK_SIZE)

    async def scenario() -> dict[str, dict[str, int]]:
        pods = await start_pods(3, SIM, redis_server.url, keys)
        pool = PodPool("decode", [], "sim-model", poll_interval_s=5.0)
        router = Router(pool, None, RouterSettings(redis_url=redis_server.url), keys)
        try:
            for pod, extra in zip(
                pods, (cache_salt_keys("a"), cache_salt_keys("b"), lora_hash_keys("x")), strict=True
            ):
                pod.cache.store(hash_full_blocks(prompt, BLOCK_SIZE, "", extra))
            await router.start()
            follower = router.index_follower
            assert follower is not None
            await _eventually(
                lambda: (
                    len(pool.pods) == 3
                    and router.is_index_synced
                    and follower.index.num_blocks == 24
                )
            )
            asked = {
                "salt a": cache_salt_keys("a"),
                "salt b": cache_salt_keys("b"),
                "lora x": lora_hash_keys("x"),
                "none": (),
            }
            return {
                name: await router.cached_tokens([*prompt, 1], pool.pods, extra)
                for name, extra in asked.items()
            }
        finally:
            await router.close()
            await pool.close()
            await close_pods(pods)

    held = asyncio.run(asyncio.wait_for(scenario(), 60))
    full = 8 * BLOCK_SIZE
    assert held == {  # the index names only the pods that hold some of the prompt
        "salt a": {"sim-decode-0": full},
        "salt b": {"sim-decode-1": full},
        "lora x": {"sim-decode-2": full},
        "none": {},
    }


def test_the_router_over_250_simulated_pods_picks_by_the_index_without_a_redis_lookup(
    redis_server,
):
    keys = RegistryKeys("pi-scale")
    prompt = _tokens(42, 1024)

    async def scenario() -> tuple[str, int]:
        pods = await start_pods(250, SIM, redis_server.url, keys)
        pool = PodPool("decode", [], "sim-model", poll_interval_s=5.0)
        router = Router(pool, None, RouterSettings(redis_url=redis_server.url), keys)
        try:
            for index, pod in enumerate(pods):  # every pod holds something else
                pod.cache.store(hash_full_blocks(_tokens(1000 + index, 128), BLOCK_SIZE, ""))
            await router.start()
            pods[201].cache.store(hash_full_blocks(prompt, BLOCK_SIZE, ""))  # an event, later
            assert router.index_follower is not None
            index = router.index_follower.index
            first_block = hash_full_blocks(prompt, BLOCK_SIZE, "")[:1]
            await _eventually(
                lambda: (
                    router.is_index_synced
                    and index.lookup(first_block, {"sim-decode-201": pods[201].generation})
                ),
                30,
            )

            async def all_answered() -> bool:  # first polls may time out on a busy machine
                await pool.poll()
                return len(pool.available()) == 250

            deadline = time.monotonic() + 60
            while not await all_answered():
                assert time.monotonic() < deadline, "pods did not answer"
            before = await _evalsha_calls(redis_server.url)
            picked = await router.pick([*prompt, 5])
            after = await _evalsha_calls(redis_server.url)
            assert picked is not None
            return picked.decode.pod_id, after - before
        finally:
            await router.close()
            await pool.close()
            await close_pods(pods)

    assert asyncio.run(asyncio.wait_for(scenario(), 120)) == ("sim-decode-201", 0)


def test_a_slow_registry_read_is_waited_for_not_taken_for_redis_down(redis_server):
    """The registry refresh runs in the background: a Redis that answers in 1.5 s (paused, as
    one busy with a thousand pods' heartbeats was) is still up, where the request path's
    0.5 s timeout took it for down (benchmarks/scale at 1,000 pods)."""

    async def scenario() -> tuple[bool, bool]:
        keys = RegistryKeys(prefix="slow-registry")
        writer = connect(redis_server.url)
        record = PodRecord("pod-s", "decode", "pod-s:1", 1)
        await writer.hset(keys.pod("pod-s"), mapping=record.to_fields())
        await writer.zadd(keys.pods, {"pod-s": time.time() + 60})
        settings = RouterSettings(redis_url=redis_server.url)
        router = Router(PodPool("decode", [], "m"), None, settings, keys)
        try:
            await router.refresh_registry()
            was_up = router.is_redis_up
            await writer.execute_command("CLIENT", "PAUSE", 1500, "ALL")
            await router.refresh_registry()
            return was_up, router.is_redis_up
        finally:
            await router.close()
            await writer.aclose()

    assert asyncio.run(scenario()) == (True, True)


def test_the_hook_after_the_first_sync_runs_once(redis_server):
    """The gateway freezes its heap once the first snapshot is in; later resyncs (a trimmed
    stream, an outage) must not freeze again what requests in flight hold."""
    keys = RegistryKeys("pi-hook")
    calls: list[int] = []

    async def scenario() -> None:
        pod = await _started(redis_server.url, keys, "pod-h")
        follower = IndexFollower(
            connect(redis_server.url), keys, after_first_sync=lambda: calls.append(len(calls))
        )
        try:
            assert calls == []
            await follower.resync()
            assert calls == [0] and follower.is_synced
            await follower.resync()
            assert calls == [0]
        finally:
            await pod.publisher.close()
            await follower.client.aclose()

    asyncio.run(asyncio.wait_for(scenario(), 30))
