"""`plan profile`'s KV tier measurement: how fast blocks come back from the offload tiers.

It times what the engine's load thread does (shared/kv/offload): blocks of the engine's own
pool are saved into a `HostBlockStore` and a `DiskBlockStore` (a temporary directory on the disk
the pod would use: `--kv-offload-disk-dir`'s filesystem matters), then copied back into the pool,
`repeats` times; the median gives seconds per block, as bytes per second.
"""

from __future__ import annotations

import hashlib
import statistics
import tempfile
import time
from collections.abc import Callable

from splitserve.engine.kv.block_hash import BlockHash
from splitserve.engine.kv.offload.disk_store import DiskBlockStore
from splitserve.engine.kv.offload.host_store import HostBlockStore
from splitserve.engine.kv.offload.layout import BlockLayout, pool_block
from splitserve.planner.profile.parts import TierLoadModel

NUM_BLOCKS = 32

Log = Callable[[str], None]


def measure_tier_loads(
    engine, repeats: int, log: Log, disk_dir: str | None = None
) -> TierLoadModel:
    kv_cache = engine.runner.kv_cache
    layout = BlockLayout.of_pool(kv_cache, "planner-profile")
    num_blocks = min(NUM_BLOCKS, engine.kv_spec.num_blocks // 2)
    hashes = [BlockHash(hashlib.sha256(str(i).encode()).digest()) for i in range(num_blocks)]
    host = HostBlockStore(num_blocks, layout)
    for i, block_hash in enumerate(hashes):
        host.save(block_hash, pool_block(kv_cache, i), 1)

    def load_host() -> None:
        for i, block_hash in enumerate(hashes):
            host.load_into(block_hash, pool_block(kv_cache, num_blocks + i))

    host_s = _median_s(load_host, repeats)
    with tempfile.TemporaryDirectory(dir=disk_dir, prefix="plan-profile-disk-") as directory:
        disk = DiskBlockStore(directory, layout.block_bytes * num_blocks, layout)
        try:
            for i, block_hash in enumerate(hashes):
                disk.write_async(block_hash, pool_block(kv_cache, i).clone())
            disk.flush()

            def load_disk() -> None:
                for i, block_hash in enumerate(hashes):
                    block = disk.read(block_hash)
                    if block is None:
                        raise RuntimeError(f"the disk tier lost block {i} while being measured")
                    pool_block(kv_cache, num_blocks + i).copy_(block)

            disk_s = _median_s(load_disk, repeats)
        finally:
            disk.close()
    total_bytes = layout.block_bytes * num_blocks
    model = TierLoadModel(total_bytes / host_s, total_bytes / disk_s)
    log(
        f"KV tier loads of {num_blocks} blocks: host {model.host_bytes_per_s / 1e9:.1f} GB/s, "
        f"disk {model.disk_bytes_per_s / 1e9:.2f} GB/s (page cache included)"
    )
    return model


def _median_s(load: Callable[[], None], repeats: int) -> float:
    times = []
    for _ in range(repeats + 1):
        start = time.perf_counter()
        load()
        times.append(time.perf_counter() - start)
    return max(statistics.median(times[1:]), 1e-9)  # the first warms caches
