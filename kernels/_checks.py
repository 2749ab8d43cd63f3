"""Argument checks shared by the Triton wrappers.

Each check raises `ValueError` naming the parameter, before any launch: a kernel fed a wrong
shape or stride reads or writes the wrong memory without any error of its own. Values inside
tensors (sequence lengths, slots, block ids) are not checked here, since reading them would
force a device-to-host sync on every call; the wrappers' docstrings state them as preconditions.
This module imports no Triton, so the checks also run where Triton is absent.
"""

from __future__ import annotations

import os
from typing import NamedTuple

import torch

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
INDEX_DTYPES = (torch.int32, torch.int64)
# A KV cache holds float values, or int8 rows of codes and a scale (splitserve.kernels.kv_int8).
CACHE_DTYPES = (*FLOAT_DTYPES, torch.int8)
# kv_int8.SCALE_BYTES (imported there from here would cycle)
INT8_SCALE_BYTES = 2


class CacheShape(NamedTuple):
    num_blocks: int
    block_size: int
    num_kv_heads: int
    head_dim: int


def check_tensor(
    name: str,
    tensor: object,
    ndim: int,
    dtypes: tuple[torch.dtype, ...],
) -> torch.Tensor:
    """Checks type, rank and dtype; returns the tensor for chaining."""
    if not isinstance(tensor, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
    if tensor.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dims, got shape {tuple(tensor.shape)}")
    if tensor.dtype not in dtypes:
        allowed = ", ".join(str(dtype) for dtype in dtypes)
        raise ValueError(f"{name} must have dtype in ({allowed}), got {tensor.dtype}")
    return tensor


def check_shape(name: str, tensor: torch.Tensor, shape: tuple[int, ...]) -> None:
    if tuple(tensor.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {tuple(shape)}, got {tuple(tensor.shape)}")


def check_same_dtype(name: str, tensor: torch.Tensor, like_name: str, like: torch.Tensor) -> None:
    if tensor.dtype != like.dtype:
        raise ValueError(
            f"{name} must have the dtype of {like_name} ({like.dtype}), got {tensor.dtype}"
        )


def check_last_dim_contiguous(name: str, tensor: torch.Tensor) -> None:
    """The kernels address rows by stride but read each head vector as one contiguous run."""
    if tensor.stride(-1) != 1:
        raise ValueError(
            f"{name} must be contiguous in its last dim, got strides {tensor.stride()}"
        )


def check_contiguous(name: str, tensor: torch.Tensor) -> None:
    if not tensor.is_contiguous():
        raise ValueError(f"{name} must be contiguous, got strides {tensor.stride()}")


def check_same_device(tensors: dict[str, torch.Tensor]) -> torch.device:
    """All tensors on one device, and one the Triton kernels can run on."""
    devices = {name: tensor.device for name, tensor in tensors.items()}
    first_name, device = next(iter(devices.items()))
    for name, other in devices.items():
        if other != device:
            raise ValueError(f"{name} is on {other} but {first_name} is on {device}")
    if device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(
            f"{first_name} is on the CPU: the Triton kernels need a GPU tensor (or "
            "TRITON_INTERPRET=1 for testing); use splitserve.kernels.reference on the CPU"
        )
    return device


def check_kv_cache_pair(key_cache: object, value_cache: object) -> CacheShape:
    """Checks the per-layer caches `[num_blocks, block_size, num_kv_heads, head_dim]` (an int8
    cache: `head_dim + 2`, codes then the scale's bytes, splitserve.kernels.kv_int8).

    Returns that shape, with the model's head_dim. Both caches must share shape, dtype and
    strides, because the kernels compute one offset and use it for both.
    """
    check_tensor("key_cache", key_cache, 4, CACHE_DTYPES)
    check_tensor("value_cache", value_cache, 4, CACHE_DTYPES)
    assert isinstance(key_cache, torch.Tensor) and isinstance(value_cache, torch.Tensor)
    check_shape("value_cache", value_cache, tuple(key_cache.shape))
    check_same_dtype("value_cache", value_cache, "key_cache", key_cache)
    if key_cache.stride() != value_cache.stride():
        raise ValueError(
            f"value_cache strides {value_cache.stride()} differ from key_cache strides "
            f"{key_cache.stride()}"
        )
    check_last_dim_contiguous("key_cache", key_cache)
    num_blocks, block_size, num_kv_heads, row = key_cache.shape
    if key_cache.dtype != torch.int8:
        return CacheShape(num_blocks, block_size, num_kv_heads, row)
    head_dim = row - INT8_SCALE_BYTES
    if head_dim < 2 or head_dim % 2 or any(stride % 2 for stride in key_cache.stride()[:3]):
        raise ValueError(
            f"an int8 key_cache needs rows of an even head_dim + {INT8_SCALE_BYTES} and even "
            f"strides (its bfloat16 scales), got shape {tuple(key_cache.shape)}, strides "
            f"{key_cache.stride()}"
        )
    return CacheShape(num_blocks, block_size, num_kv_heads, head_dim)


def check_query_and_cache(query: object, key_cache: object, value_cache: object) -> CacheShape:
    """The attention kernels' query `[num_tokens, num_heads, head_dim]` against the per-layer
    caches: same dtype and head_dim, whole query heads per kv head. Returns the cache's shape."""
    check_tensor("query", query, 3, FLOAT_DTYPES)
    assert isinstance(query, torch.Tensor)
    shape = check_kv_cache_pair(key_cache, value_cache)
    assert isinstance(key_cache, torch.Tensor), "check_kv_cache_pair checked it"
    if key_cache.dtype != torch.int8:
        check_same_dtype("key_cache", key_cache, "query", query)
    if query.shape[2] != shape.head_dim:
        raise ValueError(
            f"query head_dim ({query.shape[2]}) differs from the cache's ({shape.head_dim})"
        )
    check_gqa(query.shape[1], shape.num_kv_heads)
    check_last_dim_contiguous("query", query)
    return shape


def check_block_table_args(block_tables: object, seq_lens: object, num_seqs: int) -> None:
    """block_tables `[num_seqs, max_blocks_per_seq]` int32, seq_lens `[num_seqs]` int32."""
    check_tensor("block_tables", block_tables, 2, (torch.int32,))
    check_tensor("seq_lens", seq_lens, 1, (torch.int32,))
    assert isinstance(block_tables, torch.Tensor) and isinstance(seq_lens, torch.Tensor)
    if block_tables.shape[0] != num_seqs:
        raise ValueError(
            f"block_tables must have one row per sequence ({num_seqs}), "
            f"got shape {tuple(block_tables.shape)}"
        )
    check_shape("seq_lens", seq_lens, (num_seqs,))
    check_last_dim_contiguous("block_tables", block_tables)
    check_contiguous("seq_lens", seq_lens)


def check_gqa(num_heads: int, num_kv_heads: int) -> int:
    """Returns the number of query heads per kv head."""
    if num_heads % num_kv_heads:
        raise ValueError(
            f"query num_heads ({num_heads}) must be a multiple of the cache's "
            f"num_kv_heads ({num_kv_heads})"
        )
    return num_heads // num_kv_heads


def check_scale(scale: object) -> float:
    if isinstance(scale, bool) or not isinstance(scale, int | float) or not scale > 0:
        raise ValueError(f"scale must be a positive float, got {scale!r}")
    return float(scale)


def is_power_of_two(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0 and not (
        value & (value - 1)
    )


def prepare_out(
    out: torch.Tensor | None, shape: tuple[int, ...], like: torch.Tensor
) -> torch.Tensor:
    """Returns `out`, checked against the result's shape, dtype and device, or a new tensor."""
    if out is None:
        return torch.empty(shape, dtype=like.dtype, device=like.device)
    check_tensor("out", out, len(shape), (like.dtype,))
    check_shape("out", out, shape)
    if out.device != like.device:
        raise ValueError(f"out is on {out.device} but the inputs are on {like.device}")
    check_last_dim_contiguous("out", out)
    return out
