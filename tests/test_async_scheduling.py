"""Async scheduling (`async_scheduling=True`, shared/overlap.py): the next step is scheduled and
launched before the last one's tokens are read, and the output is the same as in order.

On the CPU the forward runs on the host, so nothing overlaps here; what these tests hold is
the bookkeeping that makes the overlap safe on a GPU: pending tokens fed from the step that
samples them, stops found one step late without a stray token, preemption and aborts with a
token in flight, requests that need their tokens on the host running in order, and no block
leaked. tests/test_cuda_graphs.py and benchmarks/gpu_engine_check.py run it on CUDA.
"""

from __future__ import annotations

import pytest

from splitserve import LLM, SamplingParams
from splitserve.engine.config import EngineConfig
from splitserve.engine.kv.block_hash import hash_full_blocks
from splitserve.engine.kv.manager import KVCacheManager
from splitserve.engine.overlap import can_run_ahead
from splitserve.engine.request import PENDING_TOKEN, Request
from tests.test_engine_tiny_models import seeded_runs_roomy_and_cramped

KV_BYTES = 16 * 2**20
_STORY = (
    "The lighthouse keeper had lived on the island for thirty years. Every evening he climbed "
    "the spiral stairs, trimmed the wick and watched the beam sweep across the dark water."
)


@pytest.fixture(scope="module")
def engines(single_thread, tiny_hf_checkpoint) -> tuple[LLM, LLM]:
    """The same engine in order and async; a small step budget so long prompts are chunked
    beside running decodes."""
    options = dict(kv_cache_bytes=KV_BYTES, max_num_batched_tokens=48)
    in_order = LLM(tiny_hf_checkpoint, **options)
    overlapped = LLM(tiny_hf_checkpoint, async_scheduling=True, **options)
    return in_order, overlapped


def _prompts(llm: LLM) -> list[list[int]]:
    story = llm.tokenizer.encode(_STORY)
    return [
        llm.tokenizer.encode("Hi"),
        story,
        story + llm.tokenizer.encode(" The end."),  # a prefix hit on the story's blocks
        llm.tokenizer.encode(_STORY * 3),  # chunked beside the others' decodes
        [17] * 5,
    ]


def _outputs(results) -> list[tuple]:
    return [
        (out.token_ids, out.text, out.finish_reason, out.stop_reason)
        for result in results
        for out in result.outputs
    ]


def _stopping_params(reference: list[int], text: str) -> list[SamplingParams]:
    """Params that end mid-way on what the in-order run generated: a stop token, a stop
    string, and max_tokens, beside greedy and seeded sampling."""
    return [
        SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=20, stop_token_ids=[reference[6]]),
        SamplingParams(temperature=0.0, max_tokens=20, stop=[text[8:14]]),
        SamplingParams(temperature=0.9, seed=7, max_tokens=17, ignore_eos=True),
        SamplingParams(temperature=0.8, top_k=20, seed=3, max_tokens=9, min_tokens=5),
    ]


def test_async_outputs_equal_in_order(engines):
    in_order, overlapped = engines
    prompts = _prompts(in_order)
    probe = in_order.generate([prompts[1]], SamplingParams(temperature=0.0, max_tokens=20))[0]
    params = _stopping_params(probe.outputs[0].token_ids, probe.outputs[0].text)
    expected = _outputs(in_order.generate(prompts, params))
    got = _outputs(overlapped.generate(prompts, params))
    assert got == expected
    finish = [row[2] for row in got]
    assert finish[1] == "stop" and finish[2] == "stop", "the stops were meant to fire early"
    assert len(got[1][0]) == 7 and len(got[0][0]) == 20
    assert all(PENDING_TOKEN not in row[0] for row in got)
    _assert_idle(overlapped)


def test_async_steps_keep_one_step_in_flight(engines):
    """A decode step returns the step before's tokens: after it, each running request has
    one pending token and the step sampling it is in flight."""
    _, overlapped = engines
    core = overlapped.engine
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    for i in range(3):
        core.add_request(f"flight-{i}", [30 + i] * 4, params)
    streamed: dict[str, list[int]] = {}
    saw_pending = False
    while core.has_unfinished_requests():
        for delta in core.step():
            streamed.setdefault(delta.request_id, []).extend(delta.token_ids)
        running = core.scheduler.running
        if running and all(request.has_pending_token for request in running):
            saw_pending = core.overlap is not None and core.overlap.in_flight is not None
    assert saw_pending
    assert sorted(len(tokens) for tokens in streamed.values()) == [8, 8, 8]
    assert all(PENDING_TOKEN not in tokens for tokens in streamed.values())
    _assert_idle(overlapped)


def test_requests_needing_host_tokens_run_in_order_beside_async_ones(engines):
    """logprobs and penalties read the tokens before the next step: any such request makes
    the steps run in order (the step in flight resolved first), and the outputs still match."""
    in_order, overlapped = engines
    prompts = _prompts(in_order)[:4]
    params = [
        SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=2),
        SamplingParams(temperature=0.0, max_tokens=10, repetition_penalty=1.3),
        SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True),
    ]
    expected = in_order.generate(prompts, params)
    got = overlapped.generate(prompts, params)
    assert _outputs(got) == _outputs(expected)
    logprobs = got[1].outputs[0].logprobs
    assert [entry.token_id for entry in logprobs] == got[1].outputs[0].token_ids
    _assert_idle(overlapped)


def test_preemption_with_a_token_in_flight(single_thread, tiny_hf_checkpoint):
    """A pool too small for the batch preempts requests whose newest token is still on the
    device; their recompute waits for it, and the seeded tokens equal the roomy run's."""
    expected, results, cramped = seeded_runs_roomy_and_cramped(
        tiny_hf_checkpoint, async_scheduling=True
    )
    assert cramped.stats().num_preemptions > 0, "the pool was meant to be too small"
    assert _outputs(results) == _outputs(expected)
    stats = cramped.stats()
    assert (stats.num_running, stats.num_waiting, stats.num_kv_blocks_free) == (0, 0, 12)


def test_abort_with_a_token_in_flight(engines):
    """An abort between steps ends a request whose newest token is pending: its final output
    holds only resolved tokens, and its row in the step in flight is dropped."""
    _, overlapped = engines
    core = overlapped.engine
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    core.add_request("kept", [40] * 6, params)
    core.add_request("aborted", [41] * 6, params)
    streamed: dict[str, list[int]] = {"kept": [], "aborted": []}
    for _ in range(6):
        for delta in core.step():
            streamed[delta.request_id].extend(delta.token_ids)
    assert core.scheduler.requests["aborted"].has_pending_token
    finals = {d.request_id: d for d in core.abort_requests(["aborted"]) if d.final is not None}
    final = finals["aborted"].final
    assert final.finish_reason == "abort"
    assert final.token_ids == streamed["aborted"] and PENDING_TOKEN not in final.token_ids
    while core.has_unfinished_requests():
        for delta in core.step():
            streamed[delta.request_id].extend(delta.token_ids)
    assert len(streamed["kept"]) == 30 and len(streamed["aborted"]) == len(final.token_ids)
    _assert_idle(overlapped)


def test_block_hashes_skip_a_pending_token():
    """A pending token never enters a block hash: the prefix cache must not match a block
    whose last token is a placeholder."""
    manager = KVCacheManager(num_blocks=4, block_size=16, enable_caching=True, hash_namespace="t")
    request = Request("r", [5] * 15, SamplingParams(max_tokens=4))
    request.append_pending_token()
    assert (request.num_tokens, request.num_known_tokens) == (16, 15)
    manager.get_computed_blocks(request)  # hashes every full block of the known tokens
    assert request.block_hashes == []  # the only full block ends in the placeholder
    request.resolve_pending_token(9)
    assert request.all_token_ids[-1] == 9 and not request.has_pending_token
    manager.get_computed_blocks(request)
    assert request.block_hashes == hash_full_blocks([5] * 15 + [9], 16, "t")
    request.append_pending_token()
    request.drop_pending_token()
    assert request.num_tokens == 16 and request.output_token_ids == [9]


def test_can_run_ahead_names_what_needs_host_tokens():
    plain = Request("a", [1, 2], SamplingParams(temperature=0.7, seed=1, max_tokens=4))
    assert can_run_ahead(plain)
    for params in (
        SamplingParams(logprobs=1),
        SamplingParams(repetition_penalty=1.1),
        SamplingParams(frequency_penalty=0.5),
        SamplingParams(presence_penalty=0.5),
    ):
        assert not can_run_ahead(Request("b", [1, 2], params))
    exporting = Request("c", [1, 2], SamplingParams())
    exporting.export_kv_from_block = 0
    assert not can_run_ahead(exporting)


def test_async_scheduling_config_is_checked():
    with pytest.raises(ValueError, match="async_scheduling must be true or false"):
        EngineConfig.from_options("m", async_scheduling="yes")
    with pytest.raises(ValueError, match="async_scheduling does not support tensor_parallel"):
        EngineConfig.from_options("m", async_scheduling=True, tensor_parallel_size=2)


def _assert_idle(llm: LLM) -> None:
    stats = llm.stats()
    assert (stats.num_running, stats.num_waiting) == (0, 0)
    assert stats.num_kv_blocks_free == stats.num_kv_blocks_total, "a block leaked"
