"""services/planner/validate/resolution.py: the range a measured sample pins a percentile to."""

from __future__ import annotations

import math
import random

import pytest

from splitserve.planner.validate.resolution import percentile_band, within_band


def test_a_percentile_at_the_edge_of_two_modes_spans_both():
    """The long-prompt run's shape: 65 decode gaps near 0.1 s and 7 stalls near 2 s. Its p90
    falls on the lower mode, one stall more puts it on the upper: the band holds both."""
    gaps = [0.09 + 0.0003 * i for i in range(65)] + [1.6, 1.6, 1.7, 1.9, 2.1, 2.2, 2.2]
    low, high = percentile_band(gaps, 0.9)
    assert low < 0.12 and high >= 1.6
    assert within_band(1.09, (low, high), 0.2)  # the simulation's p90 then
    # The median is pinned to the lower mode.
    low, high = percentile_band(gaps, 0.5)
    assert 0.09 <= low <= high < 0.12
    assert not within_band(0.2, (low, high), 0.2)


def test_a_large_sample_pins_its_percentile_closely():
    rng = random.Random(4)
    samples = [rng.gauss(1.0, 0.1) for _ in range(5000)]
    low, high = percentile_band(samples, 0.9)
    true_p90 = 1.0 + 0.1 * 1.2816
    assert low < true_p90 < high and high - low < 0.02


def test_the_band_covers_the_true_quantile_about_nine_times_in_ten():
    rng = random.Random(7)
    covered = 0
    for _ in range(400):
        samples = [rng.expovariate(1.0) for _ in range(72)]
        low, high = percentile_band(samples, 0.9)
        covered += low <= math.log(10.0) <= high  # exponential's p90
    assert 0.88 <= covered / 400 <= 0.99


def test_no_samples_give_no_band_and_a_bad_fraction_is_refused():
    assert all(math.isnan(x) for x in percentile_band([], 0.5))
    assert not within_band(1.0, percentile_band([], 0.5), 0.2)
    with pytest.raises(ValueError, match="within"):
        percentile_band([1.0], 1.0)
