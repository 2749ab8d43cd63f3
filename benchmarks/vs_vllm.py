"""splitserve beside vLLM's CPU build on this machine, same weights, same client, same KV budget.

    python -m benchmarks.vs_vllm [--quick] [--parts streams openloop] [--systems ...]

- streams: ITL (and TTFT) at 1, 2, 4, 8, 16 concurrent streams, each a closed loop of requests
  with 128-token prompts and 64 output tokens (exact lengths, EOS ignored);
- openloop: an open-loop Poisson sweep (prompts 64-512 tokens, outputs 32-128) with TTFT and ITL
  p50/p90/p99 and output throughput at each rate.

Systems: vLLM (`vllm.entrypoints.openai.api_server`, in its own virtual environment, see
benchmarks/peer/vllm_venv.py), `splitserve up --colocated` and `splitserve up` (1 prefill +
1 decode). Prompts are token ids drawn from a seeded generator, different for every run, so no
prefix cache helps either side. Ratios are splitserve / vLLM (below 1 is better for us).
Offline figures: `python -m benchmarks.peer.offline` (the same three as `make bench-engine`).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

from benchmarks.peer.vllm_server import VllmServer
from splitserve.loadgen.client import (
    RunResult,
    Target,
    print_progress,
    run_open_loop,
    run_sequential,
)
from splitserve.loadgen.stacks import RunningStack, SystemSetup
from splitserve.loadgen.stats import Percentiles, Slo, summarize
from splitserve.loadgen.workload import (
    LengthDistribution,
    RequestSpec,
    WorkloadShape,
    poisson_workload,
    sequential_workload,
)

KV_CACHE_GIB = 2
SYSTEMS = ("vllm", "colocated", "disaggregated")
STREAM_SHAPE = WorkloadShape(LengthDistribution(128, 128), LengthDistribution(64, 64))
OPEN_LOOP_SHAPE = WorkloadShape(LengthDistribution(64, 512), LengthDistribution(32, 128))
# Only for the goodput column, which this report does not print; summarize needs one.
ANY_SLO = Slo(ttft_s=3600.0, itl_s=3600.0)


@dataclass(frozen=True)
class Scale:
    concurrencies: tuple[int, ...]
    requests_per_stream: int
    rates: tuple[float, ...]
    open_loop_s: float

    @classmethod
    def chosen(cls, quick: bool) -> Scale:
        if quick:
            return cls((1, 4, 16), 2, (0.8,), 40.0)
        return cls((1, 2, 4, 8, 16), 3, (0.4, 0.8, 1.6), 90.0)


@dataclass(frozen=True)
class StreamsFigures:
    concurrency: int
    itl: Percentiles
    ttft: Percentiles
    output_tok_s: float
    num_failed: int


@dataclass(frozen=True)
class OpenLoopFigures:
    rate: float
    itl: Percentiles
    ttft: Percentiles
    output_tok_s: float
    num_failed: int


# ---- systems --------------------------------------------------------------------------------


@contextlib.contextmanager
def serving(system: str, extra_flags: list[str]) -> Iterator[Target]:
    """The system's completions endpoint while the block runs."""
    if system == "vllm":
        with VllmServer(KV_CACHE_GIB) as server:
            yield server.target()
        return
    flags = ["--kv-cache-bytes", f"{KV_CACHE_GIB}GiB", "--log-level", "warning", *extra_flags]
    if system == "colocated":
        flags.append("--colocated")
    with RunningStack(SystemSetup(system, flags)) as stack:
        yield Target(f"{stack.base_url}/v1/completions", stack.model_name())


# ---- the runs -------------------------------------------------------------------------------


async def run_streams(target: Target, concurrency: int, num_each: int, seed: str) -> RunResult:
    """`concurrency` closed loops at once, each sending its requests one after another."""
    loops = [
        sequential_workload(f"{seed}-{concurrency}-{i}", num_each, STREAM_SHAPE)
        for i in range(concurrency)
    ]
    start = time.perf_counter()
    runs = await asyncio.gather(*(run_sequential(target, specs) for specs in loops))
    return RunResult([r for run in runs for r in run.results], time.perf_counter() - start)


def streams_sweep(target: Target, scale: Scale, seed: str) -> list[StreamsFigures]:
    warm_up(target, seed)
    figures = []
    for concurrency in scale.concurrencies:
        print(f"  {concurrency} concurrent streams...", flush=True)
        run = asyncio.run(run_streams(target, concurrency, scale.requests_per_stream, seed))
        summary = summarize(run, ANY_SLO)
        figures.append(
            StreamsFigures(
                concurrency,
                summary.itl,
                summary.ttft,
                summary.output_throughput,
                summary.num_failed,
            )
        )
    return figures


def open_loop_sweep(target: Target, scale: Scale, seed: str) -> list[OpenLoopFigures]:
    warm_up(target, seed)
    figures = []
    for rate in scale.rates:
        workload = poisson_workload(
            f"{seed}-{rate}", rate, scale.open_loop_s, 10_000, OPEN_LOOP_SHAPE
        )
        progress = print_progress(f"{rate} req/s")
        run = asyncio.run(run_open_loop(target, workload, 120.0, progress))
        summary = summarize(run, ANY_SLO)
        figures.append(
            OpenLoopFigures(
                rate, summary.itl, summary.ttft, summary.output_throughput, summary.num_failed
            )
        )
    return figures


def warm_up(target: Target, seed: str) -> None:
    """A few requests of every shape first: a server's first calls pay one-off costs."""
    specs: list[RequestSpec] = sequential_workload(f"{seed}-warm", 3, OPEN_LOOP_SHAPE)
    asyncio.run(run_sequential(target, specs))


# ---- report ---------------------------------------------------------------------------------


def print_streams(results: dict[str, list[StreamsFigures]]) -> None:
    systems = list(results)
    print("\nITL median / p90 (ms) and TTFT median (ms) by concurrent streams")
    header = f"{'streams':>8} " + " ".join(f"{s + ' ITL p50/p90':>26}" for s in systems)
    header += " " + " ".join(f"{s + ' TTFT':>18}" for s in systems)
    ratios = [s for s in systems if s != "vllm" and "vllm" in results]
    header += " " + " ".join(f"{s + '/vllm ITL':>22}" for s in ratios)
    print(header)
    for row in range(len(results[systems[0]])):
        cells = [f"{results[systems[0]][row].concurrency:>8}"]
        for s in systems:
            f = results[s][row]
            cells.append(f"{f.itl.p50 * 1e3:>15.1f} / {f.itl.p90 * 1e3:>6.1f}")
        cells += [f"{results[s][row].ttft.p50 * 1e3:>18.0f}" for s in systems]
        vllm_itl = results["vllm"][row].itl.p50 if "vllm" in results else float("nan")
        cells += [f"{results[s][row].itl.p50 / vllm_itl:>22.2f}" for s in ratios]
        print(" ".join(cells))
    _print_failures(results)


def print_open_loop(results: dict[str, list[OpenLoopFigures]]) -> None:
    print("\nOpen loop: TTFT p50 | ITL p50 / p90 / p99 (ms) | output tok/s")
    for s, rows in results.items():
        for f in rows:
            print(
                f"{s:>14} {f.rate:>5.1f} req/s  TTFT {f.ttft.p50 * 1e3:7.0f} | ITL "
                f"{f.itl.p50 * 1e3:6.1f} / {f.itl.p90 * 1e3:6.1f} / {f.itl.p99 * 1e3:7.1f} | "
                f"{f.output_tok_s:6.1f} tok/s"
            )
    _print_failures(results)


def _print_failures(results: dict[str, list]) -> None:
    for s, rows in results.items():
        failed = sum(f.num_failed for f in rows)
        if failed:
            print(f"  ({s}: {failed} requests failed; their figures are left out)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="fewer points, shorter runs")
    parser.add_argument("--parts", nargs="+", default=["streams", "openloop"])
    parser.add_argument("--systems", nargs="+", default=list(SYSTEMS), choices=SYSTEMS)
    parser.add_argument("--json", type=Path, default=Path("build/vs_vllm.json"))
    parser.add_argument(
        "--up-flags", default="", help="more `splitserve up` flags, e.g. '--num-threads 2'"
    )
    parser.add_argument(
        "--rates", type=float, nargs="+", default=None, help="open-loop rates (req/s)"
    )
    args = parser.parse_args(argv)
    scale = Scale.chosen(args.quick)
    if args.rates:
        scale = dataclasses.replace(scale, rates=tuple(args.rates))
    seed = f"vs-vllm-{int(time.time())}"  # new prompts every run: no cache carries over
    streams: dict[str, list[StreamsFigures]] = {}
    open_loop: dict[str, list[OpenLoopFigures]] = {}
    for system in args.systems:
        print(f"[{system}] starting", flush=True)
        with serving(system, args.up_flags.split()) as target:
            if "streams" in args.parts:
                streams[system] = streams_sweep(target, scale, seed)
            if "openloop" in args.parts:
                open_loop[system] = open_loop_sweep(target, scale, seed)
    if streams:
        print_streams(streams)
    if open_loop:
        print_open_loop(open_loop)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    payload = {"streams": _as_json(streams), "open_loop": _as_json(open_loop)}
    args.json.write_text(json.dumps(payload, indent=1))
    return 0


def _as_json(results: dict[str, list]) -> dict[str, list[dict]]:
    return {system: [asdict(row) for row in rows] for system, rows in results.items()}


if __name__ == "__main__":
    raise SystemExit(main())
