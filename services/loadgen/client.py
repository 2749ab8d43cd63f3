"""The load generator: streaming /v1/completions requests sent open-loop (each at its arrival time,
whether or not earlier ones have finished), timed token by token on the client side.

    send ──────── first token ── token ── token ── ... ── last token
         |  TTFT  |    ITL    |   ITL  |
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import aiohttp

from splitserve.loadgen.workload import RequestSpec

PROGRESS_INTERVAL_S = 5.0
# on_progress(num_done, num_sent, num_total)
ProgressCallback = Callable[[int, int, int], None]


@dataclass
class RequestResult:
    prompt_len: int
    max_tokens: int
    sent_s: float = 0.0  # since the run started
    ttft_s: float | None = None
    # One per output token after the first: the gap since the previous token. A chunk that
    # carries k tokens contributes k equal shares of its gap.
    itls_s: list[float] = field(default_factory=list)
    num_output_tokens: int = 0
    latency_s: float | None = None  # send to the last token, when it finished
    error: str = ""  # "" when the request finished with all its tokens
    status: int | None = None  # the HTTP status answered; None when no answer came
    # Send to the response's status line: for a refusal (429, 503, ...), how fast it came.
    answered_s: float | None = None

    @property
    def ok(self) -> bool:
        return not self.error and self.latency_s is not None

    @property
    def mean_itl_s(self) -> float:
        """0 for a request of one token (no gaps)."""
        return sum(self.itls_s) / len(self.itls_s) if self.itls_s else 0.0


@dataclass(frozen=True)
class RunResult:
    results: list[RequestResult]
    duration_s: float  # the first send to the last request's end


@dataclass(frozen=True)
class Target:
    completions_url: str
    model: str
    api_key: str | None = None  # sent as a Bearer token (a gateway with --api-keys)

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}


def request_body(spec: RequestSpec, model: str) -> dict:
    return {
        "model": model,
        "prompt": spec.prompt_token_ids,
        "max_tokens": spec.max_tokens,
        "ignore_eos": True,  # exact output lengths: both systems do the same work
        "temperature": 0.0,
        "stream": True,
        "return_token_ids": True,  # so a chunk says how many tokens it carries
    }


async def stream_one(
    session: aiohttp.ClientSession, target: Target, spec: RequestSpec, run_start: float
) -> RequestResult:
    result = RequestResult(len(spec.prompt_token_ids), spec.max_tokens)
    start = time.perf_counter()
    result.sent_s = start - run_start
    try:
        body = request_body(spec, target.model)
        async with session.post(target.completions_url, json=body, headers=target.headers) as r:
            result.status, result.answered_s = r.status, time.perf_counter() - start
            if r.status != 200:
                result.error = f"HTTP {r.status}: {(await r.text())[:200]}"
                return result
            await _read_events(r, result, start)
    except asyncio.CancelledError:
        result.error = "unfinished when the run's time was up"
        raise
    except aiohttp.ClientError as error:
        result.error = f"{type(error).__name__}: {error}"
    if not result.error and result.num_output_tokens != spec.max_tokens:
        result.error = f"{result.num_output_tokens} tokens, asked for {spec.max_tokens}"
    return result


async def _read_events(response: aiohttp.ClientResponse, result: RequestResult, start: float):
    last_token_at: float | None = None
    async for line in response.content:
        if not line.startswith(b"data: "):
            continue
        data = line[len(b"data: ") :].strip()
        if data == b"[DONE]":
            result.latency_s = (last_token_at or time.perf_counter()) - start
            return
        event = json.loads(data)
        if "error" in event:
            result.error = str(event["error"].get("message", event["error"]))[:200]
            return
        now = time.perf_counter()
        num_tokens = sum(len(choice.get("token_ids") or ()) for choice in event["choices"])
        if num_tokens == 0:
            continue
        if last_token_at is None:
            result.ttft_s = now - start
            num_tokens_timed = num_tokens - 1  # the rest of the first chunk came with it
            gap = 0.0
        else:
            num_tokens_timed = num_tokens
            gap = now - last_token_at
        result.itls_s += [gap / max(num_tokens_timed, 1)] * num_tokens_timed
        result.num_output_tokens += num_tokens
        last_token_at = now
    result.error = "the stream ended without [DONE]"


def _session() -> aiohttp.ClientSession:
    # No connection limit (an open loop never waits for a free connection), no total timeout
    # (the run's own deadline cancels what is left).
    connector = aiohttp.TCPConnector(limit=0)
    return aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=None))


async def run_open_loop(
    target: Target,
    workload: list[RequestSpec],
    drain_timeout_s: float,
    on_progress: ProgressCallback | None = None,
) -> RunResult:
    """Sends each request at its arrival time; after the last arrival waits at most
    `drain_timeout_s` for the rest, then cancels what is still streaming (the gateway sees
    the disconnect and aborts it on the pods). Cancelled requests are failures."""
    async with _session() as session:
        run_start = time.perf_counter()
        progress = _Progress(len(workload), on_progress)
        tasks = []
        for spec in workload:
            delay = run_start + spec.arrival_s - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            task = asyncio.create_task(stream_one(session, target, spec, run_start))
            task.add_done_callback(progress.one_done)
            tasks.append(task)
            progress.num_sent += 1
        await asyncio.wait(tasks, timeout=drain_timeout_s)
        progress.close()
        results = await _collect(tasks, workload)
        duration = time.perf_counter() - run_start
    return RunResult(results, duration)


async def run_sequential(
    target: Target,
    workload: list[RequestSpec],
    on_progress: ProgressCallback | None = None,
) -> RunResult:
    """A closed loop of one: each request is sent when the previous one has finished."""
    async with _session() as session:
        run_start = time.perf_counter()
        results = []
        for i, spec in enumerate(workload):
            results.append(await stream_one(session, target, spec, run_start))
            if on_progress is not None:
                on_progress(i + 1, i + 1, len(workload))
        return RunResult(results, time.perf_counter() - run_start)


async def _collect(tasks: list[asyncio.Task], workload: list[RequestSpec]) -> list[RequestResult]:
    for task in tasks:
        task.cancel()  # no-op for the finished ones
    await asyncio.gather(*tasks, return_exceptions=True)
    results = []
    for task, spec in zip(tasks, workload):
        if task.cancelled():
            cancelled = RequestResult(len(spec.prompt_token_ids), spec.max_tokens)
            cancelled.error = "unfinished when the run's time was up"
            results.append(cancelled)
        else:
            results.append(task.result())
    return results


class _Progress:
    """Calls `on_progress(done, sent, total)` every few seconds while a run goes on (a
    ticker, so a saturated system that finishes nothing for a while still shows progress),
    and once more at the end."""

    def __init__(self, total: int, on_progress: ProgressCallback | None) -> None:
        self.total = total
        self.num_done = 0
        self.num_sent = 0
        self._on_progress = on_progress
        self._ticker = asyncio.create_task(self._tick()) if on_progress is not None else None

    def one_done(self, task: asyncio.Task) -> None:
        if not task.cancelled():
            self.num_done += 1

    def close(self) -> None:
        if self._ticker is not None:
            self._ticker.cancel()
            self._report()

    async def _tick(self) -> None:
        while True:
            await asyncio.sleep(PROGRESS_INTERVAL_S)
            self._report()

    def _report(self) -> None:
        assert self._on_progress is not None, "only reports when asked to"
        self._on_progress(self.num_done, self.num_sent, self.total)


def print_progress(label: str) -> ProgressCallback:
    def report(done: int, sent: int, total: int) -> None:
        print(
            f"  [{label}] {done}/{total} requests done ({sent} sent)", file=sys.stderr, flush=True
        )

    return report
