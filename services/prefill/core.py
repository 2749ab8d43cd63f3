"""What a prefill pod does with a request, free of protobuf: `PrefillPodCore`.

    Prefill(prompt, destination) ─▶ engine: prefill (chunked, batched with every other prompt
                                    in flight), sample the first token, pack the pages of the
                                    destination's blocks
                                 ─▶ KV sender: pages to the decode pod, which acknowledges them
                                 ◀─ first token, its logprobs, how the transfer went

The decode pod posts its receive before calling Prefill, so the pages always find it waiting.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import grpc

from splitserve.common import tracing
from splitserve.common.grpc_server import StatusError
from splitserve.engine.async_llm import AsyncLLM
from splitserve.engine.kv.disaggregation import ExportedPrefill, send_pages
from splitserve.engine.kv.transfer import (
    KVSender,
    KVTransferDescriptor,
    KVTransferError,
    KVTransport,
)
from splitserve.engine.kv.transfer.base import parse_address
from splitserve.engine.lora.request import LoRARequest
from splitserve.engine.outputs import CompletionOutput
from splitserve.engine.sampling_params import SamplingParams
from splitserve.pod.core import EnginePodCore
from splitserve.pod.metrics import FinishedRequest, PodMetrics
from splitserve.pod.server import PodIdentity

if TYPE_CHECKING:
    from opentelemetry.context import Context

    from splitserve.engine.sampler import TokenLogprobs

logger = logging.getLogger(__name__)

# The proto's KVTransferDescriptor carries a CRC-32, so that is the checksum pods agree on.
CHECKSUM_ALGORITHM = "crc32"


@dataclass(frozen=True)
class KVDestination:
    """Where the pages go: the decode pod's receiver and its blocks for prompt blocks
    first_block_index, first_block_index + 1, ... (earlier ones it holds already)."""

    transport: str  # "ucx" | "tcp"
    address: str  # e.g. "ucx://10.0.0.5:41234"
    block_ids: list[int]
    first_block_index: int


@dataclass(frozen=True)
class PrefillSettings:
    # CRC-32 every page buffer, checked by the decode pod before it uses the pages.
    checksum: bool = False
    transfer_timeout_s: float = 10.0

    def __post_init__(self) -> None:
        if self.transfer_timeout_s <= 0:
            raise ValueError(f"transfer_timeout_s must be > 0, got {self.transfer_timeout_s}")


@dataclass(frozen=True)
class PrefillOutcome:
    first_token_id: int
    first_logprobs: TokenLogprobs | None  # None unless the request asked for logprobs
    num_cached_tokens: int  # prompt tokens found in this pod's own prefix cache
    transfer: KVTransferDescriptor
    transfer_seconds: float
    cached_tokens_by_tier: dict[str, int]  # num_cached_tokens by the tier that served them
    lora_name: str | None = None  # the adapter the pages were computed with; None: the base


def first_token_params(params: SamplingParams) -> SamplingParams:
    """The request's sampling, stopped after its first token. min_tokens stays at 1 if it was
    set, so EOS is suppressed for that token here exactly as the decode pod would."""
    return dataclasses.replace(params, n=1, max_tokens=1, min_tokens=min(params.min_tokens, 1))


class PrefillPodCore(EnginePodCore):
    """Runs prefills on one `AsyncLLM`; `start()` opens the KV sender. A request is in flight
    while its prompt computes (Abort's answer); its pages' send is not abortable."""

    role = "prefill"

    def __init__(
        self,
        llm: AsyncLLM,
        identity: PodIdentity,
        transport: KVTransport,
        settings: PrefillSettings | None = None,
        metrics: PodMetrics | None = None,
    ) -> None:
        super().__init__(llm, identity, metrics)
        self.settings = settings or PrefillSettings()
        self._transport = transport
        self._sender: KVSender | None = None

    async def start(self) -> None:
        self._sender = self._transport.create_sender()

    async def prefill(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        destination: KVDestination,
        trace_parent: Context | None = None,
        lora_request: LoRARequest | None = None,
        priority: int = 0,
    ) -> PrefillOutcome:
        """Computes the prompt, sends the destination blocks' pages and returns the first
        token once the decode pod has acknowledged them.

        Raises ValueError for a request or destination that cannot work, StatusError when the
        request was aborted or the transfer failed. Cancelling it aborts the request here.
        `trace_parent`: the caller's trace context (the decode pod's span). `lora_request`:
        the adapter to compute the prompt with (None: the base model). `priority`: the
        request's, which this pod's queue orders by (a lower value first)."""
        received_time = time.monotonic()
        self._check_new_request_id(request_id)
        self._check_destination(destination)
        span = tracing.start_span(
            "prefill.request",
            trace_parent,
            {tracing.REQUEST_ID: request_id, tracing.INPUT_TOKENS: len(prompt_token_ids)},
            tracing.SpanKind.SERVER,
            received_time,
        )
        self._in_flight[request_id] = None
        self._steps.watch(request_id)
        exported: ExportedPrefill | None = None
        with tracing.span_scope(span):
            try:
                exported = await self._compute(
                    request_id, prompt_token_ids, params, destination, lora_request, priority
                )
                self._in_flight.pop(request_id, None)
                return await self._send_pages(request_id, exported, destination, span)
            finally:
                self._in_flight.pop(request_id, None)
                final = exported.output if exported is not None else None
                self._report(request_id, len(prompt_token_ids), received_time, final, span)

    async def _send_pages(
        self,
        request_id: str,
        exported: ExportedPrefill,
        destination: KVDestination,
        span: tracing.Span,
    ) -> PrefillOutcome:
        descriptor, seconds = await self._send(request_id, exported.kv_pages, destination, span)
        return PrefillOutcome(
            exported.first_token_id,
            exported.first_logprobs,
            exported.output.num_cached_tokens,
            descriptor,
            seconds,
            exported.output.cached_tokens_by_tier,
            exported.lora_name,
        )

    def _check_destination(self, destination: KVDestination) -> None:
        if destination.transport != self.identity.kv_transport:
            raise ValueError(
                f"destination.transport must be {self.identity.kv_transport!r} (what this "
                f"prefill pod speaks), got {destination.transport!r}"
            )
        try:
            parse_address(destination.address, destination.transport)
        except ValueError as error:
            raise ValueError(f"destination.address: {error}") from None
        if destination.first_block_index < 0:
            raise ValueError(
                f"destination.first_block_index must be >= 0, got {destination.first_block_index}"
            )
        if not destination.block_ids or min(destination.block_ids) < 0:
            raise ValueError(
                f"destination.block_ids must be non-empty block ids, got {destination.block_ids}"
            )

    async def _compute(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        destination: KVDestination,
        lora_request: LoRARequest | None = None,
        priority: int = 0,
    ) -> ExportedPrefill:
        exported = await self.llm.prefill_and_export(
            prompt_token_ids,
            first_token_params(params),
            request_id,
            destination.first_block_index,
            lora_request,
            priority,
        )
        if exported is None:
            raise StatusError(grpc.StatusCode.ABORTED, f"request {request_id} was aborted")
        return exported

    async def _send(
        self, request_id: str, pages, destination: KVDestination, parent: tracing.Span
    ) -> tuple[KVTransferDescriptor, float]:
        assert self._sender is not None, "start() runs before the first request"
        algorithm = CHECKSUM_ALGORITHM if self.settings.checksum else None
        attributes = {
            tracing.REQUEST_ID: request_id,
            "splitserve.kv.transport": destination.transport,
            "splitserve.kv.destination": destination.address,
            "splitserve.kv.bytes": pages.numel() * pages.element_size(),
            "splitserve.kv.num_blocks": len(destination.block_ids),
        }
        start = time.monotonic()
        with tracing.child_span("kv_transfer.send", parent, attributes) as span:
            try:
                descriptor = await send_pages(
                    self._sender,
                    destination.address,
                    request_id,
                    pages,
                    destination.block_ids,
                    self.settings.transfer_timeout_s,
                    algorithm,
                )
            except KVTransferError as error:
                raise StatusError(
                    grpc.StatusCode.UNAVAILABLE, f"KV transfer failed: {error}"
                ) from None
            seconds = time.monotonic() - start
            span.set_attribute("splitserve.kv.seconds", seconds)
        self.metrics.observe_kv_transfer(
            destination.transport, "send", descriptor.num_bytes, seconds
        )
        return descriptor, seconds

    def _report(
        self,
        request_id: str,
        num_prompt_tokens: int,
        received_time: float,
        final: CompletionOutput | None,
        span: tracing.Span,
    ) -> None:
        """Metrics and span attributes of one prefill that ended, however it ended (the
        caller ends the span)."""
        steps = self._steps.take(request_id)
        queue_end_time = steps.first_scheduled_time if steps is not None else None
        self.metrics.observe_finished(
            FinishedRequest(
                received_time=received_time,
                first_token_time=final.timings.first_token_time if final is not None else None,
                finished_time=time.monotonic(),
                queue_end_time=queue_end_time,
                num_prompt_tokens=num_prompt_tokens,
                output=final,
                steps=steps,
            )
        )
        if not span.is_recording():
            return
        tracing.record_engine_spans("prefill", span, steps, received_time, queue_end_time)
        if steps is not None:
            span.set_attribute("splitserve.num_chunks", len(steps.prefill_chunks))
        if final is not None:
            span.set_attribute(tracing.CACHED_TOKENS, final.num_cached_tokens)
            span.set_attribute(tracing.OUTPUT_TOKENS, len(final.token_ids))

    async def _close_transport(self) -> None:
        if self._sender is not None:
            await self._sender.close()
