"""A decode pod's side of disaggregated prefill: where each prompt is prefilled is decided here,
once (`PromptPrefill`), and a prefill pod is asked to compute it straight into blocks reserved
in this pod's cache (`PrefillClient`).

    PromptPrefill.deltas()
      no prefill pod named, or a short prompt ─────────────▶ llm.generate: prefill here ("local")
      llm.reserve_remote_prefill ──plan──▶ uncached part still >= threshold?
          no: reservation.fall_back() ────────────────────▶ prefill here ("local")
          the prefill pod already has our limit of tokens in flight:
              reservation.fall_back() ────────────────────▶ prefill here ("local-busy")
          yes: post receive(request_id, staging buffer)
               PrefillWorker.Prefill(destination = our blocks)
                  prefill pod ──KV pages (ucx / tcp)──▶ staging
               ◀── first token (after the pages have landed)
               reservation.complete(pages + first token) ──▶ joins the batch ("remote")
          RPC, transfer or timeout failure: reservation.fall_back() ▶ prefill here
                                                                       ("local-fallback")
      reservation.deltas() ──▶ the caller

No request is lost, whatever the prefill pod or the network does; any other exception (a bug)
fails the request and frees its blocks instead of hiding behind a fallback.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from enum import StrEnum

import grpc

from splitserve.common import tracing
from splitserve.common.channels import aio_channel
from splitserve.common.conditional_prefill import prefill_pod_is_full
from splitserve.common.convert import logprob_from_proto, options_from_params
from splitserve.engine.async_llm import AsyncLLM, RemotePrefillReservation
from splitserve.engine.kv.disaggregation import (
    RemotePrefillPlan,
    RemotePrefillResult,
    receive_pages,
)
from splitserve.engine.kv.transfer import KVReceiver, KVTransferError
from splitserve.engine.lora.request import LoRARequest
from splitserve.engine.outputs import StreamDelta
from splitserve.engine.sampling_params import SamplingParams
from splitserve.pod.metrics import PodMetrics
from splitserve.v1 import worker_pb2, worker_pb2_grpc

logger = logging.getLogger(__name__)

# The failures of the remote path that a local prefill recovers from: the prefill pod is gone,
# refuses or errs (gRPC), the pages do not arrive intact (transfer), or it all takes too long.
REMOTE_PREFILL_ERRORS = (grpc.RpcError, KVTransferError, TimeoutError, OSError)


class PrefillMode(StrEnum):
    LOCAL = "local"  # this pod computed the prompt, by choice (no pod named, or a short prompt)
    REMOTE = "remote"  # a prefill pod wrote the prompt's KV pages into this pod's blocks
    LOCAL_FALLBACK = "local-fallback"  # a prefill pod was named but could not be used
    LOCAL_BUSY = "local-busy"  # the prefill pod had our limit of prompt tokens in flight


@dataclass(frozen=True)
class RemotePrefillSettings:
    # Prompts with fewer uncached tokens than this are prefilled here: moving their pages and
    # a round trip would cost more than computing them.
    local_prefill_threshold: int = 32
    # The whole remote prefill (queueing on the prefill pod, compute, transfer) must fit.
    timeout_s: float = 30.0
    # Conditional disaggregation: while this many uncached prompt tokens of ours per running
    # stream here, plus one, are in flight at a prefill pod (sent, pages not back), further
    # prompts are prefilled here instead of queueing behind them; a pod with nothing in flight
    # always gets the prompt (services/common/conditional_prefill.py). 0: no limit.
    # A backed-up prefill pod otherwise holds streams out of the decode batch while this pod's
    # steps run short of rows (docs/benchmarks.md, issue 15).
    max_remote_tokens: int = 0
    # Threads each prefill pod computes with when it shares this pod's cores (`splitserve up`
    # on one machine); while one computes a prompt of ours, this pod's steps leave it them
    # (shared/thread_tuner.py). 0: the prefill pods have cores of their own.
    neighbor_prefill_threads: int = 0

    def __post_init__(self) -> None:
        if self.local_prefill_threshold < 0:
            raise ValueError(
                f"local_prefill_threshold must be >= 0, got {self.local_prefill_threshold}"
            )
        if self.timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {self.timeout_s}")
        if self.max_remote_tokens < 0:
            raise ValueError(f"max_remote_tokens must be >= 0, got {self.max_remote_tokens}")
        if self.neighbor_prefill_threads < 0:
            raise ValueError(
                f"neighbor_prefill_threads must be >= 0, got {self.neighbor_prefill_threads}"
            )


class PrefillClient:
    """Talks to prefill pods for one decode pod: a gRPC channel per prefill pod (opened on
    first use) and this pod's KV receiver. Used from the event loop only."""

    def __init__(
        self,
        receiver: KVReceiver,
        transport: str,
        timeout_s: float,
        metrics: PodMetrics | None = None,
    ) -> None:
        self.receiver = receiver
        self.transport = transport
        self.timeout_s = timeout_s
        self.metrics = metrics  # KV transfers received, when given
        self._channels: dict[str, grpc.aio.Channel] = {}  # prefill pod address -> channel
        # Prefill pod address -> uncached prompt tokens of ours it is prefilling now.
        self._tokens_in_flight: dict[str, int] = {}

    def tokens_in_flight(self, address: str) -> int:
        return self._tokens_in_flight.get(address, 0)

    def num_busy_prefill_pods(self) -> int:
        """Prefill pods computing (or queueing, or sending) a prompt of ours now. Read by the
        engine thread: one pass over a small dict the event loop updates in place."""
        return sum(1 for tokens in list(self._tokens_in_flight.values()) if tokens > 0)

    @contextlib.contextmanager
    def counted_in_flight(self, address: str, num_tokens: int) -> Iterator[None]:
        """Counts `num_tokens` as in flight at `address` while the block runs. The caller enters
        it right after deciding from tokens_in_flight, with no await between: requests deciding
        in the same turn of the event loop then see each other's tokens."""
        self._tokens_in_flight[address] = self.tokens_in_flight(address) + num_tokens
        try:
            yield
        finally:
            self._tokens_in_flight[address] -= num_tokens

    async def prefill(
        self,
        address: str,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        plan: RemotePrefillPlan,
        trace_parent: tracing.Span = tracing.NO_SPAN,
    ) -> RemotePrefillResult:
        """Has the prefill pod at `address` fill `plan`'s blocks; raises on any failure.

        The receive is posted before the Prefill call, so the pages never arrive ahead of
        their destination. Cancelling this (the client went away) cancels the Prefill call,
        which aborts the request on the prefill pod too. The call is traced as
        `decode.remote_prefill` under `trace_parent`, whose context the prefill pod gets.
        """
        attributes: tracing.Attributes = {
            tracing.REQUEST_ID: request_id,
            "splitserve.prefill.address": address,
            "splitserve.kv.transport": self.transport,
            "splitserve.kv.num_blocks": len(plan.block_ids),
            tracing.CACHED_TOKENS: plan.num_cached_tokens,
        }
        span = tracing.start_span(
            "decode.remote_prefill", trace_parent, attributes, tracing.SpanKind.CLIENT
        )
        with tracing.span_scope(span):
            result, response = await self._prefill(
                address, request_id, prompt_token_ids, params, plan, span
            )
            self._observe_transfer(response, span)
        return result

    def _observe_transfer(self, response: worker_pb2.PrefillResponse, span: tracing.Span) -> None:
        num_bytes = response.transfer.num_bytes
        if self.metrics is not None:
            self.metrics.observe_kv_transfer(
                self.transport, "receive", num_bytes, response.transfer_seconds
            )
        if span.is_recording():
            span.set_attribute("splitserve.kv.bytes", num_bytes)
            span.set_attribute("splitserve.kv.seconds", response.transfer_seconds)
            span.set_attribute("splitserve.prefill.cached_tokens", response.num_cached_tokens)

    async def _prefill(
        self,
        address: str,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        plan: RemotePrefillPlan,
        span: tracing.Span,
    ) -> tuple[RemotePrefillResult, worker_pb2.PrefillResponse]:
        receiving = asyncio.ensure_future(receive_pages(self.receiver, plan, self.timeout_s))
        try:
            response = await self._stub(address).Prefill(
                self._request(request_id, prompt_token_ids, params, plan),
                timeout=self.timeout_s,
                metadata=tracing.grpc_metadata(span),
            )
            pages, _ = await receiving
        finally:
            if not receiving.done():
                # No pages will be taken for this request any more; a payload already under
                # way lands in the staging buffer, which nothing reads.
                receiving.cancel()
            # Also when the receive failed beside a failed call (both timed out): its error is
            # the call's story, and must not surface as "exception was never retrieved".
            with contextlib.suppress(asyncio.CancelledError, KVTransferError):
                await receiving
        first_logprobs = (
            logprob_from_proto(response.first_logprob)
            if response.HasField("first_logprob")
            else None
        )
        result = RemotePrefillResult(
            response.first_token_id,
            first_logprobs,
            pages,
            prefill_cached_tokens_by_tier=dict(response.cached_tokens_by_tier),
            lora_name=response.lora_name or None,
        )
        return result, response

    def _request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        plan: RemotePrefillPlan,
    ) -> worker_pb2.PrefillRequest:
        destination = worker_pb2.KVDestination(
            transport=self.transport,
            address=self.receiver.address,
            block_ids=plan.block_ids,
            first_block_index=plan.first_block_index,
        )
        return worker_pb2.PrefillRequest(
            request_id=request_id,
            prompt_token_ids=prompt_token_ids,
            sampling=options_from_params(params),
            destination=destination,
            lora_name=plan.lora_name or "",  # the adapter the pages must be computed with
            priority=plan.priority,
        )

    def _stub(self, address: str) -> worker_pb2_grpc.PrefillWorkerStub:
        channel = self._channels.get(address)
        if channel is None:
            channel = self._channels[address] = aio_channel(address)
        return worker_pb2_grpc.PrefillWorkerStub(channel)

    async def close(self) -> None:
        channels, self._channels = list(self._channels.values()), {}
        for channel in channels:
            await channel.close()
        await self.receiver.close()


class PromptPrefill:
    """Where one request's prompt is prefilled, decided once, and the request's deltas.

    `mode` says what happened: LOCAL by choice, REMOTE once a prefill pod's pages landed, and
    LOCAL_FALLBACK while undecided or when the remote path could not be used (no blocks free to
    reserve, a failure, an abort)."""

    def __init__(
        self,
        llm: AsyncLLM,
        client: PrefillClient | None,
        settings: RemotePrefillSettings,
        prefill_address: str,
        trace_parent: tracing.Span = tracing.NO_SPAN,
    ) -> None:
        self.mode = PrefillMode.LOCAL_FALLBACK
        self.reserved_time: float | None = None  # time.monotonic() when the blocks were ready
        self._llm = llm
        self._client = client
        self._settings = settings
        self._address = prefill_address
        self._trace_parent = trace_parent
        self._call: asyncio.Task[RemotePrefillResult] | None = None  # while prefilling
        self._is_aborted = False

    async def deltas(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        priority: int,
        resumed_output: list[int] | None = None,
        lora_request: LoRARequest | None = None,
    ) -> AsyncIterator[StreamDelta]:
        """The request's deltas, however its prompt gets prefilled. Raises ValueError before
        the first for a request this pod can never serve; closing early aborts it.
        A migrated sequence (`resumed_output`) is always prefilled here: its prompt is mostly
        in this pod's prefix cache when the router chose well, and a prefill pod samples only
        first tokens."""
        is_short = len(prompt_token_ids) < self._settings.local_prefill_threshold
        if not self._address or is_short or resumed_output:
            # The prompt's length bounds its uncached part: short ones are local at no cost.
            self.mode = PrefillMode.LOCAL
            deltas = self._llm.generate(
                prompt_token_ids, params, request_id, priority, resumed_output, lora_request
            )
        else:
            reservation = await self._llm.reserve_remote_prefill(
                prompt_token_ids, params, request_id, priority, lora_request
            )
            self.reserved_time = time.monotonic()
            try:
                await self._fill(reservation, prompt_token_ids, params)
            except BaseException:
                reservation.abort()
                raise
            deltas = reservation.deltas()
        async for delta in deltas:
            yield delta

    async def _fill(
        self,
        reservation: RemotePrefillReservation,
        prompt_token_ids: list[int],
        params: SamplingParams,
    ) -> None:
        """Has a prefill pod fill the reserved blocks, or hands the prompt back to a local
        prefill; decides which from what this pod's prefix cache already holds."""
        if self._is_aborted:
            # An abort that came before the reservation found nothing to abort yet.
            self._llm.abort(reservation.request_id)
            return
        plan = reservation.plan
        if plan is None:
            return  # no blocks free now: the engine queued a local prefill
        # | cached here (plan.num_cached_tokens) | uncached: worth sending to a prefill pod? |
        num_uncached = len(prompt_token_ids) - plan.num_cached_tokens
        if num_uncached < self._settings.local_prefill_threshold:
            self.mode = PrefillMode.LOCAL
            reservation.fall_back()
            return
        assert self._client is not None, "a pod that names prefill pods has a client"
        if self._prefill_pod_is_full(num_uncached):
            self.mode = PrefillMode.LOCAL_BUSY
            reservation.fall_back()
            return
        try:
            with self._client.counted_in_flight(self._address, num_uncached):
                if self._settings.neighbor_prefill_threads:
                    # The step running now chose its threads before this prompt counted: the
                    # prefill pod starts once it ends, beside a step that leaves it its threads.
                    await self._llm.after_current_step()
                    if self._is_aborted:
                        self._llm.abort(reservation.request_id)
                        return
                result = await self._prefill_remotely(plan, prompt_token_ids, params)
        except REMOTE_PREFILL_ERRORS as error:
            logger.warning(
                "request %s: remote prefill failed (%r); prefilling locally", plan.request_id, error
            )
            reservation.fall_back()
            return
        if result is not None:
            self.mode = PrefillMode.REMOTE
            reservation.complete(result)

    def _prefill_pod_is_full(self, num_uncached: int) -> bool:
        """Whether sending `num_uncached` more tokens would pass the limit, which grows with
        the streams a local prefill would stall (services/common/conditional_prefill.py)."""
        assert self._client is not None, "checked by the caller"
        return prefill_pod_is_full(
            self._settings.max_remote_tokens,
            self._client.tokens_in_flight(self._address),
            num_uncached,
            self._llm.stats().num_running,
        )

    async def _prefill_remotely(
        self, plan: RemotePrefillPlan, prompt_token_ids: list[int], params: SamplingParams
    ) -> RemotePrefillResult | None:
        """The prefill pod's pages and first token; None when `abort` stopped it."""
        assert self._client is not None, "checked by the caller"
        self._call = asyncio.ensure_future(
            self._client.prefill(
                self._address, plan.request_id, prompt_token_ids, params, plan, self._trace_parent
            )
        )
        try:
            return await self._call
        except asyncio.CancelledError:
            # abort() cancelled the call, not our caller: the request ends as aborted (the
            # engine already knows), instead of its stream being torn down.
            task = asyncio.current_task()
            assert task is not None, "a coroutine that awaits runs in a task"
            if self._is_aborted and not task.cancelling():
                return None
            raise
        finally:
            self._call.cancel()  # our caller was cancelled: so is the Prefill call
            self._call = None

    def abort(self) -> None:
        """Stops a remote prefill under way (the prefill pod aborts its part too)."""
        self._is_aborted = True
        if self._call is not None:
            self._call.cancel()
