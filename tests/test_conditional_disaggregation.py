"""Conditional disaggregation: a decode pod started with --max-remote-prefill-tokens prefills a
prompt itself while that many of its prompt tokens are already in flight at the prefill pod
(services/decode/remote_prefill.py), and sends it when the prefill pod is idle.

One prefill pod and one decode pod (real processes, gRPC, KV pages over TCP), driven with
direct Decode calls, whose responses say where each prompt was prefilled; every output is
checked token for token against the offline engine.
"""

from __future__ import annotations

import asyncio

import pytest

from splitserve import LLM, SamplingParams
from splitserve.common.channels import aio_channel, sync_channel
from splitserve.decode.__main__ import build_parser, settings_from_args
from splitserve.decode.remote_prefill import RemotePrefillSettings
from splitserve.v1 import worker_pb2_grpc
from tests.services_util import (
    Stack,
    prefill_stats,
    single_threaded_reference,
    start_stack,
    wait_until_idle,
)
from tests.test_disaggregated_serving import TEXTS, decode_request

GREEDY = SamplingParams(max_tokens=6, temperature=0.0)
# One token: any prompt in flight at the prefill pod keeps the next one here.
LIMIT = 1


@pytest.fixture(scope="module")
def stack():
    started = start_stack(
        num_prefill=1, transport="tcp", decode_flags=["--max-remote-prefill-tokens", str(LIMIT)]
    )
    try:
        yield started.wait_healthy()
    finally:
        started.stop()


@pytest.fixture(scope="module")
def llm(stack) -> LLM:
    with single_threaded_reference(128 * 2**20) as reference:
        yield reference


def _prompts(llm: LLM, tag: str, count: int) -> list[list[int]]:
    # A tag first: no earlier request shares the first block, so nothing is cached here.
    return [llm.tokenizer.encode(f"[{tag} {i}] {TEXTS[i % len(TEXTS)]}") for i in range(count)]


def _expected(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    outputs = llm.generate(prompts, GREEDY)
    return [output.outputs[0].token_ids for output in outputs]


async def _decode_all(stack: Stack, prompts: list[list[int]], tag: str) -> list[list]:
    async with aio_channel(stack.decode_addresses[0]) as channel:
        stub = worker_pb2_grpc.DecodeWorkerStub(channel)

        async def one(i: int, prompt: list[int]) -> list:
            request = decode_request(f"{tag}-{i}", prompt, GREEDY, stack.prefill_addresses[0])
            return [response async for response in stub.Decode(request, timeout=120)]

        return await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))


def _modes_and_tokens(responses: list) -> tuple[set[str], list[int]]:
    return {r.prefill_mode for r in responses}, [t for r in responses for t in r.token_ids]


@pytest.mark.slow  # a stack of its own: ~25 s, and the fast suite is near its 15 minutes
def test_prompts_sent_while_the_prefill_pod_is_busy_are_prefilled_here(stack, llm):
    prompts = _prompts(llm, "busy", 4)
    wants = _expected(llm, prompts)
    queried_before = prefill_stats(stack.prefill_addresses[0]).prefix_cache_queried_tokens

    results = asyncio.run(_decode_all(stack, prompts, "busy"))

    modes = [_modes_and_tokens(responses)[0] for responses in results]
    assert all(len(m) == 1 for m in modes), modes  # one mode per request
    modes_seen = [next(iter(m)) for m in modes]
    # The first prompt found the prefill pod idle; the others came while it was in flight.
    assert "remote" in modes_seen and "local-busy" in modes_seen, modes_seen
    assert [_modes_and_tokens(r)[1] for r in results] == wants
    # The prefill pod saw exactly the prompts sent to it.
    remote_tokens = sum(len(p) for p, m in zip(prompts, modes_seen, strict=True) if m == "remote")
    queried = prefill_stats(stack.prefill_addresses[0]).prefix_cache_queried_tokens
    assert queried - queried_before == remote_tokens
    stats = wait_until_idle(stack.decode_addresses[0])
    assert stats.kv_blocks_free == stats.kv_blocks_total


@pytest.mark.slow
def test_an_idle_prefill_pod_takes_every_prompt_whatever_the_limit(stack, llm):
    prompts = _prompts(llm, "idle", 2)
    wants = _expected(llm, prompts)
    with sync_channel(stack.decode_addresses[0]) as channel:
        stub = worker_pb2_grpc.DecodeWorkerStub(channel)
        for i, (prompt, want) in enumerate(zip(prompts, wants, strict=True)):
            request = decode_request(f"idle-{i}", prompt, GREEDY, stack.prefill_addresses[0])
            modes, tokens = _modes_and_tokens(list(stub.Decode(request, timeout=120)))
            assert (modes, tokens) == ({"remote"}, want)


def test_the_limit_is_a_decode_pod_flag_and_refuses_negative_values():
    args = build_parser().parse_args(["--max-remote-prefill-tokens", "2048"])
    assert settings_from_args(args).max_remote_tokens == 2048
    assert RemotePrefillSettings().max_remote_tokens == 0  # default: always send
    with pytest.raises(ValueError, match="max_remote_tokens"):
        RemotePrefillSettings(max_remote_tokens=-1)


def test_the_limit_grows_with_the_streams_a_local_prefill_would_stall():
    """max_remote_tokens per running stream plus one: a pod running nothing prefills itself
    past one limit's worth in flight, one running three streams past four."""
    from splitserve.common.conditional_prefill import prefill_pod_is_full

    assert not prefill_pod_is_full(256, 0, 4096, num_running=0)  # an idle prefill pod
    assert prefill_pod_is_full(256, 256, 256, num_running=0)
    assert not prefill_pod_is_full(256, 256, 256, num_running=1)
    assert not prefill_pod_is_full(256, 768, 256, num_running=3)
    assert prefill_pod_is_full(256, 769, 256, num_running=3)
    assert not prefill_pod_is_full(0, 10_000, 256, num_running=0)  # 0: no limit
