"""The offload tiers in the Redis index and in routing: a pod publishes which blocks each tier
holds, one lookup counts a prompt's cached prefix by tier, and the router credits each tier by
the pod's measured load and prefill costs (services/gateway/routing/tier_credit.py).
"""

from __future__ import annotations

import asyncio
import time

import pytest

from splitserve import AsyncLLM, SamplingParams
from splitserve.common.pod_load import PodLoad
from splitserve.common.redis_server import RedisServer
from splitserve.common.registry_schema import (
    CachedPrefix,
    PodRecord,
    RegistryKeys,
    cached_prefixes,
    connect,
)
from splitserve.engine.kv.block_hash import hash_full_blocks
from splitserve.engine.kv.tiers import Tier
from splitserve.gateway.routing.tier_credit import PRIOR_CREDIT, credited_tokens, tier_credit
from splitserve.pod.registry_publisher import PublisherSettings, RegistryPublisher

BLOCK_SIZE = 4
FAST = PublisherSettings(ttl_s=1.0, heartbeat_interval_s=0.1, publish_interval_s=0.01)
GREEDY = SamplingParams(temperature=0.0, max_tokens=2)


@pytest.fixture(scope="module")
def redis_server():
    with RedisServer() as server:
        yield server


def _run(coroutine, timeout: float = 120.0):
    return asyncio.run(asyncio.wait_for(coroutine, timeout))


def _prompt(seed: int, num_tokens: int) -> list[int]:
    return [(seed * 7919 + i * 31) % 500 + 10 for i in range(num_tokens)]


def test_one_lookup_counts_the_cached_prefix_by_tier(redis_server):
    keys = RegistryKeys("t-tiers")
    hashes = hash_full_blocks(_prompt(1, 40), BLOCK_SIZE, "ns")  # 10 blocks

    async def scenario():
        client = connect(redis_server.url)
        device, host, disk = keys.tier_blocks("a", 1)
        await client.sadd(device, b"", *hashes[:2])
        await client.sadd(host, *hashes[2:5], hashes[8])  # 8 is past the first miss
        await client.sadd(disk, hashes[1], hashes[5])  # 1 is in the pool too: counts there
        other = keys.tier_blocks("b", 1)
        await client.sadd(other[1], *hashes[:3])  # everything in host memory, nothing above
        answers = await cached_prefixes(
            client, [(keys.tier_blocks("a", 1), hashes), (other, hashes)]
        )
        await client.aclose()
        return answers

    a, b = _run(scenario())
    assert a.num_blocks_by_tier == {Tier.DEVICE: 2, Tier.HOST: 3, Tier.DISK: 1}
    assert b.num_blocks_by_tier == {Tier.DEVICE: 0, Tier.HOST: 3, Tier.DISK: 0}
    assert a.num_blocks == 6


def _costed(prefill_s_per_token: float, host_s: float, disk_s: float) -> PodRecord:
    return PodRecord(
        "p",
        "decode",
        "h:1",
        1,
        block_size=16,
        prefill_s_per_token=prefill_s_per_token,
        host_load_s_per_block=host_s,
        disk_load_s_per_block=disk_s,
    )


def test_tier_credit_follows_measured_costs_and_falls_back_to_a_prior():
    measured = _costed(prefill_s_per_token=0.001, host_s=0.0008, disk_s=0.012)  # 16 ms/block
    assert tier_credit(measured, Tier.DEVICE) == 1.0
    assert tier_credit(measured, Tier.HOST) == pytest.approx(0.95)
    assert tier_credit(measured, Tier.DISK) == pytest.approx(0.25)
    slow_disk = _costed(prefill_s_per_token=0.001, host_s=0.0008, disk_s=0.1)
    assert tier_credit(slow_disk, Tier.DISK) == 0.0  # loading costs more than computing
    unmeasured = _costed(0.0, 0.0, 0.0)
    assert tier_credit(unmeasured, Tier.HOST) == PRIOR_CREDIT[Tier.HOST]
    prefix = CachedPrefix({Tier.DEVICE: 2, Tier.HOST: 4, Tier.DISK: 4})
    assert credited_tokens(measured, prefix) == int((2 + 4 * 0.95 + 4 * 0.25) * 16)


def _record(llm: AsyncLLM, pod_id: str, generation: int) -> PodRecord:
    tiers = llm.stats().kv_tiers
    return PodRecord(
        pod_id=pod_id,
        role="decode",
        address="10.0.0.1:1",
        generation=generation,
        block_size=BLOCK_SIZE,
        hash_namespace=llm.config.cache.hash_namespace,
        load=PodLoad.from_engine(llm.stats()),
        prefill_s_per_token=tiers.prefill_s_per_token,
        host_load_s_per_block=tiers.load_s_per_block.get("host", 0.0),
    )


async def _generate(llm: AsyncLLM, prompt: list[int], request_id: str) -> None:
    async for _ in llm.generate(prompt, GREEDY, request_id):
        pass


async def _eventually(probe, accept, timeout: float = 5.0):
    deadline = time.monotonic() + timeout
    while True:
        value = await probe()
        if accept(value) or time.monotonic() > deadline:
            return value
        await asyncio.sleep(0.02)


def test_a_pod_publishes_its_host_tier_and_leaves_no_tier_behind(
    redis_server, single_thread, tiny_hf_checkpoint
):
    llm = AsyncLLM(
        tiny_hf_checkpoint,
        block_size=BLOCK_SIZE,
        num_blocks_override=24,
        kv_cache_bytes=2**20,
        offload_host_bytes=2**20,
    )
    keys = RegistryKeys("t-tier-pub")
    session, flood = _prompt(7, 40), [_prompt(100 + i, 40) for i in range(3)]
    hashes = hash_full_blocks(session[:-1], BLOCK_SIZE, llm.config.cache.hash_namespace)

    async def scenario():
        client = connect(redis_server.url)
        publisher = RegistryPublisher(
            connect(redis_server.url), llm, lambda: _record(llm, "pod-t", 5), keys, FAST
        )
        await publisher.start()
        await _generate(llm, session, "s1")
        for i, prompt in enumerate(flood):
            await _generate(llm, prompt, f"f{i}")  # pushes the session out of the pool

        async def lookup():
            (prefix,) = await cached_prefixes(client, [(keys.tier_blocks("pod-t", 5), hashes)])
            return prefix

        pushed_out = await _eventually(lookup, lambda p: p.num_blocks_by_tier[Tier.HOST] >= 6)
        await _generate(llm, session, "s2")  # loads it back into the pool
        reloaded = await _eventually(lookup, lambda p: p.num_blocks_by_tier[Tier.DEVICE] >= 6)
        await publisher.close()
        left = await client.exists(*keys.tier_blocks("pod-t", 5))
        await client.aclose()
        return pushed_out, reloaded, left

    try:
        pushed_out, reloaded, left = _run(scenario())
    finally:
        llm.shutdown()
    assert pushed_out.num_blocks_by_tier[Tier.HOST] >= 6  # the session's blocks, written down
    assert pushed_out.num_blocks == len(hashes)
    assert reloaded.num_blocks_by_tier[Tier.DEVICE] >= 6 and reloaded.num_blocks == len(hashes)
    assert llm.stats().kv_tiers.load_s_per_block["host"] > 0  # measured, for the router
    assert left == 0
