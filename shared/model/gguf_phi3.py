"""Phi-3 GGUF files (llama.cpp's `phi3` architecture), under the contract the Hugging Face
Phi-3 loader keeps (shared/model/hf_families.py): Llama's decoder, its fused matrices split.

What the file holds beyond a llama file, as llama.cpp's converter writes it:
- `blk.N.attn_qkv`: q, k and v rows in one matrix, in that order; `blk.N.ffn_up`: gate's rows
  then up's (llama.cpp's SwiGLU takes the first half as the gate, as Phi3MLP does). Both are
  split here into Llama's names. llama.cpp runs Phi-3's rotary rotate-half, so q/k rows are in
  Hugging Face's order (no permutation to undo);
- longrope (the 128k models): the per-frequency divisors as two tensors, `rope_factors_long`
  and `rope_factors_short`, with `phi3.rope.scaling.original_context_length` and the attention
  factor in the metadata; the model's context length over the original gives the factor;
- `phi3.attention.sliding_window`: a window on every layer (the 4k models).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from splitserve.engine.gguf_file import GGUFSource
from splitserve.engine.gguf_metadata import GGUFMetadata
from splitserve.engine.model.architecture import RopeScaling

ARCH = "phi3"
ROPE_FACTOR_TENSORS = {"long": "rope_factors_long.weight", "short": "rope_factors_short.weight"}


def phi3_fields(reader: GGUFSource, num_layers: int, head_dim: int) -> dict[str, Any]:
    """The `ModelArchitecture` fields a phi3 file sets beyond llama's."""
    meta = GGUFMetadata(reader)
    window = int(meta.get(f"{ARCH}.attention.sliding_window", 0) or 0)
    fields: dict[str, Any] = {"layer_windows": (window,) * num_layers if window else ()}
    factors = _rope_factors(reader)
    if factors:
        fields["rope_scaling"] = _longrope(meta, factors, head_dim)
    return fields


def _rope_factors(reader: GGUFSource) -> dict[str, tuple[float, ...]]:
    by_name = {tensor.name: tensor for tensor in reader.tensors}
    found = {kind: by_name.get(name) for kind, name in ROPE_FACTOR_TENSORS.items()}
    if not any(found.values()):
        return {}
    if not all(found.values()):
        raise ValueError("a phi3 GGUF file needs both rope_factors_long and rope_factors_short")
    return {
        kind: tuple(float(x) for x in np.asarray(tensor.data, dtype=np.float32).ravel())
        for kind, tensor in found.items()
        if tensor is not None
    }


def _longrope(
    meta: GGUFMetadata, factors: dict[str, tuple[float, ...]], head_dim: int
) -> RopeScaling:
    for kind, values in factors.items():
        if len(values) != head_dim // 2:
            raise ValueError(
                f"rope_factors_{kind} has {len(values)} values; longrope needs head_dim / 2 = "
                f"{head_dim // 2}"
            )
    context = int(meta.require(f"{ARCH}.context_length"))
    original = int(meta.get(f"{ARCH}.rope.scaling.original_context_length", context))
    factor = context / original
    default_attention = 1.0 if factor <= 1 else math.sqrt(1 + math.log(factor) / math.log(original))
    attention = float(meta.get(f"{ARCH}.rope.scaling.attn_factor", default_attention))
    return RopeScaling(
        rope_type="longrope",
        factor=factor,
        original_max_position_embeddings=original,
        short_factor=factors["short"],
        long_factor=factors["long"],
        attention_factor=attention,
    )


def split_fused(
    name: str, values: np.ndarray, num_heads: int, num_kv_heads: int, head_dim: int
) -> dict[str, np.ndarray] | None:
    """`blk.N.attn_qkv` or `blk.N.ffn_up` of a phi3 file as Hugging Face Llama's tensors;
    None for any other tensor."""
    parts = name.split(".")
    if len(parts) != 4 or parts[0] != "blk":
        return None
    prefix = f"model.layers.{parts[1]}"
    if parts[2] == "attn_qkv":
        q_rows, kv_rows = num_heads * head_dim, num_kv_heads * head_dim
        if values.shape[0] != q_rows + 2 * kv_rows:
            raise ValueError(f"{name}: {values.shape[0]} rows, expected {q_rows + 2 * kv_rows}")
        q, k, v = np.split(values, [q_rows, q_rows + kv_rows])
        return {
            f"{prefix}.self_attn.{part}_proj.{parts[3]}": np.ascontiguousarray(rows)
            for part, rows in zip("qkv", (q, k, v))
        }
    if parts[2] == "ffn_up":
        gate, up = np.split(values, 2)
        return {
            f"{prefix}.mlp.gate_proj.{parts[3]}": np.ascontiguousarray(gate),
            f"{prefix}.mlp.up_proj.{parts[3]}": np.ascontiguousarray(up),
        }
    return None
