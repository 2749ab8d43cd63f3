"""Loads a Hugging Face checkpoint directory (config.json + safetensors) as float32.

Accepts single-file and sharded (`model.safetensors.index.json`) safetensors, both spellings of
RoPE settings (transformers 5's `rope_parameters` with `rope_theta` inside; older `rope_theta` +
`rope_scaling`), the dense families Llama, Mistral, Qwen2/3, Phi-3 and Gemma 2/3
(shared/model/hf_families.py) and the mixture-of-experts families Mixtral, Qwen2-MoE and
Qwen3-MoE (docs/moe.md) where every layer is sparse. docs/models.md lists what is refused.
"""

from __future__ import annotations

import json
import os
from typing import Any

import torch
from safetensors import safe_open

from splitserve.engine.model import hf_deepseek, hf_families
from splitserve.engine.model.architecture import (
    LoadedCheckpoint,
    ModelArchitecture,
    MoEConfig,
    RopeScaling,
)
from splitserve.engine.progress import ProgressFn
from splitserve.engine.tokenizer import Tokenizer

# config.json's model_type -> the decoder family that runs it.
_FAMILY_OF_MODEL_TYPE = {
    "llama": "llama",
    "mistral": "llama",
    "qwen2": "llama",
    "qwen3": "llama",
    "phi3": "llama",
    "gemma2": "llama",
    "gemma3_text": "llama",
    "mixtral": "mixtral",
    "qwen2_moe": "qwen2_moe",
    # Qwen2-MoE's sparse block without its shared expert (same tensor names).
    "qwen3_moe": "qwen2_moe",
    # Latent attention and its page layout, grouped routing, dense layers first.
    "deepseek_v2": "deepseek_v2",
    "deepseek_v3": "deepseek_v2",  # V2's parts, V3's routing (hf_deepseek.py)
}
# Families whose extra parts shared/model/hf_families.py reads.
_EXTENDED = ("qwen2", "qwen3", "qwen3_moe", "mistral", "phi3", "gemma2", "gemma3_text")
SUPPORTED_MODEL_TYPES = tuple(_FAMILY_OF_MODEL_TYPE)
_SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "longrope")
_SINGLE_FILE = "model.safetensors"
_INDEX_FILE = "model.safetensors.index.json"


def load_hf_dir(path: str, progress: ProgressFn | None = None) -> LoadedCheckpoint:
    """Reads config, tokenizer and weights of the checkpoint in directory `path`."""
    config = _read_config(path)
    tokenizer = Tokenizer.from_hf_dir(path)
    architecture = architecture_from_config(config, tokenizer)
    weights = _read_weights(path, architecture.tie_word_embeddings, progress)
    hf_families.to_llama_weights(config, weights)
    return LoadedCheckpoint(
        architecture=architecture, weights=weights, tokenizer=tokenizer, source=os.fspath(path)
    )


def architecture_from_config(config: dict[str, Any], tokenizer: Tokenizer) -> ModelArchitecture:
    """`ModelArchitecture` from a parsed config.json; raises ValueError naming what is not
    supported (another model type, or a setting our decoder does not compute)."""
    _check_supported(config)
    family = _FAMILY_OF_MODEL_TYPE[config["model_type"]]
    hidden_size = int(config["hidden_size"])
    num_heads = int(config["num_attention_heads"])
    rope_theta, rope_scaling = _rope_settings(config)
    extra = hf_families.family_fields(config) if config["model_type"] in _EXTENDED else {}
    if config["model_type"] in hf_deepseek.MODEL_TYPES:
        extra = hf_deepseek.family_fields(config, rope_scaling)
    fields: dict[str, Any] = dict(
        name=str(config["model_type"]),
        vocab_size=int(config["vocab_size"]),
        hidden_size=hidden_size,
        intermediate_size=int(config["intermediate_size"]),
        num_layers=int(config["num_hidden_layers"]),
        num_heads=num_heads,
        num_kv_heads=int(config.get("num_key_value_heads") or num_heads),
        head_dim=int(config.get("head_dim") or hidden_size // num_heads),
        rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
        rope_theta=rope_theta,
        max_position_embeddings=int(config["max_position_embeddings"]),
        tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
        bos_token_id=_bos_token_id(config, tokenizer),
        eos_token_ids=_eos_token_ids(config, tokenizer),
        rope_scaling=rope_scaling,
        family=family,
        moe=_moe_config(config, family),
        attention_bias=_qwen2_moe_bias(config),
    )
    return ModelArchitecture(**(fields | extra))


def _qwen2_moe_bias(config: dict[str, Any]) -> bool:
    return config["model_type"] == "qwen2_moe" and bool(config.get("qkv_bias", True))


def _moe_config(config: dict[str, Any], family: str) -> MoEConfig | None:
    if family == "mixtral":
        return MoEConfig(
            num_experts=_required_int(config, "num_local_experts"),
            num_experts_per_tok=_required_int(config, "num_experts_per_tok"),
            expert_intermediate_size=_required_int(config, "intermediate_size"),
            norm_topk_prob=True,
        )
    if family == "qwen2_moe":
        if "num_experts" not in config and "num_local_experts" in config:  # transformers 5
            config = {**config, "num_experts": config["num_local_experts"]}
        return MoEConfig(
            num_experts=_required_int(config, "num_experts"),
            num_experts_per_tok=_required_int(config, "num_experts_per_tok"),
            expert_intermediate_size=_required_int(config, "moe_intermediate_size"),
            norm_topk_prob=bool(config.get("norm_topk_prob", False)),
            shared_expert_intermediate_size=int(config.get("shared_expert_intermediate_size", 0)),
        )
    return None


def _required_int(config: dict[str, Any], key: str) -> int:
    if not isinstance(config.get(key), int):
        raise ValueError(f"{config['model_type']} config needs an integer {key!r}")
    return config[key]


def _read_config(path: str) -> dict[str, Any]:
    config_file = os.path.join(path, "config.json")
    if not os.path.isfile(config_file):
        raise ValueError(f"{os.fspath(path)!r} has no config.json")
    with open(config_file, encoding="utf-8") as f:
        return json.load(f)


def _check_supported(config: dict[str, Any]) -> None:
    model_type = config.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(
            f"unsupported model_type {model_type!r} (architectures "
            f"{config.get('architectures')}); supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    unsupported = [name for name, differs in _differences(config).items() if differs]
    if unsupported:
        raise ValueError(
            f"{model_type} config sets {', '.join(unsupported)}, which this "
            f"{_FAMILY_OF_MODEL_TYPE[model_type]} implementation does not support"
        )


def _differences(config: dict[str, Any]) -> dict[str, bool]:
    """Settings that would change the computation our decoder performs, by name."""
    common = {"mlp_bias": bool(config.get("mlp_bias", False))}
    if config["model_type"] in hf_deepseek.MODEL_TYPES:
        return common | hf_deepseek.differences(config)
    if config["model_type"] in _EXTENDED:
        return common | hf_families.differences(config)
    common["hidden_act"] = config.get("hidden_act", "silu") != "silu"
    if config["model_type"] != "qwen2_moe":
        return common | {
            "sliding_window": config.get("sliding_window") is not None,
            "attention_bias": bool(config.get("attention_bias", False)),
        }
    # Qwen2-MoE keeps sliding_window set even when off; use_sliding_window says.
    return common | {
        "use_sliding_window": bool(config.get("use_sliding_window", False)),
        "mlp_only_layers": bool(config.get("mlp_only_layers")),
        "decoder_sparse_step": int(config.get("decoder_sparse_step", 1)) != 1,
        "num_experts": int(config.get("num_experts", 0)) < 1,
        "layer_types": any(t != "full_attention" for t in config.get("layer_types") or []),
    }


def _rope_settings(config: dict[str, Any]) -> tuple[float, RopeScaling]:
    params = config.get("rope_parameters")
    if isinstance(params, dict) and isinstance(params.get("full_attention"), dict):
        params = params["full_attention"]  # per layer type (Gemma 3): the global layers'
    if isinstance(params, dict):  # transformers 5: theta and scaling in one dict
        theta = params.get("rope_theta", config.get("rope_theta", 10000.0))
        return float(theta), _rope_scaling(params, config)
    scaling = config.get("rope_scaling")
    return float(config.get("rope_theta", 10000.0)), _rope_scaling(scaling or {}, config)


def _rope_scaling(params: dict[str, Any], config: dict[str, Any]) -> RopeScaling:
    # Older configs spell the kind "type", newer ones "rope_type".
    rope_type = params.get("rope_type", params.get("type", "default"))
    supported: tuple[str, ...] = _SUPPORTED_ROPE_TYPES
    if config.get("model_type") in hf_deepseek.MODEL_TYPES:
        supported = (*supported, "yarn")  # checked against transformers for DeepSeek only
    if rope_type not in supported:
        raise ValueError(
            f"unsupported rope_type {rope_type!r}; supported: {', '.join(supported)}"
        )
    if rope_type == "default":
        return RopeScaling()
    if rope_type == "longrope":
        return hf_families.longrope_scaling(config, params)
    if rope_type == "yarn":
        return hf_deepseek.yarn_scaling(config, params)
    defaults = RopeScaling()
    return RopeScaling(
        rope_type=rope_type,
        factor=float(params.get("factor", defaults.factor)),
        low_freq_factor=float(params.get("low_freq_factor", defaults.low_freq_factor)),
        high_freq_factor=float(params.get("high_freq_factor", defaults.high_freq_factor)),
        original_max_position_embeddings=int(
            params.get(
                "original_max_position_embeddings", defaults.original_max_position_embeddings
            )
        ),
    )


def _bos_token_id(config: dict[str, Any], tokenizer: Tokenizer) -> int | None:
    if tokenizer.bos_token_id is not None:
        return tokenizer.bos_token_id
    bos = config.get("bos_token_id")
    return bos if isinstance(bos, int) else None


def _eos_token_ids(config: dict[str, Any], tokenizer: Tokenizer) -> tuple[int, ...]:
    config_eos = config.get("eos_token_id")
    extra = [config_eos] if isinstance(config_eos, int) else list(config_eos or [])
    return tuple(dict.fromkeys([*tokenizer.eos_token_ids, *extra]))


def _weight_files(path: str) -> list[str]:
    index_file = os.path.join(path, _INDEX_FILE)
    if os.path.isfile(index_file):
        with open(index_file, encoding="utf-8") as f:
            shards = sorted(set(json.load(f)["weight_map"].values()))
        return [os.path.join(path, shard) for shard in shards]
    single = os.path.join(path, _SINGLE_FILE)
    if os.path.isfile(single):
        return [single]
    raise ValueError(f"{os.fspath(path)!r} has neither {_SINGLE_FILE} nor {_INDEX_FILE}")


def _is_skipped(name: str, tie_word_embeddings: bool) -> bool:
    # Rotary inverse frequencies are recomputed from the config; a tied lm_head is the
    # embedding again, so the weights dict carries it once.
    is_tied_head = tie_word_embeddings and name == "lm_head.weight"
    return name.endswith("rotary_emb.inv_freq") or is_tied_head


def _read_weights(
    path: str, tie_word_embeddings: bool, progress: ProgressFn | None
) -> dict[str, torch.Tensor]:
    files = _weight_files(path)
    names_per_file = []
    for file in files:
        with safe_open(file, framework="pt") as f:
            names = [n for n in f.keys() if not _is_skipped(n, tie_word_embeddings)]  # noqa: SIM118
            names_per_file.append(names)
    total = sum(len(names) for names in names_per_file)
    weights: dict[str, torch.Tensor] = {}
    for file, names in zip(files, names_per_file):
        with safe_open(file, framework="pt") as f:
            for name in names:
                weights[name] = f.get_tensor(name).to(torch.float32)
                if progress is not None:
                    progress(len(weights), total, name)
    return weights
