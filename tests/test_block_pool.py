"""FreeBlockQueue order and the BlockPool's allocate / free / touch / cache / evict contract."""

from __future__ import annotations

import pytest

from splitserve.engine.kv.block import Block, FreeBlockQueue
from splitserve.engine.kv.block_hash import BlockHash, hash_full_blocks
from splitserve.engine.kv.block_pool import BlockPool
from splitserve.engine.kv.events import BlockRemoved, BlockStored

BLOCK_SIZE = 4


def _ids(blocks) -> list[int]:
    return [block.block_id for block in blocks]


def _chain(num_blocks: int, first_token: int = 0) -> tuple[list[BlockHash], list[int]]:
    tokens = list(range(first_token, first_token + num_blocks * BLOCK_SIZE))
    return hash_full_blocks(tokens, BLOCK_SIZE, "test"), tokens


def _cache(pool: BlockPool, blocks: list[Block], first_token: int = 0) -> list[BlockHash]:
    hashes, tokens = _chain(len(blocks), first_token)
    pool.cache_full_blocks(blocks, hashes, None, tokens, BLOCK_SIZE)
    return hashes


# FreeBlockQueue


def test_queue_pops_in_insertion_order_and_removes_from_the_middle() -> None:
    blocks = [Block(i) for i in range(5)]
    queue = FreeBlockQueue(blocks)
    assert len(queue) == 5
    queue.remove(blocks[2])
    queue.append(blocks[2])
    queue.appendleft(Block(9))
    assert _ids(queue) == [9, 0, 1, 3, 4, 2]
    assert blocks[2] in queue
    first = queue.popleft()
    assert first.block_id == 9 and first not in queue
    assert first.prev_free is None and first.next_free is None
    assert _ids(queue.popleft_n(3)) == [0, 1, 3]
    assert _ids(queue) == [4, 2]
    assert len(queue) == 2


def test_queue_remove_last_and_only_blocks() -> None:
    blocks = [Block(i) for i in range(2)]
    queue = FreeBlockQueue(blocks)
    queue.remove(blocks[1])
    queue.remove(blocks[0])
    assert len(queue) == 0 and _ids(queue) == []
    queue.append(blocks[1])
    assert _ids(queue) == [1]


def test_queue_rejects_double_insert_and_removing_an_absent_block() -> None:
    block = Block(0)
    queue = FreeBlockQueue([block])
    with pytest.raises(AssertionError, match="already in the free queue"):
        queue.append(block)
    queue.remove(block)
    with pytest.raises(AssertionError, match="not in the free queue"):
        queue.remove(block)


# BlockPool


def test_new_blocks_come_in_id_order_with_one_reference() -> None:
    pool = BlockPool(6)
    blocks = pool.get_new_blocks(4)
    assert _ids(blocks) == [0, 1, 2, 3]
    assert [b.ref_cnt for b in blocks] == [1, 1, 1, 1]
    assert pool.num_free_blocks == 2
    assert pool.usage == pytest.approx(4 / 6)
    assert _ids(pool.get_new_blocks(0)) == []


def test_free_keeps_hashes_cached_blocks_last_and_hashless_first() -> None:
    pool = BlockPool(8)
    chain = pool.get_new_blocks(3)  # 0, 1, 2
    hashes = _cache(pool, chain)
    scratch = pool.get_new_blocks(2)  # 3, 4: never full, no hash
    pool.free_blocks(reversed(chain))  # tail first
    pool.free_blocks(scratch)
    # Hashless blocks can never be hit, so they go before every cached block.
    assert _ids(pool.free_block_queue) == [4, 3, 5, 6, 7, 2, 1, 0]
    assert pool.num_free_blocks == 8 and pool.usage == 0.0
    assert [pool.get_cached_block(h) for h in hashes] == chain
    assert all(b.ref_cnt == 0 for b in pool.blocks)


def test_eviction_is_lru_tail_first_with_one_removed_event() -> None:
    pool = BlockPool(4)
    chain = pool.get_new_blocks(3)
    hashes = _cache(pool, chain)
    assert pool.take_events() == [BlockStored(hashes, None, list(range(12)), BLOCK_SIZE)]
    pool.free_blocks(reversed(chain))
    assert _ids(pool.free_block_queue) == [3, 2, 1, 0]

    taken = pool.get_new_blocks(3)
    assert _ids(taken) == [3, 2, 1]
    assert pool.take_events() == [BlockRemoved([hashes[2], hashes[1]])]
    assert all(b.block_hash is None for b in taken)
    assert pool.get_cached_block(hashes[1]) is None and pool.get_cached_block(hashes[2]) is None
    # The parent survives and stays hittable.
    assert pool.get_cached_block(hashes[0]) is chain[0]
    assert pool.num_cached_blocks == 1
    assert pool.take_events() == []


def test_touch_revives_a_free_cached_block_which_is_then_not_handed_out() -> None:
    pool = BlockPool(3)
    blocks = pool.get_new_blocks(2)
    hashes = _cache(pool, blocks)
    pool.free_blocks(reversed(blocks))
    assert _ids(pool.free_block_queue) == [2, 1, 0]

    pool.touch([blocks[0]])
    assert blocks[0].ref_cnt == 1 and blocks[0] not in pool.free_block_queue
    assert _ids(pool.free_block_queue) == [2, 1]
    assert _ids(pool.get_new_blocks(2)) == [2, 1]
    assert pool.num_free_blocks == 0
    assert pool.get_cached_block(hashes[0]) is blocks[0]
    pool.touch([blocks[0]])  # a second holder
    assert blocks[0].ref_cnt == 2
    pool.free_blocks([blocks[0]])
    assert blocks[0].ref_cnt == 1 and pool.num_free_blocks == 0


def test_caching_a_hash_held_by_another_block_keeps_the_first_and_splits_the_event() -> None:
    pool = BlockPool(8)
    first = pool.get_new_blocks(3)
    hashes, tokens = _chain(3)
    pool.cache_full_blocks(first[1:2], hashes[1:2], hashes[0], tokens[4:8], BLOCK_SIZE)
    pool.take_events()

    second = pool.get_new_blocks(3)
    pool.cache_full_blocks(second, hashes, None, tokens, BLOCK_SIZE)
    assert pool.get_cached_block(hashes[1]) is first[1]
    assert second[1].block_hash is None
    assert [second[0].block_hash, second[2].block_hash] == [hashes[0], hashes[2]]
    assert pool.take_events() == [
        BlockStored([hashes[0]], None, tokens[0:4], BLOCK_SIZE),
        BlockStored([hashes[2]], hashes[1], tokens[8:12], BLOCK_SIZE),
    ]


def test_without_caching_nothing_is_registered_and_no_events() -> None:
    pool = BlockPool(4, enable_caching=False)
    blocks = pool.get_new_blocks(2)
    hashes = _cache(pool, blocks)
    assert pool.get_cached_block(hashes[0]) is None
    assert all(b.block_hash is None for b in blocks)
    pool.free_blocks(reversed(blocks))
    pool.get_new_blocks(4)
    assert pool.take_events() == []


def test_reset_prefix_cache_only_when_every_block_is_free() -> None:
    pool = BlockPool(4)
    blocks = pool.get_new_blocks(2)
    hashes = _cache(pool, blocks)
    pool.take_events()
    assert pool.reset_prefix_cache() is False
    assert pool.get_cached_block(hashes[0]) is blocks[0] and pool.take_events() == []

    pool.free_blocks(reversed(blocks))
    assert pool.reset_prefix_cache() is True
    assert pool.take_events() == [BlockRemoved(hashes)]
    assert pool.num_cached_blocks == 0 and all(b.block_hash is None for b in pool.blocks)
    assert pool.reset_prefix_cache() is True and pool.take_events() == []


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="num_blocks"):
        BlockPool(0)
    pool = BlockPool(2)
    with pytest.raises(ValueError, match="num_blocks"):
        pool.get_new_blocks(3)
    with pytest.raises(ValueError, match="num_blocks"):
        pool.get_new_blocks(-1)
    assert pool.num_free_blocks == 2
    block = pool.get_new_blocks(1)[0]
    pool.free_blocks([block])
    with pytest.raises(AssertionError, match="already free"):
        pool.free_blocks([block])
