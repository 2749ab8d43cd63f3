"""`splitserve plan validate`: the simulator against the real services on this machine.

Three configurations that fit two cores (`measure/local_stacks.py`), each engine process
pinned to a core with one torch thread (what the profile measures): colocated-1 (`up
--colocated --decode 1`), colocated-2 (two such pods, one per core) and 1P+1D (a prefill pod
and a decode pod).

Two workloads, both seeded Poisson arrivals with exact output lengths (EOS ignored): "chat"
(prompts 32-128 tokens, outputs 8-32) and "long-prompt" (prompts 256-512, outputs 4-12). The
rate of each is set from the profile so that one pod is about half busy. With `--fresh-profile`
the profile is measured first (the engine pinned to the core the pods will use, then the
serving path's costs on a colocated-1 and a 1P+1D stack, `measure/serving.py`), so that both see
the machine in the same state. Each run is measured client-side with the open-loop streaming
client of `services/loadgen` (TTFT, every inter-token gap), then the same requests (arrival
times and lengths) are simulated with the profile, and the percentiles are printed side by
side, twice: with the bare engine's costs, and with the profile's serving costs (the figures
the planner stands by). Last, each workload's configurations are ranked by a latency score,
measured and simulated, to check that the planner would pick the one that measures best
(`ranking.py`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from splitserve.loadgen.client import print_progress, run_open_loop
from splitserve.loadgen.cpu import ForeignLoad
from splitserve.loadgen.stacks import usable_cores
from splitserve.loadgen.stats import Percentiles, Slo, summarize
from splitserve.loadgen.workload import (
    LengthDistribution,
    SimRequest,
    WorkloadShape,
    as_sim_requests,
    poisson_workload,
)
from splitserve.planner.measure.local_stacks import (
    CONFIGS,
    LOOSE_SLO,
    LocalConfig,
    completions_target,
    pace_cores,
    running_stack,
    simulated_cluster,
    warm_up,
)
from splitserve.planner.measure.pace import EnginePace
from splitserve.planner.measure.serving import measure_serving
from splitserve.planner.measure.settings import QUICK_GRID, ProfileSettings
from splitserve.planner.plot import plot_validation
from splitserve.planner.profile import Profile, ServingCosts, load_profile
from splitserve.planner.profile.parts import topology_of
from splitserve.planner.simulate.cluster import simulate
from splitserve.planner.validate.drift import RunPace, format_drift
from splitserve.planner.validate.goodput import format_goodput, workload_slo
from splitserve.planner.validate.pod_pace import StepLogs
from splitserve.planner.validate.ranking import format_ranking
from splitserve.planner.validate.resolution import percentile_band, within_band

TOLERANCE = 0.20
TARGET_UTILIZATION = 0.5  # of one pod, by the profile: loaded, but well short of saturation


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


NO_LATENCIES = Latencies(math.nan, math.nan, math.nan, math.nan)


@dataclass(frozen=True)
class Comparison:
    config: str
    workload: str
    rate: float
    num_requests: int
    num_ok: int
    foreign_cores: float  # other processes' CPU use meanwhile
    measured: Latencies
    simulated: Latencies  # the bare engine's costs
    overheads: ServingCosts  # the profile's, for this configuration's topology
    simulated_with_overheads: Latencies  # the profile as the planner uses it
    # What the client timed of each finished request (for `--replay` and for reading the
    # distributions behind the percentiles).
    ttfts_s: list[float] = field(default_factory=list)
    itls_s: list[list[float]] = field(default_factory=list)
    # The workload's goodput SLOs (TTFT, mean ITL; `goodput.workload_slo`) and the share of
    # the requests the simulation (as the planner uses the profile) has meeting them.
    goodput_slo: tuple[float, ...] = ()
    simulated_attainment: float = math.nan
    # With a fresh profile: the bare engine's (prefill, decode) pace around the run against the
    # profile's steps, and the run simulated as the planner would at that pace (`drift.py`).
    engine_pace: tuple[float, ...] = ()
    simulated_at_pace: Latencies = NO_LATENCIES
    # The pods' own (prefill, decode) pace during the run, from their step logs, and the run
    # simulated as the planner would at it (`pod_pace.py`); () when the logs held too little.
    pod_pace: tuple[float, ...] = ()
    simulated_at_pod_pace: Latencies = NO_LATENCIES

    @property
    def num_pods(self) -> int:
        config = next(c for c in CONFIGS if c.name == self.config)
        return config.num_prefill + config.num_decode

    def measured_bands(self) -> dict[str, tuple[float, float]]:
        """Each measured percentile's ~90% band from the run's own samples (resolution.py)."""
        gaps = [gap for request in self.itls_s for gap in request]
        samples = {"ttft": self.ttfts_s, "itl": gaps}
        return {
            key: percentile_band(samples[key.split("_")[0]], int(key[-2:]) / 100)
            for key in asdict(self.measured)
        }

    def errors(self, with_overheads: bool = True) -> dict[str, float]:
        """Relative error of each simulated figure against the measured one."""
        simulated = self.simulated_with_overheads if with_overheads else self.simulated
        measured, simulated_figures = asdict(self.measured), asdict(simulated)
        return {key: simulated_figures[key] / measured[key] - 1 for key in measured}

    def errors_at_pace(self) -> dict[str, float]:
        return self._errors_of(self.simulated_at_pace)

    def errors_at_pod_pace(self) -> dict[str, float]:
        return self._errors_of(self.simulated_at_pod_pace)

    def _errors_of(self, simulated_latencies: Latencies) -> dict[str, float]:
        measured, simulated = asdict(self.measured), asdict(simulated_latencies)
        return {key: simulated[key] / measured[key] - 1 for key in measured}


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


def run_config(
    config: LocalConfig, profile: Profile, args: argparse.Namespace, pace: EnginePace | None
) -> list[Comparison]:
    log(f"starting {config.name}")
    with tempfile.TemporaryDirectory() as steps_dir:
        step_logs = StepLogs(Path(steps_dir) / "steps")
        with running_stack(config, str(step_logs.prefix)) as stack:
            log(f"{config.name} is up ({stack.plan.mode_note})")
            target = completions_target(stack)
            warm_up(target, args.seed)
            return [
                _measure(stack, target, config, workload, profile, args, pace, step_logs)
                for workload in WORKLOADS
            ]


def _serving_costs(profile: Profile, config: LocalConfig) -> ServingCosts:
    return profile.serving.get(topology_of(config.num_prefill), ServingCosts())


def _measured(run) -> Latencies:
    """The client's figures of the requests that finished."""
    summary = summarize(run, LOOSE_SLO)
    return Latencies.of(summary.ttft, summary.itl)


def _measure(
    stack, target, config, workload, profile, args, pace, step_logs: StepLogs
) -> Comparison:
    rate = workload_rate(profile, workload)
    seed = f"{args.seed}/{workload.name}"
    specs = poisson_workload(seed, rate, args.duration, 10_000, workload.shape)
    label = f"{config.name} {workload.name} {rate:g} req/s"
    log(f"{label}: {len(specs)} requests over {specs[-1].arrival_s:.0f} s")
    num_tokens = int(workload.shape.prompt_lens.mean)
    # The cores `running_stack` pins the pods to, idle before and after the run.
    run_pace = RunPace.start(pace, pace_cores(config, stack), num_tokens) if pace else None
    foreign = ForeignLoad(lambda: [os.getpid(), *stack.pids()])
    foreign.start()
    drain_s = 60.0
    started_wall_s = time.time()
    run = asyncio.run(run_open_loop(target, specs, drain_s, print_progress(label)))
    window = (started_wall_s, time.time())
    foreign_cores = foreign.cores()
    num_ok = sum(result.ok for result in run.results)
    finished = [result for result in run.results if result.ok]
    ttfts_s = [result.ttft_s for result in finished if result.ttft_s is not None]
    assert len(ttfts_s) == len(finished), "a finished request has had its first token"
    measured = Comparison(
        config.name,
        workload.name,
        rate,
        len(specs),
        num_ok,
        foreign_cores,
        _measured(run),
        *_no_simulation(),
        ttfts_s=ttfts_s,
        itls_s=[result.itls_s for result in finished],
    )
    stack.wait_idle(timeout_s=30.0)
    if run_pace is not None:
        measured = replace(measured, engine_pace=run_pace.finish(profile))
    pod_pids = [stack.process(name).pid for name in config.pins]
    measured = replace(measured, pod_pace=step_logs.pods_pace(profile, pod_pids, window))
    comparison = simulated_beside(measured, profile, args.margin, args.seed, args.duration)
    log(f"{label}: {num_ok}/{len(specs)} finished; {_errors_line(comparison)}")
    return comparison


def simulated_beside(
    measured: Comparison, profile: Profile, margin: float, seed: int, duration_s: float
) -> Comparison:
    """`measured` with its requests (regenerated from the seed) simulated with `profile`: bare,
    and with its serving costs and `margin` as the planner uses it."""
    config = next(c for c in CONFIGS if c.name == measured.config)
    workload = next(w for w in WORKLOADS if w.name == measured.workload)
    specs = poisson_workload(
        f"{seed}/{workload.name}", measured.rate, duration_s, 10_000, workload.shape
    )
    requests = as_sim_requests(specs)
    planned = profile.with_margin(margin)
    slo = workload_slo(profile, workload.shape)
    bare_latencies, _ = _simulate_requests(replace(profile, serving={}), config, requests, slo)
    planned_latencies, attainment = _simulate_requests(planned, config, requests, slo)
    at_pace = _simulated_at(measured.engine_pace, profile, margin, config, requests, slo)
    at_pod_pace = _simulated_at(measured.pod_pace, profile, margin, config, requests, slo)
    return replace(
        measured,
        simulated=bare_latencies,
        overheads=_serving_costs(planned, config),
        simulated_with_overheads=planned_latencies,
        goodput_slo=(slo.ttft_s, slo.itl_s),
        simulated_attainment=attainment,
        simulated_at_pace=at_pace,
        simulated_at_pod_pace=at_pod_pace,
    )


def _simulated_at(
    pace: tuple[float, ...],
    profile: Profile,
    margin: float,
    config: LocalConfig,
    requests: list[SimRequest],
    slo: Slo,
) -> Latencies:
    """The requests simulated as the planner would with the profile at `pace` (prefill,
    decode); no figures without a pace."""
    if not pace:
        return NO_LATENCIES
    paced = profile.at_pace(*pace).with_margin(margin)
    return _simulate_requests(paced, config, requests, slo)[0]


def _no_simulation() -> tuple[Latencies, ServingCosts, Latencies]:
    return NO_LATENCIES, ServingCosts(), NO_LATENCIES


def _simulate_requests(
    profile: Profile, config: LocalConfig, requests: list[SimRequest], slo: Slo
) -> tuple[Latencies, float]:
    """The simulated latencies, and the share of the requests meeting `slo`."""
    result = simulate(profile, simulated_cluster(config), requests, slo)
    return Latencies.of(result.ttft, result.itl), result.attainment


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
    kind = (
        "with its serving costs and margin (as the planner uses it)"
        if with_overheads
        else "bare engine"
    )
    lines = [f"simulated with the profile, {kind}:", header]
    within = total = within_resolution = 0
    for c in comparisons:
        simulated_latencies = c.simulated_with_overheads if with_overheads else c.simulated
        measured, errors = asdict(c.measured), c.errors(with_overheads)
        bands = c.measured_bands()
        simulated = asdict(simulated_latencies)
        row = f"{c.config:<12} {c.workload:<12} {c.rate:>5.2f} {c.num_ok:>3}/{c.num_requests:<3} "
        row += f"{c.foreign_cores:>5.2f}"
        for key, _ in _FIGURES:
            cell = f"{measured[key] * 1e3:.0f}/{simulated[key] * 1e3:.0f} {errors[key]:+.0%}"
            row += f" {cell:>24}"
            if not math.isnan(errors[key]):
                total += 1
                within += abs(errors[key]) <= TOLERANCE
                within_resolution += within_band(simulated[key], bands[key], TOLERANCE)
        lines.append(row)
    lines.append(
        f"{within}/{total} simulated figures within {TOLERANCE:.0%} of the measured ones "
        "('other' = cores other processes kept busy during the run)"
    )
    lines.append(
        f"{within_resolution}/{total} within {TOLERANCE:.0%} of the range the measured sample "
        "pins its percentile to (90% confidence from its order statistics, resolution.py)"
    )
    lines.append(_bias_line(comparisons, with_overheads))
    return "\n".join(lines)


def _bias_line(comparisons: list[Comparison], with_overheads: bool) -> str:
    errors = [
        error
        for c in comparisons
        for error in c.errors(with_overheads).values()
        if not math.isnan(error)
    ]
    above = sum(error > 0 for error in errors)
    below = sum(error < 0 for error in errors)
    mean = sum(errors) / len(errors) if errors else math.nan
    return f"sign: {above} simulated above the measured, {below} below; mean error {mean:+.1%}"


def run_validation(args: argparse.Namespace) -> int:
    if args.duration <= 0:
        raise ValueError("--duration must be > 0 seconds")
    comparisons = replay(args) if args.replay else measure_all(args)
    print_report(comparisons)
    if args.json:
        save_record(args.json, comparisons, args)
        log(f"wrote {args.json}")
    if args.plot and comparisons:
        plot_validation(comparisons, args.plot)
        log(f"wrote {args.plot}")
    return 0


def measure_all(args: argparse.Namespace) -> list[Comparison]:
    configs = [c for c in CONFIGS if not args.only or c.name in args.only]
    if not configs:
        raise ValueError(f"--only names none of {[c.name for c in CONFIGS]}")
    profile, pace = _profile(args.profile, args.fresh_profile)
    for workload in WORKLOADS:
        log(f"workload {workload.name}: {workload_rate(profile, workload):g} req/s")
    comparisons: list[Comparison] = []
    try:
        for config in configs:
            comparisons += run_config(config, profile, args, pace)
    except KeyboardInterrupt:
        log("interrupted; every process it started is stopped")
    return comparisons


def print_report(comparisons: list[Comparison]) -> None:
    print(format_report(comparisons, with_overheads=False), flush=True)
    print()
    print(format_report(comparisons), flush=True)
    for config_name, costs in {c.config: c.overheads for c in comparisons}.items():
        print(f"  {config_name}: {costs.describe()}")
    drift = format_drift(comparisons, TOLERANCE)
    if drift:
        print(drift)
    print()
    print(format_ranking(comparisons, WORKLOADS), flush=True)
    print()
    print(format_goodput(comparisons, WORKLOADS), flush=True)


# ---- recorded runs --------------------------------------------------------------------------


def save_record(path: str, comparisons: list[Comparison], args: argparse.Namespace) -> None:
    """The measured runs (and what they were simulated as), enough to `--replay` them, and the
    machine they ran on (`splitserve env`'s CPU section: the figures hold for that CPU)."""
    from splitserve.environment import environment_report  # lazy: torch and the kernels

    body = {
        "machine": environment_report()["cpu"],
        "seed": args.seed,
        "duration_s": args.duration,
        "margin": args.margin,
        "comparisons": [asdict(c) for c in comparisons],
    }
    with open(path, "w") as file:
        json.dump(body, file, indent=1)
        file.write("\n")


def replay(args: argparse.Namespace) -> list[Comparison]:
    """The measured runs of a `--json` record simulated again with `--profile` and `--margin`
    (the model as it is now), without measuring anything: a change to the simulator or the
    profile can be checked against recorded runs before a new quiet half hour."""
    body = _load_record(args.replay)
    profile = load_profile(args.profile)
    log(f"replaying {len(body['comparisons'])} recorded runs of {args.replay} with {args.profile}")
    return [
        simulated_beside(measured, profile, args.margin, body["seed"], body["duration_s"])
        for measured in (_comparison(c) for c in body["comparisons"])
    ]


def _load_record(path: str) -> dict:
    try:
        with open(path) as file:
            body = json.load(file)
        if not isinstance(body, dict) or not isinstance(body.get("comparisons"), list):
            raise ValueError(f"--replay: {path} is not a `validate --json` record")
        return body
    except OSError as error:
        raise ValueError(f"--replay: cannot read {path}: {error.strerror}") from None
    except json.JSONDecodeError as error:
        raise ValueError(f"--replay: {path} is not JSON: {error}") from None


def _comparison(body: dict) -> Comparison:
    try:
        fields = dict(body)
        for name in ("measured", "simulated", "simulated_with_overheads"):
            fields[name] = Latencies(**body[name])
        fields["simulated_at_pace"] = Latencies(
            **body.get("simulated_at_pace", asdict(NO_LATENCIES))
        )
        fields["overheads"] = ServingCosts(**body["overheads"])
        fields["goodput_slo"] = tuple(body.get("goodput_slo", ()))
        fields["engine_pace"] = tuple(body.get("engine_pace", ()))
        fields["simulated_at_pod_pace"] = Latencies(
            **body.get("simulated_at_pod_pace", asdict(NO_LATENCIES))
        )
        fields["pod_pace"] = tuple(body.get("pod_pace", ()))
        comparison = Comparison(**fields)
    except (KeyError, TypeError) as error:
        raise ValueError(f"--replay: not a recorded run: {error}") from None
    known = {c.name for c in CONFIGS}, {w.name for w in WORKLOADS}
    if comparison.config not in known[0] or comparison.workload not in known[1]:
        raise ValueError(
            f"--replay: unknown configuration or workload {comparison.config!r} / "
            f"{comparison.workload!r}"
        )
    return comparison


def _profile(path: str, fresh: bool) -> tuple[Profile, EnginePace | None]:
    """The profile, and with a fresh one its engine (kept to pace the runs, `drift.py`)."""
    if os.path.exists(path) and not fresh:
        return load_profile(path), None
    # lazy: the engine (torch), only to measure a fresh profile
    from splitserve.planner.measure.profiler import load_engine, measure_profile

    own_core, neighbor_core = usable_cores()
    log(f"measuring a profile into {path} first, pinned to CPU {own_core}")
    settings = ProfileSettings(repeats=5, neighbor_core=neighbor_core, **QUICK_GRID)
    engine = load_engine(settings, log)
    affinity = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {own_core})  # as a pod runs: one thread on one core
    try:
        profile = measure_profile(settings, log=log, engine=engine)
    finally:
        os.sched_setaffinity(0, affinity)
    pace = EnginePace(engine)
    profile = measure_serving(profile, log, pace=pace)
    profile.save(path)
    return profile, pace
