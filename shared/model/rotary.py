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
    if scaling.rope_type == "longrope":
        return inv_freq / torch.tensor(scaling.short_factor, dtype=torch.float32)
    if scaling.rope_type == "yarn":
        return _yarn_scaled(inv_freq, head_dim, theta, scaling)
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


def _yarn_scaled(
    inv_freq: torch.Tensor, head_dim: int, theta: float, s: RopeScaling
) -> torch.Tensor:
    # yarn (DeepSeek): frequencies that turn fewer than beta_slow times over the original length
    # are interpolated (divided by `factor`), those that turn more than beta_fast times kept,
    # and the dimensions between blended along a linear ramp.
    def dim_of(rotations: float) -> float:
        turns = s.original_max_position_embeddings / (rotations * 2 * math.pi)
        return head_dim * math.log(turns) / (2 * math.log(theta))

    low, high = dim_of(s.beta_fast), dim_of(s.beta_slow)
    if s.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # as transformers does, against a zero-width ramp
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp
    return inv_freq / s.factor * (1 - keep) + inv_freq * keep


def _angles(positions: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    freqs = torch.outer(positions, inv_freq)  # [num_positions, head_dim // 2]
    return torch.cat((freqs, freqs), dim=-1)


def _longrope_angles(
    positions: torch.Tensor, head_dim: int, theta: float, s: RopeScaling
) -> torch.Tensor:
    """Phi-3's longrope: short factors below the original length, long ones from it. Chosen per
    position (transformers picks one set per forward by the longest position, so a sequence
    that crosses the original length differs there; below it the two agree exactly)."""
    base = inverse_frequencies(head_dim, theta, RopeScaling())
    short = _angles(positions, base / torch.tensor(s.short_factor, dtype=torch.float32))
    long = _angles(positions, base / torch.tensor(s.long_factor, dtype=torch.float32))
    is_long = (positions >= s.original_max_position_embeddings).unsqueeze(1)
    return torch.where(is_long, long, short)


class RotaryEmbedding:
    """Precomputed cos/sin per position; applied to flattened ragged batches by position id."""

    def __init__(
        self,
        arch: ModelArchitecture,
        max_positions: int,
        device: torch.device,
        theta: float | None = None,  # another base, unscaled (Gemma 3's window layers)
    ) -> None:
        positions = torch.arange(max_positions, dtype=torch.float32)
        scaling = arch.rope_scaling if theta is None else RopeScaling()
        theta = arch.rope_theta if theta is None else theta
        if scaling.rope_type == "longrope":
            angles = _longrope_angles(positions, arch.head_dim, theta, scaling)
        else:
            angles = _angles(positions, inverse_frequencies(arch.head_dim, theta, scaling))
        # Each row's two halves are the same angles (`_angles`), so only the first is kept:
        # half the table, which at 128k positions of 128 dims is 64 MiB of float32 saved.
        half = angles[:, : angles.shape[1] // 2]
        # longrope scales cos and sin themselves (1.0 for every other kind).
        self.cos_half = (half.cos() * scaling.attention_factor).to(device)  # [positions, dim/2]
        self.sin_half = (half.sin() * scaling.attention_factor).to(device)

    def lookup(self, positions: torch.Tensor, dtype: torch.dtype) -> RotaryAngles:
        """The step's cos/sin, looked up once and shared by every layer."""
        cos = self.cos_half[positions].to(dtype)
        sin = self.sin_half[positions].to(dtype)
        # [num_tokens, 1, head_dim], as `_rotate` and the fused kernels read them.
        return RotaryAngles(
            torch.cat((cos, cos), -1).unsqueeze(1), torch.cat((sin, sin), -1).unsqueeze(1)
        )


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
