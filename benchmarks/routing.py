"""Cache-aware routing vs round robin on 2 prefill + 1 decode pods (CPU, SmolLM2).

    python -m benchmarks.routing [--seed 0]

For each policy a fresh stack starts (redis-server, two prefill pods, a decode pod, the
gateway with --routing-policy), then two seeded synthetic workloads run through its HTTP API:

- shared system prompts: requests each start with one of a few long system prompts (more than
  one prefill pod's KV cache holds, so where a prompt goes decides whether it stays cached);
- multi-turn chat: conversations whose every turn re-sends the whole history.

Printed per workload and policy: client-side TTFT p50/p90 and the prompt tokens the prefill pods
actually computed (queried minus prefix-cache hits, from their stats), then the ratios.
The decode pod runs with --local-prefill-threshold 0, so every prompt goes to a prefill pod and
the routing choice is what is measured.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import sys
import time
import urllib.request
from dataclasses import dataclass

from benchmarks.serving.loadgen import Target, stream_one
from benchmarks.serving.workload import RequestSpec
from services.common.redis_server import RedisServer, free_port
from services.common.supervisor import HealthCheck, ProcessSpec, Supervisor

MODEL = "SmolLM2-135M-Instruct.Q4_1"
VOCAB = range(1000, 40000)  # ordinary tokens, clear of the special ones
POLICIES = ("round_robin", "cache_aware")


@dataclass(frozen=True)
class Figures:
    ttft_p50_ms: float
    ttft_p90_ms: float
    prefill_tokens: int
    num_errors: int


def log(message: str) -> None:
    print(f"[routing] {message}", file=sys.stderr, flush=True)


# ---- workloads (token ids, seeded) ----------------------------------------------------------


def tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.choice(VOCAB) for _ in range(n)]


def system_prompt_requests(seed: int, num_prompts=6, prompt_len=384, num_requests=24):
    rng = random.Random(seed)
    systems = [tokens(rng, prompt_len) for _ in range(num_prompts)]
    return [rng.choice(systems) + tokens(rng, 24) for _ in range(num_requests)]


def conversations(seed: int, num_conversations=4, num_turns=4, first_len=256, turn_len=48):
    """Each conversation's prompts, turn by turn: history + reply + the next user message."""
    rng = random.Random(seed + 1)
    result = []
    for _ in range(num_conversations):
        prompt, turns = tokens(rng, first_len), []
        for _ in range(num_turns):
            turns.append(prompt)
            prompt = prompt + tokens(rng, turn_len)
        result.append(turns)
    return result


# ---- the stack ------------------------------------------------------------------------------


@dataclass
class Stack:
    supervisor: Supervisor
    redis: RedisServer
    http_port: int
    prefill_addresses: list[str]

    def stop(self) -> None:
        self.supervisor.stop()
        self.redis.stop()


def start_stack(policy: str) -> Stack:
    redis = RedisServer().start()
    supervisor = Supervisor()
    common = ["--num-threads", "1", "--kv-transport", "tcp", "--log-level", "warning"]
    common += ["--redis-url", redis.url]
    pods = [("prefill-0", "64MiB", []), ("prefill-1", "64MiB", [])]
    pods.append(("decode-0", "256MiB", ["--local-prefill-threshold", "0"]))
    addresses = {}
    for name, cache, extra in pods:
        role, port = name.split("-")[0], free_port()
        argv = [sys.executable, "-m", f"services.{role}", "--host", "127.0.0.1"]
        argv += ["--port", str(port), "--worker-id", name, "--kv-cache-bytes", cache]
        addresses[name] = f"127.0.0.1:{port}"
        health = HealthCheck(addresses[name], f"splitserve.v1.{role.capitalize()}Worker")
        supervisor.start(ProcessSpec(name, [*argv, *common, *extra], health))
    http_port = free_port()
    argv = [sys.executable, "-m", "services.gateway", "--host", "127.0.0.1"]
    argv += ["--port", str(http_port), "--grpc-port", str(free_port())]
    argv += ["--redis-url", redis.url, "--routing-policy", policy, "--log-level", "warning"]
    health = HealthCheck(http_url=f"http://127.0.0.1:{http_port}/health")
    supervisor.start(ProcessSpec("gateway", argv, health))
    supervisor.wait_healthy(300.0)
    stack = Stack(supervisor, redis, http_port, [addresses["prefill-0"], addresses["prefill-1"]])
    _wait_for_pods(stack)
    return stack


def _wait_for_pods(stack: Stack) -> None:
    import json

    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        with urllib.request.urlopen(f"http://127.0.0.1:{stack.http_port}/health") as response:
            workers = json.load(response)["workers"]
        if sum(ok for pool in workers.values() for ok in pool.values()) == 3:
            return
        time.sleep(0.2)
    raise RuntimeError("the gateway never saw all three pods")


def prefill_tokens_computed(stack: Stack) -> int:
    from splitserve.v1 import worker_pb2, worker_pb2_grpc

    from services.common.channels import sync_channel

    total = 0
    for address in stack.prefill_addresses:
        with sync_channel(address) as channel:
            stub = worker_pb2_grpc.PrefillWorkerStub(channel)
            stats = stub.GetStats(worker_pb2.StatsRequest(), timeout=5)
        total += stats.prefix_cache_queried_tokens - stats.prefix_cache_hit_tokens
    return total


# ---- running --------------------------------------------------------------------------------


async def _send(session, target: Target, prompt: list[int]):
    return await stream_one(session, target, RequestSpec(0.0, prompt, 4), time.perf_counter())


async def run_system_prompts(target: Target, prompts: list[list[int]], concurrency=2):
    import aiohttp

    queue = list(prompts)
    results = []
    async with aiohttp.ClientSession() as session:

        async def worker():
            while queue:
                results.append(await _send(session, target, queue.pop(0)))

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return results


async def run_conversations(target: Target, chats: list[list[list[int]]]):
    import aiohttp

    async with aiohttp.ClientSession() as session:

        async def converse(turns):
            return [await _send(session, target, prompt) for prompt in turns]

        per_chat = await asyncio.gather(*(converse(turns) for turns in chats))
    return [result for results in per_chat for result in results]


def measure(stack: Stack, run) -> Figures:
    target = Target(f"http://127.0.0.1:{stack.http_port}/v1/completions", MODEL)
    before = prefill_tokens_computed(stack)
    results = asyncio.run(run(target))
    time.sleep(0.5)  # the stats a pod reports are taken after its step
    computed = prefill_tokens_computed(stack) - before
    ttfts = sorted(r.ttft_s * 1000 for r in results if r.ok and r.ttft_s is not None)
    deciles = statistics.quantiles(ttfts, n=10)
    return Figures(statistics.median(ttfts), deciles[8], computed, sum(not r.ok for r in results))


def run_policy(policy: str, seed: int) -> dict[str, Figures]:
    log(f"{policy}: starting redis-server, 2 prefill pods, 1 decode pod and the gateway")
    stack = start_stack(policy)
    try:
        prompts = system_prompt_requests(seed)
        log(f"{policy}: shared system prompts, {len(prompts)} requests")
        shared = measure(stack, lambda t: run_system_prompts(t, prompts))
        chats = conversations(seed)
        log(f"{policy}: multi-turn chat, {sum(len(c) for c in chats)} turns")
        chat = measure(stack, lambda t: run_conversations(t, chats))
    finally:
        stack.stop()
    return {"shared system prompts": shared, "multi-turn chat": chat}


def report(results: dict[str, dict[str, Figures]]) -> str:
    lines = [
        "| workload | policy | TTFT p50 (ms) | TTFT p90 (ms) | prefill tokens computed | errors |",
        "| --- | --- | ---: | ---: | ---: | ---: |",
    ]
    for workload in results[POLICIES[0]]:
        for policy in POLICIES:
            f = results[policy][workload]
            lines.append(
                f"| {workload} | {policy} | {f.ttft_p50_ms:.0f} | {f.ttft_p90_ms:.0f} | "
                f"{f.prefill_tokens} | {f.num_errors} |"
            )
    lines.append("")
    for workload in results[POLICIES[0]]:
        rr, ca = results["round_robin"][workload], results["cache_aware"][workload]
        saved = 1 - ca.prefill_tokens / max(rr.prefill_tokens, 1)
        lines.append(
            f"- {workload}: TTFT p50 {rr.ttft_p50_ms / ca.ttft_p50_ms:.2f}x lower, "
            f"p90 {rr.ttft_p90_ms / ca.ttft_p90_ms:.2f}x lower, {saved:.0%} fewer prefill tokens"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.routing", description=__doc__)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    results = {policy: run_policy(policy, args.seed) for policy in POLICIES}
    print(report(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
