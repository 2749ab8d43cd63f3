"""How often admission's overload test fires, below and past saturation, on simulated traffic.

    python -m benchmarks.overload_detector [--runs 100] [--duration 40]

A pool that starts a request every 1/2 s (it finishes 2 req/s at most) and serves each in
3 s x U(0.7, 1.6) after it starts; Poisson asks at half saturation (1 req/s), 0.7x, 1.5x,
2x and 3x, `--runs` runs of `--duration` seconds each. For each rule, the share of asks judged
overloaded (and of the asks in a run's first ten seconds, an overload's onset past
saturation) and the runs where any was: the shipped rule (`LoadWindow`: the asks one lag
back against the finishes) beside counting every ask of the window against the finishes in
it, overloaded at 1.5 times as many (the rule before). No model and no timing: the same
figures on any machine.
"""

from __future__ import annotations

import argparse
import random
from dataclasses import dataclass

from splitserve.gateway.admission.load_window import OVERLOAD_EXCESS, WINDOW_SECONDS, LoadWindow

CAPACITY_REQ_S = 2.0
SERVICE_S = 3.0
LOAD_FACTORS = (0.5, 0.7, 1.5, 2.0, 3.0)
BEFORE_DEMAND = 1.5  # the rule before the lag: asked at this multiple of what finished
ONSET_S = 10.0  # a run's first seconds, where the asks have not had time to finish


@dataclass
class Judged:
    """One rule's verdicts over one run: asks judged overloaded, of all and of the first."""

    overloaded: int = 0
    early_overloaded: int = 0
    early_asks: int = 0

    def add(self, overloaded: bool, at: float) -> None:
        self.overloaded += overloaded
        if at < ONSET_S:
            self.early_asks += 1
            self.early_overloaded += overloaded


@dataclass
class Tally:
    judged: int = 0
    asks: int = 0
    runs_firing: int = 0
    early_judged: int = 0
    early_asks: int = 0

    def add(self, run: Judged, asks: int) -> None:
        self.judged += run.overloaded
        self.asks += asks
        self.runs_firing += run.overloaded > 0
        self.early_judged += run.early_overloaded
        self.early_asks += run.early_asks

    def line(self) -> str:
        share = 100 * self.judged / max(self.asks, 1)
        early = 100 * self.early_judged / max(self.early_asks, 1)
        return f"{share:5.1f}% ({early:5.1f}% early) in {self.runs_firing:3d} runs"


def simulated_run(rate: float, duration_s: float, seed: int) -> tuple[list[float], list[float]]:
    """Ask times and finish times (same order) of one run."""
    rng = random.Random(seed)
    asks, at = [], rng.expovariate(rate)
    while at <= duration_s:
        asks.append(at)
        at += rng.expovariate(rate)
    finishes, start = [], float("-inf")
    for asked in asks:
        start = max(asked, start + 1 / CAPACITY_REQ_S)
        finishes.append(start + SERVICE_S * rng.uniform(0.7, 1.6))
    return asks, finishes


def judged_by_each_rule(asks: list[float], finishes: list[float]) -> tuple[Judged, Judged]:
    """The verdicts of the shipped rule and of the rule before it on one run."""
    window = LoadWindow()
    events = sorted([(t, 1, t) for t in asks] + [(f, 0, t) for t, f in zip(asks, finishes)])
    shipped, before = Judged(), Judged()
    for now, is_ask, asked_at in events:
        if not is_ask:
            window.note_finish(now, asked_at)
            continue
        window.note_ask(now)
        shipped.add(window.is_overloaded(now), now)
        asked = sum(1 for t in asks if now - WINDOW_SECONDS <= t <= now)
        finished = sum(1 for f in finishes if now - WINDOW_SECONDS <= f <= now)
        excess = asked - finished
        before.add(asked > BEFORE_DEMAND * finished and excess >= OVERLOAD_EXCESS, now)
    return shipped, before


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=100)
    parser.add_argument("--duration", type=float, default=40.0)
    args = parser.parse_args(argv)
    print(f"asks judged overloaded (early: those of the first {ONSET_S:.0f} s of a run)")
    print(f"{'load':>5} {'lagged asks (shipped)':>36} {'every ask (before)':>36}")
    for factor in LOAD_FACTORS:
        shipped, before = Tally(), Tally()
        for seed in range(args.runs):
            asks, finishes = simulated_run(factor * CAPACITY_REQ_S, args.duration, seed)
            judged_shipped, judged_before = judged_by_each_rule(asks, finishes)
            shipped.add(judged_shipped, len(asks))
            before.add(judged_before, len(asks))
        print(f"{factor:4.1f}x {shipped.line():>36} {before.line():>36}", flush=True)


if __name__ == "__main__":
    main()
