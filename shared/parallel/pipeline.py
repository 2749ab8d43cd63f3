"""Pipeline parallelism: consecutive layers per rank (a stage), hidden states passed along.

    rank 0: embed, layers [0, L/pp)          --hidden [num_tokens, hidden]-->  rank 1
    rank 1: layers [L/pp, 2L/pp)             --> ... --> rank pp-1
    rank pp-1: its layers, then the sampled rows only  --hidden [num_logits, hidden]-->  rank 0
    rank 0: final norm, lm head, sampling

Each stage holds the KV of its own layers. Stages run one after another within a step: no
micro-batches are in flight (the running batch is not split), so PP spreads the weights and
the KV over processes (devices) but does not overlap their compute; docs/parallelism.md.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from shared.model.architecture import ModelArchitecture
from shared.parallel.comm import Communicator

if TYPE_CHECKING:
    from shared.model.attention_metadata import AttentionBackend
    from shared.model.llama import LlamaForCausalLM
    from shared.runner import ModelInputs

_LAYERS_DIM = 1  # of a packed page buffer [blocks, layers, 2, block_size, heads, head_dim]


def check_pipeline_parallel(pp_size: int, arch: ModelArchitecture) -> None:
    if arch.num_layers % pp_size:
        raise ValueError(
            f"pipeline_parallel_size {pp_size} must divide the model's {arch.num_layers} layers"
        )


@dataclass(frozen=True)
class PipelineLayout:
    """Rank `rank`'s stage of a model split `pp_size` ways by layers."""

    pp_size: int
    rank: int
    num_layers: int  # the whole model's

    @property
    def world_size(self) -> int:
        return self.pp_size

    def layers_of(self, rank: int) -> range:
        per_stage = self.num_layers // self.pp_size
        return range(rank * per_stage, (rank + 1) * per_stage)

    def of_rank(self, rank: int) -> PipelineLayout:
        return dataclasses.replace(self, rank=rank)

    def local_arch(self, arch: ModelArchitecture) -> ModelArchitecture:
        return dataclasses.replace(arch, num_layers=len(self.layers_of(self.rank)))

    def pod_kv_arch(self, arch: ModelArchitecture) -> ModelArchitecture:
        """Every layer's KV once, over all stages."""
        return arch

    def shard_weights(
        self, weights: dict[str, torch.Tensor], num_layers: int
    ) -> dict[str, torch.Tensor]:
        """This stage's layers, renumbered from 0; embedding, norm and head kept (the model
        code expects them; only rank 0 runs them)."""
        layers = self.layers_of(self.rank)
        out = {name: t for name, t in weights.items() if not name.startswith("model.layers.")}
        for i in layers:
            prefix = f"model.layers.{i}."
            for name, tensor in weights.items():
                if name.startswith(prefix):
                    out[f"model.layers.{i - layers.start}." + name[len(prefix) :]] = tensor
        return out

    def attach(self, model: LlamaForCausalLM, comm: Communicator) -> None:
        model.pipeline = PipelineStage(comm, self)

    def run_step(
        self,
        model: LlamaForCausalLM,
        inputs: ModelInputs,
        kv_cache: torch.Tensor,
        backend: AttentionBackend,
    ) -> None:
        assert model.pipeline is not None, "attach() first"
        model.pipeline.run_stage(model, inputs, kv_cache, backend)

    # ---- pages in the wire layout (shared/parallel/pages.py) --------------------------------

    def wire_shape(self, kv_cache: torch.Tensor, num_blocks: int) -> tuple[int, ...]:
        _, _, _, block_size, num_kv_heads, head_dim = kv_cache.shape
        return (num_blocks, self.num_layers, 2, block_size, num_kv_heads, head_dim)

    def split_pages(self, pages: torch.Tensor) -> list[torch.Tensor]:
        return [
            pages[:, layers.start : layers.stop].contiguous()
            for layers in map(self.layers_of, range(self.pp_size))
        ]

    def join_pages(self, parts: list[torch.Tensor]) -> torch.Tensor:
        return torch.cat(parts, dim=_LAYERS_DIM)


class PipelineStage:
    """One rank's hand-offs within a step (see the module docstring)."""

    def __init__(self, comm: Communicator, layout: PipelineLayout) -> None:
        self.comm = comm
        self.layout = layout

    def sampled_rows(self, hidden: torch.Tensor, logits_indices: torch.Tensor) -> torch.Tensor:
        """Rank 0: passes its stage's output on and gets the last stage's sampled rows back."""
        self.comm.send(hidden.contiguous(), 1)
        rows = hidden.new_empty(logits_indices.shape[0], hidden.shape[1])
        self.comm.recv(rows, self.layout.pp_size - 1)
        return rows

    def run_stage(
        self,
        model: LlamaForCausalLM,
        inputs: ModelInputs,
        kv_cache: torch.Tensor,
        backend: AttentionBackend,
    ) -> None:
        """A rank other than 0: the previous stage's hidden states through this stage."""
        rank = self.layout.rank
        hidden = torch.empty(
            inputs.input_ids.shape[0],
            model.arch.hidden_size,
            dtype=model.embed_tokens.weight.dtype,
            device=inputs.input_ids.device,
        )
        self.comm.recv(hidden, rank - 1)
        hidden = model.run_layers(hidden, inputs.positions, kv_cache, inputs.meta, backend)
        if rank == self.layout.pp_size - 1:
            self.comm.send(hidden[inputs.logits_indices].contiguous(), 0)
        else:
            self.comm.send(hidden, rank + 1)
