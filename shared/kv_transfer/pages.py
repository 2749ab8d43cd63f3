"""KV cache <-> transfer glue: pack a request's blocks and send them, or receive pages and
scatter them into the cache at the receiver's block ids.

The cache is `[num_layers, 2, num_blocks, block_size, kv_heads, head_dim]`, so one block's
pages are `num_layers * 2` separate runs in memory; the transfer therefore moves the packed,
block-major buffer of `kernels.reference.pack_kv_pages`, and the receiver pays one scatter copy
(`unpack_kv_pages`) from it into the cache.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kernels.reference import pack_kv_pages, unpack_kv_pages
from shared.kv_transfer.base import KVReceiver, KVSender, KVTransferDescriptor, KVTransferError


def packed_pages_shape(kv_cache: torch.Tensor, num_blocks: int) -> tuple[int, ...]:
    """`[num_blocks, num_layers, 2, block_size, kv_heads, head_dim]` for this cache."""
    if kv_cache.dim() != 6 or kv_cache.shape[1] != 2:
        raise ValueError(
            "kv_cache must be [num_layers, 2, num_blocks, block_size, kv_heads, head_dim], "
            f"got {tuple(kv_cache.shape)}"
        )
    num_layers, _, _, block_size, kv_heads, head_dim = kv_cache.shape
    return (num_blocks, num_layers, 2, block_size, kv_heads, head_dim)


async def send_kv_pages(
    sender: KVSender,
    address: str,
    request_id: str,
    kv_cache: torch.Tensor,
    src_block_ids: Sequence[int],
    dst_block_ids: Sequence[int],
    timeout: float,
    checksum_algorithm: str | None = None,
) -> KVTransferDescriptor:
    """Packs `src_block_ids` of this cache and sends them to be stored at the receiver's
    `dst_block_ids` (same length, same order). Returns the descriptor that was sent."""
    if len(src_block_ids) != len(dst_block_ids):
        raise ValueError(
            f"src_block_ids ({len(src_block_ids)}) and dst_block_ids ({len(dst_block_ids)}) "
            "must have the same length"
        )
    packed_pages_shape(kv_cache, len(src_block_ids))
    buffer = pack_kv_pages(kv_cache, list(src_block_ids))
    descriptor = KVTransferDescriptor.for_buffer(
        request_id, dst_block_ids, buffer, checksum_algorithm
    )
    await sender.send(address, descriptor, buffer, timeout)
    return descriptor


async def receive_kv_pages(
    receiver: KVReceiver,
    request_id: str,
    kv_cache: torch.Tensor,
    block_ids: Sequence[int],
    timeout: float,
) -> KVTransferDescriptor:
    """Receives `request_id`'s pages and writes them into `kv_cache` at `block_ids` (mutates
    the cache only after the whole payload arrived and passed its checksum)."""
    staging = torch.empty(
        packed_pages_shape(kv_cache, len(block_ids)), dtype=kv_cache.dtype, device="cpu"
    )
    descriptor = await receiver.receive(request_id, staging, timeout)
    if list(descriptor.block_ids) != list(block_ids):
        raise KVTransferError(
            f"request {request_id}: sender addressed blocks {list(descriptor.block_ids)}, "
            f"expected {list(block_ids)}"
        )
    unpack_kv_pages(staging.to(kv_cache.device), kv_cache, list(block_ids))
    return descriptor
