"""Sizing and allocating the paged KV cache tensor from a memory budget.

`kv_cache_dtype` "auto" stores keys and values in the model's dtype; "int8" stores each
(token, KV head) row as int8 codes with its bfloat16 scale in the row's last two bytes
(`splitserve.kernels.kv_int8`), so the same budget holds
(2 * head_dim * itemsize) / (head_dim + 2) times the blocks: 3.88x for a float32 model and
1.94x for a bfloat16 one at head_dim 64.

Two page layouts, both `[num_layers, kv_parts, num_blocks, block_size, rows, row]`, so the block
manager, the page packing and the P->D transfer move either whatever the inner shape:

    per-head K/V (every family but DeepSeek)   [layers, 2, blocks, block_size, kv_heads, head_dim]
    MLA latent (DeepSeek-V2/V3, arch.mla)      [layers, 1, blocks, block_size, 1, kv_lora_rank
                                                                               + qk_rope_head_dim]

An MLA page row is the token's normalized latent followed by its rotated rope key (576 values
for DeepSeek-V3's shape), shared by every head: shared/model/mla.py writes and reads it. With
"int8" each of the two parts is an int8 row of its own (codes, then its scale's bytes): the
normalized latent and the rope key have ranges far apart, and one scale would spend the rope
key's few codes on the latent's largest value (576 values -> 580 bytes, 3.97x fewer than float32
and 1.99x fewer than bfloat16).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from splitserve.engine.config import CacheConfig
from splitserve.engine.kv.groups import KVGroups, slots_in_cache
from splitserve.engine.kv.offload.sizing import linux_mem_available
from splitserve.engine.model.architecture import MLAConfig, ModelArchitecture
from splitserve.kernels import kv_int8


@dataclass(frozen=True)
class KVCacheSpec:
    """Found at start-up from the budget; never written back into the config."""

    num_blocks: int
    block_size: int
    bytes_per_block: int  # all layers (a group's slots), keys and values, times `copies`
    # How many processes hold each block whole (MLA's latent pages on every tensor-parallel
    # rank): the pod pays for each, a page travels once.
    copies: int = 1
    # Layer groups (shared/kv/groups.py): a block holds one group's layers, so a position's
    # block is `groups` blocks of the pool (fewer in a window group past its window).
    groups: int = 1

    @property
    def page_bytes_per_block(self) -> int:
        """One copy of a block: what a page transfer moves."""
        return self.bytes_per_block // self.copies

    @property
    def num_position_blocks(self) -> int:
        """Blocks of `block_size` positions in every layer the pool holds at the least (each
        group holding every position)."""
        return self.num_blocks // self.groups

    @property
    def num_tokens(self) -> int:
        return self.num_position_blocks * self.block_size

    @property
    def total_bytes(self) -> int:
        return self.num_blocks * self.bytes_per_block

    def describe(self) -> str:
        """The size as the logs and the CLI state it."""
        blocks = f"{self.num_blocks} blocks of {self.block_size} tokens"
        if self.groups == 1:
            return f"{blocks} ({self.num_tokens} tokens)"
        return (
            f"{blocks} in {self.groups} layer groups "
            f"({self.num_tokens} tokens in every layer, more in window layers)"
        )


def cache_dtype(dtype: torch.dtype, kv_cache_dtype: str) -> torch.dtype:
    """The cache tensor's element type: the model's, or int8 (codes and scale bytes)."""
    return torch.int8 if kv_cache_dtype == "int8" else dtype


def row_width(arch: ModelArchitecture, kv_cache_dtype: str) -> int:
    """Elements of one (token, KV head) row: head_dim, plus the scale's bytes for int8; an MLA
    model's one row per token: its latent and rope key."""
    if arch.mla is not None:
        return latent_row_width(arch.mla, kv_cache_dtype)
    return kv_int8.row_width(arch.head_dim) if kv_cache_dtype == "int8" else arch.head_dim


def latent_row_width(mla: MLAConfig, kv_cache_dtype: str) -> int:
    """Elements of an MLA page row: the latent and the rope key, each an int8 row with its
    scale for "int8" (module docstring)."""
    if kv_cache_dtype != "int8":
        return mla.latent_width
    parts = (("kv_lora_rank", mla.kv_lora_rank), ("qk_rope_head_dim", mla.qk_rope_head_dim))
    for name, width in parts:
        if width % 2:
            raise ValueError(
                f"kv_cache_dtype 'int8' needs an even {name} (its bfloat16 scale sits on a "
                f"2-byte boundary after the codes), got {width}"
            )
    return kv_int8.row_width(mla.kv_lora_rank) + kv_int8.row_width(mla.qk_rope_head_dim)


def cache_shape(
    arch: ModelArchitecture,
    num_blocks: int,
    block_size: int,
    kv_cache_dtype: str = "auto",
    groups: KVGroups | None = None,
) -> tuple[int, ...]:
    """The cache tensor's shape in the model's page layout (module docstring); with layer
    `groups`, a block holds one group's slots rather than every layer (shared/kv/groups.py)."""
    row = row_width(arch, kv_cache_dtype)
    if arch.mla is not None:
        return (arch.num_layers, 1, num_blocks, block_size, 1, row)
    slots = slots_in_cache(arch, groups)
    return (slots, 2, num_blocks, block_size, arch.num_kv_heads, row)


def bytes_per_block(
    arch: ModelArchitecture,
    block_size: int,
    dtype: torch.dtype,
    kv_cache_dtype: str = "auto",
    groups: KVGroups | None = None,
) -> int:
    element_size = cache_dtype(dtype, kv_cache_dtype).itemsize
    return math.prod(cache_shape(arch, 1, block_size, kv_cache_dtype, groups)) * element_size


def available_memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return free
    return linux_mem_available()


def size_kv_cache(
    arch: ModelArchitecture,
    cache: CacheConfig,
    dtype: torch.dtype,
    device: torch.device,
    copies: int = 1,
    groups: KVGroups | None = None,
) -> KVCacheSpec:
    """The block count the budget holds; `copies`: how many processes hold each block whole
    (MLA's latent pages on every tensor-parallel rank), each paid for."""
    per_block = copies * bytes_per_block(
        arch, cache.block_size, dtype, cache.kv_cache_dtype, groups
    )
    if cache.kv_cache_bytes is not None:
        budget = cache.kv_cache_bytes
    else:
        budget = int(available_memory_bytes(device) * cache.kv_cache_memory_fraction)
    num_blocks = budget // per_block
    num_groups = 1 if groups is None else groups.num_groups
    if cache.num_blocks_override is not None:  # blocks of every layer: one in each group
        num_blocks = min(num_blocks, cache.num_blocks_override * num_groups)
    if num_blocks < 2 * num_groups:
        in_groups = f" in each of its {num_groups} layer groups" if num_groups > 1 else ""
        raise ValueError(
            f"KV cache budget of {budget} bytes holds {num_blocks} blocks of {per_block} bytes; "
            f"at least 2{in_groups} are needed (raise kv_cache_bytes or "
            "kv_cache_memory_fraction)"
        )
    return KVCacheSpec(
        num_blocks=num_blocks,
        block_size=cache.block_size,
        bytes_per_block=per_block,
        copies=copies,
        groups=num_groups,
    )


def allocate_kv_cache(
    spec: KVCacheSpec,
    arch: ModelArchitecture,
    dtype: torch.dtype,
    device: torch.device,
    kv_cache_dtype: str = "auto",
    groups: KVGroups | None = None,
) -> torch.Tensor:
    """[num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim], zero-filled; int8 with
    a last dim of head_dim + 2 (codes, then the scale's bytes) for kv_cache_dtype "int8"; an MLA
    model's latent layout (module docstring); a group's slots first with layer `groups`."""
    shape = cache_shape(arch, spec.num_blocks, spec.block_size, kv_cache_dtype, groups)
    return torch.zeros(shape, dtype=cache_dtype(dtype, kv_cache_dtype), device=device)
