"""Sizing and allocating the paged KV cache tensor from a memory budget."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from shared.config import CacheConfig
from shared.kv_offload.sizing import linux_mem_available
from shared.model.architecture import ModelArchitecture


@dataclass(frozen=True)
class KVCacheSpec:
    """Found at start-up from the budget; never written back into the config."""

    num_blocks: int
    block_size: int
    bytes_per_block: int  # all layers, keys and values

    @property
    def num_tokens(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def total_bytes(self) -> int:
        return self.num_blocks * self.bytes_per_block


def bytes_per_block(arch: ModelArchitecture, block_size: int, dtype: torch.dtype) -> int:
    element_size = torch.empty((), dtype=dtype).element_size()
    per_token = 2 * arch.num_layers * arch.num_kv_heads * arch.head_dim * element_size
    return per_token * block_size


def available_memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return free
    return linux_mem_available()


def size_kv_cache(
    arch: ModelArchitecture, cache: CacheConfig, dtype: torch.dtype, device: torch.device
) -> KVCacheSpec:
    per_block = bytes_per_block(arch, cache.block_size, dtype)
    if cache.kv_cache_bytes is not None:
        budget = cache.kv_cache_bytes
    else:
        budget = int(available_memory_bytes(device) * cache.kv_cache_memory_fraction)
    num_blocks = budget // per_block
    if cache.num_blocks_override is not None:
        num_blocks = min(num_blocks, cache.num_blocks_override)
    if num_blocks < 2:
        raise ValueError(
            f"KV cache budget of {budget} bytes holds {num_blocks} blocks of {per_block} bytes; "
            "at least 2 are needed (raise kv_cache_bytes or kv_cache_memory_fraction)"
        )
    return KVCacheSpec(
        num_blocks=num_blocks, block_size=cache.block_size, bytes_per_block=per_block
    )


def allocate_kv_cache(
    spec: KVCacheSpec, arch: ModelArchitecture, dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """[num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim], zero-filled."""
    shape = (arch.num_layers, 2, spec.num_blocks, spec.block_size, arch.num_kv_heads, arch.head_dim)
    return torch.zeros(shape, dtype=dtype, device=device)
