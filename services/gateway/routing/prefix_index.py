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

from splitserve.common.registry_schema import (
    EVENT_REMOVE,
    EVENT_STORE,
    BlockEvent,
    CachedPrefix,
)
from splitserve.engine.kv.tiers import Tier

# Tier -> its bit in a holder's mask; mask -> the fastest tier in it (the one a lookup credits).
_TIER_BIT = {tier: 1 << int(tier) for tier in Tier}
_FASTEST = {
    mask: next(tier for tier in Tier if mask & _TIER_BIT[tier])
    for mask in range(1, 1 << (max(Tier) + 1))
    if any(mask & bit for bit in _TIER_BIT.values())
}


@dataclass
class _PodBlocks:
    generation: int  # the pod process whose SETs these are (a newer one replaces them)
    # The seq of the last event applied; None right after a snapshot, when any next one goes.
    last_seq: int | None
    hashes: dict[Tier, set[bytes]] = field(default_factory=dict)


class PrefixIndex:
    def __init__(self) -> None:
        self._holders: dict[bytes, dict[str, int]] = {}  # hash -> pod_id -> tier mask
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
            for tier, hashes in pod.hashes.items():
                self._remove(pod_id, pod, tier, list(hashes))

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
        counts: dict[str, dict[Tier, int]] = {}
        alive: list[str] | None = None  # pods holding every hash so far
        for block_hash in hashes:
            holders = self._holders.get(block_hash)
            if not holders:
                break
            if alive is None:
                alive = [p for p in holders if self._is_current(p, generations)]
            alive = [p for p in alive if p in holders]
            if not alive:
                break
            for pod_id in alive:
                by_tier = counts.setdefault(pod_id, {})
                tier = _FASTEST[holders[pod_id]]
                by_tier[tier] = by_tier.get(tier, 0) + 1
        return {pod_id: CachedPrefix(by_tier) for pod_id, by_tier in counts.items()}

    def _is_current(self, pod_id: str, generations: Mapping[str, int]) -> bool:
        pod = self._pods.get(pod_id)
        return pod is not None and generations.get(pod_id) == pod.generation

    def _store(self, pod_id: str, pod: _PodBlocks, tier: Tier, hashes: Iterable[bytes]) -> None:
        bit = _TIER_BIT[tier]
        held = pod.hashes.setdefault(tier, set())
        for block_hash in hashes:
            held.add(block_hash)
            holders = self._holders.setdefault(block_hash, {})
            holders[pod_id] = holders.get(pod_id, 0) | bit

    def _remove(self, pod_id: str, pod: _PodBlocks, tier: Tier, hashes: Iterable[bytes]) -> None:
        bit = _TIER_BIT[tier]
        held = pod.hashes.get(tier, set())
        for block_hash in hashes:
            held.discard(block_hash)
            holders = self._holders.get(block_hash)
            if holders is None or pod_id not in holders:
                continue
            mask = holders[pod_id] & ~bit
            if mask:
                holders[pod_id] = mask
            else:
                del holders[pod_id]
                if not holders:
                    del self._holders[block_hash]
