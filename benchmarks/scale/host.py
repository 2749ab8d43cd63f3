"""The simulated pods in a process of their own, so the router under test does not share an
event loop (and, on a machine with cores to spare, a core) with a thousand pods' servers and
publishers. The benchmark drives it over a pipe: seed the caches, start and stop the churn,
ask the oracle, read each pod's id, generation and cache size."""

from __future__ import annotations

import asyncio
import multiprocessing
import random
from dataclasses import dataclass

from benchmarks.scale.sim_pod import SimPod, SimPodSettings, close_pods, start_pods
from benchmarks.scale.workload import oracle_cached_blocks
from splitserve.common.registry_schema import RegistryKeys
from splitserve.engine.kv.block_hash import BlockHash, hash_full_blocks

START_TIMEOUT_S = 300.0


@dataclass(frozen=True)
class PodInfo:
    pod_id: str
    generation: int
    num_blocks: int  # in its cache now


@dataclass(frozen=True)
class Prefixes:
    chosen: int  # blocks of the prompt the chosen pod holds
    best: int  # the most any pod holds: the oracle's


class PodHost:
    """`await PodHost.start(...)`, then the calls below; `close()` stops the pods and process."""

    def __init__(self, process, conn) -> None:
        self._process = process
        self._conn = conn

    @classmethod
    async def start(
        cls, num_pods: int, settings: SimPodSettings, redis_url: str, prefix: str, seed: int
    ) -> PodHost:
        context = multiprocessing.get_context("spawn")
        parent, child = context.Pipe()
        process = context.Process(
            target=_serve, args=(child, num_pods, settings, redis_url, prefix, seed), daemon=True
        )
        process.start()
        host = cls(process, parent)
        await asyncio.wait_for(host._call("info"), START_TIMEOUT_S)
        return host

    async def _call(self, command: str, *args):
        self._conn.send((command, args))
        return await asyncio.to_thread(self._conn.recv)

    async def info(self) -> list[PodInfo]:
        return await self._call("info")

    async def seed(self, chains_by_pod: list[list[list[BlockHash]]]) -> int:
        """Stores each pod's chains in its cache; returns the blocks held in all."""
        return await self._call("seed", chains_by_pod)

    async def prefixes(self, hashes: list[BlockHash], chosen_pod_id: str) -> Prefixes:
        return await self._call("prefixes", hashes, chosen_pod_id)

    async def start_churn(self, blocks_per_s: float) -> None:
        await self._call("churn", blocks_per_s)

    async def stop_churn(self) -> None:
        await self._call("stop_churn")

    async def num_events(self) -> int:
        """Blocks stored and removed since the pods started, over all pods."""
        return await self._call("events")

    async def close(self) -> None:
        try:
            await asyncio.wait_for(self._call("close"), 60)
        finally:
            self._process.join(timeout=10)
            if self._process.is_alive():
                self._process.kill()


def _serve(conn, num_pods, settings, redis_url, prefix, seed) -> None:
    asyncio.run(_serve_async(conn, num_pods, settings, redis_url, prefix, seed))


async def _serve_async(conn, num_pods, settings, redis_url, prefix, seed) -> None:
    pods = await start_pods(num_pods, settings, redis_url, RegistryKeys(prefix), seed)
    by_id = {pod.pod_id: pod for pod in pods}
    caches = [pod.cache for pod in pods]
    stop, churner = asyncio.Event(), None
    while True:
        command, args = await asyncio.to_thread(conn.recv)
        reply: object = None  # each command's own answer, over the pipe
        if command == "info":
            reply = [PodInfo(p.pod_id, p.generation, len(p.cache)) for p in pods]
        elif command == "seed":
            for pod, chains in zip(pods, args[0], strict=True):
                for chain in chains:
                    pod.cache.store(chain)
            reply = sum(len(cache) for cache in caches)
        elif command == "prefixes":
            hashes, chosen = args
            reply = Prefixes(
                by_id[chosen].cache.cached_prefix(hashes), oracle_cached_blocks(caches, hashes)
            )
        elif command == "churn":
            stop = asyncio.Event()
            churner = asyncio.create_task(churn(pods, args[0], stop, seed))
        elif command == "stop_churn" and churner is not None:
            stop.set()
            await churner
        elif command == "events":
            reply = sum(p.cache.num_stored + p.cache.num_removed for p in pods)
        elif command == "close":
            await close_pods(pods)
            conn.send(None)
            return
        conn.send(reply)


async def churn(pods: list[SimPod], blocks_per_s: float, stop: asyncio.Event, seed: int) -> None:
    """Fresh 8-block chains onto random pods at `blocks_per_s`: sessions this router never
    sees (other gateways' traffic), which make the pods store and evict."""
    rng = random.Random(seed)
    interval = 8 / blocks_per_s
    while not stop.is_set():
        pod = rng.choice(pods)
        tokens = [rng.randrange(1, 32000) for _ in range(8 * pod.settings.block_size)]
        pod.cache.store(hash_full_blocks(tokens, pod.settings.block_size, ""))
        await asyncio.sleep(interval)
