"""`plan validate`'s goodput check: requests per second meeting both SLOs (DistServe's
objective), measured and simulated for the same requests, and per pod; then, per workload,
whether the layout the simulator ranks best by goodput per pod measures within
PICK_TOLERANCE of the measured best.

The SLOs are set from the profile, so that they mean the same on a fast machine and a slow
one: a TTFT of a few unloaded prefills of the workload's longest prompt (room to queue behind
one or two others), and a mean ITL a little above one unloaded decode step (a colocated pod
that stalls a stream for another prompt's prefill misses it; a disaggregated one does not).
At the validation's rates (one pod about half busy) some requests miss them on some layouts,
which is what the check needs: at an SLO nobody misses, every layout's goodput is its rate.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import TYPE_CHECKING

from splitserve.loadgen.stats import Slo
from splitserve.loadgen.workload import WorkloadShape
from splitserve.planner.profile import Profile

if TYPE_CHECKING:
    from splitserve.planner.validate.compare import Comparison, LocalWorkload

TTFT_SLO_PREFILLS = 2.5  # the TTFT SLO in unloaded prefills of the longest prompt
ITL_SLO_STEPS = 1.5  # the mean ITL SLO in unloaded one-row decode steps at the longest context
PICK_TOLERANCE = 0.10  # the pick's measured goodput per pod may trail the best's by this much


def workload_slo(profile: Profile, shape: WorkloadShape) -> Slo:
    """The goodput SLOs of a workload, from the bare profile (no serving costs, no margin)."""
    bare = replace(profile, serving={})
    longest_prompt = shape.prompt_lens.high
    longest_context = longest_prompt + shape.output_lens.high
    return Slo(
        TTFT_SLO_PREFILLS * bare.prefill_s(longest_prompt),
        ITL_SLO_STEPS * bare.decode.step_s(1, longest_context),
    )


def measured_attainment(comparison: Comparison, slo: Slo) -> float:
    """The share of the run's requests that finished within both SLOs (a failed request
    misses), from the client's recorded timings."""
    good = sum(
        slo.is_met(ttft, sum(gaps) / len(gaps) if gaps else 0.0)
        for ttft, gaps in zip(comparison.ttfts_s, comparison.itls_s, strict=True)
    )
    return good / max(comparison.num_requests, 1)


def goodput_per_pod(comparison: Comparison, attainment: float) -> float:
    """Requests/s meeting both SLOs (the offered rate times the share that met them), per pod."""
    return comparison.rate * attainment / comparison.num_pods


def format_goodput(comparisons: list[Comparison], workloads: tuple[LocalWorkload, ...]) -> str:
    lines = ["goodput (requests/s meeting both SLOs, per pod), measured / simulated:"]
    for workload in workloads:
        rows = [c for c in comparisons if c.workload == workload.name and c.goodput_slo]
        if not rows:
            continue
        slo = Slo(*rows[0].goodput_slo)
        cells = [
            f"{c.config} {_per_pod(c, measured=True):.3f}/{_per_pod(c, measured=False):.3f}"
            for c in rows
        ]
        lines.append(f"  {workload.name} ({slo}): " + ", ".join(cells))
        if len(rows) >= 2:
            lines.append(f"    {_pick_verdict(rows)}")
    return "\n".join(lines)


def pick_shortfall(rows: list[Comparison]) -> tuple[Comparison, Comparison, float]:
    """(the simulator's pick by goodput per pod, the measured best, how far the pick's
    measured goodput per pod trails the best's, as a share of the best's)."""
    pick = max(rows, key=lambda c: _per_pod(c, measured=False))
    best = max(rows, key=lambda c: _per_pod(c, measured=True))
    best_figure = _per_pod(best, measured=True)
    if best_figure <= 0:
        return pick, best, 0.0
    return pick, best, 1 - _per_pod(pick, measured=True) / best_figure


def _pick_verdict(rows: list[Comparison]) -> str:
    pick, best, shortfall = pick_shortfall(rows)
    holds = "yes" if shortfall <= PICK_TOLERANCE else "NO"
    if pick.config == best.config:
        return f"the simulator's pick, {pick.config}, measures best: {holds}"
    return (
        f"the simulator's pick, {pick.config}, measures {shortfall:.0%} below the best, "
        f"{best.config}; within {PICK_TOLERANCE:.0%}: {holds}"
    )


def _per_pod(comparison: Comparison, measured: bool) -> float:
    slo = Slo(*comparison.goodput_slo)
    attainment = (
        measured_attainment(comparison, slo) if measured else comparison.simulated_attainment
    )
    return goodput_per_pod(comparison, attainment) if not math.isnan(attainment) else 0.0
