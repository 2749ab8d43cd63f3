"""The two workloads and the two clients, each run turned into per-request `Outcome`s.

- vLLM's client (`vllm bench serve`, benchmarks/peer/vllm_bench.py) is the common yardstick:
  the same client against vLLM and against our gateway. `--save-detailed` gives its
  per-request lists, so both SLO pairs are scored here the same way for every system; its own
  `--goodput` figure (the loose pair) is kept beside ours as a cross-check.
- Our client (services/loadgen) also times how fast a refusal came back, which vLLM's does not:
  it keeps only the reason phrase of a non-200 answer, and no time.
"""

from __future__ import annotations

import asyncio
import math
from dataclasses import dataclass
from http import HTTPStatus

from benchmarks.goodput.figures import LOOSE, Outcome
from benchmarks.peer.vllm_bench import run_vllm_bench
from splitserve.loadgen.client import (
    RunResult,
    Target,
    print_progress,
    run_open_loop,
    run_sequential,
)
from splitserve.loadgen.workload import (
    LengthDistribution,
    WorkloadShape,
    poisson_workload,
    sequential_workload,
)

# vLLM's client keeps `response.reason` as a refused request's error: map it back to a status.
PHRASE_STATUS = {status.phrase: status.value for status in HTTPStatus}
# Its error when the answer was 200 but no token came.
NO_TOKEN_ERROR = "Never received a valid chunk"


@dataclass(frozen=True)
class Workload:
    """Lengths uniform in [mean * (1 - r), mean * (1 + r)], drawn the way vLLM's random
    dataset draws them (`--random-range-ratio`), so both clients send the same mix."""

    name: str
    prompt_len: int  # mean
    output_len: int  # mean
    range_ratio: float = 0.0

    def _bounds(self, mean: int) -> LengthDistribution:
        low = max(1, math.floor(mean * (1 - self.range_ratio)))
        return LengthDistribution(low, math.ceil(mean * (1 + self.range_ratio)))

    @property
    def shape(self) -> WorkloadShape:
        return WorkloadShape(self._bounds(self.prompt_len), self._bounds(self.output_len))

    def vllm_args(self) -> list[str]:
        args = ["--dataset-name", "random", "--random-input-len", str(self.prompt_len)]
        args += ["--random-output-len", str(self.output_len)]
        return args + ["--random-range-ratio", str(self.range_ratio), "--ignore-eos"]


FIXED = Workload("256/64", 256, 64)
# The same means as FIXED, so the saturation rates compare and only the spread differs:
# prompts 64-448 tokens, outputs 16-112.
MIXED = Workload("mixed", 256, 64, 0.75)
WORKLOADS = (FIXED, MIXED)


@dataclass(frozen=True)
class Measured:
    outcomes: list[Outcome]
    duration_s: float  # as the client measured it
    client_goodput: float | None = None  # vLLM's client's own figure for the loose pair


# ---- vLLM's client --------------------------------------------------------------------------


def vllm_outcomes(result: dict) -> list[Outcome]:
    """Per-request outcomes from `vllm bench serve --save-detailed`'s result JSON."""
    rows = zip(result["errors"], result["ttfts"], result["latencies"], result["output_lens"])
    return [_vllm_outcome(error, ttft, latency, num_out) for error, ttft, latency, num_out in rows]


def _vllm_outcome(error: str, ttft: float, latency: float, num_output: int) -> Outcome:
    if not error:
        # vLLM's own TPOT: the time after the first token over the tokens after it.
        tpot = (latency - ttft) / (num_output - 1) if num_output > 1 else 0.0
        return Outcome(200, True, ttft, tpot)
    if error.startswith(NO_TOKEN_ERROR):
        return Outcome(200, False, None, None)
    return Outcome(PHRASE_STATUS.get(error.strip()), False, None, None)  # None: an exception


def vllm_open_loop(
    base_url: str, model: str, workload: Workload, rate: float, num_prompts: int, seed: int
) -> Measured:
    """Poisson arrivals at `rate` (`--request-rate`), `num_prompts` of them."""
    args = workload.vllm_args() + ["--num-prompts", str(num_prompts), "--seed", str(seed)]
    args += ["--request-rate", f"{rate:.4f}", "--save-detailed", "--disable-tqdm"]
    args += ["--goodput", f"ttft:{LOOSE.ttft_ms}", f"tpot:{LOOSE.tpot_ms}"]
    result = run_vllm_bench(base_url, model, args)
    return Measured(vllm_outcomes(result), result["duration"], result.get("request_goodput"))


def vllm_saturation(
    base_url: str, model: str, workload: Workload, concurrency: int, num_prompts: int, seed: int
) -> float:
    """Completed requests/s of a closed loop of `concurrency` streams: every request is sent
    as one finishes, so the system is never idle and never sees a backlog grow."""
    args = workload.vllm_args() + ["--num-prompts", str(num_prompts), "--seed", str(seed)]
    args += ["--request-rate", "inf", "--max-concurrency", str(concurrency), "--disable-tqdm"]
    result = run_vllm_bench(base_url, model, args)
    return result["completed"] / result["duration"]


# ---- our client -----------------------------------------------------------------------------


def our_outcomes(run: RunResult) -> list[Outcome]:
    return [
        Outcome(r.status, r.ok, r.ttft_s, r.mean_itl_s if r.ok else None, r.answered_s)
        for r in run.results
    ]


def our_open_loop(
    target: Target, workload: Workload, rate: float, duration_s: float, seed: str
) -> Measured:
    """Poisson arrivals at `rate` for `duration_s`; what still streams a drain time after the
    last arrival is cancelled and counted as failed: no request that slow can be good."""
    specs = poisson_workload(seed, rate, duration_s, 1_000_000, workload.shape)
    progress = print_progress(f"our client {rate:.2f} req/s")
    drain_s = max(duration_s, slowest_good_s(workload))
    run = asyncio.run(run_open_loop(target, specs, drain_s, progress))
    return Measured(our_outcomes(run), run.duration_s)


def slowest_good_s(workload: Workload) -> float:
    """The longest a request of this workload can stream and still meet the loose SLO."""
    longest_output = workload.shape.output_lens.high
    return (LOOSE.ttft_ms + (longest_output - 1) * LOOSE.tpot_ms) / 1e3


def warm_up(target: Target, workload: Workload, seed: str) -> None:
    """Two requests one after the other: first-call costs (threads, caches) out of the way."""
    specs = sequential_workload(seed, 2, workload.shape)
    run = asyncio.run(run_sequential(target, specs))
    failed = [r.error for r in run.results if not r.ok]
    if failed:
        raise RuntimeError(f"warm-up request failed: {failed[0]}")
