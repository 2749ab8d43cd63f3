"""Attention over the paged KV cache: the per-step metadata and the PyTorch (CPU) path.

The batch is flattened and ordered decodes first:

    | decode tokens (1 per seq) | prefill chunk of seq a | prefill chunk of seq b | ...
    0                    num_decodes

Decodes attend in a few padded, batched calls, one per group of similar context lengths
(`splitserve.engine.model.decode_groups`); each prefill chunk attends causally to its cached prefix
plus
itself. `splitserve.engine.model.attention_backend.select_attention_backend` picks this path or the
Triton kernels; both read the same cache layout:
`kv_cache[layer]` is `[2, num_blocks, block_size, num_kv_heads, head_dim]`, or with
`kv_cache_dtype="int8"` int8 rows of `head_dim + 2` (codes then a bfloat16 scale,
`splitserve.kernels.kv_int8`): the write quantizes, the gather dequantizes to the query's dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from splitserve.engine.model.attention_metadata import AttentionMetadata, PrefillChunk
from splitserve.engine.model.decode_groups import DecodeGroup
from splitserve.kernels import cpu as cpu_kernels
from splitserve.kernels import kv_int8


class TorchPagedAttention:
    """Attention for the CPU. Decodes go to the C++ kernel that reads the paged cache in place
    (`splitserve.kernels.cpu`, float32 or int8 rows) when the runner built decode block tables for
    it;
    otherwise, and for prefill chunks, each sequence's blocks are copied into one reused buffer
    for SDPA (an int8 cache's rows dequantized into a second one).

    Whole blocks are gathered (per kv head, one run of block_size * head_dim values written
    contiguously), not single slots: far fewer, longer copies. The buffer is kept across layers
    and steps because a fresh multi-megabyte tensor per layer costs its page faults every time.
    """

    uses_block_tables = False
    takes_window_and_softcap = False  # SDPA takes neither: masked_attention.py serves them

    def __init__(self, dtype: torch.dtype = torch.float32) -> None:
        self._buffer = torch.empty(0)
        self._values = torch.empty(0)  # an int8 cache's gathered rows, dequantized
        # Decodes read the cache in place where the C++ kernel built: float32 caches, and int8
        # ones, whose codes it reads with their scales (it computes in float32 either way).
        in_place_dtypes = (torch.float32, torch.int8)
        self._kernels = cpu_kernels.load()
        self.reads_decodes_in_place = dtype in in_place_dtypes and self._kernels is not None
        self._writes_int8 = dtype == torch.int8 and self._kernels is not None

    def write_kv(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        layer_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> None:
        # key, value: [num_tokens, num_kv_heads, head_dim]
        if kv_int8.is_int8_cache(layer_cache):
            if self._writes_int8 and key.dtype == torch.float32:
                # The C++ write quantizes straight into the slots (kernels/cpu).
                cpu_kernels.write_kv_int8(key, value, layer_cache, meta.slot_mapping)
                return
            # Keys and values quantized in one go: half the (small, per-layer) ops.
            key, value = kv_int8.quantize_rows(torch.cat((key, value))).chunk(2)
        num_kv_heads, row = key.shape[1], key.shape[2]
        flat = layer_cache.view(2, -1, num_kv_heads, row)
        flat[0].index_copy_(0, meta.slot_mapping, key)
        flat[1].index_copy_(0, meta.slot_mapping, value)

    def attend(
        self,
        query: torch.Tensor,
        layer_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        window: int = 0,
        softcap: float = 0.0,
    ) -> torch.Tensor:
        # query: [num_tokens, num_heads, head_dim] -> same shape out
        if window or softcap:  # takes_window_and_softcap is False: callers go elsewhere
            raise ValueError("the PyTorch attention path takes no window or soft-cap")
        out = torch.empty_like(query)
        if meta.num_decodes:
            out[: meta.num_decodes] = self._decode(
                query[: meta.num_decodes], layer_cache, meta, scale
            )
        for chunk in meta.prefills:
            rows = slice(chunk.query_start, chunk.query_start + chunk.query_len)
            out[rows] = self._prefill(query[rows], layer_cache, chunk, scale)
        return out

    def _gather_blocks(
        self, layer_cache: torch.Tensor, block_ids: torch.Tensor, dtype: torch.dtype
    ) -> torch.Tensor:
        """[2, num_kv_heads, len(block_ids) * block_size, head_dim], valid until the next call;
        an int8 cache's rows come back dequantized to `dtype`.

        Heads come first so each head's positions are contiguous, the layout SDPA reads
        fastest; the gather writes that layout directly (it reads head_dim-long runs instead of
        whole blocks, which measured no slower: docs/benchmarks.md)."""
        _, _, block_size, num_kv_heads, head_dim = layer_cache.shape
        by_head = layer_cache.permute(0, 3, 1, 2, 4)  # [2, kv_heads, blocks, block_size, dim]
        shape = (2, num_kv_heads, block_ids.shape[0], block_size, head_dim)
        numel = 2 * block_ids.shape[0] * block_size * num_kv_heads * head_dim
        buffer = self._buffer
        if (
            buffer.numel() < numel
            or buffer.dtype != layer_cache.dtype
            or buffer.device != layer_cache.device
        ):
            self._buffer = torch.empty(numel, dtype=layer_cache.dtype, device=layer_cache.device)
        gathered = self._buffer[:numel].view(shape)
        torch.index_select(by_head, 2, block_ids, out=gathered)
        gathered = gathered.view(2, num_kv_heads, -1, head_dim)
        if kv_int8.is_int8_cache(layer_cache):
            return self._dequantize(gathered, dtype)
        return gathered

    def _dequantize(self, rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Gathered int8 rows -> values in a second reused buffer: one more pass over the
        gathered bytes, the price of reading an int8 cache on this path."""
        codes, scales = kv_int8.split_rows(rows)
        if self._values.numel() < codes.numel() or self._values.dtype != dtype:
            self._values = torch.empty(codes.numel(), dtype=dtype, device=rows.device)
        values = self._values[: codes.numel()].view(codes.shape)
        values.copy_(codes)
        return values.mul_(scales)

    def _decode(
        self, query: torch.Tensor, layer_cache: torch.Tensor, meta: AttentionMetadata, scale: float
    ) -> torch.Tensor:
        # query: [num_decodes, num_heads, head_dim]
        if meta.decode_block_tables is not None:
            # A bfloat16 model over an int8 cache: the kernel takes float32 queries (a few
            # rows per step to convert). Called unchecked: the runner builds these tensors, the
            # kernel checks lengths and block ids, and splitserve.kernels.cpu's argument checks
            # cost more
            # than a short batch's attention.
            assert self._kernels is not None, "in-place decode tables need the CPU kernels"
            out = self._kernels.paged_decode_attention(
                query.float().contiguous(),
                layer_cache[0],
                layer_cache[1],
                meta.decode_block_tables,
                meta.decode_seq_lens,
                scale,
            )
            return out.to(query.dtype)
        assert meta.decode_groups, "the runner builds decode groups or tables for this backend"
        if len(meta.decode_groups) == 1:
            return self._decode_group(query, layer_cache, meta.decode_groups[0], scale)
        out = torch.empty_like(query)
        for group in meta.decode_groups:
            rows = group.rows
            assert rows is not None, "only a lone group covers the rows implicitly"
            group_out = self._decode_group(query.index_select(0, rows), layer_cache, group, scale)
            out.index_copy_(0, rows, group_out)
        return out

    def _decode_group(
        self, query: torch.Tensor, layer_cache: torch.Tensor, group: DecodeGroup, scale: float
    ) -> torch.Tensor:
        num_rows = query.shape[0]
        kv = self._gather_blocks(layer_cache, group.block_ids, query.dtype)
        # [2, kv_heads, num_rows * max_len, dim] -> [2, num_rows, kv_heads, max_len, dim]
        kv = kv.view(2, kv.shape[1], num_rows, -1, kv.shape[-1]).transpose(1, 2)
        out = F.scaled_dot_product_attention(
            query.unsqueeze(2),
            kv[0],
            kv[1],
            attn_mask=group.mask,
            scale=scale,
            enable_gqa=True,
        )
        return out.squeeze(2)

    def _prefill(
        self, query: torch.Tensor, layer_cache: torch.Tensor, chunk: PrefillChunk, scale: float
    ) -> torch.Tensor:
        kv = self._gather_blocks(layer_cache, chunk.block_ids, query.dtype)[:, :, : chunk.seq_len]
        # A batch dimension of 1 throughout: with 3-D inputs SDPA on the CPU falls back to its
        # unfused math path, which measured 3x slower on a 512-token chunk than the fused one.
        keys, values = kv[0, None], kv[1, None]  # [1, num_kv_heads, seq_len, head_dim]
        q = query.transpose(0, 1).unsqueeze(0)  # [1, num_heads, query_len, head_dim]
        if chunk.seq_len == chunk.query_len:
            out = F.scaled_dot_product_attention(
                q, keys, values, is_causal=True, scale=scale, enable_gqa=True
            )
        else:
            mask = _prefix_causal_mask(chunk.query_len, chunk.seq_len, query.device)
            out = F.scaled_dot_product_attention(
                q, keys, values, attn_mask=mask, scale=scale, enable_gqa=True
            )
        return out[0].transpose(0, 1)


def _prefix_causal_mask(query_len: int, seq_len: int, device: torch.device) -> torch.Tensor:
    """Query row i sits at position seq_len - query_len + i and sees keys up to it."""
    query_pos = torch.arange(seq_len - query_len, seq_len, device=device).unsqueeze(1)
    key_pos = torch.arange(seq_len, device=device).unsqueeze(0)
    return key_pos <= query_pos  # [query_len, seq_len]
