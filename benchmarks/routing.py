"""Cache-aware routing vs round robin on 2 prefill + 1 decode pods (CPU, SmolLM2).

    python -m benchmarks.routing [--seed 0]

For each policy a fresh stack starts (redis-server, two prefill pods, a decode pod, the
gateway with --routing-policy), then two seeded synthetic workloads run through its HTTP API
(4 output tokens per request, 2 requests in flight):

- shared system prompts: 8 system prompts of 512 tokens (32 blocks each), 8 rounds; each round
  sends every prompt once, in a seeded random order, with a fresh 16-token user message;
- multi-turn chat: 8 conversations of 5 turns, 512 tokens first, each turn re-sending the whole
  history plus 32 new tokens (the reply and the next user message); round t sends turn t of
  every conversation in a seeded random order, after round t - 1 has finished.

Why the sizes: each prefill pod gets 120 MiB of KV cache (170 blocks of 16 tokens in float32).
The working set of either workload (8 x 33 = 264 blocks of system prompts with their newest user
block; 8 conversations of up to 40 blocks = 320 blocks) is more than one pod's cache holds and
no more than two hold. That is
the case cache-aware routing exists for: it partitions the prefixes between the pods, so their
caches together hold everything, while round robin sends every prefix to both pods, so each
pod's cache must hold the whole working set and its LRU order evicts a prefix before it comes
back (every other prefix is used in between). Arrivals are interleaved for the same reason.

Printed per workload and policy: client-side TTFT p50/p90 and the prompt tokens computed,
counted where they are computed: queried minus prefix-cache-hit tokens on the prefill pods (from
their stats), and the prompts the decode pod prefilled itself (from its metrics). The decode pod
runs with --local-prefill-threshold 0, so every prompt goes to a prefill pod, which computes all
of it except its own cached prefix: the decode pod's prefix cache only saves page transfers, not
prefill work, and hides nothing from the count. A decode pod prefill would only be a fallback
after a failed remote prefill; the column shows there were none.
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

from splitserve.common.ports import free_port
from splitserve.common.redis_server import RedisServer
from splitserve.common.supervisor import HealthCheck, ProcessSpec, Supervisor
from splitserve.loadgen.client import Target, stream_one
from splitserve.loadgen.workload import RequestSpec

MODEL = "SmolLM2-135M-Instruct.Q4_1"
VOCAB = range(1000, 40000)  # ordinary tokens, clear of the special ones
POLICIES = ("round_robin", "cache_aware")
PREFILL_KV_CACHE = "120MiB"  # 170 blocks: less than either workload's working set (see above)
DECODE_KV_CACHE = "256MiB"
CONCURRENCY = 2
OUTPUT_TOKENS = 4


@dataclass(frozen=True)
class Figures:
    ttft_p50_ms: float
    ttft_p90_ms: float
    prefill_tokens: int  # computed on the prefill pods
    num_decode_prefills: int  # prompts the decode pod prefilled itself (fallbacks)
    num_errors: int


def log(message: str) -> None:
    print(f"[routing] {message}", file=sys.stderr, flush=True)


# ---- workloads (token ids, seeded) ----------------------------------------------------------


def tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.choice(VOCAB) for _ in range(n)]


def system_prompt_rounds(seed: int, num_prompts=8, prompt_len=512, num_rounds=8, user_len=16):
    """Rounds of requests: each round every system prompt once, shuffled, + a user message."""
    rng = random.Random(seed)
    systems = [tokens(rng, prompt_len) for _ in range(num_prompts)]
    rounds = []
    for _ in range(num_rounds):
        order = rng.sample(systems, len(systems))
        rounds.append([system + tokens(rng, user_len) for system in order])
    return rounds


def chat_rounds(seed: int, num_conversations=8, num_turns=5, first_len=512, turn_len=32):
    """Round t: turn t of every conversation (its history + `turn_len` new tokens), shuffled."""
    rng = random.Random(seed + 1)
    histories = [tokens(rng, first_len) for _ in range(num_conversations)]
    rounds = []
    for _ in range(num_turns):
        rounds.append(rng.sample(histories, len(histories)))
        histories = [history + tokens(rng, turn_len) for history in histories]
    return rounds


# ---- the stack ------------------------------------------------------------------------------


@dataclass
class Stack:
    supervisor: Supervisor
    redis: RedisServer
    http_port: int
    prefill_addresses: list[str]
    decode_metrics_url: str

    def stop(self) -> None:
        self.supervisor.stop()
        self.redis.stop()


def start_stack(policy: str) -> Stack:
    redis = RedisServer().start()
    supervisor = Supervisor()
    common = ["--num-threads", "1", "--kv-transport", "tcp", "--log-level", "warning"]
    common += ["--redis-url", redis.url]
    pods = [("prefill-0", PREFILL_KV_CACHE, []), ("prefill-1", PREFILL_KV_CACHE, [])]
    metrics_port = free_port()
    decode_flags = ["--local-prefill-threshold", "0", "--metrics-port", str(metrics_port)]
    pods.append(("decode-0", DECODE_KV_CACHE, decode_flags))
    addresses = {}
    for name, cache, extra in pods:
        role, port = name.split("-")[0], free_port()
        argv = [sys.executable, "-m", f"services.{role}", "--host", "127.0.0.1"]
        argv += ["--port", str(port), "--worker-id", name, "--kv-cache-bytes", cache]
        addresses[name] = f"127.0.0.1:{port}"
        health = HealthCheck(addresses[name], f"splitserve.v1.{role.capitalize()}Worker")
        supervisor.start(ProcessSpec(name, [*argv, *common, *extra], health))
    http_port = free_port()
    argv = [sys.executable, "-m", "splitserve.gateway", "--host", "127.0.0.1"]
    argv += ["--port", str(http_port), "--grpc-port", str(free_port())]
    argv += ["--redis-url", redis.url, "--routing-policy", policy, "--log-level", "warning"]
    health = HealthCheck(http_url=f"http://127.0.0.1:{http_port}/health")
    supervisor.start(ProcessSpec("gateway", argv, health))
    supervisor.wait_healthy(300.0)
    prefill_addresses = [addresses["prefill-0"], addresses["prefill-1"]]
    metrics_url = f"http://127.0.0.1:{metrics_port}/metrics"
    stack = Stack(supervisor, redis, http_port, prefill_addresses, metrics_url)
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
    from splitserve.common.channels import sync_channel
    from splitserve.v1 import worker_pb2, worker_pb2_grpc

    total = 0
    for address in stack.prefill_addresses:
        with sync_channel(address) as channel:
            stub = worker_pb2_grpc.PrefillWorkerStub(channel)
            stats = stub.GetStats(worker_pb2.StatsRequest(), timeout=5)
        total += stats.prefix_cache_queried_tokens - stats.prefix_cache_hit_tokens
    return total


def decode_pod_prefills(stack: Stack) -> int:
    """Prompts the decode pod prefilled itself (modes local and local-fallback)."""
    with urllib.request.urlopen(stack.decode_metrics_url, timeout=10) as response:
        text = response.read().decode()
    total = 0
    for line in text.splitlines():
        if line.startswith("splitserve:remote_prefill_requests_total{") and (
            'mode="local"' in line or 'mode="local-fallback"' in line
        ):
            total += int(float(line.rsplit(" ", 1)[1]))
    return total


# ---- running --------------------------------------------------------------------------------


async def _send(session, target: Target, prompt: list[int]):
    spec = RequestSpec(0.0, prompt, OUTPUT_TOKENS)
    return await stream_one(session, target, spec, time.perf_counter())


async def _drain(session, target: Target, queue: list[list[int]], results: list) -> None:
    """One client: sends the queue's prompts one after another until it is empty."""
    while queue:
        results.append(await _send(session, target, queue.pop(0)))


async def run_rounds(target: Target, rounds: list[list[list[int]]], label: str):
    """Each round's prompts through CONCURRENCY clients; a round starts when the last ended."""
    import aiohttp

    results = []
    start = time.monotonic()
    async with aiohttp.ClientSession() as session:
        for number, prompts in enumerate(rounds, 1):
            queue = list(prompts)
            clients = (_drain(session, target, queue, results) for _ in range(CONCURRENCY))
            await asyncio.gather(*clients)
            elapsed = time.monotonic() - start
            log(f"{label}: round {number}/{len(rounds)} done ({elapsed:.0f} s)")
    return results


def measure(stack: Stack, rounds: list[list[list[int]]], label: str) -> Figures:
    target = Target(f"http://127.0.0.1:{stack.http_port}/v1/completions", MODEL)
    before = prefill_tokens_computed(stack), decode_pod_prefills(stack)
    results = asyncio.run(run_rounds(target, rounds, label))
    time.sleep(0.5)  # the stats a pod reports are taken after its step
    computed = prefill_tokens_computed(stack) - before[0]
    decode_prefills = decode_pod_prefills(stack) - before[1]
    ttfts = sorted(r.ttft_s * 1000 for r in results if r.ok and r.ttft_s is not None)
    deciles = statistics.quantiles(ttfts, n=10)
    num_errors = sum(not r.ok for r in results)
    return Figures(statistics.median(ttfts), deciles[8], computed, decode_prefills, num_errors)


def run_policy(policy: str, seed: int) -> dict[str, Figures]:
    log(f"{policy}: starting redis-server, 2 prefill pods, 1 decode pod and the gateway")
    stack = start_stack(policy)
    try:
        shared_rounds = system_prompt_rounds(seed)
        log(f"{policy}: shared system prompts, {sum(map(len, shared_rounds))} requests")
        shared = measure(stack, shared_rounds, f"{policy} system prompts")
        chats = chat_rounds(seed)
        log(f"{policy}: multi-turn chat, {sum(map(len, chats))} turns")
        chat = measure(stack, chats, f"{policy} chat")
    finally:
        stack.stop()
    return {"shared system prompts": shared, "multi-turn chat": chat}


def report(results: dict[str, dict[str, Figures]]) -> str:
    lines = [
        "| workload | policy | TTFT p50 (ms) | TTFT p90 (ms) | prefill tokens computed "
        "| decode-pod prefills | errors |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for workload in results[POLICIES[0]]:
        for policy in POLICIES:
            f = results[policy][workload]
            lines.append(
                f"| {workload} | {policy} | {f.ttft_p50_ms:.0f} | {f.ttft_p90_ms:.0f} | "
                f"{f.prefill_tokens} | {f.num_decode_prefills} | {f.num_errors} |"
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
