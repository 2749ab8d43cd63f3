"""The simulated gateway's kept ranking of load terms against ranking them anew."""

from __future__ import annotations

import heapq
import random

from splitserve.planner.simulate.load_ranking import LoadRanking


def _nlargest_positions(terms: list[float], count: int) -> list[int]:
    """What the real router's shortlist takes: highest terms, ties to the earlier pod."""
    return heapq.nlargest(count, range(len(terms)), key=terms.__getitem__)


def test_updates_and_polls_keep_the_ranking_of_ranking_anew() -> None:
    rng = random.Random(4)
    ranking = LoadRanking(300)
    # Few distinct values, so that ties decide many places.
    ranking.set_all([rng.choice((0.1, 0.2, 0.5, 1.0)) for _ in range(300)])
    for round_number in range(2000):
        if round_number % 500 == 499:  # a poll: every term anew
            ranking.set_all([rng.choice((0.1, 0.2, 0.5, 1.0)) for _ in range(300)])
        else:  # a dispatch: one pod's term
            ranking.update(rng.randrange(300), rng.choice((0.1, 0.2, 0.3, 0.5, 1.0)))
        assert ranking.least_loaded(16) == _nlargest_positions(ranking.terms, 16)


def test_a_fresh_ranking_lists_the_first_pods_of_equal_terms() -> None:
    ranking = LoadRanking(40)
    assert ranking.least_loaded(5) == [0, 1, 2, 3, 4]
    ranking.update(7, 2.0)
    assert ranking.least_loaded(3) == [7, 0, 1]
