"""Loads a llama-architecture GGUF file into Hugging Face-named float32 tensors (Mixtral,
a llama with experts, and qwen2moe too: shared/model/gguf_moe.py splits their stacked experts;
qwen2 and qwen3, Llama's decoder with q/k/v biases or q/k norms, as their HF directories load;
phi3, its fused matrices split by shared/model/gguf_phi3.py; gemma2 and gemma3, by
shared/model/gguf_gemma.py).

Three translations happen here:
- names: llama.cpp's `blk.N.attn_q.weight` becomes `model.layers.N.self_attn.q_proj.weight`;
- values: quantized blocks are dequantized with the `gguf` package, whole tensor at a time, or
  with `keep_quantized` (quantization="gguf") Q4_0/Q4_1 matrices are kept as codes and block
  scales (`splitserve.engine.model.gguf_blocks`);
- layout: llama.cpp's converter reorders the rows of q_proj and k_proj so that its interleaved
  RoPE (rotating row pairs 2i, 2i+1) computes what Hugging Face's rotate-half RoPE computes on the
  original rows (pairs i, i + head_dim/2). We run rotate-half, so we put the rows back.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import torch

from splitserve.engine.gguf_file import GGUFSource, GGUFTensor, read_gguf
from splitserve.engine.gguf_metadata import GGUFMetadata
from splitserve.engine.model.architecture import LoadedCheckpoint, ModelArchitecture, RopeScaling
from splitserve.engine.model.gguf_blocks import PACKED_TYPES, BlockQuantized, read_blocks
from splitserve.engine.model.gguf_deepseek import ARCH as DEEPSEEK2
from splitserve.engine.model.gguf_deepseek import DeepSeekTensors, deepseek_config
from splitserve.engine.model.gguf_dequant import dequantize
from splitserve.engine.model.gguf_gemma import ARCHITECTURES as GEMMA_ARCHITECTURES
from splitserve.engine.model.gguf_gemma import gemma_fields, gemma_name
from splitserve.engine.model.gguf_moe import UNSUPPORTED_MOE_ARCHITECTURES, moe_fields, moe_tensors
from splitserve.engine.model.gguf_phi3 import ARCH as PHI3
from splitserve.engine.model.gguf_phi3 import ROPE_FACTOR_TENSORS, phi3_fields, split_fused
from splitserve.engine.model.hf_loader import architecture_from_config
from splitserve.engine.progress import ProgressFn
from splitserve.engine.tokenizer import Tokenizer

SUPPORTED_ARCHITECTURES = (
    "llama", "qwen2", "qwen3", "qwen2moe", "qwen3moe", "phi3", "gemma2", "gemma3", "deepseek2",
)  # fmt: skip

_TOP_LEVEL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_BLOCK_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q_norm": "self_attn.q_norm",  # qwen3: RMSNorm of each head's q and k
    "attn_k_norm": "self_attn.k_norm",
}


def load_gguf(
    path: str, progress: ProgressFn | None = None, keep_quantized: bool = False
) -> LoadedCheckpoint:
    """Reads architecture, tokenizer and all weights from `path`: float32, except that with
    `keep_quantized` the Q4_0/Q4_1 matrices stay `BlockQuantized`."""
    reader = read_gguf(path)
    meta = GGUFMetadata(reader)
    _check_architecture(meta.require("general.architecture"), path)
    tokenizer = Tokenizer.from_gguf_reader(reader)
    if meta.require("general.architecture") == DEEPSEEK2:
        return _load_deepseek(reader, tokenizer, path, progress, keep_quantized)
    architecture = read_architecture(reader, tokenizer)
    weights = _read_weights(reader, architecture, progress, keep_quantized)
    return LoadedCheckpoint(
        architecture=architecture, weights=weights, tokenizer=tokenizer, source=os.fspath(path)
    )


def _load_deepseek(
    reader: GGUFSource,
    tokenizer: Tokenizer,
    path: str,
    progress: ProgressFn | None,
    keep_quantized: bool,
) -> LoadedCheckpoint:
    """A deepseek2 file as its Hugging Face directory would load (shared/model/gguf_deepseek.py):
    the config its metadata makes, read by the DeepSeek loader, and checkpoint-named tensors."""
    if keep_quantized:
        raise ValueError(
            "quantization='gguf' keeps a file's Q4 blocks as they are, which the latent "
            "attention and the experts of a deepseek2 file do not take; load it without"
        )
    tensor_names = {tensor.name for tensor in reader.tensors}
    config = deepseek_config(
        GGUFMetadata(reader), _vocab_size(reader, tokenizer), "output.weight" not in tensor_names
    )
    architecture = architecture_from_config(config, tokenizer)
    splitter = DeepSeekTensors()
    weights = _read_weights(reader, architecture, progress, False, splitter)
    splitter.check_done()
    return LoadedCheckpoint(
        architecture=architecture, weights=weights, tokenizer=tokenizer, source=os.fspath(path)
    )


def read_architecture(reader: GGUFSource, tokenizer: Tokenizer) -> ModelArchitecture:
    """The model's numbers from `llama.*` metadata; token ids come from the tokenizer."""
    meta = GGUFMetadata(reader)
    arch = meta.require("general.architecture")
    hidden_size = int(meta.require(f"{arch}.embedding_length"))
    num_heads = int(meta.require(f"{arch}.attention.head_count"))
    num_kv_heads = _scalar(meta.get(f"{arch}.attention.head_count_kv", num_heads), "head_count_kv")
    head_dim = int(meta.get(f"{arch}.attention.key_length", hidden_size // num_heads))
    _check_rope_dim(int(meta.get(f"{arch}.rope.dimension_count", head_dim)), head_dim)
    tensor_names = {tensor.name for tensor in reader.tensors}
    vocab_size = _vocab_size(reader, tokenizer)
    family, moe = moe_fields(meta.get, arch)
    dense_size = meta.get(f"{arch}.feed_forward_length") if moe else None
    num_layers = int(meta.require(f"{arch}.block_count"))
    extra: dict[str, Any] = {}
    if arch == PHI3:
        extra = phi3_fields(reader, num_layers, head_dim)
    elif arch in GEMMA_ARCHITECTURES:
        extra = gemma_fields(meta, arch, num_layers, head_dim)
    return ModelArchitecture(
        name=arch,
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=int(dense_size or meta.require(f"{arch}.feed_forward_length")),
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        rms_norm_eps=float(meta.require(f"{arch}.attention.layer_norm_rms_epsilon")),
        rope_theta=float(meta.get(f"{arch}.rope.freq_base", 10000.0)),
        max_position_embeddings=int(meta.require(f"{arch}.context_length")),
        tie_word_embeddings="output.weight" not in tensor_names,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_ids=tokenizer.eos_token_ids,
        rope_scaling=extra.pop("rope_scaling", None) or _rope_scaling(meta, arch),
        family=family,
        moe=moe,
        attention_bias="blk.0.attn_q.bias" in tensor_names,
        qk_norm="blk.0.attn_q_norm.weight" in tensor_names,
        **extra,
    )


def gguf_to_hf_name(name: str) -> str:
    """`blk.3.attn_q.weight` -> `model.layers.3.self_attn.q_proj.weight`."""
    parts = name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[2] in _BLOCK_NAMES:
        return f"model.layers.{parts[1]}.{_BLOCK_NAMES[parts[2]]}.{parts[3]}"
    if len(parts) == 2 and parts[0] in _TOP_LEVEL_NAMES:
        return f"{_TOP_LEVEL_NAMES[parts[0]]}.{parts[1]}"
    raise ValueError(f"unsupported GGUF tensor {name!r} (no Hugging Face Llama equivalent)")


def unpermute_rope_rows(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Undoes llama.cpp's Q/K row order, giving the rows Hugging Face's rotate-half expects.

    Within each head of `head_dim` rows, llama.cpp stores original row `i` (first half) at
    `2i` and row `i + head_dim/2` (second half) at `2i + 1`: [h, half, 2] in memory. Viewing
    the rows as [num_heads, head_dim/2, 2, ...] and swapping the two middle axes gives back
    [num_heads, 2, head_dim/2, ...], i.e. first halves then second halves.
    """
    rows = weight.shape[0]
    assert rows % (2 * num_heads) == 0, f"{rows} rows do not split into {num_heads} heads"
    half = rows // num_heads // 2
    # [rows, ...] -> [num_heads, half, 2, ...] -> [num_heads, 2, half, ...] -> [rows, ...]
    split = weight.reshape(num_heads, half, 2, *weight.shape[1:])
    return split.swapaxes(1, 2).reshape(weight.shape)


def _read_weights(
    reader: GGUFSource,
    architecture: ModelArchitecture,
    progress: ProgressFn | None,
    keep_quantized: bool,
    deepseek: DeepSeekTensors | None = None,
) -> dict[str, torch.Tensor | BlockQuantized]:
    """`deepseek`: a deepseek2 file's own tensors' names (shared/model/gguf_deepseek.py)."""
    # Only llama's converter permutes Q/K rows; the qwen architectures (rotate-half rotary in
    # llama.cpp too) are stored in Hugging Face's order.
    heads_of = {"attn_q": architecture.num_heads, "attn_k": architecture.num_kv_heads}
    if architecture.name != "llama":
        heads_of = {}
    if keep_quantized and architecture.name == PHI3:
        raise ValueError(
            "quantization='gguf' keeps a file's Q4 blocks as they are, and a phi3 file's q/k/v "
            "and gate/up matrices are fused; load it without (its weights become float32)"
        )
    weights: dict[str, torch.Tensor | BlockQuantized] = {}
    tensors: list[GGUFTensor] = list(reader.tensors)
    for done, tensor in enumerate(tensors, start=1):
        if tensor.name in ROPE_FACTOR_TENSORS.values():
            continue  # longrope's factors: read into the architecture
        kind = tensor.name.split(".")[2] if tensor.name.startswith("blk.") else ""
        if keep_quantized and kind and tensor.tensor_type in PACKED_TYPES:
            weights[gguf_to_hf_name(tensor.name)] = _read_packed(tensor, heads_of.get(kind))
            continue
        values = _dequantize(tensor)
        if kind in heads_of:
            values = unpermute_rope_rows(values, heads_of[kind])
        named = deepseek.split(tensor.name, values) if deepseek is not None else None
        if named is None:
            named = _split_tensor(tensor.name, values, architecture)
        for name, array in named.items():
            weights[name] = torch.from_numpy(np.ascontiguousarray(array))
        if progress is not None:  # a tensor waiting for its other half: by its own name
            progress(done, len(tensors), next(iter(named), tensor.name))
    return weights


def _split_tensor(
    name: str, values: np.ndarray, architecture: ModelArchitecture
) -> dict[str, np.ndarray]:
    """One GGUF tensor as the Hugging Face Llama tensors it holds: stacked experts and
    Phi-3's fused matrices are split, any other is renamed."""
    named = moe_tensors(name, values, architecture.family)
    if named is None and architecture.name == PHI3:
        a = architecture
        named = split_fused(name, values, a.num_heads, a.num_kv_heads, a.head_dim)
    if named is None and architecture.name in GEMMA_ARCHITECTURES:
        hf_name = gemma_name(name)
        named = {hf_name: values} if hf_name else None
    return named if named is not None else {gguf_to_hf_name(name): values}


def _read_packed(tensor: GGUFTensor, num_heads: int | None) -> BlockQuantized:
    """A layer's Q4 matrix as blocks; q and k get the same row order as the float path."""
    blocks = read_blocks(tensor)
    if num_heads is None:
        return blocks
    return blocks.permute_rows(unpermute_rope_rows(np.arange(blocks.shape[0]), num_heads))


def _dequantize(tensor: GGUFTensor) -> np.ndarray:
    """float32 values in Hugging Face's [out, in] shape (GGUF lists dimensions innermost first)."""
    qtype = tensor.tensor_type
    try:
        values = dequantize(tensor.data, qtype)
    except NotImplementedError as exc:
        raise ValueError(f"GGUF tensor {tensor.name!r} has unsupported type {qtype.name}") from exc
    shape = tuple(int(dim) for dim in reversed(tensor.shape))
    values = values.astype(np.float32, copy=False).reshape(shape)
    # F32 tensors come back as views of the memory-mapped file: copy so the tensor owns
    # writable memory and the file can be closed.
    return values if values.flags.writeable and values.flags.owndata else values.copy()


def _rope_scaling(meta: GGUFMetadata, arch: str) -> RopeScaling:
    kind = meta.get(f"{arch}.rope.scaling.type")
    factor = meta.get(f"{arch}.rope.scaling.factor")
    legacy_linear = meta.get(f"{arch}.rope.scale_linear")
    if kind is None and legacy_linear is not None:
        kind, factor = "linear", legacy_linear
    if kind in (None, "none") or (kind == "linear" and float(factor or 1.0) == 1.0):
        return RopeScaling()
    if kind == "linear":
        return RopeScaling(rope_type="linear", factor=float(factor))
    raise ValueError(f"unsupported GGUF rope scaling type {kind!r}; supported: none, linear")


def _check_architecture(arch: str, path: str) -> None:
    if arch in UNSUPPORTED_MOE_ARCHITECTURES:
        raise ValueError(
            f"{os.fspath(path)!r} holds a {arch!r} mixture-of-experts model, which is not "
            "supported; supported MoE GGUF files: Mixtral (llama with experts), qwen2moe, "
            "qwen3moe, deepseek2"
        )
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ValueError(
            f"{os.fspath(path)!r} holds a {arch!r} model; supported GGUF architectures: "
            f"{', '.join(SUPPORTED_ARCHITECTURES)}"
        )


def _check_rope_dim(rope_dim: int, head_dim: int) -> None:
    if rope_dim != head_dim:
        raise ValueError(
            f"partial rotary embeddings (rope dimension {rope_dim} < head_dim {head_dim}) "
            "are not supported"
        )


def _vocab_size(reader: GGUFSource, tokenizer: Tokenizer) -> int:
    # The embedding's row count is what the model can actually score; tokenizers may be smaller
    # (padded embeddings) but never larger.
    embed = next((t for t in reader.tensors if t.name == "token_embd.weight"), None)
    if embed is None:
        raise ValueError("GGUF file has no token_embd.weight tensor")
    vocab_size = int(embed.shape[-1])
    if tokenizer.vocab_size > vocab_size:
        raise ValueError(
            f"tokenizer has {tokenizer.vocab_size} tokens but the embedding only {vocab_size}"
        )
    return vocab_size


def _scalar(value: Any, name: str) -> int:
    if isinstance(value, list):
        raise ValueError(f"per-layer {name} values are not supported")
    return int(value)
