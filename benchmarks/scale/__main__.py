"""`python -m benchmarks.scale --pods 10 100 1000 [--quick]`: the real router and a real
redis-server over simulated decode pods (benchmarks/scale/sim_pod.py), one size at a time, each
on a fresh Redis. Per size it prints:

- routing decision p50/p99: `Router.pick` from the prompt's tokens to the chosen pod (hashing,
  the index lookup, scoring), timed in this process under a Poisson load. `--lookup index`
  (the default, as the gateway runs): the gateway's in-memory prefix index fed by the block-
  event stream (services/gateway/routing/prefix_index.py), synced before routing starts;
  `--lookup script`: the per-request Redis script over every pod that it replaced;
- Redis bytes per pod (INFO memory, registered with empty caches: record, registry entry,
  sentinel SET, the pod's connection) and per indexed block (MEMORY USAGE of the block SETs
  after seeding the caches, over the blocks they hold);
- Redis commands per routed request (INFO commandstats deltas over the routing phase, minus an
  idle window of equal length that counts the pods' heartbeats and the gateway's registry
  reads; commands run inside Lua scripts count one each);
- block events ingested per second (stored + removed, by the churn the pods publish) and
  whether the Redis index, and the gateway's, matched every pod's cache once the churn stopped;
- prefix hit rate: cached blocks on the chosen pod over prompt blocks, against an oracle that
  reads every pod's cache and takes the best;
- router req/s: closed-loop `pick` calls on this process's one core for a second (an upper
  bound on one gateway core: no HTTP, no tokenizing).

It ends with one line per size, `pods N: routing p99 X ms, gateway Y req/s`, where Y is that
closed-loop rate, and writes a PNG of the curves. The pods run in a process of their own
(benchmarks/scale/host.py); on a machine with few cores they still take CPU from the router.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import random
import statistics
import time
from dataclasses import dataclass, field

from benchmarks.scale import scan_lookup
from benchmarks.scale.host import PodHost
from benchmarks.scale.sim_pod import SimPodSettings
from benchmarks.scale.workload import Workload, WorkloadSettings
from splitserve.common.redis_server import RedisServer
from splitserve.common.registry_schema import RegistryKeys, cached_prefixes, connect
from splitserve.gateway.routing.pods import PodPool
from splitserve.gateway.routing.prefix_index import PrefixIndex
from splitserve.gateway.routing.router import Router, RouterSettings
from splitserve.v1 import generate_pb2, worker_pb2


@dataclass(frozen=True)
class RunSettings:
    blocks_per_pod: int  # seeded into each pod's cache before routing
    num_requests: int
    request_rate: float  # Poisson arrivals per second
    churn_blocks_per_s: float  # fresh blocks stored across the cluster per second
    stats_poll_s: float = 2.0  # the gateway's GetStats interval per pod (its default: 0.5)
    lookup: str = "index"  # "index": the gateway's event-fed index; "script": Redis per request
    max_tokens: int = 4
    seed: int = 0


@dataclass
class SizeResult:
    num_pods: int
    num_blocks: int = 0
    routing_ms: list[float] = field(default_factory=list)
    bytes_per_pod: float = 0.0
    bytes_per_block: float = 0.0
    stream_bytes: int = 0  # the block-event stream's MEMORY USAGE after seeding (capped)
    ops_per_request: dict[str, float] = field(default_factory=dict)
    events_per_s: float = 0.0
    is_index_consistent: bool = False
    is_gateway_index_consistent: bool | None = None  # None: --lookup script
    hit_blocks: int = 0
    oracle_blocks: int = 0
    prompt_blocks: int = 0
    picks_per_s: float = 0.0
    num_pick_errors: int = 0
    # lookup name -> (ms per lookup p50, Redis commands per lookup, argument bytes per lookup)
    lookups: dict[str, tuple[float, float, int]] = field(default_factory=dict)

    def percentile(self, q: float) -> float:
        ordered = sorted(self.routing_ms)
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else math.nan


async def used_memory(client) -> int:
    return int((await client.info("memory"))["used_memory"])


async def index_bytes(client, keys: RegistryKeys, host: PodHost) -> int:
    """MEMORY USAGE of every pod's block SET, summed (exact: SAMPLES 0 counts every member)."""
    pipe = client.pipeline(transaction=False)
    for pod in await host.info():
        pipe.memory_usage(keys.blocks(pod.pod_id, pod.generation), samples=0)
    return sum(size or 0 for size in await pipe.execute())


async def command_calls(client) -> dict[str, int]:
    stats = await client.info("commandstats")
    return {name.removeprefix("cmdstat_"): int(value["calls"]) for name, value in stats.items()}


async def wait_index_matches(client, keys: RegistryKeys, host: PodHost, timeout_s: float):
    """True once every pod's block SET holds its cache's blocks and the sentinel."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        pods = await host.info()
        pipe = client.pipeline(transaction=False)
        for pod in pods:
            pipe.scard(keys.blocks(pod.pod_id, pod.generation))
        sizes = await pipe.execute()
        if all(size == pod.num_blocks + 1 for size, pod in zip(sizes, pods, strict=True)):
            return True
        await asyncio.sleep(0.2)
    return False


def seed_chains(num_pods: int, workload: Workload, blocks_per_pod: int) -> list[list]:
    """Sessions onto pods round robin until each holds about `blocks_per_pod` blocks: the
    chains of block hashes each pod's cache is seeded with."""
    num_sessions = max(1, blocks_per_pod // max(workload.settings.session_blocks, 1))
    chains: list[list] = [[] for _ in range(num_pods)]
    for _ in range(num_sessions):
        for pod_chains in chains:
            pod_chains.append(workload.hashes(workload.session_tokens[workload.new_session()]))
    return chains


async def serve(picked, prompt: list[int], max_tokens: int) -> list[int]:
    request = worker_pb2.DecodeRequest(
        request_id=f"r{random.getrandbits(48)}",
        prompt_token_ids=prompt,
        sampling=generate_pb2.SamplingOptions(max_tokens=max_tokens),
    )
    tokens: list[int] = []
    async for response in picked.decode.decode_stub.Decode(request, timeout=30):
        tokens.extend(response.token_ids)
    return tokens


async def route_requests(
    router: Router, host: PodHost, workload: Workload, run: RunSettings, result: SizeResult
) -> None:
    rng = random.Random(run.seed + 1)
    in_flight: set[asyncio.Task] = set()
    for _ in range(run.num_requests):
        session, prompt = workload.next_prompt()
        lookup = workload.hashes(prompt[:-1])
        start = time.perf_counter()
        try:
            picked = await router.pick(prompt)
        except AssertionError:
            # A router invariant broken under load (as a poll failing during the index
            # lookup once did, at 1,000 pods): counted, not hidden.
            result.num_pick_errors += 1
            continue
        if picked is None:  # every pod's latest poll failed: polls time out under load
            result.num_pick_errors += 1
            continue
        result.routing_ms.append((time.perf_counter() - start) * 1000)
        prefixes = await host.prefixes(lookup, picked.decode.pod_id)
        result.hit_blocks += prefixes.chosen
        result.oracle_blocks += prefixes.best
        result.prompt_blocks += len(lookup)
        task = asyncio.create_task(_serve_and_grow(picked, session, prompt, workload, run))
        in_flight.add(task)
        task.add_done_callback(in_flight.discard)
        await asyncio.sleep(rng.expovariate(run.request_rate))
    await asyncio.gather(*in_flight)


async def _serve_and_grow(picked, session, prompt, workload: Workload, run: RunSettings):
    workload.answered(session, prompt, await serve(picked, prompt, run.max_tokens))


async def closed_loop_picks(router: Router, workload: Workload, seconds: float) -> float:
    prompts = [workload.next_prompt()[1] for _ in range(64)]
    count, num_picked, deadline = 0, 0, time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        num_picked += await router.pick(prompts[count % len(prompts)]) is not None
        count += 1
    return num_picked / seconds  # a pick that found no pod does not count


LOOKUPS = {
    "scan (the lookup before issue 39)": scan_lookup.cached_prefixes,
    "LOOKUP_SCRIPT (registry_schema)": cached_prefixes,
}


async def compare_lookups(
    client,
    keys: RegistryKeys,
    host: PodHost,
    workload: Workload,
    index: PrefixIndex | None = None,
    num_prompts: int = 40,
) -> dict[str, tuple[float, float, int]]:
    """Each lookup over every pod for the same prompts, churn stopped. Commands: one pass per
    lookup (the pods' heartbeats meanwhile count too, a few per second). Times: the lookups
    alternate prompt by prompt, so a busy machine slows both alike. With the gateway's
    `index`, its lookup too (no Redis command), checked against the script's answers."""
    prompts = [workload.next_prompt()[1] for _ in range(num_prompts)]
    pods = await host.info()
    queries = [
        [(keys.tier_blocks(p.pod_id, p.generation), workload.hashes(prompt[:-1])) for p in pods]
        for prompt in prompts
    ]
    answers: dict[str, list] = {}
    calls: dict[str, float] = {}
    for name, lookup in LOOKUPS.items():
        before = await command_calls(client)
        answers[name] = [await lookup(client, query) for query in queries]
        calls[name] = sum(ops_delta(before, await command_calls(client)).values()) / len(queries)
    first, second = answers.values()
    assert first == second, "both lookups agree"
    times: dict[str, list[float]] = {name: [] for name in LOOKUPS}
    for query in queries:
        for name, lookup in LOOKUPS.items():
            start = time.perf_counter()
            await lookup(client, query)
            times[name].append((time.perf_counter() - start) * 1000)
    result = {
        name: (statistics.median(times[name]), calls[name], _argument_bytes(name, queries[0]))
        for name in LOOKUPS
    }
    if index is not None:
        local = _index_lookup(index, pods)
        assert [local(q) for q in queries] == [
            [prefix.num_blocks for prefix in answer] for answer in second
        ], "the gateway's index answers as the script"
        local_ms = []
        for query in queries:
            start = time.perf_counter()
            local(query)
            local_ms.append((time.perf_counter() - start) * 1000)
        result["gateway index (prefix_index.py)"] = (statistics.median(local_ms), 0.0, 0)
    return result


def _index_lookup(index: PrefixIndex, pods: list):
    """A lookup query (per pod: its SET keys, the prompt's hashes) on the gateway's index:
    blocks per pod, in the query's pod order."""
    generations = {pod.pod_id: pod.generation for pod in pods}

    def lookup(query) -> list[int]:
        found = index.lookup(query[0][1], generations)
        return [found[p.pod_id].num_blocks if p.pod_id in found else 0 for p in pods]

    return lookup


def _argument_bytes(name: str, query) -> int:
    """Hash bytes a lookup sends: the prompt once per pod, or once plus a byte per pod."""
    if LOOKUPS[name] is scan_lookup.cached_prefixes:
        return 16 * sum(len(hashes) for _, hashes in query)
    return 16 * len(query[0][1]) + len(query)


def ops_delta(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    return {name: after.get(name, 0) - before.get(name, 0) for name in after}


async def measure_size(
    num_pods: int,
    run: RunSettings,
    pod_settings: SimPodSettings,
    workload_settings: WorkloadSettings,
) -> SizeResult:
    result = SizeResult(num_pods)
    keys = RegistryKeys()
    with RedisServer() as redis_server:
        client = connect(redis_server.url, timeout_s=30)
        baseline = await used_memory(client)
        host = await PodHost.start(num_pods, pod_settings, redis_server.url, keys.prefix, run.seed)
        try:
            await wait_index_matches(client, keys, host, 60)
            registered = await used_memory(client)
            result.bytes_per_pod = (registered - baseline) / num_pods
            workload = Workload(workload_settings, run.seed)
            result.num_blocks = await host.seed(seed_chains(num_pods, workload, run.blocks_per_pod))
            await wait_index_matches(client, keys, host, 120)
            result.bytes_per_block = await index_bytes(client, keys, host) / result.num_blocks
            result.stream_bytes = await client.memory_usage(keys.block_events, samples=0) or 0
            await _route_phase(client, keys, host, workload, run, pod_settings, result)
        finally:
            await host.close()
            await client.aclose()
    return result


async def _route_phase(client, keys, host, workload, run, pod_settings, result: SizeResult):
    pool = PodPool("decode", [], pod_settings.model, poll_interval_s=run.stats_poll_s)
    settings = RouterSettings(
        redis_url=_url(client),
        use_local_index=run.lookup == "index",
        freeze_heap_after_index_sync=True,  # as the gateway's main runs it
    )
    router = Router(pool, None, settings, keys)
    await pool.start()
    await router.start()
    try:
        await wait_all_available(pool, result.num_pods, 60)
        if run.lookup == "index" and not await wait_gateway_index(router, host, 120):
            raise RuntimeError("the gateway's prefix index did not sync with the pods")
        idle_start, idle_t0 = await command_calls(client), time.perf_counter()
        await asyncio.sleep(1.0)
        idle = ops_delta(idle_start, await command_calls(client))
        idle_s = time.perf_counter() - idle_t0
        events0 = await host.num_events()
        await host.start_churn(run.churn_blocks_per_s)
        before, t0 = await command_calls(client), time.perf_counter()
        await route_requests(router, host, workload, run, result)
        busy = ops_delta(before, await command_calls(client))
        busy_s = time.perf_counter() - t0
        await host.stop_churn()
        result.events_per_s = (await host.num_events() - events0) / busy_s
        result.ops_per_request = _per_request(busy, busy_s, idle, idle_s, run.num_requests)
        result.is_index_consistent = await wait_index_matches(client, keys, host, 10)
        if run.lookup == "index":
            result.is_gateway_index_consistent = await wait_gateway_index(router, host, 10)
        result.picks_per_s = await closed_loop_picks(router, workload, 1.0)
        follower = router.index_follower
        index = follower.index if follower is not None and follower.is_synced else None
        result.lookups = await compare_lookups(client, keys, host, workload, index)
    finally:
        await router.close()
        await pool.close()


async def wait_gateway_index(router: Router, host: PodHost, timeout_s: float) -> bool:
    """True once the router's index is synced and holds every pod's cache (by count)."""
    follower = router.index_follower
    assert follower is not None, "only with --lookup index"
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        pods = await host.info()
        if follower.is_synced and all(
            follower.index.generation(pod.pod_id) == pod.generation
            and follower.index.num_pod_blocks(pod.pod_id) == pod.num_blocks
            for pod in pods
        ):
            return True
        await asyncio.sleep(0.2)
    return False


async def wait_all_available(pool: PodPool, num_pods: int, timeout_s: float) -> None:
    """The first polls of a thousand pods that share this event loop may time out: poll again
    until the router sees every pod."""
    deadline = time.monotonic() + timeout_s
    while len(pool.available()) < num_pods:
        if time.monotonic() > deadline:
            raise RuntimeError(f"only {len(pool.available())} of {num_pods} pods answered")
        await pool.poll()


def _per_request(busy, busy_s, idle, idle_s, num_requests) -> dict[str, float]:
    """Commands per routed request by name, the background rate (idle window) taken out."""
    per = {}
    for name, calls in busy.items():
        background = idle.get(name, 0) * busy_s / idle_s
        per[name] = max(calls - background, 0.0) / num_requests
    per["total"] = sum(per.values())
    return per


def _url(client) -> str:
    kwargs = client.connection_pool.connection_kwargs
    return f"redis://{kwargs['host']}:{kwargs['port']}/0"


def report(result: SizeResult, lookup: str) -> None:
    ops = result.ops_per_request
    top = sorted(((v, k) for k, v in ops.items() if k != "total" and v >= 0.05), reverse=True)
    hit = result.hit_blocks / max(result.prompt_blocks, 1)
    oracle = result.oracle_blocks / max(result.prompt_blocks, 1)
    print(f"== {result.num_pods} pods, {result.num_blocks} indexed blocks, lookup: {lookup}")
    print(
        f"  routing decision: p50 {result.percentile(0.5):.2f} ms, "
        f"p99 {result.percentile(0.99):.2f} ms ({len(result.routing_ms)} requests, "
        f"{result.num_pick_errors} picks found no pod)"
    )
    print(
        f"  redis memory: {result.bytes_per_pod:.0f} B per pod (empty cache), "
        f"{result.bytes_per_block:.1f} B per indexed block, block-event stream "
        f"{result.stream_bytes / 2**20:.1f} MiB (capped: BLOCK_EVENTS_MAXLEN entries)"
    )
    print(
        f"  redis commands per routed request: {ops.get('total', 0):.1f} ("
        + ", ".join(f"{name} {value:.1f}" for value, name in top[:4])
        + ")"
    )
    gateway_index = (
        ""
        if result.is_gateway_index_consistent is None
        else f", gateway's index too: {result.is_gateway_index_consistent}"
    )
    print(
        f"  block events ingested: {result.events_per_s:.0f}/s; index matches every cache "
        f"after: {result.is_index_consistent}{gateway_index}"
    )
    print(
        f"  prefix hit rate: router {hit:.1%}, oracle {oracle:.1%} "
        f"({result.hit_blocks / max(result.oracle_blocks, 1):.1%} of the oracle's)"
    )
    print(f"  router closed loop: {result.picks_per_s:.0f} picks/s")
    for name, (ms, calls, arg_bytes) in result.lookups.items():
        print(f"  {name}: p50 {ms:.2f} ms, {calls:.0f} commands, {arg_bytes} B of hashes")
    print(end="", flush=True)


def plot(results: list[SizeResult], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = [r.num_pods for r in results]
    fig, axes = plt.subplots(1, 4, figsize=(16, 3.6))
    axes[0].plot(sizes, [r.percentile(0.5) for r in results], "o-", label="p50")
    axes[0].plot(sizes, [r.percentile(0.99) for r in results], "o-", label="p99")
    axes[0].set(title="routing decision (ms)", xscale="log", yscale="log")
    axes[0].legend()
    axes[1].plot(
        sizes, [r.ops_per_request.get("total", 0) for r in results], "o-", label="routed request"
    )
    for name in LOOKUPS:
        axes[1].plot(
            sizes, [r.lookups[name][1] for r in results], "o--", label=name.split()[0].lower()
        )
    axes[1].legend(fontsize=7)
    axes[1].set(title="Redis commands per request", xscale="log", yscale="log")
    axes[2].plot(sizes, [r.bytes_per_block for r in results], "o-", label="per block")
    axes[2].set(title="Redis bytes per indexed block", xscale="log")
    axes[3].plot(
        sizes, [r.hit_blocks / max(r.prompt_blocks, 1) for r in results], "o-", label="router"
    )
    axes[3].plot(
        sizes, [r.oracle_blocks / max(r.prompt_blocks, 1) for r in results], "o--", label="oracle"
    )
    axes[3].set(title="prefix hit rate", xscale="log", ylim=(0, 1))
    axes[3].legend()
    for axis in axes:
        axis.set_xlabel("pods")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.scale", description=__doc__)
    parser.add_argument("--pods", type=int, nargs="+", default=None)
    parser.add_argument(
        "--quick",
        action="store_true",
        help="small caches, few requests, 10 and 100 pods unless --pods",
    )
    parser.add_argument("--blocks-per-pod", type=int, default=None)
    parser.add_argument("--requests", type=int, default=None)
    parser.add_argument("--rate", type=float, default=None, help="requests per second")
    parser.add_argument("--churn", type=float, default=None, help="blocks stored per second")
    parser.add_argument("--step-ms", type=float, default=2.0, help="per generated token")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--stats-poll-s", type=float, default=2.0, help="the router's GetStats interval per pod"
    )
    parser.add_argument(
        "--lookup",
        choices=("index", "script"),
        default="index",
        help="index: the gateway's event-fed prefix index (default); script: the per-request "
        "Redis script it replaced",
    )
    parser.add_argument("--plot", default="build/scale.png")
    return parser.parse_args(argv)


def run_settings(args: argparse.Namespace) -> RunSettings:
    quick = args.quick
    return RunSettings(
        blocks_per_pod=args.blocks_per_pod or (100 if quick else 1000),
        num_requests=args.requests or (200 if quick else 2000),
        request_rate=args.rate or (100.0 if quick else 200.0),
        churn_blocks_per_s=args.churn or (400.0 if quick else 4000.0),
        stats_poll_s=args.stats_poll_s,
        lookup=args.lookup,
        seed=args.seed,
    )


async def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    sizes = args.pods or ([10, 100] if args.quick else [10, 100, 1000])
    run = run_settings(args)
    pod_settings = SimPodSettings(
        capacity_blocks=max(2 * run.blocks_per_pod, 64), step_s=args.step_ms / 1000
    )
    workload_settings = WorkloadSettings()
    results = []
    for num_pods in sizes:
        results.append(await measure_size(num_pods, run, pod_settings, workload_settings))
        report(results[-1], run.lookup)
    for r in results:
        print(
            f"pods {r.num_pods}: routing p99 {r.percentile(0.99):.2f} ms, "
            f"gateway {r.picks_per_s:.0f} req/s"
        )
    plot(results, args.plot)


if __name__ == "__main__":
    asyncio.run(main())
