"""The gateway's in-memory prefix index: block hash -> the pods holding it, and in which tier.

Fed by services/gateway/routing/index_follower.py (a snapshot of the pods' block SETs in
Redis, then the block-event stream). A lookup walks a prompt's block hashes from the first and
follows only the pods still holding every hash so far, so its cost is the pods that hold the
prompt's first block times the run, independent of the pods that hold nothing of it (the
per-request Redis script, `registry_schema.LOOKUP_SCRIPT`, visits every pod).

Single-threaded: owned by the gateway's event loop, no locks.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TypeAlias

from splitserve.common.registry_schema import (
    EVENT_REMOVE,
    EVENT_STORE,
    BlockEvent,
    CachedPrefix,
)
from splitserve.engine.kv.tiers import Tier


@dataclass
class _PodBlocks:
    generation: int  # the pod process whose SETs these are (a newer one replaces them)
    # The seq of the last event applied; None right after a snapshot, when any next one goes.
    last_seq: int | None
    hashes: dict[Tier, set[bytes]] = field(default_factory=dict)
    # The one tier holding all its blocks (most pods: no offload), or None when several do;
    # worked out at a lookup, forgotten when its blocks change (`_store`, `_remove`).
    only_tier: Tier | None = None
    is_only_tier_known: bool = False

    def tier_of_all(self) -> Tier | None:
        """The one tier holding all its blocks, or None (several, or none)."""
        if not self.is_only_tier_known:
            # A snapshot gives every tier a set, most of them empty.
            tiers = [tier for tier, held in self.hashes.items() if held]
            self.only_tier = tiers[0] if len(tiers) == 1 else None
            self.is_only_tier_known = True
        return self.only_tier

    def fastest_tier(self, block_hash: bytes) -> Tier | None:
        for tier in Tier:
            held = self.hashes.get(tier)
            if held is not None and block_hash in held:
                return tier
        return None


# hash -> the pods holding it in any tier: one pod id (most blocks: a session's own) or, when
# several pods hold it (a shared system prompt's), their set. The pod's own sets say in which
# tier, so a block costs one entry here and one in its pod's set of that tier: about 135 bytes
# for a block one pod holds, its hash object included (tracemalloc over 100,000 blocks), where
# a dict of pod -> tiers per hash would add a dict object per block.
_Holders: TypeAlias = str | set[str]


class PrefixIndex:
    def __init__(self) -> None:
        self._holders: dict[bytes, _Holders] = {}
        self._pods: dict[str, _PodBlocks] = {}

    @property
    def num_blocks(self) -> int:
        return len(self._holders)

    def generation(self, pod_id: str) -> int | None:
        pod = self._pods.get(pod_id)
        return None if pod is None else pod.generation

    def num_pod_blocks(self, pod_id: str) -> int:
        """The hashes indexed for one pod, over its tiers (0 for an unknown pod)."""
        pod = self._pods.get(pod_id)
        return 0 if pod is None else sum(len(hashes) for hashes in pod.hashes.values())

    def pod_ids(self) -> set[str]:
        return set(self._pods)

    def replace_pod(
        self, pod_id: str, generation: int, by_tier: Mapping[Tier, Iterable[bytes]]
    ) -> None:
        """The pod's blocks become exactly `by_tier` (a snapshot of its SETs)."""
        self.drop_pod(pod_id)
        pod = self._pods[pod_id] = _PodBlocks(generation, last_seq=None)
        for tier, hashes in by_tier.items():
            self._store(pod_id, pod, tier, hashes)

    def drop_pod(self, pod_id: str) -> None:
        pod = self._pods.pop(pod_id, None)
        if pod is not None:
            for block_hash in set().union(*pod.hashes.values()):
                self._unhold(block_hash, pod_id)

    def apply(self, event: BlockEvent) -> bool:
        """Applies a store or remove. False when the index cannot: the pod is unknown or of
        another generation, its sequence has a gap, or it resynced; the caller re-reads the
        pod's SETs (`replace_pod`). Events of an older generation than the index's are dropped
        (True): a stale writer's."""
        pod = self._pods.get(event.pod_id)
        if pod is not None and event.generation < pod.generation:
            return True
        if pod is None or event.generation != pod.generation:
            return False
        if pod.last_seq is not None and event.seq != pod.last_seq + 1:
            return False
        pod.last_seq = event.seq
        if event.op == EVENT_STORE:
            self._store(event.pod_id, pod, event.tier, event.hashes)
        elif event.op == EVENT_REMOVE:
            self._remove(event.pod_id, pod, event.tier, event.hashes)
        else:
            return False  # EVENT_RESYNC: the SETs were replaced
        return True

    def lookup(
        self, hashes: Sequence[bytes], generations: Mapping[str, int]
    ) -> dict[str, CachedPrefix]:
        """pod id -> the leading run of `hashes` it holds in any tier, counted by the fastest
        tier holding each; only pods in `generations` (pod id -> the generation the registry
        names) whose indexed blocks are of that generation. Pods holding none are absent."""
        runs: dict[str, int] = {}  # pod id -> how many leading hashes it holds
        alive: set[str] = set()  # pods holding every hash so far
        for position, block_hash in enumerate(hashes):
            holders = self._holders.get(block_hash)
            members = () if holders is None else (holders,) if isinstance(holders, str) else holders
            if position == 0:  # pods of the generation the registry names
                pods = self._pods
                alive = {
                    p
                    for p in members
                    if (blocks := pods.get(p)) is not None
                    and generations.get(p) == blocks.generation
                }
            else:
                # Set operations: a shared system prompt's blocks have tens of holders each,
                # walked block by block (benchmarks/scale/pick_alone).
                still = alive.intersection(members)
                if len(still) < len(alive):
                    runs.update((pod_id, position) for pod_id in alive - still)
                alive = still
            if not alive:
                break
        else:
            runs.update((pod_id, len(hashes)) for pod_id in alive)
        # A shared system prompt's holders (a hundred at 1,000 pods: benchmarks/scale) mostly
        # hold it in one tier, to the same length: one answer object for all of them.
        same: dict[tuple[Tier, int], CachedPrefix] = {}
        return {pod_id: self._prefix(pod_id, hashes, run, same) for pod_id, run in runs.items()}

    def _prefix(
        self,
        pod_id: str,
        hashes: Sequence[bytes],
        run: int,
        same: dict[tuple[Tier, int], CachedPrefix],
    ) -> CachedPrefix:
        """The first `run` hashes' blocks by the fastest tier holding each. A pod with one
        tier (most: no offload) holds all of them there, which costs no per-block tier
        lookups, and shares its answer (`same`) with the pods holding as many there."""
        pod = self._pods[pod_id]
        tier = pod.tier_of_all()
        if tier is not None:
            key = (tier, run)
            prefix = same.get(key)
            if prefix is None:
                prefix = same[key] = CachedPrefix({tier: run})
            return prefix
        by_tier: dict[Tier, int] = {}
        for block_hash in hashes[:run]:
            tier = pod.fastest_tier(block_hash)
            assert tier is not None, "a holder holds the hash in some tier"
            by_tier[tier] = by_tier.get(tier, 0) + 1
        return CachedPrefix(by_tier)

    def _store(self, pod_id: str, pod: _PodBlocks, tier: Tier, hashes: Iterable[bytes]) -> None:
        pod.is_only_tier_known = False
        held = pod.hashes.setdefault(tier, set())
        for block_hash in hashes:
            held.add(block_hash)
            holders = self._holders.get(block_hash)
            if holders is None:
                self._holders[block_hash] = pod_id
            elif isinstance(holders, set):
                holders.add(pod_id)
            elif holders != pod_id:
                self._holders[block_hash] = {holders, pod_id}

    def _remove(self, pod_id: str, pod: _PodBlocks, tier: Tier, hashes: Iterable[bytes]) -> None:
        held = pod.hashes.get(tier)
        if held is None:
            return
        pod.is_only_tier_known = False
        for block_hash in hashes:
            if block_hash not in held:
                continue
            held.discard(block_hash)
            if pod.fastest_tier(block_hash) is None:  # in no other tier of the pod either
                self._unhold(block_hash, pod_id)

    def _unhold(self, block_hash: bytes, pod_id: str) -> None:
        holders = self._holders.get(block_hash)
        if holders is None:
            return
        if isinstance(holders, str):
            if holders == pod_id:
                del self._holders[block_hash]
            return
        holders.discard(pod_id)
        if len(holders) == 1:
            self._holders[block_hash] = next(iter(holders))
