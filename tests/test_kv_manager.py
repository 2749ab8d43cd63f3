"""KVCacheManager: prefix hits, check-then-commit allocation, caching, eviction order, freeing."""

from __future__ import annotations

import random
from collections import Counter
from dataclasses import dataclass, field

import pytest

from splitserve.engine.kv.block_hash import BlockHash, hash_block_tokens, hash_full_blocks
from splitserve.engine.kv.events import BlockRemoved, BlockStored, KVCacheEvent
from splitserve.engine.kv.manager import ComputedBlocks, KVCacheManager
from splitserve.engine.request import Request
from splitserve.engine.sampling_params import SamplingParams

BLOCK_SIZE = 4
NAMESPACE = "test-ns"


def _request(request_id: str, tokens: list[int], extra_keys: tuple[str, ...] = ()) -> Request:
    return Request(request_id, list(tokens), SamplingParams(), extra_hash_keys=extra_keys)


def _manager(num_blocks: int, enable_caching: bool = True) -> KVCacheManager:
    return KVCacheManager(num_blocks, BLOCK_SIZE, enable_caching, hash_namespace=NAMESPACE)


def _admit(manager: KVCacheManager, request: Request) -> ComputedBlocks:
    """Admits with its whole uncached prompt scheduled, as the scheduler does."""
    computed = manager.get_computed_blocks(request)
    assert manager.allocate_slots(request, request.num_tokens - computed.num_tokens, computed)
    request.num_computed_tokens = computed.num_tokens
    return computed


def _prefill(manager: KVCacheManager, request: Request) -> ComputedBlocks:
    """Admits, then 'computes' the whole prompt and caches its full blocks."""
    computed = _admit(manager, request)
    request.num_computed_tokens = request.num_tokens
    manager.cache_blocks(request, request.num_computed_tokens)
    return computed


def _hashes(tokens: list[int], extra_keys: tuple[str, ...] = ()) -> list[BlockHash]:
    return hash_full_blocks(tokens, BLOCK_SIZE, NAMESPACE, extra_keys)


def _free_ids(manager: KVCacheManager) -> list[int]:
    return [block.block_id for block in manager.block_pool.free_block_queue]


def test_eviction_order_is_lru_first_and_tail_blocks_first() -> None:
    manager = _manager(8)
    a_tokens, b_tokens = list(range(8)), list(range(100, 108))
    a = _request("a", a_tokens)
    b = _request("b", b_tokens)
    _prefill(manager, a)
    _prefill(manager, b)
    assert manager.get_block_ids("a") == [0, 1] and manager.get_block_ids("b") == [2, 3]
    a_hashes, b_hashes = _hashes(a_tokens), _hashes(b_tokens)
    assert manager.take_events() == [
        BlockStored(a_hashes, None, a_tokens, BLOCK_SIZE),
        BlockStored(b_hashes, None, b_tokens, BLOCK_SIZE),
    ]
    manager.free(a)
    manager.free(b)
    assert _free_ids(manager) == [4, 5, 6, 7, 1, 0, 3, 2]

    # Using a's prefix again makes it more recent than b's.
    a_again = _request("a2", a_tokens + [8])
    assert _admit(manager, a_again).num_tokens == 8
    assert manager.get_block_ids("a2") == [0, 1, 4]
    manager.free(a_again)  # block 4 was never full: no hash, reused first
    assert _free_ids(manager) == [4, 5, 6, 7, 3, 2, 1, 0]

    c = _request("c", list(range(200, 228)))  # 7 blocks
    _admit(manager, c)
    assert manager.get_block_ids("c") == [4, 5, 6, 7, 3, 2, 1]
    assert manager.take_events() == [BlockRemoved([b_hashes[1], b_hashes[0], a_hashes[1]])]
    assert _free_ids(manager) == [0]
    # The surviving parent still serves the shorter prefix.
    assert manager.get_computed_blocks(_request("d", a_tokens)).num_tokens == 4


def test_prefix_hit_is_the_longest_cached_run_capped_below_num_tokens() -> None:
    manager = _manager(16)
    tokens = list(range(12))  # 3 full blocks
    _prefill(manager, _request("a", tokens))
    a_ids = manager.get_block_ids("a")

    def hit(query: list[int], extra_keys: tuple[str, ...] = ()) -> tuple[list[int], int]:
        computed = manager.get_computed_blocks(_request("q", query, extra_keys))
        return [b.block_id for b in computed.blocks], computed.num_tokens

    assert hit(tokens + [99]) == (a_ids, 12)
    # All 12 tokens are cached, but the last must still run through the model for logits.
    assert hit(tokens) == (a_ids[:2], 8)
    assert hit(tokens[:9]) == (a_ids[:2], 8)
    assert hit(tokens[:8]) == (a_ids[:1], 4)
    assert hit(tokens[:5] + [77] + tokens[6:] + [1]) == (a_ids[:1], 4)
    assert hit([55] + tokens[1:] + [1]) == ([], 0)
    assert hit(tokens[:3]) == ([], 0)
    assert hit(tokens + [99], extra_keys=("lora:x",)) == ([], 0)


def test_recomputed_last_block_is_not_cached_twice() -> None:
    manager = _manager(8)
    tokens = list(range(12))
    _prefill(manager, _request("a", tokens))
    manager.take_events()
    b = _request("b", tokens)
    assert _prefill(manager, b).num_tokens == 8
    a_ids, b_ids = manager.get_block_ids("a"), manager.get_block_ids("b")
    assert b_ids[:2] == a_ids[:2] and b_ids[2] != a_ids[2]
    # b's third block holds the same tokens as a's, whose registration stands: no event.
    assert manager.take_events() == []
    assert manager.block_pool.blocks[b_ids[2]].block_hash is None
    assert manager.block_pool.get_cached_block(_hashes(tokens)[2]).block_id == a_ids[2]


def test_a_revived_cached_block_is_not_also_handed_out_as_new() -> None:
    manager = _manager(3)
    tokens = list(range(8))
    _prefill(manager, _request("a", tokens))
    manager.free(_request("a", tokens))
    assert _free_ids(manager) == [2, 1, 0]
    # Hits block 0 (capped at 1 block), needs 2 more: must get 2 and 1, not 0 again.
    b = _request("b", tokens[:4] + [50, 51, 52, 53, 54])
    assert _admit(manager, b).num_tokens == 4
    assert manager.get_block_ids("b") == [0, 2, 1]
    assert manager.num_free_blocks == 0
    assert [block.ref_cnt for block in manager.block_pool.blocks] == [1, 1, 1]


def test_two_requests_sharing_a_prefix_share_blocks_with_two_references() -> None:
    manager = _manager(8)
    prefix = list(range(8))
    a = _request("a", prefix + [1])
    b = _request("b", prefix + [2, 3, 4, 5, 6])
    _prefill(manager, a)
    assert _prefill(manager, b).num_tokens == 8
    blocks = manager.block_pool.blocks
    assert manager.get_block_ids("a") == [0, 1, 2]
    assert manager.get_block_ids("b") == [0, 1, 3, 4]
    assert [b.ref_cnt for b in blocks] == [2, 2, 1, 1, 1, 0, 0, 0]
    manager.free(a)
    assert [b.ref_cnt for b in blocks] == [1, 1, 0, 1, 1, 0, 0, 0]
    assert _free_ids(manager) == [2, 5, 6, 7]
    manager.free(b)
    manager.free(b)  # freeing twice (an abort racing a finish) is a no-op
    assert manager.num_free_blocks == 8 and all(b.ref_cnt == 0 for b in blocks)
    assert _free_ids(manager) == [4, 2, 5, 6, 7, 3, 1, 0]


def _snapshot(manager: KVCacheManager, request_ids: list[str]) -> tuple:
    pool = manager.block_pool
    return (
        _free_ids(manager),
        [(b.ref_cnt, b.block_hash) for b in pool.blocks],
        pool.num_cached_blocks,
        [manager.get_block_ids(request_id) for request_id in request_ids],
        (manager.prefix_cache_stats.num_requests, manager.prefix_cache_stats.num_hit_tokens),
    )


def test_allocation_failure_changes_nothing_and_counts_revived_blocks() -> None:
    manager = _manager(4)
    a = _request("a", list(range(5)))
    _prefill(manager, a)  # blocks 0 (full, cached) and 1 (partial)
    manager.free(a)
    x = _request("x", list(range(100, 108)))
    _prefill(manager, x)
    assert manager.get_block_ids("x") == [1, 2]
    assert _free_ids(manager) == [3, 0]
    manager.take_events()

    b = _request("b", list(range(4)) + list(range(200, 208)))
    computed = manager.get_computed_blocks(b)
    assert [block.block_id for block in computed.blocks] == [0]
    # 2 new blocks fit the 2 free ones, but touching block 0 takes it out of the free queue.
    before = _snapshot(manager, ["x", "b"])
    assert not manager.can_allocate(b, 8, computed)
    assert not manager.allocate_slots(b, 8, computed)
    assert _snapshot(manager, ["x", "b"]) == before
    assert manager.take_events() == []
    # A running request that cannot grow is left as it was, too.
    x.num_computed_tokens = 8
    assert not manager.allocate_slots(x, 9)
    assert _snapshot(manager, ["x", "b"]) == before

    assert manager.can_allocate(b, 4, computed)  # a chunk that fits
    assert manager.allocate_slots(b, 4, computed)
    assert manager.get_block_ids("b") == [0, 3]
    assert manager.num_free_blocks == 0


def test_cache_blocks_registers_output_tokens_as_blocks_fill() -> None:
    manager = _manager(8)
    keys = ("lora:7",)
    request = _request("a", [10, 11, 12, 13, 14, 15], keys)
    _prefill(manager, request)
    first = manager.take_events()
    assert first == [
        BlockStored(_hashes(request.all_token_ids, keys)[:1], None, [10, 11, 12, 13], BLOCK_SIZE)
    ]
    for token_id in (16, 17, 18):  # decode: one new token per step
        request.append_output_token(token_id)
        assert manager.allocate_slots(request, 1)
        request.num_computed_tokens += 1
        manager.cache_blocks(request, request.num_computed_tokens)
    # Tokens 0..7 are computed; 18 is sampled but its KV is not written yet.
    hashes = _hashes(request.all_token_ids, keys)
    assert request.block_hashes == hashes
    assert manager.take_events() == [BlockStored([hashes[1]], hashes[0], [14, 15, 16, 17], 4)]
    assert manager.get_block_ids("a") == [0, 1, 2]
    assert manager.block_pool.blocks[1].block_hash == hashes[1]
    assert manager.block_pool.blocks[2].block_hash is None


def test_prefix_cache_stats_count_each_admission_once() -> None:
    manager = _manager(4)
    _prefill(manager, _request("a", list(range(8))))
    b = _request("b", list(range(8)) + list(range(50, 60)))  # 18 tokens, 5 blocks: too many
    computed = manager.get_computed_blocks(b)
    manager.get_computed_blocks(b)
    assert not manager.allocate_slots(b, b.num_tokens - computed.num_tokens, computed)
    stats = manager.prefix_cache_stats
    assert (stats.num_requests, stats.num_queried_tokens, stats.num_hit_tokens) == (1, 8, 0)
    assert manager.allocate_slots(b, 4, computed)
    assert (stats.num_requests, stats.num_queried_tokens, stats.num_hit_tokens) == (2, 26, 8)
    assert stats.hit_rate == pytest.approx(8 / 26)
    assert manager.allocate_slots(b, 4)  # growing is not another admission
    assert stats.num_requests == 2


def test_without_caching_no_hits_no_hashes_no_events() -> None:
    manager = _manager(4, enable_caching=False)
    tokens = list(range(9))
    _prefill(manager, _request("a", tokens))
    b = _request("b", tokens)
    assert manager.get_computed_blocks(b).num_tokens == 0
    assert b.block_hashes == []
    manager.free(_request("a", tokens))
    _prefill(manager, b)
    assert manager.take_events() == []


def test_bad_input_raises_value_error_naming_the_parameter() -> None:
    with pytest.raises(ValueError, match="block_size"):
        KVCacheManager(4, 0)
    with pytest.raises(ValueError, match="num_blocks"):
        KVCacheManager(0, 4)
    manager = _manager(8)
    a = _request("a", list(range(9)))
    with pytest.raises(ValueError, match="num_new_tokens"):
        manager.allocate_slots(a, -1)
    with pytest.raises(ValueError, match="request_id"):
        manager.cache_blocks(a, 4)
    _prefill(manager, a)
    with pytest.raises(ValueError, match="num_computed_tokens"):
        manager.cache_blocks(a, 10)
    computed = manager.get_computed_blocks(_request("a", list(range(9))))
    with pytest.raises(ValueError, match="computed"):
        manager.allocate_slots(a, 1, computed)


# A property-style run: many requests admitted, grown, preempted, finished and aborted.


@dataclass
class _EventLedger:
    """Replays events: each hash must be stored, then removed, then maybe stored again."""

    live: set[BlockHash] = field(default_factory=set)
    num_stored: int = 0
    num_removed: int = 0

    def consume(self, events: list[KVCacheEvent]) -> None:
        for event in events:
            if isinstance(event, BlockStored):
                self._stored(event)
            else:
                assert self.live.issuperset(event.block_hashes), "removed a hash never stored"
                assert len(set(event.block_hashes)) == len(event.block_hashes)
                self.live.difference_update(event.block_hashes)
                self.num_removed += len(event.block_hashes)

    def _stored(self, event: BlockStored) -> None:
        assert len(event.token_ids) == len(event.block_hashes) * event.block_size
        parent = event.parent_block_hash
        for index, block_hash in enumerate(event.block_hashes):
            assert block_hash not in self.live, "stored a hash twice"
            tokens = event.token_ids[index * BLOCK_SIZE : (index + 1) * BLOCK_SIZE]
            if parent is not None:  # a first block also mixes in extra keys we cannot see
                assert hash_block_tokens(parent, tokens) == block_hash
            parent = block_hash
            self.live.add(block_hash)
            self.num_stored += 1


@dataclass
class _Sim:
    manager: KVCacheManager
    rng: random.Random
    waiting: list[Request] = field(default_factory=list)
    running: list[Request] = field(default_factory=list)
    scheduled: dict[str, int] = field(default_factory=dict)  # request_id -> tokens this step
    # block_id -> (extra keys, tokens) whose KV the block holds, as if the model wrote it.
    contents: dict[int, tuple] = field(default_factory=dict)
    ledger: _EventLedger = field(default_factory=_EventLedger)
    num_failed_admissions: int = 0
    num_preemptions: int = 0

    def new_request(self, request_id: str, prefixes: list[list[int]]) -> None:
        prompt = self.rng.choice(prefixes) + [
            self.rng.randrange(40) for _ in range(self.rng.randint(1, 9))
        ]
        keys = self.rng.choice([(), (), ("lora:1",)])
        self.waiting.append(_request(request_id, prompt, keys))

    def admit(self) -> None:
        request = self.rng.choice(self.waiting)
        computed = self.manager.get_computed_blocks(request)
        assert computed.num_tokens < request.num_tokens
        for index, block in enumerate(computed.blocks):  # a hit holds exactly these tokens
            assert self.contents[block.block_id] == self._content(request, index)
        num_new = self.rng.randint(1, request.num_tokens - computed.num_tokens)
        before = _snapshot(self.manager, [request.request_id])
        if not self.manager.allocate_slots(request, num_new, computed):
            assert _snapshot(self.manager, [request.request_id]) == before
            assert self.manager.take_events() == []
            self.num_failed_admissions += 1
            return
        ids = self.manager.get_block_ids(request.request_id)
        assert ids[: len(computed.blocks)] == [b.block_id for b in computed.blocks]
        request.num_computed_tokens = computed.num_tokens
        self.scheduled[request.request_id] = num_new
        self.waiting.remove(request)
        self.running.append(request)

    def step(self) -> None:
        request = self.rng.choice(self.running)
        self._compute(request, self.scheduled[request.request_id])
        if request.num_computed_tokens == request.num_tokens:
            if request.num_output_tokens >= 6:
                self.finish(request)
                return
            request.append_output_token(self.rng.randrange(40))
        num_new = self.rng.randint(1, request.num_tokens - request.num_computed_tokens)
        if self.manager.allocate_slots(request, num_new):
            self.scheduled[request.request_id] = num_new
            return
        self.manager.free(request)  # preempt: recompute later, maybe from cached blocks
        request.num_computed_tokens = 0
        self.running.remove(request)
        self.waiting.append(request)
        self.num_preemptions += 1

    def finish(self, request: Request) -> None:
        self.manager.free(request)
        (self.running if request in self.running else self.waiting).remove(request)

    def _compute(self, request: Request, num_tokens: int) -> None:
        start = request.num_computed_tokens
        request.num_computed_tokens += num_tokens
        ids = self.manager.get_block_ids(request.request_id)
        first, last = start // BLOCK_SIZE, (request.num_computed_tokens - 1) // BLOCK_SIZE
        for index in range(first, last + 1):
            self.contents[ids[index]] = self._content(request, index)
        self.manager.cache_blocks(request, request.num_computed_tokens)

    @staticmethod
    def _content(request: Request, index: int) -> tuple:
        tokens = request.all_token_ids[index * BLOCK_SIZE : (index + 1) * BLOCK_SIZE]
        return request.extra_hash_keys, tuple(tokens)

    def check_invariants(self) -> None:
        manager, pool = self.manager, self.manager.block_pool
        self.ledger.consume(manager.take_events())
        holders = Counter()
        for request in self.running:
            ids = manager.get_block_ids(request.request_id)
            allocated = request.num_computed_tokens + self.scheduled[request.request_id]
            assert len(ids) == -(-allocated // BLOCK_SIZE)
            holders.update(ids)
        assert all(manager.get_block_ids(r.request_id) == [] for r in self.waiting)
        free_ids = _free_ids(manager)
        assert len(free_ids) == len(set(free_ids)) == manager.num_free_blocks
        for block in pool.blocks:
            assert block.ref_cnt == holders[block.block_id]
            assert (block in pool.free_block_queue) == (block.ref_cnt == 0)
        cached = {b.block_hash: b for b in pool.blocks if b.block_hash is not None}
        assert pool.num_cached_blocks == len(cached)
        assert all(pool.get_cached_block(h) is b for h, b in cached.items())
        assert self.ledger.live == set(cached)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_workload_keeps_invariants_and_returns_every_block(seed: int) -> None:
    rng = random.Random(seed)
    sim = _Sim(_manager(40), rng)
    prefixes = [[rng.randrange(40) for _ in range(rng.randrange(0, 14))] for _ in range(4)]
    for index in range(2500):
        action = rng.random()
        if action < 0.15 or not (sim.waiting or sim.running):
            sim.new_request(f"r{index}", prefixes)
        elif action < 0.4 and sim.waiting:
            sim.admit()
        elif action < 0.9 and sim.running:
            sim.step()
        elif action < 0.95 and sim.running:
            sim.finish(rng.choice(sim.running))  # abort mid-flight
        elif sim.waiting:
            sim.finish(rng.choice(sim.waiting))  # abort before admission
        sim.check_invariants()

    for request in sim.running + sim.waiting:
        sim.finish(request)
    sim.check_invariants()
    manager = sim.manager
    assert manager.num_free_blocks == manager.num_blocks
    assert all(block.ref_cnt == 0 for block in manager.block_pool.blocks)
    assert manager.usage == 0.0
    # The run exercised what it claims to.
    assert manager.prefix_cache_stats.num_hit_tokens > 0
    assert sim.num_failed_admissions > 0 and sim.num_preemptions > 0
    assert sim.ledger.num_removed > 0
    assert manager.reset_prefix_cache()
    sim.check_invariants()
    assert sim.ledger.live == set()
