"""Grouped GEMM for mixture-of-experts layers: one launch multiplies every expert's slice of
rows by that expert's weight matrix.

The rows arrive sorted by expert (`shared/model/moe.py` sorts the token-expert assignments), so
expert e owns rows `expert_offsets[e]:expert_offsets[e + 1]`. Each program computes one
BLOCK_M x BLOCK_N tile of one expert's slice; a tile schedule built on the device (no
device-to-host sync for the counts) tells each program which expert and which first row it
has. The grid is sized for the worst case, `cdiv(M, BLOCK_M) + num_experts` tiles, and
programs past the last real tile return at once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from splitserve.kernels import _checks as checks
from splitserve.kernels._paged_tile import dot, dot_meta

_BLOCK_M = 16  # tl.dot needs 16 at least; decode slices are a few rows per expert
_BLOCK_N = 64
_BLOCK_K = 32


@triton.jit
def _grouped_gemm_kernel(
    x_ptr,
    w_ptr,
    out_ptr,
    scale_ptr,
    offsets_ptr,
    tile_expert_ptr,
    tile_row_ptr,
    N,
    K,
    num_experts,
    stride_xm,
    stride_we,
    stride_wn,
    stride_om,
    HAS_SCALE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    tile = tl.program_id(0)
    expert = tl.load(tile_expert_ptr + tile)
    if expert >= num_experts:  # past the last real tile
        return
    first_row = tl.load(tile_row_ptr + tile)
    end_row = tl.load(offsets_ptr + expert + 1)
    rows = first_row + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask = rows < end_row
    col_mask = cols < N
    w_base = w_ptr + expert.to(tl.int64) * stride_we
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_mask = ks < K
        a = tl.load(
            x_ptr + rows[:, None] * stride_xm + ks[None, :],
            mask=row_mask[:, None] & k_mask[None, :],
            other=0.0,
        )  # [BLOCK_M, BLOCK_K]
        b = tl.load(
            w_base + cols[None, :] * stride_wn + ks[:, None],
            mask=k_mask[:, None] & col_mask[None, :],
            other=0.0,
        )  # [BLOCK_K, BLOCK_N]: the expert's [N, K] matrix read transposed
        acc += dot(a, b, DOT_PRECISION, UPCAST_DOT)  # float32 stays ieee, not tf32
    if HAS_SCALE:
        acc *= tl.load(scale_ptr + rows, mask=row_mask, other=0.0).to(tl.float32)[:, None]
    out = out_ptr + rows[:, None] * stride_om + cols[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=row_mask[:, None] & col_mask[None, :])


def tile_schedule(expert_offsets: torch.Tensor, num_rows: int, block_m: int = _BLOCK_M):
    """(tile_expert, tile_first_row), each [cdiv(num_rows, block_m) + num_experts] int32:
    which expert each row tile belongs to (num_experts past the last tile) and its first row.
    Computed with tensor ops on the offsets' device, so no count is read back to the host."""
    num_experts = expert_offsets.shape[0] - 1
    counts = (expert_offsets[1:] - expert_offsets[:-1]).to(torch.int64)
    tiles_per_expert = (counts + block_m - 1) // block_m
    tile_end = torch.cumsum(tiles_per_expert, 0)
    max_tiles = triton.cdiv(num_rows, block_m) + num_experts
    tiles = torch.arange(max_tiles, device=expert_offsets.device)
    tile_expert = torch.searchsorted(tile_end, tiles, right=True)
    owner = tile_expert.clamp(max=num_experts - 1)
    tile_in_expert = tiles - (tile_end - tiles_per_expert)[owner]
    first_row = expert_offsets[:-1].to(torch.int64)[owner] + tile_in_expert * block_m
    return tile_expert.to(torch.int32), first_row.to(torch.int32)


def grouped_gemm(
    x: torch.Tensor,
    weights: torch.Tensor,
    expert_offsets: torch.Tensor,
    row_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """out[r] = x[r] @ weights[e].T (times row_scale[r] when given) for each row r in expert e's
    slice `expert_offsets[e]:expert_offsets[e + 1]`; returns [M, N] in x's dtype.

    x: [M, K], rows sorted by expert, last dim contiguous; weights: [E, N, K] contiguous, x's
    dtype; expert_offsets: [E + 1] int32/int64, non-decreasing from 0 to M (not checked: that
    would read it back from the device); row_scale: [M], any float dtype. Mutates nothing.
    """
    _check_args(x, weights, expert_offsets, row_scale)
    num_rows, num_cols = x.shape[0], weights.shape[1]
    out = torch.empty(num_rows, num_cols, dtype=x.dtype, device=x.device)
    if num_rows == 0:
        return out
    tile_expert, tile_row = tile_schedule(expert_offsets, num_rows)
    grid = (tile_expert.shape[0], triton.cdiv(num_cols, _BLOCK_N))
    _grouped_gemm_kernel[grid](
        x, weights, out, x if row_scale is None else row_scale, expert_offsets,
        tile_expert, tile_row, num_cols, x.shape[1], weights.shape[0], x.stride(0),
        weights.stride(0), weights.stride(1), out.stride(0), HAS_SCALE=row_scale is not None,
        BLOCK_M=_BLOCK_M, BLOCK_N=_BLOCK_N, BLOCK_K=_BLOCK_K, **dot_meta(x.dtype),
    )  # fmt: skip
    return out


def _check_args(x: object, weights: object, expert_offsets: object, row_scale: object) -> None:
    x = checks.check_tensor("x", x, 2, checks.FLOAT_DTYPES)
    checks.check_last_dim_contiguous("x", x)
    weights = checks.check_tensor("weights", weights, 3, checks.FLOAT_DTYPES)
    checks.check_same_dtype("weights", weights, "x", x)
    checks.check_contiguous("weights", weights)
    if weights.shape[2] != x.shape[1]:
        raise ValueError(
            f"weights must be [num_experts, N, {x.shape[1]}] for x {tuple(x.shape)}, got "
            f"{tuple(weights.shape)}"
        )
    expert_offsets = checks.check_tensor("expert_offsets", expert_offsets, 1, checks.INDEX_DTYPES)
    checks.check_shape("expert_offsets", expert_offsets, (weights.shape[0] + 1,))
    checks.check_contiguous("expert_offsets", expert_offsets)
    tensors = dict(x=x, weights=weights, expert_offsets=expert_offsets)
    if row_scale is not None:
        row_scale = checks.check_tensor("row_scale", row_scale, 1, checks.FLOAT_DTYPES)
        checks.check_shape("row_scale", row_scale, (x.shape[0],))
        checks.check_contiguous("row_scale", row_scale)
        tensors["row_scale"] = row_scale
    checks.check_same_device(tensors)
