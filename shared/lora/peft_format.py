"""An adapter in PEFT's format -> per-layer, per-projection A and B, scale folded into B.

A PEFT LoRA directory holds `adapter_config.json` and `adapter_model.safetensors` with tensors

    base_model.model.model.layers.{i}.self_attn.q_proj.lora_A.weight   [r, in]
    base_model.model.model.layers.{i}.self_attn.q_proj.lora_B.weight   [out, r]

and the adapted projection is W x + scale * B A x, scale = lora_alpha / r (lora_alpha / sqrt(r)
with use_rslora). What changes the product in ways this engine does not run is refused with a
ValueError naming it: DoRA, trained biases, modules_to_save, alpha_pattern, fan_in_fan_out,
targets other than the attention and MLP projections.
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass
from typing import Any

import torch

# The projections an adapter may target, as PEFT names them.
TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
_KEY = re.compile(
    r"^(?:base_model\.model\.)?model\.layers\.(\d+)\.\w+\.(\w+)\.lora_([AB])\.weight$"
)


@dataclass(frozen=True)
class LoRAModule:
    """One adapted projection: delta = x @ a.T @ b.T."""

    a: torch.Tensor  # [rank, in]
    b: torch.Tensor  # [out, rank], scale already multiplied in


@dataclass(frozen=True)
class LoRAWeights:
    """An adapter loaded on the host: its rank (the largest of its modules') and modules."""

    rank: int
    modules: dict[tuple[int, str], LoRAModule]  # (layer index, PEFT module name) -> weights

    @property
    def nbytes(self) -> int:
        return sum(m.a.nbytes + m.b.nbytes for m in self.modules.values())


def load_peft_adapter(path: str, max_rank: int, num_layers: int, dtype: torch.dtype) -> LoRAWeights:
    """Reads and checks the adapter in directory `path`; ValueError for anything this engine
    cannot run as the adapter was trained (rank above `max_rank` included)."""
    config = _read_config(path)
    _check_config(config, path)
    weights_path = os.path.join(path, WEIGHTS_FILE)
    if not os.path.isfile(weights_path):
        raise ValueError(f"LoRA adapter {path!r} has no {WEIGHTS_FILE}")
    from safetensors.torch import load_file  # lazy: torch, which reading the config does without

    tensors = load_file(weights_path)
    pairs = _pair_tensors(tensors, path, num_layers)
    modules = {key: _module(a, b, config, max_rank, path, key) for key, (a, b) in pairs.items()}
    if not modules:
        raise ValueError(f"LoRA adapter {path!r} has no lora_A/lora_B weights")
    modules = {key: LoRAModule(m.a.to(dtype), m.b.to(dtype)) for key, m in modules.items()}
    return LoRAWeights(max(m.a.shape[0] for m in modules.values()), modules)


def _read_config(path: str) -> dict[str, Any]:
    config_path = os.path.join(path, CONFIG_FILE)
    if not os.path.isfile(config_path):
        raise ValueError(f"LoRA adapter {path!r} has no {CONFIG_FILE}")
    with open(config_path, encoding="utf-8") as file:
        config = json.load(file)
    if not isinstance(config, dict):
        raise ValueError(f"{config_path} is not a JSON object")
    return config


def _check_config(config: dict[str, Any], path: str) -> None:
    refusals = {
        "use_dora": "DoRA adapters",
        "modules_to_save": "modules_to_save (fully trained extra modules)",
        "alpha_pattern": "alpha_pattern (per-module lora_alpha)",
        "fan_in_fan_out": "fan_in_fan_out (Conv1D-style weights)",
        "lora_bias": "trained LoRA biases",
    }
    for key, what in refusals.items():
        if config.get(key):
            raise ValueError(f"LoRA adapter {path!r}: {what} are not supported")
    if config.get("peft_type", "LORA") != "LORA":
        peft_type = config.get("peft_type")
        raise ValueError(f"LoRA adapter {path!r}: peft_type {peft_type!r} is not LORA")
    if config.get("bias", "none") != "none":
        raise ValueError(f"LoRA adapter {path!r}: bias {config.get('bias')!r} is not supported")
    if not isinstance(config.get("lora_alpha", 8), int | float):
        raise ValueError(f"LoRA adapter {path!r}: lora_alpha must be a number")


def _pair_tensors(
    tensors: dict[str, torch.Tensor], path: str, num_layers: int
) -> dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]:
    halves: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for name, tensor in tensors.items():
        match = _KEY.match(name)
        if match is None:
            raise ValueError(f"LoRA adapter {path!r}: unsupported tensor {name!r}")
        layer, module, half = int(match[1]), match[2], match[3]
        if module not in TARGET_MODULES:
            raise ValueError(
                f"LoRA adapter {path!r} targets {module!r}; supported: {', '.join(TARGET_MODULES)}"
            )
        if layer >= num_layers:
            raise ValueError(f"LoRA adapter {path!r} has layer {layer}; the model has {num_layers}")
        halves.setdefault((layer, module), {})[half] = tensor
    pairs = {}
    for key, found in halves.items():
        if set(found) != {"A", "B"}:
            raise ValueError(f"LoRA adapter {path!r}: {key} lacks lora_A or lora_B")
        pairs[key] = (found["A"], found["B"])
    return pairs


def _module(
    a: torch.Tensor,
    b: torch.Tensor,
    config: dict[str, Any],
    max_rank: int,
    path: str,
    key: tuple[int, str],
) -> LoRAModule:
    if a.dim() != 2 or b.dim() != 2 or a.shape[0] != b.shape[1]:
        raise ValueError(
            f"LoRA adapter {path!r}: {key} has lora_A {tuple(a.shape)} and lora_B "
            f"{tuple(b.shape)}, not [r, in] and [out, r]"
        )
    rank = a.shape[0]
    if rank > max_rank:
        raise ValueError(
            f"LoRA adapter {path!r} has rank {rank}, above this engine's max_lora_rank {max_rank}"
        )
    alpha = float(config.get("lora_alpha", 8))
    scale = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    return LoRAModule(a.float(), b.float() * scale)
