"""Decode steps a pod runs back to back with the same rows, simulated as one event.

A decode pod with no request waiting and every row decoding repeats the same step until one of
its rows finishes or something reaches the pod (an arrival, pages landing, a reservation, a pod
failure): each step one token per row, a context one token longer, blocks taken as rows cross
a block boundary. At 1,000 lightly loaded pods such steps are most of a simulation's events
(about 50 per request), each a heap push and pop, a schedule and a step-cost lookup. A run plans
them at once: their durations and ends, and one event at the end of the last; what happens to
the pod meanwhile first brings the run up to that instant (`Simulation._settle`: the steps that
ended give their tokens, with the same times and block accounting a step at a time gives) and,
when new work must join at the next step, ends the run at the step in flight
(`Simulation._interrupt`).

A run is planned only where it cannot differ from steps simulated one by one: no speculation
(its accepted drafts are random per step), no slowdown by pods sharing the machine (it depends
on what they run as each step starts), and blocks enough for every step of the run without
evicting a cached prefix (an eviction mid-run would change what the gateway's routing reads).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from splitserve.planner.profile import Profile
from splitserve.planner.simulate.pod import ScheduledStep, SimPod, SimSeq

# Steps planned at most per run: a run interrupted early wastes the durations planned past it.
MAX_RUN_STEPS = 64


@dataclass(eq=False)
class DecodeRun:
    pod: SimPod
    seqs: list[SimSeq]  # each step's rows: one decode token each
    ends: list[float]  # when each step ends
    durations: list[float]
    last: int  # the step whose end is the run's event (ends[last])
    num_applied: int = 0  # steps before `last` whose tokens are out
    event_id: int = 0  # the run's event in the heap; an older one is stale


class DecodeStepCosts:
    """A profile's decode-only step seconds of the steps after one at (rows, context sum),
    remembered per run start: runs start from the same few pairs over and over (a row's
    context spans only its prompt plus its output, and a lone row's runs restart at each
    token an arrival interrupts), and each step's seconds are two interpolations in the
    profile's grid. The longest run's steps are kept; a shorter run takes their head."""

    def __init__(self, max_remembered: int = 200_000) -> None:
        """`max_remembered`: step seconds kept per profile before starting afresh (a run start
        keeps MAX_RUN_STEPS - 1 of them)."""
        # id(profile) -> (rows, context sum) as one int -> each following step's seconds: an
        # int key hashes faster than a tuple, and runs ask hundreds of thousands of times.
        self._runs: dict[int, dict[int, tuple[float, ...]]] = {}
        self._steps: dict[int, dict[int, float]] = {}  # the same for single steps
        self._max_steps = max_remembered
        self._max_runs = max(max_remembered // (MAX_RUN_STEPS - 1), 1)

    def following_steps_s(
        self, profile: Profile, num_rows: int, context_sum: int, count: int
    ) -> tuple[float, ...]:
        """The seconds of `count` (at most MAX_RUN_STEPS - 1) steps after one at
        `context_sum`: every row's context is a token longer each step."""
        if count >= MAX_RUN_STEPS:
            raise ValueError(f"a run plans at most {MAX_RUN_STEPS - 1} following steps")
        runs = self._remembered(self._runs, profile, self._max_runs)
        rows_key = num_rows << 40
        seconds = runs.get(rows_key | context_sum)
        if seconds is None:
            steps = self._remembered(self._steps, profile, self._max_steps)
            seconds = runs[rows_key | context_sum] = tuple(
                self._step_s(steps, profile, rows_key, num_rows, context_sum + num_rows * step)
                for step in range(1, MAX_RUN_STEPS)
            )
        return seconds[:count]

    @staticmethod
    def _remembered(table: dict[int, dict], profile: Profile, bound: int) -> dict:
        known = table.get(id(profile))
        if known is None or len(known) >= bound:
            # A bound on memory for long traces of many distinct contexts.
            known = table[id(profile)] = {}
        return known

    @staticmethod
    def _step_s(
        steps: dict[int, float], profile: Profile, rows_key: int, num_rows: int, context_sum: int
    ) -> float:
        seconds = steps.get(rows_key | context_sum)
        if seconds is None:
            seconds = steps[rows_key | context_sum] = profile.step_s([], num_rows, context_sum)
        return seconds


def plan_run(
    pod: SimPod, step: ScheduledStep, now: float, tokens_left: list[int], costs: DecodeStepCosts
) -> DecodeRun | None:
    """The run that `step` (scheduled now, its blocks taken) starts, or None when it would be
    one step. `tokens_left`: each row's tokens still to emit, in the step's order."""
    length = min(min(tokens_left), MAX_RUN_STEPS)
    length = _steps_blocks_allow(pod, step.chunks, length)
    if length < 2:
        return None
    num_rows = len(step.chunks)
    context_sum = sum(seq.num_tokens for seq, _ in step.chunks)
    durations = [step.duration_s]
    durations += costs.following_steps_s(pod.profile, num_rows, context_sum, length - 1)
    ends = list(itertools.accumulate(durations, initial=now))[1:]
    return DecodeRun(pod, [seq for seq, _ in step.chunks], ends, durations, last=length - 1)


def is_plain_decode(pod: SimPod, step: ScheduledStep) -> bool:
    """Whether `step` decodes one token for every row the pod runs, with nothing waiting to
    join a later step."""
    return (
        not pod.has_waiting()
        and not pod.dropped
        and len(step.chunks) == len(pod.running)
        and all(num_new == 1 and seq.is_decode for seq, num_new in step.chunks)
    )


def _steps_blocks_allow(pod: SimPod, chunks: list[tuple[SimSeq, int]], length: int) -> int:
    """The most steps, up to `length`, whose blocks the pod has free without evicting a cached
    prefix. Step j (from 1) computes each row's position num_tokens + j - 2 (its first step's
    blocks are taken already)."""
    spare = pod.num_free_blocks - pod.cache.num_blocks["device"]
    block_size = pod.limits.block_size

    def needed(steps: int) -> int:
        return sum(
            max(-(-(seq.num_tokens + steps - 1) // block_size) - seq.num_blocks, 0)
            for seq, _ in chunks
        )

    if needed(length) <= spare:
        return length  # the common case, lightly loaded pods: no search
    low, high = 1, length - 1  # needed(1) == 0: the first step's blocks are the row's already
    while low < high:
        middle = (low + high + 1) // 2
        if needed(middle) <= spare:
            low = middle
        else:
            high = middle - 1
    return low
