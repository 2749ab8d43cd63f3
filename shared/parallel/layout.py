"""Which part of the model each tensor-parallel rank holds (Megatron-style splits).

    rank r of tp:  query heads [r * H/tp, (r+1) * H/tp)
                   KV heads    [r * K/tp, (r+1) * K/tp)       when K >= tp
                   KV head     r // (tp/K), replicated         when K < tp (GQA)
                   gate/up rows and down columns [r * I/tp, (r+1) * I/tp)

With fewer KV heads than ranks, each KV head is held by tp/K ranks: exactly the ranks whose
query heads read it, so every rank attends locally and never needs another rank's KV.

qkv and gate/up are column-parallel (each rank computes its own output columns from the full
hidden state); o_proj and down are row-parallel (each rank's partial product over its input
slice, summed by one all-reduce per block half).
"""

from __future__ import annotations

import dataclasses
import logging
import os
from dataclasses import dataclass

import torch

from shared.model.architecture import ModelArchitecture

logger = logging.getLogger(__name__)


def check_tensor_parallel(tp_size: int, arch: ModelArchitecture, device: str) -> None:
    """Raises ValueError naming the numbers when `tp_size` cannot split `arch` or exceeds the
    devices there are. A CPU may run more ranks than cores (slower, still correct): logged."""
    if arch.num_heads % tp_size:
        raise ValueError(
            f"tensor_parallel_size {tp_size} must divide the model's {arch.num_heads} "
            "attention heads"
        )
    kv = arch.num_kv_heads
    if (kv >= tp_size and kv % tp_size) or (kv < tp_size and tp_size % kv):
        raise ValueError(
            f"tensor_parallel_size {tp_size} must divide the model's {kv} KV heads or be a "
            "multiple of them (then KV heads are replicated)"
        )
    if arch.intermediate_size % tp_size:
        raise ValueError(
            f"tensor_parallel_size {tp_size} must divide the model's MLP intermediate size "
            f"{arch.intermediate_size}"
        )
    _check_devices(tp_size, device)


def _check_devices(tp_size: int, device: str) -> None:
    if device.startswith("cuda"):
        num_devices = torch.cuda.device_count()
        if tp_size > num_devices:
            raise ValueError(
                f"tensor_parallel_size {tp_size} exceeds the {num_devices} CUDA devices here"
            )
        return
    num_cores = os.cpu_count() or 1
    if tp_size > num_cores:
        logger.warning(
            "tensor_parallel_size %d exceeds the %d CPU cores: ranks share cores",
            tp_size,
            num_cores,
        )


@dataclass(frozen=True)
class TensorParallelLayout:
    """Rank `rank`'s share of a model split `tp_size` ways (see the module docstring)."""

    tp_size: int
    rank: int
    num_heads: int  # the whole model's
    num_kv_heads: int  # the whole model's
    head_dim: int
    intermediate_size: int  # the whole model's

    @classmethod
    def of(cls, arch: ModelArchitecture, tp_size: int, rank: int) -> TensorParallelLayout:
        return cls(
            tp_size, rank, arch.num_heads, arch.num_kv_heads, arch.head_dim, arch.intermediate_size
        )

    @property
    def heads_per_rank(self) -> int:
        return self.num_heads // self.tp_size

    @property
    def kv_heads_per_rank(self) -> int:
        return max(1, self.num_kv_heads // self.tp_size)

    def kv_heads_of(self, rank: int) -> range:
        """The model's KV head indices that `rank` holds (its pages' heads, in order)."""
        if self.num_kv_heads >= self.tp_size:
            per_rank = self.kv_heads_per_rank
            return range(rank * per_rank, (rank + 1) * per_rank)
        replicas = self.tp_size // self.num_kv_heads
        return range(rank // replicas, rank // replicas + 1)

    @property
    def kv_heads(self) -> range:
        return self.kv_heads_of(self.rank)

    @property
    def query_heads(self) -> range:
        per_rank = self.heads_per_rank
        return range(self.rank * per_rank, (self.rank + 1) * per_rank)

    @property
    def mlp_columns(self) -> slice:
        per_rank = self.intermediate_size // self.tp_size
        return slice(self.rank * per_rank, (self.rank + 1) * per_rank)

    def local_arch(self, arch: ModelArchitecture) -> ModelArchitecture:
        """The architecture of this rank's slice: the model code builds it unchanged."""
        return dataclasses.replace(
            arch,
            num_heads=self.heads_per_rank,
            num_kv_heads=self.kv_heads_per_rank,
            intermediate_size=self.intermediate_size // self.tp_size,
        )

    def shard_weights(
        self, weights: dict[str, torch.Tensor], num_layers: int
    ) -> dict[str, torch.Tensor]:
        """This rank's slices of HF-named weights (views; the model copies them in)."""
        out = dict(weights)
        d = self.head_dim
        q_rows = _rows(self.query_heads, d)
        kv_rows = _rows(self.kv_heads, d)
        for i in range(num_layers):
            attn, mlp = f"model.layers.{i}.self_attn.", f"model.layers.{i}.mlp."
            out[attn + "q_proj.weight"] = weights[attn + "q_proj.weight"][q_rows]
            out[attn + "k_proj.weight"] = weights[attn + "k_proj.weight"][kv_rows]
            out[attn + "v_proj.weight"] = weights[attn + "v_proj.weight"][kv_rows]
            out[attn + "o_proj.weight"] = weights[attn + "o_proj.weight"][:, q_rows]
            for name in ("gate_proj.weight", "up_proj.weight"):
                out[mlp + name] = weights[mlp + name][self.mlp_columns]
            out[mlp + "down_proj.weight"] = weights[mlp + "down_proj.weight"][:, self.mlp_columns]
        return out


def _rows(heads: range, head_dim: int) -> slice:
    """The rows of a [heads * head_dim, ...] projection that `heads` (consecutive) own."""
    return slice(heads.start * head_dim, heads.stop * head_dim)
