"""The offload tiers an engine's cache config asks for (the KV manager and the scheduler take
them in their constructors: shared/parts.py)."""

from __future__ import annotations

import logging

import torch

from splitserve.engine.config import CacheConfig
from splitserve.engine.kv.offload.disk_store import DiskBlockStore
from splitserve.engine.kv.offload.host_store import HostBlockStore
from splitserve.engine.kv.offload.layout import BlockLayout
from splitserve.engine.kv.offload.offloader import KVOffloader
from splitserve.engine.kv.offload.sizing import auto_host_tier_bytes

logger = logging.getLogger(__name__)


def build_offloader(
    cache: CacheConfig, kv_cache: torch.Tensor, world_size: int = 1
) -> KVOffloader | None:
    """None when the config asks for no tier (or prefix caching is off: nothing to keep).

    A parallel engine's KV is spread over its ranks, and the tiers copy one process's pool: the
    config refuses an explicit tier there, and the default "auto" host tier is left off."""
    if not cache.has_offload or not cache.enable_prefix_caching:
        return None
    if world_size > 1:
        logger.warning("KV offload tiers are off: not supported with parallel ranks yet")
        return None
    layout = BlockLayout.of_pool(kv_cache, cache.hash_namespace)
    disk = None
    if cache.has_disk_tier:
        assert cache.offload_disk_dir is not None, "has_disk_tier checked it"
        disk = DiskBlockStore(cache.offload_disk_dir, cache.offload_disk_bytes, layout)
    host = None
    host_blocks = _host_tier_bytes(cache, kv_cache) // layout.block_bytes
    if host_blocks:
        spill = cache.offload_disk_min_hits if disk is not None else None
        host = HostBlockStore(host_blocks, layout, spill_min_hits=spill)
    if host is None and disk is None:
        return None
    logger.info(
        "KV offload: host tier %d blocks (%.1f MiB), disk tier %s",
        host_blocks,
        host_blocks * layout.block_bytes / 2**20,
        f"{disk.capacity_blocks} blocks in {disk.directory}" if disk else "off",
    )
    return KVOffloader(
        kv_cache,
        layout,
        host,
        disk,
        disk_min_hits=cache.offload_disk_min_hits,
        load_timeout_s=cache.kv_load_timeout_s,
    )


def _host_tier_bytes(cache: CacheConfig, kv_cache: torch.Tensor) -> int:
    if cache.offload_host_bytes != "auto":
        return int(cache.offload_host_bytes)
    pool_bytes = kv_cache.numel() * kv_cache.element_size() if kv_cache.device.type == "cpu" else 0
    return auto_host_tier_bytes(pool_bytes)

