"""Rotary position embeddings in Hugging Face's rotate-half layout, with config-driven scaling."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from splitserve.engine.model.architecture import ModelArchitecture, RopeScaling


def inverse_frequencies(head_dim: int, theta: float, scaling: RopeScaling) -> torch.Tensor:
    """[head_dim // 2] float32 inverse frequencies after the model's scaling rule."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    inv_freq = 1.0 / (theta**exponents)
    if scaling.rope_type in ("default", ""):
        return inv_freq
    if scaling.rope_type == "linear":
        return inv_freq / scaling.factor
    if scaling.rope_type == "llama3":
        return _llama3_scaled(inv_freq, scaling)
    raise ValueError(f"rope_scaling type {scaling.rope_type!r} is not supported")


def _llama3_scaled(inv_freq: torch.Tensor, s: RopeScaling) -> torch.Tensor:
    # Long wavelengths are slowed by `factor`, short ones kept, and the band in between blended
    # linearly in 1/wavelength, so the model sees its trained positions unchanged at short range.
    original = s.original_max_position_embeddings
    wavelen = 2 * math.pi / inv_freq
    slow_band_start = original / s.low_freq_factor
    keep_band_end = original / s.high_freq_factor
    scaled = torch.where(wavelen > slow_band_start, inv_freq / s.factor, inv_freq)
    blend = (original / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
    blended = (1 - blend) * scaled / s.factor + blend * scaled
    in_between = (wavelen >= keep_band_end) & (wavelen <= slow_band_start)
    return torch.where(in_between, blended, scaled)


class RotaryEmbedding:
    """Precomputed cos/sin per position; applied to flattened ragged batches by position id."""

    def __init__(self, arch: ModelArchitecture, max_positions: int, device: torch.device) -> None:
        inv_freq = inverse_frequencies(arch.head_dim, arch.rope_theta, arch.rope_scaling)
        positions = torch.arange(max_positions, dtype=torch.float32)
        freqs = torch.outer(positions, inv_freq)  # [max_positions, head_dim // 2]
        angles = torch.cat((freqs, freqs), dim=-1)
        self.cos = angles.cos().to(device)  # [max_positions, head_dim]
        self.sin = angles.sin().to(device)

    def lookup(self, positions: torch.Tensor, dtype: torch.dtype) -> RotaryAngles:
        """The step's cos/sin, looked up once and shared by every layer."""
        cos = self.cos[positions].unsqueeze(1).to(dtype)  # [num_tokens, 1, head_dim]
        sin = self.sin[positions].unsqueeze(1).to(dtype)
        return RotaryAngles(cos, sin)


@dataclass(frozen=True)
class RotaryAngles:
    cos: torch.Tensor  # [num_tokens, 1, head_dim]
    sin: torch.Tensor

    def apply(self, query: torch.Tensor, key: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # query: [num_tokens, num_heads, head_dim], key: [num_tokens, num_kv_heads, head_dim]
        return _rotate(query, self.cos, self.sin), _rotate(key, self.cos, self.sin)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated_half = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated_half * sin
