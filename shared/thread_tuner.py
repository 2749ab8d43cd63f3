"""The torch thread count of each engine step, chosen by measurement between one thread and all.

A forward pass splits its kernels over OpenMP threads, and every kernel waits for its slowest
thread. When another process takes one of the cores (a gateway, Redis, a sidecar, a load
generator), the thread that shares it is descheduled for whole time slices and every step
crawls: measured on 2 cores with one busy process beside a colocated pod serving 4 streams,
2 threads fell from 152 to 30 output tokens/s while 1 thread kept 109 of its 113
(`python -m benchmarks.contention`). Which count is faster therefore depends on the machine's
load right now, so the engine measures it:

    steps are grouped by shape: (decode-only or not, tokens rounded up to a power of two)
    per shape and thread count: the median of its last WINDOW steps (one slow step, a burst
    of another process, does not outvote the others), started afresh when the count comes
    back after a pause
    each step takes the faster count for its shape; now and then one step tries the other,
    EXPLORE_MIN steps after a try that won, twice as long after each try that lost (up to
    EXPLORE_MAX): a core taken for good costs few slow tries, and a core that comes back
    is found again within EXPLORE_MIN steps of the next try

Why not a moving average and a fixed interval: a prefill pod sharing the cores (1P+1D on one
machine) takes a core for a prompt's ~170 ms now and then. A two-thread decode step caught in
such a burst took 104-130 ms instead of 28-34 (12-16 rows): the average flipped the pod to one
thread (43 ms a step) and it stayed there until the next try 32 steps later, so most steps
at 8-16 rows ran on one thread (python -m benchmarks.vs_vllm --parts streams --systems
disaggregated, each step's threads and duration logged). Where the slow steps are sustained
(the 16-stream phase, prefills back to back) the median picks one thread too, as it should;
what it no longer does is stay there after one unlucky step.

A neighbor that says when it computes (`neighbor_threads`: a decode pod sharing its machine
with a prefill pod counts the prompts it has sent there and not got back) gives up its cores
without measuring: while it computes, each step takes the threads the neighbor leaves, and
those steps are not recorded (they would teach the tuner a load that is gone once the
neighbor is done). Measured on 2 cores, 1P+1D at 4 streams (AVX2): a decode step took 45-48 ms
on 2 threads with the prefill pod idle, 114-131 ms on 2 threads while it prefilled, 68-77 ms on
1; the tuner only found out a step late each time, and those steps were the ITL tail.

Used from the engine thread only (`neighbor_threads` is called there too, so it must be safe
to call from another thread than the one that updates what it reads).
"""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from splitserve.engine.step import SchedulerOutput, StepResult

WINDOW = 5  # steps per shape and thread count whose median is compared
EXPLORE_MIN = 8  # steps from a try of the other count that won to the next try
EXPLORE_MAX = 64  # the longest wait between two tries, after tries that lost
STALE_AFTER = 8  # a count unused for this many steps of its shape starts a fresh window


@dataclass
class _ShapeStats:
    seconds: dict[int, deque[float]] = field(default_factory=dict)  # count -> last steps
    last_step: dict[int, int] = field(default_factory=dict)  # thread count -> its latest step
    num_steps: int = 0
    explore_interval: int = EXPLORE_MIN
    next_explore: int = EXPLORE_MIN

    def estimate(self, num_threads: int) -> float:
        return statistics.median(self.seconds[num_threads])


class ThreadTuner:
    """Chooses between 1 and `max_threads` threads per step."""

    def __init__(self, max_threads: int) -> None:
        if max_threads < 2:
            raise ValueError(f"max_threads must be >= 2 to choose a count, got {max_threads}")
        self.candidates = (max_threads, 1)  # all threads first: the quiet machine's choice
        self._shapes: dict[tuple[bool, int], _ShapeStats] = {}
        # Threads a neighbor on these cores computes with right now (0 = none); None: no
        # neighbor tells.
        self.neighbor_threads: Callable[[], int] | None = None
        self._yielded = False  # the step in flight took what the neighbor left

    def choose(self, sched: SchedulerOutput) -> int:
        """The thread count for the step about to compute `sched`."""
        taken = self.neighbor_threads() if self.neighbor_threads is not None else 0
        self._yielded = taken > 0
        if self._yielded:
            return max(1, self.candidates[0] - taken)
        stats = self._shapes.setdefault(_shape(sched), _ShapeStats())
        stats.num_steps += 1
        untried = [n for n in self.candidates if n not in stats.seconds]
        if untried:
            return untried[0]
        best = self._best(stats)
        if stats.num_steps >= stats.next_explore:
            return self._other(best)
        return best

    def observe(self, step: StepResult, num_threads: int) -> None:
        """Records how long a step of this shape took with `num_threads` threads (not a step
        that yielded cores to a neighbor)."""
        if self._yielded:
            return
        stats = self._shapes.setdefault(_shape(step.sched), _ShapeStats())
        tried_all = all(n in stats.seconds for n in self.candidates)
        best_before = self._best(stats) if tried_all else None
        last = stats.last_step.get(num_threads)
        if last is None or stats.num_steps - last > STALE_AFTER:
            # Back from a while unused (a try): its old steps describe a load that may be gone.
            stats.seconds[num_threads] = deque(maxlen=WINDOW)
        stats.seconds[num_threads].append(step.seconds)
        stats.last_step[num_threads] = stats.num_steps
        if best_before is not None and num_threads != best_before:  # a try of the other count
            won = self._best(stats) == num_threads
            interval = EXPLORE_MIN if won else min(2 * stats.explore_interval, EXPLORE_MAX)
            stats.explore_interval = interval
            stats.next_explore = stats.num_steps + interval

    def _best(self, stats: _ShapeStats) -> int:
        return min(self.candidates, key=stats.estimate)

    def _other(self, num_threads: int) -> int:
        return next(n for n in self.candidates if n != num_threads)


def _shape(sched: SchedulerOutput) -> tuple[bool, int]:
    num_tokens = max(1, sched.total_num_tokens)
    return sched.is_decode_only, 1 << (num_tokens - 1).bit_length()
