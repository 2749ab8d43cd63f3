"""GGUF block types to float32 in whole-tensor numpy passes.

`gguf.quants.dequantize` splits a tensor into groups of rows and runs a dozen small numpy
operations on each: 2.3 s for SmolLM2's Q4_1 file on a 2-vCPU Xeon (2026-11-27), a fifth of a
model load. The block types llama.cpp's common files use are decoded here over the whole tensor
at once, with the same float32 operations in the same order as gguf's (so the values are the
same to the bit, tests/test_gguf_file.py); any other type goes to gguf.
"""

from __future__ import annotations

import numpy as np
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize


def dequantize(data: np.ndarray, qtype: GGMLQuantizationType) -> np.ndarray:
    """float32 values of a tensor's raw data (as the GGUF reader gives it): shape
    (..., row bytes) -> (..., row values)."""
    decode = _DECODERS.get(qtype)
    if decode is None:
        return gguf_dequantize(data, qtype)
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    row_bytes = data.shape[-1]
    blocks = np.ascontiguousarray(data).reshape(-1, type_size)
    values = decode(blocks)
    return values.reshape(*data.shape[:-1], row_bytes // type_size * block_size)


def _half(blocks: np.ndarray, start: int) -> np.ndarray:
    """The float16 at byte `start` of every block, as float32, shape (blocks, 1)."""
    return np.ascontiguousarray(blocks[:, start : start + 2]).view(np.float16).astype(np.float32)


def _nibbles(packed: np.ndarray) -> np.ndarray:
    """A block's 16 bytes as its 32 4-bit codes: low nibbles first, then high ones."""
    return np.concatenate([packed & np.uint8(0x0F), packed >> np.uint8(4)], axis=1)


def _q4_0(blocks: np.ndarray) -> np.ndarray:
    scale = _half(blocks, 0)
    codes = _nibbles(blocks[:, 2:]).astype(np.int8) - np.int8(8)
    return scale * codes.astype(np.float32)


def _q4_1(blocks: np.ndarray) -> np.ndarray:
    scale, minimum = _half(blocks, 0), _half(blocks, 2)
    return (scale * _nibbles(blocks[:, 4:]).astype(np.float32)) + minimum


def _q8_0(blocks: np.ndarray) -> np.ndarray:
    scale = _half(blocks, 0)
    codes = np.ascontiguousarray(blocks[:, 2:]).view(np.int8).astype(np.float32)
    return codes * scale


_DECODERS = {
    GGMLQuantizationType.Q4_0: _q4_0,
    GGMLQuantizationType.Q4_1: _q4_1,
    GGMLQuantizationType.Q8_0: _q8_0,
}
