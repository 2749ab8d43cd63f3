"""The offload tiers seen through the OpenAI API: a conversation pushed out of a pod's KV cache
comes back from its host tier, `usage.prompt_tokens_details` says so by tier, and the pod's
metrics count the writes, loads, hits and evictions."""

from __future__ import annotations

import json

import pytest

from tests.services_util import MODEL_NAME, Stack, free_port, post_raw, start_stack
from tests.test_metrics import scrape, total


@pytest.fixture(scope="module")
def stack():
    # A KV cache of 34 blocks (544 tokens) and a host tier that holds everything evicted.
    metrics_port = free_port()
    flags = ["--kv-cache-bytes", "24MiB", "--kv-offload-host-bytes", "256MiB"]
    stack = start_stack(decode_flags=[*flags, "--metrics-port", str(metrics_port)])
    stack.metrics_url = f"http://127.0.0.1:{metrics_port}/metrics"
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

    samples = scrape(stack.metrics_url)
    name = "splitserve:{}".format
    assert total(samples, name("kv_tier_hit_tokens_total"), tier="host") == by_tier["host"]
    assert total(samples, name("kv_offload_writes_total"), tier="host") >= by_tier["host"] // 16
    assert total(samples, name("kv_tier_blocks"), tier="host") > 0
    assert total(samples, name("kv_tier_bytes"), tier="device") > 0
    assert total(samples, name("kv_load_seconds_count")) == 1
    assert total(samples, name("kv_load_failures_total")) == 0
    assert total(samples, name("kv_evictions_total"), reason="capacity") > 0
