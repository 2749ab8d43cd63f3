"""How finely a measured run pins down its own percentiles.

A validation run is a minute of traffic: a dozen requests, a few dozen to a few hundred token
gaps. Where a distribution has two modes (decode steps, and the steps a long prompt's prefill
stalls), a percentile that falls near the edge between them jumps by an order of magnitude when
one sample changes mode: on the native AVX2 EPYC (2026-12-02) colocated-1's long-prompt run had
7 stalled gaps of 72, its ITL p90 109 ms; the simulation had one stall more, and its p90 was
1,092 ms. Such a figure cannot judge a model to 20%, and neither can a rerun of the same stack.

The band here is the range of values between which the population's q-quantile lies with about
90% confidence, read from the sample's own order statistics: the number of samples below the
true quantile is Binomial(n, q), so the ranks n q +- 1.645 sqrt(n q (1 - q)) (its normal
approximation, widened by one rank each way for the discreteness) bound it. A simulated figure
inside the band, give or take the tolerance, agrees with the measurement as far as the
measurement can tell.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

Z_90 = 1.645  # two-sided 90% of the standard normal


def percentile_band(samples: Sequence[float], fraction: float) -> tuple[float, float]:
    """(low, high): the sample values bounding its `fraction` quantile's ~90% confidence
    interval; (nan, nan) for no samples."""
    if not 0.0 < fraction < 1.0:
        raise ValueError(f"fraction must be within (0, 1), got {fraction}")
    values = sorted(samples)
    n = len(values)
    if n == 0:
        return math.nan, math.nan
    centre = n * fraction
    spread = Z_90 * math.sqrt(n * fraction * (1.0 - fraction))
    low_rank = max(1, math.floor(centre - spread))  # 1-based ranks
    high_rank = min(n, math.ceil(centre + spread) + 1)
    return values[low_rank - 1], values[high_rank - 1]


def within_band(simulated: float, band: tuple[float, float], tolerance: float) -> bool:
    """Whether `simulated` lies in the band widened by `tolerance` (relative) on each side."""
    low, high = band
    if math.isnan(simulated) or math.isnan(low):
        return False
    return low * (1.0 - tolerance) <= simulated <= high * (1.0 + tolerance)
