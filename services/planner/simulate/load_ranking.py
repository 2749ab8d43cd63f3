"""A pool's pods ranked by the routing load term, kept sorted as terms change.

The simulated gateway shortlists the least loaded pods at every arrival (the real router's
`shortlist_positions`); ranking 700 terms anew each time was a sixth of a 1,000-pod
simulation. Here a dispatch moves one pod in a sorted list (a bisect and a C-level insert) and
a poll re-sorts the pool once; the least loaded are the list's head. Order: higher term first,
then the earlier pod, as `heapq.nlargest` breaks ties in the real router.
"""

from __future__ import annotations

import bisect


class LoadRanking:
    def __init__(self, num_pods: int) -> None:
        self.terms = [0.0] * num_pods
        self._ranked = [(-0.0, position) for position in range(num_pods)]

    def update(self, position: int, term: float) -> None:
        old = (-self.terms[position], position)
        del self._ranked[bisect.bisect_left(self._ranked, old)]
        self.terms[position] = term
        bisect.insort(self._ranked, (-term, position))

    def set_all(self, terms: list[float]) -> None:
        self.terms = list(terms)
        self._ranked = sorted((-term, position) for position, term in enumerate(terms))

    def least_loaded(self, count: int) -> list[int]:
        """Positions of the `count` highest terms (the least loaded pods)."""
        return [position for _, position in self._ranked[:count]]
