"""The bare engine's pace at the moment a running stack is measured (`serving.py`).

A profile's steps are timed in one half minute, the stack's requests in the next minutes, and
on a shared VM the same engine ran a 467-token prefill in 1.58 s and in 1.95 s within two
minutes (2026-12-02, an EPYC). Costs taken as the stack's latency less the profile's then carry
the drift: the stack measured 43 ms beyond the profile at 98 prompt tokens and 113 ms at 467,
where the bare engine timed beside each request put the serving path at about 10 ms and
nothing. So before each lone request the measuring process times the profile's own engine on
a prompt of the same length, and the serving costs are taken against the profile at that pace
(`Profile.at_pace`). Its prefill step is pinned to the core of the pod that prefilled the
request and its decode steps to the decode pod's (both idle then), so what is timed runs where
the stack ran it. (It was timed on the first pod's core alone until 2026-12-03, when a 1P+1D
stack's decode pod ran its token gaps 12.5 ms beyond the engine paced there. The two cores
measured within 4% of each other that morning; the gap was the gateway's placement, which
`local_stacks.py` now pins.)
"""

from __future__ import annotations

import os
import statistics
from dataclasses import dataclass

from splitserve.planner.measure.engine_steps import add_request, drain, fresh_tokens, timed_step
from splitserve.planner.profile import Profile

DECODE_STEPS = 4  # batch-1 decode steps timed after each prefill (their median is kept)


@dataclass(frozen=True)
class PaceCores:
    """Where a stack computed what is paced: its prompts' prefill, and its decode steps."""

    prefill: int
    decode: int


@dataclass(frozen=True)
class PaceSample:
    """The bare engine on one lone prompt: its prefill step, then its decode steps' median."""

    num_tokens: int
    prefill_s: float
    decode_s: float


class EnginePace:
    """Times `engine` (the profile's, one torch thread) on lone prompts, pinned to the cores
    the stack ran each kind of step on."""

    def __init__(self, engine) -> None:
        self._engine = engine

    def sample(self, num_tokens: int, cores: PaceCores) -> PaceSample:
        # Only this thread is pinned (the engine computes on it with one torch thread), and
        # only while timing: stacks started later must not inherit the pin.
        affinity = os.sched_getaffinity(0)
        os.sched_setaffinity(0, {cores.prefill})
        try:
            add_request(self._engine, fresh_tokens(num_tokens), DECODE_STEPS + 1)
            prefill_s = timed_step(self._engine)
            os.sched_setaffinity(0, {cores.decode})
            decode_s = statistics.median(timed_step(self._engine) for _ in range(DECODE_STEPS))
            drain(self._engine)
        finally:
            os.sched_setaffinity(0, affinity)
        return PaceSample(num_tokens, prefill_s, decode_s)


def pace_factors(profile: Profile, samples: list[PaceSample]) -> tuple[float, float]:
    """(prefill, decode): the median ratio of the engine's times now to the profile's for the
    same steps (a prompt of the same length; a batch-1 decode at that context)."""
    if not samples:
        raise ValueError("no pace samples")
    prefill = [s.prefill_s / profile.prefill_s(s.num_tokens) for s in samples]
    decode = [s.decode_s / profile.decode.step_s(1, s.num_tokens + 2) for s in samples]
    return statistics.median(prefill), statistics.median(decode)
