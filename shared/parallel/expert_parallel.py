"""Expert parallelism's dispatch and combine: each rank sends the rows routed to another
rank's experts there with an all-to-all, runs the fused step on the rows its own experts
received, and sends the results back with a second all-to-all.

With tensor-parallel attention every rank holds the whole batch's hidden states after the
attention all-reduce. Each rank therefore routes and dispatches only its share of the rows
(rank r of n: rows [r*T/n, (r+1)*T/n)), so no assignment is computed twice:

    rank r: its rows -> route -> sort by expert (= by destination rank)
      all-gather   per-expert counts [n, E]        every rank learns what it will receive
      all-to-all   the sorted rows                 rank d gets the rows of its experts
      fused step   on the received rows, by expert (torch_experts / triton_experts)
      all-to-all   the outputs, back in send order
      combine      * routing weight, index_add into its rows; zeros elsewhere
    SparseMoeBlock then adds the tensor-parallel shared expert's part, and its one all-reduce
    both sums that and assembles every rank's rows (x + 0 on the other ranks' rows: exact).

The counts travel by all-gather rather than all-to-all: the same bytes at this size, and every
rank then holds the whole step's per-expert load, which is what the counters report.
The weights are applied by the sender after the combine, so they never travel.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from splitserve.engine.model.moe import (
    ExpertOrder,
    ExpertsFn,
    ExpertWeights,
    Routing,
    sort_by_expert,
)
from splitserve.engine.parallel.comm import Communicator


class ExpertAllToAll:
    """One rank's dispatch for a model whose experts are split evenly over `comm`'s ranks
    (the block's `expert_parallel`, shared/model/moe_layer.py)."""

    def __init__(self, comm: Communicator, num_experts: int) -> None:
        assert num_experts % comm.world_size == 0, "checked by check_moe_parallel"
        self.comm = comm
        self.num_experts = num_experts
        self.experts_per_rank = num_experts // comm.world_size

    def run(
        self,
        x: torch.Tensor,
        route: Callable[[torch.Tensor], Routing],
        experts: ExpertWeights,
        experts_fn: ExpertsFn,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, H], the same on every rank -> (its rows' routed outputs [T, H], zero on the
        other ranks' rows; assignments per expert [E] over all rows)."""
        rows = token_share(x.shape[0], self.comm.world_size, self.comm.rank)
        mine = x[rows]  # [T_r, H]
        order = sort_by_expert(route(mine), self.num_experts)
        counts = self.comm.all_gather(order.counts)  # [n, E]: source rank, expert
        send_counts = order.counts.view(self.comm.world_size, -1).sum(1).tolist()
        local = self._local_columns(counts)  # [n, E_local]: from each source, per local expert
        receive_counts = local.sum(1).tolist()
        received = self.comm.all_to_all(mine[order.token_ids], send_counts, receive_counts)
        computed = received  # [0, H] when no row came for this rank's experts
        if received.shape[0]:
            computed = experts_fn(received, experts, self._received_order(local, received.dtype))
        returned = self.comm.all_to_all(computed, receive_counts, send_counts)  # send order
        out = torch.zeros_like(x)
        out[rows].index_add_(0, order.token_ids, returned * order.weights[:, None])
        return out, counts.sum(0)

    def _local_columns(self, counts: torch.Tensor) -> torch.Tensor:
        first = self.comm.rank * self.experts_per_rank
        return counts[:, first : first + self.experts_per_rank]

    def _received_order(self, local: torch.Tensor, dtype: torch.dtype) -> ExpertOrder:
        """The received rows (grouped by source rank, then by expert within each) as an
        ExpertOrder grouped by expert: what the fused step reads. Weights are 1: the sender
        applies them."""
        first = self.comm.rank * self.experts_per_rank
        local_ids = torch.arange(first, first + self.experts_per_rank, device=local.device)
        expert_of_row = local_ids.repeat(local.shape[0]).repeat_interleave(local.flatten())
        row_ids = torch.argsort(expert_of_row, stable=True)
        counts = torch.zeros(self.num_experts, dtype=torch.int64, device=local.device)
        counts[first : first + self.experts_per_rank] = local.sum(0)
        offsets = torch.zeros(self.num_experts + 1, dtype=torch.int64, device=local.device)
        torch.cumsum(counts, 0, out=offsets[1:])
        weights = torch.ones(row_ids.shape[0], dtype=dtype, device=local.device)
        return ExpertOrder(row_ids, weights, counts, offsets)


def token_share(num_tokens: int, world_size: int, rank: int) -> slice:
    """The rows rank `rank` routes: contiguous, sizes differing by at most one (empty for
    some ranks when there are fewer rows than ranks, as in a batch-1 decode)."""
    return slice(num_tokens * rank // world_size, num_tokens * (rank + 1) // world_size)
