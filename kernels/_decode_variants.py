"""Two structural variants of paged decode attention (kernels/decode_attention.py), each chosen
by a key of the launch configuration, so a tuned table picks them only where they measured
faster (issue 41: the one-kv-head kernel reads K/V at 86% of the H100's copy bandwidth).

`KV_HEADS` > 1: one program attends the query heads of KV_HEADS adjacent kv heads. The cache
keeps one token's kv heads next to each other (`[block, token, kv_head, dim]`), so a tile of
(token, kv head) rows is one contiguous run per token (3 x 64 bf16 = 384 bytes for SmolLM2,
where one kv head is a 128-byte row), and all query heads share one `tl.dot` of 16+ rows
instead of padding each group of 3 or 4 to 16. Each query row masks out the columns of the
other kv heads: a block-diagonal score tile. The wasted products cost tensor-core time only.

`FUSED_MERGE`: the last partition program of each (sequence, head block) to finish merges the
partitions itself, found through a counter per (sequence, head block), instead of a second
kernel launch over every (sequence, head) reading back what the first just wrote.

`HEADS_FIRST`: the grid's first (fastest-started) axis is the head block rather than the
sequence (`program_coordinates`), for either kernel.
"""

from __future__ import annotations

import triton
import triton.language as tl

from splitserve.kernels._paged_tile import load_kv_tile, online_softmax_step


@triton.jit
def decode_heads_partition_kernel(
    query_ptr,
    key_cache_ptr,
    value_cache_ptr,
    key_scale_ptr,
    value_scale_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    out_ptr,
    part_out_ptr,
    part_lse_ptr,
    counter_ptr,  # [num_seqs, num_head_blocks] int32, zero between calls (FUSED_MERGE)
    scale_log2,
    stride_q_seq,
    stride_q_head,
    stride_c_block,
    stride_c_tok,
    stride_c_head,
    stride_s_block,
    stride_s_tok,
    stride_s_head,
    stride_bt_seq,
    stride_o_seq,
    stride_o_head,
    num_heads,
    num_kv_heads,
    num_partitions,
    partition_size,
    window,
    softcap_log2,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    GROUP: tl.constexpr,
    KV_HEADS: tl.constexpr,  # kv heads per program, a power of two
    ROWS_PAD: tl.constexpr,  # KV_HEADS * GROUP query rows, padded for tl.dot
    BLOCK_SIZE: tl.constexpr,
    TILE_TOKENS: tl.constexpr,  # tokens per step: the score tile has TILE_TOKENS * KV_HEADS columns
    IS_SINGLE_PARTITION: tl.constexpr,
    FUSED_MERGE: tl.constexpr,
    HEADS_FIRST: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
    KV_INT8: tl.constexpr,
):
    """The partition kernel of decode_attention.py for KV_HEADS kv heads per program (grid:
    sequence, head block, partition, or head block first with HEADS_FIRST); same outputs, same
    partition layout."""
    seq, head_block, num_head_programs = program_coordinates(HEADS_FIRST)
    part = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq)
    part_start = part * partition_size
    part_end = tl.minimum(part_start + partition_size, seq_len)
    first_key = part_start
    if HAS_WINDOW:
        first_key = tl.maximum(part_start, seq_len - window)
    kv_first = head_block * KV_HEADS

    rows = tl.arange(0, ROWS_PAD)
    heads = kv_first * GROUP + rows
    row_ok = (rows < KV_HEADS * GROUP) & (heads < num_heads)
    dims = tl.arange(0, HEAD_DIM_PAD)
    dim_ok = dims < HEAD_DIM
    q = tl.load(
        query_ptr + seq * stride_q_seq + heads[:, None] * stride_q_head + dims[None, :],
        mask=row_ok[:, None] & dim_ok[None, :],
        other=0.0,
    )
    if KV_INT8:
        q = q.to(tl.float32)  # as in the one-kv-head kernel

    # Columns in the cache's order, token-major: a token's kv heads are adjacent in memory.
    cols = tl.arange(0, TILE_TOKENS * KV_HEADS)
    col_head = kv_first + cols % KV_HEADS
    col_head_ok = col_head < num_kv_heads
    # Padding rows take the last row's kv head, so that every row sees a key in each step and
    # its running max stays finite; a kv head past the last reads zeros: scores of 0.
    row_head = kv_first + tl.minimum(rows // GROUP, KV_HEADS - 1)
    own_head = row_head[:, None] == col_head[None, :]

    acc = tl.zeros([ROWS_PAD, HEAD_DIM_PAD], dtype=tl.float32)
    l_i = tl.zeros([ROWS_PAD], dtype=tl.float32)
    m_i = tl.full([ROWS_PAD], float("-inf"), dtype=tl.float32)
    table_ptr = block_tables_ptr + seq * stride_bt_seq
    for tile_start in range(first_key, part_end, TILE_TOKENS):
        toks = tile_start + cols // KV_HEADS
        tok_ok = toks < part_end
        read_ok = tok_ok & col_head_ok
        k = load_kv_tile(key_cache_ptr, key_scale_ptr, table_ptr, toks, read_ok, col_head, dims,
                         dim_ok, stride_c_block, stride_c_tok, stride_c_head, stride_s_block,
                         stride_s_tok, stride_s_head, BLOCK_SIZE, KV_INT8).to(q.dtype)
        v = load_kv_tile(value_cache_ptr, value_scale_ptr, table_ptr, toks, read_ok, col_head,
                         dims, dim_ok, stride_c_block, stride_c_tok, stride_c_head,
                         stride_s_block, stride_s_tok, stride_s_head, BLOCK_SIZE,
                         KV_INT8).to(q.dtype)
        acc, l_i, m_i = online_softmax_step(q, k, v, own_head & tok_ok[None, :], acc, l_i, m_i,
                                            scale_log2, True, DOT_PRECISION, UPCAST_DOT,
                                            softcap_log2, HAS_SOFTCAP)  # fmt: skip

    finish_partition(acc, l_i, m_i, heads, row_ok, dims, dim_ok, seq, seq_len, part, part_start,
                     out_ptr, part_out_ptr, part_lse_ptr,
                     counter_ptr + seq * num_head_programs + head_block, stride_o_seq,
                     stride_o_head, num_heads, num_partitions, partition_size, HEAD_DIM,
                     IS_SINGLE_PARTITION, FUSED_MERGE)  # fmt: skip


@triton.jit
def program_coordinates(HEADS_FIRST: tl.constexpr):
    """(sequence, head block, number of head blocks) of this program. The GPU starts programs
    in order of the grid's first axis: with HEADS_FIRST the head blocks of one (sequence,
    partition) run side by side, and their reads interleave in the same pages (a token's kv
    heads are adjacent in memory) instead of each page being read three or eight times,
    far apart in time, by one head's programs."""
    if HEADS_FIRST:
        head_block = tl.program_id(0)
        seq = tl.program_id(1)
        num_head_programs = tl.num_programs(0)
    else:
        seq = tl.program_id(0)
        head_block = tl.program_id(1)
        num_head_programs = tl.num_programs(1)
    return seq, head_block, num_head_programs


@triton.jit
def finish_partition(
    acc,  # [ROWS, HEAD_DIM_PAD] float32, unnormalised
    l_i,  # [ROWS]
    m_i,  # [ROWS], log2 units
    heads,  # [ROWS] query head of each row
    row_ok,  # [ROWS] which rows are real heads
    dims,
    dim_ok,
    seq,
    seq_len,
    part,
    part_start,
    out_ptr,
    part_out_ptr,
    part_lse_ptr,
    counter,  # this (sequence, head block)'s counter, used when FUSED_MERGE
    stride_o_seq,
    stride_o_head,
    num_heads,
    num_partitions,
    partition_size,
    HEAD_DIM: tl.constexpr,
    IS_SINGLE_PARTITION: tl.constexpr,
    FUSED_MERGE: tl.constexpr,
):
    """Writes a partition program's rows: the output itself when one partition covers the
    context, else the partition's normalised output and log-sum-exp (and, with FUSED_MERGE,
    the merged output if this program is its head block's last)."""
    # A sequence of length 0 (batch padding) has l_i == 0 and acc == 0: its output is 0.
    l_safe = tl.where(l_i > 0, l_i, 1.0)
    result = acc / l_safe[:, None]
    if IS_SINGLE_PARTITION:
        out_ptrs = out_ptr + seq * stride_o_seq + heads[:, None] * stride_o_head + dims[None, :]
        tl.store(out_ptrs, result.to(out_ptr.dtype.element_ty),
                 mask=row_ok[:, None] & dim_ok[None, :])
    else:
        # The merge reads only partitions that hold tokens, so empty ones store nothing.
        part_row = ((seq * num_heads + heads) * num_partitions + part).to(tl.int64)
        # A vector, not a scalar: Triton's interpreter mis-types scalar & block masks.
        store_ok = row_ok & (part_start + tl.zeros_like(heads) < seq_len)
        tl.store(part_out_ptr + part_row[:, None] * HEAD_DIM + dims[None, :], result,
                 mask=store_ok[:, None] & dim_ok[None, :])
        tl.store(part_lse_ptr + part_row, m_i + tl.log2(l_safe), mask=store_ok)
        if FUSED_MERGE:
            _merge_if_last(out_ptr, part_out_ptr, part_lse_ptr, counter, heads, row_ok, dims,
                           dim_ok, seq, seq_len, stride_o_seq, stride_o_head, num_heads,
                           num_partitions, partition_size, HEAD_DIM)  # fmt: skip


@triton.jit
def _merge_if_last(
    out_ptr,
    part_out_ptr,
    part_lse_ptr,
    counter,
    heads,
    row_ok,
    dims,
    dim_ok,
    seq,
    seq_len,
    stride_o_seq,
    stride_o_head,
    num_heads,
    num_partitions,
    partition_size,
    HEAD_DIM: tl.constexpr,
):
    """Counts this program in; the last of its head block's `num_partitions` programs (empty
    ones count too) merges the rows' partitions and sets the counter back to 0 for the next
    call. out = sum_p w_p * out_p / sum_p w_p with w_p = 2^(lse_p - max lse)."""
    # All of this program's threads have stored before the count publishes the partition
    # (the atomic's release covers what the barrier ordered before it).
    tl.debug_barrier()
    num_before = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")
    if num_before == num_partitions - 1:
        num_used = tl.cdiv(seq_len, partition_size)
        base = ((seq * num_heads + heads) * num_partitions).to(tl.int64)
        m = tl.full(heads.shape, float("-inf"), dtype=tl.float32)
        denom = tl.zeros(heads.shape, dtype=tl.float32)
        acc = tl.zeros([heads.shape[0], dims.shape[0]], dtype=tl.float32)
        for p in range(0, num_used):
            # .cg: the other programs' partitions were written from other SMs; read them from
            # L2, never from this SM's L1. Padding rows read lse 0: finite, never stored.
            lse = tl.load(part_lse_ptr + base + p, mask=row_ok, other=0.0, cache_modifier=".cg")
            partial = tl.load(part_out_ptr + (base + p)[:, None] * HEAD_DIM + dims[None, :],
                              mask=row_ok[:, None] & dim_ok[None, :], other=0.0,
                              cache_modifier=".cg")  # fmt: skip
            m_new = tl.maximum(m, lse)
            # A partition a sliding window left empty has lse -inf: while every one so far
            # is, the running max stays -inf and the weights 0 (never -inf - -inf).
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp2(m - m_safe)
            weight = tl.exp2(lse - m_safe)
            acc = acc * alpha[:, None] + weight[:, None] * partial
            denom = denom * alpha + weight
            m = m_new
        result = acc / tl.where(denom > 0, denom, 1.0)[:, None]
        tl.store(out_ptr + seq * stride_o_seq + heads[:, None] * stride_o_head + dims[None, :],
                 result.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & dim_ok[None, :])
        tl.atomic_xchg(counter, 0)
