"""One KV block's bookkeeping, and the queue of free blocks in eviction order.

A block is `block_size` token slots of KV in every layer; here it is only an id, a reference
count and, once full and registered, the hash of its contents. The tensors live elsewhere.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from splitserve.engine.kv.block_hash import BlockHash

if TYPE_CHECKING:
    from splitserve.engine.kv.eviction import Retention


@dataclass(slots=True, eq=False)
class Block:
    """Identity semantics (eq=False): two blocks are the same only if they are one object."""

    # Fixed at construction: the index into the KV tensors' block dimension.
    block_id: int
    # BlockPool only: how many requests hold this block; 0 means it sits in the free queue.
    ref_cnt: int = 0
    # BlockPool only: set when the block is full and registered in the hash map, cleared when
    # it is evicted. A full block whose hash another block already holds stays None.
    block_hash: BlockHash | None = None
    # FreeBlockQueue only: neighbours while in the queue, both None while allocated.
    prev_free: Block | None = field(default=None, repr=False)
    next_free: Block | None = field(default=None, repr=False)
    # BlockPool only (splitserve.engine.kv.eviction): the most its holders asked to keep it
    # cached, since
    # it was last registered; the retention queue it sits in while free (None: the uncached
    # queue); and when it was last freed (time.monotonic()).
    retention: Retention | None = field(default=None, repr=False)
    free_class: Retention | None = field(default=None, repr=False)
    freed_at: float = field(default=0.0, repr=False)
    # BlockPool only: prefix-cache hits on this block since it was registered (offload tiers
    # write a block to disk only once it has been reused; see shared/kv/offload/).
    num_hits: int = field(default=0, repr=False)


class FreeBlockQueue:
    """Free blocks, least recently used first: `popleft` takes the next block to evict.

    An intrusive doubly linked list (the links live in `Block`), so removing a block from the
    middle, which happens whenever a prefix-cache hit revives a free block, is O(1); a deque
    would make it O(n). Head and tail sentinels remove the empty-list special cases.

    Order policy (kept by `BlockPool.free_blocks`): a request frees its blocks tail first, so
    within one request the tail blocks are evicted before their parents; a chain whose parent
    is gone can never be hit again, while a surviving parent still serves shorter prefixes.
    """

    __slots__ = ("_head", "_tail", "_num_free_blocks")

    def __init__(self, blocks: Iterable[Block] = ()) -> None:
        self._head = Block(block_id=-1)
        self._tail = Block(block_id=-1)
        self._head.next_free = self._tail
        self._tail.prev_free = self._head
        self._num_free_blocks = 0
        for block in blocks:
            self.append(block)

    def __len__(self) -> int:
        return self._num_free_blocks

    def __contains__(self, block: Block) -> bool:
        # Every queued block has both neighbours (sentinels at the ends); allocated ones none.
        return block.prev_free is not None

    def __iter__(self) -> Iterator[Block]:
        """Walks the queue front to back; O(n), for tests and debugging only."""
        block = self._head.next_free
        while block is not self._tail:
            assert block is not None, "free queue link broken"
            yield block
            block = block.next_free

    def peek(self) -> Block:
        """The next block `popleft` would take."""
        block = self._head.next_free
        assert block is not None and block is not self._tail, "peek at an empty free queue"
        return block

    def popleft(self) -> Block:
        block = self._head.next_free
        assert block is not None and block is not self._tail, "popleft from an empty free queue"
        self.remove(block)
        return block

    def popleft_n(self, num_blocks: int) -> list[Block]:
        assert num_blocks <= self._num_free_blocks, "popping more blocks than are free"
        return [self.popleft() for _ in range(num_blocks)]

    def append(self, block: Block) -> None:
        """Puts `block` last: the most recently used, evicted after every other free block."""
        self._link_before(self._tail, block)

    def appendleft(self, block: Block) -> None:
        """Puts `block` first: the next to be evicted."""
        first = self._head.next_free
        assert first is not None, "free queue link broken"
        self._link_before(first, block)

    def remove(self, block: Block) -> None:
        prev_block, next_block = block.prev_free, block.next_free
        assert prev_block is not None and next_block is not None, (
            f"block {block.block_id} is not in the free queue"
        )
        prev_block.next_free = next_block
        next_block.prev_free = prev_block
        block.prev_free = block.next_free = None
        self._num_free_blocks -= 1

    def _link_before(self, successor: Block, block: Block) -> None:
        assert block.prev_free is None and block.next_free is None, (
            f"block {block.block_id} is already in the free queue"
        )
        predecessor = successor.prev_free
        assert predecessor is not None, "free queue link broken"
        predecessor.next_free = block
        block.prev_free = predecessor
        block.next_free = successor
        successor.prev_free = block
        self._num_free_blocks += 1
