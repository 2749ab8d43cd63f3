"""Attention with what SDPA and the paged kernels do not take: a sliding window (Mistral, Phi-3,
Gemma's local layers) and tanh soft-capping of the scores (Gemma 2).

It reads the paged cache in the layout every backend shares (shared/model/attention.py) and the
step's metadata in whichever form the runner built it (decode groups, decode block tables or
block tables), so it serves under the PyTorch and the Triton backend alike: each backend still
writes the keys and values, and a layer with a window or a cap attends here instead of through
`backend.attend`. Each sequence is attended on its own, in explicit scores: correctness first.
The C++ decode kernel and the Triton kernels take windows and caps themselves; this serves the
layers and steps that do not reach them (docs/models.md).

A window layer reads only the blocks that hold keys some query of the chunk can see:

    keys:  | out of every query's window (not read) | window of the first query ... last |
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import NamedTuple

import torch

from splitserve.engine.model.attention_metadata import AttentionMetadata
from splitserve.kernels import kv_int8


class Segment(NamedTuple):
    """One sequence's rows of the step: its queries are the last `query_len` of `seq_len`."""

    rows: slice  # its rows in the flattened batch
    seq_len: int
    block_ids: torch.Tensor  # [>= ceil(seq_len / block_size)] the blocks holding its keys


def masked_attention(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    layer_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, row]
    meta: AttentionMetadata,
    scale: float,
    window: int,  # positions a query sees, itself included; 0 = all
    softcap: float,  # scores become softcap * tanh(scores / softcap); 0 = not capped
) -> torch.Tensor:
    """[num_tokens, num_heads, head_dim]: every row's attention over its sequence's keys."""
    out = torch.empty_like(query)
    block_size = layer_cache.shape[2]
    for segment in segments(meta, block_size):
        rows = segment.rows
        out[rows] = _attend(query[rows], layer_cache, segment, scale, window, softcap)
    return out


def segments(meta: AttentionMetadata, block_size: int) -> Iterator[Segment]:
    """Every sequence of the step, decode rows first (as the runner lays them out); MLA
    (shared/model/mla.py) attends over the same segments."""
    yield from _decode_segments(meta, block_size)
    for chunk in meta.prefills:
        rows = slice(chunk.query_start, chunk.query_start + chunk.query_len)
        yield Segment(rows, chunk.seq_len, chunk.block_ids)


def _decode_segments(meta: AttentionMetadata, block_size: int) -> Iterator[Segment]:
    """One segment per decode row, from whichever decode form the runner built."""
    if not meta.num_decodes:
        return
    if meta.decode_block_tables is not None:
        assert meta.decode_seq_lens is not None, "decode tables come with their lengths"
        tables, lens = meta.decode_block_tables, meta.decode_seq_lens.tolist()
        for row in range(meta.num_decodes):
            yield Segment(slice(row, row + 1), lens[row], tables[row])
        return
    if meta.block_tables is not None:  # the Triton path: decode rows come first
        assert meta.seq_lens is not None, "block tables come with their lengths"
        tables, lens = meta.block_tables, meta.seq_lens.tolist()
        for row in range(meta.num_decodes):
            yield Segment(slice(row, row + 1), lens[row], tables[row])
        return
    for group in meta.decode_groups:
        # rows None: the lone group of every decode row, in order.
        row_ids = list(range(meta.num_decodes)) if group.rows is None else group.rows.tolist()
        tables = group.block_ids.view(len(row_ids), -1)
        padded_len = tables.shape[1] * block_size
        # The mask is None only when no row is padded: each holds its whole table.
        lens = (
            [padded_len] * len(row_ids)
            if group.mask is None
            else (group.mask.view(len(row_ids), -1).sum(-1).tolist())
        )
        for i, row in enumerate(row_ids):
            yield Segment(slice(row, row + 1), int(lens[i]), tables[i])


def _attend(
    query: torch.Tensor,  # [query_len, num_heads, head_dim]
    layer_cache: torch.Tensor,
    segment: Segment,
    scale: float,
    window: int,
    softcap: float,
) -> torch.Tensor:
    query_len, num_heads, _ = query.shape
    seq_len, block_size = segment.seq_len, layer_cache.shape[2]
    first_query = seq_len - query_len  # the position of the segment's first query
    first_key = max(0, first_query - window + 1) if window else 0
    first_block = first_key // block_size
    block_ids = segment.block_ids[first_block : -(-seq_len // block_size)].long()
    key_start = first_block * block_size
    kv = layer_cache[:, block_ids].flatten(1, 2)[:, : seq_len - key_start]
    if kv_int8.is_int8_cache(layer_cache):
        codes, scales = kv_int8.split_rows(kv)
        kv = codes.to(query.dtype) * scales.to(query.dtype)
    # [2, keys, kv_heads, dim] -> [2, heads, keys, dim], each kv head repeated for its queries
    kv = kv.transpose(1, 2).repeat_interleave(num_heads // kv.shape[2], dim=1)
    q = query.transpose(0, 1)  # [heads, query_len, dim]
    scores = torch.matmul(q, kv[0].transpose(1, 2)) * scale  # [heads, query_len, keys]
    if softcap:
        scores = torch.tanh(scores / softcap) * softcap
    query_pos = torch.arange(first_query, seq_len, device=query.device).unsqueeze(1)
    key_pos = torch.arange(key_start, seq_len, device=query.device).unsqueeze(0)
    visible = key_pos <= query_pos
    if window:
        visible &= key_pos > query_pos - window
    scores = scores.masked_fill(~visible, float("-inf"))
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
    return torch.matmul(probs, kv[1]).transpose(0, 1)  # [query_len, heads, dim]
