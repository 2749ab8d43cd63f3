"""Simulated decode pods: each a real grpc.aio server on its own loopback port (the gateway
keys pods by address) and a real `RegistryPublisher`, so they register, heartbeat and publish
block events exactly as real pods do; only the engine is replaced (`SimCache`, a load model,
synthetic tokens at `step_s` each). Many of them share one process and one event loop.

Load model (what GetStats and the heartbeat report): the requests streaming now plus a seeded
background count per pod; requests past `max_batch` wait; KV blocks in use are those of the
running requests (cached blocks no request holds count as free, as the engine reports them).
"""

from __future__ import annotations

import asyncio
import random
from dataclasses import dataclass, field

import grpc

from benchmarks.scale.cache import SimCache
from splitserve.common.pod_load import PodLoad
from splitserve.common.registry_schema import PodRecord, RegistryKeys, connect
from splitserve.engine.kv.block_hash import hash_full_blocks
from splitserve.pod.registry_publisher import PublisherSettings, RegistryPublisher, new_generation
from splitserve.v1 import generate_pb2, worker_pb2, worker_pb2_grpc

MAX_PODS = 2000  # one process, one port each: more belongs on several machines


@dataclass(frozen=True)
class SimPodSettings:
    model: str = "sim-model"
    block_size: int = 16
    capacity_blocks: int = 2048  # the simulated KV cache, in blocks
    step_s: float = 0.002  # per generated token
    default_max_tokens: int = 4
    max_batch: int = 64  # running requests past this wait
    max_background_running: int = 8  # seeded per pod: load that is not ours
    max_model_len: int = 32768
    zones: tuple[str, ...] = ("a", "b", "c")
    publisher: PublisherSettings = field(
        default_factory=lambda: PublisherSettings(
            ttl_s=10.0, heartbeat_interval_s=2.0, publish_interval_s=0.1
        )
    )

    def __post_init__(self) -> None:
        if self.step_s < 0 or self.max_batch < 1 or self.block_size < 1:
            raise ValueError("step_s >= 0, max_batch >= 1 and block_size >= 1")


class SimPod(worker_pb2_grpc.DecodeWorkerServicer):
    """One decode pod. `start()` binds 127.0.0.1:<free port> and registers; `close()` undoes."""

    def __init__(
        self,
        index: int,
        settings: SimPodSettings,
        redis_url: str,
        keys: RegistryKeys | None = None,
        seed: int = 0,
    ) -> None:
        self.index = index
        self.settings = settings
        self.pod_id = f"sim-decode-{index}"
        self.zone = settings.zones[index % len(settings.zones)]
        self.cache = SimCache(settings.capacity_blocks, settings.block_size)
        self.keys = keys or RegistryKeys()
        self.redis_url = redis_url
        self.background_running = random.Random(seed * 100003 + index).randint(
            0, settings.max_background_running
        )
        self.num_streaming = 0
        self.num_streaming_blocks = 0
        self.num_requests = 0
        self.address = ""
        self.generation = new_generation() + index  # distinct even when started together
        self._server: grpc.aio.Server | None = None
        self.publisher: RegistryPublisher | None = None

    async def start(self) -> None:
        server = grpc.aio.server()
        worker_pb2_grpc.add_DecodeWorkerServicer_to_server(self, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        self._server, self.address = server, f"127.0.0.1:{port}"
        self.publisher = RegistryPublisher(
            connect(self.redis_url, timeout_s=5.0),
            self.cache,
            self.record,
            self.keys,
            self.settings.publisher,
        )
        await self.publisher.start()

    async def close(self) -> None:
        if self.publisher is not None:
            await self.publisher.close()
        if self._server is not None:
            await self._server.stop(grace=None)

    # ---- the load model ----------------------------------------------------------------------

    def load(self) -> PodLoad:
        num_queued = self.num_streaming + self.background_running
        running = min(num_queued, self.settings.max_batch)
        total = self.settings.capacity_blocks
        return PodLoad(
            num_running=running,
            num_waiting=num_queued - running,
            kv_blocks_total=total,
            kv_blocks_free=max(total - self.num_streaming_blocks, 0),
        )

    def record(self) -> PodRecord:
        """What the publisher heartbeats, the fields a real pod's `start_registry` fills."""
        return PodRecord(
            pod_id=self.pod_id,
            role="decode",
            address=self.address,
            generation=self.generation,
            model=self.settings.model,
            kv_transport="tcp",
            zone=self.zone,
            node="127.0.0.1",
            block_size=self.settings.block_size,
            load=self.load(),
        )

    # ---- DecodeWorker ------------------------------------------------------------------------

    async def GetStats(self, request: worker_pb2.StatsRequest, context) -> worker_pb2.WorkerStats:
        return worker_pb2.WorkerStats(
            worker_id=self.pod_id,
            role="decode",
            model=self.settings.model,
            max_model_len=self.settings.max_model_len,
            block_size=self.settings.block_size,
            vocab_size=32000,
            kv_transport="tcp",
            zone=self.zone,
            tensor_parallel_size=1,
            pipeline_parallel_size=1,
            **self.load().as_fields(),
        )

    async def Abort(self, request: worker_pb2.AbortRequest, context) -> worker_pb2.AbortResponse:
        return worker_pb2.AbortResponse(found=False)

    async def Decode(self, request: worker_pb2.DecodeRequest, context):
        prompt = list(request.prompt_token_ids)
        if not prompt:
            raise ValueError("prompt_token_ids is empty")
        hashes = hash_full_blocks(prompt, self.settings.block_size, "")
        num_cached = self.cache.cached_prefix(hashes) * self.settings.block_size
        self.cache.store(hashes)
        self.num_requests += 1
        num_tokens = request.sampling.max_tokens or self.settings.default_max_tokens
        self.num_streaming += 1
        self.num_streaming_blocks += len(hashes)
        try:
            for step in range(num_tokens):
                await asyncio.sleep(self.settings.step_s)
                token = (sum(prompt[-4:]) + step) % 32000
                if step < num_tokens - 1:
                    yield worker_pb2.DecodeResponse(token_ids=[token], text=f" t{token}")
            usage = generate_pb2.Usage(
                prompt_tokens=len(prompt), completion_tokens=num_tokens, cached_tokens=num_cached
            )
            yield worker_pb2.DecodeResponse(
                token_ids=[token],
                text=f" t{token}",
                finish_reason="length",
                usage=usage,
                prefill_mode="local",
            )
        finally:
            self.num_streaming -= 1
            self.num_streaming_blocks -= len(hashes)


async def start_pods(
    num_pods: int,
    settings: SimPodSettings,
    redis_url: str,
    keys: RegistryKeys | None = None,
    seed: int = 0,
) -> list[SimPod]:
    """`num_pods` pods, started in batches so a thousand do not open a thousand Redis
    connections in one instant."""
    if not 1 <= num_pods <= MAX_PODS:
        raise ValueError(f"num_pods must be in 1..{MAX_PODS}")
    pods = [SimPod(i, settings, redis_url, keys, seed) for i in range(num_pods)]
    for start in range(0, num_pods, 100):
        await asyncio.gather(*(pod.start() for pod in pods[start : start + 100]))
    return pods


async def close_pods(pods: list[SimPod]) -> None:
    for start in range(0, len(pods), 100):
        await asyncio.gather(*(pod.close() for pod in pods[start : start + 100]))
