"""Two engines in one process play prefill pod and decode pod: the decode engine reserves
blocks, the prefill engine computes the prompt and exports its pages, the decode engine takes
them with the first token and finishes the request. Outputs equal one engine doing both."""

from __future__ import annotations

import pytest

from splitserve import LLM, SamplingParams
from splitserve.engine.core import EngineCore
from splitserve.engine.kv.disaggregation import RemotePrefillResult

PROMPTS = [
    "The lighthouse keeper climbed the stairs every evening and",
    "def quicksort(items):\n    ",
    "List three colours:",
]


@pytest.fixture(scope="module")
def engines():
    options = {"kv_cache_bytes": 64 * 2**20, "num_threads": 1}
    return LLM(**options), LLM(**options), LLM(**options)  # reference, prefill pod, decode pod


def run_until_done(engine: EngineCore) -> dict:
    finals = {}
    while engine.has_unfinished_requests():
        for delta in engine.step():
            if delta.final is not None:
                finals[delta.request_id] = delta.final
    return finals


def prefill_remotely(prefill: EngineCore, decode: EngineCore, rid, prompt, params):
    """What the services do over gRPC and UCX, done directly."""
    plan = decode.reserve_remote_prefill(rid, prompt, params)
    assert plan is not None
    first_only = SamplingParams(**{**params.__dict__, "max_tokens": 1, "min_tokens": 0})
    prefill.add_request(rid, prompt, first_only, export_kv_from_block=plan.first_block_index)
    final = run_until_done(prefill)[rid]
    pages = prefill.take_exported_pages(rid)
    assert tuple(pages.shape) == plan.page_shape
    assert prefill.take_exported_pages(rid) is None  # handed over once, not kept
    first_logprobs = final.logprobs[0] if final.logprobs else None
    result = RemotePrefillResult(final.token_ids[0], first_logprobs, pages)
    return plan, decode.complete_remote_prefill(rid, result)


def disaggregated(prefill: EngineCore, decode: EngineCore, rid, prompt, params):
    plan, first_deltas = prefill_remotely(prefill, decode, rid, prompt, params)
    finals = {d.request_id: d.final for d in first_deltas if d.final is not None}
    finals.update(run_until_done(decode))
    return plan, finals[rid]


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0.0, max_tokens=12),
        SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_tokens=12, logprobs=2),
    ],
    ids=["greedy", "seeded"],
)
def test_disaggregated_equals_colocated(engines, params):
    reference, prefill, decode = engines
    for i, text in enumerate(PROMPTS):
        prompt = reference.tokenizer.encode(text)
        expected = reference.generate([prompt], params)[0].outputs[0]
        _, got = disaggregated(prefill.engine, decode.engine, f"{params.seed}-{i}", prompt, params)
        assert got.token_ids == expected.token_ids
        assert got.text == expected.text
        if params.logprobs:
            assert [lp.token_id for lp in got.logprobs] == got.token_ids
    assert decode.stats().num_kv_blocks_free == decode.stats().num_kv_blocks_total
    assert prefill.stats().num_kv_blocks_free == prefill.stats().num_kv_blocks_total


def test_pages_of_a_prefix_cached_on_the_decode_pod_are_not_sent(engines):
    reference, prefill, decode = engines
    params = SamplingParams(temperature=0.0, max_tokens=6)
    shared_prefix = reference.tokenizer.encode("You are a careful assistant. " * 8)
    first = shared_prefix + reference.tokenizer.encode("Say hello.")
    second = shared_prefix + reference.tokenizer.encode("Say goodbye politely.")
    disaggregated(prefill.engine, decode.engine, "prefix-1", first, params)
    plan, got = disaggregated(prefill.engine, decode.engine, "prefix-2", second, params)
    assert plan.num_cached_tokens == len(shared_prefix) // 16 * 16 > 0
    assert plan.first_block_index == plan.num_cached_tokens // 16
    assert plan.page_shape[0] == -(-len(second) // 16) - plan.first_block_index
    assert got.token_ids == reference.generate([second], params)[0].outputs[0].token_ids


def test_fallback_and_abort_leave_no_block_behind(engines):
    reference, _, decode = engines
    params = SamplingParams(temperature=0.0, max_tokens=5)
    prompt = reference.tokenizer.encode(PROMPTS[0])
    expected = reference.generate([prompt], params)[0].outputs[0].token_ids

    assert decode.engine.reserve_remote_prefill("fb", prompt, params) is not None
    decode.engine.fall_back_to_local_prefill("fb")  # the prefill pod failed
    assert run_until_done(decode.engine)["fb"].token_ids == expected

    assert decode.engine.reserve_remote_prefill("gone", prompt, params) is not None
    deltas = decode.engine.abort_requests(["gone"])  # the client left while pages flew
    assert [d.finish_reason for d in deltas] == ["abort"]
    assert decode.engine.complete_remote_prefill("gone", None) == []  # late pages: ignored
    assert decode.stats().num_kv_blocks_free == decode.stats().num_kv_blocks_total


def test_the_plan_carries_the_requests_priority_to_the_prefill_pods_request(engines):
    """The prefill pod queues a prompt by its request's priority (admission control sends
    favoured requests with a lower one): the plan carries it into the PrefillRequest."""
    from splitserve.decode.remote_prefill import PrefillClient

    reference, _, decode = engines
    prompt = reference.tokenizer.encode(PROMPTS[0])
    params = SamplingParams(temperature=0.0, max_tokens=2)
    plan = decode.engine.reserve_remote_prefill("prio", prompt, params, priority=-3)
    assert plan is not None and plan.priority == -3
    receiver = type("Receiver", (), {"address": "tcp://127.0.0.1:1"})()
    client = PrefillClient(receiver, "tcp", timeout_s=1.0)  # type: ignore[arg-type]
    assert client._request("prio", prompt, params, plan).priority == -3
    decode.engine.abort_requests(["prio"])
    assert decode.stats().num_kv_blocks_free == decode.stats().num_kv_blocks_total
