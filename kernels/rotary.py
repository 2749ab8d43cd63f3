"""Rotary position embedding (Hugging Face Llama's rotate-half convention), in place.

For a head vector x = [x1 | x2] (halves) at position p, with c = cos(p * inv_freq) and
s = sin(p * inv_freq) (head_dim / 2 values each):

    out = [x1 * c - x2 * s | x2 * c + x1 * s]

which is `x * cat(c, c) + rotate_half(x) * cat(s, s)` with `rotate_half(x) = cat(-x2, x1)`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from splitserve.kernels import _checks as checks


@triton.jit
def _rotate_heads(
    x_ptr, stride_head, cos, sin, halves, NUM_HEADS: tl.constexpr, HEADS_PAD: tl.constexpr,
    HALF: tl.constexpr, HALF_PAD: tl.constexpr,
):
    """Rotates `[NUM_HEADS, 2 * HALF]` at x_ptr in place, in float32."""
    heads = tl.arange(0, HEADS_PAD)
    mask = (heads < NUM_HEADS)[:, None] & (halves < HALF)[None, :]
    first = x_ptr + heads[:, None] * stride_head + halves[None, :]
    x1 = tl.load(first, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(first + HALF, mask=mask, other=0.0).to(tl.float32)
    dtype = x_ptr.dtype.element_ty
    tl.store(first, (x1 * cos - x2 * sin).to(dtype), mask=mask)
    tl.store(first + HALF, (x2 * cos + x1 * sin).to(dtype), mask=mask)


@triton.jit
def _rotary_kernel(
    query_ptr,
    key_ptr,
    positions_ptr,
    cos_sin_ptr,
    stride_q_tok,
    stride_q_head,
    stride_k_tok,
    stride_k_head,
    stride_cache,
    NUM_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HEADS_PAD: tl.constexpr,
    KV_HEADS_PAD: tl.constexpr,
    HALF: tl.constexpr,
    HALF_PAD: tl.constexpr,
):
    token = tl.program_id(0)
    position = tl.load(positions_ptr + token).to(tl.int64)
    halves = tl.arange(0, HALF_PAD)
    row = cos_sin_ptr + position * stride_cache + halves
    cos = tl.load(row, mask=halves < HALF, other=0.0).to(tl.float32)[None, :]
    sin = tl.load(row + HALF, mask=halves < HALF, other=0.0).to(tl.float32)[None, :]
    _rotate_heads(query_ptr + token.to(tl.int64) * stride_q_tok, stride_q_head, cos, sin, halves,
                  NUM_HEADS, HEADS_PAD, HALF, HALF_PAD)
    _rotate_heads(key_ptr + token.to(tl.int64) * stride_k_tok, stride_k_head, cos, sin, halves,
                  NUM_KV_HEADS, KV_HEADS_PAD, HALF, HALF_PAD)


def rotary_embedding(
    query: torch.Tensor, key: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor
) -> None:
    """Rotates query `[T, num_heads, head_dim]` and key `[T, num_kv_heads, head_dim]` in place
    by the angles of `positions` ([T] int64 or int32).

    cos_sin_cache: [max_position, head_dim], `[:, :head_dim/2]` = cos and `[:, head_dim/2:]` =
    sin of `position * inv_freq` (see `splitserve.kernels.reference.rotary_cos_sin_cache`); float32
    is
    best. query and key may be strided views (say, of one fused QKV projection). Precondition
    not checked: `0 <= positions < max_position`.
    """
    checks.check_tensor("query", query, 3, checks.FLOAT_DTYPES)
    checks.check_tensor("key", key, 3, checks.FLOAT_DTYPES)
    num_tokens, num_heads, head_dim = query.shape
    if head_dim % 2:
        raise ValueError(f"query head_dim must be even, got {head_dim}")
    if key.shape[0] != num_tokens or key.shape[2] != head_dim:
        raise ValueError(
            f"key must have shape [{num_tokens}, num_kv_heads, {head_dim}], "
            f"got {tuple(key.shape)}"
        )
    checks.check_same_dtype("key", key, "query", query)
    checks.check_last_dim_contiguous("query", query)
    checks.check_last_dim_contiguous("key", key)
    checks.check_tensor("positions", positions, 1, checks.INDEX_DTYPES)
    checks.check_shape("positions", positions, (num_tokens,))
    checks.check_contiguous("positions", positions)
    checks.check_tensor("cos_sin_cache", cos_sin_cache, 2, checks.FLOAT_DTYPES)
    if cos_sin_cache.shape[1] != head_dim:
        raise ValueError(
            f"cos_sin_cache must have shape [max_position, {head_dim}], "
            f"got {tuple(cos_sin_cache.shape)}"
        )
    checks.check_last_dim_contiguous("cos_sin_cache", cos_sin_cache)
    checks.check_same_device(dict(query=query, key=key, positions=positions,
                                  cos_sin_cache=cos_sin_cache))
    if num_tokens == 0:
        return
    half = head_dim // 2
    _rotary_kernel[(num_tokens,)](
        query, key, positions, cos_sin_cache, query.stride(0), query.stride(1), key.stride(0),
        key.stride(1), cos_sin_cache.stride(0), NUM_HEADS=num_heads, NUM_KV_HEADS=key.shape[1],
        HEADS_PAD=triton.next_power_of_2(num_heads),
        KV_HEADS_PAD=triton.next_power_of_2(key.shape[1]), HALF=half,
        HALF_PAD=triton.next_power_of_2(half),
    )
