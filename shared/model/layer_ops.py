"""The small operations of a decoder layer (RMSNorm, the residual add before it, SwiGLU's
activation, rotary embedding with the q/k/v split), and the one place that picks how they run.

On the CPU in float32 each is one call into the C++ kernels (kernels/cpu/layer_ops.cpp) instead
of the several PyTorch ops it takes otherwise: at decode their tensors are a few rows, so the
ops' fixed costs were their whole cost (`python -m benchmarks.step_breakdown`, forward_rest).
Elsewhere (CUDA, bfloat16 activations, no compiler, SPLITSERVE_CPU_KERNELS=0) the PyTorch ops
below run, and they are the reference the C++ is tested against (tests/test_cpu_layer_ops.py).
"""

from __future__ import annotations

from types import ModuleType

import torch
import torch.nn.functional as F

from splitserve.engine.model.attention_metadata import AttentionBackend, AttentionMetadata
from splitserve.engine.model.rotary import RotaryAngles
from splitserve.kernels import cpu as cpu_kernels


class TorchLayerOps:
    """The layer ops as PyTorch ops: any device, any dtype."""

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        # Normalise in float32 whatever the model dtype, as the reference implementation does.
        x32 = x.float()
        variance = x32.pow(2).mean(-1, keepdim=True)
        return weight * (x32 * torch.rsqrt(variance + eps)).to(x.dtype)

    def add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(rms_norm(x + residual), x + residual)."""
        summed = x + residual
        return self.rms_norm(summed, weight, eps), summed

    def rms_norm_qk_heads(
        self,
        qkv: torch.Tensor,
        q_weight: torch.Tensor,
        k_weight: torch.Tensor,
        num_heads: int,
        num_kv_heads: int,
        eps: float,
    ) -> torch.Tensor:
        """qkv [tokens, (heads + 2 kv_heads) * head_dim] with each q and k head RMS-normalised
        over head_dim (Qwen3's and Gemma 3's q/k norms); v as it was. The result may be `qkv`
        itself, overwritten (the C++ op's): pass a tensor nothing else reads afterwards."""
        num_tokens, dim = qkv.shape[0], q_weight.shape[0]
        q_size, kv_size = num_heads * dim, num_kv_heads * dim
        q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
        q = self.rms_norm(q.reshape(-1, dim), q_weight, eps).view(num_tokens, q_size)
        k = self.rms_norm(k.reshape(-1, dim), k_weight, eps).view(num_tokens, kv_size)
        return torch.cat((q, k, v), dim=-1)

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up

    def rotary_split_qkv(
        self, qkv: torch.Tensor, rotary: RotaryAngles, num_heads: int, num_kv_heads: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q [tokens, num_heads, head_dim] and k rotated, and v, from the fused projection."""
        num_tokens = qkv.shape[0]
        head_dim = qkv.shape[1] // (num_heads + 2 * num_kv_heads)
        sizes = [num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim]
        q, k, v = qkv.split(sizes, dim=-1)
        q = q.view(num_tokens, num_heads, head_dim)
        k = k.view(num_tokens, num_kv_heads, head_dim)
        q, k = rotary.apply(q, k)
        return q, k, v.view(num_tokens, num_kv_heads, head_dim)

    def rotary_qkv_into_cache(
        self,
        qkv: torch.Tensor,
        rotary: RotaryAngles,
        num_heads: int,
        num_kv_heads: int,
        layer_cache: torch.Tensor,
        meta: AttentionMetadata,
        backend: AttentionBackend,
    ) -> torch.Tensor:
        """`rotary_split_qkv`, then k and v written to their slots by `backend` -> q."""
        q, k, v = self.rotary_split_qkv(qkv, rotary, num_heads, num_kv_heads)
        backend.write_kv(k, v, layer_cache, meta)
        return q


class CpuKernelLayerOps(TorchLayerOps):
    """The C++ kernels for float32 CPU tensors, the PyTorch ops for anything else (a bfloat16
    model's activations). Calls the module directly: splitserve.kernels.cpu's wrappers are for
    callers
    that want their arguments checked, and a check costs more than a decode row's norm."""

    def __init__(self, module: ModuleType) -> None:
        self._module = module

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        if x.dtype != torch.float32 or x.dim() != 2:
            return super().rms_norm(x, weight, eps)
        return self._module.rms_norm(x, weight, eps)

    def add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if x.dtype != torch.float32 or residual.dtype != torch.float32 or x.dim() != 2:
            return super().add_rms_norm(x, residual, weight, eps)
        normed, summed = self._module.add_rms_norm(x, residual, weight, eps)
        return normed, summed

    def rms_norm_qk_heads(
        self,
        qkv: torch.Tensor,
        q_weight: torch.Tensor,
        k_weight: torch.Tensor,
        num_heads: int,
        num_kv_heads: int,
        eps: float,
    ) -> torch.Tensor:
        if qkv.dtype != torch.float32 or qkv.dim() != 2 or qkv.stride(1) != 1:
            return super().rms_norm_qk_heads(qkv, q_weight, k_weight, num_heads, num_kv_heads, eps)
        # In place: qkv is the projection's own fresh output.
        self._module.rms_norm_qk_heads(qkv, q_weight, k_weight, num_heads, num_kv_heads, eps)
        return qkv

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        if gate_up.dtype != torch.float32 or gate_up.dim() != 2:
            return super().silu_and_mul(gate_up)
        return self._module.silu_and_mul(gate_up)

    def rotary_split_qkv(
        self, qkv: torch.Tensor, rotary: RotaryAngles, num_heads: int, num_kv_heads: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if qkv.dtype != torch.float32 or rotary.cos.dtype != torch.float32 or qkv.dim() != 2:
            return super().rotary_split_qkv(qkv, rotary, num_heads, num_kv_heads)
        q, k, v = self._module.rotary_split_qkv(
            qkv, rotary.cos, rotary.sin, num_heads, num_kv_heads
        )
        return q, k, v

    def rotary_qkv_into_cache(
        self,
        qkv: torch.Tensor,
        rotary: RotaryAngles,
        num_heads: int,
        num_kv_heads: int,
        layer_cache: torch.Tensor,
        meta: AttentionMetadata,
        backend: AttentionBackend,
    ) -> torch.Tensor:
        # A float32 cache in the layout every backend shares (shared/model/attention.py) is
        # written here, in the same pass as the rotation; int8 caches quantize in the backend.
        if (
            layer_cache.dtype != torch.float32
            or qkv.dtype != torch.float32
            or rotary.cos.dtype != torch.float32
            or qkv.dim() != 2
            or not layer_cache.is_contiguous()
        ):
            return super().rotary_qkv_into_cache(
                qkv, rotary, num_heads, num_kv_heads, layer_cache, meta, backend
            )
        return self._module.rotary_split_qkv_into_cache(
            qkv, rotary.cos, rotary.sin, num_heads, num_kv_heads, layer_cache, meta.slot_mapping
        )


def select_layer_ops(device: torch.device) -> TorchLayerOps:
    """The C++ layer ops on the CPU where they built (SPLITSERVE_CPU_KERNELS=0 turns them off,
    as it does the attention kernel), the PyTorch ops elsewhere."""
    if device.type == "cpu":
        module = cpu_kernels.load()
        if module is not None:
            return CpuKernelLayerOps(module)
    return TorchLayerOps()
