"""Paged prefill / extend attention: many new tokens per sequence, causal over a cached prefix.

Per sequence s (rows `query_start_loc[s]:query_start_loc[s + 1]` of query):

    | cached prefix (seq_len - q_len) | new tokens (q_len) |
      key positions 0 .. seq_len - 1, all already in the paged cache

One program takes a tile of new tokens of one sequence for one kv head, with all the query heads
of that kv head stacked as rows (row r = token r // GROUP_PAD, head r % GROUP_PAD), so K and V
are read once per tile for the whole GQA group. Key tiles fully below the tile's first position
need no causal mask; only the last few tiles are masked.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from splitserve.kernels import _checks as checks
from splitserve.kernels._paged_tile import dot_meta, load_kv_tile, online_softmax_step, scale_args

LOG2E = 1.4426950408889634
BLOCK_M = 64  # rows (tokens x heads of one group) per program
BLOCK_N = 64  # key positions per inner step


@triton.jit
def _prefill_kernel(
    query_ptr,
    key_cache_ptr,
    value_cache_ptr,
    key_scale_ptr,  # an int8 cache's scales (load_kv_tile)
    value_scale_ptr,
    block_tables_ptr,
    query_start_loc_ptr,
    seq_lens_ptr,
    out_ptr,
    scale_log2,
    stride_q_tok,
    stride_q_head,
    stride_c_block,
    stride_c_tok,
    stride_c_head,
    stride_s_block,
    stride_s_tok,
    stride_s_head,
    stride_bt_seq,
    stride_o_tok,
    stride_o_head,
    window,  # a sliding window's positions, read when HAS_WINDOW
    softcap_log2,  # Gemma 2's cap * log2(e), read when HAS_SOFTCAP
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
    KV_INT8: tl.constexpr,
):
    TOKENS_PER_TILE: tl.constexpr = BLOCK_M // GROUP_PAD
    seq = tl.program_id(0)
    kv_head = tl.program_id(2)
    q_begin = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_begin
    seq_len = tl.load(seq_lens_ptr + seq)
    context_len = seq_len - q_len
    tile_start = tl.program_id(1) * TOKENS_PER_TILE

    rows = tl.arange(0, BLOCK_M)
    tok = tile_start + rows // GROUP_PAD  # index among this sequence's new tokens
    head = kv_head * GROUP + rows % GROUP_PAD
    row_ok = (tok < q_len) & (rows % GROUP_PAD < GROUP)
    # Padding rows get positions past the tile too, so they see key 0 and stay finite.
    positions = context_len + tok
    dims = tl.arange(0, HEAD_DIM_PAD)
    dim_ok = dims < HEAD_DIM
    q = tl.load(
        query_ptr + (q_begin + tok)[:, None] * stride_q_tok + head[:, None] * stride_q_head
        + dims[None, :],
        mask=row_ok[:, None] & dim_ok[None, :],
        other=0.0,
    )

    # | keys every row sees: no mask | keys up to the tile's last position: causal mask |
    first_pos = context_len + tile_start
    last_pos = context_len + tl.minimum(tile_start + TOKENS_PER_TILE, q_len) - 1
    is_empty = tile_start >= q_len  # the grid is sized for the longest sequence
    unmasked_end = tl.where(is_empty, 0, (first_pos + 1) // BLOCK_N * BLOCK_N)
    kv_end = tl.where(is_empty, 0, last_pos + 1)
    masked_start = unmasked_end
    if HAS_WINDOW:
        # | before every row's window: not read | the rows' windows: masked per row |
        masked_start = tl.minimum(tl.maximum(first_pos - window + 1, 0), kv_end)
        unmasked_end = 0

    if KV_INT8:
        # int8 tiles dequantize to float32: the query comes up to them rather than rounding
        # every key and value down to a half-precision query's dtype.
        q = q.to(tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    table_ptr = block_tables_ptr + seq * stride_bt_seq
    for start_n in range(0, unmasked_end, BLOCK_N):
        keys = start_n + tl.arange(0, BLOCK_N)
        key_ok = keys < unmasked_end
        k = load_kv_tile(key_cache_ptr, key_scale_ptr, table_ptr, keys, key_ok, kv_head, dims,
                         dim_ok, stride_c_block, stride_c_tok, stride_c_head, stride_s_block,
                         stride_s_tok, stride_s_head, BLOCK_SIZE, KV_INT8).to(q.dtype)
        v = load_kv_tile(value_cache_ptr, value_scale_ptr, table_ptr, keys, key_ok, kv_head,
                         dims, dim_ok, stride_c_block, stride_c_tok, stride_c_head,
                         stride_s_block, stride_s_tok, stride_s_head, BLOCK_SIZE,
                         KV_INT8).to(q.dtype)
        acc, l_i, m_i = online_softmax_step(q, k, v, key_ok[None, :], acc, l_i, m_i,
                                            scale_log2, False, DOT_PRECISION, UPCAST_DOT,
                                            softcap_log2, HAS_SOFTCAP)  # fmt: skip
    for start_n in range(masked_start, kv_end, BLOCK_N):
        keys = start_n + tl.arange(0, BLOCK_N)
        key_ok = keys < kv_end
        k = load_kv_tile(key_cache_ptr, key_scale_ptr, table_ptr, keys, key_ok, kv_head, dims,
                         dim_ok, stride_c_block, stride_c_tok, stride_c_head, stride_s_block,
                         stride_s_tok, stride_s_head, BLOCK_SIZE, KV_INT8).to(q.dtype)
        v = load_kv_tile(value_cache_ptr, value_scale_ptr, table_ptr, keys, key_ok, kv_head,
                         dims, dim_ok, stride_c_block, stride_c_tok, stride_c_head,
                         stride_s_block, stride_s_tok, stride_s_head, BLOCK_SIZE,
                         KV_INT8).to(q.dtype)
        visible = (keys[None, :] <= positions[:, None]) & key_ok[None, :]
        if HAS_WINDOW:
            visible = visible & (keys[None, :] > positions[:, None] - window)
        # A window can hide a whole key tile from the tile's later rows (MAY_SEE_NONE).
        acc, l_i, m_i = online_softmax_step(q, k, v, visible, acc, l_i, m_i,
                                            scale_log2, True, DOT_PRECISION, UPCAST_DOT,
                                            softcap_log2, HAS_SOFTCAP, HAS_WINDOW)  # fmt: skip

    result = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    out_ptrs = (out_ptr + (q_begin + tok)[:, None] * stride_o_tok
                + head[:, None] * stride_o_head + dims[None, :])
    tl.store(out_ptrs, result.to(out_ptr.dtype.element_ty),
             mask=row_ok[:, None] & dim_ok[None, :])


def paged_prefill_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
    *,
    max_query_len: int | None = None,
    window: int = 0,
    softcap: float = 0.0,
) -> torch.Tensor:
    """Causal attention of each sequence's new tokens over its cached prefix and themselves
    (each token over the last `window` positions up to its own where window > 0; scores
    capped by softcap * tanh(score / softcap) where softcap > 0).

    query: [num_tokens, num_heads, head_dim]; sequence s owns rows
    `query_start_loc[s]:query_start_loc[s + 1]` (query_start_loc: [num_seqs + 1] int32,
    starting at 0, non-decreasing), the tokens at positions `seq_lens[s] - q_len ..
    seq_lens[s] - 1`, whose keys and values are already in the cache (key_cache, value_cache:
    [num_blocks, block_size, num_kv_heads, head_dim] of query's dtype, or int8 rows of
    head_dim + 2, splitserve.kernels.kv_int8). Returns `out` (or a new tensor) of query's shape and
    dtype.

    max_query_len sizes the launch; pass it (the scheduler knows it) to avoid a device sync.
    Preconditions not checked: `q_len <= seq_lens[s] <= max_blocks_per_seq * block_size`,
    query_start_loc[-1] <= num_tokens, max_query_len >= every q_len, and the block ids in use are
    valid. Rows outside every sequence's range are left untouched.
    """
    shape = _check_prefill_args(query, key_cache, value_cache, block_tables, query_start_loc,
                                seq_lens)
    scale = checks.check_scale(scale)
    out = checks.prepare_out(out, tuple(query.shape), query)
    num_seqs = seq_lens.shape[0]
    if max_query_len is None:
        max_query_len = int((query_start_loc[1:] - query_start_loc[:-1]).max()) if num_seqs else 0
    if isinstance(max_query_len, bool) or not isinstance(max_query_len, int) or max_query_len < 0:
        raise ValueError(f"max_query_len must be an int >= 0, got {max_query_len!r}")
    if window < 0 or softcap < 0:
        raise ValueError(f"window and softcap must be >= 0, got {window} and {softcap}")
    if num_seqs == 0 or max_query_len == 0:
        return out
    head_dim = query.shape[2]
    group = query.shape[1] // shape.num_kv_heads
    group_pad = triton.next_power_of_2(group)
    block_m = max(BLOCK_M, group_pad)
    grid = (num_seqs, triton.cdiv(max_query_len, block_m // group_pad), shape.num_kv_heads)
    key_scales, value_scales, *scale_strides = scale_args(key_cache, value_cache)
    _prefill_kernel[grid](
        query, key_cache, value_cache, key_scales, value_scales, block_tables, query_start_loc,
        seq_lens, out, scale * LOG2E, query.stride(0), query.stride(1), key_cache.stride(0),
        key_cache.stride(1), key_cache.stride(2), *scale_strides, block_tables.stride(0),
        out.stride(0), out.stride(1), int(window), float(softcap) * LOG2E, HEAD_DIM=head_dim,
        HEAD_DIM_PAD=max(16, triton.next_power_of_2(head_dim)), GROUP=group, GROUP_PAD=group_pad,
        BLOCK_SIZE=shape.block_size, BLOCK_M=block_m, BLOCK_N=BLOCK_N, HAS_WINDOW=window > 0,
        HAS_SOFTCAP=softcap > 0, KV_INT8=key_cache.dtype == torch.int8, **dot_meta(query.dtype),
    )
    return out


def _check_prefill_args(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
) -> checks.CacheShape:
    shape = checks.check_query_and_cache(query, key_cache, value_cache)
    checks.check_tensor("seq_lens", seq_lens, 1, (torch.int32,))
    num_seqs = seq_lens.shape[0]
    checks.check_block_table_args(block_tables, seq_lens, num_seqs)
    checks.check_tensor("query_start_loc", query_start_loc, 1, (torch.int32,))
    checks.check_shape("query_start_loc", query_start_loc, (num_seqs + 1,))
    checks.check_contiguous("query_start_loc", query_start_loc)
    checks.check_same_device(dict(query=query, key_cache=key_cache, value_cache=value_cache,
                                  block_tables=block_tables, query_start_loc=query_start_loc,
                                  seq_lens=seq_lens))
    return shape
