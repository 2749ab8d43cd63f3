"""GGUF's 4-bit blocks read as codes and per-block affine numbers, so that
`quantization="gguf"` keeps them packed instead of dequantizing to float32.

ggml's blocks hold 32 weights each, along a row:
    Q4_0: f16 d, 16 bytes of nibbles;        weight = d * (q - 8)
    Q4_1: f16 d, f16 m, 16 bytes of nibbles; weight = d * q + m
with weight j (j < 16) in the low nibble of byte j and weight j + 16 in its high nibble. Both
are `scale * code + minimum` per block (Q4_0: minimum = -8d), which is torch's int4 kernel
form with groups of 32 (`splitserve.engine.model.quantized_linear.int4_from_codes`), so the codes
carry
over bit for bit and only the scales are rounded (to bfloat16, the kernel's activation dtype).

Other types (Q8_0's one scale per 32 weights has no per-channel int8 equivalent, K-quants,
float tensors) are not read here: the loader dequantizes them.
"""

from __future__ import annotations

from dataclasses import dataclass

import gguf
import numpy as np
import torch

from splitserve.engine.gguf_file import GGUFTensor

_BLOCK = 32
# type -> bytes per block before the nibbles (d, or d and m, as float16)
_HEADER_BYTES = {gguf.GGMLQuantizationType.Q4_0: 2, gguf.GGMLQuantizationType.Q4_1: 4}
PACKED_TYPES = tuple(_HEADER_BYTES)


@dataclass(frozen=True)
class BlockQuantized:
    """A [rows, cols] weight as 4-bit codes and one (scale, minimum) per block of 32 columns:
    `weight[r, c] = scale[r, c // 32] * codes[r, c] + minimum[r, c // 32]`."""

    codes: torch.Tensor  # [rows, cols] uint8 in 0..15
    scale: torch.Tensor  # [rows, cols / 32] float32 (float16 in the file: exact)
    minimum: torch.Tensor  # [rows, cols / 32] float32

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.codes.shape)  # type: ignore[return-value]

    def dequantize(self) -> torch.Tensor:
        """float32 [rows, cols] (for tests and for the fallback without the int4 kernel)."""
        rows, cols = self.codes.shape
        blocks = self.codes.float().view(rows, cols // _BLOCK, _BLOCK)
        values = blocks * self.scale[..., None] + self.minimum[..., None]
        return values.view(rows, cols)

    def permute_rows(self, order: np.ndarray) -> BlockQuantized:
        index = torch.from_numpy(np.ascontiguousarray(order))
        return BlockQuantized(self.codes[index], self.scale[index], self.minimum[index])

    @staticmethod
    def cat(parts: list[BlockQuantized]) -> BlockQuantized:
        """Rows of `parts` one after another (q, k, v fused; gate and up fused)."""
        return BlockQuantized(
            torch.cat([p.codes for p in parts]),
            torch.cat([p.scale for p in parts]),
            torch.cat([p.minimum for p in parts]),
        )


def read_blocks(tensor: GGUFTensor) -> BlockQuantized:
    """The Q4_0 / Q4_1 `tensor` (rows along GGUF's outer dimension) without dequantizing."""
    header = _HEADER_BYTES[tensor.tensor_type]
    rows, cols = (int(dim) for dim in reversed(tensor.shape))
    assert cols % _BLOCK == 0, f"{tensor.name}: {cols} columns are not whole blocks"
    raw = np.asarray(tensor.data).reshape(rows, cols // _BLOCK, header + _BLOCK // 2)
    halves = raw[..., :header].copy().view(np.float16).astype(np.float32)  # [rows, blocks, 1|2]
    scale = halves[..., 0]
    if tensor.tensor_type == gguf.GGMLQuantizationType.Q4_1:
        minimum = halves[..., 1]
    else:
        minimum = -8.0 * scale
    nibbles = raw[..., header:]  # [rows, blocks, 16]
    codes = np.concatenate([nibbles & 0x0F, nibbles >> 4], axis=-1).reshape(rows, cols)
    return BlockQuantized(
        torch.from_numpy(np.ascontiguousarray(codes)),
        torch.from_numpy(np.ascontiguousarray(scale)),
        torch.from_numpy(np.ascontiguousarray(minimum)),
    )
