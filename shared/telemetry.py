"""Engine-side timings of single requests, for the pods' metrics and trace spans: when the
engine first computed any of a request's tokens (the end of its queue time) and every prefill
chunk it ran (when, how many tokens, beside how many others). Plain dataclasses; what a pod
makes of them (histograms, spans) lives in services/.

Only requests a caller `watch`es are recorded, and `take` hands them over and forgets them, so
the recorder holds nothing for requests nobody asked about.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from splitserve.engine.core import EngineCore
    from splitserve.engine.step import StepResult


@dataclass(frozen=True)
class ChunkTiming:
    """One forward pass's share of one request's prompt."""

    start_position: int  # the first prompt token computed in this chunk
    num_tokens: int
    start_time: float  # time.monotonic() around the whole forward pass
    end_time: float
    batch_num_tokens: int  # every token of that forward pass, this request's and others'


@dataclass
class RequestSteps:
    """What the engine did for one watched request so far."""

    first_scheduled_time: float | None = None  # the start of its first forward pass
    prefill_chunks: list[ChunkTiming] = field(default_factory=list)
    num_steps: int = 0  # forward passes it took part in (prefill chunks and decodes)

    @property
    def prefill_seconds(self) -> float:
        if not self.prefill_chunks:
            return 0.0
        return self.prefill_chunks[-1].end_time - self.prefill_chunks[0].start_time


class StepRecorder:
    """Timings of watched requests. `observe` runs on the engine thread; `watch` and `take`
    from any other thread."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._watched: dict[str, RequestSteps] = {}  # request id -> its steps so far

    def watch(self, request_id: str) -> None:
        with self._lock:
            self._watched[request_id] = RequestSteps()

    def take(self, request_id: str) -> RequestSteps | None:
        """The request's steps (None if it was not watched); it is no longer watched."""
        with self._lock:
            return self._watched.pop(request_id, None)

    def observe(self, step: StepResult) -> None:
        """Records one forward pass (a step observer)."""
        with self._lock:
            if not self._watched:
                return
            sched, start_time, end_time = step.sched, step.start_time, step.end_time
            batch_num_tokens = sched.total_num_tokens
            for chunk in sched.chunks:
                steps = self._watched.get(chunk.request.request_id)
                if steps is None:
                    continue
                steps.num_steps += 1
                if steps.first_scheduled_time is None:
                    steps.first_scheduled_time = start_time
                if chunk.start_position < chunk.request.num_prompt_tokens:
                    steps.prefill_chunks.append(
                        ChunkTiming(
                            chunk.start_position,
                            chunk.num_tokens,
                            start_time,
                            end_time,
                            batch_num_tokens,
                        )
                    )


def record_engine_steps(engine: EngineCore) -> StepRecorder:
    """A recorder fed by every forward pass of `engine` from now on."""
    recorder = StepRecorder()
    engine.step_observers.append(recorder)
    return recorder
