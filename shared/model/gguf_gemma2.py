"""Gemma 2 GGUF files (llama.cpp's `gemma2` architecture), under the contract the Hugging
Face Gemma 2 loader keeps (shared/model/hf_families.py).

What llama.cpp's graph for the architecture fixes rather than the file says, and so is set
here: embeddings scaled by sqrt(hidden), GeGLU (tanh GELU), a sliding window on the even
layers (0, 2, ...), rotate-half rotary (q/k rows in Hugging Face's order), and the attention
scale: 1 / sqrt(head_dim), except for the 46-layer 27B model, whose queries are scaled by
1 / sqrt(hidden / heads) (its query_pre_attn_scalar), as llama.cpp picks it by model size.
The file carries the window and both soft-caps. Its norm weights are stored as w + 1 (the
converter adds the 1 that Gemma's (1 + w) RMSNorm implies), as our loader keeps them too.
"""

from __future__ import annotations

from typing import Any

from splitserve.engine.gguf_metadata import GGUFMetadata

ARCH = "gemma2"
LAYERS_OF_27B = 46
# Each layer's norms: llama.cpp's names -> Hugging Face Gemma 2's (Llama's `ffn_norm` is
# Gemma's pre-feed-forward norm; the post-attention norm is its own tensor).
BLOCK_NAMES = {
    "attn_norm": "input_layernorm",
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}


def gemma2_fields(meta: GGUFMetadata, num_layers: int, head_dim: int) -> dict[str, Any]:
    """The `ModelArchitecture` fields a gemma2 file sets beyond llama's."""
    hidden = int(meta.require(f"{ARCH}.embedding_length"))
    num_heads = int(meta.require(f"{ARCH}.attention.head_count"))
    window = int(meta.get(f"{ARCH}.attention.sliding_window", 0) or 0)
    scale_dim = hidden // num_heads if num_layers == LAYERS_OF_27B else head_dim
    windows = tuple(window if layer % 2 == 0 else 0 for layer in range(num_layers))
    return {
        "layer_windows": windows if window else (),
        "attn_logit_softcap": float(meta.get(f"{ARCH}.attn_logit_softcapping", 0.0) or 0.0),
        "final_logit_softcap": float(meta.get(f"{ARCH}.final_logit_softcapping", 0.0) or 0.0),
        "attention_scale": scale_dim**-0.5,
        "embedding_multiplier": hidden**0.5,
        "sandwich_norms": True,
        "hidden_act": "gelu_pytorch_tanh",
    }


def gemma2_name(name: str) -> str | None:
    """`blk.N.<norm>.weight` of a gemma2 file as Hugging Face Gemma 2's name; None for a
    tensor Llama's names cover."""
    parts = name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[2] in BLOCK_NAMES:
        return f"model.layers.{parts[1]}.{BLOCK_NAMES[parts[2]]}.{parts[3]}"
    return None
