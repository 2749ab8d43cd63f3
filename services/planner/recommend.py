"""`splitserve plan recommend`: the fewest devices meeting a target rate and SLOs with a stated
confidence, the resource that binds, and the prefill:decode ratio with the best goodput per pod.

1. Fewest devices: every (P, D) with P + D <= max_pods is judged at the target rate
   (`sizing.judge`: several seeded workloads; it meets the target when at least `attainment`
   of the requests meet both SLOs in at least `confidence` of the seeds). The fewest devices
   (pods times each pod's parallel layout, from the profiles) that meet it win; ties go to
   fewer pods, then the higher median goodput. P = 0 is the colocated baseline (decode pods
   prefill for themselves). Each candidate's TTFT and ITL come with their band over the seeds,
   and its binding resource.
2. Best layout: for each (P, D) with P + D <= ratio_max_pods, each engine setup given (the
   profile, and `variants`: profiles of the same model run another way, such as int8 weights
   or an int8 KV cache) and, for P > 0, each conditional-disaggregation limit in
   `remote_prefill_limits`, a bisection on the arrival rate finds the highest rate still
   meeting the target the same way (DistServe's goodput); divided by the devices it says which
   layout uses the hardware best, whatever the target, and what binds it at that rate.

Every simulation of one search sees the same seeded requests (common random numbers), so
differences between configurations are not sampling noise.
"""

from __future__ import annotations

import math

from splitserve.planner.pool import Workers, simulation_pool
from splitserve.planner.profile import Profile
from splitserve.planner.search import (
    Candidate,
    Profiles,
    Progress,
    RatioPoint,
    Recommendation,
    SearchSpec,
    clusters,
    fewest_devices,
    layouts,
    max_good_rate,
)
from splitserve.planner.sizing import Verdict, judge
from splitserve.planner.slices import recommend_by_slices


def recommend(
    profile: Profile,
    spec: SearchSpec,
    progress: Progress | None = None,
    prefill_profile: Profile | None = None,
    variants: tuple[Profiles, ...] = (),
) -> Recommendation:
    """`variants`: other engine setups of the same model for the layout sweep (the fewest-
    devices search runs the given profiles alone)."""
    if spec.slice_size:
        return recommend_by_slices(profile, spec, progress, prefill_profile, variants)
    profiles = Profiles(profile, prefill_profile)
    candidates = []
    configs = clusters(spec, spec.max_pods)
    with simulation_pool(spec.jobs) as workers:
        for i, cluster in enumerate(configs, 1):
            verdict = judge(
                profile,
                cluster,
                spec.workload,
                spec.target,
                spec.seed,
                prefill_profile,
                workers=workers,
            )
            candidates.append(Candidate(verdict, profiles.devices(cluster)))
            if progress is not None:
                progress(f"simulated {i}/{len(configs)}: {cluster.label}")
        ratios = ratio_sweep((profiles, *variants), spec, progress, workers)
    return Recommendation(candidates, fewest_devices(candidates), ratios)


def ratio_sweep(
    setups: tuple[Profiles, ...],
    spec: SearchSpec,
    progress: Progress | None = None,
    workers: Workers | None = None,
) -> list[RatioPoint]:
    configs = [(profiles, cluster) for profiles in setups for cluster in layouts(spec)]
    points = []
    for i, (profiles, cluster) in enumerate(configs, 1):
        rate, verdict = max_good_rate(profiles, cluster, spec, workers=workers)
        point = RatioPoint(cluster, rate, profiles.devices(cluster), verdict, profiles.setup)
        points.append(point)
        if progress is not None:
            progress(f"rate search {i}/{len(configs)}: {point.label}, {point.setup}")
    return points


# ---- output ---------------------------------------------------------------------------------


def format_table(recommendation: Recommendation, spec: SearchSpec) -> str:
    header = (
        f"{'config':>12} {'pods':>4} {'dev':>4} {'TTFT p90 (band)':>20} "
        f"{'ITL p90 (band)':>18} {'goodput':>8} {'attain':>7} {'seeds':>6}  "
        f"{'binds':<16} meets"
    )
    lines = [
        f"target: {spec.workload.rate:g} req/s, {spec.slo}, attainment >= "
        f"{spec.attainment:.0%} in >= {spec.confidence:.0%} of {spec.num_seeds} seeded "
        "workloads (bands: lowest-highest over the seeds)",
        *_slice_note(recommendation.slice_pods),
        header,
    ]
    for candidate in sorted(
        recommendation.candidates, key=lambda c: (c.num_devices, c.cluster.num_prefill)
    ):
        verdict = candidate.verdict
        mark = "yes" if candidate.meets else ""
        if candidate is recommendation.best:
            mark += "  <== fewest devices"
        lines.append(
            f"{candidate.cluster.label:>12} {candidate.num_pods:>4} {candidate.num_devices:>4} "
            f"{_band(verdict, 'ttft.p90'):>20} {_band(verdict, 'itl.p90'):>18} "
            f"{verdict.band('goodput').median * candidate.scale:>8.2f} "
            f"{verdict.band('attainment').median:>7.0%} "
            f"{verdict.share_meeting:>6.0%}  {verdict.binding:<16} {mark}"
        )
    best = recommendation.best
    if best is not None:
        pressures = ", ".join(
            f"{name} {value:.0%}" for name, value in best.verdict.pressures.items()
        )
        lines.append(f"the pick's pressures (share of what the target allows): {pressures}")
    lines.append("")
    lines.append(
        "goodput per device (highest rate meeting the target / devices), and what binds there:"
    )
    setups = {point.setup for point in recommendation.ratios}
    best_ratio = recommendation.best_ratio
    for point in recommendation.ratios:
        mark = "  <== best layout" if point is best_ratio else ""
        mark += "" if point.settled else "  (screened)"
        setup = f"  [{point.setup}]" if len(setups) > 1 else ""
        lines.append(
            f"  {point.label:<52} {point.max_rate:7.2f} req/s  "
            f"{point.goodput_per_pod:6.2f} req/s/device  {point.binding:<16}{setup}{mark}"
        )
    if best_ratio is not None:
        lines.append(
            f"best layout: {best_ratio.label}, {best_ratio.setup}: "
            f"{best_ratio.goodput_per_pod:.2f} req/s per device, bound by {best_ratio.binding}"
        )
    return "\n".join(lines)


def _slice_note(slice_pods: int) -> list[str]:
    if not slice_pods:
        return []
    return [
        f"judged by slices of {slice_pods} pods (the layout's prefill share, the trace's span, "
        "each slice's share of the rate): a row's figures are its slice's at the highest rate "
        "the slice holds, goodput scaled to the whole; a slice queues more than the whole, so "
        "the counts err high"
    ]


def _band(verdict: Verdict, figure: str) -> str:
    band = verdict.band(figure)
    return f"{_ms(band.median)} ({_ms(band.low)}-{_ms(band.high)})"


def helm_values(candidate: Candidate) -> str:
    cluster = candidate.cluster
    lines = [
        f"# splitserve plan recommend: {cluster.label}, "
        f"simulated goodput {candidate.goodput:.2f} req/s, "
        f"binds on {candidate.verdict.binding}",
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
