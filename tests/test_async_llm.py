"""`AsyncLLM`: concurrent streams on the shipped SmolLM2 model.

Many requests at once give the same greedy tokens as the offline `LLM`; leaving a stream early
(break, cancellation) frees the request's blocks without disturbing the others; bad requests
fail before any delta and never touch someone else's request; a step that fails fails its
in-flight requests, not the engine thread.

torch runs single-threaded (see tests/test_engine_api.py for why).
"""

from __future__ import annotations

import asyncio
import time

import pytest

from splitserve import LLM, AsyncLLM, SamplingParams
from splitserve.engine.kv.tiers import Tier

MAX_TOKENS = 12
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)

TOPICS = [
    "the sea",
    "a cat",
    "trains",
    "winter",
    "coffee",
    "mountains",
    "a library at night",
    "the first day of school",
    "bees",
    "an old clock",
    "rain on a tin roof",
    "chess",
    "a lighthouse",
    "bread",
    "the moon",
    "a bicycle ride through the hills on a summer morning",
]


@pytest.fixture(scope="module")
def offline(single_thread):
    """The offline engine's greedy tokens and text for each prompt (then the engine goes)."""
    llm = LLM(kv_cache_bytes=128 * 2**20)
    prompts = [llm.tokenizer.encode(f"Write one sentence about {topic}:") for topic in TOPICS]
    results = llm.generate(prompts, GREEDY)
    return prompts, [result.outputs[0] for result in results]


@pytest.fixture(scope="module")
def engine(single_thread):
    llm = AsyncLLM(kv_cache_bytes=128 * 2**20)
    yield llm
    llm.shutdown()


def _run(coroutine, timeout: float = 60.0):
    """asyncio.run with a deadline: a regression that loses a delta fails instead of hanging."""
    return asyncio.run(asyncio.wait_for(coroutine, timeout))


async def _collect(engine, prompt, params, request_id=None, stop_after=None):
    """All deltas of one request, or the first `stop_after` ones (then the loop is left)."""
    deltas = []
    async for delta in engine.generate(prompt, params, request_id=request_id):
        deltas.append(delta)
        if stop_after is not None and len(deltas) == stop_after:
            break
    return deltas


async def _wait_idle(engine, timeout: float = 20.0) -> None:
    """Polls the engine thread's stats until nothing runs and every block is free."""
    deadline = time.monotonic() + timeout
    while True:
        stats = engine.stats()
        idle = (stats.num_running, stats.num_waiting) == (0, 0)
        if idle and stats.num_kv_blocks_free == stats.num_kv_blocks_total:
            return
        assert time.monotonic() < deadline, f"engine not idle after {timeout} s: {stats}"
        await asyncio.sleep(0.02)


def _final(deltas):
    finals = [delta.final for delta in deltas if delta.final is not None]
    assert len(finals) == 1 and deltas[-1].final is finals[0], "one final, on the last delta"
    return finals[0]


def test_16_concurrent_requests_equal_offline_greedy(engine, offline):
    prompts, expected = offline

    async def main():
        return await asyncio.gather(*(_collect(engine, p, GREEDY) for p in prompts))

    all_deltas = _run(main())
    for deltas, reference in zip(all_deltas, expected):
        final = _final(deltas)
        assert final.token_ids == reference.token_ids
        assert final.finish_reason == reference.finish_reason
        assert "".join(delta.text for delta in deltas) == final.text == reference.text
        assert [t for delta in deltas for t in delta.token_ids] == final.token_ids
    _run(_wait_idle(engine))


def test_leaving_a_stream_early_frees_its_blocks_and_spares_the_others(engine, offline):
    prompts, expected = offline
    long_params = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)

    async def main():
        others = [asyncio.create_task(_collect(engine, prompts[i], GREEDY)) for i in (0, 1)]
        left = await _collect(engine, prompts[2], long_params, stop_after=3)
        return left, await asyncio.gather(*others)

    left, others = _run(main())
    assert len(left) == 3 and not left[-1].finished
    for deltas, reference in zip(others, expected[:2]):
        assert _final(deltas).token_ids == reference.token_ids
    _run(_wait_idle(engine))


def test_cancelled_consumer_frees_its_blocks(engine, offline):
    prompts, _ = offline
    params = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)

    async def main():
        task = asyncio.create_task(_collect(engine, prompts[3], params))
        await asyncio.sleep(0.3)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await _wait_idle(engine)

    _run(main())


@pytest.mark.parametrize(
    "prompt, params, pattern",
    [
        ([], GREEDY, "prompt"),
        ([17, 49152], GREEDY, "prompt_token_ids"),
        ([17] * 8192, GREEDY, "max_model_len"),
        ("Hello", GREEDY, "prompt_token_ids"),
        ([17, 18], {"max_tokens": 4}, "params"),
    ],
    ids=["empty", "token-id", "over-context", "text-not-ids", "params-type"],
)
def test_invalid_request_raises_before_any_delta(engine, offline, prompt, params, pattern):
    prompts, expected = offline

    async def main():
        stream = engine.generate(prompt, params)
        with pytest.raises(ValueError, match=pattern):
            await stream.__anext__()
        return await _collect(engine, prompts[4], GREEDY)

    deltas = _run(main())
    assert _final(deltas).token_ids == expected[4].token_ids
    _run(_wait_idle(engine))


def test_request_id_in_use_is_rejected_and_the_owner_keeps_running(engine, offline):
    prompts, expected = offline

    async def main():
        owner = engine.generate(prompts[5], GREEDY, request_id="mine")
        deltas = [await owner.__anext__()]  # the owner is running now, with steps to go
        assert not deltas[0].finished
        with pytest.raises(ValueError, match="request_id"):
            await _collect(engine, prompts[6], GREEDY, request_id="mine")
        deltas += [delta async for delta in owner]
        return deltas

    deltas = _run(main())
    assert _final(deltas).token_ids == expected[5].token_ids
    _run(_wait_idle(engine))


def test_n_2_streams_both_sequences(engine, offline):
    prompts, _ = offline
    params = SamplingParams(n=2, temperature=0.9, seed=99, max_tokens=6, ignore_eos=True)

    deltas = _run(_collect(engine, prompts[7], params))
    by_index = {index: [d for d in deltas if d.index == index] for index in (0, 1)}
    assert sorted({delta.index for delta in deltas}) == [0, 1]
    for sequence in by_index.values():
        assert [delta.finished for delta in sequence] == [False] * 5 + [True]
        assert sequence[-1].final.finish_reason == "length"
    assert by_index[0][-1].final.token_ids != by_index[1][-1].final.token_ids


def test_timings(engine, offline):
    prompts, _ = offline
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    final = _final(_run(_collect(engine, prompts[8], params)))
    timings = final.timings
    assert timings.time_to_first_token > 0
    assert len(timings.inter_token_latencies) == len(final.token_ids) - 1 == 5
    assert all(latency >= 0 for latency in timings.inter_token_latencies)


def test_a_failing_step_fails_its_requests_not_the_engine(engine, offline, monkeypatch):
    """Fault injection: the real engine has no input that breaks a step once validated."""
    prompts, expected = offline
    runner = engine.engine.runner
    real_execute = runner.execute
    calls = []

    def execute_failing_once(sched, masks):
        calls.append(sched)
        if len(calls) == 2:
            raise RuntimeError("injected fault")
        return real_execute(sched, masks)

    monkeypatch.setattr(runner, "execute", execute_failing_once)

    async def main():
        with pytest.raises(RuntimeError, match="injected fault"):
            await _collect(engine, prompts[9], GREEDY)
        await _wait_idle(engine)
        return await _collect(engine, prompts[10], GREEDY)

    deltas = _run(main())
    assert _final(deltas).token_ids == expected[10].token_ids


def test_kv_events_follow_the_cache_and_a_snapshot_lists_it(engine, offline):
    """A publisher sees each newly cached block once; a snapshot equals the pool's hashes and
    supersedes earlier events."""
    from splitserve.engine.kv.events import BlockStored

    prompts, _ = offline
    engine.take_kv_events()  # start keeping; what came before is not ours
    long_prompt = prompts[15] * 4  # several full blocks
    _run(_collect(engine, long_prompt, GREEDY))
    stored = [
        h for e in engine.take_kv_events() if isinstance(e, BlockStored) for h in e.block_hashes
    ]
    assert len(stored) >= len(long_prompt) // engine.config.cache.block_size
    assert len(set(stored)) == len(stored)
    snapshot = _run(engine.snapshot_cached_blocks())[Tier.DEVICE]
    assert set(stored) <= set(snapshot)
    assert len(snapshot) == len(set(snapshot))
    assert engine.take_kv_events() == []  # the snapshot dropped nothing newer than itself


def test_snapshots_given_up_on_leave_the_engine_serving(engine, offline):
    """A coroutine that stops waiting for a cache snapshot (a registry publisher closed in the
    middle of a resync) cancels the snapshot's future. The engine thread must pass over it: it
    used to die completing it, and every later request of the pod then waited forever."""
    prompts, expected = offline

    async def main():
        for attempt in range(200):
            snapshot = asyncio.ensure_future(engine.snapshot_cached_blocks())
            for _ in range(attempt % 4):  # cancel at different points of the hand-over
                await asyncio.sleep(0)
            snapshot.cancel()
        return await _collect(engine, prompts[0], GREEDY)

    deltas = _run(main(), timeout=60)
    assert _final(deltas).token_ids == expected[0].token_ids
    hashes = _run(engine.snapshot_cached_blocks())  # a snapshot nobody cancels still answers
    assert hashes[Tier.DEVICE]
    _run(_wait_idle(engine))


def test_a_reader_that_falls_behind_gets_the_queued_tokens_as_one_delta(engine, offline):
    """While the reader is busy the engine keeps stepping; what queued up comes as one delta
    (so a slow consumer gets fewer, larger messages, not a growing backlog), with nothing lost
    or reordered. The first delta stays alone: its time is the request's TTFT."""
    prompts, _ = offline
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, logprobs=1)

    async def main():
        deltas = []
        async for delta in engine.generate(prompts[3], params):
            deltas.append(delta)
            if len(deltas) == 1:
                await asyncio.sleep(1.0)  # busy: the engine steps on meanwhile
        return deltas

    deltas = _run(main())
    final = _final(deltas)
    assert len(deltas[0].token_ids) == 1
    assert len(deltas[1].token_ids) > 1
    assert len(deltas) < len(final.token_ids)
    assert [t for delta in deltas for t in delta.token_ids] == final.token_ids
    assert [lp.token_id for delta in deltas for lp in delta.logprobs] == final.token_ids
    assert "".join(delta.text for delta in deltas) == final.text
    _run(_wait_idle(engine))


def test_after_current_step_waits_for_the_step_running_now(engine, offline):
    """At once on an idle engine; during a generation, it returns only once every step that
    had started when it was called has ended."""
    prompts, _ = offline
    counts = {"started": 0, "ended": 0}
    step = engine.engine.step

    def counted_step():
        counts["started"] += 1
        try:
            return step()
        finally:
            counts["ended"] += 1

    async def scenario() -> None:
        await asyncio.wait_for(engine.after_current_step(), 1.0)  # idle: nothing to wait for
        params = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
        stream = engine.generate(prompts[0], params, request_id="steps")
        await stream.__anext__()  # running now
        waited_for_a_step = 0
        # Until two calls came while a step ran: a call made right as a wait ends tends to
        # land between steps, so the calls are spread by short sleeps (and on a busy machine
        # the first few may all miss).
        for _ in range(40):
            await asyncio.sleep(0.004)
            started = counts["started"]
            running = started > counts["ended"]
            await engine.after_current_step()
            assert counts["ended"] >= started
            waited_for_a_step += running
            if waited_for_a_step >= 2:
                break
        assert waited_for_a_step > 0, "no call came while a step ran"
        async for _ in stream:
            pass

    engine.engine.step = counted_step
    try:
        _run(scenario())
    finally:
        del engine.engine.step
