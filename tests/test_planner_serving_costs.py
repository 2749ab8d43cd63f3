"""`plan profile --serving`: the serving path's costs measured on a real local stack."""

from __future__ import annotations

import pytest

from splitserve.planner.measure.local_stacks import (
    COLOCATED_1,
    completions_target,
    running_stack,
    warm_up,
)
from splitserve.planner.measure.serving import fit_nonnegative_line, measure_costs
from splitserve.planner.profile import synthetic_profile
from splitserve.planner.profile.parts import SPREAD_QUANTILES


@pytest.mark.slow  # a whole stack: about a minute
def test_serving_costs_fill_the_gap_to_a_running_stack() -> None:
    # A bare profile far cheaper than any real step (1 ms prefill, 1 ms decode): whatever the
    # machine's speed, the running stack is slower, so every cost must come out positive, and
    # the fitted per-step cost must carry the simulated ITL up to the measured one.
    bare = synthetic_profile(0.001, decode_step_s=0.001)
    with running_stack(COLOCATED_1) as stack:
        target = completions_target(stack)
        warm_up(target, 0)
        costs = measure_costs(target, COLOCATED_1, bare, seed=0)
    # The bare profile's prefill does not grow with the prompt; the stack's does, so the gap
    # before the first token has a per-prompt-token part, and a short prompt still costs time.
    assert costs.token_s > 0
    assert costs.request_s + 96 * costs.token_s > 0
    assert costs.step_s + costs.row_s > 0.005  # a real decode step is milliseconds at least
    assert costs.request_s + 512 * costs.token_s < 5.0  # not a stack that hung
    # The gaps' spread: equally likely deviations around each request's median gap, so about
    # half below 0 and half above, and some real spread (a running stack is never that still).
    spread = costs.itl_spread_s
    assert len(spread) == SPREAD_QUANTILES and list(spread) == sorted(spread)
    assert spread[0] <= 0 <= spread[-1] and spread[-1] - spread[0] > 1e-4


def test_the_serving_cost_line_passes_between_its_points() -> None:
    # Both gaps on a line with non-negative intercept and slope: the line through them.
    step_s, row_s = fit_nonnegative_line([(1, 0.003), (4, 0.006)])
    assert (step_s, row_s) == pytest.approx((0.002, 0.001))
    # The bare engine measured 1 ms slow at one row, 8 ms fast at four. The line through both
    # points has a negative intercept; clipping it to 0 kept the slope (3 ms a row) and put
    # the costs 4 ms above both points. The fit keeps the intercept at 0 and lands between.
    points = [(1, -0.001), (4, 0.008)]
    step_s, row_s = fit_nonnegative_line(points)
    assert step_s == 0.0 and 0 < row_s < 0.003
    residuals = [step_s + row_s * rows - gap for rows, gap in points]
    assert min(residuals) < 0 < max(residuals)
