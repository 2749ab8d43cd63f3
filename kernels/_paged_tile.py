"""Triton building blocks shared by the paged attention kernels.

A key tile is `TILE_N` consecutive token positions of one sequence. Each token finds its own
page through the block table, so a tile may span several pages (or part of one): the tile
width is a tuning choice independent of the cache's block size.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from splitserve.kernels.kv_int8 import split_rows


@triton.jit
def load_kv_tile(
    cache_ptr,
    scale_ptr,  # an int8 cache's bfloat16 scales (splitserve.kernels.kv_int8); unused otherwise
    block_table_ptr,  # this sequence's row of the block table
    toks,  # [TILE_N] token positions in the sequence
    tok_ok,  # [TILE_N] which positions exist
    kv_head,
    dims,  # [HEAD_DIM_PAD]
    dim_ok,
    stride_block,
    stride_tok,
    stride_head,
    stride_s_block,  # the scale view's strides, in scales
    stride_s_tok,
    stride_s_head,
    BLOCK_SIZE: tl.constexpr,
    KV_INT8: tl.constexpr,
):
    """Loads `[TILE_N, HEAD_DIM_PAD]` of one kv head; missing positions read as 0. An int8
    cache's codes come back multiplied by their row's scale, in float32."""
    block_ids = tl.load(block_table_ptr + toks // BLOCK_SIZE, mask=tok_ok, other=0)
    # int64: block_id * stride overflows int32 for caches past 2^31 elements.
    rows = (
        block_ids.to(tl.int64) * stride_block
        + (toks % BLOCK_SIZE) * stride_tok
        + kv_head * stride_head
    )
    tile = tl.load(
        cache_ptr + rows[:, None] + dims[None, :],
        mask=tok_ok[:, None] & dim_ok[None, :],
        other=0.0,
    )
    if KV_INT8:
        scale_rows = (
            block_ids.to(tl.int64) * stride_s_block
            + (toks % BLOCK_SIZE) * stride_s_tok
            + kv_head * stride_s_head
        )
        scales = tl.load(scale_ptr + scale_rows, mask=tok_ok, other=0.0).to(tl.float32)
        tile = tile.to(tl.float32) * scales[:, None]
    return tile


@triton.jit
def online_softmax_step(
    q,  # [M, HEAD_DIM_PAD]
    k,  # [TILE_N, HEAD_DIM_PAD]
    v,  # [TILE_N, HEAD_DIM_PAD]
    visible,  # [M, TILE_N] bool, or ignored when APPLY_MASK is False
    acc,  # [M, HEAD_DIM_PAD] float32, unnormalised output
    l_i,  # [M] float32, running sum of exp2
    m_i,  # [M] float32, running max of scores (log2 units)
    scale_log2,  # softmax scale * log2(e): exp2 is cheaper than exp
    APPLY_MASK: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
    softcap_log2=0.0,  # Gemma 2's cap * log2(e), used when HAS_SOFTCAP
    HAS_SOFTCAP: tl.constexpr = False,
    MAY_SEE_NONE: tl.constexpr = False,
):
    """One flash-attention step. Unless MAY_SEE_NONE, every row must see at least one key in
    its first step, so that `m_i` is finite from then on and no `-inf - -inf` ever happens;
    with it (a sliding window can hide a whole tile from a row) a row that has seen nothing
    yet keeps zeros. HAS_SOFTCAP: scores become cap * tanh(score / cap) first (in log2 units
    the same with cap * log2(e))."""
    scores = dot(q, tl.trans(k), DOT_PRECISION, UPCAST_DOT) * scale_log2
    if HAS_SOFTCAP:
        scores = softcap_log2 * tanh(scores / softcap_log2)
    if APPLY_MASK:
        scores = tl.where(visible, scores, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(scores, 1))
    m_new_safe = m_new
    if MAY_SEE_NONE:  # a statement, not a ternary: Triton's constexpr branch
        m_new_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_new_safe)
    p = tl.exp2(scores - m_new_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + dot(p.to(v.dtype), v, DOT_PRECISION, UPCAST_DOT)
    return acc, l_i, m_new


@triton.jit
def tanh(x):
    """tanh from exp2, which every backend and the interpreter have: 1 - 2 / (e^2x + 1), 1 and
    -1 in the limits (exp2 overflowing to inf gives 1)."""
    return 1.0 - 2.0 / (tl.exp2(x * 2.8853900817779268) + 1.0)  # 2x * log2(e)


@triton.jit
def dot(a, b, DOT_PRECISION: tl.constexpr, UPCAST_DOT: tl.constexpr):
    """`tl.dot` with float32 accumulation. UPCAST_DOT exists for Triton's CPU interpreter only,
    whose `tl.dot` multiplies bfloat16 bit patterns as integers (triton-lang/triton#11584):
    bfloat16 products are exact in float32, so upcasting first gives the same sums."""
    if UPCAST_DOT:
        result = tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        result = tl.dot(a, b, input_precision=DOT_PRECISION)
    return result


def scale_args(
    key_cache: torch.Tensor, value_cache: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, int, int, int]:
    """What the attention kernels take for the caches' scales: an int8 cache's key and value
    scale views and their (block, token, head) strides; otherwise the caches themselves and
    zero strides, never read (KV_INT8 False)."""
    if key_cache.dtype != torch.int8:
        return key_cache, value_cache, 0, 0, 0
    key_scales = split_rows(key_cache)[1]
    block_stride, token_stride, head_stride = key_scales.stride()[:3]
    return key_scales, split_rows(value_cache)[1], block_stride, token_stride, head_stride


def dot_meta(dtype: torch.dtype) -> dict[str, object]:
    """The `dot` constexprs for inputs of `dtype`.

    float32 inputs must not go through tf32 (a 10-bit mantissa): the float32 path promises
    float32 accuracy. Half-precision inputs ignore the precision setting.
    """
    interpreting = os.environ.get("TRITON_INTERPRET") == "1"
    return dict(
        DOT_PRECISION="ieee" if dtype == torch.float32 else "tf32",
        UPCAST_DOT=interpreting and dtype == torch.bfloat16,
    )
