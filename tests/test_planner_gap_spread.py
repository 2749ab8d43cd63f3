"""The measured token-gap spread the simulator adds to each finished request's gaps: drawn from
the spread, the request's own and in token order whatever the order of simulation, never a
negative gap."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

from splitserve.planner.simulate.gap_spread import TABLE_SIZE, GapSpread

SPREAD = (-0.004, 0.0, 0.0, 0.002, 0.010)


def test_each_gap_moves_by_a_deviation_of_the_spread() -> None:
    spread = GapSpread(SPREAD)
    gaps = [0.02] * 500
    moved = spread.client_gaps_s(7, gaps)
    assert len(moved) == 500 and all(isinstance(gap, float) for gap in moved)
    assert {round(gap - 0.02, 9) for gap in moved} <= {round(d, 9) for d in SPREAD}


def test_a_request_gets_the_same_deviations_every_time_and_others_get_others() -> None:
    first, again = GapSpread(SPREAD), GapSpread(SPREAD)
    assert list(first.deviations(41, 64)) == list(again.deviations(41, 64))
    assert list(first.deviations(41, 64)) != list(first.deviations(42, 64))
    # A request's first n deviations do not depend on how many it draws: its tokens come in order.
    assert list(first.deviations(41, 10)) == list(first.deviations(41, 64))[:10]


def test_deviations_follow_the_spreads_frequencies() -> None:
    spread = GapSpread(SPREAD)
    drawn = np.concatenate([spread.deviations(request_id, 64) for request_id in range(2000)])
    counts = Counter(np.round(drawn, 9).tolist())
    for value, share in ((0.0, 0.4), (-0.004, 0.2), (0.010, 0.2)):
        assert counts[round(value, 9)] / len(drawn) == pytest.approx(share, abs=0.01)


def test_a_stretch_past_the_tables_end_wraps_to_its_start() -> None:
    spread = GapSpread(SPREAD)
    starts = ((r, (r * 0x9E3779B1) % TABLE_SIZE) for r in range(4_000_000))
    request_id = next(r for r, start in starts if start > TABLE_SIZE - 20)
    start = (request_id * 0x9E3779B1) % TABLE_SIZE
    wrapped = spread.deviations(request_id, 20)
    table = spread.deviations(0, TABLE_SIZE)  # request 0 starts at 0: the whole table
    expected = [table[(start + i) % TABLE_SIZE] for i in range(20)]
    assert list(wrapped) == expected


def test_no_gap_goes_below_zero() -> None:
    spread = GapSpread((-0.05,))
    assert spread.client_gaps_s(3, [0.01, 0.06]) == pytest.approx([0.0, 0.01])


def test_an_empty_spread_is_refused() -> None:
    with pytest.raises(ValueError, match="at least one"):
        GapSpread(())
