"""Mixture-of-experts GGUF files: their architecture numbers and their stacked expert tensors,
in the Hugging Face terms the rest of the loader speaks (shared/model/gguf_loader.py).

llama.cpp writes Mixtral as a `llama` model with `llama.expert_count` set, Qwen2-MoE as
`qwen2moe` and Qwen3-MoE as `qwen3moe` (no shared expert; q/k norms, which the dense loader
reads). Each layer's experts are stacked in one tensor per matrix:

    blk.N.ffn_gate_inp.weight   [E, H]     the router          -> block_sparse_moe.gate / mlp.gate
    blk.N.ffn_{gate,up}_exps    [E, I, H]  (numpy order)        -> experts.{e}.w1|w3 / gate|up_proj
    blk.N.ffn_down_exps         [E, H, I]                       -> experts.{e}.w2 / down_proj
    blk.N.ffn_{gate,up,down}_shexp, ffn_gate_inp_shexp           -> mlp.shared_expert.*, _gate

which are split into the per-expert names a Hugging Face checkpoint has.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from splitserve.engine.model.architecture import MoEConfig
from splitserve.engine.model.feed_forward import hf_expert_names, hf_router_name

# GGUF architectures refused with a message that names them as MoE.
UNSUPPORTED_MOE_ARCHITECTURES = ("dbrx", "grok", "olmoe", "arctic")
_STACKED = {"ffn_gate_exps": "gate", "ffn_up_exps": "up", "ffn_down_exps": "down"}
_SHARED = {
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
}


def moe_fields(get: Callable[[str, Any], Any], arch: str) -> tuple[str, MoEConfig | None]:
    """(family, moe) from the metadata; `get(key, default)` reads one key."""
    num_experts = int(get(f"{arch}.expert_count", 0) or 0)
    if arch in ("qwen2moe", "qwen3moe"):
        if num_experts < 1:
            raise ValueError(f"{arch} GGUF file has no {arch}.expert_count")
        return "qwen2_moe", MoEConfig(
            num_experts=num_experts,
            num_experts_per_tok=int(get(f"{arch}.expert_used_count", 0)),
            expert_intermediate_size=int(get(f"{arch}.expert_feed_forward_length", 0)),
            # llama.cpp's qwen2moe graph renormalises only when the file says so; its qwen3moe
            # graph always does (transformers' GGUF reader sets norm_topk_prob for it too).
            norm_topk_prob=bool(get(f"{arch}.expert_weights_norm", arch == "qwen3moe")),
            shared_expert_intermediate_size=int(
                get(f"{arch}.expert_shared_feed_forward_length", 0)
            ),
        )
    if num_experts:  # a "llama" with experts is Mixtral
        return "mixtral", MoEConfig(
            num_experts=num_experts,
            num_experts_per_tok=int(get(f"{arch}.expert_used_count", 0)),
            expert_intermediate_size=int(get(f"{arch}.feed_forward_length", 0)),
            norm_topk_prob=True,
        )
    return "llama", None


def moe_tensors(name: str, values: np.ndarray, family: str) -> dict[str, np.ndarray] | None:
    """The Hugging Face tensors of GGUF tensor `name`, or None when it is not an MoE tensor."""
    parts = name.split(".")
    if len(parts) != 4 or parts[0] != "blk" or family == "llama":
        return None
    layer, kind, suffix = int(parts[1]), parts[2], parts[3]
    prefix = f"model.layers.{layer}."
    if kind in _STACKED:
        return {
            f"{prefix}{hf_expert_names(family, expert)[_STACKED[kind]]}.{suffix}": values[expert]
            for expert in range(values.shape[0])
        }
    if kind == "ffn_gate_inp":
        return {f"{prefix}{hf_router_name(family)}.{suffix}": values}
    if kind in _SHARED:
        return {f"{prefix}{_SHARED[kind]}.{suffix}": values}
    if kind == "ffn_gate_inp_shexp":  # llama.cpp keeps it 1-D [H]; Hugging Face [1, H]
        return {f"{prefix}mlp.shared_expert_gate.{suffix}": values.reshape(1, -1)}
    return None
