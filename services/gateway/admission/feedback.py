"""What admission control learns from the streams it admitted, so that it holds on any machine
and any mix of work without a model that is right there:

- `TokenGaps`: the gaps between tokens a decode pod's streams delivered to this gateway over the
  last window (serving overheads and interleaved prefills included: what clients see);
- `RowLimit`: how many rows a decode pod may run, moved each window toward the number at which
  its measured gaps sit at the TPOT target (more rows while it is below and the limit binds,
  fewer at once when above). Prefill work that shares the pod's steps lengthens every gap, so a
  pod whose steps are taken by prompts ends with fewer rows than its decode cost alone allows;
- `Calibration`: measured over predicted, a factor the next predictions are multiplied by
  (TTFT: recent requests' own; TPOT: the pods' windows of token gaps against their modelled
  step at the rows they ran), so a model that is consistently short (or long) on this
  machine, this topology or this workload is corrected within a few requests.
"""

from __future__ import annotations

import math
import time
from collections import deque
from dataclasses import dataclass, field

# The measured gaps are steered to this share of the TPOT objective: a request's own mean gap
# varies around the pod's, and the objective binds each request.
TPOT_TARGET_SHARE = 0.9
WINDOW_SECONDS = 1.0
MIN_TOKENS_PER_WINDOW = 8  # fewer: too little to judge the pod by, the limit stays
# How far one window may move a limit: down at once when over target, up gently, since a row
# admitted now lengthens the gaps only once its prompt is prefilled.
MAX_DECREASE = 0.5
MAX_INCREASE = 1.25
SMOOTHING = 0.5  # weight of the newest window's mean gap
CALIBRATION_WEIGHT = 0.2  # of the newest request's log ratio
CALIBRATION_RANGE = (0.25, 10.0)
# A factor holds as it is for CALIBRATION_HOLD_S after its last observation, then fades toward
# 1 with this half-life. Under load every admitted request's first token (and every busy
# window) observes again well within the hold, so a steady bias is learnt in full; fading
# all along would settle it short (at one observation a second and a 20 s half-life, a true
# 3x was learnt as 2.6x).
CALIBRATION_HOLD_S = 10.0
CALIBRATION_HALF_LIFE_S = 10.0
# A factor's spread: the last RECENT_RATIOS ratios, and the quantile of them a TTFT is judged at
# (`Calibration.upper_factor_at`), once MIN_RATIOS_FOR_SPREAD were seen.
RECENT_RATIOS = 32
UPPER_QUANTILE = 0.9
MIN_RATIOS_FOR_SPREAD = 8


@dataclass
class TokenGaps:
    """Gaps between tokens of a pod's streams, summed over the current window."""

    seconds: float = 0.0
    num_tokens: int = 0
    started: float = field(default_factory=time.monotonic)

    def add(self, gap_s: float, num_tokens: int) -> None:
        self.seconds += gap_s
        self.num_tokens += num_tokens

    def take(self, now: float) -> float | None:
        """The window's mean gap per token in ms once it is WINDOW_SECONDS old and saw enough
        tokens (None otherwise); a taken window starts over."""
        if now - self.started < WINDOW_SECONDS:
            return None
        mean_ms = self.seconds * 1000 / self.num_tokens if self.num_tokens else None
        enough = self.num_tokens >= MIN_TOKENS_PER_WINDOW
        self.seconds, self.num_tokens, self.started = 0.0, 0, now
        return mean_ms if enough else None


# Rows a pod starts with before its gaps say more (a slow start: a burst of prompts admitted at
# once would stall every stream on the pod before the first window could tell).
INITIAL_ROWS = 8


@dataclass
class RowLimit:
    """One decode pod's row limit under a TPOT objective."""

    limit: float
    ceiling: int  # never above the pod's own maximum
    smoothed_ms: float | None = None  # the windows' gaps, averaged: one prompt's burst
    # lengthens one window's gaps, and the limit must not swing with each

    def update(self, measured_ms: float, target_ms: float, rows_in_use: int) -> None:
        previous = self.smoothed_ms
        smoothed = (
            measured_ms if previous is None else previous + SMOOTHING * (measured_ms - previous)
        )
        self.smoothed_ms = smoothed
        ratio = target_ms / max(smoothed, 1e-3)
        if ratio < 1.0:
            self.limit *= max(ratio, MAX_DECREASE)
        elif rows_in_use >= self.limit - 1:  # only a limit that binds may grow
            self.limit *= min(ratio, MAX_INCREASE)
        self.limit = min(max(self.limit, 1.0), float(self.ceiling))

    @property
    def rows(self) -> int:
        return int(self.limit)


@dataclass
class Calibration:
    """A running factor, measured over predicted, in log space (a ratio of 2 and one of 0.5
    cancel out), that fades back toward 1 while nothing new is observed: a factor learnt in an
    overload, when every first token came late, otherwise outlives it, and since refused
    requests teach nothing, it kept refusing on an idle pool (2026-12-03, an EPYC: after a
    flood at 3 req/s, a lone request at 0.07 req/s refused on a predicted TTFT past 3 s)."""

    log_ratio: float = 0.0
    num_seen: int = 0
    observed_at: float | None = None  # time.monotonic() of the last observation
    recent: deque[float] = field(default_factory=lambda: deque(maxlen=RECENT_RATIOS))

    def observe(self, measured: float, predicted: float, now: float | None = None) -> None:
        if measured <= 0 or predicted <= 0:
            return
        now = time.monotonic() if now is None else now
        low, high = CALIBRATION_RANGE
        ratio = math.log(min(max(measured / predicted, low), high))
        # A steady weight, even for the first requests: a cold first request (a new shape, a
        # pod's first steps) must not set the factor on its own.
        faded = self._faded_log_ratio(now)
        self.log_ratio = faded + CALIBRATION_WEIGHT * (ratio - faded)
        self.observed_at = now
        self.num_seen += 1
        self.recent.append(ratio)

    @property
    def factor(self) -> float:
        return self.factor_at(time.monotonic())

    def factor_at(self, now: float) -> float:
        return math.exp(self._faded_log_ratio(now))

    def upper_factor_at(self, now: float) -> float:
        """The factor at the UPPER_QUANTILE of the recent ratios (never below `factor_at`):
        what a TTFT is judged at. The running factor is a middle, so a request predicted just
        inside its objective by it misses about half the time; where the predictions spread
        wide (a CPU prefill pod's steps of 1-2 s, on an EPYC: measured/predicted 0.5-1.5),
        admitting at the middle left 10-19% of the accepted requests past their TTFT."""
        middle = self._faded_log_ratio(now)
        if len(self.recent) < MIN_RATIOS_FOR_SPREAD:
            return math.exp(middle)
        ordered = sorted(self.recent)
        upper = ordered[min(int(UPPER_QUANTILE * len(ordered)), len(ordered) - 1)]
        return math.exp(max(middle, self._faded(upper, now)))

    def _faded_log_ratio(self, now: float) -> float:
        return self._faded(self.log_ratio, now)

    def _faded(self, log_ratio: float, now: float) -> float:
        if self.observed_at is None:
            return log_ratio
        stale_s = max(now - self.observed_at - CALIBRATION_HOLD_S, 0.0)
        return log_ratio * 0.5 ** (stale_s / CALIBRATION_HALF_LIFE_S)
