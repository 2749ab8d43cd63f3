"""Paged decode attention (one query token per sequence), split along the context.

Flash-decoding: one program per (sequence, kv head, context partition) attends all query heads
of that kv head at once, so each key and value is read from memory exactly once however many
query heads share it (GQA). When the context is longer than one partition, each partition
writes its normalised output and log-sum-exp, and a second kernel merges the partitions. A
batch whose contexts fit one partition skips the merge and writes the output directly.
Two variants, chosen by the launch's KV_HEADS and FUSED_MERGE keys (the tuned table's), attend
several kv heads per program and merge the partitions without a second kernel
(kernels/_decode_variants.py).
"""

from __future__ import annotations

import functools
import math
from typing import Any

import torch
import triton
import triton.language as tl

from splitserve.kernels import _checks as checks
from splitserve.kernels._decode_variants import (
    decode_heads_partition_kernel,
    finish_partition,
    program_coordinates,
)
from splitserve.kernels._decode_waves import balanced_partition_size, program_slots
from splitserve.kernels._paged_tile import dot_meta, load_kv_tile, online_softmax_step, scale_args
from splitserve.kernels.launch_configs import launch_config, lookup_environment

LOG2E = 1.4426950408889634
DEFAULT_PARTITION_SIZE = 512
# What a GPU without a tuned table (kernels/launch_configs.py) runs: Triton's own defaults of
# warps and stages, 64-token tiles, 512-token partitions.
# KV_HEADS=1 and FUSED_MERGE=0: the one-kv-head kernel and the merge kernel, not the
# variants of kernels/_decode_variants.py. HEADS_FIRST=0: the grid's fastest axis is the
# sequence (HEADS_FIRST=1 puts the head blocks first, see program_coordinates).
DEFAULT_LAUNCH = dict(PARTITION_SIZE=DEFAULT_PARTITION_SIZE, TILE_N=64, num_warps=4, num_stages=3,
                      KV_HEADS=1, FUSED_MERGE=0, HEADS_FIRST=0, WAVE_SLOTS=0)
# tl.dot needs at least 16 rows; padding the query-head group costs compute only, and decode
# is bound by reading K and V.
MIN_GROUP_ROWS = 16
MAX_KV_HEADS = 16
# The fused merge's counters are made once for this many (sequence, head block) pairs, so that a
# batch growing past its first size rarely makes new ones.
MIN_MERGE_COUNTERS = 4096


@triton.jit
def _decode_partition_kernel(
    query_ptr,
    key_cache_ptr,
    value_cache_ptr,
    key_scale_ptr,  # an int8 cache's scales (load_kv_tile)
    value_scale_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    out_ptr,  # [num_seqs, num_heads, head_dim], written when IS_SINGLE_PARTITION
    part_out_ptr,  # [num_seqs, num_heads, num_partitions, HEAD_DIM] float32
    part_lse_ptr,  # [num_seqs, num_heads, num_partitions] float32, log2 units
    counter_ptr,  # [num_seqs, num_kv_heads] int32, zero between calls (FUSED_MERGE)
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
    num_partitions,
    partition_size,  # a multiple of 16; not a constexpr, as _decode_waves.py varies it
    window,  # a sliding window's positions, read when HAS_WINDOW
    softcap_log2,  # Gemma 2's cap * log2(e), read when HAS_SOFTCAP
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    TILE_N: tl.constexpr,
    IS_SINGLE_PARTITION: tl.constexpr,
    FUSED_MERGE: tl.constexpr,
    HEADS_FIRST: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
    KV_INT8: tl.constexpr,
):
    seq, kv_head, num_head_programs = program_coordinates(HEADS_FIRST)
    part = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq)
    part_start = part * partition_size
    part_end = tl.minimum(part_start + partition_size, seq_len)
    # A window's query (at seq_len - 1) sees the last `window` positions: a partition before
    # them reads nothing and leaves an empty partial (log-sum-exp -inf) to the merge.
    first_key = part_start
    if HAS_WINDOW:
        first_key = tl.maximum(part_start, seq_len - window)

    rows = tl.arange(0, GROUP_PAD)
    heads = kv_head * GROUP + rows
    row_ok = rows < GROUP
    dims = tl.arange(0, HEAD_DIM_PAD)
    dim_ok = dims < HEAD_DIM
    q = tl.load(
        query_ptr + seq * stride_q_seq + heads[:, None] * stride_q_head + dims[None, :],
        mask=row_ok[:, None] & dim_ok[None, :],
        other=0.0,
    )

    if KV_INT8:
        # int8 tiles dequantize to float32: the query comes up to them rather than rounding
        # every key and value down to a half-precision query's dtype.
        q = q.to(tl.float32)
    acc = tl.zeros([GROUP_PAD, HEAD_DIM_PAD], dtype=tl.float32)
    l_i = tl.zeros([GROUP_PAD], dtype=tl.float32)
    m_i = tl.full([GROUP_PAD], float("-inf"), dtype=tl.float32)
    table_ptr = block_tables_ptr + seq * stride_bt_seq
    # An empty partition (past the end of this sequence) runs no iteration.
    for tile_start in range(first_key, part_end, TILE_N):
        toks = tile_start + tl.arange(0, TILE_N)
        tok_ok = toks < part_end
        k = load_kv_tile(key_cache_ptr, key_scale_ptr, table_ptr, toks, tok_ok, kv_head, dims,
                         dim_ok, stride_c_block, stride_c_tok, stride_c_head, stride_s_block,
                         stride_s_tok, stride_s_head, BLOCK_SIZE, KV_INT8).to(q.dtype)
        v = load_kv_tile(value_cache_ptr, value_scale_ptr, table_ptr, toks, tok_ok, kv_head,
                         dims, dim_ok, stride_c_block, stride_c_tok, stride_c_head,
                         stride_s_block, stride_s_tok, stride_s_head, BLOCK_SIZE,
                         KV_INT8).to(q.dtype)
        acc, l_i, m_i = online_softmax_step(q, k, v, tok_ok[None, :], acc, l_i, m_i,
                                            scale_log2, True, DOT_PRECISION, UPCAST_DOT,
                                            softcap_log2, HAS_SOFTCAP)  # fmt: skip

    finish_partition(acc, l_i, m_i, heads, row_ok, dims, dim_ok, seq, seq_len, part, part_start,
                     out_ptr, part_out_ptr, part_lse_ptr,
                     counter_ptr + seq * num_head_programs + kv_head, stride_o_seq,
                     stride_o_head, num_heads, num_partitions, partition_size, HEAD_DIM,
                     IS_SINGLE_PARTITION, FUSED_MERGE)  # fmt: skip


@triton.jit
def _decode_merge_kernel(
    out_ptr,
    part_out_ptr,
    part_lse_ptr,
    seq_lens_ptr,
    stride_o_seq,
    stride_o_head,
    num_heads,
    num_partitions,
    partition_size,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    PART_TILE: tl.constexpr,
):
    """out = sum_p w_p * out_p / sum_p w_p with w_p = 2^(lse_p - max lse)."""
    seq = tl.program_id(0)
    head = tl.program_id(1)
    seq_len = tl.load(seq_lens_ptr + seq)
    num_used = tl.cdiv(seq_len, partition_size)
    base = ((seq * num_heads + head) * num_partitions).to(tl.int64)
    dims = tl.arange(0, HEAD_DIM_PAD)
    dim_ok = dims < HEAD_DIM

    # Pass 1: the largest lse, kept elementwise so no scalar is carried through the loop.
    m_vec = tl.full([PART_TILE], float("-inf"), dtype=tl.float32)
    for p0 in range(0, num_used, PART_TILE):
        parts = p0 + tl.arange(0, PART_TILE)
        lse = tl.load(part_lse_ptr + base + parts, mask=parts < num_used, other=float("-inf"))
        m_vec = tl.maximum(m_vec, lse)
    m = tl.max(m_vec, 0)

    acc = tl.zeros([HEAD_DIM_PAD], dtype=tl.float32)
    denom = tl.zeros([PART_TILE], dtype=tl.float32)
    for p0 in range(0, num_used, PART_TILE):
        parts = p0 + tl.arange(0, PART_TILE)
        part_ok = parts < num_used
        lse = tl.load(part_lse_ptr + base + parts, mask=part_ok, other=float("-inf"))
        weight = tl.exp2(lse - m)
        partial = tl.load(part_out_ptr + (base + parts)[:, None] * HEAD_DIM + dims[None, :],
                          mask=part_ok[:, None] & dim_ok[None, :], other=0.0)
        acc += tl.sum(weight[:, None] * partial, 0)
        denom += weight
    total = tl.sum(denom, 0)
    result = acc / tl.where(total > 0, total, 1.0)
    tl.store(out_ptr + seq * stride_o_seq + head * stride_o_head + dims,
             result.to(out_ptr.dtype.element_ty), mask=dim_ok)


def paged_decode_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
    *,
    partition_size: int | None = None,
    launch: dict[str, Any] | None = None,
    window: int = 0,
    softcap: float = 0.0,
) -> torch.Tensor:
    """Attention of one new token per sequence over its whole paged context (or the last
    `window` positions of it, Mistral's and Gemma's sliding windows; 0: all), its scores
    capped by softcap * tanh(score / softcap) where softcap > 0 (Gemma 2).

    query: [num_seqs, num_heads, head_dim], the token at position `seq_lens[s] - 1`, whose own
    key and value are already in the cache. key_cache, value_cache: [num_blocks, block_size,
    num_kv_heads, head_dim] of query's dtype, or int8 rows of head_dim + 2
    (splitserve.kernels.kv_int8),
    dequantized as they are read. block_tables: [num_seqs, max_blocks_per_seq] int32. seq_lens:
    [num_seqs] int32. Returns `out` (or a new tensor) of query's shape and dtype.

    Preconditions not checked (they would need a device sync): `0 <= seq_lens[s] <=
    max_blocks_per_seq * block_size` and the first `ceil(seq_lens[s] / block_size)` block ids
    of each row are valid blocks. A sequence of length 0 gets zeros.

    The context is cut into `partition_size`-token partitions (a multiple of 16; None: the
    device's tuned size, or with the launch's WAVE_SLOTS the size that fills whole waves of
    the device, kernels/_decode_waves.py; else 512) when `max_blocks_per_seq * block_size`
    exceeds it: that bound, not the true lengths, sizes the launch, so the call never syncs;
    slice block_tables to the batch's longest row. `launch`: TILE_N, num_warps, num_stages,
    the variants' keys KV_HEADS, FUSED_MERGE and HEADS_FIRST (kernels/_decode_variants.py)
    and WAVE_SLOTS instead of the tuned table's
    (benchmarks.triton_tune tries candidates through it).
    """
    shape = _check_decode_args(query, key_cache, value_cache, block_tables, seq_lens)
    scale = checks.check_scale(scale)
    launch = {**decode_launch(query, key_cache, shape), **(launch or {})}
    kv_heads = _kv_heads_per_program(launch, shape.num_kv_heads)
    out = checks.prepare_out(out, tuple(query.shape), query)
    num_seqs, num_heads, head_dim = query.shape
    max_context = block_tables.shape[1] * shape.block_size
    head_programs = -(-shape.num_kv_heads // kv_heads)
    if partition_size is None:
        partition_size = _launch_partition_size(launch, max_context, num_seqs * head_programs,
                                                query.device)  # fmt: skip
    if partition_size % 16 or partition_size < 16:
        raise ValueError(f"partition_size must be a multiple of 16, got {partition_size}")
    if window < 0 or softcap < 0:
        raise ValueError(f"window and softcap must be >= 0, got {window} and {softcap}")
    if num_seqs == 0:
        return out
    num_partitions = max(1, math.ceil(max_context / partition_size))
    heads_first = bool(launch.get("HEADS_FIRST"))
    grid = ((head_programs, num_seqs) if heads_first else (num_seqs, head_programs)) + (
        num_partitions,)
    counters = None
    if num_partitions > 1 and launch.get("FUSED_MERGE"):
        counters = _merge_counters(query.device, num_seqs * head_programs)
    meta = _partition_meta(query, key_cache, shape, kv_heads, _tile_limit(partition_size), launch)
    meta.update(IS_SINGLE_PARTITION=num_partitions == 1, FUSED_MERGE=counters is not None,
                HEADS_FIRST=heads_first, HAS_WINDOW=window > 0, HAS_SOFTCAP=softcap > 0)
    visibility = (int(window), float(softcap) * LOG2E)
    if num_partitions == 1:
        part_out = part_lse = out  # unused by the single-partition variant
    else:
        part_out = torch.empty((num_seqs, num_heads, num_partitions, head_dim),
                               dtype=torch.float32, device=query.device)
        part_lse = torch.empty((num_seqs, num_heads, num_partitions),
                               dtype=torch.float32, device=query.device)
    key_scales, value_scales, *scale_strides = scale_args(key_cache, value_cache)
    args = [
        query, key_cache, value_cache, key_scales, value_scales, block_tables, seq_lens, out,
        part_out, part_lse, out if counters is None else counters, scale * LOG2E,
        query.stride(0), query.stride(1), key_cache.stride(0), key_cache.stride(1),
        key_cache.stride(2), *scale_strides, block_tables.stride(0), out.stride(0),
        out.stride(1), num_heads,
    ]  # fmt: skip
    if kv_heads == 1:
        _decode_partition_kernel[grid](*args, num_partitions, partition_size, *visibility,
                                       **meta)  # fmt: skip
    else:
        decode_heads_partition_kernel[grid](*args, shape.num_kv_heads, num_partitions,
                                            partition_size, *visibility, **meta)  # fmt: skip
    if num_partitions > 1 and counters is None:
        _decode_merge_kernel[(num_seqs, num_heads)](
            out, part_out, part_lse, seq_lens, out.stride(0), out.stride(1), num_heads,
            num_partitions, partition_size, HEAD_DIM=head_dim, HEAD_DIM_PAD=meta["HEAD_DIM_PAD"],
            PART_TILE=min(16, triton.next_power_of_2(num_partitions)),
        )
    return out


def _launch_partition_size(
    launch: dict[str, Any], max_context: int, row_programs: int, device: torch.device
) -> int:
    """The launch's PARTITION_SIZE, or with WAVE_SLOTS the size that fills whole waves of
    the device (kernels/_decode_waves.py), in whole tiles."""
    slots_per_sm = int(launch.get("WAVE_SLOTS", 0))
    if slots_per_sm <= 0:
        return int(launch["PARTITION_SIZE"])
    tile = max(MIN_GROUP_ROWS, int(launch["TILE_N"]) // int(launch.get("KV_HEADS", 1)))
    return balanced_partition_size(max_context, row_programs,
                                   program_slots(device, slots_per_sm), tile)  # fmt: skip


def _tile_limit(partition_size: int) -> int:
    """The longest tile a partition takes: tl.arange needs a power of two."""
    return 1 << (partition_size.bit_length() - 1)


def _kv_heads_per_program(launch: dict[str, Any], num_kv_heads: int) -> int:
    """The launch's KV_HEADS (1: the one-kv-head kernel); more than the cache holds means all
    of them, rounded up to a power of two."""
    kv_heads = int(launch.get("KV_HEADS", 1))
    if not checks.is_power_of_two(kv_heads) or kv_heads > MAX_KV_HEADS:
        raise ValueError(f"KV_HEADS must be a power of two <= {MAX_KV_HEADS}, got {kv_heads}")
    return min(kv_heads, triton.next_power_of_2(num_kv_heads))


def _partition_meta(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    shape: checks.CacheShape,
    kv_heads: int,
    max_tile: int,
    launch: dict[str, Any],
) -> dict[str, Any]:
    """The partition kernel's constexprs and launch options, for tiles of at most `max_tile`
    tokens (a power of two no longer than a partition).
    TILE_N counts score columns, (token, kv head) pairs: with KV_HEADS kv heads a step reads
    TILE_N / KV_HEADS tokens, the same bytes as the one-kv-head kernel's TILE_N tokens."""
    head_dim = query.shape[2]
    group = query.shape[1] // shape.num_kv_heads
    meta: dict[str, Any] = dict(
        HEAD_DIM=head_dim,
        HEAD_DIM_PAD=max(16, triton.next_power_of_2(head_dim)),
        GROUP=group,
        BLOCK_SIZE=shape.block_size,
        KV_INT8=key_cache.dtype == torch.int8,
        num_warps=int(launch["num_warps"]),
        num_stages=int(launch["num_stages"]),
        **dot_meta(query.dtype),
    )
    tile_n = int(launch["TILE_N"])
    if kv_heads == 1:
        meta.update(GROUP_PAD=max(MIN_GROUP_ROWS, triton.next_power_of_2(group)),
                    TILE_N=min(tile_n, max_tile))  # fmt: skip
    else:
        # At least 16 columns: tl.dot's smallest inner dimension for the P @ V product.
        tile_tokens = min(max(tile_n, MIN_GROUP_ROWS) // kv_heads, max_tile)
        meta.update(KV_HEADS=kv_heads, TILE_TOKENS=tile_tokens,
                    ROWS_PAD=max(MIN_GROUP_ROWS, triton.next_power_of_2(kv_heads * group)))
    return meta


# device -> every counter buffer made there, newest last. Older ones stay alive: a CUDA graph
# captured with one keeps writing to it.
_MERGE_COUNTERS: dict[torch.device, list[torch.Tensor]] = {}


def _merge_counters(device: torch.device, count: int) -> torch.Tensor | None:
    """`count` int32 counters at zero for FUSED_MERGE, which leaves them at zero after each
    call. None (the caller then launches the merge kernel) where new ones would have to be
    made during a CUDA-graph capture: those would hold no zeros until the graph's first
    replay, and an eager call could come first. The counters are the device's, shared by
    every call: calls on one device must run one after another (one stream), as layers do."""
    buffers = _MERGE_COUNTERS.setdefault(device, [])
    if not buffers or buffers[-1].numel() < count:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return None
        buffers.append(torch.zeros(max(count, MIN_MERGE_COUNTERS), dtype=torch.int32,
                                   device=device))  # fmt: skip
    return buffers[-1][:count]


def decode_launch_key(
    dtype: torch.dtype, head_dim: int, group: int, block_size: int, kv_int8: bool
) -> str:
    """The tuned table's key for a decode shape (kernels/launch_configs.py)."""
    cache = "int8" if kv_int8 else "kv"
    return f"{str(dtype).removeprefix('torch.')}/d{head_dim}/g{group}/b{block_size}/{cache}"


def decode_launch(
    query: torch.Tensor, key_cache: torch.Tensor, shape: checks.CacheShape
) -> dict[str, Any]:
    """The shape's launch (shared between calls: not to be changed)."""
    group = query.shape[1] // shape.num_kv_heads
    return _decode_launch(query.dtype, query.shape[2], group, shape.block_size,
                          key_cache.dtype == torch.int8, query.device, lookup_environment())


@functools.lru_cache(maxsize=256)
def _decode_launch(
    dtype: torch.dtype, head_dim: int, group: int, block_size: int, kv_int8: bool,
    device: torch.device, environment: tuple[str | None, str | None],
) -> dict[str, Any]:  # fmt: skip
    key = decode_launch_key(dtype, head_dim, group, block_size, kv_int8)
    return launch_config("decode_attention", key, device, DEFAULT_LAUNCH)


def _check_decode_args(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
) -> checks.CacheShape:
    shape = checks.check_query_and_cache(query, key_cache, value_cache)
    checks.check_block_table_args(block_tables, seq_lens, query.shape[0])
    tensors = dict(query=query, key_cache=key_cache, value_cache=value_cache,
                   block_tables=block_tables, seq_lens=seq_lens)
    checks.check_same_device(tensors)
    return shape
