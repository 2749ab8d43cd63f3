"""What API keys and tenant limits add to a request's latency at the gateway, side by side.

    python -m benchmarks.gateway_auth [--quick] [--streams 64] [--rounds 5] [--requests 8]
                                      [--tokens 8]

Two gateway processes over the same pod and the same real redis-server: one open (no key
file), one with --api-keys whose tenant has requests-per-minute, tokens-per-minute and
concurrency limits (high enough never to refuse) counted in that Redis. The pod is a stand-in
decode pod started here (GetStats and a Decode stream of `--tokens` one-token answers 50 ms
apart, no model), so what is measured is the gateway: its auth, limit round trips to Redis and
response headers, not prefill.
`--streams` clients at once each send `--requests` streaming completions in turn
(Authorization: Bearer on the keyed gateway); per request: time to the first SSE byte and
to the last. Rounds alternate the two gateways, the first of each pair flipping every round,
so a busy machine skews both alike. Prints the medians and p90s side by side and their
differences (target: under 1 ms at 64 streams), then the same difference paired by round.
Both gateways run with --server-timing, so each response also says how much of the wait for
its first byte was the gateway's own time (services/gateway/server_timing.py: arrival to the
pod's call, and the pod's first token in hand to the response's start) and how much the pod's;
the last lines compare the gateway's own time, pooled and paired by round.

Why paired: on a shared VM the machine's speed drifts by a fifth from one minute to the next,
and the pooled medians of two runs of the same code moved by 7 ms either way (2026-12-03, a
Zen 5 EPYC). Each round's keyed median less the open median of the same round (seconds apart)
cancels the drift; the median of those differences, with the interval its order statistics
give (a sign test's: exact, at least 90% where the rounds allow), says whether the runs can
tell a 1 ms difference at all.

`--quick` runs a few seconds on a shared 2-core box; figures to quote come from a quiet machine
with the defaults (docs/security.md).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import aiohttp

from splitserve.common.grpc_server import start_server, stop_event_on_signals
from splitserve.common.ports import free_port
from splitserve.common.redis_server import RedisServer
from splitserve.common.supervisor import HealthCheck, ProcessSpec, Supervisor
from splitserve.gateway.server_timing import parse_header
from splitserve.v1 import generate_pb2, worker_pb2, worker_pb2_grpc

MODEL_NAME = "SmolLM2-135M-Instruct.Q4_1"  # the shipped model's name: the gateway checks it
KEY = "sk-bench-0123456789"
NUM_TOKENS = 8
ITL_S = 0.05  # the stand-in pod's time between tokens: streams overlap as real ones do
_TOKEN_ID = 28  # any id in the vocabulary


class _StandInDecodePod(worker_pb2_grpc.DecodeWorkerServicer):
    """Answers every request with its max_tokens one-token responses, ITL_S apart."""

    async def Decode(self, request, context):
        num_tokens = request.sampling.max_tokens or NUM_TOKENS
        for i in range(num_tokens):
            await asyncio.sleep(ITL_S)
            response = worker_pb2.DecodeResponse(token_ids=[_TOKEN_ID], text="a")
            if i == num_tokens - 1:
                response.finish_reason = "length"
                response.usage.CopyFrom(
                    generate_pb2.Usage(
                        prompt_tokens=len(request.prompt_token_ids), completion_tokens=num_tokens
                    )
                )
            yield response

    async def Abort(self, request, context):
        return worker_pb2.AbortResponse()

    async def GetStats(self, request, context):
        return worker_pb2.WorkerStats(
            worker_id="stand-in",
            role="decode",
            kv_blocks_total=4096,
            kv_blocks_free=4096,
            model=MODEL_NAME,
            max_model_len=2048,
            block_size=16,
            vocab_size=49152,
            kv_transport="tcp",
        )


async def _serve_pod(port: int) -> None:
    stop = stop_event_on_signals()
    server = await start_server(
        "127.0.0.1",
        port,
        ["splitserve.v1.DecodeWorker"],
        lambda s: worker_pb2_grpc.add_DecodeWorkerServicer_to_server(_StandInDecodePod(), s),
    )
    await server.set_serving(True)
    await stop.wait()
    await server.stop()


def _gateway(name: str, pod: str, extra: list[str]) -> tuple[ProcessSpec, str]:
    port = free_port()
    argv = [sys.executable, "-m", "splitserve.gateway", "--host", "127.0.0.1"]
    argv += ["--port", str(port), "--grpc-port", str(free_port()), "--decode", pod]
    argv += ["--log-level", "warning", "--server-timing", *extra]
    url = f"http://127.0.0.1:{port}"
    return ProcessSpec(name, argv, HealthCheck(http_url=f"{url}/health")), url


@dataclass(frozen=True)
class RequestTiming:
    """One streamed request: the client's seconds to the first byte and the last, and the
    gateway's Server-Timing split of the wait for the first (ms: its own, the pod's)."""

    first_byte_s: float
    whole_s: float
    gateway_ms: float
    pods_ms: float


async def _one(
    session: aiohttp.ClientSession, url: str, headers: dict, num_tokens: int
) -> RequestTiming:
    body = {"model": MODEL_NAME, "prompt": "Hello there", "max_tokens": num_tokens}
    start = time.perf_counter()
    first = None
    async with session.post(
        f"{url}/v1/completions", json={**body, "stream": True}, headers=headers
    ) as response:
        assert response.status == 200, response.status
        durations = server_timing_ms(response.headers.get("server-timing", ""))
        async for _ in response.content.iter_any():
            if first is None:
                first = time.perf_counter() - start
    whole = time.perf_counter() - start
    return RequestTiming(first or 0.0, whole, durations["gateway"], durations["pods"])


def server_timing_ms(header: str) -> dict[str, float]:
    """`gateway;dur=0.41, pods;dur=50.2` -> {"gateway": 0.41, "pods": 50.2}; the gateways here
    run with --server-timing, so a missing part is an error."""
    durations = parse_header(header)
    if set(durations) != {"gateway", "pods"}:
        raise ValueError(f"no gateway and pods durations in Server-Timing: {header!r}")
    return durations


async def _round(
    url: str, headers: dict, streams: int, requests: int, num_tokens: int
) -> list[RequestTiming]:
    connector = aiohttp.TCPConnector(limit=streams)
    timeout = aiohttp.ClientTimeout(total=60)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:

        async def worker() -> list[RequestTiming]:
            return [await _one(session, url, headers, num_tokens) for _ in range(requests)]

        await _one(session, url, headers, num_tokens)  # connections and caches warm
        results = await asyncio.gather(*(worker() for _ in range(streams)))
    return [timing for result in results for timing in result]


def _ms(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return 1000 * ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def run(streams: int, rounds: int, requests: int, num_tokens: int = NUM_TOKENS) -> None:
    limits = {"requests_per_minute": 10**9, "tokens_per_minute": 10**12}
    limits["concurrent_requests"] = 10**6
    with tempfile.TemporaryDirectory() as tmp, RedisServer() as redis, Supervisor() as sup:
        key_file = Path(tmp) / "keys.json"
        key_file.write_text(json.dumps([{"key": KEY, "tenant": "bench", **limits}]))
        pod = f"127.0.0.1:{free_port()}"
        argv = [sys.executable, "-m", "benchmarks.gateway_auth", "--stand-in-pod", pod]
        health = HealthCheck(grpc_address=pod, grpc_service="splitserve.v1.DecodeWorker")
        sup.start(ProcessSpec("pod", argv, health))
        # Both gateways on the same Redis (its index and registry work alike), so what
        # differs is the key file alone: the keys and the limits counted there.
        shared = ["--redis-url", redis.url]
        keyed = [*shared, "--api-keys", str(key_file)]
        configs = {}
        for name, extra, headers in [
            ("off", shared, {}),
            ("on", keyed, {"Authorization": f"Bearer {KEY}"}),
        ]:
            spec, url = _gateway(f"gateway-{name}", pod, extra)
            sup.start(spec)
            configs[name] = (url, headers)
        sup.wait_healthy(120)
        time.sleep(1.5)  # the gateways' first poll of the pod
        timings: dict[str, list[RequestTiming]] = {"off": [], "on": []}
        round_medians: dict[str, list[float]] = {"off": [], "on": []}  # first byte, ms
        round_gateway: dict[str, list[float]] = {"off": [], "on": []}  # its own time, ms
        cpu_s = {"off": 0.0, "on": 0.0}
        for number in range(rounds):
            # Which gateway goes first flips each round: a round runs in the wake of the one
            # before (its sockets closing, its garbage), and neither should always follow.
            order = list(configs.items()) if number % 2 == 0 else list(configs.items())[::-1]
            for name, (url, headers) in order:
                pid = sup.process(f"gateway-{name}").pid
                before = _cpu_seconds(pid)
                round_timings = asyncio.run(_round(url, headers, streams, requests, num_tokens))
                cpu_s[name] += _cpu_seconds(pid) - before
                timings[name] += round_timings
                round_medians[name].append(_ms([t.first_byte_s for t in round_timings], 0.5))
                round_gateway[name].append(statistics.median(t.gateway_ms for t in round_timings))
    _report(timings, streams, num_tokens)
    _report_cpu(cpu_s, {name: len(values) for name, values in timings.items()})
    print(_paired_line("first byte", round_medians["off"], round_medians["on"]))
    print(_rounds_line(round_medians["off"], round_medians["on"]))
    _report_inside(timings)
    print(_paired_line("the gateway's own time", round_gateway["off"], round_gateway["on"]))


def paired_added_ms(off: list[float], on: list[float]) -> tuple[float, float, float, float]:
    """(median, low, high, coverage): the median of each round's keyed first-byte median less
    the open one of the same round, and the interval between order statistics that holds the
    differences' true median with probability `coverage` (`median_interval`)."""
    if len(off) != len(on) or not off:
        raise ValueError("one open and one keyed median per round, at least one round")
    differences = [keyed - open_ for open_, keyed in zip(off, on)]
    return (statistics.median(differences), *median_interval(differences))


def median_interval(values: list[float], confidence: float = 0.9) -> tuple[float, float, float]:
    """(low, high, coverage): the narrowest interval between the j-th smallest and the j-th
    largest value that holds the population median with probability >= `confidence` (the
    sign test: the count below the median is Binomial(n, 1/2)); min..max, with its smaller
    coverage, where n is too small to reach it."""
    ordered = sorted(values)
    n = len(ordered)

    def coverage(rank: int) -> float:  # P(rank <= count below the median < n + 1 - rank)
        return sum(math.comb(n, i) for i in range(rank, n + 1 - rank)) / 2**n

    rank = 1
    while rank + 1 <= n + 1 - (rank + 1) and coverage(rank + 1) >= confidence:
        rank += 1
    return ordered[rank - 1], ordered[n - rank], coverage(rank)


def _rounds_line(off: list[float], on: list[float]) -> str:
    pairs = " ".join(f"{open_:.1f}/{keyed - open_:+.1f}" for open_, keyed in zip(off, on))
    return f"each round, open median/added (ms): {pairs}"


def _paired_line(what: str, off: list[float], on: list[float]) -> str:
    median, low, high, coverage = paired_added_ms(off, on)
    return (
        f"paired by round: {what} median added {median:+.2f} ms over {len(off)} rounds "
        f"({coverage:.0%} interval {low:+.2f} to {high:+.2f} ms)"
    )


def _cpu_seconds(pid: int) -> float:
    """The process's user + system CPU time: what a request costs the gateway, whatever else
    shares the machine (latencies on a busy box move with the others' load; this does not)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _report_cpu(cpu_s: dict[str, float], counts: dict[str, int]) -> None:
    per_request = {name: 1000 * cpu_s[name] / max(1, counts[name]) for name in cpu_s}
    added = per_request["on"] - per_request["off"]
    print(f"{'gateway CPU per request':>24}{per_request['off']:>12.2f}{per_request['on']:>14.2f}"
          f"{added:>10.2f}")  # fmt: skip


def _report(timings: dict[str, list[RequestTiming]], streams: int, num_tokens: int) -> None:
    gap_ms = ITL_S * 1000
    print(f"gateway latency at {streams} concurrent streams ({num_tokens} tokens {gap_ms:.0f} ms "
          "apart from a stand-in pod), ms")  # fmt: skip
    print(f"{'':>24}{'keys off':>12}{'keys+limits':>14}{'added':>10}")
    _print_quantiles(
        timings, (("first byte", "first_byte_s", 1.0), ("whole stream", "whole_s", 1.0))
    )
    num = len(timings["on"])
    spread = statistics.pstdev([t.first_byte_s for t in timings["off"]]) * 1000
    print(f"({num} requests each; keys-off first-byte spread {spread:.2f} ms)")


def _report_inside(timings: dict[str, list[RequestTiming]]) -> None:
    """The Server-Timing split of the wait for the first byte: the gateway's own time (from
    the request's arrival to the pod's call, and from the pod's first token in hand to the
    response's start) and the pod's."""
    print("inside the gateways (Server-Timing), ms")
    rows = (("the gateway's own", "gateway_ms", 1e-3), ("the pod's", "pods_ms", 1e-3))
    _print_quantiles(timings, rows)


def _print_quantiles(
    timings: dict[str, list[RequestTiming]], rows: tuple[tuple[str, str, float], ...]
) -> None:
    """Median and p90 of each (label, RequestTiming field, its unit in seconds), both gateways
    and the difference, in ms."""
    for label, field, unit_s in rows:
        off_s = [getattr(t, field) * unit_s for t in timings["off"]]
        on_s = [getattr(t, field) * unit_s for t in timings["on"]]
        for q_name, q in (("median", 0.5), ("p90", 0.9)):
            off, on = _ms(off_s, q), _ms(on_s, q)
            print(f"{label + ' ' + q_name:>24}{off:>12.2f}{on:>14.2f}{on - off:>10.2f}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.gateway_auth", description=__doc__)
    parser.add_argument("--quick", action="store_true", help="2 rounds of 2 requests per stream")
    parser.add_argument("--streams", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--requests", type=int, default=8, help="per stream per round")
    parser.add_argument(
        "--tokens",
        type=int,
        default=NUM_TOKENS,
        help=f"tokens per request (default {NUM_TOKENS}: many requests a second, the keyed "
        "path's per-request work at its heaviest)",
    )
    parser.add_argument("--stand-in-pod", metavar="ADDR", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.stand_in_pod:
        asyncio.run(_serve_pod(int(args.stand_in_pod.rsplit(":", 1)[1])))
        return 0
    if args.quick:
        args.rounds, args.requests = 2, 2
    run(args.streams, args.rounds, args.requests, args.tokens)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
