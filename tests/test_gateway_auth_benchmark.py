"""The gateway benchmark's paired estimate (benchmarks/gateway_auth.py): each round's keyed
first-byte median less the open one of the same round, and the sign test's interval around the
median of those differences."""

from __future__ import annotations

import random

import pytest

from benchmarks.gateway_auth import median_interval, paired_added_ms, server_timing_ms


def test_differences_are_taken_within_each_round():
    # The open gateway drifts by 30 ms between rounds; within a round the keyed one is 1 ms
    # slower: pooled medians would mix the drift in, the pairs do not.
    off = [60.0, 90.0, 70.0, 61.0, 88.0]
    on = [value + 1.0 for value in off]
    median, low, high, _ = paired_added_ms(off, on)
    assert median == pytest.approx(1.0)
    assert low == pytest.approx(1.0) and high == pytest.approx(1.0)


def test_interval_ranks_and_their_exact_coverage():
    assert median_interval([2.0, 1.0]) == (1.0, 2.0, 0.5)  # two rounds cannot reach 90%
    low, high, coverage = median_interval([float(v) for v in range(1, 13)])
    assert (low, high) == (3.0, 10.0)  # ranks 4..9 would cover only 85%
    assert coverage == pytest.approx(1 - 2 * (1 + 12 + 66) / 4096)
    low, high, coverage = median_interval([float(v) for v in range(1, 31)])
    assert (low, high) == (11.0, 20.0) and coverage >= 0.9


def test_interval_holds_the_true_median_as_often_as_it_says():
    rng = random.Random(7)
    trials, hits = 3000, 0
    for _ in range(trials):
        low, high, coverage = median_interval([rng.gauss(0.0, 1.0) for _ in range(12)])
        hits += low <= 0.0 <= high
    assert hits / trials == pytest.approx(coverage, abs=0.015)


def test_rounds_must_pair_up():
    with pytest.raises(ValueError):
        paired_added_ms([1.0, 2.0], [1.0])
    with pytest.raises(ValueError):
        paired_added_ms([], [])


def test_server_timing_is_read_by_name_in_any_order():
    assert server_timing_ms("pods;dur=50.2, gateway;dur=0.410") == {"gateway": 0.41, "pods": 50.2}
    with pytest.raises(ValueError):
        server_timing_ms("")  # a gateway started without --server-timing
