"""Moving KV data: new tokens into their slots, and whole blocks in and out of a transfer buffer.

A block's *page* is what one block holds for one layer and one of K/V: `[block_size,
num_kv_heads, head_dim]`, contiguous inside the engine's cache `[num_layers, 2, num_blocks,
block_size, num_kv_heads, head_dim]`. An int8 cache (`splitserve.kernels.kv_int8`) has rows of
head_dim + 2
int8 elements: the write quantizes each (token, head) row; pages move as bytes, scales inside.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from splitserve.kernels import _checks as checks
from splitserve.kernels.kv_int8 import split_rows

COPY_TILE = 1024  # elements per step of the page copy


@triton.jit
def _write_kv_kernel(
    key_ptr,
    value_ptr,
    key_cache_ptr,
    value_cache_ptr,
    key_scale_ptr,  # an int8 cache's scale views (splitserve.kernels.kv_int8); unused otherwise
    value_scale_ptr,
    slot_mapping_ptr,
    stride_in_tok,
    stride_in_head,
    stride_c_block,
    stride_c_tok,
    stride_c_head,
    stride_s_block,
    stride_s_tok,
    stride_s_head,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEADS_PAD: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    KV_INT8: tl.constexpr,
):
    token = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + token)
    heads = tl.arange(0, HEADS_PAD)
    dims = tl.arange(0, HEAD_DIM_PAD)
    # slot -1 (padding) masks every element; a vector compare keeps the mask a block.
    is_real = (slot + tl.zeros_like(heads).to(slot.dtype)) >= 0
    head_ok = is_real & (heads < NUM_KV_HEADS)
    mask = head_ok[:, None] & (dims < HEAD_DIM)[None, :]
    slot = tl.maximum(slot, 0)
    src = token * stride_in_tok + heads[:, None] * stride_in_head + dims[None, :]
    dst = ((slot // BLOCK_SIZE) * stride_c_block + (slot % BLOCK_SIZE) * stride_c_tok
           + heads[:, None] * stride_c_head + dims[None, :])
    key = tl.load(key_ptr + src, mask=mask, other=0.0)
    value = tl.load(value_ptr + src, mask=mask, other=0.0)
    if KV_INT8:
        scale_dst = ((slot // BLOCK_SIZE) * stride_s_block + (slot % BLOCK_SIZE) * stride_s_tok
                     + heads * stride_s_head)
        _store_int8(key_cache_ptr + dst, key_scale_ptr + scale_dst, key, mask, head_ok)
        _store_int8(value_cache_ptr + dst, value_scale_ptr + scale_dst, value, mask, head_ok)
    else:
        tl.store(key_cache_ptr + dst, key, mask=mask)
        tl.store(value_cache_ptr + dst, value, mask=mask)


@triton.jit
def _store_int8(code_ptrs, scale_ptrs, x, mask, head_ok):
    """`splitserve.kernels.kv_int8.quantize` of each head's row of x `[HEADS_PAD, HEAD_DIM_PAD]`
    (masked
    elements are 0, so they leave the absmax alone): codes to code_ptrs, scales to scale_ptrs."""
    x = x.to(tl.float32)
    scale_f = _round_to_bfloat16(tl.max(tl.abs(x), 1) / 127.0)  # [HEADS_PAD]; kv_int8.QMAX
    scale = scale_f.to(tl.bfloat16)  # exact: the low 16 bits are zero
    is_scaled = scale_f > 0  # a row of zeros (or a padding head) keeps codes 0
    inverse = tl.where(is_scaled, 1.0 / tl.where(is_scaled, scale_f, 1.0), 0.0)
    scaled = x * inverse[:, None]
    # Half away from zero, as the reference rounds.
    codes = tl.where(scaled >= 0, tl.floor(scaled + 0.5), -tl.floor(0.5 - scaled))
    codes = tl.minimum(tl.maximum(codes, -127.0), 127.0)
    tl.store(code_ptrs, codes.to(tl.int8), mask=mask)
    tl.store(scale_ptrs, scale, mask=head_ok)


@triton.jit
def _round_to_bfloat16(x):
    """float32 -> the nearest bfloat16 (ties to even), as torch's `.to(bfloat16)` rounds, still
    in float32. Done on the bits because Triton's interpreter truncates in `.to(bfloat16)`
    whatever rounding is asked for. x is finite and >= 0 here."""
    bits = x.to(tl.uint32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return bits.to(tl.float32, bitcast=True)


def write_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Writes token t's key and value `[num_kv_heads, head_dim]` into slot `slot_mapping[t]`
    (`block_id * block_size + offset`) of key_cache and value_cache, which it mutates.

    key, value: [num_tokens, num_kv_heads, head_dim] of the caches' dtype (of any float dtype
    for an int8 cache, whose rows it quantizes: splitserve.kernels.kv_int8); slot_mapping:
    [num_tokens]
    int64, -1 for padding tokens (skipped). Precondition not checked: every other
    slot is below `num_blocks * block_size`, and no two tokens share a slot.
    """
    shape = checks.check_kv_cache_pair(key_cache, value_cache)
    checks.check_tensor("key", key, 3, checks.FLOAT_DTYPES)
    checks.check_tensor("value", value, 3, checks.FLOAT_DTYPES)
    num_tokens = key.shape[0]
    checks.check_shape("key", key, (num_tokens, shape.num_kv_heads, shape.head_dim))
    checks.check_shape("value", value, tuple(key.shape))
    kv_int8 = key_cache.dtype == torch.int8
    if not kv_int8:
        checks.check_same_dtype("key", key, "key_cache", key_cache)
    checks.check_same_dtype("value", value, "key", key)
    if key.stride() != value.stride():
        raise ValueError(f"value strides {value.stride()} differ from key strides {key.stride()}")
    checks.check_last_dim_contiguous("key", key)
    checks.check_tensor("slot_mapping", slot_mapping, 1, (torch.int64,))
    checks.check_shape("slot_mapping", slot_mapping, (num_tokens,))
    checks.check_contiguous("slot_mapping", slot_mapping)
    checks.check_same_device(dict(key=key, value=value, key_cache=key_cache,
                                  value_cache=value_cache, slot_mapping=slot_mapping))
    if num_tokens == 0:
        return
    key_scales, value_scales = key_cache, value_cache
    scale_strides: tuple[int, ...] = (0, 0, 0)  # (block, token, head), read only if kv_int8
    if kv_int8:
        key_scales, value_scales = split_rows(key_cache)[1], split_rows(value_cache)[1]
        scale_strides = key_scales.stride()[:3]
    _write_kv_kernel[(num_tokens,)](
        key, value, key_cache, value_cache, key_scales, value_scales, slot_mapping,
        key.stride(0), key.stride(1), key_cache.stride(0), key_cache.stride(1),
        key_cache.stride(2), *scale_strides, NUM_KV_HEADS=shape.num_kv_heads,
        HEAD_DIM=shape.head_dim, HEADS_PAD=triton.next_power_of_2(shape.num_kv_heads),
        HEAD_DIM_PAD=triton.next_power_of_2(shape.head_dim), BLOCK_SIZE=shape.block_size,
        KV_INT8=kv_int8,
    )


@triton.jit
def _copy_pages_kernel(
    cache_ptr,
    buffer_ptr,
    block_ids_ptr,
    stride_layer,
    stride_kv,
    stride_block,
    num_layers,
    KV_PARTS: tl.constexpr,
    PAGE_ELEMS: tl.constexpr,
    TILE: tl.constexpr,
    TO_BUFFER: tl.constexpr,
):
    """Program (i, layer * KV_PARTS + part) copies one page between block `block_ids[i]` of the
    cache and its place in the buffer `[n, num_layers, KV_PARTS, page]` (KV_PARTS 2: K and V;
    1: MLA's latent pages)."""
    i = tl.program_id(0)
    layer_kv = tl.program_id(1)
    layer = layer_kv // KV_PARTS
    block_id = tl.load(block_ids_ptr + i).to(tl.int64)
    cache_page = (cache_ptr + layer.to(tl.int64) * stride_layer
                  + (layer_kv % KV_PARTS) * stride_kv + block_id * stride_block)
    buffer_page = buffer_ptr + (i.to(tl.int64) * num_layers * KV_PARTS + layer_kv) * PAGE_ELEMS
    for start in range(0, PAGE_ELEMS, TILE):
        offsets = start + tl.arange(0, TILE)
        mask = offsets < PAGE_ELEMS
        if TO_BUFFER:
            tl.store(buffer_page + offsets, tl.load(cache_page + offsets, mask=mask), mask=mask)
        else:
            tl.store(cache_page + offsets, tl.load(buffer_page + offsets, mask=mask), mask=mask)


def pack_kv_pages(
    kv_cache: torch.Tensor, block_ids: torch.Tensor | Sequence[int]
) -> torch.Tensor:
    """Copies blocks `block_ids` (all layers, K and V) into a new contiguous buffer
    `[n, num_layers, 2, block_size, num_kv_heads, head_dim]` (dim 2 is 1 for MLA's latent
    pages, shared/kv/cache.py).

    Block-major on purpose: everything one block holds, across all layers, is one contiguous
    run of `buffer[i]`, so a block is the unit of transfer. The sender can ship any subset of a
    request's blocks (the receiver may already hold a cached prefix) as `buffer[i:j]`, one
    contiguous region per message, and the receiver can unpack blocks as they arrive; a
    layer-major buffer would scatter each block over `2 * num_layers` places.
    Precondition not checked: every id is below num_blocks.
    """
    index = _check_pages_args(kv_cache, block_ids)
    buffer = torch.empty((index.shape[0], *kv_cache.shape[:2], *kv_cache.shape[3:]),
                         dtype=kv_cache.dtype, device=kv_cache.device)
    _launch_copy(kv_cache, buffer, index, to_buffer=True)
    return buffer


def unpack_kv_pages(
    buffer: torch.Tensor, kv_cache: torch.Tensor, block_ids: torch.Tensor | Sequence[int]
) -> None:
    """The inverse of `pack_kv_pages`: writes `buffer[i]` into block `block_ids[i]` of every
    layer of kv_cache, which it mutates. buffer must be contiguous and of kv_cache's dtype."""
    index = _check_pages_args(kv_cache, block_ids)
    num_layers, kv_parts, _, *page_shape = kv_cache.shape
    checks.check_tensor("buffer", buffer, 6, (kv_cache.dtype,))
    checks.check_shape("buffer", buffer, (index.shape[0], num_layers, kv_parts, *page_shape))
    checks.check_contiguous("buffer", buffer)
    checks.check_same_device(dict(kv_cache=kv_cache, buffer=buffer))
    _launch_copy(kv_cache, buffer, index, to_buffer=False)


def _check_pages_args(
    kv_cache: torch.Tensor, block_ids: torch.Tensor | Sequence[int]
) -> torch.Tensor:
    """Checks the cache and returns block_ids as a 1-D integer tensor on its device."""
    checks.check_tensor("kv_cache", kv_cache, 6, checks.CACHE_DTYPES)
    if kv_cache.shape[1] not in (1, 2):
        raise ValueError(
            f"kv_cache dim 1 must be 2 (K, V) or 1 (MLA latent), got shape {tuple(kv_cache.shape)}"
        )
    block_size, num_kv_heads, head_dim = kv_cache.shape[3:]
    if kv_cache.stride()[3:] != (num_kv_heads * head_dim, head_dim, 1):
        raise ValueError(f"kv_cache pages must be contiguous, got strides {kv_cache.stride()}")
    if isinstance(block_ids, torch.Tensor):
        index = block_ids
    else:
        index = torch.tensor(list(block_ids), dtype=torch.int64, device=kv_cache.device)
    checks.check_tensor("block_ids", index, 1, checks.INDEX_DTYPES)
    checks.check_contiguous("block_ids", index)
    checks.check_same_device(dict(kv_cache=kv_cache, block_ids=index))
    return index


def _launch_copy(
    kv_cache: torch.Tensor, buffer: torch.Tensor, index: torch.Tensor, to_buffer: bool
) -> None:
    if index.shape[0] == 0 or kv_cache.shape[0] == 0:
        return
    page_elems = kv_cache.shape[3] * kv_cache.shape[4] * kv_cache.shape[5]
    _copy_pages_kernel[(index.shape[0], kv_cache.shape[0] * kv_cache.shape[1])](
        kv_cache, buffer, index, kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2),
        kv_cache.shape[0], KV_PARTS=kv_cache.shape[1], PAGE_ELEMS=page_elems,
        TILE=min(COPY_TILE, triton.next_power_of_2(page_elems)), TO_BUFFER=to_buffer,
    )
