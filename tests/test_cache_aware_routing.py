"""Cache-aware routing end to end: a real redis-server, two prefill pods and a decode pod (real
processes, registered in Redis), and the gateway's routing core in this process (its
`GatewayCore` and `Router`, the code the gateway runs), so each request's `RoutingDecision`
can be asserted.

- Requests sharing a long system prompt go to the prefill pod that holds it, whose prefix-cache
  hits grow by what the decision promised.
- A killed prefill pod leaves the registry, and requests go on.
- Redis killed during a burst: every request completes (routed by load, reason "redis_down");
  after Redis restarts empty the pods republish and the index fills again.
"""

from __future__ import annotations

import asyncio
import signal
import sys
import time

import pytest

from splitserve.common.model_files import load_tokenizer, resolve_model_path
from splitserve.common.redis_server import RedisServer
from splitserve.common.supervisor import HealthCheck, ProcessSpec, Supervisor
from splitserve.engine.sampling_params import SamplingParams
from splitserve.gateway.core import GatewayCore, GenerationRequest
from splitserve.gateway.generation import collect
from splitserve.gateway.routing.pods import PodPool
from splitserve.gateway.routing.router import Router, RouterSettings
from tests.services_util import MODEL_NAME, STARTUP_TIMEOUT_SECONDS, free_port, prefill_stats

SYSTEM = (
    "You are the support assistant of the Lighthouse Coffee Company. Our shops open at seven "
    "and close at nine, every day of the year except the first of January. We roast our beans "
    "on Tuesdays and Fridays, sell whole beans and ground coffee in bags of 250 grams and one "
    "kilogram, and ship to every country of the European Union within five working days. "
    "Refunds are given within thirty days for unopened bags. Answer briefly and politely. "
) * 2
QUESTIONS = ["When do you open?", "Do you ship to Spain?", "Can I get a refund?", "Decaf?"]
PARAMS = SamplingParams(temperature=0.0, max_tokens=4)


@pytest.fixture(scope="module")
def redis_server():
    with RedisServer() as server:
        yield server


@pytest.fixture(scope="module")
def pods(redis_server):
    """prefill-0, prefill-1 and decode-0, registered in Redis; name -> gRPC address."""
    supervisor = Supervisor()
    addresses, processes = {}, {}
    common = ["--kv-cache-bytes", "64MiB", "--num-threads", "1", "--kv-transport", "tcp"]
    common += ["--log-level", "warning", "--redis-url", redis_server.url]
    try:
        for name, extra in [
            ("prefill-0", []),
            ("prefill-1", []),
            ("decode-0", ["--local-prefill-threshold", "0"]),
        ]:
            role = name.split("-")[0]
            port = free_port()
            argv = [sys.executable, "-m", f"services.{role}", "--host", "127.0.0.1"]
            argv += ["--port", str(port), "--worker-id", name, *common, *extra]
            addresses[name] = f"127.0.0.1:{port}"
            health = HealthCheck(addresses[name], f"splitserve.v1.{role.capitalize()}Worker")
            processes[name] = supervisor.start(ProcessSpec(name, argv, health))
        supervisor.wait_healthy(STARTUP_TIMEOUT_SECONDS)
        yield addresses, processes
    finally:
        supervisor.stop()


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(resolve_model_path(None))


class Gateway:
    """The gateway's routing core, discovering pods from Redis only (no static addresses)."""

    def __init__(self, tokenizer, redis_url: str, use_local_index: bool = True) -> None:
        self.decode_pool = PodPool("decode", [], MODEL_NAME)
        self.prefill_pool = PodPool("prefill", [], MODEL_NAME)
        settings = RouterSettings(redis_url=redis_url, use_local_index=use_local_index)
        self.router = Router(self.decode_pool, self.prefill_pool, settings)
        self.core = GatewayCore(
            tokenizer, MODEL_NAME, self.decode_pool, self.prefill_pool, router=self.router
        )

    async def __aenter__(self) -> Gateway:
        for pool in (self.decode_pool, self.prefill_pool):
            await pool.start()
        await self.router.start()
        return self

    async def __aexit__(self, *exc) -> None:
        await self.router.close()
        for pool in (self.decode_pool, self.prefill_pool):
            await pool.close()

    def prompt(self, question: str) -> list[int]:
        messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]
        return self.core.encode_chat(messages)

    async def ask(self, question: str, request_id: str):
        """(routing decision, decoded text) of one chat request."""
        generation = await self.core.start(
            GenerationRequest(request_id, [self.prompt(question)], PARAMS)
        )
        decision = generation._children[0].decision
        sequences = await collect(generation)
        return decision, sequences[0].text

    async def wait_for(self, predicate, timeout: float = 15.0) -> bool:
        deadline = time.monotonic() + timeout
        while not predicate():
            if time.monotonic() > deadline:
                return False
            await asyncio.sleep(0.1)
        return True

    def available(self) -> set[str]:
        pools = (self.decode_pool, self.prefill_pool)
        return {pod.pod_id for pool in pools for pod in pool.available()}

    async def cached(self, question: str) -> dict[str, int]:
        pods = [*self.prefill_pool.available(), *self.decode_pool.available()]
        return await self.router.cached_tokens(self.prompt(question), pods)


def _run(coroutine, timeout: float = 240.0):
    return asyncio.run(asyncio.wait_for(coroutine, timeout))


def test_shared_system_prompt_goes_to_the_pod_that_holds_it(pods, redis_server, tokenizer):
    addresses, _ = pods

    async def scenario():
        async with Gateway(tokenizer, redis_server.url) as gateway:
            everyone = {"prefill-0", "prefill-1", "decode-0"}
            assert await gateway.wait_for(lambda: gateway.available() == everyone)
            first, _ = await gateway.ask(QUESTIONS[0], "cache-0")
            holder = first.prefill_pod_id
            # The holder's blocks reach the index a few milliseconds after its step.
            for _ in range(100):
                if (await gateway.cached(QUESTIONS[1])).get(holder, 0) > 0:
                    break
                await asyncio.sleep(0.05)
            hits_before = prefill_stats(addresses[holder]).prefix_cache_hit_tokens
            later = [(await gateway.ask(q, f"cache-{i}"))[0] for i, q in enumerate(QUESTIONS[1:3])]
            hits_after = prefill_stats(addresses[holder]).prefix_cache_hit_tokens
            return first, holder, later, hits_after - hits_before

    first, holder, later, new_hits = _run(scenario())
    assert first.prefill_pod_id in ("prefill-0", "prefill-1")
    assert first.decode_pod_id == "decode-0"
    assert first.cached_prefix_tokens == 0
    num_system_tokens = len(tokenizer.encode(SYSTEM, add_special_tokens=False))
    for decision in later:
        assert decision.prefill_pod_id == holder
        assert decision.reason == "prefix_cache"
        assert decision.cached_prefix_tokens >= num_system_tokens - 32
        assert decision.scores[holder] > max(
            score
            for pod_id, score in decision.scores.items()
            if pod_id.startswith("prefill") and pod_id != holder
        )
    assert new_hits >= sum(decision.cached_prefix_tokens for decision in later)


def test_redis_killed_during_a_burst_then_the_index_refills(pods, redis_server, tokenizer):
    async def scenario():
        # The per-request lookup path, whose every request meets the outage. With the local
        # index (the default) a burst sent in the very instant of the kill is still answered
        # from memory until the follower notices (tests/test_prefix_index.py covers that path).
        async with Gateway(tokenizer, redis_server.url, use_local_index=False) as gateway:
            assert await gateway.wait_for(lambda: len(gateway.available()) == 3)
            await gateway.ask(QUESTIONS[0], "burst-warm")
            redis_server.kill()
            burst = [gateway.ask(q, f"burst-{i}") for i, q in enumerate(QUESTIONS)]
            results = await asyncio.gather(*burst)
            redis_server.start()
            refilled = False
            deadline = time.monotonic() + 20
            while not refilled and time.monotonic() < deadline:
                await asyncio.sleep(0.2)
                refilled = max((await gateway.cached(QUESTIONS[1])).values(), default=0) > 0
            return results, refilled

    results, refilled = _run(scenario())
    assert len(results) == len(QUESTIONS)
    assert all(text for _, text in results)
    assert {decision.reason for decision, _ in results} <= {"redis_down", "load", "only_candidate"}
    assert "redis_down" in {decision.reason for decision, _ in results}
    assert refilled


def test_killed_prefill_pod_leaves_the_registry(pods, redis_server, tokenizer):
    _, processes = pods

    async def scenario():
        async with Gateway(tokenizer, redis_server.url) as gateway:
            assert await gateway.wait_for(lambda: len(gateway.available()) == 3)
            processes["prefill-1"].send_signal(signal.SIGKILL)
            left = await gateway.wait_for(
                lambda: "prefill-1" not in {p.pod_id for p in gateway.prefill_pool.pods}
            )
            decision, text = await gateway.ask(QUESTIONS[3], "after-kill")
            return left, decision, text

    left, decision, text = _run(scenario())
    assert left
    assert decision.prefill_pod_id == "prefill-0"
    assert text
