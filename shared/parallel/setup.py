"""Rank 0's side of building a tensor-parallel engine: its model slice, the pod's KV sizing,
and the other ranks started alongside."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from shared.config import EngineConfig
from shared.model.architecture import LoadedCheckpoint
from shared.model.kv_cache import KVCacheSpec, allocate_kv_cache, size_kv_cache
from shared.model.llama import LlamaForCausalLM
from shared.parallel.group import TensorParallelGroup
from shared.parallel.layout import TensorParallelLayout, check_tensor_parallel


@dataclass
class RankZero:
    group: TensorParallelGroup
    model: LlamaForCausalLM  # rank 0's slice
    kv_spec: KVCacheSpec  # the pod's: bytes_per_block counts every rank's pages
    kv_cache: torch.Tensor  # rank 0's heads only


def start_tensor_parallel(
    config: EngineConfig, checkpoint: LoadedCheckpoint, max_model_len: int
) -> RankZero:
    """Raises ValueError when the size cannot split this model (naming the numbers)."""
    arch, tp_size = checkpoint.architecture, config.parallel.tensor_parallel_size
    check_tensor_parallel(tp_size, arch, config.model.device)
    layout = TensorParallelLayout.of(arch, tp_size, 0)
    local_arch = layout.local_arch(arch)
    device, dtype = torch.device(config.model.device), getattr(torch, config.model.dtype)
    # The budget is the pod's: every rank's pages (replicated KV heads counted each time).
    pod_arch = dataclasses.replace(arch, num_kv_heads=layout.kv_heads_per_rank * tp_size)
    kv_spec = size_kv_cache(pod_arch, config.cache, dtype, device)

    def build_rank0() -> tuple[LlamaForCausalLM, torch.Tensor]:
        model = LlamaForCausalLM(local_arch, max_model_len, device)
        model.materialize(device, dtype)
        model.load_hf_weights(layout.shard_weights(checkpoint.weights, arch.num_layers))
        return model, allocate_kv_cache(kv_spec, local_arch, dtype, device)

    group, (model, kv_cache) = TensorParallelGroup.start(
        config, arch, kv_spec.num_blocks, max_model_len, build_rank0
    )
    model.set_tensor_parallel(group.comm)
    return RankZero(group, model, kv_spec, kv_cache)
