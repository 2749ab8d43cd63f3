"""A sequence whose decode pod is gone before it streamed anything is retried on another pod;
one that already streamed tokens migrates there with them. A pod found unreachable cools down
even when no retry follows, and a retry prefers a prefill pod other than the failed attempt's.

Three real decode pods and two prefill pods (separate processes serving the tiny random
checkpoint, so they start in seconds) and the gateway's request path in this process: its
`GatewayCore`, `Router` and `PodPool`, the code `python -m splitserve.gateway` runs. The
prompts are shorter than a decode pod's local-prefill threshold, so the prefill pods are only
routed to, never called. Each gateway here polls its pods once
and then no more, so a pod killed with SIGKILL stays "available" to its router, as a vanished
pod does in a running gateway until its next stats poll (up to 0.5 s): the window in which a
request is routed to a pod that is gone, held open for as long as the test needs instead of
raced against.

Round robin takes pods in pod-id order from turn 0, both roles by the same turn: the first
request of a gateway over (decode-0, decode-2) goes to decode-0 (and prefill-0), over
(decode-1, decode-2) to decode-1. The first test
kills decode-0, the second decode-1, and decode-2 stays up, in whatever order they run.
"""

from __future__ import annotations

import asyncio
import functools
import signal
import subprocess
import sys
from dataclasses import dataclass

import grpc
import pytest

from splitserve.common.model_files import default_model_name, load_tokenizer
from splitserve.common.supervisor import HealthCheck, ProcessSpec, Supervisor
from splitserve.engine.sampling_params import SamplingParams
from splitserve.engine.tokenizer import Tokenizer
from splitserve.gateway import generation as generation_module
from splitserve.gateway.core import GatewayCore, GenerationRequest
from splitserve.gateway.generation import PodError, collect
from splitserve.gateway.metrics import GatewayMetrics
from splitserve.gateway.routing.pods import PodPool
from splitserve.gateway.routing.router import Router, RouterSettings
from tests.services_util import STARTUP_TIMEOUT_SECONDS, free_port, wait_until_idle

DECODE_POD_NAMES = ("decode-0", "decode-1", "decode-2")
PREFILL_POD_NAMES = ("prefill-0", "prefill-1")
# No background polls and no end to a pod's cooldown while a test runs.
FROZEN_SECONDS = 3600.0
PROMPTS = ["The capital of France is", "Once upon a time", "def fibonacci(n):", "Water boils at"]
SEEDED = SamplingParams(temperature=0.8, seed=7, max_tokens=12, ignore_eos=True)
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
# Long enough to be killed or cancelled mid-stream (the tiny model takes milliseconds a step).
LONG = SamplingParams(temperature=0.0, max_tokens=3000, ignore_eos=True)


@dataclass(frozen=True)
class Pod:
    address: str
    process: subprocess.Popen

    def kill(self) -> None:
        """SIGKILL: no deregistration, no drain; its connections are reset."""
        self.process.send_signal(signal.SIGKILL)
        self.process.wait(timeout=10)


@pytest.fixture(scope="module")
def pods(tiny_hf_checkpoint: str):
    """decode-0..2 and prefill-0..1 serving the tiny checkpoint; name -> Pod. Prefix caching
    is off so that a request computes the same shapes however often it is sent (seeded outputs
    compare)."""
    supervisor = Supervisor()
    flags = ["--model", tiny_hf_checkpoint, "--no-prefix-caching", "--kv-cache-bytes", "16MiB"]
    flags += ["--num-threads", "1", "--kv-transport", "tcp", "--log-level", "warning"]
    roles = [("decode", "DecodeWorker", name) for name in DECODE_POD_NAMES]
    roles += [("prefill", "PrefillWorker", name) for name in PREFILL_POD_NAMES]
    started = {}
    try:
        for role, service, name in roles:
            port = free_port()
            argv = [sys.executable, "-m", f"services.{role}", "--host", "127.0.0.1"]
            argv += ["--port", str(port), "--worker-id", name, *flags]
            address = f"127.0.0.1:{port}"
            health = HealthCheck(address, f"splitserve.v1.{service}")
            started[name] = Pod(address, supervisor.start(ProcessSpec(name, argv, health)))
        supervisor.wait_healthy(STARTUP_TIMEOUT_SECONDS)
        yield started
    finally:
        supervisor.stop()


@pytest.fixture(scope="module")
def tokenizer(tiny_hf_checkpoint: str) -> Tokenizer:
    return load_tokenizer(tiny_hf_checkpoint)


@dataclass(frozen=True)
class Served:
    first_address: str  # the decode pod the request was first routed to
    final_address: str  # the one that served it
    token_ids: list[int]
    first_prefill_address: str | None = None  # the prefill pods named to those decode pods
    final_prefill_address: str | None = None


class Gateway:
    """The gateway's request path over static decode (and prefill) pods, round robin, view
    frozen after its first poll."""

    def __init__(
        self, tokenizer: Tokenizer, model_name: str, pods: list[Pod], prefill_pods: list[Pod]
    ) -> None:
        self.pool = _frozen_pool("decode", pods, model_name)
        self.prefill_pool = _frozen_pool("prefill", prefill_pods, model_name)
        router = Router(self.pool, self.prefill_pool, RouterSettings(policy="round_robin"))
        self.core = GatewayCore(
            tokenizer, model_name, self.pool, self.prefill_pool, GatewayMetrics(), router
        )

    async def __aenter__(self) -> Gateway:
        for pool in (self.pool, self.prefill_pool):
            await pool.start()
            available = {pod.address for pod in pool.available()}
            assert available == set(pool.addresses), "every pod must be up before any is killed"
        return self

    async def __aexit__(self, *exc) -> None:
        await self.pool.close()
        await self.prefill_pool.close()

    @property
    def available_addresses(self) -> set[str]:
        """The decode pods routing may choose now."""
        return {pod.address for pod in self.pool.available()}

    @property
    def num_retries(self) -> float:
        return self.core.metrics.registry.get_sample_value("splitserve:routing_retries_total")

    def request(self, request_id: str, text: str, params: SamplingParams) -> GenerationRequest:
        return GenerationRequest(request_id, [self.core.encode(text)], params)

    async def serve(self, request_id: str, text: str, params: SamplingParams) -> Served:
        generation = await self.core.start(self.request(request_id, text, params))
        # The calls start once this coroutine waits: these are the first routing decisions.
        (first,) = generation.decisions
        (sequence,) = await collect(generation)
        (final,) = generation.decisions
        assert sequence.finish_reason == "length", "every request here runs to max_tokens"
        return Served(
            first.decode_address,
            final.decode_address,
            sequence.token_ids,
            first.prefill_address,
            final.prefill_address,
        )


def _frozen_pool(role: str, pods: list[Pod], model_name: str) -> PodPool:
    return PodPool(
        role,
        [pod.address for pod in pods],
        model_name,
        poll_interval_s=FROZEN_SECONDS,
        unreachable_cooldown_s=FROZEN_SECONDS,
    )


def _gateway(
    tokenizer: Tokenizer, tiny_hf_checkpoint: str, *pods: Pod, prefill: tuple[Pod, ...] = ()
) -> Gateway:
    return Gateway(tokenizer, default_model_name(tiny_hf_checkpoint), list(pods), list(prefill))


def _run(coroutine, timeout: float = 60.0):
    return asyncio.run(asyncio.wait_for(coroutine, timeout))


def test_requests_routed_to_a_killed_pod_are_retried_on_another_pod(
    pods, tokenizer, tiny_hf_checkpoint
):
    dead, live = pods["decode-0"], pods["decode-2"]
    prefill = (pods["prefill-0"], pods["prefill-1"])
    gateway = functools.partial(_gateway, tokenizer, tiny_hf_checkpoint)

    async def scenario():
        # Every gateway polls while both pods are up, so each still routes to `dead` after it.
        async with (
            gateway(dead, live) as single,
            gateway(dead, live) as burst,
            gateway(dead, live) as cancelling,
            gateway(dead) as alone,
            gateway(dead, live) as without_retries,
            gateway(dead, live, prefill=prefill) as disaggregated,
            gateway(dead, live, prefill=prefill[:1]) as one_prefill,
        ):
            dead.kill()
            await _a_seeded_request_is_retried_with_its_seed(single, dead, live)
            await _a_burst_completes_with_one_retry_per_request_sent_to_the_dead_pod(
                burst, dead, live
            )
            await _cancelling_a_retried_request_frees_its_blocks(cancelling, live)
            await _without_another_pod_the_request_fails_unavailable(alone, dead)
            await _the_pod_of_the_last_allowed_attempt_cools_down_too(without_retries, dead, live)
            await _a_retry_prefers_another_prefill_pod_than_the_failed_attempts(
                disaggregated, dead, live, prefill
            )
            await _a_retry_keeps_the_only_prefill_pod(one_prefill, dead, live, prefill[0])

    _run(scenario())


async def _a_seeded_request_is_retried_with_its_seed(
    gateway: Gateway, dead: Pod, live: Pod
) -> None:
    served = await gateway.serve("seeded", PROMPTS[0], SEEDED)
    assert (served.first_address, served.final_address) == (dead.address, live.address)
    assert len(served.token_ids) == SEEDED.max_tokens
    assert gateway.num_retries == 1
    # The dead pod cools down: the same request id and seed now go straight to the live pod,
    # and sample the very same tokens, so the retry was the same request.
    again = await gateway.serve("seeded", PROMPTS[0], SEEDED)
    assert again.first_address == live.address
    assert gateway.num_retries == 1
    assert again.token_ids == served.token_ids


async def _a_burst_completes_with_one_retry_per_request_sent_to_the_dead_pod(
    gateway: Gateway, dead: Pod, live: Pod
) -> None:
    # Three prompts twice each: turns 0-5 alternate the pods, so each prompt is served once
    # after a retry and once straight.
    prompts = [PROMPTS[i % 3] for i in range(6)]
    requests = [gateway.serve(f"burst-{i}", text, GREEDY) for i, text in enumerate(prompts)]
    served = await asyncio.gather(*requests)
    num_sent_to_dead = sum(s.first_address == dead.address for s in served)
    assert num_sent_to_dead == 3  # round robin over two pods, all routed before any call ran
    assert gateway.num_retries == num_sent_to_dead
    assert all(s.final_address == live.address for s in served)
    assert all(len(s.token_ids) == GREEDY.max_tokens for s in served)
    # Greedy: a retried request answers what the same prompt sent straight to the live pod does.
    for text in set(prompts):
        pair = [s for s, p in zip(served, prompts, strict=True) if p == text]
        assert {s.first_address for s in pair} == {dead.address, live.address}
        assert pair[0].token_ids == pair[1].token_ids


async def _cancelling_a_retried_request_frees_its_blocks(gateway: Gateway, live: Pod) -> None:
    generation = await gateway.core.start(gateway.request("cancelled", PROMPTS[1], LONG))
    first_chunk = await anext(generation)  # served by the live pod, after the retry
    assert first_chunk.token_ids
    assert gateway.num_retries == 1
    generation.cancel()  # what a client going away does
    stats = await asyncio.to_thread(wait_until_idle, live.address)
    assert stats.num_running == 0
    assert stats.kv_blocks_free == stats.kv_blocks_total


async def _without_another_pod_the_request_fails_unavailable(gateway: Gateway, dead: Pod) -> None:
    with pytest.raises(PodError, match=dead.address) as failure:
        await gateway.serve("alone", PROMPTS[2], GREEDY)
    assert failure.value.code == grpc.StatusCode.UNAVAILABLE  # HTTP 503
    assert gateway.num_retries == 0
    assert gateway.available_addresses == set()  # the dead pod cools down


async def _the_pod_of_the_last_allowed_attempt_cools_down_too(
    gateway: Gateway, dead: Pod, live: Pod
) -> None:
    # With no retries allowed the first attempt is the last: its pod must cool down all the
    # same, or every request routed to it meanwhile fails too. Marking it picks nothing.
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(generation_module, "MAX_DECODE_RETRIES", 0)
        with pytest.raises(PodError, match=dead.address) as failure:
            await gateway.serve("last-attempt", PROMPTS[2], GREEDY)
    assert failure.value.code == grpc.StatusCode.UNAVAILABLE
    assert gateway.num_retries == 0
    assert gateway.available_addresses == {live.address}
    dispatched = {pod.address: pod.num_dispatched for pod in gateway.pool.pods}
    assert dispatched == {dead.address: 1, live.address: 0}
    # Round robin's next turn is the dead pod's, but routing skips it now.
    served = await gateway.serve("after-last-attempt", PROMPTS[2], GREEDY)
    assert (served.first_address, served.final_address) == (live.address, live.address)
    assert gateway.num_retries == 0


async def _a_retry_prefers_another_prefill_pod_than_the_failed_attempts(
    gateway: Gateway, dead: Pod, live: Pod, prefill: tuple[Pod, Pod]
) -> None:
    # Both requests are routed before either call runs: turn 0 takes (dead, prefill-0), turn 1
    # (live, prefill-1). The retry comes at turn 2, prefill-0's turn; but prefill-0 may still
    # hold the first attempt under the same request id and refuse the resend's prefill.
    retried, straight = await asyncio.gather(
        gateway.serve("disaggregated-0", PROMPTS[0], GREEDY),
        gateway.serve("disaggregated-1", PROMPTS[1], GREEDY),
    )
    first, second = (pod.address for pod in prefill)
    assert (straight.first_address, straight.first_prefill_address) == (live.address, second)
    assert (retried.first_address, retried.first_prefill_address) == (dead.address, first)
    assert (retried.final_address, retried.final_prefill_address) == (live.address, second)
    assert gateway.num_retries == 1
    assert len(retried.token_ids) == len(straight.token_ids) == GREEDY.max_tokens


async def _a_retry_keeps_the_only_prefill_pod(
    gateway: Gateway, dead: Pod, live: Pod, prefill: Pod
) -> None:
    served = await gateway.serve("one-prefill", PROMPTS[3], GREEDY)
    assert (served.first_address, served.first_prefill_address) == (dead.address, prefill.address)
    assert (served.final_address, served.final_prefill_address) == (live.address, prefill.address)
    assert gateway.num_retries == 1


# make test stays well under 15 min: ~10 s; test_migration kills pods mid-stream too
@pytest.mark.slow
def test_a_stream_that_produced_tokens_migrates_instead_of_being_resent(
    pods, tokenizer, tiny_hf_checkpoint
):
    """Resending would repeat what the client has seen: the sequence moves to the other pod
    with its tokens so far and continues after them (services/gateway/migration.py)."""
    doomed, other = pods["decode-1"], pods["decode-2"]

    async def scenario():
        async with _gateway(tokenizer, tiny_hf_checkpoint, doomed, other) as gateway:
            generation = await gateway.core.start(gateway.request("streaming", PROMPTS[3], LONG))
            assert generation.decisions[0].decode_address == doomed.address
            tokens = list((await anext(generation)).token_ids)
            assert tokens  # the client has seen output
            doomed.kill()
            async for chunk in generation:
                tokens += chunk.token_ids
            assert len(tokens) == LONG.max_tokens  # nothing repeated, nothing lost
            assert gateway.num_retries == 0
            migrations = gateway.core.metrics.registry.get_sample_value(
                "splitserve:migrations_total", {"cause": "unavailable"}
            ) or gateway.core.metrics.registry.get_sample_value(
                "splitserve:migrations_total", {"cause": "reset"}
            )
            assert migrations == 1
            assert generation.decisions[0].decode_address == other.address
            assert generation.usage.completion_tokens == LONG.max_tokens
            # Greedy: the tokens equal the same request served by the live pod alone.
            alone = await gateway.serve("alone", PROMPTS[3], LONG)
            assert alone.token_ids == tokens
            stats = await asyncio.to_thread(wait_until_idle, other.address)
            assert stats.num_running == 0

    _run(scenario())


def test_a_pod_marked_unreachable_is_skipped_until_it_answers_a_later_poll(
    pods, tiny_hf_checkpoint
):
    pod = pods["decode-2"]  # never killed
    model_name = default_model_name(tiny_hf_checkpoint)

    async def scenario():
        pool = PodPool("decode", [pod.address], model_name, poll_interval_s=FROZEN_SECONDS)
        await pool.start()
        try:
            assert [w.address for w in pool.available()] == [pod.address]
            pool.mark_unreachable(pool.pods[0])
            assert pool.available() == []  # skipped: the cooldown has seconds to run
            await pool.poll()  # begun after the failure and answered: reachable again
            return [w.address for w in pool.available()]
        finally:
            await pool.close()

    assert _run(scenario()) == [pod.address]
