"""What a decode pod does with a request, free of protobuf: `DecodeWorkerCore`.

The servicer (services/decode/servicer.py) only translates proto <-> these dataclasses. Where
the prompt gets prefilled is decided in one place, `DecodeWorkerCore._remote_prefill`:

- no prefill pod named, or a prompt shorter than the threshold: prefill here ("local");
- otherwise reserve the blocks, and if the prompt's uncached part (what this pod's own prefix
  cache does not hold) is still at least the threshold, a prefill pod fills them ("remote");
- a prefill pod that fails, times out or is not there: prefill here ("local-fallback").
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from services.common import tracing
from services.common.pod import PodStats, WorkerIdentity, pod_stats, token_text
from services.common.pod_metrics import FinishedRequest, PodMetrics
from services.decode.remote_prefill import (
    PrefillClient,
    PrefillMode,
    RemotePrefillAttempt,
    RemotePrefillSettings,
)
from shared.async_llm import AsyncLLM
from shared.kv_transfer import KVTransport
from shared.outputs import CompletionOutput, StreamDelta
from shared.sampling_params import SamplingParams
from shared.telemetry import record_engine_steps

if TYPE_CHECKING:
    from opentelemetry.context import Context

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class DecodeOutput:
    """One engine delta of a request, with how its prompt was prefilled."""

    delta: StreamDelta
    prefill_mode: PrefillMode
    num_prompt_tokens: int


@dataclass
class _Progress:
    """How far one request got here, for its metrics and spans (time.monotonic() seconds)."""

    received_time: float
    num_prompt_tokens: int
    first_token_time: float | None = None
    final: CompletionOutput | None = None
    is_reported: bool = False  # its metrics and spans are out

    def see(self, delta: StreamDelta, span: tracing.Span) -> None:
        if self.first_token_time is None and delta.token_ids:
            self.first_token_time = time.monotonic()
            span.add_event("first_token")
        if delta.final is not None:
            self.final = delta.final


class DecodeWorkerCore:
    """Runs requests on one `AsyncLLM`; one per process, used from the event loop only.
    `start()` (on that loop) must run before the first request: it listens for KV pages."""

    def __init__(
        self,
        llm: AsyncLLM,
        identity: WorkerIdentity,
        transport: KVTransport,
        settings: RemotePrefillSettings | None = None,
        kv_host: str = "127.0.0.1",
        kv_port: int = 0,
        metrics: PodMetrics | None = None,
    ) -> None:
        self.llm = llm
        self.identity = identity
        self.settings = settings or RemotePrefillSettings()
        self.metrics = metrics or PodMetrics("decode", identity.model_name, llm.stats)
        self._steps = record_engine_steps(llm.engine)  # queue time and chunks, per request
        self._transport = transport
        self._kv_bind = (kv_host, kv_port)
        self._prefill_client: PrefillClient | None = None
        # request id -> its remote prefill attempt (None: prefilled here), while it streams
        self._in_flight: dict[str, RemotePrefillAttempt | None] = {}

    async def start(self) -> None:
        """Starts the KV receiver; its address goes into this pod's stats."""
        receiver = await self._transport.start_receiver(*self._kv_bind)
        self._prefill_client = PrefillClient(
            receiver, self._transport.kind, self.settings.timeout_s, self.metrics
        )
        self.identity = dataclasses.replace(self.identity, kv_address=receiver.address)
        logger.info("receiving KV pages at %s", receiver.address)

    async def generate(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        priority: int = 0,
        prefill_address: str = "",
        trace_parent: Context | None = None,
    ) -> AsyncIterator[DecodeOutput]:
        """Streams the request's deltas; the last one has `finished` set and a `final`.

        Raises ValueError before the first output for a request this pod can never serve.
        Closing the iterator early (the caller went away, or was cancelled) aborts the request
        here and on the prefill pod, and frees its blocks on both. `trace_parent`: the
        caller's trace context (the gateway's span).
        """
        progress = _Progress(time.monotonic(), len(prompt_token_ids))
        if not request_id:
            raise ValueError("request_id must not be empty")
        if params.n != 1:
            raise ValueError(f"n must be 1 on a decode pod (the gateway fans out), got {params.n}")
        if request_id in self._in_flight:
            raise ValueError(f"request_id {request_id!r} is already in use")
        span = tracing.start_span(
            "decode.request",
            trace_parent,
            {tracing.REQUEST_ID: request_id, tracing.INPUT_TOKENS: len(prompt_token_ids)},
            tracing.SpanKind.SERVER,
            progress.received_time,
        )
        attempt = self._remote_prefill(request_id, prompt_token_ids, params, prefill_address, span)
        self._in_flight[request_id] = attempt
        self._steps.watch(request_id)
        error: BaseException | None = None
        try:
            deltas = self.llm.generate(
                prompt_token_ids, params, request_id, priority, remote_prefill=attempt
            )
            async for delta in deltas:
                progress.see(delta, span)
                mode = PrefillMode.LOCAL if attempt is None else attempt.mode
                if delta.finished:  # counted before the caller can see the end
                    self._report(request_id, progress, attempt, span, None)
                yield DecodeOutput(delta, mode, len(prompt_token_ids))
        except BaseException as caught:  # also a consumer that went away (GeneratorExit)
            error = caught
            raise
        finally:
            del self._in_flight[request_id]
            if not progress.is_reported:
                self._report(request_id, progress, attempt, span, error)

    def _report(
        self,
        request_id: str,
        progress: _Progress,
        attempt: RemotePrefillAttempt | None,
        span: tracing.Span,
        error: BaseException | None,
    ) -> None:
        """Metrics and spans of one request that ended here, however it ended."""
        progress.is_reported = True
        finished_time = time.monotonic()
        steps = self._steps.take(request_id)
        queue_end_time = steps.first_scheduled_time if steps is not None else None
        if attempt is not None and attempt.mode == PrefillMode.REMOTE:
            queue_end_time = attempt.reserved_time  # then the prefill pod computed it
        mode = PrefillMode.LOCAL if attempt is None else attempt.mode
        self.metrics.observe_prefill_mode(mode.value)
        finished = FinishedRequest(
            received_time=progress.received_time,
            first_token_time=progress.first_token_time,
            finished_time=finished_time,
            queue_end_time=queue_end_time,
            num_prompt_tokens=progress.num_prompt_tokens,
            output=progress.final,
            steps=steps,
        )
        self.metrics.observe_finished(finished)
        if span.is_recording():
            _finish_span(span, finished, mode, error)

    def _remote_prefill(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        prefill_address: str,
        trace_parent: tracing.Span,
    ) -> RemotePrefillAttempt | None:
        """The remote prefill to try, or None to prefill here without reserving first.

        The prompt's length bounds its uncached part from above, so a prompt shorter than the
        threshold is local at no cost; a longer one is decided once the reservation has told
        how much of it this pod holds already (`RemotePrefillAttempt`)."""
        threshold = self.settings.local_prefill_threshold
        if not prefill_address or len(prompt_token_ids) < threshold:
            return None
        assert self._prefill_client is not None, "start() runs before the first request"
        return RemotePrefillAttempt(
            self._prefill_client,
            prefill_address,
            request_id,
            prompt_token_ids,
            params,
            threshold,
            trace_parent,
        )

    def abort(self, request_id: str) -> bool:
        """Aborts a request still streaming here; False when there is none by that id."""
        if request_id not in self._in_flight:
            return False
        self.llm.abort(request_id)
        attempt = self._in_flight[request_id]
        if attempt is not None:
            attempt.abort()
        return True

    def stats(self) -> PodStats:
        return pod_stats(self.llm, self.identity)

    def token_text(self, token_id: int) -> str:
        return token_text(self.llm, token_id)

    async def close(self) -> None:
        if self._prefill_client is not None:
            await self._prefill_client.close()
        self.llm.shutdown()


def _finish_span(
    span: tracing.Span,
    finished: FinishedRequest,
    mode: PrefillMode,
    error: BaseException | None,
) -> None:
    steps, final = finished.steps, finished.output
    tracing.record_engine_spans(
        "decode", span, steps, finished.received_time, finished.queue_end_time
    )
    span.set_attribute("splitserve.prefill_mode", mode.value)
    if final is not None:
        span.set_attribute(tracing.OUTPUT_TOKENS, len(final.token_ids))
        span.set_attribute(tracing.CACHED_TOKENS, final.num_cached_tokens)
        span.set_attribute("splitserve.finish_reason", final.finish_reason or "")
        span.add_event("finish", {"splitserve.finish_reason": final.finish_reason or ""})
    if finished.first_token_time is not None:
        # | queue | prefill (here or remote) | decode: first token .. last token |
        tracing.record_span(
            "decode.decode",
            span,
            finished.first_token_time,
            finished.finished_time,
            {tracing.OUTPUT_TOKENS: len(final.token_ids) if final is not None else 0},
        )
    tracing.end_span(span, error, finished.finished_time)
