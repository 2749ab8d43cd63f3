"""`plan validate`'s ranking check: per workload, would the planner's pick measure best?

Each configuration gets a latency score, a request's median latency about: TTFT p50 + (mean
output - 1) x ITL p50, simulated (the profile as the planner uses it) and measured. The
simulated best should be the measured best. Two configurations can measure within a percent
or two of each other, inside what a minute's run can tell apart; so when the pick is not the
measured best, the gap between their measured scores is bootstrapped over the runs' requests
(resampled with replacement, BOOTSTRAP_ROUNDS times): if its 90% interval holds 0, the runs do
not say which is better, and the check reads "within noise" instead of "NO".
"""

from __future__ import annotations

import random
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from splitserve.planner.validate.compare import Comparison, Latencies, LocalWorkload

BOOTSTRAP_ROUNDS = 1000
INTERVAL = (5.0, 95.0)  # percentiles of the bootstrapped gap: a 90% interval


def latency_score(latencies: Latencies, workload: LocalWorkload) -> float:
    return _score(latencies.ttft_p50, latencies.itl_p50, workload)


def _score(ttft_p50: float, itl_p50: float, workload: LocalWorkload) -> float:
    """A request's median latency, about: first token, then the mean output's gaps."""
    return ttft_p50 + (workload.shape.output_lens.mean - 1) * itl_p50


def format_ranking(comparisons: list[Comparison], workloads: tuple[LocalWorkload, ...]) -> str:
    """Per workload, the configurations by latency score, simulated (the profile with its
    serving costs) and measured, and whether the planner's pick measures best."""
    lines = ["ranking by median request latency (TTFT p50 + (mean output - 1) x ITL p50):"]
    for workload in workloads:
        rows = [c for c in comparisons if c.workload == workload.name]
        if len(rows) < 2:
            continue
        simulated = sorted(rows, key=lambda c: latency_score(c.simulated_with_overheads, workload))
        measured = sorted(rows, key=lambda c: latency_score(c.measured, workload))
        lines.append(
            f"  {workload.name}: simulated {_order(simulated, workload, True)}; measured "
            f"{_order(measured, workload, False)}; the simulated best measures best: "
            f"{_verdict(simulated[0], measured[0], workload)}"
        )
    return "\n".join(lines)


def _verdict(pick: Comparison, best: Comparison, workload: LocalWorkload) -> str:
    if pick.config == best.config:
        return "yes"
    behind = f"{pick.config} behind {best.config}"
    if not pick.ttfts_s or not best.ttfts_s:
        return f"NO ({behind}; no per-request timings to tell it from noise)"
    low, high = bootstrap_gap(pick, best, workload)
    interval = f"{low * 1e3:+.0f} to {high * 1e3:+.0f} ms"
    if low <= 0:
        return f"within noise ({behind}; the 90% interval of the gap, {interval}, holds 0)"
    return f"NO ({behind}: the 90% interval of the gap is {interval})"


def bootstrap_gap(
    pick: Comparison, best: Comparison, workload: LocalWorkload, seed: int = 0
) -> tuple[float, float]:
    """The 90% interval of measured score(pick) - score(best), each configuration's requests
    (which both must have recorded) resampled with replacement."""
    rng = random.Random(seed)
    gaps = [
        _resampled_score(pick, workload, rng) - _resampled_score(best, workload, rng)
        for _ in range(BOOTSTRAP_ROUNDS)
    ]
    low, high = np.percentile(gaps, INTERVAL)
    return float(low), float(high)


def _resampled_score(run: Comparison, workload: LocalWorkload, rng: random.Random) -> float:
    picks = [rng.randrange(len(run.ttfts_s)) for _ in run.ttfts_s]
    ttft_p50 = float(np.median([run.ttfts_s[i] for i in picks]))
    gaps = [gap for i in picks for gap in run.itls_s[i]]
    itl_p50 = float(np.median(gaps)) if gaps else 0.0
    return _score(ttft_p50, itl_p50, workload)


def _order(rows: list[Comparison], workload: LocalWorkload, simulated: bool) -> str:
    def score(c: Comparison) -> float:
        return latency_score(c.simulated_with_overheads if simulated else c.measured, workload)

    return " < ".join(f"{c.config} ({score(c) * 1e3:.0f} ms)" for c in rows)
