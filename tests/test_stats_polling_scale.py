"""A large pool's stats polls (services/gateway/routing/pods.py): past MAX_POLLS_PER_SECOND x
the poll interval pods, each tick polls the next slice in turn rather than every pod, and every
pod is still polled within pods / MAX_POLLS_PER_SECOND seconds. Real gRPC servers (simulated
pods) answer the polls."""

from __future__ import annotations

import asyncio
import time

import pytest

from benchmarks.scale.sim_pod import SimPodSettings, close_pods, start_pods
from splitserve.common.redis_server import RedisServer
from splitserve.common.registry_schema import RegistryKeys, read_pods
from splitserve.common.registry_schema import connect as connect_redis
from splitserve.gateway.routing import pods as pods_module
from splitserve.gateway.routing.pods import PodPool
from splitserve.pod.registry_publisher import PublisherSettings

NUM_PODS = 150
TICK_S = 0.05
SIM = SimPodSettings(
    max_background_running=0,
    step_s=0.0,
    publisher=PublisherSettings(ttl_s=5.0, heartbeat_interval_s=0.2, publish_interval_s=0.05),
)


@pytest.fixture(scope="module")
def redis_url():
    with RedisServer() as server:
        yield server.url


def test_a_large_pool_polls_a_slice_per_tick_and_every_pod_in_turn(redis_url):
    per_tick = int(pods_module.MAX_POLLS_PER_SECOND * TICK_S)
    assert per_tick < NUM_PODS, "the pool must be past the slicing threshold"
    keys = RegistryKeys("polls")

    async def scenario() -> tuple[int, int, float]:
        pods = await start_pods(NUM_PODS, SIM, redis_url, keys)
        pool = PodPool("decode", [], "sim-model", poll_interval_s=TICK_S)
        client = connect_redis(redis_url)
        try:
            deadline = time.monotonic() + 30
            while len(records := await read_pods(client, keys)) < NUM_PODS:
                assert time.monotonic() < deadline, "pods did not register"
                await asyncio.sleep(0.1)
            await pool.apply_records(records)  # polls each new pod once
            first = {pod.address: pod.stats for pod in pool.pods}
            await pool.start()  # one more full poll, then the slices
            started = time.monotonic()
            second = {pod.address: pod.stats for pod in pool.pods}
            await asyncio.sleep(2.5 * TICK_S)
            elapsed = time.monotonic() - started
            repolled = sum(pod.stats is not second[pod.address] for pod in pool.pods)
            while any(pod.stats is second[pod.address] for pod in pool.pods):
                assert time.monotonic() < deadline, "some pod was never polled again"
                await asyncio.sleep(TICK_S)
            assert all(first[pod.address] is not pod.stats for pod in pool.pods)
            return repolled, per_tick, elapsed
        finally:
            await pool.close()
            await client.aclose()
            await close_pods(pods)

    repolled, per_tick, elapsed = asyncio.run(asyncio.wait_for(scenario(), 90))
    num_ticks = int(elapsed / TICK_S) + 1  # ticks that can have begun meanwhile
    assert repolled <= per_tick * num_ticks
