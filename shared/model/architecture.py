"""What a loader hands the engine: the architecture numbers and the weights, in one contract.

Weights use Hugging Face Llama names (`model.layers.{i}.self_attn.q_proj.weight`, ...) with
Hugging Face's rotary convention (rotate-half), whatever file they came from: the GGUF loader
undoes llama.cpp's Q/K row permutation so one model implementation serves both sources.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import Mapping

    import torch

    from splitserve.engine.model.gguf_blocks import BlockQuantized
    from splitserve.engine.tokenizer import Tokenizer


@dataclass(frozen=True)
class RopeScaling:
    """RoPE frequency scaling as Hugging Face's `rope_scaling` describes it."""

    rope_type: str = "default"  # "default", "linear", "llama3", "longrope" or "yarn"
    factor: float = 1.0
    # llama3 only: the band of wavelengths that is interpolated smoothly.
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    # longrope only (Phi-3): per-frequency divisors below and from the original length, and the
    # factor cos and sin are multiplied by.
    short_factor: tuple[float, ...] = ()
    long_factor: tuple[float, ...] = ()
    attention_factor: float = 1.0
    # yarn only (DeepSeek): the band of rotations blended between interpolation and
    # extrapolation, and DeepSeek's softmax mscale (shared/model/hf_deepseek.py).
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True
    mscale_all_dim: float = 0.0


FAMILIES = ("llama", "mixtral", "qwen2_moe", "deepseek_v2")
TOPK_METHODS = ("greedy", "group_limited_greedy", "noaux_tc")
GELU_TANH = "gelu_pytorch_tanh"  # Gemma's GeGLU gate
HIDDEN_ACTS = ("silu", GELU_TANH)


@dataclass(frozen=True)
class MoEConfig:
    """A sparse feed-forward block: a router picks `num_experts_per_tok` of `num_experts`
    SwiGLU experts for each token (docs/moe.md). Every decoder layer is sparse except
    DeepSeek's first `first_dense_layers` and those off its `sparse_layer_step` (`is_sparse`)."""

    num_experts: int
    num_experts_per_tok: int
    expert_intermediate_size: int
    # Mixtral renormalises the k chosen probabilities to sum to 1; Qwen2-MoE only if it says so.
    norm_topk_prob: bool
    # Qwen2-MoE: one dense expert every token goes through, scaled by a sigmoid gate (0 = none).
    shared_expert_intermediate_size: int = 0
    # Expert parallel (shared/parallel/moe_shard.py): this model holds experts
    # first_local_expert .. first_local_expert + num_local_experts - 1; 0 = all of them.
    first_local_expert: int = 0
    num_local_experts: int = 0
    # DeepSeek: the shared experts are added ungated (Qwen2-MoE scales by a sigmoid gate).
    shared_expert_gated: bool = True
    # DeepSeek routing: "group_limited_greedy" keeps the experts of the `topk_groups` groups
    # (of `num_groups`) with the highest best-expert score; the chosen weights are multiplied by
    # `routed_scaling_factor`. "noaux_tc" (V3): sigmoid scores, the groups and experts chosen on
    # the scores plus a learned per-expert bias (the router's `e_score_correction_bias`), a
    # group ranked by its two best experts; the weights are the chosen scores without the bias
    # (renormalised with norm_topk_prob). None: the softmax top-k of Mixtral and Qwen.
    topk_method: str | None = None
    num_groups: int = 1
    topk_groups: int = 1
    routed_scaling_factor: float = 1.0
    # DeepSeek: layers below first_dense_layers, and those whose index is not a multiple of
    # sparse_layer_step, are dense (the architecture's intermediate_size).
    first_dense_layers: int = 0
    sparse_layer_step: int = 1

    def is_sparse(self, layer: int) -> bool:
        """Whether decoder layer `layer`'s feed-forward block is the sparse one."""
        return layer >= self.first_dense_layers and layer % self.sparse_layer_step == 0

    @property
    def local_experts(self) -> range:
        """The expert indices whose weights this model holds (the router still scores all)."""
        if self.num_local_experts == 0:
            return range(self.num_experts)
        return range(self.first_local_expert, self.first_local_expert + self.num_local_experts)

    def __post_init__(self) -> None:
        if self.num_experts < 1 or self.expert_intermediate_size < 1:
            raise ValueError(
                f"num_experts ({self.num_experts}) and expert_intermediate_size "
                f"({self.expert_intermediate_size}) must be positive"
            )
        if not 1 <= self.num_experts_per_tok <= self.num_experts:
            raise ValueError(
                f"num_experts_per_tok ({self.num_experts_per_tok}) must be between 1 and "
                f"num_experts ({self.num_experts})"
            )
        if self.shared_expert_intermediate_size < 0:
            raise ValueError(
                "shared_expert_intermediate_size must be >= 0, got "
                f"{self.shared_expert_intermediate_size}"
            )
        self._check_routing()
        local_end = self.first_local_expert + self.num_local_experts
        if self.first_local_expert < 0 or self.num_local_experts < 0 or (
            local_end > self.num_experts
        ):
            raise ValueError(
                f"local experts {self.first_local_expert}..{local_end - 1} are not within the "
                f"model's {self.num_experts} experts"
            )

    def _check_routing(self) -> None:
        if self.topk_method is not None and self.topk_method not in TOPK_METHODS:
            raise ValueError(
                f"unsupported topk_method {self.topk_method!r}; "
                f"supported: {', '.join(TOPK_METHODS)}"
            )
        if self.num_experts % self.num_groups or not 1 <= self.topk_groups <= self.num_groups:
            raise ValueError(
                f"n_group ({self.num_groups}) must divide the {self.num_experts} experts and "
                f"topk_group ({self.topk_groups}) be between 1 and n_group"
            )
        if self.sparse_layer_step < 1 or self.first_dense_layers < 0:
            raise ValueError(
                f"moe_layer_freq ({self.sparse_layer_step}) must be >= 1 and "
                f"first_k_dense_replace ({self.first_dense_layers}) >= 0"
            )


@dataclass(frozen=True)
class MLAConfig:
    """DeepSeek's multi-head latent attention (shared/model/mla.py): keys and values come from
    one `kv_lora_rank` latent per token, shared by every head, plus one rotary key part of
    `qk_rope_head_dim` shared likewise; the cache holds those two and nothing per head."""

    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    q_lora_rank: int | None = None  # None: q straight from q_proj
    # The softmax scale: (qk_nope + qk_rope) ** -0.5, times yarn's mscale squared.
    softmax_scale: float = 0.0

    def __post_init__(self) -> None:
        sizes = (self.kv_lora_rank, self.qk_nope_head_dim, self.qk_rope_head_dim, self.v_head_dim)
        if min(sizes) < 1 or self.qk_rope_head_dim % 2 or (self.q_lora_rank or 1) < 1:
            raise ValueError(
                "kv_lora_rank, qk_nope_head_dim, qk_rope_head_dim (even), v_head_dim and "
                f"q_lora_rank must be positive, got {sizes} and {self.q_lora_rank}"
            )

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def latent_width(self) -> int:
        """Cached values per token per layer: the latent, then the rotated rope key."""
        return self.kv_lora_rank + self.qk_rope_head_dim


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
    # Which decoder: "llama" (dense, Mistral too), "mixtral" or "qwen2_moe" (sparse, `moe` set).
    family: str = "llama"
    moe: MoEConfig | None = None
    # Biases on q, k and v (Qwen2 attention); o_proj and the MLPs never have one.
    attention_bias: bool = False
    # The parts other dense families add to the Llama decoder (docs/models.md says which family
    # sets which). Defaults: plain Llama.
    # RMSNorm of each head's q and k before rotary (Qwen3, Gemma 3).
    qk_norm: bool = False
    # Per layer: how many positions a query sees, itself included (0 = all); () = all layers 0.
    layer_windows: tuple[int, ...] = ()
    # Gemma 2: tanh soft-capping of attention scores and of the final logits (0 = none).
    attn_logit_softcap: float = 0.0
    final_logit_softcap: float = 0.0
    # Gemma: query_pre_attn_scalar ** -0.5 instead of head_dim ** -0.5 (None = the latter).
    attention_scale: float | None = None
    # Gemma: embeddings are multiplied by sqrt(hidden_size) before the first layer.
    embedding_multiplier: float = 1.0
    # Gemma: a norm after attention and one before and one after the MLP, each on its branch.
    sandwich_norms: bool = False
    # The MLP's gate activation: "silu" (SwiGLU) or "gelu_pytorch_tanh" (Gemma's GeGLU).
    hidden_act: str = "silu"
    # Gemma 3: the window layers' rotary base (None = rope_theta on every layer).
    local_rope_theta: float | None = None
    # DeepSeek-V2/V3: multi-head latent attention, with head_dim the rotary part's width
    # (qk_rope_head_dim) and the latent KV page layout (shared/kv/cache.py).
    mla: MLAConfig | None = None

    def __post_init__(self) -> None:
        if self.family not in FAMILIES:
            raise ValueError(f"unknown model family {self.family!r}; known: {', '.join(FAMILIES)}")
        if (self.moe is None) != (self.family == "llama") or (
            (self.mla is None) != (self.family != "deepseek_v2")
        ):
            raise ValueError(
                f"model family {self.family!r}, moe={self.moe!r} and mla={self.mla!r} disagree"
            )
        if self.layer_windows and len(self.layer_windows) != self.num_layers:
            raise ValueError(
                f"layer_windows has {len(self.layer_windows)} entries for {self.num_layers} layers"
            )
        if self.hidden_act not in HIDDEN_ACTS:
            raise ValueError(
                f"unsupported hidden_act {self.hidden_act!r}; supported: {', '.join(HIDDEN_ACTS)}"
            )
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of "
                f"num_kv_heads ({self.num_kv_heads})"
            )

    def is_sparse_layer(self, layer: int) -> bool:
        """Whether layer `layer` has the sparse experts (False for every layer of a dense
        model)."""
        return self.moe is not None and self.moe.is_sparse(layer)

    @property
    def num_queries_per_kv(self) -> int:
        return self.num_heads // self.num_kv_heads

    def window_of(self, layer: int) -> int:
        """How many positions layer `layer`'s queries see, themselves included (0 = all)."""
        return self.layer_windows[layer] if self.layer_windows else 0

    def rotates_locally(self, layer: int) -> bool:
        """Whether layer `layer` rotates with the local base (Gemma 3's window layers)."""
        return self.local_rope_theta is not None and self.window_of(layer) > 0

    @property
    def kv_window(self) -> int:
        """How many trailing positions any query of any layer still reads: the widest window
        when every layer has one (Mistral, Phi-3), 0 when some layer sees every position
        (Gemma's global layers, no window at all). Keys older than that are never read again,
        so their blocks can be released while the sequence runs."""
        if not self.layer_windows or not all(self.layer_windows):
            return 0
        return max(self.layer_windows)


@dataclass
class LoadedCheckpoint:
    architecture: ModelArchitecture
    # HF-named tensors, already dequantized to float32 (the engine casts to its dtype); with
    # quantization="gguf", a GGUF file's Q4_0/Q4_1 layer matrices are `BlockQuantized` instead.
    weights: Mapping[str, torch.Tensor | BlockQuantized]
    tokenizer: Tokenizer
    source: str  # the file or directory the weights came from, for messages and /v1/models
