"""`recommend` at cluster scale: a layout of N pods at rate R judged by a slice of n pods with
the same prefill share carrying n/N of the rate over the same span of time.

Why: one judgement of a 1,000-pod layout over a 10-minute trace is several seeded simulations
of about 50 s each, and the exhaustive (P, D) search would run hundreds of thousands of them.
A layout's pods only meet through the gateway, which spreads the requests by load, so a slice
sees the load per pod the whole sees. It is an approximation that errs one way: with fewer
pods to choose from, a slice's queues build sooner than the whole's (the same utilisation
waits longer in a small M/M/c than a large one), so it asks for more pods, never fewer, than a
simulation of the whole would (docs/benchmarks.md measures by how much).

The search, in two passes so that the full test (every seed, the whole span) runs only where
the answer is:
1. screen: every slice layout (P_s prefill and n - P_s decode pods, each setup, limit and
   admission choice as the layout sweep has them) gets its highest rate on one seed over a
   quarter of the span, by the sweep's bisection; the layouts are screened in parallel;
2. settle: the layouts within SETTLE_WITHIN of the best goodput per device get the full test,
   stepping CONFIRM_STEP up while it meets or down until it does (again while settling
   lowers the best enough to bring more layouts within reach).
A settled layout meeting the target rate R then needs R / r slices, each role rounded up to
whole pods; the fewest devices win. A layout only screened shows its screened rate, marked.
"""

from __future__ import annotations

import math
from concurrent.futures import Executor
from dataclasses import replace

from splitserve.planner.pool import simulation_pool
from splitserve.planner.profile import Profile
from splitserve.planner.search import (
    Candidate,
    Profiles,
    Progress,
    RatioPoint,
    Recommendation,
    SearchSpec,
    fewest_devices,
    layouts,
    max_good_rate,
    workload_at,
)
from splitserve.planner.simulate.cluster import ClusterConfig
from splitserve.planner.sizing import Verdict, judge

# The one-seed search that screens a slice layout runs this share of the trace's span.
SCREEN_SHARE = 0.25
# Layouts whose screened goodput per device is within this share of the best get settled.
SETTLE_WITHIN = 0.9
# The full test steps by this share of the rate (the precision of a settled answer), at most
# MAX_CONFIRM_STEPS times either way (down, in steps that double).
CONFIRM_STEP = 0.03
MAX_CONFIRM_STEPS = 8


def slice_layouts(spec: SearchSpec, slice_pods: int) -> list[ClusterConfig]:
    """The layout sweep's layouts with exactly `slice_pods` pods."""
    return [
        cluster
        for cluster in layouts(replace(spec, ratio_max_pods=slice_pods))
        if cluster.num_prefill + cluster.num_decode == slice_pods
    ]


def recommend_by_slices(
    profile: Profile,
    spec: SearchSpec,
    progress: Progress | None = None,
    prefill_profile: Profile | None = None,
    variants: tuple[Profiles, ...] = (),
) -> Recommendation:
    slice_pods = spec.slice_size
    profiles = Profiles(profile, prefill_profile)
    with simulation_pool(spec.jobs) as executor:
        points = slice_sweep((profiles, *variants), spec, slice_pods, progress, executor)
    # The fewest-devices pick runs the given profiles alone, as the whole search does.
    own = [point for point in points if point.setup == profiles.setup and point.settled]
    candidates = [
        candidate
        for point in own
        if (candidate := scaled_candidate(point, profiles, spec)) is not None
    ]
    return Recommendation(candidates, fewest_devices(candidates), points, slice_pods)


def slice_sweep(
    setups: tuple[Profiles, ...],
    spec: SearchSpec,
    slice_pods: int,
    progress: Progress | None = None,
    executor: Executor | None = None,
) -> list[RatioPoint]:
    """Every setup's slice layouts screened, and the best of them settled (see the module)."""
    pairs = [(profiles, c) for profiles in setups for c in slice_layouts(spec, slice_pods)]
    # Start each screen at the rate a slice carries when the whole is `max_pods`: low rates
    # are cheap to simulate, overloaded ones dear, so the bracket grows up to the answer.
    start = spec.workload.rate * slice_pods / spec.max_pods
    tasks = [(profiles, cluster, spec, start) for profiles, cluster in pairs]
    if executor is None:
        screened = [screen_rate(*task) for task in tasks]
    else:
        screened = list(executor.map(screen_rate, *zip(*tasks)))
    points = [
        RatioPoint(cluster, rate, profiles.devices(cluster), profiles.setup, v.binding, v, False)
        for (profiles, cluster), (rate, v) in zip(pairs, screened)
    ]
    if progress is not None:
        progress(f"screened {len(points)} slice layouts of {slice_pods} pods")
    while todo := _to_settle(points):
        for i in todo:
            (profiles, cluster), point = pairs[i], points[i]
            rate, verdict = settle_rate(profiles, cluster, spec, point.max_rate, executor)
            points[i] = replace(point, max_rate=rate, binding=verdict.binding, verdict=verdict,
                                settled=True)  # fmt: skip
            if progress is not None:
                progress(f"settled {cluster.label}, {profiles.setup}: {rate:.2f} req/s")
    return points


def _to_settle(points: list[RatioPoint]) -> list[int]:
    """The layouts not settled yet within SETTLE_WITHIN of the best goodput per device (a
    settled figure counts where there is one): settling can lower the best, which can bring
    more layouts within reach, so the sweep asks again until none are."""
    best = max(point.goodput_per_pod for point in points)
    return [
        i
        for i, point in enumerate(points)
        if not point.settled and best > 0 and point.goodput_per_pod >= SETTLE_WITHIN * best
    ]


def screen_rate(
    profiles: Profiles, cluster: ClusterConfig, spec: SearchSpec, start: float
) -> tuple[float, Verdict]:
    """A slice's highest rate on one seed over SCREEN_SHARE of the span (module level, so a
    process pool can run it)."""
    screen = replace(
        spec,
        workload=replace(
            spec.workload, num_requests=max(1, round(spec.workload.num_requests * SCREEN_SHARE))
        ),
        num_seeds=1,
        confidence=1.0,
    )
    return max_good_rate(profiles, cluster, screen, start, keep_duration=True)


def settle_rate(
    profiles: Profiles,
    cluster: ClusterConfig,
    spec: SearchSpec,
    screened: float,
    executor: Executor | None = None,
) -> tuple[float, Verdict]:
    """The highest rate at which a slice meets the target by the full test, to within
    CONFIRM_STEP (a rate that fails lies at most that far above), from its screened rate; and
    the verdict there (0 and the lowest rate's verdict if none met)."""

    def full(rate: float) -> Verdict:
        return judge(
            profiles.decode,
            cluster,
            workload_at(spec.workload, rate, keep_duration=True),
            spec.target,
            spec.seed,
            profiles.prefill,
            stop_once_failed=True,
            executor=executor,
        )

    rate = screened
    verdict = full(rate)
    if verdict.meets:
        for _ in range(MAX_CONFIRM_STEPS):
            higher = full(rate * (1 + CONFIRM_STEP))
            if not higher.meets:
                break
            rate, verdict = rate * (1 + CONFIRM_STEP), higher
        return rate, verdict
    # Down in steps that double (3%, 6%, 12%, ...) to a rate that meets, then halve the gap
    # to the last that failed until it is one step wide.
    failed, step = rate, CONFIRM_STEP
    for _ in range(MAX_CONFIRM_STEPS):
        lower = full(failed * (1 - step))
        if lower.meets:
            rate, verdict = failed * (1 - step), lower
            break
        failed, verdict, step = failed * (1 - step), lower, min(2 * step, 0.5)
    else:
        return 0.0, verdict
    while failed > rate * (1 + CONFIRM_STEP):
        middle = (rate + failed) / 2
        tried = full(middle)
        if tried.meets:
            rate, verdict = middle, tried
        else:
            failed = middle
    return rate, verdict


def scaled_candidate(point: RatioPoint, profiles: Profiles, spec: SearchSpec) -> Candidate | None:
    """The whole layout that `point`'s slice says meets the target rate, or None when the
    slice holds no rate or the layout would pass `max_pods`."""
    if point.max_rate <= 0 or point.verdict is None:
        return None
    layout = scale_up(point.cluster, spec.workload.rate / point.max_rate)
    if layout.num_prefill + layout.num_decode > spec.max_pods:
        return None
    return Candidate(point.verdict, profiles.devices(layout), layout)


def scale_up(slice_cluster: ClusterConfig, slices: float) -> ClusterConfig:
    """`slices` copies of a slice (a fraction allowed), each role rounded up to whole pods so
    that none carries more than its slice's share."""
    return replace(
        slice_cluster,
        num_prefill=_whole(slice_cluster.num_prefill * slices),
        num_decode=max(_whole(slice_cluster.num_decode * slices), 1),
    )


def _whole(pods: float) -> int:
    # 1e-9: a count computed as 300.0000000001 is 300 pods
    return math.ceil(pods - 1e-9)
