"""The gateway PROCESS discovering its pods from Redis alone: a real redis-server, one prefill and
one decode pod registered there (--redis-url), and `python -m splitserve.gateway --redis-url` with
no --decode / --prefill. OpenAI requests through it succeed, with and without the client-region
header, and the pods' registry records carry their recent TTFT and ITL.
"""

from __future__ import annotations

import asyncio
import re
import sys
import time
import urllib.request

import pytest
from openai import OpenAI

from splitserve.common.redis_server import RedisServer
from splitserve.common.registry_schema import PodRecord, RegistryKeys, connect, read_pods
from splitserve.common.supervisor import HealthCheck, ProcessSpec, Supervisor
from tests.services_util import MODEL_NAME, STARTUP_TIMEOUT_SECONDS, free_port, get_json

# make test stays well under 15 min: a stack of its own (~11 s); test_cache_aware_routing covers
# pods found in Redis.
pytestmark = pytest.mark.slow

REGION = "us-east"
POD_FLAGS = ["--kv-cache-bytes", "32MiB", "--num-threads", "1", "--kv-transport", "tcp"]
POD_FLAGS += ["--log-level", "warning", "--region", REGION, "--zone", f"{REGION}-1a"]


@pytest.fixture(scope="module")
def redis_server():
    with RedisServer() as server:
        yield server


@pytest.fixture(scope="module")
def gateway_url(redis_server):
    """The gateway's base URL, once it sees both pods through Redis."""
    with Supervisor() as supervisor:
        for role, extra in [("prefill", []), ("decode", ["--local-prefill-threshold", "0"])]:
            address = f"127.0.0.1:{free_port()}"
            argv = [sys.executable, "-m", f"services.{role}", "--host", "127.0.0.1"]
            argv += ["--port", address.rsplit(":", 1)[1], "--worker-id", f"{role}-0"]
            argv += [*POD_FLAGS, "--redis-url", redis_server.url, *extra]
            health = HealthCheck(address, f"splitserve.v1.{role.capitalize()}Worker")
            supervisor.start(ProcessSpec(f"{role}-0", argv, health))
        http_port = free_port()
        argv = [sys.executable, "-m", "splitserve.gateway", "--host", "127.0.0.1"]
        argv += ["--port", str(http_port), "--grpc-port", str(free_port())]
        argv += ["--redis-url", redis_server.url, "--log-level", "warning"]
        url = f"http://127.0.0.1:{http_port}"
        supervisor.start(ProcessSpec("gateway", argv, HealthCheck(http_url=f"{url}/health")))
        supervisor.wait_healthy(STARTUP_TIMEOUT_SECONDS)
        _wait_until_the_gateway_sees_both_pods(url)
        yield url


def _wait_until_the_gateway_sees_both_pods(url: str) -> None:
    deadline = time.monotonic() + 30
    while True:
        workers = get_json(f"{url}/health").body.get("workers", {})
        if all(any(workers.get(role, {}).values()) for role in ("prefill", "decode")):
            return
        assert time.monotonic() < deadline, f"the gateway never saw both pods: {workers}"
        time.sleep(0.1)


def _client(url: str) -> OpenAI:
    return OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)


def _routing_decisions(url: str) -> float:
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as response:
        text = response.read().decode()
    pattern = r"^splitserve:routing_decisions_total\{[^}]*\} ([0-9.e+]+)$"
    return sum(float(value) for value in re.findall(pattern, text, re.MULTILINE))


def _chat(url: str, question: str, headers: dict[str, str] | None = None):
    return _client(url).chat.completions.create(
        model=MODEL_NAME,
        messages=[{"role": "user", "content": question}],
        max_tokens=4,
        temperature=0.0,
        extra_headers=headers,
    )


def test_chat_completion_through_pods_found_in_redis(gateway_url):
    before = _routing_decisions(gateway_url)
    response = _chat(gateway_url, "What is the capital of France?")
    assert response.choices[0].message.content
    assert response.usage.completion_tokens == 4
    assert _routing_decisions(gateway_url) == before + 1  # routed, not rejected


@pytest.mark.parametrize("region", [REGION, "eu-west"])
def test_client_region_header_is_served(gateway_url, region):
    """The pods' own region, and one with no pods (the gateway serves it from the others)."""
    before = _routing_decisions(gateway_url)
    response = _chat(gateway_url, "Name a colour.", {"x-splitserve-region": region})
    assert response.usage.completion_tokens == 4
    assert _routing_decisions(gateway_url) == before + 1


def _has_latencies(pods: dict[str, PodRecord]) -> bool:
    measured = all(pod.recent_ttft_s > 0 for pod in pods.values())
    return len(pods) == 2 and measured and pods["decode"].recent_itl_s > 0


def test_registry_records_carry_recent_latencies(gateway_url, redis_server):
    _chat(gateway_url, "Say hello.")

    async def records():
        client = connect(redis_server.url)
        try:
            deadline = time.monotonic() + 10
            while True:
                pods = {pod.role: pod for pod in await read_pods(client, RegistryKeys())}
                if time.monotonic() > deadline or _has_latencies(pods):
                    return pods
                await asyncio.sleep(0.1)
        finally:
            await client.aclose()

    pods = asyncio.run(records())
    assert set(pods) == {"prefill", "decode"}
    # Seconds, measured on each pod: a served request's TTFT is positive and well under the
    # client's timeout; 4 tokens give the decode pod 3 inter-token gaps.
    for role in ("prefill", "decode"):
        assert 0 < pods[role].recent_ttft_s < 120, pods[role]
    assert 0 < pods["decode"].recent_itl_s < 120
    assert pods["prefill"].recent_itl_s == 0.0  # a prefill pod makes one token per request
