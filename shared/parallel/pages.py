"""KV pages of a parallel engine in and out of the one wire layout every pod speaks.

Between pods, pages always travel in the model's own layout: `[num_blocks, num_layers, 2,
block_size, num_kv_heads, head_dim]` with every layer and every KV head of the model once, in
model order; the same bytes a single-process pod packs. So the descriptor's `num_layers` and
`num_kv_heads` are the model's, any sender layout meets any receiver layout, and replicated
heads never travel twice:

    sender (TP, PP or both)    each rank packs its part -> gather on rank 0 -> join
    receiver (TP, PP or both)  rank 0 cuts each rank's part (replicas included) -> scatter

The layout says how parts are cut and joined: by KV heads (`TensorParallelLayout`), by
layers (`PipelineLayout`), or by layers into stages and then by heads into each stage's ranks
(`GridLayout`). A single-process pod does none of these (`LocalPages`).

Both sides of each page collective live here, rank 0's (`ParallelPages`) and the other ranks'
(`run_page_op`, which their loop in worker.py calls), so the two stay in step.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol, TypeVar

import torch

from splitserve.engine.kv.disaggregation import pack_pages, unpack_pages
from splitserve.engine.parallel.comm import Communicator
from splitserve.engine.parallel.ops import Header, Opcode, send
from splitserve.engine.parallel.rank import RankLayout

T = TypeVar("T")


class RankZeroGroup(Protocol):
    """What page I/O needs of rank 0's `ParallelGroup` (group.py). A protocol: the group
    imports the other ranks' loop, which imports this module."""

    comm: Communicator
    layout: RankLayout

    def guard(self, action: Callable[[], T]) -> T: ...


class ParallelPages:
    """Rank 0's page I/O for the whole pod (the interface of `LocalPages`). Engine thread only:
    each call is a collective, between two steps."""

    def __init__(self, group: RankZeroGroup, kv_cache: torch.Tensor) -> None:
        self.group = group
        self.layout = group.layout
        self.kv_cache = kv_cache  # rank 0's part

    def shape(self, num_blocks: int) -> tuple[int, ...]:
        return self.layout.wire_shape(self.kv_cache, num_blocks)

    def pack(self, block_ids: list[int]) -> torch.Tensor:
        return self.group.guard(lambda: self._pack(block_ids))

    def _pack(self, block_ids: list[int]) -> torch.Tensor:
        if self.layout.page_copies > 1:  # rank 0's copy is the whole page: no gather
            return pack_pages(self.kv_cache, block_ids)
        ids = torch.tensor(block_ids, dtype=torch.int64)
        send(self.group.comm, Opcode.GATHER_PAGES, ids, count=len(block_ids))
        parts = self.group.comm.gather_to_first(pack_pages(self.kv_cache, block_ids))
        assert parts is not None, "rank 0 receives the gather"
        return self.layout.join_pages(parts)

    def unpack(self, pages: torch.Tensor, block_ids: list[int]) -> None:
        self.group.guard(lambda: self._unpack(pages, block_ids))

    def _unpack(self, pages: torch.Tensor, block_ids: list[int]) -> None:
        ids = torch.tensor(block_ids, dtype=torch.int64)
        send(self.group.comm, Opcode.SCATTER_PAGES, ids, count=len(block_ids))
        parts = self.layout.split_pages(pages.to(self.kv_cache.device))
        mine = torch.empty_like(parts[0])
        self.group.comm.scatter_from_first(parts, mine)
        unpack_pages(mine, self.kv_cache, block_ids)


# ---- the other ranks' side ---------------------------------------------------------------


def run_page_op(
    comm: Communicator, header: Header, payload: torch.Tensor, kv_cache: torch.Tensor
) -> None:
    """A rank's side of GATHER_PAGES / SCATTER_PAGES; `payload` holds the block ids."""
    if header.opcode == Opcode.GATHER_PAGES:
        gather_pages(comm, kv_cache, payload)
    elif header.opcode == Opcode.SCATTER_PAGES:
        scatter_pages(comm, kv_cache, payload)
    else:
        raise AssertionError(f"not a page opcode: {header.opcode}")


def gather_pages(comm: Communicator, kv_cache: torch.Tensor, block_ids: torch.Tensor) -> None:
    comm.gather_to_first(pack_pages(kv_cache, block_ids.tolist()))


def scatter_pages(comm: Communicator, kv_cache: torch.Tensor, block_ids: torch.Tensor) -> None:
    # num_parts: keys and values (2), or MLA's one latent row.
    num_layers, num_parts, _, block_size, num_heads, head_dim = kv_cache.shape
    mine = torch.empty(
        (block_ids.numel(), num_layers, num_parts, block_size, num_heads, head_dim),
        dtype=kv_cache.dtype,
        device=kv_cache.device,
    )
    comm.scatter_from_first(None, mine)
    unpack_pages(mine, kv_cache, block_ids.tolist())
