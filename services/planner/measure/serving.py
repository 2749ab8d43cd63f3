"""The serving path's costs, measured as part of a profile (`plan profile --serving`).

A profile measures the bare engine: `EngineCore.step()` in one process. A running stack adds
to every step (the pod streams each row's token over gRPC and the gateway writes an SSE event,
on the engine's core) and to every request (HTTP, tokenizing, routing, the RPC hops before a
remote prefill). They are measured on the smallest stack of each topology (`local_stacks.py`),
from requests whose simulation is exact enough to take differences against:

- one request at a time, then the same requests in batches of `BATCH` sent together: the
  gap between measured and simulated median ITL is `step_s + rows * row_s` at each, two points
  that give both;
- how the gaps of those requests spread around each one's median (`itl_spread_s`): the
  profile's step costs are medians, the client's gaps are not;
- what remains of the gap between measured and simulated median TTFT one at a time, with the
  step costs applied, is `request_s + prompt tokens x token_s`: short prompts (64-128 tokens)
  and long ones (384-512) give both. On a disaggregated stack the part that grows with the
  prompt (the pages' way into the decode pod) is what a bare profile's in-process transfer
  does not see.

Those differences are taken against the bare engine as it ran beside the requests, not as the
profile measured it minutes before (`pace.py`): on a VM whose speed drifts, the latter put the
drift into the costs, and the 10% margin on top.

They go into the profile per topology, and the simulator applies the topology's costs to every
configuration of that kind, so a validation run on another configuration (two colocated pods)
checks them rather than refitting them.
"""

from __future__ import annotations

import asyncio
import statistics
from collections.abc import Callable
from dataclasses import replace

import numpy as np

from splitserve.loadgen.client import RunResult, run_open_loop, run_sequential
from splitserve.loadgen.stats import summarize
from splitserve.loadgen.workload import (
    LengthDistribution,
    RequestSpec,
    SimRequest,
    WorkloadShape,
    as_sim_requests,
    sequential_workload,
)
from splitserve.planner.measure.local_stacks import (
    LOOSE_SLO,
    TOPOLOGY_CONFIGS,
    LocalConfig,
    completions_target,
    pace_cores,
    running_stack,
    simulated_cluster,
    warm_up,
)
from splitserve.planner.measure.pace import EnginePace, PaceCores, PaceSample, pace_factors
from splitserve.planner.profile import Profile, ServingCosts
from splitserve.planner.profile.parts import (
    MIN_ENGINE_SCALE,
    nonnegative_least_squares,
    spread_quantiles,
    topology_of,
)
from splitserve.planner.simulate.cluster import simulate

NUM_REQUESTS = 8  # one at a time; then in batches of BATCH sent together
BATCH = 4
SHAPE = WorkloadShape(LengthDistribution(64, 128), LengthDistribution(24, 24))
# Long prompts one at a time: the TTFT gap's growth with the prompt is `token_s`.
LONG_SHAPE = WorkloadShape(LengthDistribution(384, 512), LengthDistribution(4, 4))
# Six, and one more before them that is not timed: the first long prompt through a fresh
# 1P+1D stack pays one-off costs on its way to the decode pod, and with four timed the median
# TTFT gap at 434 tokens ranged 26-244 ms over five profiles of one hour (docs/benchmarks.md).
NUM_LONG = 6

Log = Callable[[str], None]


def measure_serving(
    profile: Profile, log: Log, seed: int = 0, pace: EnginePace | None = None
) -> Profile:
    """`profile` with the serving costs of both topologies measured on running stacks; with
    `pace` (the profile's engine), against that engine timed beside each lone request."""
    serving = dict(profile.serving)
    for topology, config in TOPOLOGY_CONFIGS.items():
        log(f"serving costs ({topology}): starting {config.name}")
        with running_stack(config) as stack:
            warm_up(completions_target(stack), seed)
            serving[topology] = measure_costs(stack, config, profile, seed, log, pace)
        costs = serving[topology]
        log(f"serving costs ({topology}): {costs.describe()}")
    return replace(profile, serving=serving)


def measure_costs(
    stack,
    config: LocalConfig,
    profile: Profile,
    seed: int,
    log: Log = print,
    pace: EnginePace | None = None,
) -> ServingCosts:
    target = completions_target(stack)
    lone = _LoneRequests(target, pace, pace_cores(config, stack))
    specs = sequential_workload(f"{seed}/serving", NUM_REQUESTS, SHAPE)
    alone = lone.run(specs)
    short_samples = list(lone.samples)
    batches = [specs[i : i + BATCH] for i in range(0, len(specs), BATCH)]
    together_runs = [
        asyncio.run(run_open_loop(target, _sent_together(batch), drain_timeout_s=120.0))
        for batch in batches
    ]
    together = RunResult([r for run in together_runs for r in run.results], 0.0)
    long_specs = sequential_workload(f"{seed}/serving-long", NUM_LONG, LONG_SHAPE)
    first_long = sequential_workload(f"{seed}/serving-long-warm-up", 1, LONG_SHAPE)
    _check_ok(asyncio.run(run_sequential(target, first_long)), config=config)
    long_run = lone.run(long_specs)
    long_samples = lone.samples[len(short_samples) :]
    _check_ok(alone, together, long_run, config=config)

    alone_requests = _far_apart(specs)
    bare_costs, reference, engine_scale = _reference_engine(
        profile, config, (alone, alone_requests), short_samples, log
    )
    bare = _with_costs(reference, config, bare_costs)
    gap_1 = _itl_p50(alone) - _simulated_itl_p50(bare, config, alone_requests)
    together_requests = as_sim_requests(_batches_far_apart(batches))
    gap_n = _itl_p50(together) - _simulated_itl_p50(bare, config, together_requests)
    step_s, row_s = fit_nonnegative_line([(1, gap_1), (BATCH, gap_n)])
    step_costs = replace(bare_costs, step_s=step_s, row_s=row_s)
    short_gap = _ttft_gap(alone, _with_costs(reference, config, step_costs), config, alone_requests)
    # The long prompts against the engine timed beside them: one pace for prompts of 64-128
    # and 384-512 tokens mixed the two minutes' drift (and prefill's pace differs by length).
    long_reference = _at_pace_of(
        profile, long_samples, reference, f"{config.name}, long prompts", log
    )
    with_steps = _with_costs(long_reference, config, step_costs)
    long_gap = _ttft_gap(long_run, with_steps, config, _far_apart(long_specs))
    short_len, long_len = _median_prompt(specs), _median_prompt(long_specs)
    request_s, token_s = fit_nonnegative_line([(short_len, short_gap), (long_len, long_gap)])
    log(
        f"serving costs ({config.name}): engine steps x{engine_scale:.3f}; the stack's median "
        f"token gap beyond that engine's {gap_1 * 1e3:+.1f} ms at 1 row, {gap_n * 1e3:+.1f} ms "
        f"at {BATCH} rows; TTFT beyond it (step costs applied) {short_gap * 1e3:+.0f} ms at "
        f"{short_len:.0f} prompt tokens, {long_gap * 1e3:+.0f} ms at {long_len:.0f}"
    )
    spread = itl_spread([alone, together])
    return ServingCosts(step_s, row_s, request_s, token_s, spread, engine_scale)


class _LoneRequests:
    """Sends requests one at a time; with a pace, times the bare engine on a prompt of the
    same length right after each (on the cores of the stack's pods, idle then)."""

    def __init__(self, target, pace: EnginePace | None, cores: PaceCores) -> None:
        self._target = target
        self._pace = pace
        self._cores = cores
        self.samples: list[PaceSample] = []

    def run(self, specs: list[RequestSpec]) -> RunResult:
        pace = self._pace
        if pace is None:
            return asyncio.run(run_sequential(self._target, specs))

        def time_the_engine(num_done: int, _num_sent: int, _total: int) -> None:
            num_tokens = len(specs[num_done - 1].prompt_token_ids)
            self.samples.append(pace.sample(num_tokens, self._cores))

        return asyncio.run(run_sequential(self._target, specs, on_progress=time_the_engine))


def _reference_engine(
    profile: Profile,
    config: LocalConfig,
    alone: tuple[RunResult, list[SimRequest]],
    samples: list[PaceSample],
    log: Log,
) -> tuple[ServingCosts, Profile, float]:
    """The bare engine the stack's latencies are taken against (as costs of nothing but its
    engine scale, and the profile they apply to), and the engine scale the costs keep.

    With pace samples: the profile at the pace the engine ran beside the requests; the scale
    kept is the slower of the two paces (prefill, decode) when below 1, so a profile from a
    slow minute is corrected only where both kinds of step ran faster. Without: the profile
    scaled by the lone requests' token gaps against it (`_engine_scale`)."""
    if not samples:
        engine_scale = _engine_scale(*alone, profile, config)
        return ServingCosts(engine_scale=engine_scale), profile, engine_scale
    prefill_factor, decode_factor = _logged_pace(profile, samples, config.name, log)
    engine_scale = min(max(prefill_factor, decode_factor, MIN_ENGINE_SCALE), 1.0)
    return ServingCosts(), profile.at_pace(prefill_factor, decode_factor), engine_scale


def _at_pace_of(
    profile: Profile, samples: list[PaceSample], otherwise: Profile, label: str, log: Log
) -> Profile:
    """`profile` at the pace of `samples`, or `otherwise` without any."""
    if not samples:
        return otherwise
    return profile.at_pace(*_logged_pace(profile, samples, label, log))


def _logged_pace(
    profile: Profile, samples: list[PaceSample], label: str, log: Log
) -> tuple[float, float]:
    prefill_factor, decode_factor = pace_factors(profile, samples)
    log(
        f"serving costs ({label}): the bare engine beside the lone requests ran at "
        f"x{prefill_factor:.3f} the profile's prefill and x{decode_factor:.3f} its decode steps"
    )
    return prefill_factor, decode_factor


def _engine_scale(alone: RunResult, requests, profile: Profile, config: LocalConfig) -> float:
    """The lone requests' median token gap on the stack over the bare profile's, when the
    stack's is the shorter (else 1: the serving costs take up a longer gap), no lower than
    MIN_ENGINE_SCALE. One row a step, nothing else running: the gap is an engine step and
    a streamed token, the cleanest look at how fast the machine runs the engine now."""
    simulated = _simulated_itl_p50(replace(profile, serving={}), config, requests)
    return min(max(_itl_p50(alone) / simulated, MIN_ENGINE_SCALE), 1.0)


def fit_nonnegative_line(points: list[tuple[float, float]]) -> tuple[float, float]:
    """(intercept, slope), both >= 0, the least-squares line through `points` (x, y).

    Not the line through two points with a negative intercept then clipped to 0: that keeps
    the slope of the unclipped line and so lies above both points, and a stack whose bare
    engine was measured a little slow at one row (a negative gap there) came out with a
    per-row cost three times what its gaps showed. The least-squares line on the non-negative
    support passes between its points."""
    matrix = np.array([[1.0, x] for x, _ in points])
    target = np.array([y for _, y in points])
    intercept, slope = nonnegative_least_squares(matrix, target)
    return float(intercept), float(slope)


def itl_spread(runs) -> tuple[float, ...]:
    """How the measured token gaps spread around each request's own median gap (its steady
    decode step), pooled over `runs`, as `spread_quantiles`. A request's first gap is left
    out: on a disaggregated stack it spans the hand-over to the decode pod, which the
    simulator models itself."""
    deviations = []
    for run in runs:
        for result in run.results:
            steady = result.itls_s[1:]
            if len(steady) >= 2:
                median = statistics.median(steady)
                deviations += [gap - median for gap in steady]
    return spread_quantiles(deviations)


def _check_ok(*runs, config: LocalConfig) -> None:
    if not all(result.ok for run in runs for result in run.results):
        raise RuntimeError(f"{config.name}: a request failed while measuring serving costs")


def _sent_together(specs: list[RequestSpec]) -> list[RequestSpec]:
    return [replace(spec, arrival_s=0.0) for spec in specs]


def _batches_far_apart(batches: list[list[RequestSpec]]) -> list[RequestSpec]:
    """Each batch sent together, the batches far apart (as they were run, one after another)."""
    return [
        replace(spec, arrival_s=i * 1000.0) for i, batch in enumerate(batches) for spec in batch
    ]


def _ttft_gap(run, profile: Profile, config: LocalConfig, requests) -> float:
    """Measured median TTFT less the simulated one, the requests one at a time."""
    simulated = simulate(profile, simulated_cluster(config), requests, LOOSE_SLO)
    return _ttft_p50(run) - simulated.ttft.p50


def _median_prompt(specs: list[RequestSpec]) -> float:
    return statistics.median(len(spec.prompt_token_ids) for spec in specs)


def _far_apart(specs: list[RequestSpec]) -> list[SimRequest]:
    """One at a time in the simulation too: arrivals far apart."""
    return as_sim_requests([replace(spec, arrival_s=i * 1000.0) for i, spec in enumerate(specs)])


def _with_costs(profile: Profile, config: LocalConfig, costs: ServingCosts) -> Profile:
    return replace(profile, serving={topology_of(config.num_prefill): costs})


def _simulated_itl_p50(profile: Profile, config: LocalConfig, requests) -> float:
    return simulate(profile, simulated_cluster(config), requests, LOOSE_SLO).itl.p50


def _itl_p50(run) -> float:
    return summarize(run, LOOSE_SLO).itl.p50


def _ttft_p50(run) -> float:
    return summarize(run, LOOSE_SLO).ttft.p50
