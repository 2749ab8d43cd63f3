"""Recent TTFT / ITL: the pod's exponentially weighted averages (exact numbers), what a finished
request adds to them, and their trip through a real Redis in the pod's registry record."""

from __future__ import annotations

import asyncio

import pytest

from splitserve import AsyncLLM
from splitserve.common.redis_server import RedisServer
from splitserve.common.registry_schema import PodRecord, RegistryKeys, connect, read_pods
from splitserve.engine.core import EngineStats
from splitserve.engine.outputs import CompletionOutput, RequestTimings
from splitserve.pod.metrics import FinishedRequest, PodMetrics, RecentAverage
from splitserve.pod.registry_publisher import PublisherSettings, RegistryPublisher


def test_first_sample_is_taken_as_is_and_later_ones_by_weight():
    average = RecentAverage(weight=0.25)
    assert average.value is None
    average.add(2.0)
    assert average.value == 2.0
    average.add(6.0)  # 2 + 0.25 * (6 - 2)
    assert average.value == 3.0
    average.add(3.0)
    assert average.value == 3.0


@pytest.mark.parametrize("weight", [0.0, -0.1, 1.5])
def test_weight_outside_zero_one_is_refused(weight):
    with pytest.raises(ValueError, match="weight"):
        RecentAverage(weight)


def _engine_stats() -> EngineStats:
    return EngineStats(0, 0, 10, 10, 0, 0, 0)


def _finished(received: float, first: float | None, gaps: list[float]) -> FinishedRequest:
    """One request as a pod saw it: received, first token, then one token after each gap."""
    output = None
    if first is not None:
        token_times = [first]
        for gap in gaps:
            token_times.append(token_times[-1] + gap)
        timings = RequestTimings(received, first, token_times, token_times[-1])
        output = CompletionOutput(0, "", [1] * len(token_times), "length", None, None, timings)
    return FinishedRequest(received, first, first or received, None, 3, output, None)


def test_finished_requests_feed_the_recent_averages():
    metrics = PodMetrics("decode", "m", _engine_stats)
    metrics.observe_finished(_finished(10.0, 10.5, [0.1, 0.3]))  # TTFT 0.5, mean ITL 0.2
    assert metrics.recent_ttft.value == pytest.approx(0.5)
    assert metrics.recent_itl.value == pytest.approx(0.2)
    metrics.observe_finished(_finished(20.0, 21.5, [0.7]))  # TTFT 1.5, ITL 0.7
    assert metrics.recent_ttft.value == pytest.approx(0.5 + 0.2 * 1.0)
    assert metrics.recent_itl.value == pytest.approx(0.2 + 0.2 * 0.5)
    metrics.observe_finished(_finished(30.0, None, []))  # aborted before a token: no sample
    assert metrics.recent_ttft.value == pytest.approx(0.7)


def test_record_floats_round_trip():
    record = PodRecord("p", "decode", "h:1", 3, recent_ttft_s=0.125, recent_itl_s=0.0375)
    assert PodRecord.from_fields(record.to_fields()) == record
    old_pod = {k: v for k, v in record.to_fields().items() if not k.startswith("recent_")}
    assert PodRecord.from_fields(old_pod).recent_ttft_s == 0.0  # a pod without the fields


def test_heartbeat_publishes_recent_latencies(single_thread, tiny_hf_checkpoint):
    """The publisher's record, built at each heartbeat from the pod's metrics, as the gateway
    and the planner read it back from Redis."""
    llm = AsyncLLM(tiny_hf_checkpoint, kv_cache_bytes=2**20, block_size=16)
    metrics = PodMetrics("decode", "m", llm.stats)
    keys = RegistryKeys("t-recent")
    settings = PublisherSettings(ttl_s=1.0, heartbeat_interval_s=0.05, publish_interval_s=0.01)

    def record() -> PodRecord:
        ttft, itl = metrics.recent_ttft.value or 0.0, metrics.recent_itl.value or 0.0
        return PodRecord("pod-r", "decode", "10.0.0.9:1", 7, recent_ttft_s=ttft, recent_itl_s=itl)

    async def published_after(request: FinishedRequest) -> PodRecord:
        metrics.observe_finished(request)
        pods: list[PodRecord] = []
        for _ in range(250):  # the next heartbeat carries it (every 0.05 s)
            pods = await read_pods(reader, keys)
            if pods and pods[0].recent_ttft_s == pytest.approx(metrics.recent_ttft.value):
                break
            await asyncio.sleep(0.02)
        assert len(pods) == 1, pods
        return pods[0]

    async def scenario() -> tuple[PodRecord, PodRecord]:
        publisher = RegistryPublisher(connect(server.url), llm, record, keys, settings)
        await publisher.start()
        try:
            first = await published_after(_finished(1.0, 1.25, [0.05, 0.05]))
            second = await published_after(_finished(2.0, 3.25, [0.15]))
            return first, second
        finally:
            await publisher.close()

    try:
        with RedisServer() as server:
            reader = connect(server.url)
            first, second = asyncio.run(asyncio.wait_for(scenario(), 60))
    finally:
        llm.shutdown()
    assert (first.recent_ttft_s, first.recent_itl_s) == pytest.approx((0.25, 0.05))
    assert (second.recent_ttft_s, second.recent_itl_s) == pytest.approx((0.45, 0.07))
