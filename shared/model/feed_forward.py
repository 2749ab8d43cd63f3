"""Each decoder layer's feed-forward block, per model family: its checkpoint tensor names and
shapes (for the loader's check) and how they map onto the model's parameters (fused, stacked).

    llama      mlp.{gate,up,down}_proj                       -> LlamaMLP (gate_up fused)
    mixtral    block_sparse_moe.gate, .experts.{e}.w1/w3/w2  -> SparseMoeBlock (experts stacked)
    qwen2_moe  mlp.gate, mlp.experts.{e}.{gate,up,down}_proj,
               mlp.shared_expert.*, mlp.shared_expert_gate   -> SparseMoeBlock + shared expert
    deepseek_v2  qwen2_moe's experts, mlp.shared_experts.* (no gate) -> SparseMoeBlock; its
                 dense layers (first_k_dense_replace, moe_layer_freq) are llama's

Names are relative to `model.layers.{i}.` in the checkpoint and `layers.{i}.` in the model.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from splitserve.engine.model.architecture import ModelArchitecture
from splitserve.engine.model.gguf_blocks import BlockQuantized
from splitserve.engine.model.quantization import cat_rows, dense

# HF-named checkpoint tensors; a GGUF file's matrices may be blocks (quantization=gguf).
Weights = Mapping[str, torch.Tensor | BlockQuantized]


@dataclass(frozen=True)
class ExpertNames:
    """Where a family's checkpoints keep the router and each expert's three matrices."""

    prefix: str
    gate: str
    up: str
    down: str


_EXPERT_NAMES = {
    "mixtral": ExpertNames("block_sparse_moe.", "w1", "w3", "w2"),
    "qwen2_moe": ExpertNames("mlp.", "gate_proj", "up_proj", "down_proj"),
    "deepseek_v2": ExpertNames("mlp.", "gate_proj", "up_proj", "down_proj"),
}
_SHARED = "mlp.shared_expert."
# DeepSeek's n_shared_experts experts, held as one SwiGLU of their summed width.
_DEEPSEEK_SHARED = "mlp.shared_experts."


def hf_shared_expert_prefix(family: str) -> str:
    """The shared expert's module prefix in a layer of a `family` checkpoint."""
    return _DEEPSEEK_SHARED if family == "deepseek_v2" else _SHARED


def hf_router_name(family: str) -> str:
    """The router's module name in a layer of a `family` checkpoint."""
    return f"{_EXPERT_NAMES[family].prefix}gate"


def hf_expert_names(family: str, expert: int) -> dict[str, str]:
    """"gate", "up", "down" -> expert `expert`'s module names in a layer of `family`."""
    names = _EXPERT_NAMES[family]
    prefix = f"{names.prefix}experts.{expert}."
    return {"gate": prefix + names.gate, "up": prefix + names.up, "down": prefix + names.down}


def hf_feed_forward_shapes(
    arch: ModelArchitecture, layer: int = 0
) -> dict[str, tuple[int, ...]]:
    """Layer `layer`'s feed-forward tensors in the checkpoint, with their [out, in] shapes."""
    hidden = arch.hidden_size
    if arch.moe is None or not arch.is_sparse_layer(layer):
        inter = arch.intermediate_size
        return _swiglu_shapes("mlp.", "gate_proj", "up_proj", "down_proj", hidden, inter)
    names = _EXPERT_NAMES[arch.family]
    moe = arch.moe
    shapes: dict[str, tuple[int, ...]] = {f"{names.prefix}gate.weight": (moe.num_experts, hidden)}
    if moe.topk_method == "noaux_tc":
        shapes[f"{names.prefix}gate.e_score_correction_bias"] = (moe.num_experts,)
    for expert in range(moe.num_experts):
        prefix = f"{names.prefix}experts.{expert}."
        inter = moe.expert_intermediate_size
        shapes.update(_swiglu_shapes(prefix, names.gate, names.up, names.down, hidden, inter))
    if moe.shared_expert_intermediate_size:
        inter = moe.shared_expert_intermediate_size
        prefix = hf_shared_expert_prefix(arch.family)
        shapes.update(_swiglu_shapes(prefix, "gate_proj", "up_proj", "down_proj", hidden, inter))
        if moe.shared_expert_gated:
            shapes["mlp.shared_expert_gate.weight"] = (1, hidden)
    return shapes


def internal_feed_forward_weights(
    weights: Weights, arch: ModelArchitecture, layer: int
) -> dict[str, torch.Tensor | BlockQuantized]:
    """Layer `layer`'s feed-forward tensors under the model's parameter names (KeyError for a
    missing one, which the model reports). Experts are stacked dense: MoE models are never
    quantized (LlamaForCausalLM refuses it)."""
    hf, ours = f"model.layers.{layer}.", f"layers.{layer}.mlp."
    if arch.moe is None or not arch.is_sparse_layer(layer):
        return _swiglu(weights, hf + "mlp.", "gate_proj", "up_proj", "down_proj", ours)
    names = _EXPERT_NAMES[arch.family]
    # Only the experts this model holds (a range of them under expert parallelism).
    experts = [f"{hf}{names.prefix}experts.{e}." for e in arch.moe.local_experts]
    def expert(name: str) -> torch.Tensor:
        return dense(weights[name])

    out: dict[str, torch.Tensor | BlockQuantized] = {
        ours + "gate.weight": weights[f"{hf}{names.prefix}gate.weight"],
        # [E, 2*I, H]: each expert's gate rows then its up rows, as LlamaMLP fuses them.
        ours + "experts_gate_up": torch.stack(
            [
                torch.cat([expert(p + f"{names.gate}.weight"), expert(p + f"{names.up}.weight")])
                for p in experts
            ]
        ),  # fmt: skip
        ours + "experts_down": torch.stack([expert(p + f"{names.down}.weight") for p in experts]),
    }
    if arch.moe.topk_method == "noaux_tc":  # DeepSeek-V3's bias on the routing choice
        out[ours + "router_bias"] = weights[f"{hf}{names.prefix}gate.e_score_correction_bias"]
    if arch.moe.shared_expert_intermediate_size:
        shared, prefix = ours + "shared_expert.", hf + hf_shared_expert_prefix(arch.family)
        out.update(_swiglu(weights, prefix, "gate_proj", "up_proj", "down_proj", shared))
        if arch.moe.shared_expert_gated:
            gate = weights[hf + "mlp.shared_expert_gate.weight"]
            out[ours + "shared_expert_gate.weight"] = gate
    return out


def _swiglu_shapes(
    prefix: str, gate: str, up: str, down: str, hidden: int, inter: int
) -> dict[str, tuple[int, ...]]:
    return {
        f"{prefix}{gate}.weight": (inter, hidden),
        f"{prefix}{up}.weight": (inter, hidden),
        f"{prefix}{down}.weight": (hidden, inter),
    }


def _swiglu(
    weights: Weights, hf: str, gate: str, up: str, down: str, ours: str
) -> dict[str, torch.Tensor | BlockQuantized]:
    return {
        # cat_rows: a GGUF file's blocks stay blocks for quantization=gguf.
        ours + "gate_up_proj.weight": cat_rows(
            [weights[f"{hf}{gate}.weight"], weights[f"{hf}{up}.weight"]]
        ),
        ours + "down_proj.weight": weights[f"{hf}{down}.weight"],
    }
