"""A Llama-family decoder that runs flattened ragged batches over the paged KV cache.

Mixtral and Qwen2-MoE share it: only the feed-forward block differs (`feed_forward`,
shared/model/moe_layer.py) and Qwen2's q/k/v biases (`ModelArchitecture.attention_bias`).

One forward serves prefill chunks and decode tokens of many requests at once: every token is a
row of `[num_tokens, hidden]`, and only attention needs to know which row belongs to whom.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from shared.model.architecture import ModelArchitecture
from shared.model.attention_metadata import AttentionBackend, AttentionMetadata
from shared.model.feed_forward import internal_feed_forward_weights
from shared.model.linear import Linear, linear, onednn_weight
from shared.model.moe_layer import SparseMoeBlock
from shared.model.rotary import RotaryAngles, RotaryEmbedding


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in float32 whatever the model dtype, as the reference implementation does.
        x32 = x.float()
        variance = x32.pow(2).mean(-1, keepdim=True)
        return self.weight * (x32 * torch.rsqrt(variance + self.eps)).to(x.dtype)


class LlamaAttention(nn.Module):
    def __init__(self, arch: ModelArchitecture) -> None:
        super().__init__()
        self.num_heads = arch.num_heads
        self.num_kv_heads = arch.num_kv_heads
        self.head_dim = arch.head_dim
        self.scale = arch.head_dim**-0.5
        q_size = arch.num_heads * arch.head_dim
        kv_size = arch.num_kv_heads * arch.head_dim
        self.split_sizes = [q_size, kv_size, kv_size]
        # q, k and v in one matmul: one pass over the activations instead of three.
        self.qkv_proj = Linear(arch.hidden_size, q_size + 2 * kv_size, bias=arch.attention_bias)
        self.o_proj = Linear(q_size, arch.hidden_size)

    def forward(
        self,
        hidden: torch.Tensor,
        rotary: RotaryAngles,
        layer_cache: torch.Tensor,
        meta: AttentionMetadata,
        backend: AttentionBackend,
    ) -> torch.Tensor:
        num_tokens = hidden.shape[0]
        q, k, v = self.qkv_proj(hidden).split(self.split_sizes, dim=-1)
        q = q.view(num_tokens, self.num_heads, self.head_dim)
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        q, k = rotary.apply(q, k)
        backend.write_kv(k, v, layer_cache, meta)
        out = backend.attend(q, layer_cache, meta, self.scale)  # [num_tokens, heads, head_dim]
        return self.o_proj(out.reshape(num_tokens, -1))


class LlamaMLP(nn.Module):
    def __init__(self, arch: ModelArchitecture) -> None:
        super().__init__()
        self.intermediate_size = arch.intermediate_size
        self.gate_up_proj = Linear(arch.hidden_size, 2 * arch.intermediate_size)
        self.down_proj = Linear(arch.intermediate_size, arch.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.intermediate_size, dim=-1)
        return self.down_proj(F.silu(gate) * up)


def feed_forward(arch: ModelArchitecture) -> nn.Module:
    """A layer's MLP: dense SwiGLU, or the sparse experts of Mixtral and Qwen2-MoE."""
    return LlamaMLP(arch) if arch.moe is None else SparseMoeBlock(arch)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, arch: ModelArchitecture) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.self_attn = LlamaAttention(arch)
        self.post_attention_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.mlp = feed_forward(arch)

    def forward(
        self,
        hidden: torch.Tensor,
        rotary: RotaryAngles,
        layer_cache: torch.Tensor,
        meta: AttentionMetadata,
        backend: AttentionBackend,
    ) -> torch.Tensor:
        attn_out = self.self_attn(self.input_layernorm(hidden), rotary, layer_cache, meta, backend)
        hidden = hidden + attn_out
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


class LlamaForCausalLM(nn.Module):
    def __init__(self, arch: ModelArchitecture, max_positions: int, device: torch.device) -> None:
        super().__init__()
        self.arch = arch
        # Built on the meta device: random initialisation of weights about to be overwritten
        # would cost seconds. `materialize` gives them real storage.
        with torch.device("meta"):
            self.embed_tokens = nn.Embedding(arch.vocab_size, arch.hidden_size)
            self.layers = nn.ModuleList(LlamaDecoderLayer(arch) for _ in range(arch.num_layers))
            self.norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
            self.lm_head = nn.Linear(arch.hidden_size, arch.vocab_size, bias=False)
        self.rotary = RotaryEmbedding(arch, max_positions, device)
        self.requires_grad_(False)

    def materialize(self, device: torch.device, dtype: torch.dtype) -> None:
        """Allocates uninitialised storage for every weight; `load_hf_weights` fills it."""
        self.to_empty(device=device)
        self.to(dtype)
        if self.arch.tie_word_embeddings:
            # to_empty replaces parameters one module at a time, which unties them.
            self.lm_head.weight = self.embed_tokens.weight

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,  # [num_tokens]
        positions: torch.Tensor,  # [num_tokens]
        kv_cache: torch.Tensor,  # [num_layers, 2, num_blocks, block_size, kv_heads, head_dim]
        meta: AttentionMetadata,
        backend: AttentionBackend,
        logits_indices: torch.Tensor,  # [num_sampled] rows whose next token is sampled
        num_layers: int | None = None,  # only the first layers (a self-speculative draft)
    ) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)
        angles = self.rotary.lookup(positions, hidden.dtype)
        for layer_id, layer in enumerate(self.layers[:num_layers]):
            hidden = layer(hidden, angles, kv_cache[layer_id], meta, backend)
        # Norm and project only the rows that are sampled: a prefill chunk needs one, not all.
        last = self.norm(hidden[logits_indices])
        weight = self.lm_head.weight
        return linear(last, weight, self._lm_head_onednn).float()  # [num_sampled, vocab]

    def load_hf_weights(self, weights: dict[str, torch.Tensor]) -> None:
        """Copies Hugging Face-named tensors in, fusing q/k/v and gate/up; mutates self."""
        params = dict(self.named_parameters())
        try:
            internal = _to_internal_names(weights, self.arch)
        except KeyError as missing:
            raise ValueError(f"checkpoint lacks weight {missing.args[0]!r}") from None
        for name, tensor in internal.items():
            if name not in params:
                raise ValueError(f"unexpected weight {name!r} for this architecture")
            target = params.pop(name)
            if target.shape != tensor.shape:
                raise ValueError(
                    f"weight {name!r} has shape {tuple(tensor.shape)}, "
                    f"expected {tuple(target.shape)}"
                )
            target.data.copy_(tensor)
        if params:
            raise ValueError(f"checkpoint lacks weights: {sorted(params)[:5]}")
        # On the CPU every product, the vocabulary projection too, runs on oneDNN (see
        # shared/model/linear.py): its weights are reordered once, here.
        self._lm_head_onednn = onednn_weight(self.lm_head.weight)
        for module in self.modules():
            if isinstance(module, Linear):
                module.prepare_cpu_kernel()


def _to_internal_names(
    weights: dict[str, torch.Tensor], arch: ModelArchitecture
) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {
        "embed_tokens.weight": weights["model.embed_tokens.weight"],
        "norm.weight": weights["model.norm.weight"],
    }
    if not arch.tie_word_embeddings:  # tied: lm_head shares embed_tokens' parameter
        out["lm_head.weight"] = weights["lm_head.weight"]
    for i in range(arch.num_layers):
        hf = f"model.layers.{i}."
        ours = f"layers.{i}."
        attn = hf + "self_attn."
        out[ours + "self_attn.qkv_proj.weight"] = torch.cat(
            [
                weights[attn + "q_proj.weight"],
                weights[attn + "k_proj.weight"],
                weights[attn + "v_proj.weight"],
            ]
        )
        if arch.attention_bias:
            out[ours + "self_attn.qkv_proj.bias"] = torch.cat(
                [weights[attn + f"{p}_proj.bias"] for p in ("q", "k", "v")]
            )
        out[ours + "self_attn.o_proj.weight"] = weights[attn + "o_proj.weight"]
        out.update(internal_feed_forward_weights(weights, arch, i))
        out[ours + "input_layernorm.weight"] = weights[hf + "input_layernorm.weight"]
        out[ours + "post_attention_layernorm.weight"] = weights[
            hf + "post_attention_layernorm.weight"
        ]
    return out
