"""`splitserve plan validate`: the simulator against the real services on this machine.

Three configurations that fit two cores, each engine process pinned to a core with one torch
thread (what the profile measures):

- colocated-1: one decode pod prefilling for itself (`up --colocated --decode 1`);
- colocated-2: two such pods, one per core (`up --colocated --decode 2`);
- 1P+1D: a prefill pod and a decode pod (`up --prefill 1 --decode 1`), KV over UCX or TCP.

Two workloads, both seeded Poisson arrivals with exact output lengths (EOS ignored): "chat"
(prompts 32-128 tokens, outputs 8-32) and "long-prompt" (prompts 256-512, outputs 4-12). The
rate of each is set from the profile so that one pod is about half busy. With `--fresh-profile`
the profile is measured first, pinned to the core the pods will use, so that both see the
machine in the same state (on a shared machine, a profile from another hour is another
machine). Each run is measured client-side with the open-loop streaming client of
`services/loadgen` (TTFT, every inter-token gap), then the same requests (arrival times and
lengths) are simulated with the profile, and the percentiles are printed side by side, twice:
with the bare engine's profile, and with the serving path's fixed costs added (a per-step and a
per-request overhead, measured on each running stack from four requests sent one at a time
before the loaded runs: what the engine profile cannot see, such as gRPC streaming and the
gateway).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import sys
import time
from dataclasses import asdict, dataclass, replace

from services.loadgen.stats import Percentiles, Slo, summarize
from services.loadgen.workload import (
    LengthDistribution,
    SimRequest,
    WorkloadShape,
    as_sim_requests,
    poisson_workload,
    sequential_workload,
)
from services.planner.profile import Profile, load_profile
from services.planner.simulator import ClusterConfig, simulate

TOLERANCE = 0.25
TARGET_UTILIZATION = 0.5  # of one pod, by the profile: loaded, but well short of saturation
LOOSE_SLO = Slo(ttft_s=1e9, itl_s=1e9)  # validation compares latencies, not goodput


@dataclass(frozen=True)
class LocalConfig:
    name: str
    up_flags: tuple[str, ...]
    pins: tuple[str, ...]  # process names pinned to core 0, core 1 (in that order)
    num_prefill: int
    num_decode: int


CONFIGS = (
    LocalConfig("colocated-1", ("--colocated", "--decode", "1"), ("decode-0",), 0, 1),
    LocalConfig("colocated-2", ("--colocated", "--decode", "2"), ("decode-0", "decode-1"), 0, 2),
    LocalConfig("1P+1D", ("--prefill", "1", "--decode", "1"), ("prefill-0", "decode-0"), 1, 1),
)


@dataclass(frozen=True)
class LocalWorkload:
    name: str
    shape: WorkloadShape


# Short enough that a minute's run holds a few dozen requests on one CPU core per pod.
WORKLOADS = (
    LocalWorkload("chat", WorkloadShape(LengthDistribution(32, 128), LengthDistribution(8, 32))),
    LocalWorkload(
        "long-prompt", WorkloadShape(LengthDistribution(256, 512), LengthDistribution(4, 12))
    ),
)


@dataclass(frozen=True)
class Latencies:
    ttft_p50: float
    ttft_p90: float
    itl_p50: float
    itl_p90: float

    @classmethod
    def of(cls, ttft: Percentiles, itl: Percentiles) -> Latencies:
        return cls(ttft.p50, ttft.p90, itl.p50, itl.p90)


@dataclass(frozen=True)
class Overheads:
    """The serving path's fixed costs, measured on the running stack with one request at a
    time (see `_measure_overheads`)."""

    step_s: float
    request_s: float


@dataclass(frozen=True)
class Comparison:
    config: str
    workload: str
    rate: float
    num_requests: int
    num_ok: int
    foreign_cores: float  # other processes' CPU use meanwhile
    measured: Latencies
    simulated: Latencies  # the profile as measured (the bare engine)
    overheads: Overheads
    simulated_with_overheads: Latencies

    def errors(self, with_overheads: bool = True) -> dict[str, float]:
        """Relative error of each simulated figure against the measured one."""
        simulated = self.simulated_with_overheads if with_overheads else self.simulated
        measured, simulated_figures = asdict(self.measured), asdict(simulated)
        return {key: simulated_figures[key] / measured[key] - 1 for key in measured}


def log(message: str) -> None:
    print(f"[plan validate {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def workload_rate(profile: Profile, workload: LocalWorkload) -> float:
    """Requests/s that keep one pod about TARGET_UTILIZATION busy, by the profile."""
    mean_in = workload.shape.prompt_lens.mean
    mean_out = workload.shape.output_lens.mean
    context = mean_in + mean_out / 2
    busy_s = profile.prefill_s(int(mean_in)) + (mean_out - 1) * profile.decode.step_s(2, context)
    return round(TARGET_UTILIZATION / busy_s, 3)


# ---- one measured run -----------------------------------------------------------------------


def run_config(config: LocalConfig, profile: Profile, args: argparse.Namespace) -> list[Comparison]:
    from services.loadgen.stacks import RunningStack, SystemSetup, usable_cores

    cores = usable_cores()
    pins = {name: {core} for name, core in zip(config.pins, cores)}
    setup = SystemSetup(config.name, [*config.up_flags, "--num-threads", "1"], pins, config.name)
    log(f"starting {config.name}")
    with RunningStack(setup) as stack:
        log(f"{config.name} is up ({stack.plan.mode_note})")
        target = _target(stack)
        _warm_up(target, args.seed)
        overheads = _measure_overheads(target, config, profile, args.seed)
        log(
            f"{config.name} unloaded: {overheads.step_s * 1e3:.1f} ms per step and "
            f"{overheads.request_s * 1e3:.0f} ms per request beyond the bare engine"
        )
        return [
            _measure(stack, target, config, workload, profile, overheads, args)
            for workload in WORKLOADS
        ]


def _target(stack):
    from services.loadgen.client import Target

    return Target(f"{stack.base_url}/v1/completions", stack.model_name())


def _warm_up(target, seed: int) -> None:
    from services.loadgen.client import run_sequential

    shape = WorkloadShape(LengthDistribution(64, 256), LengthDistribution(8, 8))
    asyncio.run(run_sequential(target, sequential_workload(f"{seed}/warm-up", 2, shape)))


UNLOADED_REQUESTS = 4


def _measure_overheads(target, config: LocalConfig, profile: Profile, seed: int) -> Overheads:
    """What the serving path adds to the bare engine, from requests sent one at a time: the
    gap between measured and simulated median ITL is a per-step cost (streaming each step's
    tokens through the pod's gRPC, the gateway and SSE); what then remains of the TTFT gap is
    a per-request cost (HTTP, routing, the RPC hops before the first step)."""
    from services.loadgen.client import run_sequential

    shape = WorkloadShape(LengthDistribution(64, 128), LengthDistribution(16, 16))
    specs = sequential_workload(f"{seed}/unloaded", UNLOADED_REQUESTS, shape)
    run = asyncio.run(run_sequential(target, specs))
    if not any(r.ok for r in run.results):
        return Overheads(0.0, 0.0)
    measured = _measured(run)
    # One at a time in the simulation too: arrivals far apart.
    apart = [replace(spec, arrival_s=i * 1000.0) for i, spec in enumerate(specs)]
    requests = as_sim_requests(apart)
    bare = _simulate_requests(profile, config, requests)
    step_s = max(measured.itl_p50 - bare.itl_p50, 0.0)
    with_steps = _simulate_requests(replace(profile, step_overhead_s=step_s), config, requests)
    return Overheads(step_s, max(measured.ttft_p50 - with_steps.ttft_p50, 0.0))


def _with_overheads(profile: Profile, overheads: Overheads) -> Profile:
    return replace(
        profile, step_overhead_s=overheads.step_s, request_overhead_s=overheads.request_s
    )


def _measured(run) -> Latencies:
    """The client's figures of the requests that finished."""
    summary = summarize(run, LOOSE_SLO)
    return Latencies.of(summary.ttft, summary.itl)


def _measure(stack, target, config, workload, profile, overheads, args) -> Comparison:
    from services.loadgen.client import print_progress, run_open_loop
    from services.loadgen.cpu import ForeignLoad

    rate = workload_rate(profile, workload)
    seed = f"{args.seed}/{workload.name}"
    specs = poisson_workload(seed, rate, args.duration, 10_000, workload.shape)
    label = f"{config.name} {workload.name} {rate:g} req/s"
    log(f"{label}: {len(specs)} requests over {specs[-1].arrival_s:.0f} s")
    foreign = ForeignLoad(lambda: [os.getpid(), *stack.pids()])
    foreign.start()
    drain_s = 60.0
    run = asyncio.run(run_open_loop(target, specs, drain_s, print_progress(label)))
    foreign_cores = foreign.cores()
    num_ok = sum(result.ok for result in run.results)
    requests = as_sim_requests(specs)
    comparison = Comparison(
        config.name,
        workload.name,
        rate,
        len(specs),
        num_ok,
        foreign_cores,
        _measured(run),
        _simulate_requests(profile, config, requests),
        overheads,
        _simulate_requests(_with_overheads(profile, overheads), config, requests),
    )
    log(f"{label}: {num_ok}/{len(specs)} finished; {_errors_line(comparison)}")
    stack.wait_idle(timeout_s=30.0)
    return comparison


def _simulate_requests(
    profile: Profile, config: LocalConfig, requests: list[SimRequest]
) -> Latencies:
    cluster = ClusterConfig(config.num_prefill, config.num_decode)
    result = simulate(profile, cluster, requests, LOOSE_SLO)
    return Latencies.of(result.ttft, result.itl)


# ---- the report -----------------------------------------------------------------------------

_FIGURES = (
    ("ttft_p50", "TTFT p50"),
    ("ttft_p90", "TTFT p90"),
    ("itl_p50", "ITL p50"),
    ("itl_p90", "ITL p90"),
)


def _errors_line(comparison: Comparison) -> str:
    errors = comparison.errors()
    return ", ".join(f"{title} {errors[key]:+.0%}" for key, title in _FIGURES)


def format_report(comparisons: list[Comparison], with_overheads: bool = True) -> str:
    header = f"{'config':<12} {'workload':<12} {'rate':>5} {'ok':>7} {'other':>5}"
    header += "".join(f" {title + ' meas/sim (ms)':>24}" for _, title in _FIGURES)
    kind = "with the serving overheads measured unloaded" if with_overheads else "bare engine"
    lines = [f"simulated with the profile, {kind}:", header]
    within = total = 0
    for c in comparisons:
        simulated = c.simulated_with_overheads if with_overheads else c.simulated
        measured, errors = asdict(c.measured), c.errors(with_overheads)
        simulated = asdict(simulated)
        row = f"{c.config:<12} {c.workload:<12} {c.rate:>5.2f} {c.num_ok:>3}/{c.num_requests:<3} "
        row += f"{c.foreign_cores:>5.2f}"
        for key, _ in _FIGURES:
            cell = f"{measured[key] * 1e3:.0f}/{simulated[key] * 1e3:.0f} {errors[key]:+.0%}"
            row += f" {cell:>24}"
            if not math.isnan(errors[key]):
                total += 1
                within += abs(errors[key]) <= TOLERANCE
        lines.append(row)
    lines.append(
        f"{within}/{total} simulated figures within {TOLERANCE:.0%} of the measured ones "
        "('other' = cores other processes kept busy during the run)"
    )
    return "\n".join(lines)


def run_validation(args: argparse.Namespace) -> int:
    if args.duration <= 0:
        raise ValueError("--duration must be > 0 seconds")
    configs = [c for c in CONFIGS if not args.only or c.name in args.only]
    if not configs:
        raise ValueError(f"--only names none of {[c.name for c in CONFIGS]}")
    profile = _profile(args.profile, args.fresh_profile)
    for workload in WORKLOADS:
        log(f"workload {workload.name}: {workload_rate(profile, workload):g} req/s")
    comparisons: list[Comparison] = []
    try:
        for config in configs:
            comparisons += run_config(config, profile, args)
    except KeyboardInterrupt:
        log("interrupted; every process it started is stopped")
    print(format_report(comparisons, with_overheads=False), flush=True)
    print()
    print(format_report(comparisons), flush=True)
    for config_name, overheads in {c.config: c.overheads for c in comparisons}.items():
        print(
            f"  {config_name}: {overheads.step_s * 1e3:.1f} ms per step, "
            f"{overheads.request_s * 1e3:.0f} ms per request"
        )
    if args.json:
        with open(args.json, "w") as file:
            json.dump([asdict(c) for c in comparisons], file, indent=2)
    if args.plot and comparisons:
        from services.planner.plot import plot_validation

        plot_validation(comparisons, args.plot)
        log(f"wrote {args.plot}")
    return 0


def _profile(path: str, fresh: bool) -> Profile:
    if os.path.exists(path) and not fresh:
        return load_profile(path)
    from services.loadgen.stacks import usable_cores
    from services.planner.profiler import QUICK_GRID, ProfileSettings, measure_profile

    log(f"measuring a profile into {path} first, pinned to CPU {usable_cores()[0]}")
    affinity = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {usable_cores()[0]})  # as a pod runs: one thread on one core
    try:
        profile = measure_profile(ProfileSettings(repeats=5, **QUICK_GRID), log=log)
    finally:
        os.sched_setaffinity(0, affinity)
    profile.save(path)
    return profile
