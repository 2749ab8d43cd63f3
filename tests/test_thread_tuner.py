"""`ThreadTuner`: the thread count a step runs with follows what the steps measured.

Steps are fed as `StepResult`s with chosen durations (what a quiet machine and one with a
taken core measure), and each expectation is exact."""

from __future__ import annotations

import pytest

from shared.request import Request
from shared.sampling_params import SamplingParams
from shared.step import ModelOutput, ScheduledChunk, SchedulerOutput, StepResult
from shared.thread_tuner import EXPLORE_EVERY, ThreadTuner


def decode_step(batch: int) -> SchedulerOutput:
    chunks = []
    for i in range(batch):
        request = Request(f"r{i}", [1, 2, 3], SamplingParams())
        request.num_computed_tokens = 2
        chunks.append(ScheduledChunk(request, 2, 1, [0], is_sampled=True))
    return SchedulerOutput(chunks)


def run(tuner: ThreadTuner, sched: SchedulerOutput, seconds_by_threads: dict[int, float]):
    """One step: the tuner's choice, timed as `seconds_by_threads` says it takes."""
    threads = tuner.choose(sched)
    tuner.observe(StepResult(sched, ModelOutput({}), 0.0, seconds_by_threads[threads]), threads)
    return threads


def test_tries_each_count_then_keeps_the_faster_and_explores_now_and_then():
    tuner = ThreadTuner(2)
    sched = decode_step(4)
    quiet = {2: 0.020, 1: 0.030}
    chosen = [run(tuner, sched, quiet) for _ in range(2 * EXPLORE_EVERY)]
    assert chosen[:2] == [2, 1]  # all threads first, then one
    explored = [i + 1 for i, n in enumerate(chosen) if n == 1 and i > 1]
    assert explored == [EXPLORE_EVERY, 2 * EXPLORE_EVERY]  # one try of the slower count each


def test_switches_to_one_thread_when_a_core_is_taken_and_back_when_it_is_free():
    tuner = ThreadTuner(2)
    sched = decode_step(4)
    for _ in range(EXPLORE_EVERY):
        run(tuner, sched, {2: 0.020, 1: 0.030})
    busy = {2: 0.150, 1: 0.032}  # another process took a core
    chosen = [run(tuner, sched, busy) for _ in range(EXPLORE_EVERY)]
    # Switched within EXPLORE_EVERY steps; from then on one thread but for one try of two.
    assert chosen.index(1) < EXPLORE_EVERY
    later = [run(tuner, sched, busy) for _ in range(EXPLORE_EVERY)]
    assert later.count(1) == EXPLORE_EVERY - 1
    quiet_again = {2: 0.020, 1: 0.030}
    chosen = [run(tuner, sched, quiet_again) for _ in range(EXPLORE_EVERY)]
    assert chosen.index(2) < EXPLORE_EVERY  # the next try of two brings it back
    later = [run(tuner, sched, quiet_again) for _ in range(EXPLORE_EVERY)]
    assert later.count(2) == EXPLORE_EVERY - 1


def test_shapes_are_measured_apart():
    """A batch of 16 may want all threads while a batch of 1 wants one."""
    tuner = ThreadTuner(4)
    small, large = decode_step(1), decode_step(16)
    for _ in range(3):
        run(tuner, small, {4: 0.030, 1: 0.020})
        run(tuner, large, {4: 0.040, 1: 0.090})
    assert tuner.choose(small) == 1
    assert tuner.choose(large) == 4


def test_needs_two_counts_to_choose_from():
    with pytest.raises(ValueError, match="max_threads"):
        ThreadTuner(1)
