"""Async scheduling (`async_scheduling=True`): the host prepares step k+1 while the device
runs step k.

On a GPU a decode step of a small model is short (SmolLM2-135M at batch 64: 2.7 ms of kernels
with CUDA graphs), and the host's part of it (scheduling, building the inputs, reading the
tokens back, detokenizing, streaming) is as long again; done in order, the device idles
through half of every step. Here each call of `step` does, in this order:

    schedule step k        a decode row's input is the pending token of step k-1
    launch step k          on the device behind k-1; k-1's tokens feed k's rows there
    resolve step k-1       wait for its tokens (k is still running), stop rules, output
    advance step k         computed counts move on, k's sampled rows get pending tokens

so the host's work for k-1 and k+1 overlaps the device's for k. What it costs: a request that
stops (EOS, a stop string) is found one step late, so one more row is computed for it and
dropped; max_tokens and the context length are known ahead and cost nothing. Each token
reaches its stream one step later than in order.

Steps run in order whenever a request needs its tokens on the host before the next step
(`can_run_ahead`: logprobs, penalties, grammars, KV export) or speculation proposes from them;
the step in flight is resolved first. Tensor and pipeline parallelism are refused with it
(shared/config.py).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from splitserve.engine.launched_step import LaunchedStep
from splitserve.engine.outputs import StreamDelta
from splitserve.engine.request import Request
from splitserve.engine.step import ModelOutput, StepResult

if TYPE_CHECKING:
    from splitserve.engine.core import EngineCore


def can_run_ahead(request: Request) -> bool:
    """Whether the next step can be scheduled before this request's token is on the host:
    nothing that builds the next step reads the token's value."""
    params = request.sampling_params
    return (
        request.grammar is None
        and params.logprobs is None
        and params.repetition_penalty == 1.0
        and params.frequency_penalty == 0.0
        and params.presence_penalty == 0.0
        and request.export_kv_from_block is None
    )


class OverlappedSteps:
    """Drives an `EngineCore`'s steps with one step in flight on the device."""

    def __init__(self, core: EngineCore) -> None:
        self.core = core
        self.in_flight: LaunchedStep | None = None

    def step(self) -> list[StreamDelta]:
        core = self.core
        if core.speculator is not None or not self._all_run_ahead():
            return self.drain() + core.step_in_order()
        sched = core.scheduler.schedule()
        deltas = core.close_dropped_requests()
        if sched.is_empty:
            return deltas + self.drain()
        launched = core.runner.launch(sched, self.in_flight)
        previous, self.in_flight = self.in_flight, launched
        if previous is not None:
            deltas += self._resolve(previous)
        core.scheduler.advance_launched(sched)
        return deltas

    def drain(self) -> list[StreamDelta]:
        """Resolves the step in flight, if any: afterwards no token is pending."""
        launched, self.in_flight = self.in_flight, None
        return [] if launched is None else self._resolve(launched)

    def _all_run_ahead(self) -> bool:
        return all(can_run_ahead(request) for request in self.core.scheduler.requests.values())

    def _resolve(self, launched: LaunchedStep) -> list[StreamDelta]:
        token_ids = launched.token_ids()
        model_out = ModelOutput(dict(zip(launched.request_ids, token_ids)))
        step = StepResult(launched.sched, model_out, launched.start_time, time.monotonic())
        scheduler = self.core.scheduler
        return self.core.finish_step(
            step, lambda: scheduler.resolve_launched(launched.sched, model_out)
        )
