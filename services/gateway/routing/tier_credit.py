"""How much of a cached block the router counts, by the tier that holds it.

A block in a decode or prefill pod's own pool saves its whole recomputation. A block in the
pod's host-memory or disk tier saves the recomputation minus the load:

    credit(tier) = clamp(1 - load_s_per_block(tier) / (block_size * prefill_s_per_token), 0, 1)

with both costs measured by the pod and published in its registry record (shared/kv/offload/
costs.py). Until a pod has measured them (no load yet, no prefill yet), a prior stands in:
loading is a memcpy from host memory or a file read, far cheaper than a forward pass on any
machine this serves on, so the prior sits near the top and errs toward the pod that holds the
blocks.
"""

from __future__ import annotations

from splitserve.common.registry_schema import CachedPrefix, PodRecord
from splitserve.engine.kv.tiers import Tier

PRIOR_CREDIT = {Tier.DEVICE: 1.0, Tier.HOST: 0.9, Tier.DISK: 0.6}


def tier_credit(record: PodRecord, tier: Tier) -> float:
    """The fraction of a block's recomputation that a block in `tier` of this pod saves."""
    if tier == Tier.DEVICE:
        return 1.0
    load_s = record.disk_load_s_per_block if tier == Tier.DISK else record.host_load_s_per_block
    compute_s = record.block_size * record.prefill_s_per_token
    if load_s <= 0.0 or compute_s <= 0.0:
        return PRIOR_CREDIT[tier]
    return min(1.0, max(0.0, 1.0 - load_s / compute_s))


def credited_tokens(record: PodRecord, prefix: CachedPrefix) -> int:
    """The prompt tokens a pod's cached prefix is worth, each tier's blocks by its credit."""
    by_tier = prefix.num_blocks_by_tier
    if len(by_tier) == 1 and Tier.DEVICE in by_tier:  # most pods (no offload): whole credit
        return by_tier[Tier.DEVICE] * record.block_size
    blocks = sum(
        count * tier_credit(record, tier) for tier, count in prefix.num_blocks_by_tier.items()
    )
    return int(blocks * record.block_size)
