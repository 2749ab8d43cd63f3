"""A snapshot of the cache's tiers for the pod's metrics and registry record (engine thread)."""

from __future__ import annotations

from dataclasses import dataclass, field

from splitserve.engine.kv.grouped_manager import GroupedKVManager
from splitserve.engine.kv.manager import KVCacheManager
from splitserve.engine.kv.offload.offloader import KVOffloader
from splitserve.engine.kv.tiers import Tier


@dataclass(frozen=True)
class KVTierStats:
    # Tier.label -> cached blocks and their bytes (device: blocks registered in the pool).
    blocks: dict[str, int] = field(default_factory=dict)
    bytes: dict[str, int] = field(default_factory=dict)
    # Tier.label -> prompt tokens served from that tier, cumulative.
    hit_tokens: dict[str, int] = field(default_factory=dict)
    # Tier.label -> blocks written into that tier, cumulative (host, disk).
    writes: dict[str, int] = field(default_factory=dict)
    num_loads: int = 0
    load_seconds_total: float = 0.0
    load_failures: int = 0
    disk_dropped_writes: int = 0
    # (reason, retention rank) -> cached blocks the pool evicted, cumulative; reason is
    # "expired" (past its retention window) or "capacity".
    evictions: dict[tuple[str, int], int] = field(default_factory=dict)
    # Measured costs (0.0 until measured): what the router credits lower tiers by.
    prefill_s_per_token: float = 0.0
    load_s_per_block: dict[str, float] = field(default_factory=dict)


# Every reason is reported from the start (at 0), so dashboards find the series.
_EVICTION_REASONS = ("quota", "expired", "capacity")


def tier_stats(
    kv: KVCacheManager | GroupedKVManager, offloader: KVOffloader | None, block_bytes: int
) -> KVTierStats:
    """`block_bytes`: one block of the pool (all layers, or a layer group's slots)."""
    pool = kv.block_pool
    blocks = {Tier.DEVICE.label: pool.num_cached_blocks}
    hit_tokens = {Tier.DEVICE.label: kv.prefix_cache_stats.num_hit_tokens}
    evictions = {(reason, 0): 0 for reason in _EVICTION_REASONS} | dict(pool.eviction_counts)
    if offloader is None:
        return KVTierStats(
            blocks=blocks,
            bytes={Tier.DEVICE.label: blocks[Tier.DEVICE.label] * block_bytes},
            hit_tokens=hit_tokens,
            evictions=evictions,
        )
    counters, disk = offloader.counters, offloader.disk
    sizes = {Tier.HOST: len(offloader.host or ()), Tier.DISK: len(disk or ())}
    blocks.update({tier.label: count for tier, count in sizes.items()})
    hit_tokens.update(
        {tier.label: counters.load_hits[tier] * kv.block_size for tier in (Tier.HOST, Tier.DISK)}
    )
    writes = {Tier.HOST.label: counters.host_writes}
    writes[Tier.DISK.label] = disk.num_writes if disk is not None else 0
    return KVTierStats(
        blocks=blocks,
        bytes={label: count * block_bytes for label, count in blocks.items()},
        hit_tokens=hit_tokens,
        writes=writes,
        num_loads=counters.num_loads,
        load_seconds_total=counters.load_seconds_total,
        load_failures=counters.load_failures,
        disk_dropped_writes=disk.num_dropped_writes if disk is not None else 0,
        evictions=evictions,
        prefill_s_per_token=offloader.costs.prefill_s_per_token.value,
        load_s_per_block={
            tier.label: ewma.value for tier, ewma in offloader.costs.load_s_per_block.items()
        },
    )
