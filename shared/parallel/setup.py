"""Rank 0's side of building a parallel engine: its part of the model, the pod's KV sizing,
and the other ranks started alongside."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from splitserve.engine.config import EngineConfig
from splitserve.engine.kv.cache import KVCacheSpec, size_kv_cache
from splitserve.engine.model.architecture import LoadedCheckpoint
from splitserve.engine.model.llama import LlamaForCausalLM
from splitserve.engine.parallel.group import ParallelGroup
from splitserve.engine.parallel.rank import build_rank, layout_for


@dataclass
class RankZero:
    group: ParallelGroup
    model: LlamaForCausalLM  # rank 0's part
    kv_spec: KVCacheSpec  # the pod's: bytes_per_block counts every rank's pages
    kv_cache: torch.Tensor  # rank 0's part only


def start_parallel(
    config: EngineConfig, checkpoint: LoadedCheckpoint, max_model_len: int
) -> RankZero:
    """Raises ValueError when the sizes cannot split this model (naming the numbers)."""
    arch = checkpoint.architecture
    layout = layout_for(config, arch)
    dtype = getattr(torch, config.model.dtype)
    # The budget is the pod's: every rank's pages (replicated KV heads counted each time; MLA's
    # latent pages once per rank, as each holds them whole).
    kv_spec = size_kv_cache(
        layout.pod_kv_arch(arch),
        config.cache,
        dtype,
        torch.device(config.model.device),
        copies=layout.page_copies,
    )

    def build_rank0() -> tuple[LlamaForCausalLM, torch.Tensor]:
        return build_rank(
            layout, arch, checkpoint.weights, config, max_model_len, kv_spec.num_blocks
        )

    group, (model, kv_cache) = ParallelGroup.start(
        config, layout, kv_spec.num_blocks, max_model_len, build_rank0
    )
    layout.attach(model, group.comm)
    return RankZero(group, model, kv_spec, kv_cache)
