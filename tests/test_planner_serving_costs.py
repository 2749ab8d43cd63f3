"""`plan profile --serving`: the serving path's costs measured on a real local stack."""

from __future__ import annotations

import pytest

from splitserve.planner.measure.engine_steps import load_engine
from splitserve.planner.measure.local_stacks import (
    COLOCATED_1,
    completions_target,
    running_stack,
    warm_up,
)
from splitserve.planner.measure.pace import EnginePace
from splitserve.planner.measure.profiler import measure_profile
from splitserve.planner.measure.serving import fit_nonnegative_line, measure_costs
from splitserve.planner.measure.settings import ProfileSettings
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
        costs = measure_costs(stack, COLOCATED_1, bare, seed=0)
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


@pytest.mark.slow  # a profile of the real engine, then a whole stack: about three minutes
def test_costs_paced_by_the_engine_beside_them_do_not_carry_its_drift() -> None:
    # The profile of the stack's own engine (SmolLM2, one thread), then taken twice as fast:
    # a profile from a minute the machine ran at double speed. Against the profile alone the
    # stack's TTFT would be half a prefill beyond it; against the engine timed beside each
    # request only the serving path remains, a small part of a step.
    settings = ProfileSettings(
        prefill_lens=(16, 128, 512),
        batch_sizes=(1, 4),
        context_lens=(64, 512),
        mixed_batch_sizes=(),
        repeats=1,
    )
    engine = load_engine(settings, lambda line: None)
    profile = measure_profile(settings, lambda line: None, engine=engine)
    fast = profile.at_pace(0.5, 0.5)
    with running_stack(COLOCATED_1) as stack:
        target = completions_target(stack)
        warm_up(target, 0)
        costs = measure_costs(stack, COLOCATED_1, fast, 0, lambda line: None, EnginePace(engine))
    assert costs.request_s + 98 * costs.token_s < 0.25 * profile.prefill_s(98)
    assert costs.step_s + costs.row_s < 0.25 * profile.decode.step_s(1, 100)
    assert costs.engine_scale == 1.0  # the engine ran slower than this profile: no correction


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
