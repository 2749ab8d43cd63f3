"""A simulated pod's prefix cache, by prefix group, with the KV offload tiers below it.

The engine keeps a prompt's full blocks cached after the request ends, in the free part of its
pool, and evicts the least recently used when it needs blocks; with offload tiers an evicted
block goes down to host memory, and from there to disk (shared/kv/offload). Here a workload's
prefix groups stand for those blocks:

- `device`: groups whose blocks sit in the pool; together they may hold at most the pod's free
  blocks (`fit`), the least recently used going down first;
- `host`, `disk`: groups pushed out of the tier above, each tier LRU within its size in blocks
  (0 = the tier is off, and what falls out of the tier above is gone).

A hit in a lower tier costs a load (the profile's tier bandwidth) before the request is
scheduled, and moves the group back up to `device`.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

TIERS = ("device", "host", "disk")


@dataclass(frozen=True)
class TierSizes:
    host_blocks: int = 0
    disk_blocks: int = 0

    def __post_init__(self) -> None:
        if self.host_blocks < 0 or self.disk_blocks < 0:
            raise ValueError("tier sizes must be >= 0 blocks")


@dataclass
class SimPrefixCache:
    sizes: TierSizes = field(default_factory=TierSizes)
    # tier -> group -> blocks, least recently used first.
    tiers: dict[str, OrderedDict[str, int]] = field(
        default_factory=lambda: {tier: OrderedDict() for tier in TIERS}
    )
    hit_tokens: dict[str, int] = field(default_factory=lambda: dict.fromkeys(TIERS, 0))
    # Blocks held per tier, kept as the tiers change (fit runs at every allocation).
    num_blocks: dict[str, int] = field(default_factory=lambda: dict.fromkeys(TIERS, 0))

    def tier_of(self, group: str) -> str | None:
        return next((tier for tier in TIERS if group in self.tiers[tier]), None)

    def __contains__(self, group: str) -> bool:
        return self.tier_of(group) is not None

    def add(self, group: str, num_blocks: int) -> None:
        """The group's blocks were just computed (or loaded) on the pod: most recent."""
        for tier in TIERS:
            self.num_blocks[tier] -= self.tiers[tier].pop(group, 0)
        self.tiers["device"][group] = num_blocks
        self.num_blocks["device"] += num_blocks

    def count_hit(self, group: str, num_tokens: int) -> None:
        tier = self.tier_of(group)
        if tier is not None:
            self.hit_tokens[tier] += num_tokens
            self.tiers[tier].move_to_end(group)

    def fit(self, free_blocks: int) -> None:
        """Cached groups on the device hold at most the pool's free blocks: the least recently
        used go down a tier (or are gone) until they fit."""
        device = self.tiers["device"]
        while device and self.num_blocks["device"] > max(free_blocks, 0):
            group, num_blocks = device.popitem(last=False)
            self.num_blocks["device"] -= num_blocks
            self._push_down("host", group, num_blocks)

    def _push_down(self, tier: str, group: str, num_blocks: int) -> None:
        capacity = self.sizes.host_blocks if tier == "host" else self.sizes.disk_blocks
        if num_blocks > capacity:
            if tier == "host":
                self._push_down("disk", group, num_blocks)
            return
        entries = self.tiers[tier]
        entries[group] = num_blocks
        self.num_blocks[tier] += num_blocks
        while self.num_blocks[tier] > capacity:
            older, older_blocks = entries.popitem(last=False)
            self.num_blocks[tier] -= older_blocks
            if tier == "host":
                self._push_down("disk", older, older_blocks)
