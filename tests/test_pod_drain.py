"""Graceful drain of a real decode pod process: on SIGTERM mid-stream it leaves the Redis registry
at once, refuses new calls, lets the running stream finish within --drain-timeout, then exits 0;
a stream longer than the drain timeout is cut when it runs out."""

from __future__ import annotations

import asyncio
import signal
import sys
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from splitserve.common.channels import sync_channel
from splitserve.common.redis_server import RedisServer
from splitserve.common.registry_schema import RegistryKeys, connect, read_pods
from splitserve.common.supervisor import HealthCheck, ProcessSpec, Supervisor
from splitserve.v1 import generate_pb2, worker_pb2, worker_pb2_grpc
from tests.services_util import STARTUP_TIMEOUT_SECONDS, free_port

PROMPT = list(range(1000, 1040))


@pytest.fixture(scope="module")
def redis_server():
    with RedisServer() as server:
        yield server


def _start_decode_pod(supervisor: Supervisor, redis_url: str, drain_timeout: float):
    address = f"127.0.0.1:{free_port()}"
    argv = [sys.executable, "-m", "splitserve.decode", "--host", "127.0.0.1"]
    argv += ["--port", address.rsplit(":", 1)[1], "--worker-id", "decode-drain"]
    argv += ["--kv-cache-bytes", "32MiB", "--num-threads", "1", "--log-level", "warning"]
    argv += ["--redis-url", redis_url, "--drain-timeout", str(drain_timeout)]
    health = HealthCheck(address, "splitserve.v1.DecodeWorker")
    process = supervisor.start(ProcessSpec("decode", argv, health))
    supervisor.wait_healthy(STARTUP_TIMEOUT_SECONDS)
    return address, process


def _request(request_id: str, max_tokens: int) -> worker_pb2.DecodeRequest:
    sampling = generate_pb2.SamplingOptions(max_tokens=max_tokens, temperature=0.0)
    sampling.ignore_eos = True  # the stream's length is max_tokens, whatever the model says
    return worker_pb2.DecodeRequest(
        request_id=request_id, prompt_token_ids=PROMPT, sampling=sampling
    )


def _registered(redis_url: str) -> set[str]:
    async def read() -> set[str]:
        client = connect(redis_url)
        try:
            return {pod.pod_id for pod in await read_pods(client, RegistryKeys())}
        finally:
            await client.aclose()

    return asyncio.run(read())


def _wait_registered(redis_url: str, expected: bool, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while ("decode-drain" in _registered(redis_url)) != expected:
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def _wait_not_serving(channel: grpc.Channel, timeout: float = 10.0) -> bool:
    """Registry first, then health: the pod turns NOT_SERVING as it stops taking calls."""
    health = health_pb2_grpc.HealthStub(channel)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            status = health.Check(health_pb2.HealthCheckRequest(), timeout=2).status
        except grpc.RpcError:
            return True  # refused: the server no longer takes calls
        if status == health_pb2.HealthCheckResponse.NOT_SERVING:
            return True
        time.sleep(0.02)
    return False


def test_sigterm_mid_stream_deregisters_refuses_new_calls_and_finishes_the_stream(
    redis_server,
):
    with Supervisor() as supervisor:
        address, process = _start_decode_pod(supervisor, redis_server.url, drain_timeout=60)
        assert _wait_registered(redis_server.url, True)
        with sync_channel(address) as channel:
            stub = worker_pb2_grpc.DecodeWorkerStub(channel)
            stream = stub.Decode(_request("long", 64), timeout=120)
            responses = [next(stream)]  # generating: now stop the pod
            process.send_signal(signal.SIGTERM)
            assert _wait_registered(redis_server.url, False), "still in the registry"
            assert process.poll() is None, "the pod exited with a stream in flight"
            assert _wait_not_serving(channel), "health never turned NOT_SERVING"
            with pytest.raises(grpc.RpcError) as refused:
                list(stub.Decode(_request("late", 4), timeout=30))
            assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
            responses += list(stream)
        assert sum(len(r.token_ids) for r in responses) == 64
        assert responses[-1].finish_reason == "length"
        assert process.wait(timeout=30) == 0


@pytest.mark.slow  # ~9 s; the fast suite measured 14:32 on a quiet evening
def test_drain_timeout_cuts_a_stream_that_outlasts_it(redis_server):
    with Supervisor() as supervisor:
        address, process = _start_decode_pod(supervisor, redis_server.url, drain_timeout=1)
        with sync_channel(address) as channel:
            stub = worker_pb2_grpc.DecodeWorkerStub(channel)
            stream = stub.Decode(_request("endless", 4000), timeout=300)
            tokens = len(next(stream).token_ids)
            signalled = time.monotonic()
            process.send_signal(signal.SIGTERM)
            with pytest.raises(grpc.RpcError):
                for response in stream:
                    tokens += len(response.token_ids)
        assert process.wait(timeout=30) == 0
        assert time.monotonic() - signalled < 25, "the pod waited past its drain timeout"
        assert tokens < 4000
