"""What one run at one load adds up to, from per-request outcomes whichever client saw them.

Goodput (DistServe's objective) is the requests per second that finished and met both SLOs:
TTFT within its bound and the request's own TPOT, (last token - first token) / (tokens - 1),
within its bound. It is divided by the run's duration as the client measured it (first send to
the last answer), as vLLM's `bench serve` does, so a backlog that drains long after the last
arrival lowers it. SLO attainment is counted among the accepted requests only (HTTP 200): what
admission control promises is that what it accepts is served well.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass

from splitserve.loadgen.stats import Percentiles, Slo

# Answered at once by SLO-aware admission, whose speed the issue bounds (< 50 ms); a queue
# timeout (408) comes late by design and is counted but not timed with them.
FAST_REFUSALS = (429, 503)


@dataclass(frozen=True)
class SloPair:
    name: str  # "loose", "tight"
    ttft_ms: int
    tpot_ms: int

    @property
    def slo(self) -> Slo:
        return Slo(ttft_s=self.ttft_ms / 1e3, itl_s=self.tpot_ms / 1e3)

    def __str__(self) -> str:
        return f"TTFT <= {self.ttft_ms} ms, TPOT <= {self.tpot_ms} ms"


# The pair, and a tight one: on this 2-core machine an unloaded request sees TTFT
# ~0.2-0.35 s (256-token prompt) and ~20-28 ms between tokens (docs/benchmarks.md), so 1 s and
# 100 ms are ~3-4x the unloaded figures. A few streams batched together still meet them, while
# any real queue breaks them: admission has something to protect, and it is reachable.
LOOSE = SloPair("loose", 3000, 200)
TIGHT = SloPair("tight", 1000, 100)
SLO_PAIRS = (LOOSE, TIGHT)


@dataclass(frozen=True)
class Outcome:
    """One request as a client saw it."""

    status: int | None  # the HTTP status; None when no answer came (connection error, cancel)
    finished: bool  # accepted and every asked-for token streamed
    ttft_s: float | None
    tpot_s: float | None  # 0 for a request of one token
    answered_s: float | None = None  # send to the status line; None where the client says not


@dataclass(frozen=True)
class LoadFigures:
    """One system, one client, one workload, one offered rate."""

    offered_rate: float  # requests/s sent
    duration_s: float
    num_sent: int
    num_completed: int
    refused: dict[int, int]  # HTTP status -> count, every answer other than 200
    num_failed: int  # neither completed nor refused: broken streams, cancels, no answer
    goodput: dict[str, float]  # SLO pair name -> requests/s meeting both
    attainment: dict[str, float]  # SLO pair name -> share of accepted requests meeting both
    ttft: Percentiles  # seconds, over completed requests
    tpot: Percentiles
    refusal_s: Percentiles  # send to the answer of 429/503s (NaN when none or not timed)

    @property
    def num_refused(self) -> int:
        return sum(self.refused.values())


def is_good(outcome: Outcome, slo: Slo) -> bool:
    return outcome.finished and slo.is_met(outcome.ttft_s, outcome.tpot_s or 0.0)


def summarize(
    outcomes: list[Outcome],
    duration_s: float,
    offered_rate: float,
    slo_pairs: tuple[SloPair, ...] = SLO_PAIRS,
) -> LoadFigures:
    completed = [o for o in outcomes if o.finished]
    refused = [o for o in outcomes if o.status is not None and o.status != 200]
    num_accepted = sum(o.status == 200 for o in outcomes)
    duration = max(duration_s, 1e-9)
    num_good = {p.name: sum(is_good(o, p.slo) for o in completed) for p in slo_pairs}
    return LoadFigures(
        offered_rate=offered_rate,
        duration_s=duration_s,
        num_sent=len(outcomes),
        num_completed=len(completed),
        refused=dict(sorted(Counter(o.status for o in refused if o.status).items())),
        num_failed=len(outcomes) - len(completed) - len(refused),
        goodput={name: n / duration for name, n in num_good.items()},
        attainment={
            name: n / num_accepted if num_accepted else math.nan for name, n in num_good.items()
        },
        ttft=Percentiles.of([o.ttft_s for o in completed if o.ttft_s is not None]),
        tpot=Percentiles.of([o.tpot_s for o in completed if o.tpot_s is not None]),
        refusal_s=Percentiles.of(_fast_refusal_times(refused)),
    )


def _fast_refusal_times(refused: list[Outcome]) -> list[float]:
    return [o.answered_s for o in refused if o.status in FAST_REFUSALS and o.answered_s is not None]


def offered_rates(reference_rate: float, load_factors: list[float]) -> list[float]:
    """The Poisson rate of each load, as multiples of the reference saturation rate."""
    if reference_rate <= 0:
        raise ValueError(f"the reference saturation rate must be > 0, got {reference_rate}")
    return [reference_rate * factor for factor in load_factors]


def load_seeds(base_seed: int, load_factors: list[float]) -> list[int]:
    """The arrival sequence's seed of each load: one per load factor, so that every system
    gets the same requests at a load, and a new one each time a factor repeats (`--loads 0.5
    0.5`): a repeat of the same prompts was served from the prefix cache (2026-12-03, a Zen 5
    EPYC: TTFT p50 599 ms the first time at half saturation, 90-104 ms the next two)."""
    seen: dict[float, int] = {}
    seeds = []
    for factor in load_factors:
        repeat = seen.get(factor, 0)
        seen[factor] = repeat + 1
        seeds.append(base_seed + round(factor * 1000) + 1_000_003 * repeat)
    return seeds


def num_arrivals(rate: float, duration_s: float) -> int:
    """Requests a Poisson process of `rate` sends in `duration_s` on average (at least one):
    vLLM's client takes a count and a rate, not a duration."""
    return max(1, round(rate * duration_s))
