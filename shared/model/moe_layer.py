"""The sparse feed-forward block of Mixtral, Qwen2-MoE and DeepSeek decoder layers (`mlp`).

    x [T, H] -> router (`gate`) -> top-k routing -> fused experts (shared/model/moe.py)
             (+ Qwen2-MoE: sigmoid(shared_expert_gate(x)) * shared_expert(x))
             (+ DeepSeek: shared_expert(x), ungated; grouped top-k routing, scaled weights)

Parameter names are the internal ones `shared/model/feed_forward.py` maps checkpoints onto.
Each block counts the token-expert assignments its router made, per expert, since start: the
load imbalance that expert parallelism suffers from shows there first (`expert_token_counts`,
EngineStats.moe_expert_tokens, the pods' splitserve:moe_expert_tokens_total).

Parallel (shared/parallel/moe_shard.py): under tensor parallelism each rank's block holds a
slice of every expert's (and the shared expert's) intermediate size and the output is summed
over the ranks (`tensor_parallel`); under expert parallelism it holds a range of the experts
and `expert_parallel` dispatches rows to the ranks holding their experts and back.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from splitserve.engine.model.architecture import ModelArchitecture
from splitserve.engine.model.linear import Linear, onednn_weight
from splitserve.engine.model.moe import (
    ExpertsFn,
    ExpertWeights,
    Routing,
    route_biased_groups,
    route_grouped,
    route_tokens,
    select_moe_experts,
    sort_by_expert,
)


class SumOverRanks(Protocol):
    """Sums a tensor over the tensor-parallel ranks in place (shared/parallel/comm.py)."""

    def all_reduce(self, tensor: torch.Tensor) -> None: ...


class ExpertDispatch(Protocol):
    """Expert parallel: the routed experts' output for this rank's share of the rows, with the
    rows of other experts computed on the ranks holding them (shared/parallel/expert_parallel.py).
    """

    def run(
        self,
        x: torch.Tensor,
        route: Callable[[torch.Tensor], Routing],
        experts: ExpertWeights,
        experts_fn: ExpertsFn,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, H] (every rank the same) -> ([T, H] this rank's rows' outputs, zero on the
        other rows; [E] int64 assignments per expert over every rank's rows)."""
        ...


class SwiGLU(nn.Module):
    """A dense SwiGLU MLP (Qwen2-MoE's shared expert), gate and up fused as in LlamaMLP."""

    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.intermediate_size = intermediate_size
        self.gate_up_proj = Linear(hidden_size, 2 * intermediate_size)
        self.down_proj = Linear(intermediate_size, hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.intermediate_size, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class SparseMoeBlock(nn.Module):
    # Tensor parallel: the experts' (or, with expert parallel, the rows') partial outputs and
    # the shared expert's are summed over the ranks by one all-reduce.
    tensor_parallel: SumOverRanks | None = None
    expert_parallel: ExpertDispatch | None = None

    def __init__(self, arch: ModelArchitecture) -> None:
        super().__init__()
        moe = arch.moe
        assert moe is not None, "SparseMoeBlock needs an architecture with moe set"
        self.num_experts = moe.num_experts
        self.top_k = moe.num_experts_per_tok
        self.renormalize = moe.norm_topk_prob
        self.moe = moe
        hidden, inter = arch.hidden_size, moe.expert_intermediate_size
        self.gate = Linear(hidden, moe.num_experts)  # the router, over every expert
        # DeepSeek-V3's per-expert bias on the routing choice (not on the weights).
        self.router_bias = _parameter(moe.num_experts) if moe.topk_method == "noaux_tc" else None
        # Stacked experts held here, gate and up fused: [E_local, 2*I, H] and [E_local, H, I].
        self.local_experts = moe.local_experts
        num_local = len(self.local_experts)
        self.experts_gate_up = _parameter(num_local, 2 * inter, hidden)
        self.experts_down = _parameter(num_local, hidden, inter)
        self.shared_expert: SwiGLU | None = None
        self.shared_expert_gate: Linear | None = None
        if moe.shared_expert_intermediate_size:
            self.shared_expert = SwiGLU(hidden, moe.shared_expert_intermediate_size)
            self.shared_expert_gate = Linear(hidden, 1) if moe.shared_expert_gated else None
        # Built on the first forward, after the weights are loaded (the model is built on the
        # meta device): the experts' view with CPU layouts, the implementation, the counters.
        self._experts: ExpertWeights | None = None
        self._experts_fn: ExpertsFn | None = None
        self.expert_tokens: torch.Tensor | None = None  # [E] int64, cumulative

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        experts, experts_fn = self._prepared(x.device)
        assert self.expert_tokens is not None, "_prepared builds the counters with the experts"
        if self.expert_parallel is not None:
            out, counts = self.expert_parallel.run(x, self.route, experts, experts_fn)
        else:
            order = sort_by_expert(self.route(x), self.num_experts)
            out, counts = experts_fn(x, experts, order), order.counts
        self.expert_tokens += counts
        if self.shared_expert is not None:
            shared = self.shared_expert(x)
            if self.shared_expert_gate is not None:  # Qwen2-MoE's; DeepSeek's are ungated
                shared = torch.sigmoid(self.shared_expert_gate(x)) * shared
            out = out + shared
        if self.tensor_parallel is not None:
            self.tensor_parallel.all_reduce(out)
        return out

    def route(self, x: torch.Tensor) -> Routing:
        """Each row's top-k experts and weights (the router holds every expert)."""
        moe = self.moe
        if self.router_bias is not None:  # DeepSeek-V3
            return route_biased_groups(
                self.gate(x),
                self.router_bias,
                self.top_k,
                moe.num_groups,
                moe.topk_groups,
                moe.routed_scaling_factor,
                self.renormalize,
            )
        if moe.topk_method is not None:  # DeepSeek-V2
            groups = moe.num_groups if moe.topk_method == "group_limited_greedy" else 1
            return route_grouped(
                self.gate(x), self.top_k, groups, moe.topk_groups, moe.routed_scaling_factor
            )
        return route_tokens(self.gate(x), self.top_k, self.renormalize)

    def _prepared(self, device: torch.device) -> tuple[ExpertWeights, ExpertsFn]:
        if self._experts is None or self._experts_fn is None:
            self._experts_fn = select_moe_experts(device)
            self._experts = prepare_expert_weights(
                self.experts_gate_up, self.experts_down, self.local_experts.start
            )
            self.expert_tokens = torch.zeros(self.num_experts, dtype=torch.int64, device=device)
        return self._experts, self._experts_fn


def moe_blocks(model: nn.Module) -> list[SparseMoeBlock]:
    """The model's MoE layers ([] for a dense model): found once, since the engine reads their
    counters after every step and walking every module each time would cost the step."""
    return [module for module in model.modules() if isinstance(module, SparseMoeBlock)]


def expert_token_counts(blocks: list[SparseMoeBlock]) -> tuple[int, ...]:
    """Token-expert assignments per expert index, summed over `blocks` (moe_blocks) since
    start; () for a dense model."""
    counters = [block.expert_tokens for block in blocks if block.expert_tokens is not None]
    if not counters:
        return ()
    return tuple(torch.stack(counters).sum(0).tolist())


def _parameter(*shape: int) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape), requires_grad=False)


def prepare_expert_weights(
    gate_up: torch.Tensor, down: torch.Tensor, first_expert: int = 0
) -> ExpertWeights:
    """Stacked experts as the fused step reads them: with one oneDNN layout per expert on the
    CPU (shared/model/linear.py says why; costs the experts' memory once more), none elsewhere."""
    gate_up_onednn = [onednn_weight(w) for w in gate_up]
    down_onednn = [onednn_weight(w) for w in down]
    has_onednn = gate_up_onednn and gate_up_onednn[0] is not None
    return ExpertWeights(
        gate_up,
        down,
        first_expert,
        gate_up_onednn=gate_up_onednn if has_onednn else None,
        down_onednn=down_onednn if has_onednn else None,
    )
