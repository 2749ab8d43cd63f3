"""Turns per-step token updates into text deltas, detects stop strings and keeps timings."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, replace

from splitserve.engine.detokenizer import IncrementalDetokenizer
from splitserve.engine.outputs import CompletionOutput, RequestTimings, StreamDelta
from splitserve.engine.request import Request, RequestStatus
from splitserve.engine.step import RequestUpdate
from splitserve.engine.tokenizer import Tokenizer


@dataclass
class _SequenceState:
    request: Request
    index: int
    detokenizer: IncrementalDetokenizer
    timings: RequestTimings
    logprobs: list | None
    # Tokens a verification step accepted after the one that completed a stop string: they
    # are in the request's output but not the client's (text, token ids, logprobs alike).
    num_dropped_tokens: int = 0


@dataclass
class ProcessedStep:
    deltas: list[StreamDelta]
    # Sequences a stop string ended: the engine must finish them in the scheduler too.
    stopped_request_ids: list[str]


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self._states: dict[str, _SequenceState] = {}

    def add(self, request: Request, index: int, resumed_output: Sequence[int] = ()) -> None:
        """`resumed_output`: tokens streamed by another pod before this one took the sequence
        over. They go through the detokenizer silently, leaving it exactly where the other
        pod's was: text it held back (a possible stop string, an unfinished character) is
        released from here, and nothing the client has seen comes again."""
        params = request.sampling_params
        detokenizer = IncrementalDetokenizer(self.tokenizer, request.prompt_token_ids, params)
        for token_id in resumed_output:
            detokenizer.append(token_id)
        self._states[request.request_id] = _SequenceState(
            request=request,
            index=index,
            detokenizer=detokenizer,
            timings=RequestTimings(arrival_time=request.arrival_time),
            logprobs=[] if params.logprobs is not None else None,
        )

    def process(self, updates: list[RequestUpdate]) -> ProcessedStep:
        now = time.monotonic()
        step = ProcessedStep([], [])
        for update in updates:
            state = self._states.get(update.request.request_id)
            if state is not None:
                step.deltas.append(self._advance(state, update, now, step))
        return step

    def _advance(
        self, state: _SequenceState, update: RequestUpdate, now: float, step: ProcessedStep
    ) -> StreamDelta:
        text = ""
        stop_string = None
        num_kept = len(update.new_token_ids)
        for position, token_id in enumerate(self._text_token_ids(state.request, update)):
            result = state.detokenizer.append(token_id)
            text += result.text_delta
            if result.stop_string is not None:
                stop_string = result.stop_string
                num_kept = position + 1  # speculation may have accepted more after it
                break
        update = self._cut(state, update, num_kept)
        timings = state.timings
        if timings.first_token_time is None:
            timings.first_token_time = now
        timings.token_times.extend(now for _ in update.new_token_ids)
        if state.logprobs is not None:
            state.logprobs.extend(update.logprobs)
        request = state.request
        finished = update.finished or stop_string is not None
        if stop_string is not None:
            request.stop_reason = stop_string
            step.stopped_request_ids.append(request.request_id)
        elif finished:
            text += state.detokenizer.flush()
        finish_reason = "stop" if stop_string is not None else request.status.finish_reason
        return self._delta(state, text, update, finished, finish_reason, now)

    @staticmethod
    def _cut(state: _SequenceState, update: RequestUpdate, num_kept: int) -> RequestUpdate:
        """The update without its tokens past `num_kept` (counted as dropped on `state`)."""
        num_dropped = len(update.new_token_ids) - num_kept
        if num_dropped == 0:
            return update
        state.num_dropped_tokens += num_dropped
        return replace(
            update,
            new_token_ids=update.new_token_ids[:num_kept],
            logprobs=update.logprobs[:num_kept],
        )

    @staticmethod
    def _text_token_ids(request: Request, update: RequestUpdate) -> list[int]:
        """The update's tokens that become text. A token that stopped the sequence (EOS or a
        stop token id) does not, just as a stop string is cut from the text (vLLM's behaviour
        too); it stays in `token_ids`."""
        if update.finished and request.status == RequestStatus.FINISHED_STOPPED:
            return update.new_token_ids[:-1]
        return update.new_token_ids

    def _delta(
        self,
        state: _SequenceState,
        text: str,
        update: RequestUpdate,
        finished: bool,
        finish_reason: str | None,
        now: float,
    ) -> StreamDelta:
        request = state.request
        delta = StreamDelta(
            request_id=request.request_id,
            text=text,
            token_ids=list(update.new_token_ids),
            logprobs=list(update.logprobs) if state.logprobs is not None else None,
            finished=finished,
            index=state.index,
            finish_reason=finish_reason if finished else None,
            stop_reason=request.stop_reason if finished else None,
        )
        if finished:
            state.timings.finish_time = now
            delta.final = self._completion(state, finish_reason)
            del self._states[request.request_id]
        return delta

    def abort(self, request: Request) -> StreamDelta | None:
        """The closing delta of a sequence that was aborted or dropped by the scheduler."""
        state = self._states.pop(request.request_id, None)
        if state is None:
            return None
        state.timings.finish_time = time.monotonic()
        reason = request.status.finish_reason
        delta = StreamDelta(
            request.request_id, state.detokenizer.flush(), [], None, True, state.index, reason
        )
        delta.final = self._completion(state, reason)
        return delta

    @staticmethod
    def _completion(state: _SequenceState, finish_reason: str | None) -> CompletionOutput:
        request = state.request
        return CompletionOutput(
            index=state.index,
            text=state.detokenizer.text,
            token_ids=list(request.output_token_ids)[
                : len(request.output_token_ids) - state.num_dropped_tokens
            ],
            finish_reason=finish_reason,
            stop_reason=request.stop_reason,
            logprobs=state.logprobs,
            timings=state.timings,
            num_cached_tokens=request.num_cached_tokens,
            cached_tokens_by_tier=request.cached_tokens_by_tier(),
            num_preemptions=request.num_preemptions,
        )
