"""Which layer classes the decoder builds for `ModelConfig.quantization`, and how a loaded
tensor becomes their packed weight.

    "none"  dense `Linear`s, dense embedding and head (the model's dtype)
    "int8"  every decoder matrix int8 per output channel
    "int4"  every decoder matrix int4 in groups of 32
    "gguf"  a GGUF file's Q4_0/Q4_1 matrices repacked as they are into the int4 layout; any
            other type (Q8_0, K-quants, floats) dequantized and re-quantized to int8 per
            channel, with a logged note

With any of the three, the vocabulary matrix (embedding and head, one copy when tied) is int8
per row: dense float32 it alone would be a third of SmolLM2's float32 weights (49152 x 576),
more than the whole int4 decoder. A GGUF file's Q8_0 embedding has one scale per 32 values,
which per-row int8 cannot hold exactly: it is re-quantized (logged).

int4 and gguf weights are packed in our own layout for kernels/cpu/int4_gemm.cpp where the C++
kernels load (on any x86-64 CPU with AVX2, and on ARM), else in torch's, packed by torch on this
host for its own kernel (quantized_linear.int4_layout). Where no packed kernel answers right
(checked once on a small product), the model is built dense instead, with a warning: slower and
larger, never silently so.

On CUDA (`select_quantized_backend`) the same methods keep the layouts the Triton dequantizing
matmuls read (shared/model/quantized_triton.py), packed on the device; where Triton is missing
or its kernels fail their check, the model is built dense, with a warning, as on the CPU.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

import torch
from torch import nn

from splitserve.engine.config import QUANTIZATION_METHODS
from splitserve.engine.model.gguf_blocks import BlockQuantized
from splitserve.engine.model.linear import Linear
from splitserve.engine.model.quantized_linear import (
    INT8_ACTIVATION_QUANT_FROM_ROWS,
    Int8Weight,
    QuantizedLinear,
    QuantizedWeight,
    int4_from_codes,
    int4_layout,
    kernels_usable,
    quantize,
    quantize_int8,
    quantized_matmul,
    warn_if_kernel_is_slow,
)
from splitserve.engine.model.quantized_triton import (
    QuantizedBackend,
    TritonInt8Weight,
    TritonWeight,
    int4_group_weight,
    quantize_for_triton,
    select_quantized_backend,
    to_triton_int8,
    triton_kernel_problem,
    triton_slowness,
)
from splitserve.kernels import cpu as cpu_kernels

logger = logging.getLogger(__name__)

__all__ = ["QUANTIZATION_METHODS"]  # re-exported for the model's callers
_CPU = torch.device("cpu")
# Which packed kernels each method needs.
_KERNELS = {"int8": ("int8",), "int4": ("int8", "int4"), "gguf": ("int8", "int4")}
_RESIDUAL_STEPS = 14  # a vocabulary code's lookup refinement, per step (QuantizedEmbedding)


def effective_method(method: str, device: torch.device) -> str:
    """`method`, or "none" (with a warning) where its kernels cannot run here."""
    if method == "none":
        return method
    if select_quantized_backend(device) == "triton":
        if not triton_kernels_usable(method, device):
            return "none"
        note = triton_slowness(method, device)
        if note is not None:
            logger.warning(note)
        return method
    if not all(kernels_usable(kernel) for kernel in _KERNELS[method]):
        return "none"
    warn_if_kernel_is_slow("int8" if method == "int8" else "int4")
    if method != "int8":
        int4_layout()  # which int4 kernel, decided at start-up; logs why when not ours
    return method


def triton_kernels_usable(method: str, device: torch.device) -> bool:
    """Whether the Triton kernels run right on `device`; logs a warning when they do not."""
    problem = triton_kernel_problem(device)
    if problem is not None:
        logger.warning(
            "quantization %r: the Triton dequantizing matmuls are not usable on %s (%s); the "
            "weights are dequantized and run densely instead (no memory is saved)",
            method,
            device,
            problem,
        )
    return problem is None


def make_linear(
    in_features: int,
    out_features: int,
    method: str,
    activation_passes: int = 1,
    bias: bool = False,
) -> nn.Module:
    """A dense or quantized layer, with a dense bias when `bias`; `activation_passes`
    (QuantizedLinear's) matters to int8 products of many rows only."""
    if method == "none":
        return Linear(in_features, out_features, bias=bias)
    return QuantizedLinear(in_features, out_features, method, activation_passes, bias=bias)


def pack_weight(
    weight: torch.Tensor | BlockQuantized,
    method: str,
    backend: QuantizedBackend = "torch",
    device: torch.device = _CPU,
) -> QuantizedWeight | TritonWeight:
    """A decoder matrix in `method`'s packed form for `backend`'s kernels, on `device`."""
    if backend == "triton":
        return _pack_for_triton(weight, method, device)
    if isinstance(weight, BlockQuantized):
        if method == "gguf":
            return int4_from_codes(
                weight.codes, weight.scale, weight.minimum, in_features=weight.shape[1]
            )
        weight = weight.dequantize()  # blocks only come with "gguf"; kept general
    return quantize(weight, "int8" if method == "gguf" else method)


def _pack_for_triton(
    weight: torch.Tensor | BlockQuantized, method: str, device: torch.device
) -> TritonWeight:
    """Moved to the device first: quantizing there is the fast part of loading on a GPU."""
    if isinstance(weight, BlockQuantized):
        if method == "gguf":
            parts = (weight.codes, weight.scale, weight.minimum)
            codes, scale, minimum = (part.to(device) for part in parts)
            return int4_group_weight(codes, scale, minimum, in_features=weight.shape[1])
        weight = weight.dequantize()
    return quantize_for_triton(weight.to(device), "int8" if method == "gguf" else method)


def dense(weight: torch.Tensor | BlockQuantized) -> torch.Tensor:
    return weight.dequantize() if isinstance(weight, BlockQuantized) else weight


def cat_rows(parts: list[torch.Tensor | BlockQuantized]) -> torch.Tensor | BlockQuantized:
    """Fused q/k/v or gate/up: blocks stay blocks when every part is; otherwise floats."""
    if all(isinstance(part, BlockQuantized) for part in parts):
        return BlockQuantized.cat(parts)  # type: ignore[arg-type]
    return torch.cat([dense(part) for part in parts])


def log_gguf_notes(weights: Mapping[str, torch.Tensor | BlockQuantized]) -> None:
    """Says which matrices of a GGUF file could not be kept as they are (quantization=gguf)."""
    matrices = {name: w for name, w in weights.items() if len(w.shape) == 2}
    requantized = sorted(n for n, w in matrices.items() if not isinstance(w, BlockQuantized))
    if requantized:
        logger.info(
            "quantization 'gguf': %d of %d matrices are not Q4_0/Q4_1 (%s%s): dequantized and "
            "re-quantized to int8 per channel (per row for the vocabulary matrix)",
            len(requantized),
            len(matrices),
            ", ".join(requantized[:3]),
            " ..." if len(requantized) > 3 else "",
        )


class QuantizedEmbedding(nn.Module):
    """The vocabulary matrix [vocab, hidden] as int8 per row: looked up for the embedding and,
    tied or as the separate head, multiplied for the logits (a row's scale is then its output
    channel's).

    A lookup also adds a 4-bit refinement of each code (`lookup_residual`: what rounding to
    int8 left, in 14ths of a step), half a byte per value: per-row int8 alone coarsens the
    small values of a row with a few large ones, and the looked-up embeddings carried most of
    the quantized models' perplexity gap (the shipped file's chunks-of-8 text: +0.38% with it
    as plain int8, +0.18% with the lookup exact). The product for the logits keeps the codes
    alone, which its int8 kernels need."""

    def __init__(
        self,
        vocab_size: int,
        hidden_size: int,
        dtype: torch.dtype,
        device: torch.device = _CPU,
        backend: QuantizedBackend = "torch",
    ) -> None:
        super().__init__()
        self.vocab_size, self.hidden_size, self.dtype = vocab_size, hidden_size, dtype
        self.device, self.backend = device, backend
        self.qweight: Int8Weight | TritonInt8Weight | None = None
        self.lookup_residual: torch.Tensor | None = None  # [vocab, in_padded / 2] uint8
        self.nibble_refinements: torch.Tensor | None = None  # [256, 2]: _nibble_refinements

    def load(self, weight: torch.Tensor | BlockQuantized) -> None:
        weight = dense(weight)
        if tuple(weight.shape) != (self.vocab_size, self.hidden_size):
            raise ValueError(
                f"vocabulary matrix has shape {tuple(weight.shape)}, expected "
                f"{(self.vocab_size, self.hidden_size)}"
            )
        packed = quantize_int8(weight.to(self.device))
        self.lookup_residual = _residual_nibbles(weight.to(self.device), packed)
        self.nibble_refinements = _nibble_refinements(self.device)
        self.qweight = to_triton_int8(packed) if self.backend == "triton" else packed

    def forward(self, token_ids: torch.Tensor) -> torch.Tensor:
        """[num_tokens] -> [num_tokens, hidden] in the model's dtype."""
        assert self.qweight is not None, "QuantizedEmbedding used before load()"
        assert self.lookup_residual is not None, "QuantizedEmbedding used before load()"
        assert self.nibble_refinements is not None, "QuantizedEmbedding used before load()"
        module = cpu_kernels.load()
        if (
            module is not None
            and self.backend == "torch"
            and token_ids.device.type == "cpu"
            and token_ids.dim() == 1
        ):
            # The same arithmetic in one call (kernels/cpu/step_lookups.cpp), bit for bit:
            # the ops below took 0.27 ms of a batch-1 step (2-core AVX2 EPYC).
            looked_up = module.int8_embedding(
                token_ids.to(torch.int64).contiguous(),
                self.qweight.codes,
                self.lookup_residual,
                self.nibble_refinements,
                self.qweight.scales,
                self.hidden_size,
            )
            return looked_up.to(self.dtype)
        return self.torch_lookup(token_ids)

    def torch_lookup(self, token_ids: torch.Tensor) -> torch.Tensor:
        """forward's lookup in PyTorch ops: where the C++ kernels are not loaded, on another
        device, and the kernel's reference."""
        assert self.qweight is not None and self.lookup_residual is not None
        assert self.nibble_refinements is not None, "QuantizedEmbedding used before load()"
        codes = self.qweight.codes[token_ids].float()
        # Each byte's two refinements from a 256-row table: one gather where unpacking the
        # nibbles and scaling them took six small ops (one token's lookup: 172 -> 110 us).
        nibbles = self.lookup_residual[token_ids].long()
        refined = codes.add_(self.nibble_refinements[nibbles].view(codes.shape))
        scales = self.qweight.scales[token_ids].float()[:, None]
        return (refined[:, : self.hidden_size] * scales).to(self.dtype)

    def project(self, hidden: torch.Tensor) -> torch.Tensor:
        """[rows, hidden] -> logits [rows, vocab] in hidden's dtype."""
        assert self.qweight is not None, "QuantizedEmbedding used before load()"
        # Two activation passes: one pass moved the int4 model's perplexity +0.7% (the final
        # norm's output has a few large features per row, as qkv's input does).
        logits = self.qweight.matmul(hidden, activation_passes=2)
        if hidden.shape[0] >= INT8_ACTIVATION_QUANT_FROM_ROWS and self.backend == "torch":
            # Many rows (prompt logprobs, a text's perplexity; a step's logits are a few rows)
            # are compute-bound: the lookup's refinement costs one more int8 product there and
            # takes the head's per-row rounding out (the quality text in one prefill: +0.45%
            # perplexity with the codes alone, +0.05% refined). At few rows the product reads
            # the head's bytes once per step, and the refinement would add half as many again.
            logits = logits.add_(self._refinement_product(hidden).to(logits.dtype))
        return logits

    def _refinement_product(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden @ (the lookup residuals x each row's step).T: [rows, vocab] float32."""
        assert isinstance(self.qweight, Int8Weight) and self.lookup_residual is not None
        nibbles = self.lookup_residual
        residual = torch.stack([nibbles & 15, nibbles >> 4], dim=-1).view(nibbles.shape[0], -1)
        codes = (residual.to(torch.int16) - 8).to(torch.int8)  # -7..7
        steps = (self.qweight.scales.float() / _RESIDUAL_STEPS).to(torch.bfloat16)
        refinement = Int8Weight(codes, steps, self.hidden_size)
        return quantized_matmul(hidden, refinement, activation_passes=2).float()


def _nibble_refinements(device: torch.device) -> torch.Tensor:
    """[256, 2] float32: a lookup-residual byte's two refinements (low nibble first), in steps
    of the row's scale, computed as QuantizedEmbedding.forward computed them per element."""
    byte = torch.arange(256, device=device)
    halves = torch.stack([byte & 15, byte >> 4], dim=-1)
    return (halves.float() - 8) / _RESIDUAL_STEPS


def _residual_nibbles(weight: torch.Tensor, packed: Int8Weight) -> torch.Tensor:
    """What rounding `weight` [vocab, hidden] to `packed`'s codes left (within half a step), in
    14ths of each row's step (-7..7: 16ths would need 17 values), offset by 8 into 1..15, two
    per byte: [vocab, in_padded / 2] uint8."""
    in_padded = packed.codes.shape[1]
    w = torch.nn.functional.pad(weight.float(), (0, in_padded - weight.shape[1]))
    steps = w / packed.scales.float()[:, None] - packed.codes.float()  # within +-1/2
    nibbles = (torch.round(steps * _RESIDUAL_STEPS) + 8).clamp(1, 15).to(torch.uint8)
    pairs = nibbles.view(w.shape[0], in_padded // 2, 2)
    return (pairs[..., 0] | (pairs[..., 1] << 4)).contiguous()


def weight_nbytes(model: nn.Module) -> int:
    """Bytes of weights `model` keeps resident: parameters (each storage once), oneDNN's
    reordered copies, packed weights."""
    seen: set[int] = set()
    total = 0

    def add(tensor: torch.Tensor | None) -> None:
        nonlocal total
        if tensor is None or tensor.device.type == "meta":
            return
        try:
            key, nbytes = tensor.untyped_storage().data_ptr(), tensor.untyped_storage().nbytes()
        except NotImplementedError:  # oneDNN's reordered weights are opaque: no storage
            key, nbytes = id(tensor), tensor.numel() * tensor.element_size()
        if key not in seen:
            seen.add(key)
            total += nbytes

    for param in model.parameters():
        add(param)
    for module in model.modules():
        add(getattr(module, "onednn_weight", None))
        add(getattr(module, "_lm_head_onednn", None))
        add(getattr(module, "lookup_residual", None))
        add(getattr(module, "nibble_refinements", None))
        packed = getattr(module, "qweight", None)
        if packed is not None:
            for tensor in vars(packed).values():
                if isinstance(tensor, torch.Tensor):
                    add(tensor)
    return total
