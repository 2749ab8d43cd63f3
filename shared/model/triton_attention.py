"""Attention over the paged KV cache through the Triton kernels in `kernels/`, for the GPU.

The batch is split where the runner puts the seam (`splitserve.engine.model.attention`):

    rows       | decodes: 1 token per seq | prefill chunks (ragged) |
    sequences  | 0 .. num_decodes - 1     | num_decodes .. num_seqs - 1
               `-> paged_decode_attention  `-> paged_prefill_attention

Every launch is sized from host values (tensor shapes, `meta.num_decodes`, `meta.prefills`), so a
step never waits on the device. Under `TRITON_INTERPRET=1` the same code runs on CPU tensors in
Triton's interpreter, which is how the tests check it against `TorchPagedAttention`.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from splitserve.engine.model.attention_metadata import AttentionMetadata
from splitserve.kernels.decode_attention import paged_decode_attention
from splitserve.kernels.kv_cache_ops import write_kv
from splitserve.kernels.prefill_attention import paged_prefill_attention


class TritonPagedAttention:
    """Reads `meta.block_tables`, `seq_lens` and `query_start_loc`; the runner builds them
    because `uses_block_tables` is True. Stateless: one instance serves every layer."""

    uses_block_tables = True
    reads_decodes_in_place = False  # the block tables cover the decodes too
    takes_window_and_softcap = True  # both kernels take them

    def write_kv(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        layer_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> None:
        """Writes each new token's K/V into its slot `meta.slot_mapping[t]`; mutates
        layer_cache `[2, num_blocks, block_size, num_kv_heads, head_dim]`."""
        # key, value: [num_tokens, num_kv_heads, head_dim]
        if key.stride() != value.stride():
            # The kernel addresses both with one set of strides. The model's key comes out of
            # RoPE as a fresh tensor while its value is still a view into the fused qkv output.
            key, value = key.contiguous(), value.contiguous()
        write_kv(key, value, layer_cache[0], layer_cache[1], meta.slot_mapping)

    def attend(
        self,
        query: torch.Tensor,
        layer_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        window: int = 0,
        softcap: float = 0.0,
    ) -> torch.Tensor:
        """query: [num_tokens, num_heads, head_dim] -> a new tensor of the same shape. Every
        row's own key and value must already be in layer_cache (`write_kv` came first).
        window: a sliding window's positions (0: all); softcap: Gemma 2's score cap (0: none)."""
        tables = _check_metadata(meta)
        out = torch.empty_like(query)
        key_cache, value_cache = layer_cache[0], layer_cache[1]
        num_decodes = meta.num_decodes
        if num_decodes:
            paged_decode_attention(
                query[:num_decodes],
                key_cache,
                value_cache,
                tables.block_tables[:num_decodes],
                tables.seq_lens[:num_decodes],
                scale,
                out=out[:num_decodes],
                window=window,
                softcap=softcap,
            )
        if meta.prefills:
            paged_prefill_attention(
                query[num_decodes:],
                key_cache,
                value_cache,
                tables.block_tables[num_decodes:],
                # The prefill rows are handed over as their own tensor, whose first row is 0.
                tables.query_start_loc[num_decodes:] - num_decodes,
                tables.seq_lens[num_decodes:],
                scale,
                out=out[num_decodes:],
                max_query_len=max(chunk.query_len for chunk in meta.prefills),
                window=window,
                softcap=softcap,
            )
        return out


class _BlockTables(NamedTuple):
    """The metadata's optional fields this backend needs, known to be set."""

    block_tables: torch.Tensor  # [num_seqs, max_blocks]
    seq_lens: torch.Tensor  # [num_seqs]
    query_start_loc: torch.Tensor  # [num_seqs + 1]


def _check_metadata(meta: AttentionMetadata) -> _BlockTables:
    """Internal invariants of the runner's metadata; host values only, so no device sync."""
    assert meta.block_tables is not None and meta.seq_lens is not None, (
        "TritonPagedAttention needs block tables: the runner builds them only for a backend "
        "whose uses_block_tables is True"
    )
    assert meta.query_start_loc is not None, "query_start_loc is built with the block tables"
    num_seqs = meta.num_decodes + len(meta.prefills)
    assert meta.block_tables.shape[0] == num_seqs, (
        f"{meta.block_tables.shape[0]} block-table rows for {meta.num_decodes} decodes and "
        f"{len(meta.prefills)} prefill chunks"
    )
    return _BlockTables(meta.block_tables, meta.seq_lens, meta.query_start_loc)
