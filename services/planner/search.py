"""The planner's search primitives, shared by the whole-layout search (`recommend.py`) and the
slice search (`slices.py`): what a search is asked (`SearchSpec`), what it finds (candidates at
the target rate, each layout's highest good rate), the layouts it tries and the rate search.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from splitserve.loadgen.stats import Slo
from splitserve.loadgen.workload import WorkloadSpec
from splitserve.planner.pool import Workers
from splitserve.planner.profile import Profile
from splitserve.planner.simulate.cluster import ClusterConfig
from splitserve.planner.simulate.prefix_cache import TierSizes
from splitserve.planner.simulate.results import SimResult
from splitserve.planner.simulate.speculation import SpeculationModel
from splitserve.planner.sizing import Target, Verdict, judge

RATE_SEARCH_STEPS = 7
# Past this many pods `recommend` judges slices of a layout (`slices.py`) unless told not to.
AUTO_SLICE_ABOVE_PODS = 64
AUTO_SLICE_PODS = 10


@dataclass(frozen=True)
class SearchSpec:
    workload: WorkloadSpec  # its rate is the target
    slo: Slo
    attainment: float = 0.9  # fraction of requests that must meet both SLOs
    confidence: float = 0.8  # fraction of the seeded workloads in which it must hold
    num_seeds: int = 5
    max_pods: int = 8
    ratio_max_pods: int = 4
    include_colocated: bool = True
    seed: int = 0
    local_prefill_threshold: int = 32
    max_remote_prefill_tokens: int = 0
    pods_per_host: int = 1  # ClusterConfig.pods_per_host
    # More conditional-disaggregation limits for the layout sweep's P > 0 layouts, beside
    # max_remote_prefill_tokens (0 = every prompt to a prefill pod).
    remote_prefill_limits: tuple[int, ...] = ()
    # Also try each layout of the sweep with the gateway's SLO-aware admission at the TTFT
    # SLO (`--admission --slo-ttft-ms`): refused requests count as misses.
    try_admission: bool = False
    speculation: SpeculationModel | None = None
    tier_sizes: TierSizes = field(default_factory=TierSizes)
    # Judge layouts by slices of this many pods (`slices.py`); 0: judge whole layouts; None:
    # slices of AUTO_SLICE_PODS once max_pods passes AUTO_SLICE_ABOVE_PODS.
    slice_pods: int | None = None
    jobs: int = 1  # simulations run at once, in worker processes (`pool.py`)

    def __post_init__(self) -> None:
        if self.slice_pods is not None and self.slice_pods != 0 and self.slice_pods < 2:
            raise ValueError(f"slice_pods must be 0 (whole layouts) or >= 2, got {self.slice_pods}")
        if self.jobs < 1:
            raise ValueError(f"jobs must be >= 1, got {self.jobs}")
        if not 0 < self.attainment <= 1:
            raise ValueError(f"attainment must be in (0, 1], got {self.attainment}")
        if self.max_pods < 1 or self.ratio_max_pods < 1:
            raise ValueError("max_pods and ratio_max_pods must be >= 1")
        if min(self.remote_prefill_limits, default=0) < 0:
            raise ValueError("remote prefill limits must be >= 0 tokens")
        _ = self.target  # Target checks confidence and num_seeds

    @property
    def target(self) -> Target:
        return Target(self.slo, self.attainment, self.confidence, self.num_seeds)

    @property
    def slice_size(self) -> int:
        """The pods of a judged slice (0: whole layouts are judged)."""
        if self.slice_pods is not None:
            return self.slice_pods
        return AUTO_SLICE_PODS if self.max_pods > AUTO_SLICE_ABOVE_PODS else 0


@dataclass(frozen=True)
class Profiles:
    """The decode pods' profile, and the prefill pods' when they run another setup."""

    decode: Profile
    prefill: Profile | None = None

    @property
    def setup(self) -> str:
        """The engine setup, for tables: the decode pods', and the prefill pods' if other."""
        decode = self.decode.engine.describe()
        if self.prefill is None or self.prefill.engine == self.decode.engine:
            return decode
        return f"prefill {self.prefill.engine.describe()}; decode {decode}"

    def devices(self, cluster: ClusterConfig) -> int:
        prefill = self.prefill or self.decode
        return (
            cluster.num_prefill * prefill.engine.devices_per_pod
            + cluster.num_decode * self.decode.engine.devices_per_pod
        )


@dataclass(frozen=True)
class Candidate:
    verdict: Verdict  # at the target rate (of a slice: see `layout`)
    num_devices: int
    # The whole layout, when the verdict judged a slice of it carrying its share of the rate
    # (`splitserve.planner.slices`); None when the verdict judged the layout itself.
    layout: ClusterConfig | None = None
    # How many such slices the whole is (its rate over the slice's; 1 when judged whole).
    scale: float = 1.0

    @property
    def cluster(self) -> ClusterConfig:
        return self.layout or self.verdict.cluster

    @property
    def goodput(self) -> float:
        """`result`'s goodput, of the whole layout (a slice's times the slices)."""
        return self.result.goodput * self.scale

    @property
    def result(self) -> SimResult:
        return self.verdict.result

    @property
    def meets(self) -> bool:
        return self.verdict.meets

    @property
    def num_pods(self) -> int:
        return self.cluster.num_prefill + self.cluster.num_decode


@dataclass(frozen=True)
class RatioPoint:
    cluster: ClusterConfig
    max_rate: float  # highest rate found meeting the target (0 if none)
    num_devices: int
    verdict: Verdict  # at max_rate (at the lowest rate tried if none met)
    setup: str = ""  # `Profiles.setup` of the engine setup it ran
    # False: max_rate is a slice's screened rate (one seed, part of the span), not the full
    # test's (`slices.py`)
    settled: bool = True

    @property
    def binding(self) -> str:
        """What binds first at max_rate (at the lowest rate tried if none met)."""
        return self.verdict.binding

    @property
    def label(self) -> str:
        label = self.cluster.label
        if self.cluster.num_prefill and self.cluster.max_remote_prefill_tokens:
            label += f" (prefill locally past {self.cluster.max_remote_prefill_tokens} tokens)"
        if self.cluster.admission_ttft_s is not None:
            label += ", admission"
        return label

    @property
    def goodput_per_pod(self) -> float:
        """Per device: a pod of a TP=2 profile counts twice."""
        return self.max_rate / self.num_devices


@dataclass(frozen=True)
class Recommendation:
    candidates: list[Candidate]
    best: Candidate | None  # fewest pods meeting the target; None if none does
    ratios: list[RatioPoint]
    slice_pods: int = 0  # layouts judged as slices of this many pods (0: judged whole)

    @property
    def best_ratio(self) -> RatioPoint | None:
        useful = [point for point in self.ratios if point.max_rate > 0 and point.settled]
        return max(useful, key=lambda p: p.goodput_per_pod) if useful else None


Progress = Callable[[str], None]


def clusters(spec: SearchSpec, max_pods: int) -> list[ClusterConfig]:
    first_prefill = 0 if spec.include_colocated else 1
    return [
        ClusterConfig(
            p,
            total - p,
            local_prefill_threshold=spec.local_prefill_threshold,
            max_remote_prefill_tokens=spec.max_remote_prefill_tokens,
            pods_per_host=spec.pods_per_host,
            speculation=spec.speculation,
            tier_sizes=spec.tier_sizes,
        )
        for total in range(1, max_pods + 1)
        for p in range(first_prefill, total)
    ]


def fewest_devices(candidates: list[Candidate]) -> Candidate | None:
    """The candidate meeting the target on the fewest devices (then pods, then the higher
    goodput); None when none meets it."""
    meeting = [c for c in candidates if c.meets]
    return min(meeting, key=lambda c: (c.num_devices, c.num_pods, -c.goodput), default=None)


def layouts(spec: SearchSpec) -> list[ClusterConfig]:
    """The (P, D) clusters of the layout sweep, each P > 0 one at every remote-prefill limit,
    and each of those with admission too when the spec asks."""
    limits = sorted({spec.max_remote_prefill_tokens, *spec.remote_prefill_limits})
    admissions = (None, spec.slo.ttft_s) if spec.try_admission else (None,)
    return [
        replace(cluster, max_remote_prefill_tokens=limit, admission_ttft_s=admission)
        for cluster in clusters(spec, spec.ratio_max_pods)
        for limit in (limits if cluster.num_prefill else [spec.max_remote_prefill_tokens])
        for admission in admissions
    ]


def max_good_rate(
    profiles: Profiles,
    cluster: ClusterConfig,
    spec: SearchSpec,
    start_rate: float | None = None,
    keep_duration: bool = False,
    workers: Workers | None = None,
) -> tuple[float, Verdict]:
    """The highest Poisson rate at which `cluster` still meets the target (bisection between
    a rate that meets and one that fails; 0 when even a trickle fails), and the verdict there
    (at the lowest rate tried, when none met the target: it says what binds).

    From the target's rate, a failing first try bisects down from 0; from `start_rate` (a
    guess), it halves first, up to RATE_SEARCH_STEPS times, so the bisection's steps are
    spent near the answer."""
    verdicts: dict[float, Verdict] = {}

    def meets(rate: float) -> bool:
        verdicts[rate] = judge(
            profiles.decode,
            cluster,
            workload_at(spec.workload, rate, keep_duration),
            spec.target,
            spec.seed,
            profiles.prefill,
            stop_once_failed=True,
            workers=workers,
        )
        return verdicts[rate].meets

    halvings = RATE_SEARCH_STEPS if start_rate is not None else 0
    low, high = _bracket(meets, start_rate or spec.workload.rate, halvings)
    if math.isinf(high):
        return low, verdicts[low]  # no bound in sight: the SLOs do not bind
    for _ in range(RATE_SEARCH_STEPS):
        middle = (low + high) / 2
        low, high = (middle, high) if meets(middle) else (low, middle)
    return low, verdicts[low if low > 0 else min(verdicts)]


def _bracket(meets: Callable[[float], bool], start: float, halvings: int) -> tuple[float, float]:
    """(low, high): `low` meets (0 when no rate tried did), `high` fails (inf past 1e6)."""
    if meets(start):
        low, high = start, start * 2
        while meets(high):
            low, high = high, high * 2
            if high > 1e6:
                return low, math.inf
        return low, high
    high = start
    for _ in range(halvings):
        if meets(high / 2):
            return high / 2, high
        high /= 2
    return 0.0, high


def workload_at(workload: WorkloadSpec, rate: float, keep_duration: bool) -> WorkloadSpec:
    """`workload` at another rate: the same request count, or (`keep_duration`) the same
    span of arrivals."""
    if not keep_duration:
        return replace(workload, rate=rate)
    num_requests = max(1, round(workload.num_requests * rate / workload.rate))
    return replace(workload, rate=rate, num_requests=num_requests)
