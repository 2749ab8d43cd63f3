"""The gateway's view of the worker pods: a gRPC channel each, their latest stats (polled), and
a least-load pick. The routing issue (prefix-cache index, proximity) replaces `pick`."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

import grpc
from splitserve.v1 import worker_pb2, worker_pb2_grpc

from services.common.channels import aio_channel

logger = logging.getLogger(__name__)

POLL_INTERVAL_SECONDS = 0.5
STATS_TIMEOUT_SECONDS = 2.0


@dataclass
class Worker:
    address: str  # "host:port" of the pod's gRPC server
    stub: worker_pb2_grpc.DecodeWorkerStub | worker_pb2_grpc.PrefillWorkerStub
    # The latest answer to GetStats; None before the first one and after a failed poll.
    stats: worker_pb2.WorkerStats | None = None
    # Requests this gateway sent since `stats` was taken: the stats do not count them yet, and
    # without them every request between two polls would land on the same pod.
    num_dispatched: int = 0
    is_serving_model: bool = False  # stats name the gateway's model

    @property
    def is_available(self) -> bool:
        return self.stats is not None and self.is_serving_model

    @property
    def load(self) -> tuple[int, float]:
        """Queued work first, then KV cache use; lower is lighter."""
        assert self.stats is not None, "only available workers have a load"
        stats = self.stats
        queued = stats.num_running + stats.num_waiting + self.num_dispatched
        kv_usage = 1.0 - stats.kv_blocks_free / max(stats.kv_blocks_total, 1)
        return queued, kv_usage


class WorkerPool:
    """One role's pods. Owned by one event loop: `start` there, then `pick` from handlers."""

    def __init__(self, role: str, addresses: list[str], model_name: str) -> None:
        self.role = role
        self.model_name = model_name
        self.addresses = list(addresses)
        self.workers: list[Worker] = []
        self._channels: list[grpc.aio.Channel] = []
        self._poller: asyncio.Task | None = None

    async def start(self) -> None:
        stub_class = (
            worker_pb2_grpc.DecodeWorkerStub
            if self.role == "decode"
            else worker_pb2_grpc.PrefillWorkerStub
        )
        for address in self.addresses:
            channel = aio_channel(address)
            self._channels.append(channel)
            self.workers.append(Worker(address, stub_class(channel)))
        await self.poll()
        self._poller = asyncio.create_task(self._poll_forever(), name=f"poll-{self.role}")

    async def close(self) -> None:
        if self._poller is not None:
            self._poller.cancel()
        for channel in self._channels:
            await channel.close()

    def available(self) -> list[Worker]:
        return [worker for worker in self.workers if worker.is_available]

    def pick(self) -> Worker | None:
        """The least loaded available worker (counted as dispatched), or None."""
        candidates = self.available()
        if not candidates:
            return None
        worker = min(candidates, key=lambda w: w.load)
        worker.num_dispatched += 1
        return worker

    @property
    def max_model_len(self) -> int | None:
        """The context every available pod can serve: the smallest of theirs."""
        lengths = [worker.stats.max_model_len for worker in self.available()]
        return min(lengths) if lengths else None

    async def poll(self) -> None:
        await asyncio.gather(*(self._poll_one(worker) for worker in self.workers))

    async def _poll_forever(self) -> None:
        while True:
            await asyncio.sleep(POLL_INTERVAL_SECONDS)
            await self.poll()

    async def _poll_one(self, worker: Worker) -> None:
        try:
            stats = await worker.stub.GetStats(
                worker_pb2.StatsRequest(), timeout=STATS_TIMEOUT_SECONDS
            )
        except grpc.aio.AioRpcError as error:
            if worker.stats is not None:
                logger.warning(
                    "%s pod %s is unreachable: %s", self.role, worker.address, error.code()
                )
            worker.stats = None
            return
        if worker.stats is None:
            logger.info("%s pod %s is up (%s)", self.role, worker.address, stats.worker_id)
        serving = stats.model == self.model_name
        if not serving and (worker.stats is None or worker.is_serving_model):
            logger.warning(
                "%s pod %s serves %r, not %r: not routing to it",
                self.role,
                worker.address,
                stats.model,
                self.model_name,
            )
        worker.stats, worker.num_dispatched, worker.is_serving_model = stats, 0, serving
