"""Parallel pods end to end (slow: a 3-process decode pod on 2 cores): a gateway, a prefill pod
of one process and a decode pod with --tensor-parallel-size 3 (SmolLM2's 9 heads and 3 KV
heads, one KV head per rank), KV pages over TCP. A remote prefill equals the offline engine
token for token; a killed rank takes the decode pod down (exit code 1, out of service)."""

from __future__ import annotations

import os
import signal
import time

import psutil
import pytest
import torch
from openai import OpenAI

from splitserve import LLM, SamplingParams
from tests.services_util import MODEL_NAME, decode_stats, prefill_stats, start_stack

pytestmark = pytest.mark.slow

PROMPTS = [
    "The lighthouse keeper climbed the narrow spiral stairs every evening at dusk, lit the "
    "great lamp, and wrote in his logbook about the ships that passed. One stormy night,",
    "Here is a Python function that parses a comma-separated list of integers, skips blank "
    "entries, and returns their sum:\n\ndef parse_and_sum(text):\n",
]


@pytest.fixture(scope="module")
def stack():
    stack = start_stack(num_prefill=1, decode_flags=["--tensor-parallel-size", "3"])
    try:
        yield stack.wait_healthy()
    finally:
        stack.stop()


def test_remote_prefill_into_a_tp3_decode_pod_equals_the_offline_engine(stack):
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        reference = LLM(kv_cache_bytes=128 * 2**20)
        expected = reference.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=8))
    finally:
        torch.set_num_threads(previous)
    client = OpenAI(base_url=f"{stack.base_url}/v1", api_key="unused", max_retries=0, timeout=120)
    before = prefill_stats(stack.prefill_addresses[0]).prefix_cache_queried_tokens
    for prompt, want in zip(PROMPTS, expected):
        got = client.completions.create(
            model=MODEL_NAME,
            prompt=prompt,
            max_tokens=8,
            temperature=0,
            extra_body={"return_token_ids": True},
        )
        assert got.choices[0].model_extra["token_ids"] == want.outputs[0].token_ids
    queried = prefill_stats(stack.prefill_addresses[0]).prefix_cache_queried_tokens - before
    assert queried == sum(len(r.prompt_token_ids) for r in expected)  # prefilled remotely
    layout = decode_stats(stack.decode_addresses[0])
    assert (layout.tensor_parallel_size, layout.pipeline_parallel_size) == (3, 1)
    prefill_layout = prefill_stats(stack.prefill_addresses[0])
    assert (prefill_layout.tensor_parallel_size, prefill_layout.pipeline_parallel_size) == (1, 1)


def test_a_killed_rank_takes_the_decode_pod_down(stack):
    pod = stack.processes["decode-0"]
    ranks = [child for child in psutil.Process(pod.pid).children(recursive=True)]
    ranks = [p for p in ranks if "spawn_main" in " ".join(p.cmdline())]  # not the tracker
    assert len(ranks) == 2, "ranks 1 and 2 of the decode pod"
    os.kill(ranks[0].pid, signal.SIGKILL)
    client = OpenAI(base_url=f"{stack.base_url}/v1", api_key="unused", max_retries=0, timeout=60)
    with pytest.raises(Exception):  # noqa: B017 - whichever error the gateway maps it to
        client.completions.create(model=MODEL_NAME, prompt="Hello", max_tokens=4)
    deadline = time.monotonic() + 60
    while pod.poll() is None and time.monotonic() < deadline:
        time.sleep(0.2)
    assert pod.poll() == 1
    assert not psutil.pid_exists(ranks[1].pid) or ranks[1].status() == psutil.STATUS_ZOMBIE
