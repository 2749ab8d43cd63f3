"""`StepCostsFit`, a pod's online fit of what an engine step costs: fed synthetic steps on a
known line, it recovers the line; a pod that only ever decoded gets a sane one."""

from __future__ import annotations

import dataclasses
import random

import pytest

from splitserve.common.step_costs import StepCosts
from splitserve.engine.core import EngineStats
from splitserve.engine.request import Request
from splitserve.engine.sampling_params import SamplingParams
from splitserve.engine.step import ModelOutput, ScheduledChunk, SchedulerOutput, StepResult
from splitserve.engine.step_costs_fit import MIN_STEPS, StepCostsFit, step_shape
from splitserve.pod.server import PodIdentity, PodStats, pod_stats_to_proto

BASE_MS, ROW_MS, TOKEN_MS = 12.0, 0.5, 0.05


def _step(
    num_rows: int, prefill_chunks: list[int], milliseconds: float, start: float = 100.0
) -> StepResult:
    """A step of `num_rows` decode chunks and one prompt chunk per entry of `prefill_chunks`
    (its token count), that started at `start` (seconds) and took `milliseconds`."""
    chunks = []
    for i in range(num_rows):
        request = Request(f"d{i}", [1, 2, 3], SamplingParams())
        chunks.append(ScheduledChunk(request, 2, 1, [0], is_sampled=True))
    for i, num_tokens in enumerate(prefill_chunks):
        request = Request(f"p{i}", [1] * num_tokens, SamplingParams())
        chunks.append(ScheduledChunk(request, 0, num_tokens, [0], is_sampled=True))
    return StepResult(SchedulerOutput(chunks), ModelOutput({}), start, start + milliseconds / 1e3)


def _line(num_rows: int, num_tokens: int) -> float:
    return BASE_MS + ROW_MS * num_rows + TOKEN_MS * num_tokens


def test_the_shape_of_a_step_counts_decode_rows_and_prefill_tokens():
    sched = _step(3, [40, 7], 1.0).sched
    assert step_shape(sched) == (3, 47)


def test_the_fit_recovers_a_known_line_through_mixed_steps():
    rng = random.Random(0)
    fit = StepCostsFit()
    for _ in range(300):
        num_rows = rng.randint(0, 64)
        prefill = [rng.randint(1, 256)] if rng.random() < 0.3 else []
        noise = rng.gauss(0.0, 0.05)
        fit.observe(_step(num_rows, prefill, _line(num_rows, sum(prefill)) + noise))
    costs = fit.costs()
    assert costs.num_steps == 300
    assert costs.base_ms == pytest.approx(BASE_MS, rel=0.02)
    assert costs.row_ms == pytest.approx(ROW_MS, rel=0.05)
    assert costs.prefill_token_ms == pytest.approx(TOKEN_MS, rel=0.05)
    assert costs.step_ms(10, 100) == pytest.approx(_line(10, 100), rel=0.02)


def test_nothing_is_reported_before_enough_steps():
    fit = StepCostsFit()
    for i in range(MIN_STEPS - 1):
        fit.add(i + 1, 0, _line(i + 1, 0))
    assert (fit.costs().base_ms, fit.costs().row_ms, fit.costs().num_steps) == (0, 0, MIN_STEPS - 1)
    fit.add(3, 0, _line(3, 0))
    assert fit.costs().base_ms == pytest.approx(BASE_MS, rel=0.01)


def test_a_pod_that_only_decoded_gets_base_and_row_costs_and_no_prefill_cost():
    fit = StepCostsFit()
    for step in range(50):
        num_rows = 1 + step % 16
        fit.add(num_rows, 0, _line(num_rows, 0))
    costs = fit.costs()
    assert costs.base_ms == pytest.approx(BASE_MS, rel=0.01)
    assert costs.row_ms == pytest.approx(ROW_MS, rel=0.02)
    assert costs.prefill_token_ms == 0.0


def test_a_constant_row_count_goes_into_the_base():
    """One row every step cannot tell base from row: the ridge leaves the time in the base,
    so more rows are never predicted to cost as much as the first."""
    fit = StepCostsFit()
    for _ in range(40):
        fit.add(1, 0, 10.0)
    costs = fit.costs()
    assert costs.step_ms(1) == pytest.approx(10.0, rel=0.01)
    assert costs.row_ms < 0.1 * costs.base_ms
    assert costs.prefill_token_ms == 0.0


def test_coefficients_are_never_negative():
    fit = StepCostsFit()
    for step in range(40):
        num_rows = step % 8
        fit.add(num_rows, 0, 20.0 - 1.0 * num_rows)  # more rows, faster: noise, not physics
    costs = fit.costs()
    assert costs.row_ms == 0.0
    assert costs.base_ms == pytest.approx(16.5, rel=0.05)  # the mean step


def test_old_steps_fade():
    fit = StepCostsFit(half_life_steps=20)
    for step in range(200):
        fit.add(1 + step % 8, 0, 100.0 + 1.0 * (1 + step % 8))  # a slow machine at first
    for step in range(400):
        num_rows = 1 + step % 8
        fit.add(num_rows, 0, _line(num_rows, 0))
    assert fit.costs().base_ms == pytest.approx(BASE_MS, rel=0.01)


def test_the_pod_reports_every_step_cost_in_its_stats():
    costs = StepCosts(step_base_ms=1.5, step_row_ms=0.25, step_prefill_token_ms=0.01)
    costs = dataclasses.replace(costs, max_num_seqs=8, max_num_batched_tokens=256)
    identity = PodIdentity("d-0", "decode", "m", "tcp")
    engine = EngineStats(0, 0, 10, 10, 0, 0, 0)
    stats = PodStats(identity, engine, 128, 16, 100, step_costs=costs)
    assert StepCosts.from_proto(pod_stats_to_proto(stats)) == costs


def test_the_work_between_steps_counts_and_idle_time_does_not():
    busy, idle = StepCostsFit(), StepCostsFit()
    busy_start = idle_start = 0.0
    for step in range(40):
        num_rows = 1 + step % 4
        forward_ms = _line(num_rows, 0)
        busy.observe(_step(num_rows, [], forward_ms, busy_start))
        idle.observe(_step(num_rows, [], forward_ms, idle_start))
        busy_start += (forward_ms + 2.0) / 1e3  # 2 ms of scheduling and output work
        idle_start += (forward_ms + 500.0) / 1e3  # waiting half a second for requests
    assert busy.costs().step_ms(2) == pytest.approx(_line(2, 0) + 2.0, rel=0.01)
    assert idle.costs().step_ms(2) == pytest.approx(_line(2, 0), rel=0.01)


def test_a_prefill_pods_first_full_steps_price_its_backlog_at_once():
    """A prefill pod under a burst runs only full steps, a second or two each on a slow CPU:
    its line must be there after its first few, with the one shape it has seen in the base
    (a blind pod gives admission control nothing to predict a TTFT by)."""
    fit = StepCostsFit()
    for _ in range(3):
        fit.add(0, 512, 1500.0)
    costs = fit.costs()
    assert costs.step_ms(0, 512) == pytest.approx(1500.0, rel=0.01)
    assert (costs.row_ms, costs.base_ms) == (0.0, pytest.approx(1500.0, rel=0.01))
