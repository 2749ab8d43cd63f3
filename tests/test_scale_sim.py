"""The simulated pods of benchmarks/scale against a real redis-server and real gRPC: one
registers, publishes and answers like a real decode pod (read back with the gateway's own
readers), and the real router over ~200 of them picks the pod holding a prompt's prefix."""

from __future__ import annotations

import asyncio
import random
import time

import pytest

from benchmarks.scale.scan_lookup import cached_prefixes as scan_cached_prefixes
from benchmarks.scale.sim_pod import SimPod, SimPodSettings, close_pods, start_pods
from splitserve.common.channels import aio_channel
from splitserve.common.redis_server import RedisServer
from splitserve.common.registry_schema import (
    SENTINEL,
    RegistryKeys,
    cached_prefixes,
    connect,
    read_pods,
)
from splitserve.engine.kv.block_hash import hash_full_blocks
from splitserve.engine.kv.tiers import Tier
from splitserve.gateway.routing.pods import PodPool
from splitserve.gateway.routing.router import Router, RouterSettings
from splitserve.pod.registry_publisher import PublisherSettings
from splitserve.v1 import generate_pb2, worker_pb2, worker_pb2_grpc

FAST = PublisherSettings(ttl_s=5.0, heartbeat_interval_s=0.2, publish_interval_s=0.02)
SETTINGS = SimPodSettings(max_background_running=0, step_s=0.0, publisher=FAST)
KEYS = RegistryKeys()


@pytest.fixture(scope="module")
def redis_url():
    with RedisServer() as server:
        yield server.url


async def _eventually(check, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not await check():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.05)


def _prompt(first: int, num_tokens: int) -> list[int]:
    return [(first + 7 * i) % 32000 + 1 for i in range(num_tokens)]


def test_a_simulated_pod_registers_publishes_and_answers_like_a_decode_pod(redis_url):
    async def run() -> None:
        pod = SimPod(0, SETTINGS, redis_url, KEYS)
        await pod.start()
        client = connect(redis_url)
        try:
            await _check_registry(pod, client)
            await _check_stats_and_decode(pod, client)
            await _check_gateway_pool_takes_it(pod, client)
        finally:
            await pod.close()
            await client.aclose()
        assert await read_pods(connect(redis_url), KEYS) == [], "deregistered on close"

    asyncio.run(run())


async def _check_registry(pod: SimPod, client) -> None:
    async def registered() -> bool:
        return any(r.pod_id == pod.pod_id for r in await read_pods(client, KEYS))

    await _eventually(registered)
    (record,) = await read_pods(client, KEYS)
    assert (record.role, record.address, record.model) == ("decode", pod.address, "sim-model")
    assert (record.generation, record.block_size, record.hash_namespace) == (
        pod.generation,
        16,
        "",
    )
    assert record.load.kv_blocks_total == SETTINGS.capacity_blocks
    blocks_key = record.blocks_key(KEYS)
    assert await client.smembers(blocks_key) == {SENTINEL}
    hashes = hash_full_blocks(_prompt(5, 64), 16, "")
    pod.cache.store(hashes)

    async def published() -> bool:
        return await client.smembers(blocks_key) == {SENTINEL, *hashes}

    await _eventually(published)


async def _check_stats_and_decode(pod: SimPod, client) -> None:
    channel = aio_channel(pod.address)
    stub = worker_pb2_grpc.DecodeWorkerStub(channel)
    try:
        stats = await stub.GetStats(worker_pb2.StatsRequest())
        assert (stats.worker_id, stats.role, stats.model) == (pod.pod_id, "decode", "sim-model")
        assert (stats.block_size, stats.kv_blocks_total) == (16, SETTINGS.capacity_blocks)
        assert stats.kv_blocks_free == stats.kv_blocks_total and stats.num_running == 0
        prompt = [*_prompt(5, 64), 9, 9, 9]  # 4 cached blocks, then a partial one
        request = worker_pb2.DecodeRequest(
            request_id="r1",
            prompt_token_ids=prompt,
            sampling=generate_pb2.SamplingOptions(max_tokens=3),
        )
        responses = [r async for r in stub.Decode(request)]
        assert sum(len(r.token_ids) for r in responses) == 3
        assert responses[-1].finish_reason == "length"
        usage = responses[-1].usage
        assert (usage.prompt_tokens, usage.completion_tokens, usage.cached_tokens) == (67, 3, 64)
    finally:
        await channel.close()


async def _check_gateway_pool_takes_it(pod: SimPod, client) -> None:
    pool = PodPool("decode", [], "sim-model")
    try:
        await pool.apply_records(await read_pods(client, KEYS))
        (gateway_pod,) = pool.available()
        assert (gateway_pod.pod_id, gateway_pod.address) == (pod.pod_id, pod.address)
        assert gateway_pod.load.kv_blocks_total == SETTINGS.capacity_blocks
    finally:
        await pool.close()


def test_the_router_over_200_simulated_pods_picks_the_one_holding_the_prefix(redis_url):
    async def run() -> str:
        pods = await start_pods(200, SETTINGS, redis_url, RegistryKeys("scale200"))
        pool = PodPool("decode", [], "sim-model", poll_interval_s=5.0)
        router = Router(pool, None, RouterSettings(redis_url=redis_url), RegistryKeys("scale200"))
        try:
            for index, pod in enumerate(pods):  # every pod holds something else
                pod.cache.store(hash_full_blocks(_prompt(1000 + index, 128), 16, ""))
            prompt = _prompt(42, 1024)
            pods[137].cache.store(hash_full_blocks(prompt, 16, ""))
            await _eventually(lambda: _all_published(pods, redis_url, "scale200"), 30)
            await router.start()

            async def all_answered() -> bool:  # first polls may time out on a busy machine
                await pool.poll()
                return len(pool.available()) == 200

            await _eventually(all_answered, 60)
            picked = await router.pick([*prompt, 5])
            assert picked is not None
            return picked.decode.pod_id
        finally:
            await router.close()
            await pool.close()
            await close_pods(pods)

    assert asyncio.run(run()) == "sim-decode-137"


async def _all_published(pods: list[SimPod], redis_url: str, prefix: str) -> bool:
    client = connect(redis_url)
    try:
        pipe = client.pipeline(transaction=False)
        for pod in pods:
            pipe.scard(RegistryKeys(prefix).blocks(pod.pod_id, pod.generation))
        sizes = await pipe.execute()
    finally:
        await client.aclose()
    return all(size == len(pod.cache) + 1 for size, pod in zip(sizes, pods, strict=True))


def test_the_lookup_answers_as_the_scan_it_replaced_did(redis_url):
    """registry_schema's LOOKUP_SCRIPT against the per-block scan before it, on pods whose
    held hashes form a prefix of each chain (device only, and with host and disk tiers) and
    with two block sizes among the queries."""

    async def run() -> None:
        client = connect(redis_url)
        keys, rng = RegistryKeys("fastlookup"), random.Random(7)
        chains = [hash_full_blocks(_prompt(s, 16 * 40), 16, "") for s in range(3)]
        other = hash_full_blocks(_prompt(0, 32 * 20), 32, "")
        unrelated = hash_full_blocks(_prompt(99, 16 * 20), 16, "")  # held, never asked for
        queries = []
        try:
            for pod in range(60):
                chain = chains[pod % 3] if pod % 5 else other
                tier_keys = keys.tier_blocks(f"p{pod}", 1)
                held = rng.choice([0, 1, 2, 7, 16, 39, len(chain)])
                await client.sadd(tier_keys[0], SENTINEL, *rng.sample(unrelated, 5))
                if pod % 4 == 0 and held:  # offload tiers: a device run, then host, then disk
                    cut = sorted(rng.sample(range(held + 1), 2))
                    for tier_key, part in zip(tier_keys, _split(chain[:held], cut), strict=True):
                        if part:
                            await client.sadd(tier_key, *part)
                elif held:
                    await client.sadd(tier_keys[0], *chain[:held])
                queries.append((tier_keys, chain))
            expected = await scan_cached_prefixes(client, queries)
            assert await cached_prefixes(client, queries) == expected
            assert any(p.num_blocks_by_tier[Tier.DISK] for p in expected), "tiers exercised"
        finally:
            await client.aclose()

    asyncio.run(run())


def _split(chain: list, cut: list[int]) -> list[list]:
    return [chain[: cut[0]], chain[cut[0] : cut[1]], chain[cut[1] :]]


class _PollFailsDuringLookup(Router):
    """The real router, with a real round of stats polls (one pod stopped) landing while the
    index lookup is in flight: the interleaving that 1,000 pods on a busy gateway produce."""

    async def cached_tokens(self, prompt, pods, extra_hash_keys=(), pods_version=None):
        answer = await super().cached_tokens(prompt, pods, extra_hash_keys, pods_version)
        await self.decode_pool.poll()
        return answer


def test_a_pod_whose_poll_fails_during_the_lookup_is_not_picked(redis_url):
    async def run() -> str | None:
        keys = RegistryKeys("pollrace")
        pods = await start_pods(2, SETTINGS, redis_url, keys)
        pool = PodPool("decode", [], "sim-model", poll_interval_s=60)
        router = _PollFailsDuringLookup(pool, None, RouterSettings(redis_url=redis_url), keys)
        try:
            await _eventually(lambda: _all_published(pods, redis_url, "pollrace"))
            await router.start()
            assert len(pool.available()) == 2
            await pods[0].close()
            picked = await router.pick(_prompt(3, 64))
            return picked.decode.pod_id if picked is not None else None
        finally:
            await router.close()
            await pool.close()
            await close_pods(pods[1:])

    assert asyncio.run(run()) == "sim-decode-1"
