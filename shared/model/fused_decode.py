"""Decode-only steps through every decoder layer in one C++ call (kernels/cpu/decode_layers.cpp).

At batch 1 the Python between a layer's dozen operations was a large part of a step (gguf
weights: 7.7 ms a step through the Python layers, 5.9 through this loop). The loop runs the
same operations on the same kernels in the same order, so its output is the Python layers'
output (tests/test_fused_decode.py holds it to that). It serves the steps it can: every row a
decode token, float32 activations, dense Llama-family layers (with Qwen2's q/k/v bias, Qwen3's
and Gemma 3's q/k norms, Gemma's sandwich norms and GeGLU, Gemma 3's local rotary base) whose
products are all oneDNN, all int8 or all int4 in our layout, in one process; rows with LoRA
adapters too, once `set_lora` gave it the slots (each projection's output gets its rows'
deltas, row by row from each row's own adapter: decode_layers.cpp's add_lora_delta says why).
Everything else (prefill chunks, mixed steps, tensor parallel, mixture-of-experts, MLA, bfloat16
models, CUDA, int4 in torch's layout: `fused_decode_problem`) keeps the Python layers.
SPLITSERVE_FUSED_DECODE=0 turns it off (to compare the two).
"""

from __future__ import annotations

import functools
import os
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from splitserve.engine.kv.groups import KVGroups
from splitserve.engine.lora.batched import LoRABatch
from splitserve.engine.lora.layers import LoRAHook
from splitserve.engine.model.architecture import GELU_TANH, ModelArchitecture
from splitserve.engine.model.attention_metadata import AttentionMetadata
from splitserve.engine.model.linear import Linear
from splitserve.engine.model.mla import MLAAttention
from splitserve.engine.model.moe_layer import SparseMoeBlock
from splitserve.engine.model.quantized_linear import (
    INT8_ACTIVATION_QUANT_FROM_ROWS,
    Int4Weight,
    Int8Weight,
    QuantizedLinear,
    inner_size,
)
from splitserve.engine.model.rotary import RotaryAngles
from splitserve.kernels import cpu as cpu_kernels

if TYPE_CHECKING:  # llama.py imports this module
    from splitserve.engine.model.llama import LlamaDecoderLayer, LlamaForCausalLM

_ENV = "SPLITSERVE_FUSED_DECODE"
_ONEDNN, _INT8, _INT4 = 0, 1, 2  # decode_layers.cpp's WeightFormat
# Below this many rows the packed kernels serve the step (quantized_linear.py's crossovers);
# from there the Python layers take it (int8: the int8 x int8 products win by more than the
# loop saves). int4 (our layout) takes int4_gemm at every row count, as the Python layers do.
_MAX_ROWS = {_ONEDNN: None, _INT8: INT8_ACTIVATION_QUANT_FROM_ROWS, _INT4: None}
# decode_layers.cpp's Projection order, by the projection's attribute name.
_PROJECTIONS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")


class FusedDecode:
    """The C++ layers of one model, and the test of whether a step may take them."""

    def __init__(self, layers: Any, weight_format: int) -> None:
        self._layers = layers
        self._max_rows = _MAX_ROWS[weight_format]
        self.has_lora = False  # set_lora done: steps with adapter rows may come here too

    def set_lora(self, hooks: Sequence[LoRAHook]) -> None:
        """Hands the C++ layers each LoRA hook's slot tensors (the same storage: adapters the
        slots load later are seen at once), so a step with adapter rows stays in the loop.
        float32 slots only, as the loop's activations are."""
        for hook in hooks:
            assert hook.a.dtype == torch.float32, "the fused decode runs float32 activations"
            projection = _PROJECTIONS.index(hook.layout.attribute)
            self._layers.set_lora(hook.layer, projection, hook.a, hook.b, hook.offsets)
        self.has_lora = True

    def serves(self, hidden: torch.Tensor, meta: AttentionMetadata) -> bool:
        rows = hidden.shape[0]
        return (
            not meta.prefills
            and meta.num_decodes == rows
            and meta.decode_block_tables is not None
            and hidden.dtype == torch.float32
            and (self._max_rows is None or rows < self._max_rows)
        )

    def run(
        self,
        hidden: torch.Tensor,
        angles: RotaryAngles,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        num_layers: int | None,
        lora: LoRABatch | None = None,
        local_angles: RotaryAngles | None = None,
    ) -> torch.Tensor:
        """The step through the layers; `lora`: its rows' slots (set_lora done), None when no
        row has an adapter; `local_angles`: Gemma 3's window layers' own (None: the model has
        one rotary base)."""
        count = self._layers.num_layers if num_layers is None else num_layers
        args = (
            hidden,
            kv_cache,
            meta.slot_mapping,
            meta.decode_block_tables,
            meta.decode_seq_lens,
            angles.cos,
            angles.sin,
            count,
        )
        local: dict[str, object] = {}
        if local_angles is not None:
            local = {"local_cos": local_angles.cos, "local_sin": local_angles.sin}
        if meta.kv_groups is not None:  # a cache of layer groups (shared/kv/groups.py)
            local["group_slot_mappings"] = [group.slot_mapping for group in meta.group_metas]
            local["group_block_tables"] = [group.decode_block_tables for group in meta.group_metas]
            local["layer_places"] = _flat_places(meta.kv_groups)
        if lora is None:
            return self._layers.run(*args, **local)
        assert self.has_lora, "a LoRA step needs set_lora first"
        return self._layers.run_lora(*args, lora.slot_ids, **local)


@functools.cache
def _flat_places(groups: KVGroups) -> list[int]:
    """Each layer's (group, slot), flat, as the C++ loop takes them (cached: one per model)."""
    return [index for place in groups.layer_places for index in place]


def build_fused_decode(model: LlamaForCausalLM) -> FusedDecode | None:
    """The fused layers for `model` (a loaded LlamaForCausalLM), or None where its layers or
    this machine do not fit them."""
    if os.environ.get(_ENV, "1") == "0":
        return None
    module = cpu_kernels.load()
    arch = model.arch
    if module is None or model.weight_device.type != "cpu" or fused_decode_problem(arch):
        return None
    if model.norm.weight.dtype != torch.float32:
        return None
    decoder_layers = model.decoder_layers()
    first = decoder_layers[0]
    products = [_products(layer) for layer in decoder_layers]
    if any(getattr(linear, "bias", None) is not None for layer in products for linear in layer[1:]):
        return None  # the loop adds a bias to qkv only (no family has another one today)
    formats = {_format(linear) for layer in products for linear in layer}
    weight_format = formats.pop() if len(formats) == 1 else None
    if weight_format is None:
        return None
    attention = first.self_attn
    layers = module.DecodeLayers(
        weight_format,
        attention.num_heads,
        attention.num_kv_heads,
        first.input_layernorm.eps,
        attention.scale,
        float(arch.attn_logit_softcap or 0.0),
        arch.hidden_act == GELU_TANH,
    )
    for layer_id, (layer, linears) in enumerate(zip(decoder_layers, products, strict=True)):
        tensors: list[torch.Tensor] = [
            layer.input_layernorm.weight,
            layer.post_attention_layernorm.weight,
        ]
        sizes: list[int] = []
        for linear in linears:
            first_tensor, second_tensor, in_padded, out_features = _weight_parts(linear)
            tensors += [first_tensor, second_tensor]
            sizes += [in_padded, out_features]
        qkv_bias = getattr(layer.self_attn.qkv_proj, "bias", None)  # Qwen2's, dense or packed
        layers.add_layer(
            tensors,
            sizes,
            int(layer.self_attn.window),
            [_decode_passes(linear) for linear in linears],
            None if qkv_bias is None else qkv_bias.detach().contiguous(),
            _qk_norms(layer),
            _sandwich_norms(layer),
            arch.rotates_locally(layer_id),
        )
    return FusedDecode(layers, weight_format)


def _qk_norms(layer: LlamaDecoderLayer) -> list[torch.Tensor]:
    """Qwen3's and Gemma 3's [q_norm, k_norm] weights, or none."""
    # MLA's attention has no such attribute; build_fused_decode refuses MLA anyway.
    q_norm = getattr(layer.self_attn, "q_norm", None)
    k_norm = getattr(layer.self_attn, "k_norm", None)
    if q_norm is None or k_norm is None:
        return []
    return [q_norm.weight, k_norm.weight]


def _sandwich_norms(layer: LlamaDecoderLayer) -> list[torch.Tensor]:
    """Gemma's [pre_feedforward, post_feedforward] norm weights, or none (Llama's layout)."""
    if not layer.sandwich_norms:
        return []
    return [layer.pre_feedforward_layernorm.weight, layer.post_feedforward_layernorm.weight]


def fused_decode_problem(arch: ModelArchitecture) -> str | None:
    """Why `arch`'s layers are not the ones decode_layers.cpp computes, or None: those models
    decode through the Python layers."""
    parts = {  # every hidden_act the loaders take (HIDDEN_ACTS) is in the loop
        "mixture-of-experts": arch.moe is not None,
        "multi-head latent attention": arch.mla is not None,
    }
    found = [name for name, present in parts.items() if present]
    return None if not found else "the C++ decode layers lack " + ", ".join(found)


def _products(layer: LlamaDecoderLayer) -> list[nn.Module]:
    attention, mlp = layer.self_attn, layer.mlp
    assert not isinstance(mlp, SparseMoeBlock), "build_fused_decode refuses arch.moe"
    assert not isinstance(attention, MLAAttention), "build_fused_decode refuses arch.mla"
    return [attention.qkv_proj, attention.o_proj, mlp.gate_up_proj, mlp.down_proj]


def _format(linear: nn.Module) -> int | None:
    """The products' weight format; a bias is taken on qkv_proj only (add_layer's qkv_bias),
    and no Llama-family layer has another."""
    if isinstance(linear, Linear):
        return _ONEDNN if linear.onednn_weight is not None else None
    if isinstance(linear, QuantizedLinear):
        if isinstance(linear.qweight, Int8Weight):
            return _INT8
        if isinstance(linear.qweight, Int4Weight):  # torch's int4 layout stays in Python
            return _INT4
    return None


def _decode_passes(linear: nn.Module) -> int:
    """The activation passes an int4 product takes at decode rows: the layer's own, as its
    Python forward takes them (qkv and down two, quantized_linear.py); only int4 reads it."""
    return linear.activation_passes if isinstance(linear, QuantizedLinear) else 2


def _weight_parts(linear: nn.Module) -> tuple[torch.Tensor, torch.Tensor, int, int]:
    """What decode_layers.cpp's Weight holds: (first, second, in_padded, out_features)."""
    if isinstance(linear, Linear):
        weight = linear.weight
        assert linear.onednn_weight is not None, "_format admits oneDNN weights only"
        return linear.onednn_weight, torch.empty(0), weight.shape[1], weight.shape[0]
    assert isinstance(linear, QuantizedLinear), "_format admits Linear and QuantizedLinear"
    packed = linear.qweight
    if isinstance(packed, Int8Weight):
        return packed.codes, packed.scales, inner_size(packed), packed.out_features
    assert isinstance(packed, Int4Weight), "_format admits int4 in our layout only"
    return packed.packed, packed.scales_minimums, inner_size(packed), packed.out_features
