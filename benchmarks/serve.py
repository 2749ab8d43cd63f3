"""`make bench-serve`: disaggregated against colocated serving, under the same open-loop load.

Both systems are started the way `splitserve up` starts them (its plan, its supervisor), with
the engine processes pinned to cores:

- disaggregated: 1 prefill process on one core and 1 decode process on the other, one torch
  thread each;
- colocated (`--colocated`): 1 decode process doing both phases, two torch threads on both.

Each is measured unloaded (one request at a time), then at each rate of a sweep with the same
seeded workload: Poisson arrivals, prompts of uniform length (token ids), outputs of uniform
exact length (ignore_eos), streamed, so TTFT and every inter-token latency (ITL) are measured
by the client. The report gives TTFT and ITL p50/p90/p99, throughput and goodput under an SLO,
both systems side by side per rate, and marks the rate where colocated's ITL p90 reaches twice
its unloaded value: the issue's goal is disaggregated's ITL p90 clearly lower there. Plots go
to docs/bench_serve_*.png. Progress goes to stderr, the report to stdout.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import time
from dataclasses import asdict

from benchmarks.serving.options import BenchConfig, build_parser, config_from_args
from benchmarks.serving.report import (
    NOISY_FOREIGN_CORES,
    Point,
    SystemResults,
    full_report,
    knee_rate,
    plot_distributions,
    plot_vs_rate,
)
from splitserve.loadgen.client import (
    Target,
    print_progress,
    run_open_loop,
    run_sequential,
)
from splitserve.loadgen.cpu import ForeignLoad, idle_foreign_load
from splitserve.loadgen.stacks import RunningStack, SystemSetup, usable_cores
from splitserve.loadgen.stats import summarize
from splitserve.loadgen.workload import (
    LengthDistribution,
    WorkloadShape,
    poisson_workload,
    sequential_workload,
)

WARM_UP_REQUESTS = 2
IDLE_TIMEOUT_S = 30.0


# ---- running ----------------------------------------------------------------------------------


def disaggregated(cores: tuple[int, int], transport: str | None) -> SystemSetup:
    flags = ["--prefill", "1", "--decode", "1", "--num-threads", "1"]
    if transport is not None:
        flags += ["--transport", transport]
    return SystemSetup(
        "disaggregated",
        flags,
        {"prefill-0": {cores[0]}, "decode-0": {cores[1]}},
        f"prefill-0 on CPU {cores[0]}, decode-0 on CPU {cores[1]}, 1 torch thread each",
    )


def colocated(cores: tuple[int, int]) -> SystemSetup:
    return SystemSetup(
        "colocated",
        ["--colocated", "--decode", "1", "--num-threads", "2"],
        {"decode-0": set(cores)},
        f"decode-0 prefills and decodes on CPUs {cores[0]},{cores[1]}, 2 torch threads",
    )


def log(message: str) -> None:
    print(f"[bench-serve {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def run_system(setup: SystemSetup, config: BenchConfig) -> SystemResults:
    _wait_quiet(config.quiet_wait_s)
    log(f"starting {setup.name}: {setup.description}")
    started = time.monotonic()
    with RunningStack(setup, config.startup_timeout_s) as stack:
        log(f"{setup.name} up in {time.monotonic() - started:.0f} s ({stack.plan.mode_note})")
        target = Target(f"{stack.base_url}/v1/completions", stack.model_name())
        # The first requests after start-up pay one-off costs (allocation, first calls).
        warm_up_shape = WorkloadShape(config.shape.prompt_lens, LengthDistribution(8, 8))
        warm_up = sequential_workload(f"{config.seed}/warm-up", WARM_UP_REQUESTS, warm_up_shape)
        asyncio.run(run_sequential(target, warm_up))
        results = SystemResults(setup.name, setup.description, points=[])
        results.unloaded = _measure_quietly(stack, target, None, config)
        for rate in config.rates:
            results.points.append(_measure_quietly(stack, target, rate, config))
    return results


def _measure_quietly(
    stack: RunningStack, target: Target, rate: float | None, config: BenchConfig
) -> Point:
    """`_measure`, once more after a quiet spell if other processes were busy meanwhile."""
    point = _measure(stack, target, rate, config)
    if point.foreign_cores > NOISY_FOREIGN_CORES and config.retry_noisy:
        log(f"other processes took {point.foreign_cores:.2f} cores meanwhile: measuring again")
        _wait_quiet(config.quiet_wait_s)
        # New prompts: the pod's prefix cache holds the first try's.
        point = _measure(stack, target, rate, config, seed_suffix="/again")
    return point


def _wait_quiet(timeout_s: float) -> None:
    """Waits (up to `timeout_s`) until other processes leave the cores alone: on a shared
    machine a stranger's busy core would be measured as our latency."""
    deadline = time.monotonic() + timeout_s
    load = idle_foreign_load()
    while load > NOISY_FOREIGN_CORES and time.monotonic() < deadline:
        log(f"other processes keep {load:.1f} cores busy; waiting for them")
        time.sleep(4.0)
        load = idle_foreign_load()
    if load > NOISY_FOREIGN_CORES:
        log(f"WARNING: other processes keep {load:.1f} cores busy; the figures will be noisy")


def _measure(
    stack: RunningStack,
    target: Target,
    rate: float | None,
    config: BenchConfig,
    seed_suffix: str = "",
) -> Point:
    name = stack.setup.name
    label = f"{name} {'unloaded' if rate is None else f'{rate:g} req/s'}"
    tokens_before = _prefill_pod_tokens(stack)
    foreign = ForeignLoad(lambda: [os.getpid(), *stack.pids()])
    foreign.start()
    if rate is None:
        seed = f"{config.seed}/unloaded{seed_suffix}"
        workload = sequential_workload(seed, config.num_unloaded, config.shape)
        run = asyncio.run(run_sequential(target, workload, print_progress(label)))
    else:
        seed = f"{config.seed}/rate={rate:g}{seed_suffix}"
        workload = poisson_workload(
            seed, rate, config.duration_s, config.max_requests, config.shape
        )
        log(f"{label}: {len(workload)} requests over {workload[-1].arrival_s:.0f} s")
        progress = print_progress(label)
        run = asyncio.run(run_open_loop(target, workload, config.drain_timeout_s, progress))
    foreign_cores = foreign.cores()
    stack.check_alive()
    if not stack.wait_idle(IDLE_TIMEOUT_S):
        log("WARNING: the pods were still busy after the run; going on")
    share = _remote_share(stack, tokens_before, workload)
    point = Point(rate, len(workload), run, summarize(run, config.slo), share, foreign_cores)
    log(f"{label}: {_one_line(point)}")
    return point


def _prefill_pod_tokens(stack: RunningStack) -> int | None:
    """Prompt tokens the prefill pod has computed so far (what it looked up in its prefix
    cache, one lookup per prefill), or None without a prefill pod."""
    stats = stack.pod_stats().get("prefill-0")
    return None if stats is None else stats.prefix_cache_queried_tokens


def _remote_share(stack: RunningStack, before: int | None, workload) -> float | None:
    """Shows that disaggregated really prefilled on the prefill pod (a failing KV transfer
    falls back to local prefill silently, which would make it colocated in disguise)."""
    after = _prefill_pod_tokens(stack)
    if before is None or after is None:
        return None
    return (after - before) / sum(len(spec.prompt_token_ids) for spec in workload)


def _one_line(point: Point) -> str:
    s = point.summary
    return (
        f"{s.num_ok}/{s.num_requests} finished, TTFT p90 {s.ttft.p90 * 1e3:.0f} ms, "
        f"ITL p50/p90 {s.itl.p50 * 1e3:.0f}/{s.itl.p90 * 1e3:.0f} ms, "
        f"{s.output_throughput:.1f} tok/s, goodput {s.goodput:.2f} req/s, "
        f"other processes {point.foreign_cores:.2f} cores"
    )


# ---- output -----------------------------------------------------------------------------------


def write_plots(coloc: SystemResults, disagg: SystemResults, plot_dir: str) -> list[str]:
    os.makedirs(plot_dir, exist_ok=True)
    vs_rate = os.path.join(plot_dir, "bench_serve_latency_vs_rate.png")
    plot_vs_rate(coloc, disagg, vs_rate)
    # The distributions where the comparison is made, or at the heaviest load.
    rate = knee_rate(coloc) or max(p.rate for p in coloc.points or [])
    distribution = os.path.join(plot_dir, "bench_serve_latency_cdf.png")
    plot_distributions(coloc, disagg, rate, distribution)
    return [vs_rate, distribution]


def write_json(path: str, config: BenchConfig, systems: list[SystemResults]) -> None:
    def point_json(point: Point | None) -> dict | None:
        if point is None:
            return None
        return {
            "rate": point.rate,
            "num_requests": point.num_requests,
            "remote_prefill_share": point.remote_prefill_share,
            "foreign_cores": point.foreign_cores,
            **asdict(point.summary),
        }

    body = {
        "config": asdict(config),
        "systems": {
            s.name: {
                "description": s.description,
                "unloaded": point_json(s.unloaded),
                "rates": [point_json(p) for p in s.points or []],
            }
            for s in systems
        },
    }
    with open(path, "w") as file:
        json.dump(body, file, indent=2)


def _raise_interrupt(signum, frame) -> None:
    raise KeyboardInterrupt()


def main(argv: list[str] | None = None) -> int:
    args = build_parser(__doc__).parse_args(argv)
    try:
        config = config_from_args(args)
        cores = usable_cores()
    except ValueError as error:
        print(f"bench-serve: error: {error}", file=sys.stderr)
        return 2
    # SIGTERM unwinds like Ctrl-C, through the `with` that stops every process we started.
    signal.signal(signal.SIGTERM, _raise_interrupt)
    setups = {
        "colocated": colocated(cores),
        "disaggregated": disaggregated(cores, config.transport),
    }
    results = {}
    try:
        for name in config.systems:  # one at a time: each needs both cores to itself
            results[name] = run_system(setups[name], config)
    except KeyboardInterrupt:
        log("interrupted; every process it started is stopped")
        return 130
    coloc = results.get("colocated") or SystemResults("colocated", "not run")
    disagg = results.get("disaggregated") or SystemResults("disaggregated", "not run")
    print(full_report(coloc, disagg, config.slo), flush=True)
    if config.plot_dir is not None and coloc.points and disagg.points:
        for path in write_plots(coloc, disagg, config.plot_dir):
            log(f"wrote {path}")
    if config.json_path is not None:
        write_json(config.json_path, config, list(results.values()))
        log(f"wrote {config.json_path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
