"""`recommend` at cluster scale: a layout of N pods at rate R judged by a slice of n pods with
the same prefill share carrying n/N of the rate over the same span of time.

Why: one judgement of a 1,000-pod layout over a 10-minute trace is several seeded simulations
of about 50 s each, and the exhaustive (P, D) search would run hundreds of thousands of them.
A layout's pods only meet through the gateway, which spreads the requests by load, so a slice
sees the load per pod the whole sees. It is an approximation that errs one way: with fewer
pods to choose from, a slice's queues build sooner than the whole's (the same utilisation
waits longer in a small M/M/c than a large one), so it is expected to ask for more pods than a
simulation of the whole would (about 11% more in the one case docs/benchmarks.md measures). A
whole no larger than a slice is judged whole instead, where the argument runs the other way.

The search, in two passes so that the full test (every seed, the whole span) runs only where
the answer is:
1. screen: every slice layout (P_s prefill and n - P_s decode pods, each setup, limit and
   admission choice as the layout sweep has them) gets its highest rate on one seed over a
   quarter of the span, by the sweep's bisection; the layouts are screened in parallel;
2. settle: the layouts within SETTLE_WITHIN of the best goodput per device get the full test,
   walked up or down from the screened rate and bisected to CONFIRM_STEP (again while
   settling lowers the best enough to bring more layouts within reach).
A settled layout meeting the target rate R then needs R / r slices, each role rounded up to
whole pods; the fewest devices win among the given profiles at the spec's own remote-prefill
limit without admission (the whole-layout search's candidates; the sweep's other choices show
in its table). A layout only screened shows its screened rate, marked.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import replace

from splitserve.planner.pool import Workers, in_order, simulation_pool
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
    with simulation_pool(spec.jobs) as workers:
        points = slice_sweep((profiles, *variants), spec, slice_pods, progress, workers)
        candidates = whole_candidates(points, profiles, spec, slice_pods, workers)
    return Recommendation(candidates, fewest_devices(candidates), points, slice_pods)


def whole_candidates(
    points: list[RatioPoint],
    profiles: Profiles,
    spec: SearchSpec,
    slice_pods: int,
    workers: Workers | None = None,
) -> list[Candidate]:
    """One candidate per distinct whole layout the settled slices give: the given profiles
    at the spec's own remote-prefill limit without admission, as the whole-layout search's
    candidates are (the layout sweep's other choices stay in its table). A whole no larger
    than a slice is judged whole: the slice's argument (more pods, less queueing) runs the
    other way there, and at that size the whole is cheap to simulate."""
    by_layout: dict[tuple[int, int], Candidate] = {}
    for point in points:
        if not _is_candidate_layout(point, profiles, spec):
            continue
        candidate = scaled_candidate(point, profiles, spec)
        if candidate is None:
            continue
        if candidate.num_pods <= slice_pods:
            verdict = judge(
                profiles.decode,
                candidate.cluster,
                spec.workload,
                spec.target,
                spec.seed,
                profiles.prefill,
                workers=workers,
            )
            candidate = Candidate(verdict, profiles.devices(candidate.cluster))
        key = (candidate.cluster.num_prefill, candidate.cluster.num_decode)
        by_layout.setdefault(key, candidate)
    return list(by_layout.values())


def _is_candidate_layout(point: RatioPoint, profiles: Profiles, spec: SearchSpec) -> bool:
    cluster = point.cluster
    own_limit = cluster.num_prefill == 0 or (
        cluster.max_remote_prefill_tokens == spec.max_remote_prefill_tokens
    )
    return (
        point.settled
        and point.setup == profiles.setup
        and own_limit
        and cluster.admission_ttft_s is None
    )


def slice_sweep(
    setups: tuple[Profiles, ...],
    spec: SearchSpec,
    slice_pods: int,
    progress: Progress | None = None,
    workers: Workers | None = None,
) -> list[RatioPoint]:
    """Every setup's slice layouts screened, and the best of them settled (see the module)."""
    pairs = [(profiles, c) for profiles in setups for c in slice_layouts(spec, slice_pods)]
    # Start each screen at the rate a slice carries when the whole is `max_pods`: low rates
    # are cheap to simulate, overloaded ones dear, so the bracket grows up to the answer.
    start = spec.workload.rate * slice_pods / spec.max_pods
    tasks = [(profiles, cluster, spec, start) for profiles, cluster in pairs]
    screened = in_order(workers, screen_rate, tasks)
    points = [
        RatioPoint(cluster, rate, profiles.devices(cluster), v, profiles.setup, settled=False)
        for (profiles, cluster), (rate, v) in zip(pairs, screened)
    ]
    if progress is not None:
        progress(f"screened {len(points)} slice layouts of {slice_pods} pods")
    while todo := _to_settle(points):
        for i in todo:
            (profiles, cluster), point = pairs[i], points[i]
            rate, verdict = settle_rate(profiles, cluster, spec, point.max_rate, workers)
            points[i] = replace(point, max_rate=rate, verdict=verdict, settled=True)
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
    workers: Workers | None = None,
) -> tuple[float, Verdict]:
    """The highest rate at which a slice meets the target by the full test (every seed, the
    whole span), from its screened rate: see `settle`."""

    def full_test(rate: float) -> Verdict:
        return judge(
            profiles.decode,
            cluster,
            workload_at(spec.workload, rate, keep_duration=True),
            spec.target,
            spec.seed,
            profiles.prefill,
            stop_once_failed=True,
            workers=workers,
        )

    return settle(full_test, screened)


def settle(test: Callable[[float], Verdict], start: float) -> tuple[float, Verdict]:
    """The highest rate `test` says meets, to within CONFIRM_STEP (a rate that fails lies at
    most that far above it), walking from `start` in steps that double (3%, 6%, 12%, ...) up
    while it meets or down until it does, then halving the gap between the last rate that met
    and the first that failed; with the verdict there. (0, the lowest rate's verdict) when
    none met in MAX_CONFIRM_STEPS steps down; past MAX_CONFIRM_STEPS steps up, all meeting,
    the highest tried, a lower bound."""
    first = test(start)
    if first.meets:
        met, verdict, failed = _walk_up(test, start, first)
        if failed is None:
            return met, verdict
    else:
        found = _walk_down(test, start, first)
        if isinstance(found, Verdict):
            return 0.0, found
        met, verdict, failed = found
    while failed > met * (1 + CONFIRM_STEP):
        middle = (met + failed) / 2
        tried = test(middle)
        if tried.meets:
            met, verdict = middle, tried
        else:
            failed = middle
    return met, verdict


def _walk_up(
    test: Callable[[float], Verdict], rate: float, verdict: Verdict
) -> tuple[float, Verdict, float | None]:
    """From a rate that meets: (the last rate that met, its verdict, the first that failed,
    None if none did)."""
    step = CONFIRM_STEP
    for _ in range(MAX_CONFIRM_STEPS):
        higher = rate * (1 + step)
        tried = test(higher)
        if not tried.meets:
            return rate, verdict, higher
        rate, verdict, step = higher, tried, 2 * step
    return rate, verdict, None


def _walk_down(
    test: Callable[[float], Verdict], failed: float, verdict: Verdict
) -> tuple[float, Verdict, float] | Verdict:
    """From a rate that fails: (the first rate that met, its verdict, the last that failed),
    or the lowest rate's verdict when none met."""
    step = CONFIRM_STEP
    for _ in range(MAX_CONFIRM_STEPS):
        lower = failed * (1 - step)
        tried = test(lower)
        if tried.meets:
            return lower, tried, failed
        failed, verdict, step = lower, tried, min(2 * step, 0.5)
    return verdict


def scaled_candidate(point: RatioPoint, profiles: Profiles, spec: SearchSpec) -> Candidate | None:
    """The whole layout that `point`'s slice says meets the target rate, or None when the
    slice holds no rate or the layout would pass `max_pods`."""
    if point.max_rate <= 0:
        return None
    slices = spec.workload.rate / point.max_rate
    layout = scale_up(point.cluster, slices)
    if layout.num_prefill + layout.num_decode > spec.max_pods:
        return None
    return Candidate(point.verdict, profiles.devices(layout), layout, slices)


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
