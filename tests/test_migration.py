"""No request lost when a decode pod dies or stalls mid-stream: real processes, real signals.

Three decode pods behind a gateway (stall timeout 3 s). A streamed request's pod is SIGKILLed or
SIGSTOPped after some tokens; the stream must complete as if nothing happened: the same tokens
and text as one engine produces (greedy and seeded sampling), the usage of the whole sequence,
and every surviving pod's blocks free afterwards.
"""

from __future__ import annotations

import signal
import time
import urllib.request

import pytest
import torch
from openai import OpenAI

from shared import LLM, SamplingParams
from tests.services_util import MODEL_NAME, Stack, decode_stats, start_stack, wait_until_idle

PROMPT = "The history of lighthouses begins in ancient Egypt, where"
MAX_TOKENS = 40
FAULT_AFTER_TOKENS = 10
STALL_TIMEOUT = "3"


@pytest.fixture(scope="module")
def stack():
    started = start_stack(num_decode=3, gateway_flags=["--stream-stall-timeout", STALL_TIMEOUT])
    try:
        yield started.wait_healthy()
    finally:
        started.stop()


@pytest.fixture(scope="module")
def llm(stack) -> LLM:
    """The reference, single-threaded like the pods."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield LLM(kv_cache_bytes=64 * 2**20)
    torch.set_num_threads(previous)


@pytest.fixture(scope="module")
def client(stack: Stack) -> OpenAI:
    return OpenAI(base_url=f"{stack.base_url}/v1", api_key="unused", max_retries=0, timeout=90)


def _busy_pod(stack: Stack) -> str:
    """The decode pod running the one request in flight."""
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        for address in stack.decode_addresses:
            if decode_stats(address).num_running:
                return address
        time.sleep(0.05)
    raise AssertionError("no decode pod is running the request")


_processes: dict[str, object] = {}  # decode pod address -> its process, as started


def _process(stack: Stack, address: str):
    if not _processes:
        for i, pod_address in enumerate(stack.decode_addresses):
            _processes[pod_address] = stack.processes[f"decode-{i}"]
    return _processes[address]


def _stream_with_fault(client: OpenAI, stack: Stack, sampling: dict, fault) -> tuple:
    """Streams one completion; after FAULT_AFTER_TOKENS tokens, `fault(address)` hits the pod
    serving it. Returns the text, token ids, finish reason, usage and the pod hit."""
    stream = client.completions.create(
        model=MODEL_NAME,
        prompt=PROMPT,
        max_tokens=MAX_TOKENS,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"return_token_ids": True},
        **sampling,
    )
    text, tokens, finish, usage, hit = "", [], None, None, None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        text += choice.text
        tokens += choice.model_extra.get("token_ids") or []
        finish = choice.finish_reason or finish
        if hit is None and len(tokens) >= FAULT_AFTER_TOKENS:
            hit = _busy_pod(stack)
            fault(hit)
    return text, tokens, finish, usage, hit


def _reference(llm: LLM, params: SamplingParams):
    return llm.generate([PROMPT], params)[0].outputs[0]


def _migrations(stack: Stack, cause: str) -> float:
    with urllib.request.urlopen(f"{stack.base_url}/metrics", timeout=10) as response:
        body = response.read().decode()
    for line in body.splitlines():
        if line.startswith(f'splitserve:migrations_total{{cause="{cause}"}}'):
            return float(line.split()[-1])
    return 0.0


def _assert_idle(stack: Stack, skip: str | None = None) -> None:
    for address in stack.decode_addresses:
        if address != skip:
            stats = wait_until_idle(address)
            assert (stats.num_running, stats.num_waiting) == (0, 0), address
            assert stats.kv_blocks_free == stats.kv_blocks_total, address


def test_a_stalled_pod_is_left_and_its_stream_continues_elsewhere(stack, client, llm):
    want = _reference(llm, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS))
    before = _migrations(stack, "stalled")
    stopped = []

    def stop(address: str) -> None:
        _process(stack, address).send_signal(signal.SIGSTOP)
        stopped.append(address)

    start = time.monotonic()
    try:
        text, tokens, finish, usage, hit = _stream_with_fault(
            client, stack, {"temperature": 0}, stop
        )
    finally:
        for address in stopped:
            _process(stack, address).send_signal(signal.SIGCONT)
    assert (tokens, text, finish) == (want.token_ids, want.text, "length")
    assert usage.completion_tokens == MAX_TOKENS
    assert time.monotonic() - start < 30  # the stall timeout, not the stop, bounded the wait
    assert _migrations(stack, "stalled") == before + 1
    # Once running again, the stopped pod sees the gateway's cancel and frees the request.
    _assert_idle(stack)


def test_a_killed_pod_greedy_stream_completes_token_for_token(stack, client, llm):
    want = _reference(llm, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS))
    killed = []

    def kill(address: str) -> None:
        _process(stack, address).send_signal(signal.SIGKILL)
        killed.append(address)

    text, tokens, finish, usage, hit = _stream_with_fault(client, stack, {"temperature": 0}, kill)
    assert killed == [hit]
    assert (tokens, text, finish) == (want.token_ids, want.text, "length")
    assert usage.completion_tokens == MAX_TOKENS
    _assert_idle(stack, skip=hit)
    stack.decode_addresses.remove(hit)  # the next test must not pick the dead pod


def test_a_killed_pod_seeded_stream_continues_its_own_random_stream(stack, client, llm):
    params = SamplingParams(temperature=0.9, top_p=0.95, seed=99, max_tokens=MAX_TOKENS)
    want = _reference(llm, params)

    def kill(address: str) -> None:
        _process(stack, address).send_signal(signal.SIGKILL)

    text, tokens, finish, usage, hit = _stream_with_fault(
        client, stack, {"temperature": 0.9, "top_p": 0.95, "seed": 99}, kill
    )
    assert (tokens, text) == (want.token_ids, want.text)
    assert usage.completion_tokens == len(want.token_ids)
    _assert_idle(stack, skip=hit)
