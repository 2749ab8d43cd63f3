"""`Router.pick` alone at N pods: its own CPU time, without pods, Redis or polls beside it.

    python -m benchmarks.scale.pick_alone --pods 1000

benchmarks/scale measures a pick inside a gateway that also polls every pod, follows the event
stream and shares the machine with the simulated pods and Redis; on two cores a pick there
mostly waits for a core. This builds the same kind of cluster in memory (30% prefill pods;
every pod holding its own blocks and two sessions, each session behind one of 30 shared system
prompts, so that a system prompt has about 60 holders) and times picks one after another, half
of them of a session's prompt and half of a prompt nobody holds. The pools' stats polls are
imitated as they come at the benchmark's rate (about 600 picks/s): each pool polls 100 pods
per 0.5 s tick (pods.MAX_POLLS_PER_SECOND), so every 300 picks the next 100 pods of each pool
get a new answer (new stats, their dispatch counts restarting).
"""

from __future__ import annotations

import argparse
import asyncio
import random
import time
from dataclasses import dataclass

from splitserve.common.registry_schema import PodRecord, RegistryKeys
from splitserve.engine.kv.block_hash import hash_full_blocks
from splitserve.engine.kv.tiers import Tier
from splitserve.gateway.routing.index_follower import IndexFollower
from splitserve.gateway.routing.pods import Pod, PodPool
from splitserve.gateway.routing.router import Router
from splitserve.v1 import worker_pb2

VOCAB = 50_000
BLOCK_SIZE = 16
NUM_SYSTEM_PROMPTS = 30
NUM_SESSIONS = 300
OWN_BLOCKS_PER_POD = 1000
PICKS_PER_POLL_TICK = 300
PODS_PER_POLL_TICK = 100


@dataclass
class Cluster:
    router: Router
    pools: list[PodPool]
    sessions: list[list[int]]


def build_cluster(num_pods: int, rng: random.Random) -> Cluster:
    systems = [_tokens(rng, 512) for _ in range(NUM_SYSTEM_PROMPTS)]
    sessions = [rng.choice(systems) + _tokens(rng, 256) for _ in range(NUM_SESSIONS)]
    decode, prefill = PodPool("decode", [], "m"), PodPool("prefill", [], "m")
    follower = IndexFollower(None, RegistryKeys())
    for i in range(num_pods):
        pool = prefill if i < num_pods * 3 // 10 else decode
        pod = _pod(i, pool.role, rng)
        pool.pods.append(pod)  # before the pool is first read: its ranking sees it
        held = [h for s in rng.sample(sessions, 2) for h in hash_full_blocks(s, BLOCK_SIZE, "")]
        held += [rng.randbytes(16) for _ in range(OWN_BLOCKS_PER_POD)]
        follower.index.replace_pod(pod.pod_id, 1, {Tier.DEVICE: held})
    follower.is_synced = True
    router = Router(decode, prefill)
    # The index as a synced follower leaves it; no Redis is asked anything.
    router.index_follower, router.redis, router.is_redis_up = follower, object(), True
    return Cluster(router, [decode, prefill], sessions)


def _tokens(rng: random.Random, count: int) -> list[int]:
    return [rng.randrange(VOCAB) for _ in range(count)]


def _pod(index: int, role: str, rng: random.Random) -> Pod:
    record = PodRecord(f"pod-{index:04d}", role, f"10.0.{index // 250}.{index % 250}:1", 1)
    stats = _stats(record.pod_id, rng)
    return Pod(record.address, None, stats=stats, is_serving_model=True, record=record)


def _stats(pod_id: str, rng: random.Random) -> worker_pb2.WorkerStats:
    return worker_pb2.WorkerStats(
        worker_id=pod_id,
        num_running=rng.randrange(8),
        num_waiting=rng.randrange(2),
        kv_blocks_total=1000,
        kv_blocks_free=rng.randrange(200, 1000),
    )


def _poll_tick(pool: PodPool, tick: int, rng: random.Random) -> None:
    """The answers to one tick of `pool`'s polls, as PodPool._poll_one applies them."""
    start = tick * PODS_PER_POLL_TICK
    for offset in range(PODS_PER_POLL_TICK):
        pod = pool.pods[(start + offset) % len(pool.pods)]
        pod.stats, pod.num_dispatched = _stats(pod.pod_id, rng), 0


async def time_picks(cluster: Cluster, num_picks: int, rng: random.Random) -> list[float]:
    """Milliseconds per pick."""
    times = []
    for k in range(num_picks):
        # A session's next turn, or a prompt nobody holds.
        prompt = rng.choice(cluster.sessions) + _tokens(rng, 32) if k % 2 else _tokens(rng, 300)
        start = time.perf_counter()
        picked = await cluster.router.pick(prompt)
        times.append((time.perf_counter() - start) * 1000)
        if picked is None:
            raise RuntimeError("a pick found no pod")
        if k % PICKS_PER_POLL_TICK == 0:
            for pool in cluster.pools:
                _poll_tick(pool, k // PICKS_PER_POLL_TICK, rng)
        if (k + 1) % 1000 == 0:
            print(f"  {k + 1}/{num_picks} picks", flush=True)
    return times


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--pods", type=int, nargs="+", default=[1000])
    parser.add_argument("--picks", type=int, default=3000)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    for num_pods in args.pods:
        rng = random.Random(args.seed)
        print(f"building {num_pods} pods' index", flush=True)
        cluster = build_cluster(num_pods, rng)
        times = sorted(asyncio.run(time_picks(cluster, args.picks, rng))[200:])  # warm
        p50, p99 = times[len(times) // 2], times[int(len(times) * 0.99)]
        mean = sum(times) / len(times)
        print(f"pods {num_pods}: pick alone p50 {p50:.3f} ms, p99 {p99:.3f} ms, mean {mean:.3f} ms")


if __name__ == "__main__":
    main()
