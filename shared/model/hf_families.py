"""What the dense families beyond Llama add, read from a Hugging Face config.json, and their
checkpoints' tensors under Llama's names (the contract of shared/model/architecture.py).

    qwen2        q/k/v biases; window layers where use_sliding_window says (layer_types)
    qwen3        q/k RMSNorm per head, head_dim apart from hidden / heads
    qwen3_moe    qwen3's attention with Qwen2-MoE's sparse block (no shared expert)
    mistral      a sliding window on every layer when sliding_window is set
    phi3         fused qkv_proj and gate_up_proj (split here), longrope scaling, window
    gemma2       alternating window/global layers, attention and final logit soft-capping,
                 pre/post feed-forward norms, GeGLU, embeddings scaled by sqrt(hidden),
                 (1 + w) RMSNorm (stored here as w + 1), query_pre_attn_scalar
    gemma3_text  gemma2's layout without caps by default, q/k norm, the window layers' own
                 rotary base

docs/models.md lists them with what each supports and what is refused.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from splitserve.engine.model.architecture import RopeScaling

_QWEN = ("qwen2", "qwen3", "qwen3_moe")
# Dense Qwen configs without layer_types window the layers from max_window_layers on, as
# transformers derives their layer_types (its default: 28).
_QWEN_MAX_WINDOW_LAYERS = {"qwen2": 28, "qwen3": 28}
_QWEN_DEFAULT_WINDOW = 4096
_GEMMA = ("gemma2", "gemma3_text")
_QK_NORM = ("qwen3", "qwen3_moe", "gemma3_text")
# Layer types a config may list; every other one is refused.
_LAYER_TYPES = ("full_attention", "sliding_attention")


def family_fields(config: dict[str, Any]) -> dict[str, Any]:
    """The `ModelArchitecture` fields (beyond Llama's) that config.json's model type sets."""
    model_type = config["model_type"]
    fields: dict[str, Any] = {
        "qk_norm": model_type in _QK_NORM,
        "layer_windows": layer_windows(config),
    }
    if model_type == "qwen2":
        fields["attention_bias"] = True
    if model_type in _GEMMA:
        hidden = int(config["hidden_size"])
        fields |= {
            "attn_logit_softcap": float(config.get("attn_logit_softcapping") or 0.0),
            "final_logit_softcap": float(config.get("final_logit_softcapping") or 0.0),
            "attention_scale": float(config.get("query_pre_attn_scalar") or 256) ** -0.5,
            "embedding_multiplier": hidden**0.5,
            "sandwich_norms": True,
            "hidden_act": config.get("hidden_activation") or "gelu_pytorch_tanh",
        }
    if model_type == "gemma3_text":
        fields["local_rope_theta"] = _local_rope_theta(config)
    return fields


def layer_windows(config: dict[str, Any]) -> tuple[int, ...]:
    """Per layer, the sliding window (0 = global). Configs that list layer_types (Qwen2/3,
    Gemma) window the "sliding_attention" layers; Qwen2/3 configs without them the layers from
    max_window_layers on; Mistral and Phi-3 window every layer when sliding_window is set. ()
    when no layer has one."""
    window = config.get("sliding_window")
    layer_types = config.get("layer_types")
    num_layers = int(config["num_hidden_layers"])
    if config["model_type"] in _QWEN and not config.get("use_sliding_window", False):
        return ()
    if layer_types:
        unknown = sorted(set(layer_types) - set(_LAYER_TYPES))
        if unknown:
            raise ValueError(f"{config['model_type']} config has unsupported layer_types {unknown}")
        windows = tuple(int(window or 0) if t == "sliding_attention" else 0 for t in layer_types)
    elif config["model_type"] in _QWEN_MAX_WINDOW_LAYERS:
        # transformers' defaults where config.json leaves them out: a 4096 window from layer 28
        window = config.get("sliding_window", _QWEN_DEFAULT_WINDOW)
        first = int(config.get("max_window_layers", _QWEN_MAX_WINDOW_LAYERS[config["model_type"]]))
        windows = tuple(int(window or 0) if i >= first else 0 for i in range(num_layers))
    else:
        windows = (int(window or 0),) * num_layers
    return windows if any(windows) else ()


def differences(config: dict[str, Any]) -> dict[str, bool]:
    """Settings of these families that would change the computation, by name."""
    model_type = config["model_type"]
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    partial = [rope.get("partial_rotary_factor"), config.get("partial_rotary_factor")]
    out = {"partial_rotary_factor": any(f is not None and float(f) != 1.0 for f in partial)}
    if model_type in _GEMMA:
        out["use_bidirectional_attention"] = bool(config.get("use_bidirectional_attention"))
        out["hidden_activation"] = (
            config.get("hidden_activation") or "gelu_pytorch_tanh"
        ) != "gelu_pytorch_tanh"
    else:
        out["hidden_act"] = config.get("hidden_act", "silu") != "silu"
    if model_type != "qwen2":
        out["attention_bias"] = bool(config.get("attention_bias", False))
    if model_type == "qwen3_moe":
        out["mlp_only_layers"] = bool(config.get("mlp_only_layers"))
        out["decoder_sparse_step"] = int(config.get("decoder_sparse_step", 1)) != 1
    return out


def _local_rope_theta(config: dict[str, Any]) -> float:
    params = config.get("rope_parameters")
    if isinstance(params, dict) and isinstance(params.get("sliding_attention"), dict):
        return float(params["sliding_attention"].get("rope_theta", 10000.0))
    return float(config.get("rope_local_base_freq", 10000.0))


def longrope_scaling(config: dict[str, Any], params: dict[str, Any]) -> RopeScaling:
    """Phi-3's longrope from its rope dict, with transformers' defaults: `factor` from the
    position limits, the attention factor from `factor`."""
    original = int(
        params.get("original_max_position_embeddings")
        or config.get("original_max_position_embeddings")
        or config["max_position_embeddings"]
    )
    factor = params.get("factor")
    if factor is None:
        factor = int(config["max_position_embeddings"]) / original
    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        attention_factor = (
            1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
        )
    head_dim = int(config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"])
    short, long = tuple(params["short_factor"]), tuple(params["long_factor"])
    if len(short) != head_dim // 2 or len(long) != head_dim // 2:
        raise ValueError(
            f"longrope short_factor and long_factor need head_dim / 2 = {head_dim // 2} "
            f"values, got {len(short)} and {len(long)}"
        )
    return RopeScaling(
        rope_type="longrope",
        factor=float(factor),
        original_max_position_embeddings=original,
        short_factor=tuple(float(f) for f in short),
        long_factor=tuple(float(f) for f in long),
        attention_factor=float(attention_factor),
    )


def to_llama_weights(config: dict[str, Any], weights: dict[str, torch.Tensor]) -> None:
    """Renames and rewrites `weights` in place into Llama's names and conventions: Phi-3's
    fused projections split into q/k/v and gate/up, Gemma's (1 + w) norm weights stored as
    w + 1 (the same product in float32)."""
    model_type = config["model_type"]
    if model_type == "phi3":
        _split_phi3(config, weights)
    if model_type in _GEMMA:
        for name in weights:
            if name.endswith("norm.weight"):
                weights[name] = weights[name] + 1.0


def _split_phi3(config: dict[str, Any], weights: dict[str, torch.Tensor]) -> None:
    num_heads = int(config["num_attention_heads"])
    num_kv_heads = int(config.get("num_key_value_heads") or num_heads)
    head_dim = int(config.get("head_dim") or config["hidden_size"] // num_heads)
    sizes = [num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim]
    for name in [n for n in weights if n.endswith(("qkv_proj.weight", "gate_up_proj.weight"))]:
        fused = weights.pop(name)
        if name.endswith("qkv_proj.weight"):
            prefix = name.removesuffix("qkv_proj.weight")
            for part, tensor in zip("qkv", fused.split(sizes)):
                weights[f"{prefix}{part}_proj.weight"] = tensor.contiguous()
        else:
            prefix = name.removesuffix("gate_up_proj.weight")
            gate, up = fused.chunk(2)  # gate's rows first, as Phi3MLP splits them
            weights[prefix + "gate_proj.weight"] = gate.contiguous()
            weights[prefix + "up_proj.weight"] = up.contiguous()
