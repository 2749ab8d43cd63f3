"""The serving path's measured token-gap deviations, added to a finished request's step gaps.

A profile measured through the stack carries how its token gaps spread around their median
(`ServingCosts.itl_spread_s`); the simulator adds one deviation drawn from that spread to each
simulated gap. The draws must not depend on the order the pods' steps were simulated in (a
decode run and step-by-step simulation give the same gaps), so each request reads its own
stretch of one table drawn once per spread: request r's token i takes table[start(r) + i],
start(r) a multiplicative hash of its id. At 300,000 requests of 64 tokens a seeded
`random.Random` per request took about a tenth of a 10-minute trace's simulation; a slice of
a table and one vectorised add take a fraction of that.
"""

from __future__ import annotations

import functools

import numpy as np

TABLE_SIZE = 1 << 20  # deviations per table: far more than any request's token count
_SEED = 20261128  # fixed: a simulation is reproducible run to run
_GOLDEN = 0x9E3779B1  # Knuth's multiplicative hash spreads consecutive ids over the table


@functools.lru_cache(maxsize=8)
def _table(spread_s: tuple[float, ...]) -> np.ndarray:
    """Drawn once per spread (~60 ms, 8 MiB): sizing and the autoscaler run many small
    simulations of one profile, and each would otherwise draw it again."""
    rng = np.random.default_rng(_SEED)
    table = rng.choice(np.asarray(spread_s, dtype=np.float64), size=TABLE_SIZE)
    table.flags.writeable = False  # shared by every simulation of this spread
    return table


class GapSpread:
    """Adds a request's deviations to its gaps, clipped at zero as a client's clock is."""

    def __init__(self, spread_s: tuple[float, ...]) -> None:
        if not spread_s:
            raise ValueError("a gap spread needs at least one deviation")
        self._table = _table(tuple(spread_s))

    def deviations(self, request_id: int, count: int) -> np.ndarray:
        """Request `request_id`'s first `count` deviations, in token order (read-only)."""
        start = (request_id * _GOLDEN) % TABLE_SIZE
        if start + count <= TABLE_SIZE:
            return self._table[start : start + count]
        return np.take(self._table, np.arange(start, start + count), mode="wrap")

    def client_gaps_s(self, request_id: int, step_gaps_s: list[float]) -> list[float]:
        """The gaps a client would time: each step gap plus its deviation, never negative."""
        deviations = self.deviations(request_id, len(step_gaps_s))
        gaps = np.asarray(step_gaps_s, dtype=np.float64) + deviations
        return np.maximum(gaps, 0.0).tolist()
