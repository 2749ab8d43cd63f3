"""`splitserve plan recommend`: the fewest pods meeting a target rate and SLOs, and the
prefill:decode ratio with the best goodput per pod.

1. Fewest pods: every (P, D) with P + D <= max_pods is simulated at the target rate; a
   configuration meets the target when at least `attainment` of the requests meet both SLOs.
   The smallest P + D that meets it wins; ties go to the higher goodput. P = 0 is the colocated
   baseline (decode pods prefill for themselves).
2. Best ratio: for each (P, D) with P + D <= ratio_max_pods, a bisection on the arrival rate
   finds the highest rate still meeting the attainment (DistServe's per-GPU goodput); divided
   by P + D it says which ratio uses a pod best, whatever the target.

Every simulation of one search sees the same seeded requests (common random numbers), so
differences between configurations are not sampling noise.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace

from services.loadgen.stats import Slo
from services.loadgen.workload import WorkloadSpec, poisson_requests
from services.planner.profile import Profile
from services.planner.sim_results import SimResult
from services.planner.simulator import ClusterConfig, simulate

RATE_SEARCH_STEPS = 7


@dataclass(frozen=True)
class SearchSpec:
    workload: WorkloadSpec  # its rate is the target
    slo: Slo
    attainment: float = 0.9  # fraction of requests that must meet both SLOs
    max_pods: int = 8
    ratio_max_pods: int = 4
    include_colocated: bool = True
    seed: int = 0
    local_prefill_threshold: int = 32

    def __post_init__(self) -> None:
        if not 0 < self.attainment <= 1:
            raise ValueError(f"attainment must be in (0, 1], got {self.attainment}")
        if self.max_pods < 1 or self.ratio_max_pods < 1:
            raise ValueError("max_pods and ratio_max_pods must be >= 1")


@dataclass(frozen=True)
class Candidate:
    cluster: ClusterConfig
    result: SimResult  # at the target rate
    meets: bool

    @property
    def num_pods(self) -> int:
        return self.cluster.num_prefill + self.cluster.num_decode


@dataclass(frozen=True)
class RatioPoint:
    cluster: ClusterConfig
    max_rate: float  # highest rate found meeting the attainment (0 if none)

    @property
    def goodput_per_pod(self) -> float:
        return self.max_rate / (self.cluster.num_prefill + self.cluster.num_decode)


@dataclass(frozen=True)
class Recommendation:
    candidates: list[Candidate]
    best: Candidate | None  # fewest pods meeting the target; None if none does
    ratios: list[RatioPoint]

    @property
    def best_ratio(self) -> RatioPoint | None:
        useful = [point for point in self.ratios if point.max_rate > 0]
        return max(useful, key=lambda p: p.goodput_per_pod) if useful else None


Progress = Callable[[str], None]


def clusters(max_pods: int, include_colocated: bool, threshold: int) -> list[ClusterConfig]:
    first_prefill = 0 if include_colocated else 1
    return [
        ClusterConfig(p, total - p, local_prefill_threshold=threshold)
        for total in range(1, max_pods + 1)
        for p in range(first_prefill, total)
    ]


def recommend(profile: Profile, spec: SearchSpec, progress: Progress | None = None):
    requests = poisson_requests(spec.workload, spec.seed)
    candidates = []
    configs = clusters(spec.max_pods, spec.include_colocated, spec.local_prefill_threshold)
    for i, cluster in enumerate(configs, 1):
        result = simulate(profile, cluster, requests, spec.slo)
        candidates.append(Candidate(cluster, result, result.attainment >= spec.attainment))
        if progress is not None:
            progress(f"simulated {i}/{len(configs)}: {cluster.label}")
    meeting = [c for c in candidates if c.meets]
    best = min(meeting, key=lambda c: (c.num_pods, -c.result.goodput)) if meeting else None
    ratios = ratio_sweep(profile, spec, progress)
    return Recommendation(candidates, best, ratios)


def ratio_sweep(profile: Profile, spec: SearchSpec, progress: Progress | None = None):
    configs = clusters(spec.ratio_max_pods, spec.include_colocated, spec.local_prefill_threshold)
    points = []
    for i, cluster in enumerate(configs, 1):
        points.append(RatioPoint(cluster, max_good_rate(profile, cluster, spec)))
        if progress is not None:
            progress(f"rate search {i}/{len(configs)}: {cluster.label}")
    return points


def max_good_rate(profile: Profile, cluster: ClusterConfig, spec: SearchSpec) -> float:
    """The highest Poisson rate at which `cluster` still meets the attainment (bisection
    between 0 and a rate that fails; 0 when even a trickle fails)."""

    def meets(rate: float) -> bool:
        workload = replace(spec.workload, rate=rate)
        result = simulate(profile, cluster, poisson_requests(workload, spec.seed), spec.slo)
        return result.attainment >= spec.attainment

    low, high = 0.0, spec.workload.rate
    while meets(high):
        low, high = high, high * 2
        if high > 1e6:
            return high  # no bound in sight: the SLOs do not bind
    for _ in range(RATE_SEARCH_STEPS):
        middle = (low + high) / 2
        low, high = (middle, high) if meets(middle) else (low, middle)
    return low


# ---- output ---------------------------------------------------------------------------------


def format_table(recommendation: Recommendation, spec: SearchSpec) -> str:
    header = (
        f"{'config':>12} {'pods':>4} {'TTFT p50':>9} {'p90':>8} {'ITL p50':>8} {'p90':>7} "
        f"{'goodput':>8} {'attain':>7}  meets"
    )
    lines = [
        f"target: {spec.workload.rate:g} req/s, {spec.slo}, attainment >= {spec.attainment:.0%}",
        header,
    ]
    for candidate in sorted(
        recommendation.candidates, key=lambda c: (c.num_pods, c.cluster.num_prefill)
    ):
        r = candidate.result
        mark = "yes" if candidate.meets else ""
        if candidate is recommendation.best:
            mark += "  <== fewest pods"
        lines.append(
            f"{candidate.cluster.label:>12} {candidate.num_pods:>4} {_ms(r.ttft.p50):>9} "
            f"{_ms(r.ttft.p90):>8} {_ms(r.itl.p50):>8} {_ms(r.itl.p90):>7} "
            f"{r.goodput:>8.2f} {r.attainment:>7.0%}  {mark}"
        )
    lines.append("")
    lines.append("goodput per pod (highest rate meeting the attainment / pods):")
    for point in recommendation.ratios:
        best = recommendation.best_ratio
        mark = "  <== best ratio" if point is best else ""
        lines.append(
            f"{point.cluster.label:>12}  {point.max_rate:7.2f} req/s  "
            f"{point.goodput_per_pod:6.2f} req/s/pod{mark}"
        )
    return "\n".join(lines)


def helm_values(candidate: Candidate) -> str:
    cluster = candidate.cluster
    lines = [
        f"# splitserve plan recommend: {cluster.label}, "
        f"simulated goodput {candidate.result.goodput:.2f} req/s",
        "prefill:",
        f"  replicas: {cluster.num_prefill}",
        "decode:",
        f"  replicas: {cluster.num_decode}",
    ]
    if cluster.num_prefill == 0:
        lines.insert(1, "# colocated: no prefill pods, the decode pods prefill for themselves")
    return "\n".join(lines)


def _ms(seconds: float) -> str:
    return "-" if math.isnan(seconds) else f"{seconds * 1e3:.0f}ms"
