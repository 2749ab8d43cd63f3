"""The int8 KV cache format (`kv_cache_dtype="int8"`) in plain PyTorch: the specification the
Triton KV write and attention kernels are tested against, and what the CPU path runs.

Each (token, KV head) row of keys or values is stored as `head_dim` int8 codes followed by its
scale, a bfloat16 in the row's last two bytes, so one row of an int8 cache is `head_dim + 2`
int8 elements:

    | code 0 | code 1 | ... | code head_dim-1 | scale (bfloat16, 2 bytes) |

Symmetric quantization: `scale = absmax(row) / 127` (rounded to bfloat16 first), `code =
round(x / scale)` clamped to [-127, 127], `x ~= code * scale`. A row of zeros has scale 0.

Why the scale lives inside the row: a block of the cache stays one run of bytes of one tensor,
so everything that moves blocks (the P/D page buffers, tensor-parallel head splits, the offload
tiers' host and disk stores) moves codes and scales together without knowing about either.
Why bfloat16 and not float32: with head_dim 64 a float32 scale would make a row 68 bytes, 1.88x
smaller than a bfloat16 model's 128, short of the 1.9x the budget aims at; a bfloat16 scale
(66 bytes) gives 1.94x there and 3.88x against float32. Its 8-bit mantissa scales the whole row
by at most 2^-9, below the codes' own step (1/254 of the row's largest value).
"""

from __future__ import annotations

import torch

from splitserve.kernels._checks import INT8_SCALE_BYTES

SCALE_DTYPE = torch.bfloat16
SCALE_BYTES = INT8_SCALE_BYTES
QMAX = 127.0


def is_int8_cache(cache: torch.Tensor) -> bool:
    return cache.dtype == torch.int8


def row_width(head_dim: int) -> int:
    """int8 elements one (token, head) row takes: codes plus the scale's bytes."""
    return head_dim + SCALE_BYTES


def head_dim_of(cache: torch.Tensor) -> int:
    """The model's head_dim of a cache whose last dim is `row_width(head_dim)`."""
    return cache.shape[-1] - SCALE_BYTES


def split_rows(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Views of an int8 cache (or any tensor of rows): codes `[..., head_dim]` int8 and scales
    `[..., 1]` bfloat16. Writes through either view change `rows`."""
    assert is_int8_cache(rows), f"int8 rows expected, got {rows.dtype}"
    head_dim = head_dim_of(rows)
    assert head_dim % 2 == 0, "the scale view needs an even head_dim"
    return rows[..., :head_dim], rows[..., head_dim:].view(SCALE_DTYPE)


def quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x `[..., head_dim]` (any float dtype) -> codes `[..., head_dim]` int8, scales `[..., 1]`
    bfloat16. Rounds half away from zero (the Triton write kernel rounds the same way).

    Few, whole-tensor ops on purpose: the engine quantizes every layer's new keys and values
    at every step, where a decode step's tensors are tiny and each op's fixed cost dominates."""
    x = x.float()
    scale = x.abs().amax(dim=-1, keepdim=True).div_(QMAX).to(SCALE_DTYPE)
    scale_f = scale.float()
    inverse = torch.where(scale_f > 0, scale_f.reciprocal(), 0.0)  # a zero row stays zero
    scaled = x * inverse
    # Adding +-0.5, then the cast's truncation toward zero: round half away from zero.
    codes = scaled.add_(torch.copysign(torch.tensor(0.5), scaled)).clamp_(-QMAX, QMAX)
    return codes.to(torch.int8), scale


def quantize_rows(x: torch.Tensor) -> torch.Tensor:
    """x `[..., head_dim]` -> int8 rows `[..., head_dim + 2]` (codes then scale bytes)."""
    codes, scale = quantize(x)
    return torch.cat((codes, scale.view(torch.int8)), dim=-1)


def dequantize_rows(rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """int8 rows `[..., head_dim + 2]` -> `[..., head_dim]` of `dtype` (a new tensor)."""
    codes, scale = split_rows(rows)
    return (codes.float() * scale.float()).to(dtype)
