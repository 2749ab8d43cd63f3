"""What a loader hands the engine: the architecture numbers and the weights, in one contract.

Weights use Hugging Face Llama names (`model.layers.{i}.self_attn.q_proj.weight`, ...) with
Hugging Face's rotary convention (rotate-half), whatever file they came from: the GGUF loader
undoes llama.cpp's Q/K row permutation so one model implementation serves both sources.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from shared.model.gguf_blocks import BlockQuantized
    from shared.tokenizer import Tokenizer


@dataclass(frozen=True)
class RopeScaling:
    """RoPE frequency scaling as Hugging Face's `rope_scaling` describes it."""

    rope_type: str = "default"  # "default", "linear" or "llama3"
    factor: float = 1.0
    # llama3 only: the band of wavelengths that is interpolated smoothly.
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass(frozen=True)
class ModelArchitecture:
    name: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    rope_scaling: RopeScaling = field(default_factory=RopeScaling)

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of "
                f"num_kv_heads ({self.num_kv_heads})"
            )

    @property
    def num_queries_per_kv(self) -> int:
        return self.num_heads // self.num_kv_heads


@dataclass
class LoadedCheckpoint:
    architecture: ModelArchitecture
    # HF-named tensors, already dequantized to float32 (the engine casts to its dtype); with
    # quantization="gguf", a GGUF file's Q4_0/Q4_1 layer matrices are `BlockQuantized` instead.
    weights: dict[str, torch.Tensor | BlockQuantized]
    tokenizer: Tokenizer
    source: str  # the file or directory the weights came from, for messages and /v1/models
