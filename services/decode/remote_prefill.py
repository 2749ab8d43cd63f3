"""A decode pod's side of disaggregated prefill: ask a prefill pod to compute a prompt straight
into blocks reserved here, and take the pages and the first token it sends back.

    AsyncLLM.generate(remote_prefill=attempt)
      engine reserves blocks ──plan──▶ attempt(plan)
                                         post receive(request_id, staging buffer)
                                         PrefillWorker.Prefill(destination = our blocks)
                                            prefill pod ──KV pages (ucx / tcp)──▶ staging
                                         ◀── first token (after the pages have landed)
      engine unpacks staging into the blocks, request joins the batch ◀── RemotePrefillResult

Anything that goes wrong raises out of `attempt`, and AsyncLLM then frees the reserved blocks
and prefills locally: no request is lost, whatever the prefill pod or the network does.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass
from enum import StrEnum

import grpc
import torch
from splitserve.v1 import generate_pb2, worker_pb2, worker_pb2_grpc

from services.common import tracing
from services.common.channels import aio_channel
from services.common.convert import options_from_params
from services.common.pod_metrics import PodMetrics
from shared.disaggregation import RemotePrefillPlan, RemotePrefillResult
from shared.kv_transfer import KVReceiver, KVTransferError
from shared.sampler import TokenLogprobs
from shared.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class PrefillMode(StrEnum):
    LOCAL = "local"  # this pod computed the prompt, by choice (no pod named, or a short prompt)
    REMOTE = "remote"  # a prefill pod wrote the prompt's KV pages into this pod's blocks
    LOCAL_FALLBACK = "local-fallback"  # a prefill pod was named but could not be used


@dataclass(frozen=True)
class RemotePrefillSettings:
    # Prompts with fewer uncached tokens than this are prefilled here: moving their pages and
    # a round trip would cost more than computing them.
    local_prefill_threshold: int = 32
    # The whole remote prefill (queueing on the prefill pod, compute, transfer) must fit.
    timeout_s: float = 30.0

    def __post_init__(self) -> None:
        if self.local_prefill_threshold < 0:
            raise ValueError(
                f"local_prefill_threshold must be >= 0, got {self.local_prefill_threshold}"
            )
        if self.timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {self.timeout_s}")


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
        attributes = {
            tracing.REQUEST_ID: request_id,
            "splitserve.prefill.address": address,
            "splitserve.kv.transport": self.transport,
            "splitserve.kv.num_blocks": len(plan.block_ids),
            tracing.CACHED_TOKENS: plan.num_cached_tokens,
        }
        span = tracing.start_span(
            "decode.remote_prefill", trace_parent, attributes, tracing.SpanKind.CLIENT
        )
        try:
            result, response = await self._prefill(
                address, request_id, prompt_token_ids, params, plan, span
            )
        except BaseException as error:
            tracing.end_span(span, error)
            raise
        self._observe_transfer(response, span)
        tracing.end_span(span)
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
        # [len(plan.block_ids), num_layers, 2, block_size, num_kv_heads, head_dim]
        staging = torch.empty(plan.page_shape, dtype=plan.dtype)
        receiving = asyncio.ensure_future(
            self.receiver.receive(request_id, staging, self.timeout_s)
        )
        try:
            response = await self._stub(address).Prefill(
                self._request(request_id, prompt_token_ids, params, plan),
                timeout=self.timeout_s,
                metadata=tracing.grpc_metadata(span),
            )
            descriptor = await receiving
        finally:
            if not receiving.done():
                # No pages will be taken for this request any more; a payload already under
                # way lands in `staging`, which nothing reads.
                receiving.cancel()
                with contextlib.suppress(asyncio.CancelledError, KVTransferError):
                    await receiving
        if list(descriptor.block_ids) != plan.block_ids:
            raise KVTransferError(
                f"request {request_id}: pages for blocks {list(descriptor.block_ids)}, "
                f"expected {plan.block_ids}"
            )
        first_logprobs = (
            logprob_from_proto(response.first_logprob)
            if response.HasField("first_logprob")
            else None
        )
        return RemotePrefillResult(response.first_token_id, first_logprobs, staging), response

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


class RemotePrefillAttempt:
    """One request's `remote_prefill` callable for AsyncLLM, which remembers what happened.

    `mode` stays LOCAL_FALLBACK unless the attempt is called and succeeds (REMOTE) or decides
    the prompt is short enough to prefill here (LOCAL): AsyncLLM also prefills locally without
    calling it when it cannot reserve the blocks now.
    """

    def __init__(
        self,
        client: PrefillClient,
        address: str,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        local_prefill_threshold: int,
        trace_parent: tracing.Span = tracing.NO_SPAN,
    ) -> None:
        self.mode = PrefillMode.LOCAL_FALLBACK
        self.reserved_time: float | None = None  # time.monotonic() when the blocks were ready
        self._trace_parent = trace_parent
        self._client = client
        self._address = address
        self._request_id = request_id
        self._prompt_token_ids = prompt_token_ids
        self._params = params
        self._threshold = local_prefill_threshold
        self._call: asyncio.Task[RemotePrefillResult] | None = None  # while prefilling
        self._is_aborted = False

    async def __call__(self, plan: RemotePrefillPlan) -> RemotePrefillResult | None:
        """The pages and first token; None when this pod should prefill the prompt itself
        (few uncached tokens, or the request was aborted meanwhile)."""
        self.reserved_time = time.monotonic()
        # | cached here (plan.num_cached_tokens) | uncached: worth sending to a prefill pod? |
        num_uncached = len(self._prompt_token_ids) - plan.num_cached_tokens
        if num_uncached < self._threshold:
            self.mode = PrefillMode.LOCAL
            return None
        if self._is_aborted:
            return None
        self._call = asyncio.ensure_future(
            self._client.prefill(
                self._address,
                self._request_id,
                self._prompt_token_ids,
                self._params,
                plan,
                self._trace_parent,
            )
        )
        try:
            result = await self._call
        except asyncio.CancelledError:
            # abort() cancelled the call, not our caller: the request ends as aborted (the
            # engine already knows), instead of its stream being torn down.
            if self._is_aborted and not asyncio.current_task().cancelling():
                return None
            raise
        finally:
            self._call.cancel()  # our caller was cancelled: so is the Prefill call
            self._call = None
        self.mode = PrefillMode.REMOTE
        return result

    def abort(self) -> None:
        """Stops a remote prefill under way (the prefill pod aborts its part too)."""
        self._is_aborted = True
        if self._call is not None:
            self._call.cancel()


def logprob_from_proto(proto: generate_pb2.TokenLogprob) -> TokenLogprobs:
    return TokenLogprobs(
        token_id=proto.token_id,
        logprob=proto.logprob,
        rank=proto.rank,
        top=[(top.token_id, top.logprob) for top in proto.top],
    )
