"""The engine's KV cache: its blocks, the paged tensors, the tiers below it, and pages between pods.

This file re-exports nothing, so `import splitserve.engine.kv.block_hash` (the gateway's one
import from here) loads no torch and nothing else of the package.

Block-level modules, at this package's root: torch-free, and nothing from the engine's other
modules but `config` (a request is a protocol to them).

- `block_hash`: chained, cross-process deterministic hashes of full blocks.
- `block`: `Block` and the LRU `FreeBlockQueue`.
- `tiers`: `Tier` (device, host, disk): where a cached block lives.
- `events`: `BlockStored` / `BlockRemoved` per tier, what the prefix-cache index in Redis follows.
- `eviction`: retention classes, soft windows and tenant quotas: the order free blocks go in.
- `block_pool`: allocate, free, touch, evict, hash -> block.
- `manager`: `KVCacheManager`, the request-level API the scheduler calls.

Above them (torch, and the engine's request and step types where they need them):

- `cache`: sizing the paged KV tensor from a memory budget and allocating it.
- `offload/`: the host-memory and disk tiers below the pool, and the offloader between them.
- `loads`: the scheduler's side of those tiers: requests waiting for their prefix to load.
- `transfer/`: moving one packed page buffer between pods (UCX, TCP); knows no cache.
- `disaggregation`: pages out of and into the cache for a remote prefill, over a transfer.
"""
