"""How often admission's overload test fires, below and past saturation, on simulated traffic.

    python -m benchmarks.overload_detector [--runs 100] [--duration 40]

A pool that starts a request every 1/2 s (it finishes 2 req/s at most) and serves each in
3 s x U(0.7, 1.6) after it starts; Poisson asks at half saturation (1 req/s), 0.7x, 2x and
3x, `--runs` runs of `--duration` seconds each. For each rule, the share of asks judged
overloaded and the runs where any was: the shipped rule (`LoadWindow`: the asks one recent
service time back against the finishes) beside counting every ask of the window against the
finishes in it (the rule before). No model and no timing: the same figures on any machine.
"""

from __future__ import annotations

import argparse
import random
from dataclasses import dataclass

from splitserve.gateway.admission.load_window import (
    OVERLOAD_DEMAND,
    OVERLOAD_EXCESS,
    WINDOW_SECONDS,
    LoadWindow,
)

CAPACITY_REQ_S = 2.0
SERVICE_S = 3.0
LOAD_FACTORS = (0.5, 0.7, 2.0, 3.0)


@dataclass
class Tally:
    judged: int = 0
    asks: int = 0
    runs_firing: int = 0

    def add(self, judged: int, asks: int) -> None:
        self.judged += judged
        self.asks += asks
        self.runs_firing += judged > 0

    def line(self) -> str:
        share = 100 * self.judged / max(self.asks, 1)
        return f"{share:5.1f}% of {self.asks:6d} asks, in {self.runs_firing:3d} runs"


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


def judged_by_each_rule(asks: list[float], finishes: list[float]) -> tuple[int, int]:
    """Asks judged overloaded by the shipped rule and by the rule before it."""
    window = LoadWindow()
    events = sorted([(t, 1, t) for t in asks] + [(f, 0, t) for t, f in zip(asks, finishes)])
    shipped = before = 0
    for now, is_ask, asked_at in events:
        if not is_ask:
            window.note_finish(now, asked_at)
            continue
        window.note_ask(now)
        shipped += window.is_overloaded(now)
        asked = sum(1 for t in asks if now - WINDOW_SECONDS <= t <= now)
        finished = sum(1 for f in finishes if now - WINDOW_SECONDS <= f <= now)
        before += asked > OVERLOAD_DEMAND * finished and asked - finished >= OVERLOAD_EXCESS
    return shipped, before


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=100)
    parser.add_argument("--duration", type=float, default=40.0)
    args = parser.parse_args(argv)
    print(f"{'load':>5} {'lagged asks (shipped)':>38} {'every ask (before)':>38}")
    for factor in LOAD_FACTORS:
        shipped, before = Tally(), Tally()
        for seed in range(args.runs):
            asks, finishes = simulated_run(factor * CAPACITY_REQ_S, args.duration, seed)
            judged_shipped, judged_before = judged_by_each_rule(asks, finishes)
            shipped.add(judged_shipped, len(asks))
            before.add(judged_before, len(asks))
        print(f"{factor:4.1f}x {shipped.line():>38} {before.line():>38}", flush=True)


if __name__ == "__main__":
    main()
