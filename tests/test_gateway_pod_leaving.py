"""A decode pod leaving the registry (it got SIGTERM and is draining) must not cut the streams
the gateway has open to it; a stream cut from outside must end the client's request with an
error, never leave it waiting. A real grpc.aio server stands in for the decode pod's Decode
stream; the gateway side is its real PodPool and Generation."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from splitserve.common.registry_schema import PodRecord
from splitserve.gateway.generation import Generation, PodError
from splitserve.gateway.generation import SequenceCall as _Child
from splitserve.gateway.metrics import GatewayMetrics
from splitserve.gateway.routing.pods import PodPool
from splitserve.v1 import worker_pb2

NUM_CHUNKS = 30


async def _stream(request, context):
    for index in range(NUM_CHUNKS):
        last = index == NUM_CHUNKS - 1
        response = worker_pb2.DecodeResponse(
            text="x", token_ids=[7], finish_reason="length" if last else ""
        )
        yield response.SerializeToString()
        await asyncio.sleep(0.02)


async def _serve_decode_stream() -> tuple[grpc.aio.Server, str]:
    server = grpc.aio.server()
    handler = grpc.method_handlers_generic_handler(
        "splitserve.v1.DecodeWorker", {"Decode": grpc.unary_stream_rpc_method_handler(_stream)}
    )
    server.add_generic_rpc_handlers((handler,))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, f"127.0.0.1:{port}"


async def _generation_on_a_registered_pod(address: str) -> tuple[PodPool, Generation]:
    pool = PodPool("decode", [], "model")
    await pool.apply_records([PodRecord("decode-0", "decode", address, generation=1)])
    (pod,) = pool.pods
    child = _Child(0, 0, worker_pb2.DecodeRequest(request_id="r"), pod, None)
    return pool, Generation([child], 4, GatewayMetrics())


async def _count_chunks(generation: Generation) -> int:
    return sum([1 async for _ in generation])


def test_a_stream_outlives_its_pod_leaving_the_registry():
    async def scenario():
        server, address = await _serve_decode_stream()
        pool, generation = await _generation_on_a_registered_pod(address)
        try:
            reading = asyncio.create_task(_count_chunks(generation))
            await asyncio.sleep(0.15)
            await pool.apply_records([])  # the pod deregistered: it is draining
            assert pool.pods == []
            return await asyncio.wait_for(reading, 10)
        finally:
            await pool.close()
            await server.stop(0)

    assert asyncio.run(scenario()) == NUM_CHUNKS


def test_a_stream_cut_from_outside_fails_the_request_instead_of_hanging():
    async def scenario():
        server, address = await _serve_decode_stream()
        pool, generation = await _generation_on_a_registered_pod(address)
        try:
            reading = asyncio.create_task(_count_chunks(generation))
            await asyncio.sleep(0.15)
            await pool._channels[address].close()  # cancels every call on it
            return await asyncio.wait_for(reading, 10)
        finally:
            await pool.close()
            await server.stop(0)

    with pytest.raises(PodError, match="ended the stream early"):
        asyncio.run(scenario())
