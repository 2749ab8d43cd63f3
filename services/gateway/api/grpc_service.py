"""The public gRPC `Generation` service: proto <-> `GatewayCore` translation, nothing more.
ValueError becomes INVALID_ARGUMENT in the shared interceptor (splitserve.common.grpc_server)."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from typing import TypedDict

import grpc

from splitserve.common import tracing
from splitserve.common.convert import params_from_options
from splitserve.common.grpc_server import StatusError
from splitserve.gateway.admission.slo import requested_slo
from splitserve.gateway.auth.gate import Gate, grpc_caller
from splitserve.gateway.core import GatewayCore, GenerationRequest
from splitserve.gateway.errors import RequestError
from splitserve.gateway.generation import Generation, collect
from splitserve.gateway.outputs import CollectedSequence, SequenceChunk, Usage
from splitserve.v1 import generate_pb2, generate_pb2_grpc

# The client's region, for routing it to pods nearby (HTTP: the header of the same name).
REGION_METADATA = "x-splitserve-region"


class GenerationServicer(generate_pb2_grpc.GenerationServicer):
    def __init__(self, core: GatewayCore, gate: Gate | None = None) -> None:
        self.core = core
        self.gate = gate  # keys, tenants and limits (None: open)

    async def Generate(self, request: generate_pb2.GenerateRequest, context):
        async with grpc_caller(self.gate, context):
            return await self._generate(request, context)

    async def GenerateStream(self, request: generate_pb2.GenerateRequest, context):
        async with grpc_caller(self.gate, context):
            async for message in self._generate_stream(request, context):
                yield message

    async def _generate(self, request: generate_pb2.GenerateRequest, context):
        with _server_span("Generate", context):
            generation, request_id = await self._start(request, context)
            sequences = await collect(generation)
            _annotate_usage(generation.usage)
            return generate_pb2.GenerateResponse(
                request_id=request_id,
                model=request.model or self.core.model_name,
                sequences=[_sequence(sequence) for sequence in sequences],
                usage=_usage(generation.usage),
            )

    async def _generate_stream(self, request: generate_pb2.GenerateRequest, context):
        with _server_span("GenerateStream", context):
            generation, request_id = await self._start(request, context)
            try:
                async for chunk in generation:
                    message = generate_pb2.GenerateStreamResponse(
                        request_id=request_id,
                        model=request.model or self.core.model_name,
                        deltas=[_delta(chunk)],
                    )
                    if generation.is_done:  # the stream's last message carries usage
                        message.usage.CopyFrom(_usage(generation.usage))
                        _annotate_usage(generation.usage)
                    yield message
            finally:
                generation.cancel()  # the client went away (or a pod failed): abort on the pods

    async def _start(
        self, request: generate_pb2.GenerateRequest, context
    ) -> tuple[Generation, str]:
        try:
            lora_name = self.core.served_models().lora_name(request.model or None)
        except RequestError as error:  # HTTP's 404
            raise StatusError(grpc.StatusCode.NOT_FOUND, str(error)) from None
        with tracing.child_span("gateway.tokenize", None):
            prompt = self._prompt(request)
        with tracing.child_span("gateway.validate", None):
            params = params_from_options(request.sampling)
        request_id = request.request_id or f"gen-{uuid.uuid4().hex}"
        metadata = dict(context.invocation_metadata() or ())
        generation_request = GenerationRequest(
            request_id, [prompt], params, request.priority, lora_name=lora_name
        )
        generation = await self.core.start(
            generation_request, metadata.get(REGION_METADATA, ""), requested_slo(metadata)
        )
        return generation, request_id

    def _prompt(self, request: generate_pb2.GenerateRequest) -> list[int]:
        kind = request.WhichOneof("prompt")
        if kind == "text":
            return self.core.encode(request.text)
        if kind == "token_ids":
            return list(request.token_ids.ids)
        if kind == "chat":
            messages = [{"role": m.role, "content": m.content} for m in request.chat.messages]
            if not messages:
                raise ValueError("messages must not be empty")
            return self.core.encode_chat(messages)
        raise ValueError("prompt must be set: text, token_ids or chat")


def _server_span(method: str, context):
    """The call's server span (child of the caller's trace context), current for the block;
    nothing at all while tracing is off."""
    if not tracing.is_enabled():
        return nullcontext()
    return _traced_call(f"splitserve.v1.Generation/{method}", context)


@contextmanager
def _traced_call(name: str, context) -> Iterator[None]:
    span = tracing.start_span(
        name,
        tracing.context_from_grpc(context),
        {"rpc.system": "grpc", "rpc.method": name},
        tracing.SpanKind.SERVER,
    )
    with tracing.span_scope(span), tracing.use_span(span):
        yield


def _annotate_usage(usage: Usage) -> None:
    span = tracing.current_span()
    if span.is_recording():
        span.set_attribute(tracing.INPUT_TOKENS, usage.prompt_tokens)
        span.set_attribute(tracing.OUTPUT_TOKENS, usage.completion_tokens)
        span.set_attribute(tracing.CACHED_TOKENS, usage.cached_tokens)


def _delta(chunk: SequenceChunk) -> generate_pb2.SequenceDelta:
    return generate_pb2.SequenceDelta(**_sequence_fields(chunk))


def _sequence(sequence: CollectedSequence) -> generate_pb2.Sequence:
    return generate_pb2.Sequence(**_sequence_fields(sequence))


class _SequenceFields(TypedDict):
    index: int
    text: str
    token_ids: list[int]
    logprobs: list[generate_pb2.TokenLogprob]
    finish_reason: str
    stop_reason: str


def _sequence_fields(part: SequenceChunk | CollectedSequence) -> _SequenceFields:
    """What `Sequence` and `SequenceDelta` share: all their fields; unset reasons are ""."""
    return {
        "index": part.index,
        "text": part.text,
        "token_ids": part.token_ids,
        "logprobs": part.logprobs,
        "finish_reason": part.finish_reason or "",
        "stop_reason": part.stop_reason or "",
    }


def _usage(usage: Usage) -> generate_pb2.Usage:
    return generate_pb2.Usage(
        prompt_tokens=usage.prompt_tokens,
        completion_tokens=usage.completion_tokens,
        cached_tokens=usage.cached_tokens,
        cached_tokens_by_tier=usage.cached_tokens_by_tier,
    )
