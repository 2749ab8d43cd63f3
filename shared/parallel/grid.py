"""Tensor and pipeline parallel together: pp stages of tp ranks each (vLLM's layout).

    rank = stage * tp + tp_rank          stage = rank // tp, tp_rank = rank % tp

    stage 0:  rank 0 (0,0)  rank 1 (0,1)   embed, layers [0, L/pp) on their heads;
                 |             |           all-reduce inside the stage only
                 v             v           hidden rows, each rank to its counterpart
    stage 1:  rank 2 (1,0)  rank 3 (1,1)   layers [L/pp, 2L/pp) on their heads
                 |
                 v  sampled rows only, from (last stage, 0)
              rank 0: final norm, lm head, sampling

Each rank holds its stage's layers (`PipelineLayout`) and, of those, its heads and MLP columns
(`TensorParallelLayout`), and the pages of exactly those. The scheduler runs once on rank 0,
which broadcasts each step to every rank over the pod's group; a stage's all-reduces run on a
group of that stage's ranks alone (`Communicator.subgroup`).

Why every tensor-parallel rank sends its own copy across a stage boundary rather than rank
(s, 0) sending once and broadcasting inside stage s+1: after a block's all-reduce every rank of
a stage holds the same full rows already, so tp point-to-point sends run side by side and each
receiver can start as soon as its own copy lands; the alternative adds a broadcast behind the
one send on the critical path. The cost is tp copies of `[tokens, hidden]` per boundary, small
beside the all-reduces a stage already runs per layer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from splitserve.engine.model.architecture import ModelArchitecture
from splitserve.engine.parallel.layout import TensorParallelLayout
from splitserve.engine.parallel.pipeline import PipelineLayout

if TYPE_CHECKING:
    from splitserve.engine.model.llama import LlamaForCausalLM
    from splitserve.engine.parallel.comm import Communicator
    from splitserve.engine.runner import ModelInputs, ModelRunner


@dataclass(frozen=True)
class GridLayout:
    """Rank `rank`'s stage (`pipeline`, whose rank is the global one) and its heads within
    the stage (`tensor`, whose rank is the tp rank)."""

    tensor: TensorParallelLayout
    pipeline: PipelineLayout

    def __post_init__(self) -> None:
        assert self.pipeline.tp_size == self.tensor.tp_size, "one tp size for both parts"
        assert self.tensor.rank == self.pipeline.rank % self.tensor.tp_size, "tp_rank mismatch"

    @classmethod
    def of(cls, arch: ModelArchitecture, pipeline: PipelineLayout) -> GridLayout:
        tp_size = pipeline.tp_size
        return cls(TensorParallelLayout.of(arch, tp_size, pipeline.rank % tp_size), pipeline)

    @property
    def rank(self) -> int:
        return self.pipeline.rank

    @property
    def world_size(self) -> int:
        return self.pipeline.world_size

    @property
    def page_copies(self) -> int:
        return 1  # MLA (the replicated pages) is refused with pipeline parallel

    @property
    def tp_size(self) -> int:
        return self.tensor.tp_size

    def of_rank(self, rank: int) -> GridLayout:
        return GridLayout(self.tensor.of_rank(rank % self.tp_size), self.pipeline.of_rank(rank))

    def local_arch(self, arch: ModelArchitecture) -> ModelArchitecture:
        return self.pipeline.local_arch(self.tensor.local_arch(arch))

    def pod_kv_arch(self, arch: ModelArchitecture) -> ModelArchitecture:
        """Every layer once (over the stages), every rank's heads (replicas each time)."""
        return self.tensor.pod_kv_arch(arch)

    def shard_weights(
        self, weights: dict[str, torch.Tensor], num_layers: int
    ) -> dict[str, torch.Tensor]:
        """The stage's layers (renumbered from 0), then this rank's heads and columns of them."""
        stage = self.pipeline.shard_weights(weights, num_layers)
        num_stage_layers = len(self.pipeline.layers_of(self.pipeline.stage))
        return self.tensor.shard_weights(stage, num_stage_layers)

    def attach(self, model: LlamaForCausalLM, comm: Communicator) -> None:
        """The stage's own group for the all-reduces (every rank of the pod calls this once,
        after joining the pod's group)."""
        stage = self.pipeline.stage
        stage_comm = comm.subgroup(f"tp-stage-{stage}", self.tensor.rank, self.tp_size)
        self.tensor.attach(model, stage_comm)

    def run_first_rank(
        self, comm: Communicator, runner: ModelRunner, inputs: ModelInputs
    ) -> torch.Tensor:
        return self.pipeline.run_first_rank(comm, runner, inputs)

    def run_other_rank(
        self, comm: Communicator, runner: ModelRunner, payload: torch.Tensor, count: int
    ) -> None:
        self.pipeline.run_other_rank(comm, runner, payload, count)

    # ---- pages in the wire layout (shared/parallel/pages.py) --------------------------------

    def wire_shape(self, kv_cache: torch.Tensor, num_blocks: int) -> tuple[int, ...]:
        """The model's layers and KV heads, not this rank's."""
        _, _, _, block_size, _, head_dim = kv_cache.shape
        num_layers, num_kv_heads = self.pipeline.num_layers, self.tensor.num_kv_heads
        return (num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim)

    def split_pages(self, pages: torch.Tensor) -> list[torch.Tensor]:
        """Wire-layout pages -> each rank's layers and heads, in rank order (stage-major)."""
        return [
            part
            for stage_pages in self.pipeline.split_pages(pages)
            for part in self.tensor.split_pages(stage_pages)
        ]

    def join_pages(self, parts: list[torch.Tensor]) -> torch.Tensor:
        """Each rank's packed pages (rank order) -> wire layout."""
        tp = self.tp_size
        stage_parts = (parts[s * tp : (s + 1) * tp] for s in range(self.pipeline.pp_size))
        return self.pipeline.join_pages([self.tensor.join_pages(p) for p in stage_parts])
