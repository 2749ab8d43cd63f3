"""Chaos: a seeded open-loop load on prefill and decode pods while pods and Redis are killed,
stopped and restarted at random moments. Does every request end, and end right?

    python -m benchmarks.chaos [--minutes 3] [--rate 0.75] [--decode 2] [--prefill 1]
                               [--fault-every 30] [--seed 0] [--png docs/chaos.png]

1. Starts the stack as `splitserve up` would (its plan, its supervisor, Redis beside it) and
   restarts any process that exits, with up's back-off.
2. Reference: every request of the workload once, greedy, before any fault (the same stack,
   so the same numerics).
3. The same requests again, open loop (Poisson arrivals), while a seeded schedule injects a
   fault every `--fault-every` seconds: SIGKILL a decode pod (the supervisor restarts it),
   SIGSTOP a decode pod for 20 s (longer than gRPC keepalive's ~15 s detection), SIGKILL the
   prefill pod, SIGKILL Redis (back after 3 s).
   Only one decode pod is ever down at a time, so another is always left standing.
4. Reports: sent, completed, completed identical to the reference, ended with a clear error,
   hung (no end within `--hang-after` s), migrations (the gateway's counter) and the added
   latency per migration (p50/p99 from its histogram), and blocks leaked (a pod whose blocks
   are not all free once idle). A PNG plots each request's latency over the run, the faults
   marked.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import signal
import sys
import time
import urllib.request
from dataclasses import dataclass, field

import aiohttp

from splitserve.common.redis_server import RedisServer
from splitserve.launcher import RESTART_POLICY
from splitserve.loadgen.stacks import RunningStack, SystemSetup

TOPICS = [
    "the history of lighthouses",
    "how bread rises",
    "why the sky is blue",
    "the life of honeybees",
    "how a steam engine works",
    "the rules of chess",
    "the water cycle",
    "how vaccines train the immune system",
]


STOP_SECONDS = 20


def log(message: str) -> None:
    print(f"[chaos {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


@dataclass(frozen=True)
class Spec:
    prompt: str
    max_tokens: int
    send_at_s: float


@dataclass
class Outcome:
    tokens: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    error: str = ""
    hung: bool = False
    sent_s: float = 0.0
    latency_s: float | None = None


def workload(seed: int, minutes: float, rate: float) -> list[Spec]:
    rng = random.Random(seed)
    specs, now = [], 0.0
    while True:
        now += rng.expovariate(rate)
        if now > minutes * 60:
            return specs
        topic = rng.choice(TOPICS)
        prompt = f"Request {len(specs)}: write a few sentences about {topic}."
        specs.append(Spec(prompt, rng.randint(16, 48), now))


async def stream(session: aiohttp.ClientSession, url: str, model: str, spec: Spec) -> Outcome:
    outcome = Outcome()
    body = {
        "model": model,
        "prompt": spec.prompt,
        "max_tokens": spec.max_tokens,
        "temperature": 0,
        "ignore_eos": True,  # every request streams all its tokens: faults find work in flight
        "stream": True,
        "return_token_ids": True,
    }
    try:
        async with session.post(f"{url}/v1/completions", json=body) as response:
            if response.status != 200:
                outcome.error = f"HTTP {response.status}"
                return outcome
            async for line in response.content:
                if not line.startswith(b"data: ") or line.strip() == b"data: [DONE]":
                    continue
                event = json.loads(line[len(b"data: ") :])
                if "error" in event:
                    outcome.error = str(event["error"].get("message"))[:120]
                    return outcome
                for choice in event["choices"]:
                    outcome.tokens += choice.get("token_ids") or []
                    outcome.finish_reason = choice.get("finish_reason") or outcome.finish_reason
    except aiohttp.ClientError as error:
        outcome.error = f"{type(error).__name__}: {error}"[:120]
    if not outcome.error and outcome.finish_reason is None:
        outcome.error = "the stream ended without a finish"
    return outcome


async def timed(session, url, model, spec: Spec, start: float, hang_after_s: float) -> Outcome:
    await asyncio.sleep(max(0.0, start + spec.send_at_s - time.monotonic()))
    sent = time.monotonic()
    try:
        outcome = await asyncio.wait_for(stream(session, url, model, spec), hang_after_s)
    except TimeoutError:
        outcome = Outcome(hung=True)
    outcome.sent_s = sent - start
    outcome.latency_s = time.monotonic() - sent
    return outcome


async def reference(url: str, model: str, specs: list[Spec]) -> list[Outcome]:
    """Every request once before any fault, eight at a time."""
    gate = asyncio.Semaphore(8)
    done = 0

    async def one(session, spec):
        nonlocal done
        async with gate:
            outcome = await stream(session, url, model, spec)
        done += 1
        if done % 20 == 0:
            log(f"reference {done}/{len(specs)}")
        return outcome

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None)) as session:
        return await asyncio.gather(*(one(session, spec) for spec in specs))


@dataclass
class Faults:
    stack: RunningStack
    redis: RedisServer
    num_decode: int
    num_prefill: int
    rng: random.Random
    log_lines: list[tuple[float, str]] = field(default_factory=list)

    async def run(self, start: float, every_s: float, until_s: float) -> None:
        kinds = ["kill-decode", "stop-decode", "kill-decode"]
        kinds += ["kill-prefill"] * (self.num_prefill > 0) + ["kill-redis"]
        while time.monotonic() - start + every_s < until_s:
            await asyncio.sleep(every_s * self.rng.uniform(0.6, 1.4))
            kind = self.rng.choice(kinds)
            await self.inject(kind, time.monotonic() - start)

    async def inject(self, kind: str, at_s: float) -> None:
        if kind == "kill-redis":
            self.redis.kill()
            self.log_lines.append((at_s, "SIGKILL redis"))
            await asyncio.sleep(3)
            self.redis.start()
            return
        role = kind.split("-")[1]
        count = self.num_decode if role == "decode" else self.num_prefill
        name = f"{role}-{self.rng.randrange(count)}"
        process = self.stack.process(name)
        if process.poll() is not None:
            return  # already down (restarting): one pod down at a time
        if kind.startswith("stop"):
            process.send_signal(signal.SIGSTOP)
            self.log_lines.append((at_s, f"SIGSTOP {name} ({STOP_SECONDS} s)"))
            await asyncio.sleep(STOP_SECONDS)
            process.send_signal(signal.SIGCONT)
        else:
            process.send_signal(signal.SIGKILL)
            self.log_lines.append((at_s, f"SIGKILL {name}"))


async def supervise(stack: RunningStack, start: float, lines: list) -> None:
    while True:
        for event in stack.restart_exited(RESTART_POLICY):
            lines.append((time.monotonic() - start, event))
            log(event)
        await asyncio.sleep(0.5)


async def chaos_run(args, stack: RunningStack, redis: RedisServer, specs, model):
    rng = random.Random(args.seed + 1)
    faults = Faults(stack, redis, args.decode, args.prefill, rng)
    start = time.monotonic()
    keeper = asyncio.create_task(supervise(stack, start, faults.log_lines))
    injector = asyncio.create_task(faults.run(start, args.fault_every, args.minutes * 60))
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(
        connector=connector, timeout=aiohttp.ClientTimeout(total=None)
    ) as session:
        tasks = [
            asyncio.create_task(timed(session, stack.base_url, model, spec, start, args.hang_after))
            for spec in specs
        ]
        outcomes = await asyncio.gather(*tasks)
    await injector
    await asyncio.sleep(RESTART_POLICY.max_backoff_s if faults.log_lines else 0)
    keeper.cancel()
    return outcomes, faults.log_lines


def histogram_quantiles(metrics: str, name: str) -> tuple[float, dict[float, float]]:
    """(count, {quantile: seconds}) from a Prometheus histogram's buckets, interpolated."""
    buckets = []
    for line in metrics.splitlines():
        if line.startswith(f"{name}_bucket"):
            bound = line.split('le="')[1].split('"')[0]
            buckets.append((float(bound), float(line.split()[-1])))
    count = buckets[-1][1] if buckets else 0.0
    quantiles = {}
    for q in (0.5, 0.99):
        target, previous_bound, previous_count = q * count, 0.0, 0.0
        for bound, cumulative in buckets:
            if cumulative >= target and count:
                if bound == float("inf"):
                    quantiles[q] = previous_bound
                else:
                    share = (target - previous_count) / max(cumulative - previous_count, 1e-9)
                    quantiles[q] = previous_bound + share * (bound - previous_bound)
                break
            previous_bound, previous_count = bound, cumulative
    return count, quantiles


def report(specs, wanted, outcomes, metrics: str, leaked: list[str]) -> dict:
    completed = [o for o in outcomes if not o.error and not o.hung]
    identical = [
        o
        for o, want in zip(outcomes, wanted)
        if not o.error and not o.hung and o.tokens == want.tokens
    ]
    migrations = sum(
        float(line.split()[-1])
        for line in metrics.splitlines()
        if line.startswith("splitserve:migrations_total{")
    )
    count, quantiles = histogram_quantiles(metrics, "splitserve:migration_latency_seconds")
    return {
        "sent": len(specs),
        "completed": len(completed),
        "identical_to_reference": len(identical),
        "clear_error": sum(1 for o in outcomes if o.error),
        "hung": sum(1 for o in outcomes if o.hung),
        "migrations": migrations,
        "migration_latency_p50_s": quantiles.get(0.5),
        "migration_latency_p99_s": quantiles.get(0.99),
        "migrations_timed": count,
        "pods_with_leaked_blocks": leaked,
        "errors": sorted({o.error for o in outcomes if o.error})[:8],
    }


def plot(path: str, outcomes: list[Outcome], wanted: list[Outcome], faults: list) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(10, 4))
    for outcome, want in zip(outcomes, wanted):
        if outcome.hung or outcome.error:
            color = "tab:red"
        elif outcome.tokens != want.tokens:
            color = "tab:orange"
        else:
            color = "tab:green"
        ax.scatter(outcome.sent_s, outcome.latency_s, s=10, color=color)
    for at_s, text in faults:
        if text.startswith("SIG"):
            ax.axvline(at_s, color="grey", linewidth=0.8, linestyle="--")
            ax.annotate(text, (at_s, ax.get_ylim()[1] * 0.95), rotation=90, fontsize=7,
                        va="top", ha="right")
    ax.set_xlabel("sent at (s)")
    ax.set_ylabel("request latency (s)")
    ax.set_title("chaos run: green = identical to reference, orange = differs, red = error/hung")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def leaked_pods(stack: RunningStack, timeout_s: float = 180.0) -> list[str]:
    """Pods whose blocks are not all free once every pod answers and is idle."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            stats = stack.pod_stats()  # fails while a restarted pod still loads
            if all(s.num_running == 0 and s.num_waiting == 0 for s in stats.values()):
                return [n for n, s in stats.items() if s.kv_blocks_free != s.kv_blocks_total]
        except Exception as error:  # grpc.RpcError while a pod is down
            if time.monotonic() > deadline:
                return [f"unreachable: {error}"[:80]]
        if time.monotonic() > deadline:
            return [name for name, s in stats.items() if s.kv_blocks_free != s.kv_blocks_total]
        time.sleep(1.0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--minutes", type=float, default=3.0)
    parser.add_argument("--rate", type=float, default=0.75, help="requests per second")
    parser.add_argument("--decode", type=int, default=2)
    parser.add_argument("--prefill", type=int, default=1)
    parser.add_argument("--fault-every", type=float, default=30.0, metavar="SECONDS")
    parser.add_argument("--hang-after", type=float, default=180.0, metavar="SECONDS")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--png", default="docs/chaos.png")
    parser.add_argument("--json", default="build/chaos.json")
    args = parser.parse_args()

    specs = workload(args.seed, args.minutes, args.rate)
    log(f"{len(specs)} requests over {args.minutes:g} min; starting Redis and the stack")
    flags = ["--decode", str(args.decode), "--prefill", str(args.prefill)]
    flags += ["--kv-cache-bytes", "128MiB"] + (["--colocated"] if args.prefill == 0 else [])
    with RedisServer() as redis:
        setup = SystemSetup("chaos", flags, redis_url=redis.url)
        with RunningStack(setup) as stack:
            model = stack.model_name()
            log("reference run (no faults)")
            wanted = asyncio.run(reference(stack.base_url, model, specs))
            log("chaos run")
            outcomes, faults = asyncio.run(chaos_run(args, stack, redis, specs, model))
            leaked = leaked_pods(stack)
            with urllib.request.urlopen(f"{stack.base_url}/metrics", timeout=10) as response:
                metrics = response.read().decode()
    result = report(specs, wanted, outcomes, metrics, leaked)
    result["faults"] = [f"{at:.0f}s {text}" for at, text in faults]
    with open(args.json, "w") as file:
        json.dump(result, file, indent=2)
    plot(args.png, outcomes, wanted, faults)
    for key, value in result.items():
        if key != "faults":
            print(f"{key:>28}: {value}")
    print("faults:")
    for line in result["faults"]:
        print(f"  {line}")


if __name__ == "__main__":
    main()
