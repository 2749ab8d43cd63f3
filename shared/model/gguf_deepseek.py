"""DeepSeek-V2/V3 GGUF files (llama.cpp's `deepseek2` architecture) in the Hugging Face terms
the DeepSeek loader speaks (shared/model/hf_deepseek.py): the metadata becomes the config.json a
Hugging Face directory would have, and the tensors their checkpoint names.

What llama.cpp's converter writes (convert_hf_to_gguf.py, DeepseekV2Model):
- `deepseek2.attention.{q_lora_rank, kv_lora_rank}`, `rope.dimension_count` (qk_rope_head_dim),
  the experts' counts and sizes, `leading_dense_block_count` (first_k_dense_replace),
  `expert_weights_scale` (routed_scaling_factor), `expert_weights_norm` (norm_topk_prob, when
  set), `expert_gating_func` (1 softmax: V2; 2 sigmoid: V3's routing), the groups, and yarn's
  factor, original length, betas and `yarn_log_multiplier` (0.1 * mscale_all_dim).
- Since llama.cpp's MLA support, `key_length_mla` / `value_length_mla` hold qk_nope + qk_rope and
  v_head_dim (key_length and value_length then describe the latent), and each layer's
  kv_b_proj is split per head into `attn_k_b` ([heads, kv_lora_rank, qk_nope], transposed) and
  `attn_v_b` ([heads, v_head_dim, kv_lora_rank]); older files have `attn_kv_b` whole and
  key_length = qk_nope + qk_rope.
- No row is permuted: llama.cpp rotates DeepSeek's rope dimensions in interleaved pairs, as
  the checkpoint (and transformers) does.

Files from before llama.cpp wrote the expert groups and the gating function have neither:
they read as softmax routing without groups (group_limited_greedy becomes greedy), which is
what llama.cpp computes for them too.

The tokenizer: llama.cpp names DeepSeek's own pre-tokenizers, `deepseek-llm` (V2, V2-Lite) and
`deepseek-v3` (V3, R1); shared/tokenizer_gguf.py builds both.

yarn: the file has no `mscale`; llama.cpp's graph scales the softmax by mscale_all_dim's factor
squared and leaves cos/sin unscaled, which is transformers' yarn with mscale = mscale_all_dim
(DeepSeek-V2's 0.707 and 0.707, V3's 1 and 1), so that is what the config gets.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from splitserve.engine.gguf_metadata import GGUFMetadata

ARCH = "deepseek2"
# llama.cpp's expert_gating_func: 1 softmax (V2; files without the key are V2), 2 sigmoid (V3).
_SOFTMAX, _SIGMOID = 1, 2
# DeepSeek's own tensors; the rest (attn_output, the norms, the dense MLP, the stacked experts
# and the router) have the names shared/model/gguf_loader.py and gguf_moe.py give every family.
_ATTENTION = {
    "attn_q_a": "self_attn.q_a_proj",
    "attn_q_a_norm": "self_attn.q_a_layernorm",
    "attn_q_b": "self_attn.q_b_proj",
    "attn_q": "self_attn.q_proj",
    "attn_kv_a_mqa": "self_attn.kv_a_proj_with_mqa",
    "attn_kv_a_norm": "self_attn.kv_a_layernorm",
    "attn_kv_b": "self_attn.kv_b_proj",
}
_SHARED_EXPERTS = {  # ungated, plural (Qwen2-MoE's are mlp.shared_expert.*)
    "ffn_gate_shexp": "mlp.shared_experts.gate_proj",
    "ffn_up_shexp": "mlp.shared_experts.up_proj",
    "ffn_down_shexp": "mlp.shared_experts.down_proj",
}


def deepseek_config(meta: GGUFMetadata, vocab_size: int, tied: bool) -> dict[str, Any]:
    """The config.json of the file's model (module docstring)."""

    def get(key: str, default: Any = None) -> Any:
        return meta.get(f"{ARCH}.{key}", default)

    def need(key: str) -> Any:
        return meta.require(f"{ARCH}.{key}")

    rope_dim = int(need("rope.dimension_count"))
    mla_layout = get("attention.key_length_mla") is not None
    key_length = int(need("attention.key_length_mla" if mla_layout else "attention.key_length"))
    v_head_dim = int(need("attention.value_length_mla" if mla_layout else "attention.value_length"))
    gating = int(get("expert_gating_func", _SOFTMAX))
    if gating not in (_SOFTMAX, _SIGMOID):
        raise ValueError(
            f"{ARCH} file: expert_gating_func {gating} is not supported (1 softmax: "
            "DeepSeek-V2; 2 sigmoid: DeepSeek-V3)"
        )
    is_v3 = gating == _SIGMOID
    num_groups = int(get("expert_group_count", 1) or 1)
    q_lora_rank = get("attention.q_lora_rank")
    config: dict[str, Any] = {
        "model_type": "deepseek_v3" if is_v3 else "deepseek_v2",
        "vocab_size": vocab_size,
        "hidden_size": int(need("embedding_length")),
        "intermediate_size": int(need("feed_forward_length")),
        "moe_intermediate_size": int(need("expert_feed_forward_length")),
        "num_hidden_layers": int(need("block_count")),
        "num_attention_heads": int(need("attention.head_count")),
        "q_lora_rank": None if q_lora_rank is None else int(q_lora_rank),
        "kv_lora_rank": int(need("attention.kv_lora_rank")),
        "qk_rope_head_dim": rope_dim,
        "qk_nope_head_dim": key_length - rope_dim,
        "v_head_dim": v_head_dim,
        "n_routed_experts": int(need("expert_count")),
        "num_experts_per_tok": int(need("expert_used_count")),
        "n_shared_experts": int(get("expert_shared_count", 0)),
        "first_k_dense_replace": int(get("leading_dense_block_count", 0)),
        "routed_scaling_factor": float(get("expert_weights_scale", 1.0)),
        "norm_topk_prob": bool(get("expert_weights_norm", False)),
        "n_group": num_groups,
        "topk_group": int(get("expert_group_used_count", 1) or 1),
        "rms_norm_eps": float(need("attention.layer_norm_rms_epsilon")),
        "rope_theta": float(get("rope.freq_base", 10000.0)),
        "max_position_embeddings": int(need("context_length")),
        "tie_word_embeddings": tied,
        "rope_scaling": _yarn(get),
    }
    if not is_v3:
        config["topk_method"] = "group_limited_greedy" if num_groups > 1 else "greedy"
    config["num_key_value_heads"] = config["num_attention_heads"]
    return config


def _yarn(get: Any) -> dict[str, Any] | None:
    if get("rope.scaling.type") != "yarn":
        return None
    for key in ("rope.scaling.factor", "rope.scaling.original_context_length"):
        if get(key) is None:
            raise ValueError(f"{ARCH} file: yarn rope scaling without {ARCH}.{key}")
    mscale_all_dim = float(get("rope.scaling.yarn_log_multiplier", 0.0)) / 0.1
    return {
        "type": "yarn",
        "factor": float(get("rope.scaling.factor")),
        "original_max_position_embeddings": int(get("rope.scaling.original_context_length")),
        "beta_fast": float(get("rope.scaling.yarn_beta_fast", 32.0)),
        "beta_slow": float(get("rope.scaling.yarn_beta_slow", 1.0)),
        "mscale": mscale_all_dim,  # as llama.cpp's graph computes (module docstring)
        "mscale_all_dim": mscale_all_dim,
    }


class DeepSeekTensors:
    """A layer's DeepSeek-only GGUF tensors -> checkpoint tensors, one at a time in file order;
    a layer's attn_k_b and attn_v_b wait for each other and come out as its kv_b_proj."""

    def __init__(self) -> None:
        self._halves: dict[int, dict[str, np.ndarray]] = {}

    def split(self, name: str, values: np.ndarray) -> dict[str, np.ndarray] | None:
        """The checkpoint tensors of `blk.N.*` tensor `name` ({} while it waits for its other
        half), or None for a tensor every family names alike."""
        parts = name.split(".")
        if len(parts) != 4 or parts[0] != "blk":
            return None
        layer, kind, suffix = int(parts[1]), parts[2], parts[3]
        prefix = f"model.layers.{layer}."
        if kind in _ATTENTION:
            return {f"{prefix}{_ATTENTION[kind]}.{suffix}": values}
        if kind in _SHARED_EXPERTS:
            return {f"{prefix}{_SHARED_EXPERTS[kind]}.{suffix}": values}
        if kind == "exp_probs_b":  # V3's per-expert bias on the choice
            return {f"{prefix}mlp.gate.e_score_correction_bias": values}
        if kind in ("attn_k_b", "attn_v_b"):
            return self._kv_b(prefix, layer, kind, values)
        return None

    def check_done(self) -> None:
        if self._halves:
            layers = sorted(self._halves)
            raise ValueError(f"{ARCH} file: layers {layers} have attn_k_b or attn_v_b alone")

    def _kv_b(
        self, prefix: str, layer: int, kind: str, values: np.ndarray
    ) -> dict[str, np.ndarray]:
        """kv_b_proj [heads * (qk_nope + v), kv_lora_rank] once both halves are in: per head
        the key rows (attn_k_b transposed back) and then the value rows."""
        halves = self._halves.setdefault(layer, {})
        halves[kind] = values
        if len(halves) < 2:
            return {}
        del self._halves[layer]
        keys = halves["attn_k_b"].transpose(0, 2, 1)  # [heads, qk_nope, rank]
        joined = np.concatenate([keys, halves["attn_v_b"]], axis=1)
        return {f"{prefix}self_attn.kv_b_proj.weight": joined.reshape(-1, joined.shape[2])}
