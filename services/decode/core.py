"""What a decode pod does with a request, free of protobuf: `DecodePodCore`.

The servicer (services/decode/servicer.py) only translates proto <-> these dataclasses. Where
the prompt gets prefilled is decided in one place, `PromptPrefill`
(services/decode/remote_prefill.py); this module streams the outcome and reports it.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import grpc

from splitserve.common import tracing
from splitserve.common.grpc_server import StatusError
from splitserve.decode.overload import OverloadBound, PodRoom, refusal
from splitserve.decode.remote_prefill import (
    PrefillClient,
    PrefillMode,
    PromptPrefill,
    RemotePrefillSettings,
)
from splitserve.engine.async_llm import AsyncLLM
from splitserve.engine.kv.transfer import KVTransport
from splitserve.engine.lora.request import LoRARequest
from splitserve.engine.outputs import CompletionOutput, StreamDelta
from splitserve.engine.sampling_params import SamplingParams
from splitserve.pod.core import EnginePodCore
from splitserve.pod.metrics import FinishedRequest, PodMetrics
from splitserve.pod.server import PodIdentity

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


class DecodePodCore(EnginePodCore):
    """Runs requests on one `AsyncLLM`; `start()` listens for KV pages. In flight: request id
    -> its `PromptPrefill`, which an abort stops too."""

    role = "decode"

    def __init__(
        self,
        llm: AsyncLLM,
        identity: PodIdentity,
        transport: KVTransport,
        settings: RemotePrefillSettings | None = None,
        kv_host: str = "127.0.0.1",
        kv_port: int = 0,
        metrics: PodMetrics | None = None,
        overload: OverloadBound | None = None,
    ) -> None:
        """`overload`: when to refuse a request rather than queue it (None: never)."""
        super().__init__(llm, identity, metrics)
        self.settings = settings or RemotePrefillSettings()
        self.overload = overload or OverloadBound()
        self._transport = transport
        self._kv_bind = (kv_host, kv_port)
        self._prefill_client: PrefillClient | None = None

    async def start(self) -> None:
        """Starts the KV receiver; its address goes into this pod's stats."""
        receiver = await self._transport.start_receiver(*self._kv_bind)
        self._prefill_client = PrefillClient(
            receiver, self._transport.kind, self.settings.timeout_s, self.metrics
        )
        self.identity = dataclasses.replace(self.identity, kv_address=receiver.address)
        logger.info("receiving KV pages at %s", receiver.address)
        self._yield_cores_to_prefill(self._prefill_client)

    def _yield_cores_to_prefill(self, client: PrefillClient) -> None:
        """With prefill pods on this pod's cores, steps leave them their threads while they
        compute a prompt of ours (shared/thread_tuner.py)."""
        per_pod = self.settings.neighbor_prefill_threads
        if not per_pod:
            return
        tuner = self.llm.engine.thread_tuner
        if tuner is None:
            logger.info("--neighbor-prefill-threads: this engine's thread count is fixed; ignored")
            return
        tuner.neighbor_threads = lambda: per_pod * client.num_busy_prefill_pods()

    async def generate(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        priority: int = 0,
        prefill_address: str = "",
        trace_parent: Context | None = None,
        resumed_output: list[int] | None = None,
        lora_request: LoRARequest | None = None,
    ) -> AsyncIterator[DecodeOutput]:
        """Streams the request's deltas; the last one has `finished` set and a `final`.
        `resumed_output`: a migrated sequence's tokens so far (see AsyncLLM.generate).
        `lora_request`: the adapter it runs with, here and on the prefill pod (None: base).

        Raises ValueError before the first output for a request this pod can never serve,
        and StatusError(RESOURCE_EXHAUSTED) for one it will not take now (`self.overload`),
        before anything is reserved for it.
        Closing the iterator early (the caller went away, or was cancelled) aborts the request
        here and on the prefill pod, and frees its blocks on both. `trace_parent`: the
        caller's trace context (the gateway's span).
        """
        progress = _Progress(time.monotonic(), len(prompt_token_ids))
        self._check_new_request_id(request_id)
        if params.n != 1:
            raise ValueError(f"n must be 1 on a decode pod (the gateway fans out), got {params.n}")
        self._check_room(len(prompt_token_ids) + len(resumed_output or []))
        span = tracing.start_span(
            "decode.request",
            trace_parent,
            {tracing.REQUEST_ID: request_id, tracing.INPUT_TOKENS: len(prompt_token_ids)},
            tracing.SpanKind.SERVER,
            progress.received_time,
        )
        prefill = PromptPrefill(
            self.llm, self._prefill_client, self.settings, prefill_address, span
        )
        self._in_flight[request_id] = prefill
        self._steps.watch(request_id)
        error: BaseException | None = None
        try:
            deltas = prefill.deltas(
                request_id, prompt_token_ids, params, priority, resumed_output, lora_request
            )
            async for delta in deltas:
                progress.see(delta, span)
                if delta.finished:  # counted before the caller can see the end
                    self._report(request_id, progress, prefill, span, None)
                yield DecodeOutput(delta, prefill.mode, len(prompt_token_ids))
        except BaseException as caught:  # also a consumer that went away (GeneratorExit)
            error = caught
            raise
        finally:
            del self._in_flight[request_id]
            if not progress.is_reported:
                self._report(request_id, progress, prefill, span, error)

    def _check_room(self, num_tokens: int) -> None:
        """Refuses (RESOURCE_EXHAUSTED) a request of `num_tokens` that the overload bound
        says must not queue here now. Runs before the request is in flight or in the engine,
        so a refusal leaves nothing behind."""
        if not self.overload.max_waiting_requests:
            return
        stats = self.llm.stats()
        # Every request in the engine is one of our calls: the rest of them are on their way.
        num_unseen = len(self._in_flight) - stats.num_running - stats.num_waiting
        config = self.llm.config
        room = PodRoom(
            stats,
            max(num_unseen, 0),
            config.cache.block_size,
            config.scheduler.max_num_seqs,
            self.llm.engine.kv_manager.num_groups,
        )
        reason = refusal(self.overload, room, num_tokens)
        if reason is not None:
            self.metrics.observe_refused()
            raise StatusError(grpc.StatusCode.RESOURCE_EXHAUSTED, reason)

    def _report(
        self,
        request_id: str,
        progress: _Progress,
        prefill: PromptPrefill,
        span: tracing.Span,
        error: BaseException | None,
    ) -> None:
        """Metrics and spans of one request that ended here, however it ended."""
        progress.is_reported = True
        finished_time = time.monotonic()
        steps = self._steps.take(request_id)
        queue_end_time = steps.first_scheduled_time if steps is not None else None
        mode = prefill.mode
        if mode == PrefillMode.REMOTE:
            queue_end_time = prefill.reserved_time  # then the prefill pod computed it
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

    async def _close_transport(self) -> None:
        if self._prefill_client is not None:
            await self._prefill_client.close()


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
