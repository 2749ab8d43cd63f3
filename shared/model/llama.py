"""A Llama-family decoder that runs flattened ragged batches over the paged KV cache.

Mixtral and Qwen2/Qwen3-MoE share it: only the feed-forward block differs (`feed_forward`,
shared/model/moe_layer.py) and Qwen2's q/k/v biases (`ModelArchitecture.attention_bias`).
Qwen2/3, Mistral, Phi-3 and Gemma 2/3 add parts the architecture switches on (q/k norms,
sliding windows, soft-capping, Gemma's extra norms and GeGLU): docs/models.md lists them.
DeepSeek-V2 swaps the attention for multi-head latent attention (shared/model/mla.py, with its
own KV page layout) and mixes dense and sparse feed-forward layers.

One forward serves prefill chunks and decode tokens of many requests at once: every token is a
row of `[num_tokens, hidden]`, and only attention needs to know which row belongs to whom.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Mapping
from typing import Protocol, cast

import torch
from torch import nn

from splitserve.engine.lora.layers import LoRAState
from splitserve.engine.model.architecture import GELU_TANH, ModelArchitecture
from splitserve.engine.model.attention_metadata import AttentionBackend, AttentionMetadata
from splitserve.engine.model.feed_forward import internal_feed_forward_weights
from splitserve.engine.model.fused_decode import (
    FusedDecode,
    build_fused_decode,
    fused_decode_problem,
)
from splitserve.engine.model.gguf_blocks import BlockQuantized
from splitserve.engine.model.layer_ops import TorchLayerOps, select_layer_ops
from splitserve.engine.model.linear import Linear, linear, onednn_weight
from splitserve.engine.model.masked_attention import masked_attention
from splitserve.engine.model.mla import LATENT_NORM_EPS, MLAAttention
from splitserve.engine.model.moe_layer import SparseMoeBlock
from splitserve.engine.model.quantization import (
    QuantizedEmbedding,
    QuantizedLinear,
    cat_rows,
    dense,
    effective_method,
    log_gguf_notes,
    make_linear,
    pack_weight,
    select_quantized_backend,
    weight_nbytes,
)
from splitserve.engine.model.quantized_linear import plain_input_activation_passes
from splitserve.engine.model.rotary import RotaryAngles, RotaryEmbedding

logger = logging.getLogger(__name__)


class AllReduce(Protocol):
    """Sums a tensor over the tensor-parallel ranks in place (shared/parallel/comm.py)."""

    def all_reduce(self, tensor: torch.Tensor) -> None: ...


class RMSNorm(nn.Module):
    # How the norm runs (shared/model/layer_ops.py); LlamaForCausalLM sets its device's choice.
    ops: TorchLayerOps = TorchLayerOps()

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ops.rms_norm(x, self.weight, self.eps)

    def add_and_norm(
        self, x: torch.Tensor, residual: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(this norm of x + residual, x + residual): a residual add and the norm after it."""
        return self.ops.add_rms_norm(x, residual, self.weight, self.eps)


class LlamaAttention(nn.Module):
    # Tensor parallel: this rank's heads only; o_proj is row-parallel, summed over the ranks.
    tensor_parallel: AllReduce | None = None
    ops: TorchLayerOps = TorchLayerOps()  # set by LlamaForCausalLM (layer_ops.py)

    def __init__(self, arch: ModelArchitecture, quantization: str) -> None:
        super().__init__()
        self.num_heads = arch.num_heads
        self.num_kv_heads = arch.num_kv_heads
        self.head_dim = arch.head_dim
        self.scale = arch.head_dim**-0.5 if arch.attention_scale is None else arch.attention_scale
        # Set per layer by LlamaForCausalLM: a sliding window (0 = none) and Gemma 2's cap.
        self.window = 0
        self.softcap = arch.attn_logit_softcap
        # Qwen3 and Gemma 3: each head's q and k RMS-normalised before rotary.
        self.q_norm = RMSNorm(arch.head_dim, arch.rms_norm_eps) if arch.qk_norm else None
        self.k_norm = RMSNorm(arch.head_dim, arch.rms_norm_eps) if arch.qk_norm else None
        q_size = arch.num_heads * arch.head_dim
        kv_size = arch.num_kv_heads * arch.head_dim
        # q, k and v in one matmul: one pass over the activations instead of three (quantized,
        # the fused matrix is: its rows are the three matrices' rows, each quantized alike),
        # with Qwen2's q/k/v biases added dense. Two activation passes: a few large features
        # per row (quantized_linear.py).
        self.qkv_proj = make_linear(
            arch.hidden_size, q_size + 2 * kv_size, quantization, 2, bias=arch.attention_bias
        )
        self.o_proj = make_linear(
            q_size, arch.hidden_size, quantization, plain_input_activation_passes()
        )

    def forward(
        self,
        hidden: torch.Tensor,
        rotary: RotaryAngles,
        layer_cache: torch.Tensor,
        meta: AttentionMetadata,
        backend: AttentionBackend,
    ) -> torch.Tensor:
        num_tokens = hidden.shape[0]
        qkv = self.qkv_proj(hidden)
        if self.q_norm is not None:
            qkv = self._norm_qk(qkv)
        q = self.ops.rotary_qkv_into_cache(
            qkv, rotary, self.num_heads, self.num_kv_heads, layer_cache, meta, backend
        )
        if not (self.window or self.softcap):
            out = backend.attend(q, layer_cache, meta, self.scale)  # [tokens, heads, head_dim]
        elif backend.takes_window_and_softcap:  # the Triton kernels
            out = backend.attend(q, layer_cache, meta, self.scale, window=self.window,
                                 softcap=self.softcap)  # fmt: skip
        else:  # what the PyTorch path's SDPA does not take
            out = masked_attention(q, layer_cache, meta, self.scale, self.window, self.softcap)
        out = self.o_proj(out.reshape(num_tokens, -1))
        if self.tensor_parallel is not None:
            self.tensor_parallel.all_reduce(out)
        return out

    def _norm_qk(self, qkv: torch.Tensor) -> torch.Tensor:
        """qkv with q's and k's heads RMS-normalised, each over head_dim (the fused rotary op
        then takes it as before). The C++ op normalises `qkv` itself, in place: the caller
        uses only what this returns."""
        assert self.q_norm is not None and self.k_norm is not None, "qk_norm models only"
        return self.ops.rms_norm_qk_heads(
            qkv,
            self.q_norm.weight,
            self.k_norm.weight,
            self.num_heads,
            self.num_kv_heads,
            self.q_norm.eps,
        )


class LlamaMLP(nn.Module):
    # Tensor parallel: this rank's intermediate columns; down is row-parallel, summed.
    tensor_parallel: AllReduce | None = None
    ops: TorchLayerOps = TorchLayerOps()  # set by LlamaForCausalLM (layer_ops.py)

    def __init__(self, arch: ModelArchitecture, quantization: str) -> None:
        super().__init__()
        self.gate_up_proj = make_linear(
            arch.hidden_size,
            2 * arch.intermediate_size,
            quantization,
            plain_input_activation_passes(),
        )
        # SwiGLU's output has a few large features per row: two activation passes.
        self.down_proj = make_linear(arch.intermediate_size, arch.hidden_size, quantization, 2)
        self.gelu = arch.hidden_act == GELU_TANH  # Gemma's GeGLU

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if self.gelu:
            gate, up = gate_up.chunk(2, dim=-1)
            activated = torch.nn.functional.gelu(gate, approximate="tanh") * up
        else:
            activated = self.ops.silu_and_mul(gate_up)
        out = self.down_proj(activated)
        if self.tensor_parallel is not None:
            self.tensor_parallel.all_reduce(out)
        return out


def feed_forward(
    arch: ModelArchitecture, quantization: str = "none", layer: int = 0
) -> LlamaMLP | SparseMoeBlock:
    """Layer `layer`'s MLP: dense SwiGLU (quantized as asked), or the sparse experts of Mixtral,
    Qwen2-MoE and DeepSeek's sparse layers (never quantized: LlamaForCausalLM refuses that)."""
    return SparseMoeBlock(arch) if arch.is_sparse_layer(layer) else LlamaMLP(arch, quantization)


def attention(arch: ModelArchitecture, quantization: str) -> LlamaAttention | MLAAttention:
    """A layer's attention: Llama's (with the parts families add), or DeepSeek's MLA."""
    if arch.mla is None:
        return LlamaAttention(arch, quantization)
    return MLAAttention(arch, lambda size: RMSNorm(size, LATENT_NORM_EPS))


class LlamaDecoderLayer(nn.Module):
    # Gemma's (sandwich_norms) only.
    pre_feedforward_layernorm: RMSNorm
    post_feedforward_layernorm: RMSNorm

    def __init__(self, arch: ModelArchitecture, quantization: str, layer: int = 0) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.self_attn = attention(arch, quantization)
        self.post_attention_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.mlp = feed_forward(arch, quantization, layer)
        # Gemma: post_attention_layernorm normalises the attention branch itself, and the MLP
        # branch has a norm before and after it.
        self.sandwich_norms = arch.sandwich_norms
        if arch.sandwich_norms:
            self.pre_feedforward_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
            self.post_feedforward_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)

    def forward(
        self,
        hidden: torch.Tensor,
        rotary: RotaryAngles,
        layer_cache: torch.Tensor,
        meta: AttentionMetadata,
        backend: AttentionBackend,
    ) -> torch.Tensor:
        attn_out = self.self_attn(self.input_layernorm(hidden), rotary, layer_cache, meta, backend)
        if self.sandwich_norms:
            attn_out = self.post_attention_layernorm(attn_out)
            normed, hidden = self.pre_feedforward_layernorm.add_and_norm(attn_out, hidden)
            return hidden + self.post_feedforward_layernorm(self.mlp(normed))
        normed, hidden = self.post_attention_layernorm.add_and_norm(attn_out, hidden)
        return hidden + self.mlp(normed)


class LlamaForCausalLM(nn.Module):
    # Quantized: one int8 copy serves the lookup and, tied, the head (see `materialize`).
    embed_tokens: nn.Embedding | QuantizedEmbedding
    lm_head: nn.Linear | QuantizedEmbedding

    def __init__(
        self,
        arch: ModelArchitecture,
        max_positions: int,
        device: torch.device,
        quantization: str = "none",  # ModelConfig.quantization (shared/model/quantization.py)
    ) -> None:
        super().__init__()
        self.arch = arch
        self.quantization = effective_method(quantization, device)
        # Which kernels the packed layers multiply with, so which layout they keep: torch's
        # CPU kernels or the Triton dequantizing matmuls (CUDA); packed straight onto `device`.
        self.quantized_backend = (
            select_quantized_backend(device) if self.quantization != "none" else "torch"
        )
        self.weight_device = device
        if arch.moe is not None and self.quantization != "none":
            raise ValueError(
                f"quantization {quantization!r} does not support mixture-of-experts models "
                f"({arch.family}) yet: their experts are stacked tensors, not packed layers; "
                "use quantization 'none'"
            )
        # Built on the meta device: random initialisation of weights about to be overwritten
        # would cost seconds. `materialize` gives them real storage.
        with torch.device("meta"):
            self.layers = nn.ModuleList(
                LlamaDecoderLayer(arch, self.quantization, layer)
                for layer in range(arch.num_layers)
            )
            self.norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
            if self.quantization == "none":
                # Given its (meta) weight: its own initialisation, normal_ on the meta device,
                # would import torch._dynamo (and Triton where installed), ~145 MiB resident.
                shape = (arch.vocab_size, arch.hidden_size)
                self.embed_tokens = nn.Embedding(*shape, _weight=torch.empty(shape))
                self.lm_head = nn.Linear(arch.hidden_size, arch.vocab_size, bias=False)
        self.rotary = RotaryEmbedding(arch, max_positions, device)
        # Gemma 3: the window layers rotate with their own base.
        self.local_rotary = (
            None
            if arch.local_rope_theta is None
            else RotaryEmbedding(arch, max_positions, device, arch.local_rope_theta)
        )
        for layer_id, layer in enumerate(self.decoder_layers()):
            layer.self_attn.window = arch.window_of(layer_id)
        self.requires_grad_(False)
        self.use_layer_ops(select_layer_ops(device))
        # Decode-only steps through all layers in one C++ call, once the weights are loaded
        # (shared/model/fused_decode.py); None: the Python layers serve every step.
        self.fused_decode: FusedDecode | None = None
        # Multi-LoRA (shared/lora/layers.py): while its batch is set, a step has adapter rows;
        # the fused decode applies them once given the slots (build_lora), else the Python
        # layers (hooked) take the step.
        self.lora: LoRAState | None = None

    def use_layer_ops(self, ops: TorchLayerOps) -> None:
        """Runs the norms, activations and rotary of every layer through `ops`."""
        for module in self.modules():
            if isinstance(module, RMSNorm | LlamaAttention | LlamaMLP):
                module.ops = ops

    def materialize(self, device: torch.device, dtype: torch.dtype) -> None:
        """Allocates uninitialised storage for every weight; `load_hf_weights` fills it."""

        # What `to_empty(device)` then `to(dtype)` would do, in one allocation per tensor and
        # without `empty_like` on meta tensors, which goes through torch's Python references and
        # imports sympy on the way (about 1 s and tens of MiB of every load).
        def allocate(tensor: torch.Tensor) -> torch.Tensor:
            kind = dtype if tensor.is_floating_point() else tensor.dtype
            return torch.empty(tensor.shape, dtype=kind, device=device)

        self._apply(allocate)
        if self.quantization != "none":
            # One int8 copy serves the lookup and, tied, the head (quantization.py says why).
            vocab, hidden = self.arch.vocab_size, self.arch.hidden_size
            backend = self.quantized_backend
            embed_tokens = QuantizedEmbedding(vocab, hidden, dtype, device, backend)
            self.embed_tokens = embed_tokens
            self.lm_head = (
                embed_tokens
                if self.arch.tie_word_embeddings
                else QuantizedEmbedding(vocab, hidden, dtype, device, backend)
            )
        elif self.arch.tie_word_embeddings:
            # `allocate` replaces parameters one module at a time, which unties them.
            assert isinstance(self.lm_head, nn.Linear), "unquantized heads are nn.Linear"
            assert isinstance(self.embed_tokens, nn.Embedding), "unquantized: nn.Embedding"
            self.lm_head.weight = self.embed_tokens.weight

    def decoder_layers(self) -> list[LlamaDecoderLayer]:
        """`layers`, typed: the type checker sees an nn.ModuleList's items as plain Modules."""
        return [cast(LlamaDecoderLayer, layer) for layer in self.layers]

    def _is_tensor_parallel(self) -> bool:
        return any(layer.self_attn.tensor_parallel is not None for layer in self.decoder_layers())

    def set_tensor_parallel(self, group: AllReduce) -> None:
        """This model holds one rank's slice (its arch says which sizes): the row-parallel
        products are summed over the ranks through `group`."""
        for layer in self.decoder_layers():
            layer.self_attn.tensor_parallel = group
            layer.mlp.tensor_parallel = group
        self.fused_decode = None  # it has no all-reduce

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,  # [num_tokens]
        positions: torch.Tensor,  # [num_tokens]
        kv_cache: torch.Tensor,  # [num_layers or group slots, 2, blocks, block_size, kv_heads, dim]
        meta: AttentionMetadata,
        backend: AttentionBackend,
        logits_indices: torch.Tensor,  # [num_sampled] rows whose next token is sampled
        num_layers: int | None = None,  # only the first layers (a self-speculative draft)
    ) -> torch.Tensor:
        hidden = self.decode_layers(input_ids, positions, kv_cache, meta, backend, num_layers)
        # Norm and project only the rows that are sampled: a prefill chunk needs one, not all.
        return self.compute_logits(hidden[logits_indices])

    def compute_logits(self, rows: torch.Tensor) -> torch.Tensor:
        """Final norm and vocabulary projection of hidden rows [num_sampled, hidden] ->
        [num_sampled, vocab] float32 (a pipeline's rank 0 gets the rows from its last stage).
        Callers hold torch.inference_mode."""
        last = self.norm(rows)
        if isinstance(self.lm_head, QuantizedEmbedding):
            logits = self.lm_head.project(last).float()
        else:
            logits = linear(last, self.lm_head.weight, self._lm_head_onednn).float()
        cap = self.arch.final_logit_softcap
        return logits if not cap else torch.tanh(logits / cap) * cap

    def decode_layers(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        backend: AttentionBackend,
        num_layers: int | None = None,
    ) -> torch.Tensor:
        """The hidden states after the decoder layers, [num_tokens, hidden] (no head: tensor-
        parallel ranks other than 0 stop here). Callers hold torch.inference_mode."""
        hidden = self.embed_tokens(input_ids)
        if self.arch.embedding_multiplier != 1.0:
            # Gemma: rounded to the model's dtype first, as its reference multiplies.
            hidden = hidden * torch.tensor(self.arch.embedding_multiplier, dtype=hidden.dtype)
        return self.run_layers(hidden, positions, kv_cache, meta, backend, num_layers)

    def run_layers(
        self,
        hidden: torch.Tensor,  # [num_tokens, hidden]
        positions: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        backend: AttentionBackend,
        num_layers: int | None = None,
    ) -> torch.Tensor:
        """`hidden` through this model's decoder layers (a pipeline stage starts here)."""
        angles = self.rotary.lookup(positions, hidden.dtype)
        local = self.local_rotary
        local_angles = None if local is None else local.lookup(positions, hidden.dtype)
        fused = self.fused_decode
        lora_batch = None if self.lora is None else self.lora.batch
        lora_served = lora_batch is None or (fused is not None and fused.has_lora)
        if fused is not None and lora_served and fused.serves(hidden, meta):
            return fused.run(hidden, angles, kv_cache, meta, num_layers, lora_batch, local_angles)
        # Iterated, not sliced: a slice of a ModuleList builds a new one every step.
        for layer_id, layer in enumerate(self.layers):
            if layer_id == num_layers:
                break
            layer_angles = angles
            if local_angles is not None and self.arch.rotates_locally(layer_id):
                layer_angles = local_angles
            slot, layer_meta = meta.for_layer(layer_id)
            hidden = layer(hidden, layer_angles, kv_cache[slot], layer_meta, backend)
        return hidden

    def load_hf_weights(
        self, weights: Mapping[str, torch.Tensor | BlockQuantized], consume: bool = False
    ) -> None:
        """Copies Hugging Face-named tensors in, fusing q/k/v and gate/up, packing them when
        quantized; mutates self. With `consume` (`weights` a dict), each layer's tensors are
        deleted from `weights` once they are in the model, so the checkpoint and the model are
        never both whole in memory (the engine's load; tests build several models from one)."""
        params = dict(self.named_parameters())
        packed = _packed_modules(self)
        # On the CPU every product runs on oneDNN (shared/model/linear.py): each weight is
        # reordered as soon as it is in, so the plain copies never pile up.
        linears = _dense_linears(self) if self.quantization == "none" else {}
        if self.quantization == "gguf":
            log_gguf_notes(weights)
        for name, tensor in _internal_weights(weights, self.arch, consume):
            if name in packed:
                module = packed.pop(name)
                if isinstance(module, QuantizedLinear):
                    module.load(
                        pack_weight(
                            tensor, self.quantization, self.quantized_backend, self.weight_device
                        )
                    )
                else:
                    module.load(tensor)
                continue
            if name not in params:
                raise ValueError(f"unexpected weight {name!r} for this architecture")
            tensor = dense(tensor)
            target = params.pop(name)
            if target.shape != tensor.shape:
                raise ValueError(
                    f"weight {name!r} has shape {tuple(tensor.shape)}, "
                    f"expected {tuple(target.shape)}"
                )
            target.data.copy_(tensor)
            if name in linears:
                linears.pop(name).prepare_cpu_kernel()
        if params or packed:
            raise ValueError(f"checkpoint lacks weights: {sorted([*params, *packed])[:5]}")
        if self.quantization == "none":
            # The vocabulary projection runs on oneDNN too, reordered once the embedding is in.
            assert isinstance(self.lm_head, nn.Linear), "unquantized heads are nn.Linear"
            self._lm_head_onednn = onednn_weight(self.lm_head.weight)
            if self._lm_head_onednn is not None and not self.arch.tie_word_embeddings:
                # Its own head: the reordered copy replaces it (tied, the lookup needs it).
                head = self.lm_head.weight.detach()
                self.lm_head.weight = nn.Parameter(head.to("meta"), requires_grad=False)
        if not self._is_tensor_parallel():
            self.fused_decode = build_fused_decode(self)
            problem = fused_decode_problem(self.arch)
            if problem is not None:
                logger.info("fused decode off for %s: %s", self.arch.name, problem)
        logger.info(
            "weights: quantization %s, %.0f MiB resident",
            self.quantization,
            weight_nbytes(self) / 2**20,
        )


def _packed_modules(model: nn.Module) -> dict[str, QuantizedLinear | QuantizedEmbedding]:
    """Internal weight name -> the quantized module that takes it (tied: the embedding)."""
    packed: dict[str, QuantizedLinear | QuantizedEmbedding] = {}
    for name, module in model.named_modules():
        if isinstance(module, QuantizedLinear | QuantizedEmbedding):
            packed[f"{name}.weight"] = module
    return packed


def _dense_linears(model: nn.Module) -> dict[str, Linear]:
    """Internal weight name -> the dense `Linear` that takes it."""
    return {
        f"{name}.weight": module
        for name, module in model.named_modules()
        if isinstance(module, Linear)
    }


Tensors = Mapping[str, torch.Tensor | BlockQuantized]


def _internal_weights(
    weights: Tensors, arch: ModelArchitecture, consume: bool
) -> Iterator[tuple[str, torch.Tensor | BlockQuantized]]:
    """(internal name, tensor) pairs, one layer at a time: a layer's fused q/k/v and gate/up
    copies exist only while that layer loads. With `consume`, the Hugging Face tensors of
    what was yielded are deleted from `weights` (a dict) before the next layer. Raises
    ValueError naming a tensor the checkpoint lacks."""
    top_level = ["model.embed_tokens.weight", "model.norm.weight"]
    if not arch.tie_word_embeddings:  # tied: lm_head shares embed_tokens' parameter
        top_level.append("lm_head.weight")
    try:
        yield from ((name.removeprefix("model."), weights[name]) for name in top_level)
        if consume:
            _delete(weights, top_level)
        for i in range(arch.num_layers):
            yield from _internal_layer_weights(weights, arch, i).items()
            if consume:
                _delete(weights, [n for n in weights if n.startswith(f"model.layers.{i}.")])
    except KeyError as missing:
        raise ValueError(f"checkpoint lacks weight {missing.args[0]!r}") from None


def _delete(weights: Tensors, names: list[str]) -> None:
    assert isinstance(weights, dict), "consume needs the checkpoint's dict"
    for name in names:
        del weights[name]


def _internal_layer_weights(
    weights: Tensors, arch: ModelArchitecture, i: int
) -> dict[str, torch.Tensor | BlockQuantized]:
    """Layer `i`'s tensors under the model's names, q/k/v and gate/up fused (KeyError for a
    missing one)."""
    out: dict[str, torch.Tensor | BlockQuantized] = {}
    hf = f"model.layers.{i}."
    ours = f"layers.{i}."
    if arch.mla is not None:  # DeepSeek: its latent attention's tensors under their own names
        out.update(_mla_weights(weights, i))
    else:
        out.update(_qkv_weights(weights, arch, i))
    out.update(internal_feed_forward_weights(weights, arch, i))
    norms = ["input_layernorm", "post_attention_layernorm"]
    if arch.sandwich_norms:
        norms += ["pre_feedforward_layernorm", "post_feedforward_layernorm"]
    if arch.qk_norm:
        norms += ["self_attn.q_norm", "self_attn.k_norm"]
    for norm in norms:
        out[f"{ours}{norm}.weight"] = weights[f"{hf}{norm}.weight"]
    return out


def _mla_weights(weights: Tensors, i: int) -> dict[str, torch.Tensor | BlockQuantized]:
    prefix = f"model.layers.{i}.self_attn."
    return {
        f"layers.{i}.self_attn.{name.removeprefix(prefix)}": tensor
        for name, tensor in weights.items()
        if name.startswith(prefix)
    }


def _qkv_weights(
    weights: Tensors, arch: ModelArchitecture, i: int
) -> dict[str, torch.Tensor | BlockQuantized]:
    """Layer `i`'s q/k/v fused (with Qwen2's biases) and o_proj, under the model's names."""
    out: dict[str, torch.Tensor | BlockQuantized] = {}
    attn, ours = f"model.layers.{i}.self_attn.", f"layers.{i}."
    out[ours + "self_attn.qkv_proj.weight"] = cat_rows(
        [
            weights[attn + "q_proj.weight"],
            weights[attn + "k_proj.weight"],
            weights[attn + "v_proj.weight"],
        ]
    )
    if arch.attention_bias:
        out[ours + "self_attn.qkv_proj.bias"] = torch.cat(
            [dense(weights[attn + f"{p}_proj.bias"]) for p in ("q", "k", "v")]
        )
    out[ours + "self_attn.o_proj.weight"] = weights[attn + "o_proj.weight"]
    return out
