"""Retention policies: the exact eviction order of each (shared/kv/eviction.py), tenants'
cache salts, and a premium session that a flood of low-class requests cannot push out.
"""

from __future__ import annotations

import math

import pytest

from splitserve import LLM, SamplingParams
from splitserve.engine.kv.block_hash import hash_full_blocks
from splitserve.engine.kv.block_pool import BlockPool
from splitserve.engine.kv.eviction import KEEP_LRU, Retention, retention_for

BLOCK_SIZE = 4


def _ids(blocks) -> list[int]:
    return [block.block_id for block in blocks]


def _cached_pool(num_blocks: int, tenant_quota: int | None = None) -> tuple[BlockPool, list]:
    """A pool whose blocks are all allocated and registered under distinct hashes."""
    pool = BlockPool(num_blocks, tenant_quota=tenant_quota)
    blocks = pool.get_new_blocks(num_blocks, now=0.0)
    for i, block in enumerate(blocks):
        tokens = list(range(i * 100, i * 100 + BLOCK_SIZE))
        hashes = hash_full_blocks(tokens, BLOCK_SIZE, "test")
        pool.cache_full_blocks([block], hashes, None, tokens, BLOCK_SIZE)
    return pool, blocks


def _evicted(pool: BlockPool, count: int, now: float) -> list[int]:
    return _ids(pool.get_new_blocks(count, now=now))


def test_lru_evicts_least_recently_freed_first_whatever_the_windows():
    pool, blocks = _cached_pool(3)
    for i, block in enumerate(blocks):
        pool.free_blocks([block], KEEP_LRU, now=float(i))
    assert _ids(pool.free_block_queue.order(now=100.0)) == [0, 1, 2]
    assert _evicted(pool, 3, now=100.0) == [0, 1, 2]


def test_idle_ttl_evicts_expired_blocks_before_older_ones_still_in_their_window():
    pool, blocks = _cached_pool(3)
    pool.free_blocks([blocks[0]], Retention(0, 100.0), now=0.0)  # old, long window
    pool.free_blocks([blocks[1]], Retention(0, 2.0), now=5.0)  # newer, short window
    pool.free_blocks([blocks[2]], Retention(0, 100.0), now=6.0)
    assert _ids(pool.free_block_queue.order(now=6.5)) == [0, 1, 2]  # none expired: LRU
    assert _ids(pool.free_block_queue.order(now=7.0)) == [1, 0, 2]  # 1 expired at 7
    assert _evicted(pool, 1, now=7.0) == [1]


def test_priority_evicts_lower_ranks_first_and_lru_within_a_rank():
    pool, blocks = _cached_pool(5)
    ranks = [1, 0, 1, 0, 2]
    for i, (block, rank) in enumerate(zip(blocks, ranks)):
        pool.free_blocks([block], Retention(rank, math.inf), now=float(i))
    assert _evicted(pool, 5, now=10.0) == [1, 3, 0, 2, 4]


def test_a_retention_window_decays_to_the_lowest_rank():
    pool, blocks = _cached_pool(2)
    pool.free_blocks([blocks[0]], Retention(5, 10.0), now=0.0)  # premium for 10 s
    pool.free_blocks([blocks[1]], Retention(0, math.inf), now=1.0)
    assert _ids(pool.free_block_queue.order(now=9.0)) == [1, 0]
    assert _ids(pool.free_block_queue.order(now=10.0)) == [0, 1]


def test_a_shared_block_keeps_the_most_any_holder_asked_for_until_evicted():
    pool, blocks = _cached_pool(2)
    shared, other = blocks
    pool.touch([shared])  # a second holder
    pool.free_blocks([shared], Retention(3, 50.0), now=0.0)  # premium holder leaves first
    pool.free_blocks([shared], Retention(0, 1.0), now=1.0)  # the low-class holder frees it
    pool.free_blocks([other], Retention(0, 1.0), now=2.0)
    assert shared.retention == Retention(3, 50.0)
    assert _ids(pool.free_block_queue.order(now=2.5)) == [other.block_id, shared.block_id]
    (taken,) = pool.get_new_blocks(1, now=3.5)  # `other` expired at 3
    assert taken is other and other.retention is None  # evicted: retention forgotten


def test_a_revived_block_leaves_its_class_and_counts_stay_right():
    pool, blocks = _cached_pool(3)
    for i, block in enumerate(blocks):
        pool.free_blocks([block], Retention(i, math.inf), now=float(i))
    assert pool.num_free_blocks == 3
    pool.touch([blocks[1]])
    assert pool.num_free_blocks == 2 and blocks[1] not in pool.free_block_queue
    assert _evicted(pool, 2, now=5.0) == [0, 2]
    assert pool.num_free_blocks == 0


@pytest.mark.parametrize(
    ("policy", "priority", "window", "expected"),
    [
        ("lru", -5, 30.0, KEEP_LRU),
        ("idle_ttl", -5, None, Retention(0, 600.0)),
        ("idle_ttl", 0, 30.0, Retention(0, 30.0)),
        ("priority", -2, None, Retention(2, 600.0)),
    ],
)
def test_retention_for_each_policy(policy, priority, window, expected):
    assert retention_for(policy, priority, 600.0, window) == expected


def test_retention_carries_the_tenant_under_every_policy():
    assert retention_for("lru", 0, 600.0, tenant="t") == Retention(0, math.inf, "t")
    assert retention_for("priority", -1, 600.0, tenant="t") == Retention(1, 600.0, "t")


def test_a_tenant_over_its_quota_loses_its_own_oldest_blocks_first():
    pool, blocks = _cached_pool(6, tenant_quota=2)
    owners = ["a", "a", "", "a", "b", "a"]  # freed in this order; a keeps 4 > 2
    for i, (block, tenant) in enumerate(zip(blocks, owners)):
        pool.free_blocks([block], Retention(tenant=tenant), now=float(i))
    # a's two oldest go first (it is over by two), then plain LRU: the shared block 2, a's
    # block 3, b's 4, a's 5 (a is back at its quota after two evictions).
    assert _ids(pool.free_block_queue.order(now=10.0)) == [0, 1, 2, 3, 4, 5]
    pool2, blocks2 = _cached_pool(6, tenant_quota=2)
    owners2 = ["", "b", "a", "a", "a", "a"]
    for i, (block, tenant) in enumerate(zip(blocks2, owners2)):
        pool2.free_blocks([block], Retention(tenant=tenant), now=float(i))
    assert _ids(pool2.free_block_queue.order(now=10.0)) == [2, 3, 0, 1, 4, 5]
    assert _evicted(pool2, 3, now=10.0) == [2, 3, 0]
    assert pool2.eviction_counts == {("quota", 0): 2, ("capacity", 0): 1}


# ---- the engine --------------------------------------------------------------------------


def _story(i: int) -> str:
    return f"Session {i}: " + "the keeper climbed the stairs and lit the lamp again. " * 6


def _cached_tokens(llm: LLM, prompt: str, priority: int = 0, **params) -> int:
    params = SamplingParams(temperature=0.0, max_tokens=1, **params)
    return llm.generate([prompt], params, priority=[priority])[0].outputs[0].num_cached_tokens


@pytest.mark.parametrize("policy", ["lru", "priority"])
def test_a_premium_session_survives_a_flood_only_under_the_priority_policy(policy):
    # 34 blocks of 16 tokens; a session is 71 tokens (5 blocks).
    llm = LLM(kv_cache_bytes=24 * 2**20, eviction_policy=policy)
    premium = _story(0)
    assert _cached_tokens(llm, premium, priority=-1) == 0
    for i in range(1, 17):  # low-class sessions: twice what the pool holds
        _cached_tokens(llm, _story(i), priority=0)
    hit = _cached_tokens(llm, premium, priority=-1)
    if policy == "priority":
        assert hit >= 0.9 * len(llm.tokenizer.encode(premium)) - 16
    else:
        assert hit == 0


@pytest.mark.parametrize("quota", [1.0, 0.25])
def test_a_tenant_quota_keeps_one_tenants_flood_from_pushing_out_another(quota):
    llm = LLM(kv_cache_bytes=24 * 2**20, tenant_cache_quota=quota)
    session = _story(0)
    assert _cached_tokens(llm, session, cache_salt="quiet") == 0
    for i in range(1, 17):  # one tenant's sessions: twice what the pool holds
        _cached_tokens(llm, _story(i), cache_salt="noisy")
    hit = _cached_tokens(llm, session, cache_salt="quiet")
    if quota < 1.0:
        assert hit >= 0.9 * len(llm.tokenizer.encode(session)) - 16
    else:
        assert hit == 0


def test_a_cache_salt_isolates_tenants_and_expires_requests_above_the_maximum():
    llm = LLM(kv_cache_bytes=32 * 2**20, max_retention_s=3600.0)
    prompt = _story(42)
    assert _cached_tokens(llm, prompt, cache_salt="tenant-a") == 0
    assert _cached_tokens(llm, prompt, cache_salt="tenant-a") > 0  # same tenant: shared
    assert _cached_tokens(llm, prompt, cache_salt="tenant-b") == 0  # another tenant: not
    assert _cached_tokens(llm, prompt) == 0  # nor unsalted requests
    with pytest.raises(ValueError, match="cache_retention_s must be at most 3600"):
        _cached_tokens(llm, prompt, cache_retention_s=7200.0)
