"""Whether a configuration meets a target, how sure the planner is, and what binds.

One test, used by `recommend` to rank configurations and by the autoscaler to size a role, so
that what `recommend` promises is what `autoscale` does:

- the workload is simulated under `num_seeds` seeds (other arrival times and lengths drawn
  from the same distributions); in each, the attainment is the share of requests meeting both
  SLOs;
- the configuration meets the target when the attainment holds in at least `confidence` of
  the seeds; the report gives each figure's band over the seeds (lowest, median, highest);
- the binding resource is the one under the most pressure, each as a fraction of what it may
  take: prefill compute (TTFT p90 without the KV transfer, over the TTFT SLO), the decode step
  (the p90 of the requests' own mean ITL, over the ITL SLO), KV capacity (the fullest any pod's
  cache got; 1 once a request is preempted) and the transfer (KV transfer p90 over the TTFT
  SLO). The planner names it so that the fix is clear: more prefill pods, more decode pods,
  more KV per pod, or a faster link.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass

from splitserve.loadgen.stats import Slo
from splitserve.loadgen.workload import LengthDistribution, WorkloadSpec, poisson_requests
from splitserve.planner.pool import Workers, in_order
from splitserve.planner.profile import Profile
from splitserve.planner.simulate.cluster import ClusterConfig, simulate
from splitserve.planner.simulate.results import SimResult

RESOURCES = ("prefill compute", "decode step", "KV capacity", "KV transfer")


@dataclass(frozen=True)
class Target:
    slo: Slo
    attainment: float = 0.9  # share of requests that must meet both SLOs
    confidence: float = 0.8  # share of seeded workloads in which that attainment must hold
    num_seeds: int = 5

    def __post_init__(self) -> None:
        if not 0 < self.attainment <= 1:
            raise ValueError(f"attainment must be in (0, 1], got {self.attainment}")
        if not 0 < self.confidence <= 1:
            raise ValueError(f"confidence must be in (0, 1], got {self.confidence}")
        if self.num_seeds < 1:
            raise ValueError(f"num_seeds must be >= 1, got {self.num_seeds}")


@dataclass(frozen=True)
class Band:
    low: float
    median: float
    high: float

    @classmethod
    def of(cls, values: list[float]) -> Band:
        finite = [value for value in values if not math.isnan(value)]
        if not finite:
            nan = float("nan")
            return cls(nan, nan, nan)
        return cls(min(finite), statistics.median(finite), max(finite))


@dataclass(frozen=True)
class Verdict:
    cluster: ClusterConfig
    results: list[SimResult]  # one per seed
    share_meeting: float  # of the seeds, in which the attainment held
    meets: bool
    binding: str  # one of RESOURCES
    pressures: dict[str, float]  # resource -> median pressure over the seeds

    @property
    def result(self) -> SimResult:
        """The seed with the median attainment, for tables that show one run."""
        ranked = sorted(self.results, key=lambda r: r.attainment)
        return ranked[len(ranked) // 2]

    def band(self, figure: str) -> Band:
        """`figure` is a dotted SimResult path, such as "ttft.p90" or "goodput"."""
        return Band.of([_figure(result, figure) for result in self.results])


def judge(
    profile: Profile,
    cluster: ClusterConfig,
    workload: WorkloadSpec,
    target: Target,
    seed: int = 0,
    prefill_profile: Profile | None = None,
    stop_once_failed: bool = False,
    workers: Workers | None = None,
) -> Verdict:
    """`stop_once_failed`: stop simulating seeds once too many have missed for the target to
    hold (a rate search only needs the yes or no); the verdict's bands then cover the seeds
    run. Whether it meets is the same either way. `workers`: simulate seeds in those worker
    processes, as many at once as there are workers, read in order."""
    allowed_misses = target.num_seeds - _seeds_needed(target)
    arguments = [
        (profile, cluster, workload, target.slo, prefill_profile, f"{seed}/{i}")
        for i in range(target.num_seeds)
    ]
    seeds = in_order(workers, simulate_seed, arguments)
    results: list[SimResult] = []
    misses = 0
    for result in seeds:
        results.append(result)
        misses += result.attainment < target.attainment
        if stop_once_failed and misses > allowed_misses:
            break
    seeds.close()  # the seeds still queued are dropped now, not at collection
    share = sum(r.attainment >= target.attainment for r in results) / len(results)
    pressures = {
        resource: statistics.median(pressure(r, target.slo)[resource] for r in results)
        for resource in RESOURCES
    }
    binding = max(RESOURCES, key=lambda resource: pressures[resource])
    meets = len(results) - misses >= _seeds_needed(target)
    return Verdict(cluster, results, share, meets, binding, pressures)


def simulate_seed(
    profile: Profile,
    cluster: ClusterConfig,
    workload: WorkloadSpec,
    slo: Slo,
    prefill_profile: Profile | None,
    seed_key: str,
) -> SimResult:
    """One seeded workload simulated (module level, so a process pool can run it)."""
    return simulate(profile, cluster, poisson_requests(workload, seed_key), slo, prefill_profile)


def _seeds_needed(target: Target) -> int:
    """The fewest seeds in which the attainment must hold (`confidence` of `num_seeds`)."""
    return math.ceil(target.confidence * target.num_seeds - 1e-9)


def pressure(result: SimResult, slo: Slo) -> dict[str, float]:
    """Each resource's use as a fraction of what the target lets it take (see the module)."""
    if result.num_finished == 0:
        return dict.fromkeys(RESOURCES, math.inf)
    transfer_p90 = _zero_if_nan(result.transfer.p90)
    kv = 1.0 if result.num_preemptions else result.peak_kv_usage
    return {
        "prefill compute": max(result.ttft.p90 - transfer_p90, 0.0) / slo.ttft_s,
        "decode step": _zero_if_nan(result.mean_itl.p90) / slo.itl_s,
        "KV capacity": kv,
        "KV transfer": transfer_p90 / slo.ttft_s,
    }


def pods_needed(
    profile: Profile,
    workload: WorkloadSpec,
    target: Target,
    role: str,
    current: dict[str, int],
    max_pods: int,
    prefill_profile: Profile | None = None,
    cluster_options: dict | None = None,
) -> int | None:
    """The fewest pods of `role` ("prefill" or "decode"), the other role kept at its current
    count, with which `judge` says the cluster meets the target; None if `max_pods` do not.
    `cluster_options`: the rest of the `ClusterConfig` (as recommend builds it)."""
    for count in range(1, max_pods + 1):
        counts = {**current, role: count}
        cluster = ClusterConfig(counts["prefill"], counts["decode"], **(cluster_options or {}))
        if judge(profile, cluster, workload, target, 0, prefill_profile).meets:
            return count
    return None


def steady_workload(
    rate: float, mean_input: float, mean_output: float, duration_s: float = 120.0
) -> WorkloadSpec:
    """A Poisson workload at a measured rate with the measured mean lengths (all the
    autoscaler knows of the load), long enough for queues to form: `duration_s` of arrivals,
    between 50 and 400 requests."""
    num_requests = min(max(int(rate * duration_s), 50), 400)
    inputs = max(int(round(mean_input)), 1)
    outputs = max(int(round(mean_output)), 1)
    return WorkloadSpec(
        rate, num_requests, LengthDistribution(inputs, inputs), LengthDistribution(outputs, outputs)
    )


def _figure(result: SimResult, figure: str) -> float:
    value: object = result
    for part in figure.split("."):
        value = getattr(value, part)
    if not isinstance(value, int | float):
        raise ValueError(f"{figure} is not a number of a simulation's result")
    return float(value)


def _zero_if_nan(value: float) -> float:
    return 0.0 if math.isnan(value) else value
