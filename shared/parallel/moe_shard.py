"""Which part of a mixture-of-experts layer each tensor-parallel rank holds.

    enable_expert_parallel   rank r of n: experts [r*E/n, (r+1)*E/n), whole; rows dispatched
                             to them and back by all-to-all (shared/parallel/expert_parallel.py)
    otherwise (TP MoE)       every expert, intermediate rows [r*I/n, (r+1)*I/n) of gate/up and
                             those columns of down: each rank's partial output, summed
    both                     the router whole on every rank; a shared expert (Qwen2-MoE)
                             tensor-parallel like a dense MLP

Either way the block ends in one all-reduce of [T, H], as a dense layer's MLP does. Attention
is split by heads as for dense models (shared/parallel/layout.py).

Expert parallel's rows move by all-to-all by default. SPLITSERVE_EXPERT_DISPATCH=all_reduce
picks the scheme tensor-parallel attention allows instead: every rank routes every row, runs
its own experts on the rows routed to them, and the block's all-reduce sums the ranks' shares
(no rows move; docs/moe.md says when each pays off). benchmarks/moe_parallel.py compares them.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

import torch

from splitserve.engine.model.architecture import MoEConfig
from splitserve.engine.model.feed_forward import hf_expert_names, hf_shared_expert_prefix

DISPATCH_ENV = "SPLITSERVE_EXPERT_DISPATCH"
_DISPATCHES = ("all_to_all", "all_reduce")


def expert_dispatch() -> str:
    """How expert parallel exchanges rows: SPLITSERVE_EXPERT_DISPATCH, all_to_all by default.
    Every rank reads it (the ranks inherit rank 0's environment), so they agree."""
    choice = os.environ.get(DISPATCH_ENV, "") or "all_to_all"
    if choice not in _DISPATCHES:
        raise ValueError(f"{DISPATCH_ENV} must be one of {', '.join(_DISPATCHES)}, got {choice!r}")
    return choice


def check_moe_parallel(tp_size: int, moe: MoEConfig, expert_parallel: bool) -> None:
    """Raises ValueError naming the numbers when `tp_size` ranks cannot split these experts."""
    if expert_parallel and moe.num_experts % tp_size:
        raise ValueError(
            f"enable_expert_parallel: the model's {moe.num_experts} experts are not divisible "
            f"by tensor_parallel_size {tp_size} (each rank holds an equal range)"
        )
    if not expert_parallel and moe.expert_intermediate_size % tp_size:
        raise ValueError(
            f"tensor_parallel_size {tp_size} must divide the experts' intermediate size "
            f"{moe.expert_intermediate_size} (or set enable_expert_parallel to split the "
            "experts themselves)"
        )
    if moe.shared_expert_intermediate_size % tp_size:
        raise ValueError(
            f"tensor_parallel_size {tp_size} must divide the shared expert's intermediate size "
            f"{moe.shared_expert_intermediate_size}"
        )


@dataclass(frozen=True)
class MoeShard:
    """Rank `rank`'s part of every MoE layer (see the module docstring)."""

    tp_size: int
    rank: int
    expert_parallel: bool
    family: str
    moe: MoEConfig  # the whole model's
    dispatch: str = "all_to_all"  # expert parallel's exchange (expert_dispatch)

    @property
    def uses_all_to_all(self) -> bool:
        return self.expert_parallel and self.dispatch == "all_to_all"

    @property
    def experts(self) -> range:
        """The experts this rank holds weights of."""
        if not self.expert_parallel:
            return range(self.moe.num_experts)
        per_rank = self.moe.num_experts // self.tp_size
        return range(self.rank * per_rank, (self.rank + 1) * per_rank)

    def local_moe(self) -> MoEConfig:
        """The MoE config this rank's model is built with."""
        shared = self.moe.shared_expert_intermediate_size // self.tp_size
        if self.expert_parallel:
            first, count = self.experts.start, len(self.experts)
            return dataclasses.replace(
                self.moe,
                shared_expert_intermediate_size=shared,
                first_local_expert=first,
                num_local_experts=count,
            )
        inter = self.moe.expert_intermediate_size // self.tp_size
        return dataclasses.replace(
            self.moe, expert_intermediate_size=inter, shared_expert_intermediate_size=shared
        )

    def shard_layer(self, out: dict[str, torch.Tensor], layer: int) -> None:
        """This rank's slices of layer `layer`'s HF-named feed-forward tensors, into `out`
        (views). Under expert parallel the experts stay whole: the model reads only its own."""
        prefix = f"model.layers.{layer}."
        if not self.expert_parallel:
            for expert in self.experts:
                names = hf_expert_names(self.family, expert)
                self._shard_swiglu(out, prefix, names, self.moe.expert_intermediate_size)
        if self.moe.shared_expert_intermediate_size:
            shared = hf_shared_expert_prefix(self.family)  # Qwen2-MoE's one, DeepSeek's several
            names = {part: f"{shared}{part}_proj" for part in ("gate", "up", "down")}
            self._shard_swiglu(out, prefix, names, self.moe.shared_expert_intermediate_size)

    def _shard_swiglu(
        self, out: dict[str, torch.Tensor], prefix: str, names: dict[str, str], inter: int
    ) -> None:
        per_rank = inter // self.tp_size
        rows = slice(self.rank * per_rank, (self.rank + 1) * per_rank)
        for part in ("gate", "up"):
            name = f"{prefix}{names[part]}.weight"
            out[name] = out[name][rows]
        name = f"{prefix}{names['down']}.weight"
        out[name] = out[name][:, rows]
