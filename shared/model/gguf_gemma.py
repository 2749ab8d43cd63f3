"""Gemma 2 and Gemma 3 GGUF files (llama.cpp's `gemma2` and `gemma3` architectures, text
only), under the contract the Hugging Face Gemma loader keeps (shared/model/hf_families.py).

What llama.cpp's graph for these architectures fixes rather than the file says, and so is set
here: embeddings scaled by sqrt(hidden), GeGLU (tanh GELU), rotate-half rotary (q/k rows in
Hugging Face's order), sandwich norms, and the attention scale: 1 / sqrt(head_dim), except for
the 27B models (46 layers for Gemma 2, 62 for Gemma 3), whose queries are scaled by
1 / sqrt(hidden / heads) (their query_pre_attn_scalar), as llama.cpp picks it by model size.

- gemma2: a sliding window on the even layers (0, 2, ...); the file carries the window and
  both soft-caps.
- gemma3: a sliding window on five layers of every six (layer i is global when i % 6 == 5,
  the default of Hugging Face's layer_types), or the file's
  `gemma3.attention.sliding_window_pattern` (every Nth layer global); the window layers rotate
  with base 10,000 and no scaling, the global ones with the file's freq_base and rope scaling;
  q/k norms; no soft-caps.

Norm weights (q/k norms too) are stored as w + 1 (the converter adds the 1 that Gemma's
(1 + w) RMSNorm implies), as our loader keeps them too.
"""

from __future__ import annotations

from typing import Any

from splitserve.engine.gguf_metadata import GGUFMetadata

GEMMA2 = "gemma2"
GEMMA3 = "gemma3"
ARCHITECTURES = (GEMMA2, GEMMA3)
LAYERS_OF_27B = {GEMMA2: 46, GEMMA3: 62}
GEMMA3_WINDOW_PATTERN = 6  # llama.cpp's: five window layers, then a global one
GEMMA3_LOCAL_ROPE_THETA = 10000.0  # llama.cpp's rope_freq_base_train_swa for gemma3
# Each layer's norms: llama.cpp's names -> Hugging Face Gemma's (Llama's `ffn_norm` is
# Gemma's pre-feed-forward norm; the post-attention norm is its own tensor).
BLOCK_NAMES = {
    "attn_norm": "input_layernorm",
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}


def gemma_fields(meta: GGUFMetadata, arch: str, num_layers: int, head_dim: int) -> dict[str, Any]:
    """The `ModelArchitecture` fields a gemma2 or gemma3 file sets beyond llama's."""
    hidden = int(meta.require(f"{arch}.embedding_length"))
    num_heads = int(meta.require(f"{arch}.attention.head_count"))
    window = int(meta.get(f"{arch}.attention.sliding_window", 0) or 0)
    scale_dim = hidden // num_heads if num_layers == LAYERS_OF_27B[arch] else head_dim
    fields: dict[str, Any] = {
        "attention_scale": scale_dim**-0.5,
        "embedding_multiplier": hidden**0.5,
        "sandwich_norms": True,
        "hidden_act": "gelu_pytorch_tanh",
    }
    if arch == GEMMA2:
        windowed = [layer % 2 == 0 for layer in range(num_layers)]
        fields["attn_logit_softcap"] = float(meta.get(f"{arch}.attn_logit_softcapping", 0) or 0)
        fields["final_logit_softcap"] = float(meta.get(f"{arch}.final_logit_softcapping", 0) or 0)
    else:
        windowed = _gemma3_window_layers(meta, num_layers)
        fields["local_rope_theta"] = GEMMA3_LOCAL_ROPE_THETA
    windows = tuple(window if is_windowed else 0 for is_windowed in windowed)
    fields["layer_windows"] = windows if window and any(windows) else ()
    return fields


def _gemma3_window_layers(meta: GGUFMetadata, num_layers: int) -> list[bool]:
    """Which layers have the sliding window: the file's pattern (an int N: every Nth layer is
    global; a list: per layer, True = windowed), else llama.cpp's six."""
    pattern = meta.get(f"{GEMMA3}.attention.sliding_window_pattern", GEMMA3_WINDOW_PATTERN)
    if isinstance(pattern, (list, tuple)):
        if len(pattern) != num_layers:
            raise ValueError(
                f"gemma3.attention.sliding_window_pattern lists {len(pattern)} layers, the "
                f"model has {num_layers}"
            )
        return [bool(is_windowed) for is_windowed in pattern]
    every = int(pattern)
    if every < 1:
        raise ValueError(f"gemma3.attention.sliding_window_pattern must be >= 1, got {every}")
    return [(layer + 1) % every != 0 for layer in range(num_layers)]


def gemma_name(name: str) -> str | None:
    """`blk.N.<norm>.weight` of a gemma2/gemma3 file as Hugging Face Gemma's name; None for a
    tensor Llama's names cover (q/k norms among them)."""
    parts = name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[2] in BLOCK_NAMES:
        return f"model.layers.{parts[1]}.{BLOCK_NAMES[parts[2]]}.{parts[3]}"
    return None
