"""Scheduler policy with exact expectations: budgets, ordering, admission, preemption, freeing.

The scheduler is driven with a real KV manager; the "model" is the test choosing each sampled
token, which is all the scheduler sees of a forward pass.
"""

from __future__ import annotations

import random

import pytest

from splitserve.engine.config import SchedulerConfig
from splitserve.engine.kv.manager import KVCacheManager
from splitserve.engine.request import Request, RequestStatus
from splitserve.engine.sampling_params import SamplingParams
from splitserve.engine.scheduler import Scheduler
from splitserve.engine.step import ModelOutput, SchedulerOutput

EOS = 2
BLOCK = 4


def make_scheduler(num_blocks: int = 64, budget: int = 16, max_seqs: int = 8, chunk=None):
    config = SchedulerConfig(
        max_num_batched_tokens=budget, max_num_seqs=max_seqs, long_prefill_token_threshold=chunk
    )
    kv = KVCacheManager(num_blocks, BLOCK)
    return Scheduler(config, kv, max_model_len=1024, eos_token_ids=(EOS,))


def make_request(rid: str, num_prompt: int, max_tokens: int = 4, priority: int = 0, t=0.0):
    prompt = [100 + (hash((rid, i)) % 1000) for i in range(num_prompt)]
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    return Request(rid, prompt, params, priority=priority, arrival_time=t)


def step(sched: Scheduler, token: int = 7) -> SchedulerOutput:
    out = sched.schedule()
    sampled = {c.request.request_id: token for c in out.chunks if c.is_sampled}
    sched.update(out, ModelOutput(sampled))
    return out


def plan(out: SchedulerOutput) -> list[tuple[str, int]]:
    return [(c.request.request_id, c.num_tokens) for c in out.chunks]


def test_chunked_prefill_splits_long_prompt_under_budget():
    sched = make_scheduler(budget=16)
    sched.add_request(make_request("a", 40))
    assert plan(step(sched)) == [("a", 16)]
    assert plan(step(sched)) == [("a", 16)]
    out = step(sched)
    assert plan(out) == [("a", 8)] and out.chunks[0].is_sampled
    assert sched.requests["a"].output_token_ids == [7]


def test_decodes_come_first_and_prefill_fills_the_rest():
    sched = make_scheduler(budget=16)
    sched.add_request(make_request("a", 5, t=0))
    step(sched)  # a's whole prompt
    sched.add_request(make_request("b", 30, t=1))
    out = step(sched)
    assert plan(out) == [("a", 1), ("b", 15)]
    out = step(sched)
    assert plan(out) == [("a", 1), ("b", 15)]  # b's rest; a keeps decoding every step


def test_long_prefill_threshold_caps_one_request_per_step():
    sched = make_scheduler(budget=16, chunk=6)
    sched.add_request(make_request("a", 10, t=0))
    sched.add_request(make_request("b", 10, t=1))
    assert plan(step(sched)) == [("a", 6), ("b", 6)]


def test_prefill_beside_decodes_is_capped_and_alone_takes_the_budget():
    config = SchedulerConfig(max_num_batched_tokens=16, max_prefill_tokens_while_decoding=5)
    sched = Scheduler(config, KVCacheManager(64, BLOCK), max_model_len=1024, eos_token_ids=(EOS,))
    sched.add_request(make_request("a", 12, max_tokens=8, t=0))
    assert plan(step(sched)) == [("a", 12)]  # nothing decodes yet: the whole budget
    sched.add_request(make_request("b", 9, t=1))
    sched.add_request(make_request("c", 9, t=2))
    # a decodes now: the prompts share 5 tokens per step, b's unfinished chunk before c's.
    assert dict(plan(step(sched))) == {"a": 1, "b": 5}
    assert dict(plan(step(sched))) == {"a": 1, "b": 4, "c": 1}
    assert dict(plan(step(sched))) == {"a": 1, "b": 1, "c": 5}  # b decodes, c's prompt goes on


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def make_background_capped(cap: int = 4, window_s: float = 10.0, budget: int = 16):
    config = SchedulerConfig(
        max_num_batched_tokens=budget,
        max_background_prefill_tokens=cap,
        importance_window_s=window_s,
    )
    clock = FakeClock()
    kv = KVCacheManager(64, BLOCK)
    return Scheduler(config, kv, max_model_len=1024, eos_token_ids=(EOS,), clock=clock), clock


def test_background_prompts_take_short_steps_only_while_an_important_one_was_sent_lately():
    sched, clock = make_background_capped(cap=4, window_s=10.0)
    sched.add_request(make_request("vip", 4, priority=0, t=0))
    step(sched)  # the important prompt, computed alone
    sched.finish_requests(["vip"], RequestStatus.FINISHED_ABORTED)
    sched.add_request(make_request("bulk", 40, priority=1, t=1))
    assert plan(step(sched)) == [("bulk", 4)]  # priority 0 was sent 0 s ago: a short step
    clock.now = 5.0
    sched.add_request(make_request("more", 40, priority=1, t=2))  # priority 1 lately: no matter
    clock.now = 10.5  # nothing at priority 0 for longer than the window
    assert plan(step(sched)) == [("bulk", 16)]


def test_an_important_prompt_takes_its_step_without_background_prompts_beside_it():
    sched, _ = make_background_capped(cap=4)
    sched.add_request(make_request("bulk", 40, priority=1, t=0))
    assert plan(step(sched)) == [("bulk", 16)]  # one priority only: every prompt alike
    sched.add_request(make_request("vip", 10, priority=0, t=1))
    assert plan(step(sched)) == [("vip", 10)]  # the running bulk prompt waits a step
    out = step(sched)
    assert plan(out) == [("vip", 1), ("bulk", 4)]  # vip decodes; bulk's prompt at the cap


def test_a_waiting_important_prompt_without_blocks_leaves_the_background_running():
    config = SchedulerConfig(max_num_batched_tokens=20, max_background_prefill_tokens=4)
    kv = KVCacheManager(6, BLOCK)  # 24 slots: the bulk prompt's first step holds 5 blocks
    sched = Scheduler(config, kv, max_model_len=1024, eos_token_ids=(EOS,), clock=FakeClock())
    sched.add_request(make_request("bulk", 26, priority=1, t=0))
    assert plan(step(sched)) == [("bulk", 20)]
    sched.add_request(make_request("vip", 8, priority=0, t=1))  # needs 2 blocks; 1 is free
    # vip cannot start: the bulk prompt goes on, 4 of its 6 tokens left (the cap); vip is not
    # squeezed in at the cap either (it keeps the head of the queue for its whole chunk).
    assert plan(step(sched)) == [("bulk", 4)]
    assert sched.requests["vip"].status == RequestStatus.WAITING


def test_with_one_priority_the_background_cap_changes_nothing():
    """Every prompt alike: the same steps as without a cap, down to admission under tight
    blocks (a prompt whose whole chunk does not fit is not let in at the cap instead)."""

    def plans(cap: int | None) -> list[list[tuple[str, int]]]:
        config = SchedulerConfig(max_num_batched_tokens=16, max_background_prefill_tokens=cap)
        kv = KVCacheManager(6, BLOCK)
        sched = Scheduler(config, kv, max_model_len=1024, eos_token_ids=(EOS,), clock=FakeClock())
        sched.add_request(make_request("a", 14, max_tokens=6, priority=1, t=0))
        steps = [plan(step(sched))]
        sched.add_request(make_request("b", 12, max_tokens=2, priority=1, t=1))
        steps += [plan(step(sched)) for _ in range(8)]
        return steps

    assert plans(4) == plans(None)
    assert sum(n for s in plans(4) for _, n in s) > 0


def test_background_cap_and_window_must_be_positive():
    with pytest.raises(ValueError, match="max_background_prefill_tokens"):
        SchedulerConfig(max_background_prefill_tokens=0)
    with pytest.raises(ValueError, match="importance_window_s"):
        SchedulerConfig(importance_window_s=0)


def test_prefill_cap_while_decoding_must_be_positive():
    with pytest.raises(ValueError, match="max_prefill_tokens_while_decoding"):
        SchedulerConfig(max_prefill_tokens_while_decoding=0)


def test_queued_prompt_tokens_count_what_is_left_to_prefill_here():
    """Waiting prompts whole, running prompts' unfinished chunks, no decode; a request whose
    KV a prefill pod computes is not queued here, though it is waiting."""
    sched = make_scheduler(budget=16, max_seqs=2)
    for rid, num_prompt in (("a", 40), ("b", 3), ("c", 10)):
        sched.add_request(make_request(rid, num_prompt, max_tokens=8))
    assert (sched.num_waiting_prompt_tokens, sched.num_waiting_for_admission) == (53, 3)
    assert plan(step(sched)) == [("a", 16)]  # the budget: b and c wait
    assert (sched.num_waiting_prompt_tokens, sched.num_waiting_for_admission) == (24 + 13, 2)
    remote = make_request("r", 20)
    assert sched.reserve_remote_kv(remote) == 0
    assert sched.num_waiting_for_admission == 2  # b and c, not r
    assert sched.num_waiting_prompt_tokens == 24 + 13
    while sched.running[0].num_output_tokens == 0:
        step(sched)
    # a decodes (nothing of it is left), b was prefilled beside a's last chunk, c waits for
    # a batch slot.
    assert (sched.num_waiting_prompt_tokens, sched.num_waiting_for_admission) == (10, 1)


def test_waiting_order_is_priority_then_arrival():
    sched = make_scheduler(budget=4, max_seqs=1)
    sched.add_request(make_request("late-important", 3, priority=-1, t=5))
    sched.add_request(make_request("early", 3, priority=0, t=1))
    sched.add_request(make_request("earlier", 3, priority=0, t=0))
    assert plan(step(sched)) == [("late-important", 3)]


def test_admission_waits_for_free_blocks():
    sched = make_scheduler(num_blocks=4, budget=64)
    sched.add_request(make_request("a", 12, max_tokens=3, t=0))  # 3 blocks + room to grow
    sched.add_request(make_request("b", 8, t=1))  # needs 2 blocks, only 1 free
    assert plan(step(sched)) == [("a", 12)]
    assert sched.num_waiting == 1


def test_preemption_picks_lowest_priority_then_newest_and_recomputes():
    sched = make_scheduler(num_blocks=6, budget=64)
    sched.add_request(make_request("old", 8, max_tokens=20, t=0))
    sched.add_request(make_request("new", 8, max_tokens=20, t=1))
    sched.add_request(make_request("vip", 7, max_tokens=20, priority=-5, t=2))
    assert plan(step(sched)) == [("vip", 7), ("old", 8), ("new", 8)]  # all 6 blocks in use
    # vip's next token still fits its 2 blocks; old needs a third block, so the least important
    # running request goes: new (same priority as old, but newer). vip is never the victim.
    out = step(sched)
    assert out.preempted_request_ids == ["new"]
    assert plan(out) == [("vip", 1), ("old", 1)]
    victim = sched.requests["new"]
    assert victim.status == RequestStatus.PREEMPTED and victim.num_computed_tokens == 0
    assert victim.output_token_ids == [7]  # recomputed later, not forgotten
    assert victim.num_preemptions == 1


def test_preempted_request_resumes_with_its_output_tokens():
    sched = make_scheduler(num_blocks=5, budget=64)
    sched.add_request(make_request("a", 8, max_tokens=10, t=0))
    sched.add_request(make_request("b", 8, max_tokens=10, t=1))
    finished: dict[str, Request] = {}
    for _ in range(200):
        if not sched.has_unfinished_requests():
            break
        out = sched.schedule()
        sampled = {c.request.request_id: 7 for c in out.chunks if c.is_sampled}
        for update in sched.update(out, ModelOutput(sampled)):
            if update.finished:
                finished[update.request.request_id] = update.request
    assert sched.num_preemptions > 0
    assert {rid: r.num_output_tokens for rid, r in finished.items()} == {"a": 10, "b": 10}
    assert sched.kv.num_free_blocks == 5


def test_finishes_on_eos_stop_token_and_max_tokens():
    sched = make_scheduler()
    sched.add_request(make_request("len", 3, max_tokens=2))
    step(sched)
    out = sched.schedule()
    updates = sched.update(out, ModelOutput({"len": 9}))
    assert updates[0].finished and updates[0].request.status == RequestStatus.FINISHED_LENGTH

    sched.add_request(make_request("eos", 3, max_tokens=5))
    out = sched.schedule()
    updates = sched.update(out, ModelOutput({"eos": EOS}))
    assert updates[0].request.status == RequestStatus.FINISHED_STOPPED

    stop_params = SamplingParams(max_tokens=5, temperature=0.0, stop_token_ids=(42,))
    sched.add_request(Request("stop", [5, 6, 7], stop_params))
    out = sched.schedule()
    updates = sched.update(out, ModelOutput({"stop": 42}))
    assert updates[0].request.stop_reason == 42
    assert sched.kv.num_free_blocks == sched.kv.num_blocks


def test_ignore_eos_and_min_tokens_keep_generating():
    sched = make_scheduler()
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    sched.add_request(Request("r", [5, 6], params))
    for _ in range(3):
        out = sched.schedule()
        sched.update(out, ModelOutput({"r": EOS}))
    assert not sched.has_unfinished_requests()


def test_abort_anywhere_frees_every_block():
    rng = random.Random(0)
    sched = make_scheduler(num_blocks=24, budget=20)
    for i in range(12):
        sched.add_request(make_request(f"r{i}", rng.randint(1, 30), max_tokens=50, t=i))
    for i in range(30):
        step(sched)
        if i % 3 == 0 and sched.requests:
            victim = rng.choice(sorted(sched.requests))
            sched.finish_requests([victim], RequestStatus.FINISHED_ABORTED)
    sched.finish_requests(sorted(sched.requests), RequestStatus.FINISHED_ABORTED)
    assert sched.kv.num_free_blocks == 24
    assert sched.num_running == 0 and sched.num_waiting == 0


def test_request_alone_outgrowing_the_cache_finishes_with_length():
    sched = make_scheduler(num_blocks=2, budget=64)
    sched.add_request(make_request("big", 7, max_tokens=100))
    for _ in range(5):
        step(sched)
    dropped = sched.take_dropped()
    assert [r.request_id for r in dropped] == ["big"]
    assert dropped[0].status == RequestStatus.FINISHED_LENGTH
    # 2 blocks of 4 hold positions 0-7; the token sampled at position 8 has no slot for its KV.
    assert dropped[0].num_tokens == 9
    assert sched.kv.num_free_blocks == 2


def test_remote_kv_reserves_blocks_reuses_cached_prefix_and_joins_the_batch():
    sched = make_scheduler(num_blocks=16, budget=64)
    local = make_request("local", 9, max_tokens=1)
    sched.add_request(local)
    step(sched)  # computes and caches local's first two full blocks, then finishes it
    assert sched.kv.num_free_blocks == 16

    prompt = local.prompt_token_ids[:8] + [555, 556, 557]
    remote = Request("remote", prompt, SamplingParams(max_tokens=3, temperature=0.0))
    assert sched.reserve_remote_kv(remote) == 8  # two cached blocks need no pages
    assert remote.status == RequestStatus.WAITING_FOR_REMOTE_KV
    assert len(sched.kv.get_block_ids("remote")) == 3
    assert sched.schedule().is_empty  # never scheduled while its pages are in flight

    update = sched.complete_remote_kv("remote", 42)
    assert update.new_token_ids == [42] and not update.finished
    assert remote.num_computed_tokens == 11 and remote.status == RequestStatus.RUNNING
    assert plan(step(sched)) == [("remote", 1)]  # decodes the remote prefill's first token


def test_remote_kv_fallback_and_abort_free_the_reservation():
    sched = make_scheduler(num_blocks=4, budget=64)
    request = make_request("r", 10, max_tokens=2)
    assert sched.reserve_remote_kv(request) == 0
    assert sched.kv.num_free_blocks == 1
    sched.fall_back_to_local_prefill("r")
    assert sched.kv.num_free_blocks == 4 and request.status == RequestStatus.WAITING
    assert plan(step(sched)) == [("r", 10)]  # prefilled locally now

    other = make_request("o", 10)
    assert sched.reserve_remote_kv(other) is None  # r holds 3 of 4 blocks: no room, no change
    assert sched.kv.num_free_blocks == 1
    sched.finish_requests(["r"], RequestStatus.FINISHED_ABORTED)
    assert sched.reserve_remote_kv(other) == 0
    sched.finish_requests(["o"], RequestStatus.FINISHED_ABORTED)
    assert sched.kv.num_free_blocks == 4


def test_draft_slots_never_take_the_block_another_decode_needs():
    """One free block left: a's draft slots would take it and b, whose next token starts a
    new block, would be preempted. Drafts must wait instead."""
    from splitserve.engine.spec_decode.adaptive import SpeculationPolicy

    config = SchedulerConfig(max_num_batched_tokens=16, max_num_seqs=8)
    policy = SpeculationPolicy(max_draft_tokens=4, max_batch_size=8, adaptive=False)
    sched = Scheduler(config, KVCacheManager(5, BLOCK), 1024, (EOS,), speculation=policy)
    sched.add_request(make_request("a", 7, max_tokens=16, t=0))  # 8 tokens after one step
    sched.add_request(make_request("b", 8, max_tokens=16, t=1))  # 9: its next needs a block
    step(sched)
    assert sched.kv.num_free_blocks == 1
    out = step(sched)
    assert plan(out) == [("a", 1), ("b", 1)]
    assert [c.num_draft_slots for c in out.chunks] == [0, 0]
    assert sched.num_preemptions == 0


def test_the_next_best_priority_counts_once_the_best_expires():
    from splitserve.engine.step_importance import RecentBestPriority

    clock = FakeClock()
    recent = RecentBestPriority(window_s=10.0, clock=clock)
    assert recent.current() is None
    recent.note(3)
    recent.note(0)
    clock.now = 6.0
    recent.note(1)  # a worse priority than the best: remembered, not in charge
    recent.note(3)
    assert recent.current() == 0
    clock.now = 10.5  # 0 expired; 1 and 3 were seen 4.5 s ago
    assert recent.current() == 1
    clock.now = 16.5  # everything expired
    assert recent.current() is None
