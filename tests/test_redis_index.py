"""The Redis registry and prefix-cache index against a real redis-server and a real engine (a
tiny random checkpoint): a pod's publisher registers it, its cached prompts become findable by
the gateway's lookup, evicted blocks leave the index, a stopped pod leaves the registry, a newer
process fences an older one, and the index refills after Redis restarts empty.
"""

from __future__ import annotations

import asyncio
import time

import pytest
from redis.exceptions import RedisError

from splitserve import AsyncLLM, SamplingParams
from splitserve.common.pod_load import PodLoad
from splitserve.common.redis_server import RedisServer
from splitserve.common.registry_schema import (
    PodRecord,
    RegistryKeys,
    cached_prefixes,
    connect,
    read_pods,
)
from splitserve.engine.kv.block_hash import hash_full_blocks
from splitserve.engine.kv.events import BlockRemoved, BlockStored
from splitserve.engine.kv.tiers import Tier
from splitserve.pod.registry_publisher import (
    PublisherSettings,
    RegistryPublisher,
    event_commands,
    new_generation,
)

BLOCK_SIZE = 16
FAST = PublisherSettings(ttl_s=1.0, heartbeat_interval_s=0.1, publish_interval_s=0.01)
ONE_TOKEN = SamplingParams(temperature=0.0, max_tokens=1)


@pytest.fixture(scope="module")
def redis_server():
    with RedisServer() as server:
        yield server


@pytest.fixture(scope="module")
def llm(single_thread, tiny_hf_checkpoint):
    engine = AsyncLLM(tiny_hf_checkpoint, kv_cache_bytes=2**20, block_size=BLOCK_SIZE)
    yield engine
    engine.shutdown()


def _run(coroutine, timeout: float = 120.0):
    return asyncio.run(asyncio.wait_for(coroutine, timeout))


def _record(llm: AsyncLLM, worker_id: str, generation: int) -> PodRecord:
    stats = llm.stats()
    return PodRecord(
        pod_id=worker_id,
        role="prefill",
        address=f"10.0.0.1:{len(worker_id)}",
        generation=generation,
        block_size=BLOCK_SIZE,
        hash_namespace=llm.config.cache.hash_namespace,
        load=PodLoad.from_engine(stats),
    )


def _publisher(llm, url, keys, worker_id, generation=None) -> RegistryPublisher:
    generation = generation or new_generation()
    return RegistryPublisher(
        connect(url), llm, lambda: _record(llm, worker_id, generation), keys, FAST
    )


async def _prefill(llm: AsyncLLM, prompt: list[int], request_id: str) -> None:
    async for _ in llm.generate(prompt, ONE_TOKEN, request_id):
        pass


async def _cached_blocks(client, keys, worker_id: str, prompt: list[int], llm) -> int:
    records = {record.pod_id: record for record in await read_pods(client, keys)}
    if worker_id not in records:
        return -1
    hashes = hash_full_blocks(prompt, BLOCK_SIZE, llm.config.cache.hash_namespace)
    (prefix,) = await cached_prefixes(client, [(records[worker_id].tier_blocks_keys(keys), hashes)])
    return prefix.num_blocks_by_tier[Tier.DEVICE]


async def _eventually(probe, expected, timeout: float = 5.0):
    deadline = time.monotonic() + timeout
    while True:
        try:
            value = await probe()
        except RedisError:  # Redis restarting: the client reconnects on the next try
            value = None
        if value == expected or time.monotonic() > deadline:
            return value
        await asyncio.sleep(0.02)


def _prompt(seed: int, num_tokens: int) -> list[int]:
    return [(seed * 7919 + i * 31) % 500 + 10 for i in range(num_tokens)]


def test_event_commands_merge_runs_and_keep_order():
    a, b, c = b"a" * 16, b"b" * 16, b"c" * 16
    events = [
        BlockStored([a, b], None, [], BLOCK_SIZE),
        BlockStored([c], b, [], BLOCK_SIZE),
        BlockRemoved([c]),
        BlockStored([c], b, [], BLOCK_SIZE),
        BlockRemoved([]),
    ]
    assert event_commands(events) == [
        ("sadd", Tier.DEVICE, [a, b, c]),
        ("srem", Tier.DEVICE, [c]),
        ("sadd", Tier.DEVICE, [c]),
    ]
    lower = [
        BlockStored([a], None, [], BLOCK_SIZE, Tier.HOST),
        BlockStored([b], None, [], BLOCK_SIZE, Tier.HOST),
        BlockStored([c], None, [], BLOCK_SIZE, Tier.DISK),
        BlockRemoved([a], Tier.HOST),
    ]
    assert event_commands(lower) == [
        ("sadd", Tier.HOST, [a, b]),
        ("sadd", Tier.DISK, [c]),
        ("srem", Tier.HOST, [a]),
    ]


def test_record_round_trips_through_redis_fields():
    record = PodRecord(
        "p-0",
        "decode",
        "1.2.3.4:5",
        17,
        region="r",
        zone="z",
        block_size=32,
        tensor_parallel_size=2,
    )
    assert PodRecord.from_fields(record.to_fields()) == record
    encoded = {k.encode(): v.encode() for k, v in record.to_fields().items()}
    assert PodRecord.from_fields(encoded) == record
    assert PodRecord.from_fields({}) is None


def test_cached_prompt_is_found_and_evicted_blocks_leave(redis_server, llm):
    keys = RegistryKeys("t-evict")

    async def scenario():
        client = connect(redis_server.url)
        publisher = _publisher(llm, redis_server.url, keys, "pod-a")
        await publisher.start()
        prompt = _prompt(1, 8 * BLOCK_SIZE + 5)  # 8 full blocks
        await _prefill(llm, prompt, "first")
        probe = lambda: _cached_blocks(client, keys, "pod-a", prompt, llm)  # noqa: E731
        found = await _eventually(probe, 8)
        # Fill the cache with other prompts until the first one's blocks are evicted.
        num_blocks = llm.stats().num_kv_blocks_total
        for i in range(num_blocks // 8 + 2):
            await _prefill(llm, _prompt(100 + i, 8 * BLOCK_SIZE + 1), f"filler-{i}")
        after = await _eventually(probe, 0)
        await publisher.close()
        await client.aclose()
        return found, after

    found, after = _run(scenario())
    assert found == 8
    assert after == 0


def test_lookup_of_a_4k_token_prompt_is_one_round_trip(redis_server, llm):
    """Index lookup latency for a 4k-token prompt over 4 pods (printed; never asserted)."""
    keys = RegistryKeys("t-latency")
    hashes = hash_full_blocks(_prompt(5, 4096), BLOCK_SIZE, "ns")

    async def scenario():
        client = connect(redis_server.url)
        for pod in range(4):
            await client.sadd(keys.blocks(f"p{pod}", 1), b"", *hashes[: 64 * pod])
        queries = [(keys.tier_blocks(f"p{pod}", 1), hashes) for pod in range(4)]
        answers = [prefix.num_blocks for prefix in await cached_prefixes(client, queries)]
        start = time.perf_counter()
        for _ in range(50):
            await cached_prefixes(client, queries)
        elapsed = (time.perf_counter() - start) / 50
        await client.aclose()
        return answers, elapsed

    answers, elapsed = _run(scenario())
    assert answers == [0, 64, 128, 192]
    print(f"\nlookup of 256 block hashes on 4 pods: {elapsed * 1e3:.3f} ms")


def test_stopped_pod_expires_and_newer_process_fences_older(redis_server, llm):
    keys = RegistryKeys("t-fence")

    async def scenario():
        client = connect(redis_server.url)
        old = _publisher(llm, redis_server.url, keys, "pod-f", generation=100)
        await old.start()
        await _eventually(lambda: _ids(client, keys), ["pod-f"])
        new = _publisher(llm, redis_server.url, keys, "pod-f", generation=200)
        await new.start()
        generations = lambda: _generations(client, keys)  # noqa: E731
        seen = await _eventually(generations, [200])
        await asyncio.sleep(0.3)  # several heartbeats of the old one
        fenced, still = old.is_fenced, await generations()
        new._task.cancel()  # dies without deregistering: only the TTL removes it
        gone = await _eventually(lambda: _ids(client, keys), [], timeout=FAST.ttl_s + 2)
        # Its blocks key got its TTL in the heartbeat's second round trip, a few ms after the
        # record's: it goes too, a moment later (it was still there once, in make test).
        blocks_key = keys.blocks("pod-f", 200)
        blocks_left = await _eventually(lambda: client.exists(blocks_key), 0, timeout=1.0)
        await old.close()
        await new.client.aclose()
        await client.aclose()
        return seen, fenced, still, gone, blocks_left

    seen, fenced, still, gone, blocks_left = _run(scenario())
    assert seen == [200]
    assert fenced
    assert still == [200]
    assert gone == []
    assert blocks_left == 0


def test_a_stale_process_closing_leaves_the_live_record(redis_server, llm):
    """The old process closes before any heartbeat told it a newer one took its worker id:
    its deregistration must not remove the newer process's record."""
    keys = RegistryKeys("t-stale-close")

    async def scenario():
        client = connect(redis_server.url)
        old = _publisher(llm, redis_server.url, keys, "pod-s", generation=100)
        await old.start()
        await _eventually(lambda: _ids(client, keys), ["pod-s"])
        old._task.cancel()  # no heartbeat of the old one sees the newer generation
        new = _publisher(llm, redis_server.url, keys, "pod-s", generation=200)
        await new.start()
        await _eventually(lambda: _generations(client, keys), [200])
        assert not old.is_fenced
        await old.close()
        after = await _generations(client, keys)
        old_blocks = await client.exists(keys.blocks("pod-s", 100))
        await new.close()
        gone = await _ids(client, keys)
        await client.aclose()
        return after, old_blocks, gone

    after, old_blocks, gone = _run(scenario())
    assert after == [200], "the stale process removed the live record"
    assert old_blocks == 0  # its own block set goes
    assert gone == []  # the live process deregisters itself


async def _ids(client, keys) -> list[str]:
    return sorted(record.pod_id for record in await read_pods(client, keys))


async def _generations(client, keys) -> list[int]:
    return [record.generation for record in await read_pods(client, keys)]


def test_index_refills_after_redis_restarts_empty(llm):
    keys = RegistryKeys("t-restart")
    with RedisServer() as server:

        async def scenario():
            client = connect(server.url)
            publisher = _publisher(llm, server.url, keys, "pod-r")
            await publisher.start()
            prompt = _prompt(42, 5 * BLOCK_SIZE + 3)
            await _prefill(llm, prompt, "before")
            probe = lambda: _cached_blocks(client, keys, "pod-r", prompt, llm)  # noqa: E731
            before = await _eventually(probe, 5)
            server.kill()
            await _prefill(llm, _prompt(43, 2 * BLOCK_SIZE), "during")  # serving goes on
            await asyncio.sleep(0.3)
            server.start()  # same port, empty
            after = await _eventually(probe, 5, timeout=10)
            await publisher.close()
            await client.aclose()
            return before, after

        before, after = _run(scenario())
    assert before == 5
    assert after == 5
