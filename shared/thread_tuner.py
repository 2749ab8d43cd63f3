"""The torch thread count of each engine step, chosen by measurement between one thread and all.

A forward pass splits its kernels over OpenMP threads, and every kernel waits for its slowest
thread. When another process takes one of the cores (a gateway, Redis, a sidecar, a load
generator), the thread that shares it is descheduled for whole time slices and every step
crawls: measured on 2 cores with one busy process beside a colocated pod serving 4 streams,
2 threads fell from 152 to 30 output tokens/s while 1 thread kept 109 of its 113
(`python -m benchmarks.contention`). Which count is faster therefore depends on the machine's
load right now, so the engine measures it:

    steps are grouped by shape: (decode-only or not, tokens rounded up to a power of two)
    per shape and thread count: a moving average of the step's seconds over a run of steps
    with that count, started afresh when the count comes back after a pause
    each step takes the faster count for its shape, and every EXPLORE_EVERY steps of a shape
    one step tries the other, so a change of load is noticed within EXPLORE_EVERY steps

Used from the engine thread only.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from shared.step import SchedulerOutput, StepResult

EXPLORE_EVERY = 32  # steps of one shape between two tries of the other thread count
SMOOTHING = 0.3  # weight of the newest step in a moving average


@dataclass
class _ShapeStats:
    seconds: dict[int, float] = field(default_factory=dict)  # thread count -> moving average
    last_step: dict[int, int] = field(default_factory=dict)  # thread count -> its latest step
    num_steps: int = 0


class ThreadTuner:
    """Chooses between 1 and `max_threads` threads per step."""

    def __init__(self, max_threads: int) -> None:
        if max_threads < 2:
            raise ValueError(f"max_threads must be >= 2 to choose a count, got {max_threads}")
        self.candidates = (max_threads, 1)  # all threads first: the quiet machine's choice
        self._shapes: dict[tuple[bool, int], _ShapeStats] = {}

    def choose(self, sched: SchedulerOutput) -> int:
        """The thread count for the step about to compute `sched`."""
        stats = self._shapes.setdefault(_shape(sched), _ShapeStats())
        stats.num_steps += 1
        untried = [n for n in self.candidates if n not in stats.seconds]
        if untried:
            return untried[0]
        best = min(self.candidates, key=lambda n: stats.seconds[n])
        if stats.num_steps % EXPLORE_EVERY == 0:
            return next(n for n in self.candidates if n != best)
        return best

    def observe(self, step: StepResult, num_threads: int) -> None:
        """Records how long a step of this shape took with `num_threads` threads."""
        stats = self._shapes.setdefault(_shape(step.sched), _ShapeStats())
        seconds = step.seconds
        # A count used in the step before is averaged; one back from a while unused (an
        # exploration) starts afresh: its old figure describes a load that may be gone.
        if stats.last_step.get(num_threads) == stats.num_steps - 1:
            seconds = SMOOTHING * seconds + (1 - SMOOTHING) * stats.seconds[num_threads]
        stats.seconds[num_threads] = seconds
        stats.last_step[num_threads] = stats.num_steps


def _shape(sched: SchedulerOutput) -> tuple[bool, int]:
    num_tokens = max(1, sched.total_num_tokens)
    return sched.is_decode_only, 1 << (num_tokens - 1).bit_length()
