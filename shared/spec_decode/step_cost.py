"""What a forward pass costs by the number of rows (tokens) it computes, measured as the engine
runs: the price side of deciding how many draft tokens to verify.

On a GPU, verifying 8 extra tokens costs next to nothing until the batch is compute-bound; on
a CPU one thread's matmul over 4-8 rows already costs about twice a 1-row decode, and the shape
of the curve depends on the BLAS kernels (8 rows can cost less than 9 by a wide margin). So the
curve is measured, not assumed: each decode-only step reports (rows, seconds), and a row count
never seen is priced optimistically from its measured neighbours, which makes the policy try it
once and learn its real price.
"""

from __future__ import annotations

import bisect

# Weight of the past in each row count's moving average.
_DECAY = 0.8
# Price of one more row, relative to the nearest measured smaller batch, before it is measured.
# Deliberately low: an unmeasured shape gets tried, then priced for real.
OPTIMISTIC_ROW_COST = 0.05


class StepCostModel:
    """Seconds of a decode-only forward by its row count. Engine-thread only."""

    def __init__(self) -> None:
        self._seconds: dict[int, float] = {}  # rows -> moving average of measured seconds
        self._measured_rows: list[int] = []  # sorted keys of _seconds

    def observe(self, num_rows: int, seconds: float) -> None:
        assert num_rows >= 1 and seconds >= 0.0, f"bad step measurement {num_rows}, {seconds}"
        previous = self._seconds.get(num_rows)
        if previous is None:
            bisect.insort(self._measured_rows, num_rows)
            self._seconds[num_rows] = seconds
        else:
            self._seconds[num_rows] = _DECAY * previous + (1 - _DECAY) * seconds

    def is_measured(self, num_rows: int) -> bool:
        return num_rows in self._seconds

    def cost(self, num_rows: int) -> float:
        """Estimated seconds for `num_rows` rows (a relative unit until anything is measured:
        then 1 row costs 1)."""
        if num_rows in self._seconds:
            return self._seconds[num_rows]
        rows = self._measured_rows
        index = bisect.bisect_left(rows, num_rows)
        below = rows[index - 1] if index > 0 else None
        above = rows[index] if index < len(rows) else None
        if below is None:
            if above is None:
                return 1.0 + OPTIMISTIC_ROW_COST * (num_rows - 1)
            # Fewer rows never cost more than more rows.
            return self._seconds[above] * num_rows / above
        optimistic = self._seconds[below] * (1.0 + OPTIMISTIC_ROW_COST * (num_rows - below))
        if above is None:
            return optimistic
        span = (num_rows - below) / (above - below)
        interpolated = self._seconds[below] + span * (self._seconds[above] - self._seconds[below])
        return min(optimistic, interpolated)
