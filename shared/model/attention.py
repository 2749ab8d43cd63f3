"""Attention over the paged KV cache: the per-step metadata and the PyTorch (CPU) path.

The batch is flattened and ordered decodes first:

    | decode tokens (1 per seq) | prefill chunk of seq a | prefill chunk of seq b | ...
    0                    num_decodes

Decodes attend in one padded, batched call; each prefill chunk attends causally to its cached
prefix plus itself. `select_attention_backend` is the one place that picks this path or the
Triton kernels; both read the same cache layout:
`kv_cache[layer]` is `[2, num_blocks, block_size, num_kv_heads, head_dim]`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F


@dataclass
class PrefillChunk:
    query_start: int  # first row of this chunk in the flattened batch
    query_len: int
    # Indices into the flattened slot axis of every key this chunk attends to, oldest first:
    # | cached prefix | this chunk |
    context_slots: torch.Tensor  # [seq_len] int64


@dataclass
class AttentionMetadata:
    """Built once per step by the runner and shared by every layer."""

    slot_mapping: torch.Tensor  # [num_tokens] int64: where each new token's K/V is written
    num_decodes: int
    # Flattened-slot index of every key of every decoding sequence, padded to the longest.
    decode_context_slots: torch.Tensor  # [num_decodes, max_seq_len] int64
    # False where a decode row's index is padding; None when no row is padded.
    decode_mask: torch.Tensor | None  # [num_decodes, 1, 1, max_seq_len] bool
    prefills: list[PrefillChunk]
    # Block-table form of the same positions, for kernels that walk blocks themselves.
    block_tables: torch.Tensor | None = None  # [num_seqs, max_blocks] int32
    seq_lens: torch.Tensor | None = None  # [num_seqs] int32
    query_start_loc: torch.Tensor | None = None  # [num_seqs + 1] int32


class AttentionBackend(Protocol):
    # True when `attend` reads meta.block_tables / seq_lens / query_start_loc (the runner only
    # builds them then).
    uses_block_tables: bool

    def write_kv(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        layer_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> None: ...

    def attend(
        self, query: torch.Tensor, layer_cache: torch.Tensor, meta: AttentionMetadata, scale: float
    ) -> torch.Tensor: ...


class TorchPagedAttention:
    """Gathers each sequence's keys through its slots, then runs SDPA; for the CPU."""

    uses_block_tables = False

    def write_kv(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        layer_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> None:
        # key, value: [num_tokens, num_kv_heads, head_dim]
        num_kv_heads, head_dim = key.shape[1], key.shape[2]
        flat = layer_cache.view(2, -1, num_kv_heads, head_dim)
        flat[0].index_copy_(0, meta.slot_mapping, key)
        flat[1].index_copy_(0, meta.slot_mapping, value)

    def attend(
        self, query: torch.Tensor, layer_cache: torch.Tensor, meta: AttentionMetadata, scale: float
    ) -> torch.Tensor:
        # query: [num_tokens, num_heads, head_dim] -> same shape out
        out = torch.empty_like(query)
        flat = layer_cache.view(2, -1, layer_cache.shape[-2], layer_cache.shape[-1])
        if meta.num_decodes:
            out[: meta.num_decodes] = self._decode(query[: meta.num_decodes], flat, meta, scale)
        for chunk in meta.prefills:
            rows = slice(chunk.query_start, chunk.query_start + chunk.query_len)
            out[rows] = self._prefill(query[rows], flat, chunk, scale)
        return out

    @staticmethod
    def _decode(
        query: torch.Tensor, flat: torch.Tensor, meta: AttentionMetadata, scale: float
    ) -> torch.Tensor:
        num_decodes, max_len = meta.decode_context_slots.shape
        # One index_select fetches keys and values together (advanced indexing is far slower).
        kv = flat.index_select(1, meta.decode_context_slots.view(-1))
        kv = kv.view(2, num_decodes, max_len, flat.shape[-2], flat.shape[-1]).transpose(2, 3)
        q = query.unsqueeze(2)  # [num_decodes, num_heads, 1, head_dim]
        out = F.scaled_dot_product_attention(
            q, kv[0], kv[1], attn_mask=meta.decode_mask, scale=scale, enable_gqa=True
        )
        return out.squeeze(2)

    @staticmethod
    def _prefill(
        query: torch.Tensor, flat: torch.Tensor, chunk: PrefillChunk, scale: float
    ) -> torch.Tensor:
        kv = flat.index_select(1, chunk.context_slots).transpose(1, 2)
        keys, values = kv[0], kv[1]  # [num_kv_heads, seq_len, head_dim]
        q = query.transpose(0, 1)  # [num_heads, query_len, head_dim]
        seq_len = chunk.context_slots.shape[0]
        if seq_len == chunk.query_len:
            out = F.scaled_dot_product_attention(
                q, keys, values, is_causal=True, scale=scale, enable_gqa=True
            )
        else:
            mask = _prefix_causal_mask(chunk.query_len, seq_len, query.device)
            out = F.scaled_dot_product_attention(
                q, keys, values, attn_mask=mask, scale=scale, enable_gqa=True
            )
        return out.transpose(0, 1)


def _prefix_causal_mask(query_len: int, seq_len: int, device: torch.device) -> torch.Tensor:
    """Query row i sits at position seq_len - query_len + i and sees keys up to it."""
    query_pos = torch.arange(seq_len - query_len, seq_len, device=device).unsqueeze(1)
    key_pos = torch.arange(seq_len, device=device).unsqueeze(0)
    return key_pos <= query_pos  # [query_len, seq_len]


def select_attention_backend(device: torch.device) -> AttentionBackend:
    """The one place that picks the attention implementation for a device."""
    if device.type == "cuda":
        from shared.model.triton_attention import TritonPagedAttention

        return TritonPagedAttention()
    return TorchPagedAttention()
