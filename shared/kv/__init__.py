"""Paged KV cache bookkeeping: block hashes, blocks, the block pool and the request-level manager.

Nothing here imports torch, so the gateway can import `splitserve.engine.kv.block_hash` cheaply;
this file
re-exports nothing, to keep that import from pulling in the rest.

- `block_hash`: chained, cross-process deterministic hashes of full blocks.
- `block`: `Block` and the LRU `FreeBlockQueue`.
- `tiers`: `Tier` (device, host, disk): where a cached block lives.
- `events`: `BlockStored` / `BlockRemoved` per tier, what the prefix-cache index in Redis follows.
- `eviction`: retention classes, soft windows and tenant quotas: the order free blocks go in.
- `block_pool`: allocate, free, touch, evict, hash -> block.
- `manager`: `KVCacheManager`, the request-level API the scheduler calls.
"""
