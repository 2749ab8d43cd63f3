"""`ThreadTuner`: the thread count a step runs with follows what the steps measured.

Steps are fed as `StepResult`s with chosen durations (what a quiet machine and one with a
taken core measure), and each expectation is exact."""

from __future__ import annotations

import pytest
import torch

from splitserve import LLM
from splitserve.engine.request import Request
from splitserve.engine.sampling_params import SamplingParams
from splitserve.engine.step import ModelOutput, ScheduledChunk, SchedulerOutput, StepResult
from splitserve.engine.thread_tuner import EXPLORE_MAX, EXPLORE_MIN, ThreadTuner


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


def tries(chosen: list[int], count: int) -> list[int]:
    """The 1-based steps (past the first two) that ran with `count` threads."""
    return [i + 1 for i, n in enumerate(chosen) if n == count and i > 1]


def test_tries_each_count_then_keeps_the_faster_and_tries_less_often_while_it_loses():
    tuner = ThreadTuner(2)
    sched = decode_step(4)
    quiet = {2: 0.020, 1: 0.030}
    chosen = [run(tuner, sched, quiet) for _ in range(200)]
    assert chosen[:2] == [2, 1]  # all threads first, then one
    # Each losing try doubles the wait before the next one, up to EXPLORE_MAX.
    expected, step, interval = [], EXPLORE_MIN, EXPLORE_MIN
    while step <= 200:
        expected.append(step)
        interval = min(2 * interval, EXPLORE_MAX)
        step += interval
    assert tries(chosen, 1) == expected


def test_a_slow_step_now_and_then_does_not_move_the_choice():
    """A burst of another process (a prefill pod sharing the cores) slows one step in a few;
    the median of the last steps keeps the faster count."""
    tuner = ThreadTuner(2)
    sched = decode_step(16)
    chosen = []
    for i in range(100):
        spike = i % 7 == 3  # one step in seven caught in a burst
        chosen.append(run(tuner, sched, {2: 0.130 if spike else 0.028, 1: 0.043}))
    assert chosen[2:].count(2) > 90


def test_switches_to_one_thread_when_a_core_is_taken_and_back_when_it_is_free():
    tuner = ThreadTuner(2)
    sched = decode_step(4)
    for _ in range(20):
        run(tuner, sched, {2: 0.020, 1: 0.030})
    busy = {2: 0.150, 1: 0.032}  # another process took a core
    chosen = [run(tuner, sched, busy) for _ in range(EXPLORE_MAX)]
    # Switched within a median window plus the wait for the next try.
    first_one = chosen.index(1)
    assert first_one < 2 * EXPLORE_MIN + 3
    # From then on one thread, but for tries of two that grow rarer while they lose.
    later = [run(tuner, sched, busy) for _ in range(4 * EXPLORE_MAX)]
    assert later.count(2) <= 6
    quiet_again = {2: 0.020, 1: 0.030}
    chosen = [run(tuner, sched, quiet_again) for _ in range(EXPLORE_MAX + 1)]
    back = chosen.index(2)  # the next try of two wins and brings it back
    assert all(n == 2 for n in chosen[back:][:EXPLORE_MIN])


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


def test_a_computing_neighbor_gets_its_threads_and_those_steps_teach_nothing():
    """While a neighbor says it computes with one thread, steps take what it leaves (one of
    two) whatever the tuner had learned, and are not recorded: once it stops, the tuner picks
    as it did before, not from steps measured under its load."""
    tuner = ThreadTuner(2)
    sched = decode_step(4)
    quiet = {2: 0.020, 1: 0.030}
    for _ in range(3):
        run(tuner, sched, quiet)
    busy_neighbor = [0]
    tuner.neighbor_threads = lambda: busy_neighbor[0]
    busy_neighbor[0] = 1
    # Under the neighbor, one thread is slow as measured here; it must not be learned.
    assert [run(tuner, sched, {2: 0.120, 1: 0.090}) for _ in range(20)] == [1] * 20
    busy_neighbor[0] = 0
    assert run(tuner, sched, quiet) == 2
    busy_neighbor[0] = 5  # more than there are: at least one thread stays
    assert run(tuner, sched, quiet) == 1


def test_a_decode_pod_counts_the_prefill_pods_computing_its_prompts():
    """The neighbor signal of a decode pod: prefill pods with prompt tokens of ours in flight."""
    from splitserve.decode.remote_prefill import PrefillClient, RemotePrefillSettings

    client = PrefillClient(receiver=None, transport="tcp", timeout_s=1.0)  # type: ignore[arg-type]
    assert client.num_busy_prefill_pods() == 0
    with client.counted_in_flight("p0:1", 256), client.counted_in_flight("p1:1", 64):
        assert client.num_busy_prefill_pods() == 2
        with client.counted_in_flight("p0:1", 100):
            assert client.num_busy_prefill_pods() == 2
    with client.counted_in_flight("p1:1", 10):
        assert client.num_busy_prefill_pods() == 1
    assert client.num_busy_prefill_pods() == 0
    with pytest.raises(ValueError, match="neighbor_prefill_threads must be >= 0"):
        RemotePrefillSettings(neighbor_prefill_threads=-1)


def test_each_engine_in_a_process_steps_with_its_own_thread_count(make_tiny_hf_checkpoint):
    """torch's thread count is the process's: an engine resets it to its own before each step,
    whatever another engine in the process set since."""
    checkpoint = make_tiny_hf_checkpoint()
    threads = torch.get_num_threads()
    one = LLM(checkpoint, num_threads=1, adaptive_threads=False, kv_cache_bytes=2**22)
    two = LLM(checkpoint, num_threads=2, adaptive_threads=False, kv_cache_bytes=2**22)
    seen: list[int] = []
    for llm in (one, two):
        execute = llm.engine.runner.execute

        def counting(*args, execute=execute, **kwargs):
            seen.append(torch.get_num_threads())
            return execute(*args, **kwargs)

        llm.engine.runner.execute = counting
    try:
        params = SamplingParams(max_tokens=2, temperature=0.0)
        for llm, count in ((two, 2), (one, 1), (two, 2), (one, 1)):
            seen.clear()
            llm.generate([[1, 2, 3, 4]], params)
            assert seen and set(seen) == {count}
    finally:
        torch.set_num_threads(threads)
