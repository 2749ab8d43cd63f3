"""What one engine step costs on this machine, fitted online over the recent steps: a step
observer (`StepCostsFit`) that a pod reads for its stats.

    step ms ~= base_ms + row_ms * decode rows + prefill_token_ms * prefill tokens

Decode rows are the step's chunks that compute only a request's newest token (and its drafts);
prefill tokens are every token of the other chunks (prompt chunks, and a preempted request's
recomputation). A step's milliseconds are its forward pass plus the time since the previous
step ended, when the engine went straight on (that gap is no longer than the forward): what a
running stream waits per step, not only the forward.

The fit is exponentially weighted least squares: each step adds to nine running sums and older
steps fade (half-life `half_life_steps`), so the line follows the machine as its load and
thread count change. The 3x3 normal equations are solved only when the costs are read.

A small ridge pulls the two slopes (never the base) toward zero, so a pod that has only ever
decoded, or always with the same number of rows, still gets a sane line: the prefill slope stays
0 where no prefill was seen, and a constant row count is put in the base, not split between
base and row. Coefficients are never negative (a slope the data pull below 0 is fixed at 0 and
the rest is fitted again).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from splitserve.engine.core import EngineCore
    from splitserve.engine.step import SchedulerOutput, StepResult

# Steps seen before the fit reports anything. The ridge keeps a line from few shapes sane (what
# the steps leave open goes to the base), so this is only enough that one odd step (a pod's
# cold first) is not the whole line. More is blindness: a prefill pod computes a 512-token step
# in 1-2 s on a 2-core EPYC, and at 8 steps a fresh 1P+1D stack under a burst admitted without
# any prediction for its first 30 s (TTFTs up to 23 s against a 3 s objective).
MIN_STEPS = 3
# Weight of a step after this many later steps: 1/2 (a few seconds of a busy pod's steps).
HALF_LIFE_STEPS = 500.0
# The slopes' ridge, per unit of weight seen: as if a small share of the steps had said
# "this slope is 0" at one row / one token, which decides only what the data leave open.
RIDGE = 1e-3

# The running sums, by index: weight, then w*x for x in (rows, tokens, rows^2, rows*tokens,
# tokens^2), then w*y, w*rows*y, w*tokens*y.
_W, _R, _P, _RR, _RP, _PP, _Y, _RY, _PY = range(9)


@dataclass(frozen=True)
class FittedStepCosts:
    """The fitted line, in milliseconds; all zeros until MIN_STEPS steps were seen."""

    base_ms: float = 0.0
    row_ms: float = 0.0
    prefill_token_ms: float = 0.0
    num_steps: int = 0  # steps observed (all of them, however faded)

    def step_ms(self, num_rows: int, num_prefill_tokens: int = 0) -> float:
        return self.base_ms + self.row_ms * num_rows + self.prefill_token_ms * num_prefill_tokens


class StepCostsFit:
    """A `StepObserver`: `observe` runs on the engine thread (a few float operations a step);
    `costs()` may be called from any thread. The sums are one tuple replaced whole each step,
    so a reader never sees half a step."""

    def __init__(
        self,
        half_life_steps: float = HALF_LIFE_STEPS,
        ridge: float = RIDGE,
        min_steps: int = MIN_STEPS,
    ) -> None:
        if half_life_steps <= 0:
            raise ValueError(f"half_life_steps must be > 0, got {half_life_steps}")
        self._decay = 0.5 ** (1.0 / half_life_steps)
        self._ridge = ridge
        self._min_steps = min_steps
        self._sums: tuple[float, ...] = (0.0,) * 9
        self._num_steps = 0
        self._last_end_time = float("-inf")  # the previous step's (engine thread only)

    def observe(self, step: StepResult) -> None:
        num_rows, num_prefill_tokens = step_shape(step.sched)
        seconds = step.seconds
        gap = step.start_time - self._last_end_time
        # Straight on from the previous step: the scheduling, sampling bookkeeping and output
        # work between two forwards is part of what a step costs a stream. A longer gap is
        # the engine idling (waiting for requests), which is not.
        if 0.0 <= gap <= seconds:
            seconds += gap
        self._last_end_time = step.end_time
        self.add(num_rows, num_prefill_tokens, seconds * 1000.0)

    def add(self, num_rows: int, num_prefill_tokens: int, step_ms: float) -> None:
        """One step's shape and its measured milliseconds."""
        r, p, y, d = float(num_rows), float(num_prefill_tokens), step_ms, self._decay
        s = self._sums
        self._sums = (
            s[_W] * d + 1.0,
            s[_R] * d + r,
            s[_P] * d + p,
            s[_RR] * d + r * r,
            s[_RP] * d + r * p,
            s[_PP] * d + p * p,
            s[_Y] * d + y,
            s[_RY] * d + r * y,
            s[_PY] * d + p * y,
        )
        self._num_steps += 1

    def costs(self) -> FittedStepCosts:
        """The line through the recent steps (zeros before MIN_STEPS steps)."""
        num_steps = self._num_steps
        if num_steps < self._min_steps:
            return FittedStepCosts(num_steps=num_steps)
        base, row, token = _fit(self._sums, self._ridge)
        return FittedStepCosts(base, row, token, num_steps)


def step_shape(sched: SchedulerOutput) -> tuple[int, int]:
    """(decode rows, prefill tokens) of one step."""
    num_rows = num_prefill_tokens = 0
    for chunk in sched.chunks:
        if chunk.is_decode:
            num_rows += 1
        else:
            num_prefill_tokens += chunk.num_tokens
    return num_rows, num_prefill_tokens


def fit_step_costs(engine: EngineCore) -> StepCostsFit:
    """A fit fed by every forward pass of `engine` from now on."""
    fit = StepCostsFit()
    engine.step_observers.append(fit)
    return fit


def _fit(s: tuple[float, ...], ridge: float) -> tuple[float, float, float]:
    """Solves the ridge-regularised normal equations for (base, row, token), keeping every
    coefficient >= 0: a slope that comes out negative is fixed at 0 and the others refitted."""
    penalty = ridge * s[_W]
    gram = [
        [s[_W], s[_R], s[_P]],
        [s[_R], s[_RR] + penalty, s[_RP]],
        [s[_P], s[_RP], s[_PP] + penalty],
    ]
    rhs = [s[_Y], s[_RY], s[_PY]]
    active = [0, 1, 2]
    while True:
        solution = _solve([[gram[i][j] for j in active] for i in active], [rhs[i] for i in active])
        coefficients = [0.0, 0.0, 0.0]
        for index, value in zip(active, solution, strict=True):
            coefficients[index] = value
        negative = [i for i in active[1:] if coefficients[i] < 0]
        if not negative:
            break
        active.remove(min(negative, key=lambda i: coefficients[i]))
    base, row, token = coefficients
    return max(base, 0.0), row, token


def _solve(a: list[list[float]], b: list[float]) -> list[float]:
    """Gaussian elimination with partial pivoting for a small symmetric positive system; a
    (near-)singular direction gets 0 (the base column alone is singular only with no steps)."""
    n = len(b)
    a = [row[:] + [b[i]] for i, row in enumerate(a)]
    for col in range(n):
        pivot = max(range(col, n), key=lambda r: abs(a[r][col]))
        a[col], a[pivot] = a[pivot], a[col]
        if abs(a[col][col]) < 1e-12:
            continue
        for r in range(col + 1, n):
            factor = a[r][col] / a[col][col]
            for c in range(col, n + 1):
                a[r][c] -= factor * a[col][c]
    x = [0.0] * n
    for i in reversed(range(n)):
        if abs(a[i][i]) < 1e-12:
            continue
        x[i] = (a[i][n] - sum(a[i][j] * x[j] for j in range(i + 1, n))) / a[i][i]
    return x
