"""The DecodeWorker gRPC servicer: proto <-> `DecodePodCore` translation, nothing more."""

from __future__ import annotations

from splitserve.common import tracing
from splitserve.common.convert import logprobs_to_proto, params_from_options
from splitserve.decode.core import DecodeOutput, DecodePodCore
from splitserve.pod.core import PodServicerBase
from splitserve.v1 import generate_pb2, worker_pb2, worker_pb2_grpc


class DecodeWorkerServicer(
    PodServicerBase[DecodePodCore], worker_pb2_grpc.DecodeWorkerServicer
):
    """Decode calls; readiness, Abort and GetStats come from `PodServicerBase`."""

    async def Decode(self, request: worker_pb2.DecodeRequest, context):
        core = await self._ready(context)
        outputs = core.generate(
            request.request_id,
            list(request.prompt_token_ids),
            params_from_options(request.sampling),
            request.priority,
            request.prefill_address,
            trace_parent=tracing.context_from_grpc(context),
            resumed_output=list(request.resumed_output_token_ids),
            lora_request=core.lora_request(request.lora_name),
        )
        # grpc cancels this handler when the caller goes away; the cancellation unwinds
        # through `outputs`, whose cleanup aborts the request in the engine.
        async for output in outputs:
            yield decode_response(output, core)


def decode_response(output: DecodeOutput, core: DecodePodCore) -> worker_pb2.DecodeResponse:
    delta = output.delta
    response = worker_pb2.DecodeResponse(
        token_ids=delta.token_ids,
        text=delta.text,
        logprobs=logprobs_to_proto(delta.logprobs or [], core.token_text),
        prefill_mode=output.prefill_mode.value,
    )
    if delta.finished:
        assert delta.final is not None, "a finished delta carries its final output"
        response.finish_reason = delta.finish_reason or ""
        response.stop_reason = _stop_reason_text(delta.stop_reason, core)
        response.usage.CopyFrom(
            generate_pb2.Usage(
                prompt_tokens=output.num_prompt_tokens,
                completion_tokens=len(delta.final.token_ids),
                cached_tokens=delta.final.num_cached_tokens,
                cached_tokens_by_tier=delta.final.cached_tokens_by_tier,
            )
        )
    return response


def _stop_reason_text(stop_reason: int | str | None, core: DecodePodCore) -> str:
    if stop_reason is None:
        return ""
    if isinstance(stop_reason, int):  # a stop token id: the proto carries it as text
        return core.token_text(stop_reason)
    return stop_reason
