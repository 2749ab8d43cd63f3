"""KV pages of a tensor-parallel engine in and out of the one wire layout every pod speaks.

Between pods, pages always travel in the model's own layout: `[num_blocks, num_layers, 2,
block_size, num_kv_heads, head_dim]` with every KV head of the model once, in model order; the
same bytes a TP=1 pod packs. So the descriptor's `num_kv_heads` is the model's, any sender
layout meets any receiver layout, and replicated heads never travel twice:

    sender (TP=n)   each rank packs its heads -> gather on rank 0 -> place by model head
    receiver (TP=m) rank 0 cuts each rank's heads (replicas included) -> scatter -> unpack

A TP=1 pod does neither step (`shared.disaggregation.LocalPages`).
"""

from __future__ import annotations

import torch

from shared.disaggregation import pack_pages, unpack_pages
from shared.parallel.comm import Communicator
from shared.parallel.group import TensorParallelGroup
from shared.parallel.layout import TensorParallelLayout
from shared.parallel.ops import Opcode, send

_HEADS_DIM = 4  # of a packed page buffer


class TensorParallelPages:
    """Rank 0's page I/O for the whole pod (the interface of `LocalPages`). Engine thread only:
    each call is a collective, between two steps."""

    def __init__(self, group: TensorParallelGroup, kv_cache: torch.Tensor) -> None:
        self.group = group
        self.layout = group.layout
        self.kv_cache = kv_cache  # rank 0's heads

    def shape(self, num_blocks: int) -> tuple[int, ...]:
        """The wire shape: the model's KV heads, not this rank's."""
        num_layers, _, _, block_size, _, head_dim = self.kv_cache.shape
        return (num_blocks, num_layers, 2, block_size, self.layout.num_kv_heads, head_dim)

    def pack(self, block_ids: list[int]) -> torch.Tensor:
        return self.group.guard(lambda: self._pack(block_ids))

    def _pack(self, block_ids: list[int]) -> torch.Tensor:
        ids = torch.tensor(block_ids, dtype=torch.int64)
        send(self.group.comm, Opcode.GATHER_PAGES, ids, count=len(block_ids))
        parts = self.group.comm.gather_to_first(pack_pages(self.kv_cache, block_ids))
        assert parts is not None, "rank 0 receives the gather"
        return join_heads(parts, self.layout)

    def unpack(self, pages: torch.Tensor, block_ids: list[int]) -> None:
        self.group.guard(lambda: self._unpack(pages, block_ids))

    def _unpack(self, pages: torch.Tensor, block_ids: list[int]) -> None:
        ids = torch.tensor(block_ids, dtype=torch.int64)
        send(self.group.comm, Opcode.SCATTER_PAGES, ids, count=len(block_ids))
        parts = split_heads(pages.to(self.kv_cache.device), self.layout)
        mine = torch.empty_like(parts[0])
        self.group.comm.scatter_from_first(parts, mine)
        unpack_pages(mine, self.kv_cache, block_ids)


def split_heads(pages: torch.Tensor, layout: TensorParallelLayout) -> list[torch.Tensor]:
    """Wire-layout pages -> each rank's heads (contiguous), in rank order."""
    return [
        pages[..., heads.start : heads.stop, :].contiguous()
        for heads in map(layout.kv_heads_of, range(layout.tp_size))
    ]


def join_heads(parts: list[torch.Tensor], layout: TensorParallelLayout) -> torch.Tensor:
    """Each rank's packed pages -> wire layout (a replicated head is taken once)."""
    shape = list(parts[0].shape)
    shape[_HEADS_DIM] = layout.num_kv_heads
    pages = torch.empty(shape, dtype=parts[0].dtype, device=parts[0].device)
    for rank, part in enumerate(parts):
        heads = layout.kv_heads_of(rank)
        pages[..., heads.start : heads.stop, :] = part
    return pages


# ---- the other ranks' side (shared.parallel.ops.run_page_op) --------------------------------


def gather_pages(comm: Communicator, kv_cache: torch.Tensor, block_ids: torch.Tensor) -> None:
    comm.gather_to_first(pack_pages(kv_cache, block_ids.tolist()))


def scatter_pages(comm: Communicator, kv_cache: torch.Tensor, block_ids: torch.Tensor) -> None:
    num_layers, _, _, block_size, num_heads, head_dim = kv_cache.shape
    mine = torch.empty(
        (block_ids.numel(), num_layers, 2, block_size, num_heads, head_dim),
        dtype=kv_cache.dtype,
        device=kv_cache.device,
    )
    comm.scatter_from_first(None, mine)
    unpack_pages(mine, kv_cache, block_ids.tolist())
