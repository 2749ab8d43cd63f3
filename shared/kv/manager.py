"""The request-level KV cache API the scheduler talks to: prefix hits, slots, caching, freeing.

A request's blocks cover its tokens in order; block i holds tokens [i * block_size,
(i + 1) * block_size). At admission:

    | prefix-cache hits (touched) | new blocks for num_new_tokens |
    0                  computed.num_tokens

and while running:

    | computed (num_computed_tokens) | num_new_tokens (this step) | unallocated |

With a sliding window on every layer (`sliding_window`, Mistral and Phi-3), a running request
gives back the blocks no query of it will read again, so its blocks stay bounded by the window:

    | released (out of every window) | window of its next query | new |

A released position keeps a block id in the request's table, the id of its first block still
held (the kernels index a table by position and read only the window, so any block they are
given for a position outside it is never looked at, and a held one is always valid memory).

Who owns what: the scheduler owns `request.num_computed_tokens` (it sets it to
`computed.num_tokens` after a successful admission, and advances it after each step); this
manager owns `request.block_hashes`, extended lazily as blocks fill and never recomputed. Not
thread safe: the engine loop owns it.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from itertools import islice
from typing import Protocol, cast

from splitserve.engine.config import CacheConfig
from splitserve.engine.kv.block import Block
from splitserve.engine.kv.block_hash import BlockHash, hash_full_blocks, salted_hash
from splitserve.engine.kv.block_pool import BlockPool, EvictedBlock
from splitserve.engine.kv.events import KVCacheEvent
from splitserve.engine.kv.eviction import Retention
from splitserve.engine.kv.tiers import Tier


class Request(Protocol):
    """What this manager reads of the engine's `splitserve.engine.request.Request` (and writes: only
    `block_hashes`). A protocol, so the KV package needs nothing from the engine's modules."""

    request_id: str
    num_computed_tokens: int
    all_token_ids: list[int]
    extra_hash_keys: tuple[str, ...]
    block_hashes: list[BlockHash]
    kv_retention: Retention

    @property
    def num_tokens(self) -> int: ...

    @property
    def num_known_tokens(self) -> int: ...


class LowerTiers(Protocol):
    """Where blocks evicted from the pool go and may still be found
    (shared/kv/offload/offloader.py)."""

    def save_evicted(self, evicted: list[EvictedBlock]) -> None: ...

    def tier_of(self, block_hash: BlockHash) -> Tier | None: ...


@dataclass(frozen=True, slots=True)
class ComputedBlocks:
    """Cached blocks that hold a prefix of a request's tokens, and how many tokens that is;
    then the hashes of the blocks that continue that prefix in the lower tiers (they must be
    loaded into new blocks before they count as computed)."""

    blocks: tuple[Block, ...] = ()
    num_tokens: int = 0  # (num_skipped_blocks + len(blocks)) * block_size
    load_hashes: tuple[BlockHash, ...] = ()
    load_tiers: tuple[Tier, ...] = ()  # where each of load_hashes is
    # A window group's hit (shared/kv/groups.py): the leading blocks its layers no longer read,
    # which the hit does not hold; `blocks` continue after them.
    num_skipped_blocks: int = 0

    def without_loads(self) -> ComputedBlocks:
        if not self.load_hashes:
            return self
        return ComputedBlocks(
            self.blocks, self.num_tokens, num_skipped_blocks=self.num_skipped_blocks
        )


NO_COMPUTED_BLOCKS = ComputedBlocks()


@dataclass(slots=True)
class PrefixCacheStats:
    """Cumulative over admissions; a request counts once per successful admission."""

    num_requests: int = 0
    num_queried_tokens: int = 0
    num_hit_tokens: int = 0

    @property
    def hit_rate(self) -> float:
        return self.num_hit_tokens / self.num_queried_tokens if self.num_queried_tokens else 0.0


@dataclass(slots=True)
class _RequestBlocks:
    blocks: list[Block] = field(default_factory=list)
    block_ids: list[int] = field(default_factory=list)  # mirrors blocks, for get_block_ids
    # Leading blocks already offered to the pool's hash map (registered, or skipped because
    # another block holds the same hash); cache_blocks starts after them.
    num_cached_blocks: int = 0
    # Leading blocks given back because they fell out of the sliding window; blocks[:n] are
    # no longer this request's and block_ids[:n] name its first held block instead.
    num_released_blocks: int = 0


class KVCacheManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_caching: bool = True,
        hash_namespace: str = CacheConfig.hash_namespace,
        tenant_quota: int | None = None,
        lower_tiers: LowerTiers | None = None,
        sliding_window: int = 0,
        block_pool: BlockPool | None = None,
        hash_salt: bytes = b"",
    ) -> None:
        """`lower_tiers`: the offload tiers, when the engine has them: the pool's evictions are
        written down to them, and prefix lookups continue there. `sliding_window`: how many
        trailing positions any query reads (the model's `kv_window`; 0 = all), past which
        `release_out_of_window` gives blocks back. `block_pool` and `hash_salt`: one layer
        group of several sharing a pool (shared/kv/groups.py): this group's blocks are cached
        under its own hashes (the request's, keyed by the salt) and never published."""
        if not isinstance(block_size, int) or block_size < 1:
            raise ValueError(f"block_size must be an int >= 1, got {block_size!r}")
        if not isinstance(sliding_window, int) or sliding_window < 0:
            raise ValueError(f"sliding_window must be an int >= 0, got {sliding_window!r}")
        self.sliding_window = sliding_window
        if not isinstance(hash_namespace, str):
            raise ValueError(f"hash_namespace must be a str, got {hash_namespace!r}")
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.hash_namespace = hash_namespace
        sink = lower_tiers.save_evicted if lower_tiers is not None else None
        if block_pool is None:
            block_pool = BlockPool(num_blocks, enable_caching, tenant_quota, sink)
        self.block_pool = block_pool
        self.hash_salt = hash_salt
        self.prefix_cache_stats = PrefixCacheStats()
        self._requests: dict[str, _RequestBlocks] = {}
        self.lower_tiers = lower_tiers

    @classmethod
    def from_config(
        cls,
        cache_config: CacheConfig,
        num_blocks: int,
        lower_tiers: LowerTiers | None = None,
        sliding_window: int = 0,
    ) -> KVCacheManager:
        return cls(
            num_blocks,
            cache_config.block_size,
            enable_caching=cache_config.enable_prefix_caching,
            hash_namespace=cache_config.hash_namespace,
            tenant_quota=cache_config.tenant_quota_blocks(num_blocks),
            lower_tiers=lower_tiers,
            sliding_window=sliding_window,
        )

    @property
    def num_blocks(self) -> int:
        return self.block_pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.block_pool.num_free_blocks

    @property
    def usage(self) -> float:
        return self.block_pool.usage

    def get_computed_blocks(self, request: Request) -> ComputedBlocks:
        """The longest run of cached blocks holding a prefix of the request's tokens.

        Never all of its tokens: the last one must still go through the model to produce
        logits, so at most (num_tokens - 1) // block_size blocks hit. Pure lookup: no
        reference is taken (allocate_slots does that) and no stats are recorded, so the
        scheduler may call it on every admission attempt; call allocate_slots with the result
        before anything else allocates, or the blocks may be evicted in between.
        """
        if not self.enable_caching:
            return NO_COMPUTED_BLOCKS
        self._update_block_hashes(request)
        max_num_blocks = max(0, (request.num_tokens - 1) // self.block_size)
        blocks: list[Block] = []
        for block_hash in islice(request.block_hashes, max_num_blocks):
            block = self.block_pool.get_cached_block(cast(BlockHash, block_hash))
            if block is None:
                break
            blocks.append(block)
        if self.lower_tiers is None:
            return ComputedBlocks(tuple(blocks), len(blocks) * self.block_size)
        hashes = islice(request.block_hashes, len(blocks), max_num_blocks)
        load_hashes, load_tiers = self._lower_tier_run(self.lower_tiers, hashes)
        return ComputedBlocks(tuple(blocks), len(blocks) * self.block_size, load_hashes, load_tiers)

    @staticmethod
    def _lower_tier_run(
        lower_tiers: LowerTiers, hashes: Iterable[bytes]
    ) -> tuple[tuple[BlockHash, ...], tuple[Tier, ...]]:
        """The leading hashes the lower tiers hold, and where each is."""
        found: list[BlockHash] = []
        tiers: list[Tier] = []
        for block_hash in cast("Iterable[BlockHash]", hashes):
            tier = lower_tiers.tier_of(block_hash)
            if tier is None:
                break
            found.append(block_hash)
            tiers.append(tier)
        return tuple(found), tuple(tiers)

    def can_allocate(
        self, request: Request, num_new_tokens: int, computed: ComputedBlocks | None = None
    ) -> bool:
        """Whether allocate_slots with the same arguments would succeed; changes nothing."""
        computed = NO_COMPUTED_BLOCKS if computed is None else computed
        return self._fits(self._num_new_blocks(request, num_new_tokens, computed), computed)

    def allocate_slots(
        self, request: Request, num_new_tokens: int, computed: ComputedBlocks | None = None
    ) -> bool:
        """Gives the request slots for num_computed_tokens + computed + num_new_tokens tokens.

        `computed` (from get_computed_blocks) applies only to an admission, while the request
        holds no blocks; its blocks are touched and become the request's first blocks, followed
        by one new block for each of its `load_hashes` (the caller loads them and then calls
        `cache_blocks`), and the admission is counted in prefix_cache_stats. Returns False and
        changes nothing when not enough blocks are free; the scheduler then preempts or waits.
        Does not change `request.num_computed_tokens`.
        """
        computed = NO_COMPUTED_BLOCKS if computed is None else computed
        num_new_blocks = self._num_new_blocks(request, num_new_tokens, computed)
        if not self._fits(num_new_blocks, computed):
            return False
        self.take_hit(request, computed)
        self.take_new_blocks(request, num_new_blocks)
        return True

    def take_hit(self, request: Request, computed: ComputedBlocks) -> None:
        """allocate_slots' first half, unchecked: the request's entry (its admission counted)
        and its hit's blocks, touched. Layer groups of one pool (grouped_manager.py) take
        every group's hit before any group takes new blocks, which could evict them."""
        entry = self._requests.get(request.request_id)
        if entry is None:
            entry = self._requests[request.request_id] = _RequestBlocks()
            self._record_admission(request, computed)
        if computed.blocks:
            self.block_pool.touch(computed.blocks)
            skipped = computed.num_skipped_blocks
            # Skipped positions name the first block held, as released ones do.
            entry.blocks.extend([computed.blocks[0]] * skipped)
            entry.block_ids.extend([computed.blocks[0].block_id] * skipped)
            entry.num_released_blocks = skipped
            self._append_blocks(entry, computed.blocks)
            entry.num_cached_blocks = skipped + len(computed.blocks)

    def take_new_blocks(self, request: Request, num_blocks: int) -> None:
        """allocate_slots' second half, unchecked: `num_blocks` new blocks after the
        request's (take_hit made its entry)."""
        entry = self._requests[request.request_id]
        self._append_blocks(entry, self.block_pool.get_new_blocks(num_blocks))

    def cache_blocks(self, request: Request, num_computed_tokens: int) -> None:
        """Registers the request's blocks that are full of computed tokens in the prefix cache.

        Call after the model wrote KV for the first `num_computed_tokens` tokens (prompt and
        output tokens alike); cheap when no new block filled, so it may run every step.
        """
        if not self.enable_caching:
            return
        if not 0 <= num_computed_tokens <= request.num_tokens:
            raise ValueError(
                f"num_computed_tokens must be in [0, {request.num_tokens}], "
                f"got {num_computed_tokens}"
            )
        entry = self._requests.get(request.request_id)
        if entry is None:
            raise ValueError(f"request_id {request.request_id!r} holds no KV blocks")
        num_full_blocks = min(num_computed_tokens // self.block_size, len(entry.blocks))
        # Released blocks are no longer this request's to register (they were cached, if
        # full, before they went).
        start = max(entry.num_cached_blocks, entry.num_released_blocks)
        if num_full_blocks <= start:
            return
        self._update_block_hashes(request)
        hashes = self._own_hashes(request, max(0, start - 1), num_full_blocks)
        self.block_pool.cache_full_blocks(
            entry.blocks[start:num_full_blocks],
            hashes[1:] if start else hashes,
            hashes[0] if start else None,
            request.all_token_ids[start * self.block_size : num_full_blocks * self.block_size],
            self.block_size,
            publish=not self.hash_salt,
        )
        entry.num_cached_blocks = num_full_blocks

    def free(self, request: Request) -> None:
        """Returns the request's blocks to the pool and forgets it; a no-op if it holds none.

        Blocks are freed tail first, so a chain's tail is evicted before its parents; they keep
        the request's `kv_retention`.
        """
        entry = self._requests.pop(request.request_id, None)
        if entry is not None:
            held = entry.blocks[entry.num_released_blocks :]
            self.block_pool.free_blocks(reversed(held), request.kv_retention)

    def release_out_of_window(self, request: Request, num_settled_tokens: int) -> int:
        """Gives back the request's leading blocks that no query from position
        `num_settled_tokens` on can see (with `sliding_window` W, a query at p reads keys
        p - W + 1 .. p). Call with the first position no step in flight or to come queries
        below: the count of tokens whose KV a finished step wrote. The blocks keep their place
        in the prefix cache until evicted; the request's last block is always kept. Returns how
        many blocks were given back; 0 without a window or blocks."""
        if not self.sliding_window:  # every step calls this: nothing more without a window
            return 0
        entry = self._requests.get(request.request_id)
        if entry is None or not entry.blocks:
            return 0
        first_key = num_settled_tokens - self.sliding_window + 1
        num_out = min(max(0, first_key) // self.block_size, len(entry.blocks) - 1)
        start = entry.num_released_blocks
        if num_out <= start:
            return 0
        # Tail first, as `free` does: a chain's head stays cached longest, and a prefix hit
        # needs its blocks from the first on.
        self.block_pool.free_blocks(reversed(entry.blocks[start:num_out]), request.kv_retention)
        # Every released position, not only the new ones: the id they named before may be
        # one released just now.
        entry.block_ids[:num_out] = [entry.block_ids[num_out]] * num_out
        entry.num_released_blocks = num_out
        return num_out - start

    def num_held_blocks(self, request_id: str) -> int:
        """Blocks the request holds now (released ones not counted); 0 if it holds none."""
        entry = self._requests.get(request_id)
        return len(entry.blocks) - entry.num_released_blocks if entry is not None else 0

    def get_block_ids(self, request_id: str) -> list[int]:
        """The request's block ids in token order (a copy); [] if it holds none."""
        entry = self._requests.get(request_id)
        return list(entry.block_ids) if entry is not None else []

    def take_events(self) -> list[KVCacheEvent]:
        return self.block_pool.take_events()

    def cached_block_hashes(self) -> list[BlockHash]:
        return self.block_pool.cached_block_hashes()

    def reset_prefix_cache(self) -> bool:
        return self.block_pool.reset_prefix_cache()

    def _num_new_blocks(
        self, request: Request, num_new_tokens: int, computed: ComputedBlocks
    ) -> int:
        if not isinstance(num_new_tokens, int) or num_new_tokens < 0:
            raise ValueError(f"num_new_tokens must be an int >= 0, got {num_new_tokens!r}")
        entry = self._requests.get(request.request_id)
        num_held = len(entry.blocks) if entry is not None else 0
        if computed.blocks:
            if num_held:
                raise ValueError(
                    "computed: prefix-cache hits apply only to an admission, but request_id "
                    f"{request.request_id!r} already holds {num_held} blocks"
                )
            self._check_still_cached(request, computed)
        num_loaded_tokens = len(computed.load_hashes) * self.block_size
        num_tokens = (
            request.num_computed_tokens + computed.num_tokens + num_loaded_tokens + num_new_tokens
        )
        num_required = -(-num_tokens // self.block_size)
        num_hit = computed.num_skipped_blocks + len(computed.blocks) if computed.blocks else 0
        return max(0, num_required - num_held - num_hit)

    def _fits(self, num_new_blocks: int, computed: ComputedBlocks) -> bool:
        # Hits on free cached blocks leave the free queue when touched: they cost free blocks
        # just as new ones do, and must not be counted twice.
        num_revived = sum(1 for block in computed.blocks if block.ref_cnt == 0)
        return num_new_blocks + num_revived <= self.block_pool.num_free_blocks

    def _check_still_cached(self, request: Request, computed: ComputedBlocks) -> None:
        num_blocks = computed.num_skipped_blocks + len(computed.blocks)
        assert computed.num_tokens == num_blocks * self.block_size, (
            "computed.num_tokens must cover its blocks exactly"
        )
        hashes = self._own_hashes(request, computed.num_skipped_blocks, num_blocks)
        for block, block_hash in zip(computed.blocks, hashes):
            assert block.block_hash == block_hash, (
                f"computed block {block.block_id} was evicted after get_computed_blocks"
            )

    def lookup_blocks(self, request: Request, num_blocks: int) -> list[Block | None]:
        """The cached block of each of the request's first `num_blocks` blocks (None where this
        pool holds none), under this group's hashes: what a layer group's part of a prefix hit
        is made from (shared/kv/grouped_manager.py)."""
        if not num_blocks:
            return []
        self._update_block_hashes(request)
        get = self.block_pool.get_cached_block
        return [get(block_hash) for block_hash in self._own_hashes(request, 0, num_blocks)]

    def num_unread_blocks(self, num_blocks: int) -> int:
        """Of a prefix of `num_blocks` blocks, how many leading ones no query after it reads
        (with a sliding window; 0 without): a hit need not hold them."""
        if not self.sliding_window or not num_blocks:
            return 0
        first_key = num_blocks * self.block_size - self.sliding_window + 1
        # The last block always counts (a window of one position would skip it all).
        return min(max(0, first_key) // self.block_size, num_blocks - 1)

    def num_new_blocks(
        self, request: Request, num_new_tokens: int, computed: ComputedBlocks | None = None
    ) -> int:
        """The new blocks allocate_slots with these arguments would take (beside the hit's)."""
        computed = NO_COMPUTED_BLOCKS if computed is None else computed
        return self._num_new_blocks(request, num_new_tokens, computed)

    @property
    def num_groups(self) -> int:
        """Blocks a position's block takes: one (no layer groups, grouped_manager.py)."""
        return 1

    def get_group_block_ids(self, request_id: str) -> tuple[list[int], ...]:
        """The block tables of layer groups after the first: none here (one group)."""
        return ()

    def page_block_ids(self, request_id: str, first_block: int) -> list[int]:
        """The blocks whose pages a transfer of the request's blocks from `first_block` on
        moves, in order."""
        return self.get_block_ids(request_id)[first_block:]

    def _own_hashes(self, request: Request, start: int, end: int) -> list[BlockHash]:
        """The hashes this pool caches blocks start..end-1 of the request under: the
        request's, keyed by the group's salt for a layer group after the first."""
        # Request types them as plain bytes; they are BlockHashes made by hash_full_blocks.
        hashes = cast("list[BlockHash]", request.block_hashes[start:end])
        if not self.hash_salt:
            return hashes
        return [salted_hash(block_hash, self.hash_salt) for block_hash in hashes]

    def _update_block_hashes(self, request: Request) -> None:
        """Extends request.block_hashes to every full block of its known tokens (a pending
        token of a step still running is not hashed)."""
        num_known = request.num_known_tokens
        if len(request.block_hashes) < num_known // self.block_size:
            known = request.all_token_ids
            if num_known < len(known):
                known = known[:num_known]
            request.block_hashes.extend(
                hash_full_blocks(
                    known,
                    self.block_size,
                    self.hash_namespace,
                    request.extra_hash_keys,
                    start_hashes=request.block_hashes,
                )
            )

    def _record_admission(self, request: Request, computed: ComputedBlocks) -> None:
        stats = self.prefix_cache_stats
        stats.num_requests += 1
        stats.num_queried_tokens += request.num_tokens
        stats.num_hit_tokens += computed.num_tokens

    @staticmethod
    def _append_blocks(entry: _RequestBlocks, blocks: tuple[Block, ...] | list[Block]) -> None:
        entry.blocks.extend(blocks)
        entry.block_ids.extend(block.block_id for block in blocks)
