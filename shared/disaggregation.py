"""The engine's side of disaggregated serving: what a decode pod reserves for a remote prefill,
what comes back from the prefill pod, and moving KV pages in and out of the paged cache.

    decode pod                                   prefill pod
    reserve_remote_prefill -> RemotePrefillPlan  add_request(export_kv_from_block=k)
        (blocks allocated, cached prefix kept)       ... prefill, sample the first token
    <----- pages of blocks k.. + first token ----    final.kv_pages = pack_pages(...)
    complete_remote_prefill(RemotePrefillResult)
        (pages unpacked, joins the running batch)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from shared.sampler import TokenLogprobs


@dataclass(frozen=True)
class RemotePrefillPlan:
    """Where a prefill pod must put a request's prompt KV on this decode pod."""

    request_id: str
    num_cached_tokens: int  # prompt tokens this pod already holds (their blocks get no pages)
    first_block_index: int  # prompt block index of block_ids[0]
    block_ids: list[int]  # this pod's blocks for prompt blocks first_block_index, ...
    # [len(block_ids), num_layers, 2, block_size, num_kv_heads, head_dim]
    page_shape: tuple[int, ...]
    dtype: torch.dtype


@dataclass
class RemotePrefillResult:
    first_token_id: int
    first_logprobs: TokenLogprobs | None
    kv_pages: torch.Tensor  # RemotePrefillPlan.page_shape, on any device


def pack_pages(kv_cache: torch.Tensor, block_ids: list[int]) -> torch.Tensor:
    """Blocks' pages of every layer as one contiguous block-major buffer (a copy)."""
    if kv_cache.device.type == "cuda":
        from kernels import pack_kv_pages
    else:
        from kernels.reference import pack_kv_pages
    return pack_kv_pages(kv_cache, block_ids)


def unpack_pages(pages: torch.Tensor, kv_cache: torch.Tensor, block_ids: list[int]) -> None:
    """Writes a `pack_pages` buffer into `kv_cache` at `block_ids`; mutates kv_cache."""
    pages = pages.to(kv_cache.device)
    if kv_cache.device.type == "cuda":
        from kernels import unpack_kv_pages
    else:
        from kernels.reference import unpack_kv_pages
    unpack_kv_pages(pages, kv_cache, block_ids)


def page_shape(kv_cache: torch.Tensor, num_blocks: int) -> tuple[int, ...]:
    num_layers, _, _, block_size, num_kv_heads, head_dim = kv_cache.shape
    return (num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim)
