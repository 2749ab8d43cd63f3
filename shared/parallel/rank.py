"""What one rank of a parallel engine holds, and building it: shared by rank 0 (the engine
process, shared/parallel/setup.py) and the others (shared/parallel/worker.py)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol

import torch

from splitserve.engine.config import EngineConfig
from splitserve.engine.kv.cache import KVCacheSpec, allocate_kv_cache
from splitserve.engine.model.architecture import ModelArchitecture
from splitserve.engine.model.gguf_blocks import BlockQuantized
from splitserve.engine.model.llama import LlamaForCausalLM
from splitserve.engine.parallel.grid import GridLayout
from splitserve.engine.parallel.layout import (
    TensorParallelLayout,
    check_devices,
    check_tensor_parallel,
)
from splitserve.engine.parallel.pipeline import PipelineLayout, check_pipeline_parallel


class RankLayout(Protocol):
    """A rank's part of the model: `TensorParallelLayout` (heads), `PipelineLayout` (layers)
    or `GridLayout` (both). Cuts weights and pages, and wires the model's collectives."""

    @property
    def rank(self) -> int: ...

    @property
    def world_size(self) -> int: ...

    def of_rank(self, rank: int) -> RankLayout: ...

    def local_arch(self, arch: ModelArchitecture) -> ModelArchitecture: ...

    def pod_kv_arch(self, arch: ModelArchitecture) -> ModelArchitecture: ...

    def shard_weights(
        self, weights: dict[str, torch.Tensor], num_layers: int
    ) -> dict[str, torch.Tensor]: ...

    def attach(self, model: LlamaForCausalLM, comm) -> None: ...

    def run_first_rank(self, comm, runner, inputs) -> torch.Tensor:
        """Rank 0: sends the step, runs its part; the logits."""
        ...

    def run_other_rank(self, comm, runner, payload: torch.Tensor, count: int) -> None:
        """A rank other than 0: its part of the step rank 0 sent (STEP or PIPELINE_STEP)."""
        ...

    def wire_shape(self, kv_cache: torch.Tensor, num_blocks: int) -> tuple[int, ...]: ...

    def split_pages(self, pages: torch.Tensor) -> list[torch.Tensor]: ...

    def join_pages(self, parts: list[torch.Tensor]) -> torch.Tensor: ...

    @property
    def page_copies(self) -> int:
        """How many ranks hold each page whole: 1, or every rank for MLA's latent pages under
        tensor parallel (then rank 0's copy alone is sent)."""
        ...


def layout_for(config: EngineConfig, arch: ModelArchitecture, rank: int = 0) -> RankLayout:
    """Global rank `rank`'s layout: by heads (TP), by layers (PP) or both (a grid of stages
    of tensor-parallel ranks). Raises ValueError when the sizes cannot split `arch` (naming
    the numbers)."""
    parallel, device = config.parallel, config.model.device
    tp_size, pp_size = parallel.tensor_parallel_size, parallel.pipeline_parallel_size
    if pp_size == 1:
        expert_parallel = parallel.enable_expert_parallel
        check_tensor_parallel(tp_size, arch, device, expert_parallel)
        return TensorParallelLayout.of(arch, tp_size, rank, expert_parallel)
    check_pipeline_parallel(pp_size, arch)
    check_devices("pipeline_parallel_size", pp_size, device)
    pipeline = PipelineLayout(pp_size, rank, arch.num_layers, tp_size)
    if tp_size == 1:
        return pipeline
    # MoE and expert parallel with stages are refused before (config, engine).
    check_tensor_parallel(tp_size, arch, device)
    check_devices("tensor_parallel_size x pipeline_parallel_size", tp_size * pp_size, device)
    return GridLayout.of(arch, pipeline)


def build_rank(
    layout: RankLayout,
    arch: ModelArchitecture,
    weights: Mapping[str, torch.Tensor | BlockQuantized],
    config: EngineConfig,
    max_model_len: int,
    num_blocks: int,
) -> tuple[LlamaForCausalLM, torch.Tensor]:
    """This rank's model (its part of the weights) and its part of the paged KV cache (the
    pod's block count: the scheduler's block ids mean the same block on every rank)."""
    local_arch = layout.local_arch(arch)
    device, dtype = torch.device(config.model.device), getattr(torch, config.model.dtype)
    model = LlamaForCausalLM(local_arch, max_model_len, device)
    model.materialize(device, dtype)
    model.load_hf_weights(layout.shard_weights(_plain_tensors(weights), arch.num_layers))
    # Only the block count matters for allocation; rank 0 sized it for the whole pod.
    kv_spec = KVCacheSpec(num_blocks, config.cache.block_size, bytes_per_block=0)
    kv_cache = allocate_kv_cache(
        kv_spec, local_arch, dtype, device, config.cache.kv_cache_dtype
    )
    return model, kv_cache


def _plain_tensors(weights: Mapping[str, torch.Tensor | BlockQuantized]) -> dict[str, torch.Tensor]:
    """The layouts slice plain tensors: config refuses quantization with parallelism, so a
    checkpoint loaded for a parallel engine holds no `BlockQuantized` matrix."""
    plain: dict[str, torch.Tensor] = {}
    for name, weight in weights.items():
        assert isinstance(weight, torch.Tensor), f"{name}: block-quantized on a parallel engine"
        plain[name] = weight
    return plain
