"""The engine's LoRA part from its config: hooks on the loaded model and the slots over them."""

from __future__ import annotations

import torch

from splitserve.engine.config import EngineConfig
from splitserve.engine.lora.layers import attach_lora
from splitserve.engine.lora.slots import LoRASlots
from splitserve.engine.model.llama import LlamaForCausalLM


def build_lora(config: EngineConfig, model: LlamaForCausalLM) -> LoRASlots | None:
    """None unless enable_lora. Hooks every dense projection of `model` (a one-process model:
    the config refuses LoRA with parallel ranks) and sets its LoRA state. The slots' weights
    are allocated here, after the KV cache was sized: at max_loras x max_lora_rank they are
    small beside it."""
    lora = config.lora
    if not lora.enable_lora:
        return None
    arch = model.arch
    sizes = {
        "hidden": arch.hidden_size,
        "q": arch.num_heads * arch.head_dim,
        "kv": arch.num_kv_heads * arch.head_dim,
        "intermediate": arch.intermediate_size,
    }
    dtype = getattr(torch, config.model.dtype)
    device = torch.device(config.model.device)
    hooks = attach_lora(
        model.decoder_layers(), sizes, lora.max_loras, lora.max_lora_rank, dtype, device
    )
    model.lora = hooks.state
    if model.fused_decode is not None and dtype == torch.float32:
        model.fused_decode.set_lora(hooks.hooks)
    return LoRASlots(
        hooks,
        lora.max_loras,
        lora.num_cpu_loras,
        lora.max_lora_rank,
        arch.num_layers,
        dtype,
        device,
    )
