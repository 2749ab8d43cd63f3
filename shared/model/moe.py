"""The fused mixture-of-experts step: route, sort by expert, one product per expert, combine.

    router logits [T, E] -> top-k experts and weights per token         (route_tokens)
    T*k assignments sorted by expert: expert e owns one contiguous slice (sort_by_expert)
    per expert: x[slice] @ gate_up[e].T -> SwiGLU -> @ down[e].T * weight (a grouped GEMM)
    combine: out.index_add_(0, token_of_assignment, expert_outputs)

No per-token Python loop: the CPU path loops over the experts that received tokens (one batched
matmul each), the CUDA path runs every expert's product in one Triton launch
(`kernels/moe_gemm.py`). `select_moe_experts` is the one place that picks between them.

Expert weights are stacked, gate and up fused: gate_up [E, 2*I, H], down [E, H, I]. The
sort-then-combine split is also where expert parallelism sits (shared/parallel/expert_parallel.py,
docs/moe.md): a rank holds a contiguous range of experts, the sorted slices are what an
all-to-all dispatches, and the combine runs after the reverse all-to-all.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from splitserve.engine.model.linear import linear

_BACKEND_ENV = "SPLITSERVE_MOE_BACKEND"


@dataclass(frozen=True)
class Routing:
    """Each token's chosen experts and their weights."""

    expert_ids: torch.Tensor  # [num_tokens, top_k] int64
    weights: torch.Tensor  # [num_tokens, top_k] in the activations' dtype


@dataclass(frozen=True)
class ExpertOrder:
    """The T*k token-expert assignments sorted by expert (stable, so by token within one)."""

    token_ids: torch.Tensor  # [T*k] the token (row of the input) of each sorted assignment
    weights: torch.Tensor  # [T*k] its routing weight
    counts: torch.Tensor  # [num_experts] int64 assignments per expert
    offsets: torch.Tensor  # [num_experts + 1] int64: expert e owns offsets[e]:offsets[e + 1]


def route_tokens(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> Routing:
    """Softmax over all experts in float32, keep the top k; with `renormalize` (Mixtral, and
    Qwen2-MoE's norm_topk_prob) the k kept probabilities are scaled to sum to 1."""
    probs = torch.softmax(router_logits.float(), dim=-1)  # [T, E]
    weights, expert_ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return Routing(expert_ids, weights.to(router_logits.dtype))


def route_grouped(
    router_logits: torch.Tensor,
    top_k: int,
    num_groups: int,
    topk_groups: int,
    scaling_factor: float,
) -> Routing:
    """DeepSeek's routing: softmax over all experts in float32; with num_groups > 1
    ("group_limited_greedy") only the experts of the `topk_groups` groups whose best expert
    scores highest stay candidates; the top k of those, their probabilities (not renormalised)
    times `scaling_factor`. num_groups 1 is DeepSeek's "greedy"."""
    probs = torch.softmax(router_logits.float(), dim=-1)  # [T, E]
    if num_groups > 1:
        grouped = probs.unflatten(-1, (num_groups, -1))  # [T, G, E / G]
        best_groups = torch.topk(grouped.amax(dim=-1), topk_groups, dim=-1).indices  # [T, g]
        kept = torch.zeros(grouped.shape[:2], dtype=torch.bool, device=probs.device)
        kept.scatter_(1, best_groups, True)
        probs = grouped.masked_fill(~kept.unsqueeze(-1), 0.0).flatten(1)
    weights, expert_ids = torch.topk(probs, top_k, dim=-1)
    return Routing(expert_ids, (weights * scaling_factor).to(router_logits.dtype))


def route_biased_groups(
    router_logits: torch.Tensor,
    choice_bias: torch.Tensor,
    top_k: int,
    num_groups: int,
    topk_groups: int,
    scaling_factor: float,
    renormalize: bool,
) -> Routing:
    """DeepSeek-V3's "noaux_tc" routing, in float32: sigmoid scores; the choice is made on
    the scores plus `choice_bias` (its load-balancing bias, learned without an auxiliary loss),
    within the `topk_groups` groups whose two best experts sum highest; the weights are the
    chosen experts' plain scores, scaled to sum to 1 with `renormalize`, times
    `scaling_factor`."""
    scores = torch.sigmoid(router_logits.float())  # [T, E]
    for_choice = scores + choice_bias.float()
    if num_groups > 1:
        grouped = for_choice.unflatten(-1, (num_groups, -1))  # [T, G, E / G]
        group_scores = torch.topk(grouped, 2, dim=-1).values.sum(dim=-1)  # [T, G]
        best_groups = torch.topk(group_scores, topk_groups, dim=-1).indices
        kept = torch.zeros(grouped.shape[:2], dtype=torch.bool, device=scores.device)
        kept.scatter_(1, best_groups, True)
        for_choice = grouped.masked_fill(~kept.unsqueeze(-1), float("-inf")).flatten(1)
    expert_ids = torch.topk(for_choice, top_k, dim=-1).indices
    weights = scores.gather(1, expert_ids)
    if renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return Routing(expert_ids, (weights * scaling_factor).to(router_logits.dtype))


def sort_by_expert(routing: Routing, num_experts: int) -> ExpertOrder:
    flat_ids = routing.expert_ids.flatten()  # [T*k], assignment a is token a // k
    order = torch.argsort(flat_ids, stable=True)
    top_k = routing.expert_ids.shape[1]
    counts = torch.bincount(flat_ids, minlength=num_experts)
    offsets = torch.zeros(num_experts + 1, dtype=torch.int64, device=counts.device)
    torch.cumsum(counts, 0, out=offsets[1:])
    return ExpertOrder(order // top_k, routing.weights.flatten()[order], counts, offsets)


@dataclass
class ExpertWeights:
    """One layer's experts; `*_onednn` are per-expert oneDNN layouts on the CPU (see
    shared/model/linear.py), None where F.linear is used."""

    gate_up: torch.Tensor  # [E_local, 2*I, H]
    down: torch.Tensor  # [E_local, H, I]
    # The experts held are first_expert .. first_expert + E_local - 1 (all of them, or a
    # contiguous range per rank under expert parallelism, docs/moe.md).
    first_expert: int = 0
    gate_up_onednn: list[torch.Tensor | None] | None = None
    down_onednn: list[torch.Tensor | None] | None = None


ExpertsFn = Callable[[torch.Tensor, ExpertWeights, ExpertOrder], torch.Tensor]


def torch_experts(hidden: torch.Tensor, experts: ExpertWeights, order: ExpertOrder) -> torch.Tensor:
    """The CPU path: one SwiGLU product per expert over its slice, combined with index_add_.
    hidden: [T, H] -> [T, H]. Reads the counts on the host (one sync, free on the CPU)."""
    out = torch.zeros_like(hidden)
    intermediate = experts.down.shape[2]
    bounds = order.offsets.tolist()
    for local in range(experts.gate_up.shape[0]):
        start, end = bounds[experts.first_expert + local], bounds[experts.first_expert + local + 1]
        if start == end:
            continue
        rows = order.token_ids[start:end]
        gate_up = linear(hidden[rows], experts.gate_up[local], _nth(experts.gate_up_onednn, local))
        gate, up = gate_up.split(intermediate, dim=-1)
        down = linear(F.silu(gate) * up, experts.down[local], _nth(experts.down_onednn, local))
        out.index_add_(0, rows, down * order.weights[start:end, None])
    return out


def triton_experts(
    hidden: torch.Tensor, experts: ExpertWeights, order: ExpertOrder
) -> torch.Tensor:
    """The CUDA path: the sorted rows through two grouped GEMMs (the routing weight applied in
    the second one's epilogue), then the same combine. No host sync. When the layer holds only
    a range of the experts, rows of the others are left out of the combine (their sum is what
    the other ranks add)."""
    from splitserve.kernels.moe_gemm import grouped_gemm  # optional: Triton, CUDA path only

    first, num_local = experts.first_expert, experts.gate_up.shape[0]
    offsets = order.offsets[first : first + num_local + 1]  # absolute rows: no rebasing
    sorted_rows = hidden[order.token_ids]  # [T*k, H]
    gate_up = grouped_gemm(sorted_rows, experts.gate_up, offsets)  # [T*k, 2*I]
    gate, up = gate_up.split(experts.down.shape[2], dim=-1)
    down = grouped_gemm(F.silu(gate) * up, experts.down, offsets, order.weights)
    if num_local != order.counts.shape[0]:  # rows outside the range were never written
        rows = torch.arange(down.shape[0], device=down.device)
        held = (rows >= offsets[0]) & (rows < offsets[-1])
        down = torch.where(held[:, None], down, 0.0)
    out = torch.zeros_like(hidden)
    out.index_add_(0, order.token_ids, down)
    return out


def select_moe_experts(device: torch.device) -> ExpertsFn:
    """Triton on CUDA, PyTorch elsewhere; SPLITSERVE_MOE_BACKEND=triton|torch overrides it (the
    tests run the Triton path on the CPU under TRITON_INTERPRET=1), as
    SPLITSERVE_ATTENTION_BACKEND does for attention (shared/model/attention_backend.py)."""
    choice = os.environ.get(_BACKEND_ENV, "")
    if choice not in ("", "triton", "torch"):
        raise ValueError(f"{_BACKEND_ENV} must be 'triton' or 'torch', got {choice!r}")
    if choice == "triton" or (not choice and device.type == "cuda"):
        return triton_experts
    return torch_experts


def _nth(items: list[torch.Tensor | None] | None, index: int) -> torch.Tensor | None:
    return None if items is None else items[index]


def naive_experts(hidden: torch.Tensor, experts: ExpertWeights, routing: Routing) -> torch.Tensor:
    """The definition, one token and one chosen expert at a time (a per-token Python loop):
    what the tests check the fused paths against and the benchmark's baseline."""
    out = torch.zeros_like(hidden)
    intermediate = experts.down.shape[2]
    for token in range(hidden.shape[0]):
        for slot in range(routing.expert_ids.shape[1]):
            local = int(routing.expert_ids[token, slot]) - experts.first_expert
            gate, up = F.linear(hidden[token], experts.gate_up[local]).split(intermediate)
            down = F.linear(F.silu(gate) * up, experts.down[local])
            out[token] += routing.weights[token, slot] * down
    return out
