"""DeepSeek-V2 and V3 (model_types `deepseek_v2`, `deepseek_v3`) read from a Hugging Face
config.json: multi-head latent attention (shared/model/mla.py) and its latent page layout, the
sparse block with ungated shared experts and grouped top-k routing, the dense layers before
`first_k_dense_replace` and off `moe_layer_freq`. Its tensors keep their checkpoint names (no
renaming). V3 differs in its routing only ("noaux_tc": sigmoid scores, a bias on the choice,
groups ranked by their two best experts; shared/model/moe.py); its multi-token-prediction
layers (`num_nextn_predict_layers`) are not in transformers' checkpoints and are not run.

transformers is the reference: its V2 router ignores `norm_topk_prob` (DeepSeek's own code
renormalises), so a V2 config that sets it is refused rather than computed one way or the
other; V3's router honours it.
"""

from __future__ import annotations

import math
from typing import Any

from splitserve.engine.model.architecture import MLAConfig, MoEConfig, RopeScaling

MODEL_TYPE = "deepseek_v2"
MODEL_TYPES = ("deepseek_v2", "deepseek_v3")


def family_fields(config: dict[str, Any], rope_scaling: RopeScaling) -> dict[str, Any]:
    """The `ModelArchitecture` fields a deepseek_v2 config sets (they replace Llama's)."""
    num_heads = int(config["num_attention_heads"])
    mla = mla_config(config, rope_scaling)
    return {
        "head_dim": mla.qk_rope_head_dim,  # the rotary tables' width
        "num_kv_heads": num_heads,  # every head reads the one latent
        "mla": mla,
        "moe": moe_config(config),
    }


def mla_config(config: dict[str, Any], rope_scaling: RopeScaling) -> MLAConfig:
    q_lora_rank = config.get("q_lora_rank")
    nope, rope = int(config["qk_nope_head_dim"]), int(config["qk_rope_head_dim"])
    return MLAConfig(
        kv_lora_rank=int(config["kv_lora_rank"]),
        qk_nope_head_dim=nope,
        qk_rope_head_dim=rope,
        v_head_dim=int(config["v_head_dim"]),
        q_lora_rank=None if q_lora_rank is None else int(q_lora_rank),
        softmax_scale=(nope + rope) ** -0.5 * yarn_softmax_mscale(rope_scaling) ** 2,
    )


def yarn_softmax_mscale(scaling: RopeScaling) -> float:
    """yarn's `mscale_all_dim` factor, which DeepSeek applies to the softmax scale squared."""
    if scaling.rope_type != "yarn" or not scaling.mscale_all_dim:
        return 1.0
    return _mscale(scaling.factor, scaling.mscale_all_dim)


def yarn_scaling(config: dict[str, Any], params: dict[str, Any]) -> RopeScaling:
    """yarn from DeepSeek's rope dict, with transformers' defaults: `factor` from the position
    limits, the cos/sin factor from mscale and mscale_all_dim."""
    original = int(
        params.get("original_max_position_embeddings") or config["max_position_embeddings"]
    )
    factor = params.get("factor")
    if factor is None:
        factor = int(config["max_position_embeddings"]) / original
    factor = float(factor)
    mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")
    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        if mscale and mscale_all_dim:
            attention_factor = _mscale(factor, mscale) / _mscale(factor, mscale_all_dim)
        else:
            attention_factor = _mscale(factor, 1.0)
    return RopeScaling(
        rope_type="yarn",
        factor=factor,
        original_max_position_embeddings=original,
        attention_factor=float(attention_factor),
        beta_fast=float(params.get("beta_fast") or 32),
        beta_slow=float(params.get("beta_slow") or 1),
        truncate=bool(params.get("truncate", True)),
        mscale_all_dim=float(mscale_all_dim or 0.0),
    )


def _mscale(factor: float, mscale: float) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def moe_config(config: dict[str, Any]) -> MoEConfig:
    expert_size = int(config["moe_intermediate_size"])
    is_v3 = config.get("model_type") == "deepseek_v3"
    return MoEConfig(
        num_experts=int(config.get("n_routed_experts") or 0),
        num_experts_per_tok=int(config.get("num_experts_per_tok") or 0),
        expert_intermediate_size=expert_size,
        norm_topk_prob=is_v3 and bool(config.get("norm_topk_prob", True)),
        shared_expert_intermediate_size=expert_size * int(config.get("n_shared_experts") or 0),
        shared_expert_gated=False,
        topk_method=str(config.get("topk_method") or ("noaux_tc" if is_v3 else "greedy")),
        num_groups=int(config.get("n_group") or 1),
        topk_groups=int(config.get("topk_group") or 1),
        routed_scaling_factor=float(config.get("routed_scaling_factor") or 1.0),
        first_dense_layers=int(config.get("first_k_dense_replace") or 0),
        sparse_layer_step=int(config.get("moe_layer_freq") or 1),
    )


def differences(config: dict[str, Any]) -> dict[str, bool]:
    """Settings of a deepseek_v2/v3 config that this implementation does not compute, by name."""
    common = {
        "attention_bias": bool(config.get("attention_bias", False)),
        "hidden_act": config.get("hidden_act", "silu") != "silu",
    }
    if config.get("model_type") == "deepseek_v3":
        return common | {
            # transformers' V3 router always scores by sigmoid and ranks by the biased scores.
            "scoring_func": config.get("scoring_func", "sigmoid") != "sigmoid",
            "topk_method": config.get("topk_method", "noaux_tc") != "noaux_tc",
            # The latent attention pairs rotary dimensions as V2 does (interleaved).
            "rope_interleave": not config.get("rope_interleave", True),
        }
    return common | {
        "norm_topk_prob": bool(config.get("norm_topk_prob", False)),
        "topk_method": config.get("topk_method") == "noaux_tc",  # V3's routing, not V2's
        # DeepSeek's remote-code configs name the router's scoring; V2 scores by softmax.
        "scoring_func": config.get("scoring_func", "softmax") != "softmax",
    }
