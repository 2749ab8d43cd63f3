"""The PrefillWorker gRPC servicer: proto <-> `PrefillPodCore` translation, nothing more."""

from __future__ import annotations

from splitserve.common import tracing
from splitserve.common.convert import logprob_to_proto, params_from_options
from splitserve.engine.kv.transfer import KVTransferDescriptor
from splitserve.pod.core import PodServicerBase
from splitserve.prefill.core import CHECKSUM_ALGORITHM, KVDestination, PrefillPodCore
from splitserve.v1 import worker_pb2, worker_pb2_grpc


class PrefillWorkerServicer(
    PodServicerBase[PrefillPodCore], worker_pb2_grpc.PrefillWorkerServicer
):
    """Prefill calls; readiness, Abort and GetStats come from `PodServicerBase`."""

    async def Prefill(
        self, request: worker_pb2.PrefillRequest, context
    ) -> worker_pb2.PrefillResponse:
        core = await self._ready(context)
        params = params_from_options(request.sampling)
        # grpc cancels this handler when the decode pod cancels the call (its client went
        # away); the cancellation aborts the request in the engine.
        outcome = await core.prefill(
            request.request_id,
            list(request.prompt_token_ids),
            params,
            destination_from_proto(request.destination),
            trace_parent=tracing.context_from_grpc(context),
            lora_request=core.lora_request(request.lora_name),
            priority=request.priority,
        )
        response = worker_pb2.PrefillResponse(
            lora_name=outcome.lora_name or "",
            first_token_id=outcome.first_token_id,
            num_cached_tokens=outcome.num_cached_tokens,
            cached_tokens_by_tier=outcome.cached_tokens_by_tier,
            transfer=descriptor_to_proto(outcome.transfer),
            transfer_seconds=outcome.transfer_seconds,
        )
        if outcome.first_logprobs is not None:
            response.first_logprob.CopyFrom(
                logprob_to_proto(outcome.first_logprobs, core.token_text)
            )
        return response


def destination_from_proto(proto: worker_pb2.KVDestination) -> KVDestination:
    return KVDestination(
        transport=proto.transport,
        address=proto.address,
        block_ids=list(proto.block_ids),
        first_block_index=proto.first_block_index,
    )


def descriptor_to_proto(descriptor: KVTransferDescriptor) -> worker_pb2.KVTransferDescriptor:
    # [num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]
    _, num_layers, _, block_size, num_kv_heads, head_dim = descriptor.shape
    is_crc32 = descriptor.checksum_algorithm == CHECKSUM_ALGORITHM
    return worker_pb2.KVTransferDescriptor(
        request_id=descriptor.request_id,
        block_ids=list(descriptor.block_ids),
        num_layers=num_layers,
        block_size=block_size,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        dtype=descriptor.dtype,
        num_bytes=descriptor.num_bytes,
        checksum=descriptor.checksum if is_crc32 else 0,
    )
