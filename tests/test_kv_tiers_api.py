"""The offload tiers seen through the OpenAI API: a conversation pushed out of a pod's KV cache
comes back from its host tier, and `usage.prompt_tokens_details` says so, by tier."""

from __future__ import annotations

import json

import pytest

from tests.services_util import MODEL_NAME, Stack, post_raw, start_stack


@pytest.fixture(scope="module")
def stack():
    # A KV cache of 34 blocks (544 tokens) and a host tier that holds everything evicted.
    flags = ["--kv-cache-bytes", "24MiB", "--kv-offload-host-bytes", "256MiB"]
    stack = start_stack(decode_flags=flags)
    try:
        yield stack.wait_healthy()
    finally:
        stack.stop()


def _complete(stack: Stack, prompt: str) -> dict:
    body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": 4, "temperature": 0}
    result = post_raw(f"{stack.base_url}/v1/completions", json.dumps(body).encode())
    assert result.status == 200, result.body
    return result.body


def test_a_resumed_conversation_reports_the_tokens_its_host_tier_served(stack):
    session = "You are a helpful assistant who answers questions on geography. " * 12
    session += "Question: what is the capital of France?"
    first = _complete(stack, session)
    assert first["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
    for i in range(4):  # other conversations push it out of the KV cache
        _complete(stack, f"Story number {i}: once upon a time a kingdom lay far away. " * 10)
    resumed = _complete(stack, session)
    details = resumed["usage"]["prompt_tokens_details"]
    by_tier = details["cached_tokens_by_tier"]
    assert by_tier.get("host", 0) >= 16 * 4  # most of it came back from host memory
    assert sum(by_tier.values()) == details["cached_tokens"] > 0
    assert resumed["choices"][0]["text"] == first["choices"][0]["text"]
