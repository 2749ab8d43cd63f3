"""`PromptPrefill`, the decode pod's one owner of "where is this prompt prefilled": in process,
around a real `AsyncLLM` and a real `PrefillClient` (TCP receiver, gRPC channel).

- A prefill pod that cannot be reached is a remote-path failure: the prompt is prefilled here
  and the output equals the offline engine's.
- Short prompts and prompts this pod mostly holds already never leave the pod.
- A bug on the remote path (a TypeError) is not a remote-path failure: the request fails with
  it instead of quietly falling back, and its blocks are freed.
"""

from __future__ import annotations

import asyncio

import pytest

from splitserve import LLM, AsyncLLM, SamplingParams
from splitserve.decode.remote_prefill import (
    PrefillClient,
    PrefillMode,
    PromptPrefill,
    RemotePrefillSettings,
)
from splitserve.engine.kv.transfer import create_kv_transport
from tests.services_util import free_port

# make test stays well under 15 min: a stack of its own (~9 s); test_disaggregated_serving covers
# the fallback to local prefill.
pytestmark = pytest.mark.slow

GREEDY = SamplingParams(temperature=0.0, max_tokens=6)
SETTINGS = RemotePrefillSettings(local_prefill_threshold=16, timeout_s=5.0)
PROMPT = (
    "The lighthouse keeper climbed the narrow spiral stairs every evening at dusk, lit the "
    "great lamp, and wrote in his logbook about the ships that passed. One stormy night,"
)


class BrokenPrefillClient(PrefillClient):
    """Fault injection: a programming error inside the remote path."""

    async def prefill(self, *args, **kwargs):
        raise TypeError("injected: a bug, not a transport failure")


@pytest.fixture(scope="module")
def llm(single_thread):
    engine = AsyncLLM(kv_cache_bytes=64 * 2**20)
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def reference(single_thread) -> list[int]:
    offline = LLM(kv_cache_bytes=64 * 2**20)
    return offline.generate([PROMPT], GREEDY)[0].outputs[0].token_ids


async def _run(llm: AsyncLLM, client_class, request_id: str, prompt: list[int], address: str):
    transport = create_kv_transport("tcp")
    receiver = await transport.start_receiver("127.0.0.1", 0)
    client = client_class(receiver, "tcp", SETTINGS.timeout_s)
    prefill = PromptPrefill(llm, client, SETTINGS, address)
    try:
        token_ids = []
        async for delta in prefill.deltas(request_id, prompt, GREEDY, 0):
            token_ids += delta.token_ids
        return prefill.mode, token_ids
    finally:
        await client.close()


def _all_blocks_free(llm: AsyncLLM) -> bool:
    stats = llm.engine.stats()
    return stats.num_kv_blocks_free == stats.num_kv_blocks_total and not stats.num_running


def test_unreachable_prefill_pod_falls_back_to_the_same_tokens(llm, reference):
    prompt = llm.tokenizer.encode(PROMPT)
    assert len(prompt) % 16 < SETTINGS.local_prefill_threshold <= len(prompt)
    nowhere = f"127.0.0.1:{free_port()}"  # nothing listens there
    mode, token_ids = asyncio.run(_run(llm, PrefillClient, "unreachable", prompt, nowhere))
    assert mode == PrefillMode.LOCAL_FALLBACK
    assert token_ids == reference


def test_prompts_worth_no_transfer_stay_local(llm, reference):
    prompt = llm.tokenizer.encode(PROMPT)
    nowhere = f"127.0.0.1:{free_port()}"
    short = prompt[: SETTINGS.local_prefill_threshold - 1]
    mode, _ = asyncio.run(_run(llm, BrokenPrefillClient, "short", short, nowhere))
    assert mode == PrefillMode.LOCAL
    # The same prompt again: this pod's prefix cache holds all but its last partial block, so
    # fewer than the threshold are uncached and the broken client is never called.
    asyncio.run(_run(llm, PrefillClient, "first", prompt, ""))
    mode, token_ids = asyncio.run(_run(llm, BrokenPrefillClient, "cached", prompt, nowhere))
    assert mode == PrefillMode.LOCAL
    assert token_ids == reference


def test_a_bug_on_the_remote_path_fails_the_request_and_frees_its_blocks(llm):
    prompt = llm.tokenizer.encode("A different prompt, so that nothing of it is cached: " * 3)
    nowhere = f"127.0.0.1:{free_port()}"
    with pytest.raises(TypeError, match="injected"):
        asyncio.run(_run(llm, BrokenPrefillClient, "bug", prompt, nowhere))

    async def settled() -> bool:
        for _ in range(100):
            if _all_blocks_free(llm):
                return True
            await asyncio.sleep(0.05)
        return False

    assert asyncio.run(settled())
