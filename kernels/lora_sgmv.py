"""Segmented gather matrix-vector products for multi-LoRA (SGMV, as punica names them).

A step's rows come in segments that share an adapter slot (segment = maximal run of equal
slots). Each product reads its segment's slot and gathers that slot's weights, so one launch
serves every adapter in the batch:

    shrink  xa[rows, slices, rank]  = x[rows, in] @ A[slot, s]^T           (per segment)
    expand  out[:, offset_s + n]   += xa[rows, s] @ B_s[slot][:, n]         (per segment)

A program takes BLOCK_M rows of one segment; programs past a segment's end, and segments of the
base model (slot -1), return at once. The products accumulate in float32. The reference is the
engine's `lora_delta_segmented` (shared/lora/batched.py), which the tests compare against.
Layouts are the engine's LoRA slots (shared/lora/layers.py): A [max_loras, slices, rank, in],
B_s [max_loras, rank, out_s].
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from splitserve.kernels import _checks as checks


class Segments(NamedTuple):
    """The rows' runs of equal slots: rows starts[i]:starts[i + 1] use slots[i]."""

    starts: torch.Tensor  # [num_segments + 1] int32
    slots: torch.Tensor  # [num_segments] int32, -1 = the base model (no delta)
    max_length: int  # the longest segment's row count (sizes the grid)


def make_segments(row_slots: Sequence[int], device: torch.device) -> Segments:
    """Segments of `row_slots` (one per row, -1 = base), built on the host once per step."""
    starts: list[int] = []
    slots: list[int] = []
    for row, slot in enumerate(row_slots):
        if not slots or slots[-1] != slot:
            starts.append(row)
            slots.append(slot)
    starts.append(len(row_slots))
    lengths = [end - start for start, end in zip(starts, starts[1:])]
    return Segments(
        torch.tensor(starts, dtype=torch.int32, device=device),
        torch.tensor(slots, dtype=torch.int32, device=device),
        max(lengths, default=0),
    )


@triton.jit
def _segment_rows(starts_ptr, slots_ptr, BLOCK_M: tl.constexpr):
    """(slot, first row, end row) of this program's BLOCK_M rows: program (segment, row block,
    ...). Nothing to do where the slot is -1 (no adapter) or the block is past the segment."""
    segment = tl.program_id(0)
    slot = tl.load(slots_ptr + segment)
    start = tl.load(starts_ptr + segment) + tl.program_id(1) * BLOCK_M
    return slot, start, tl.load(starts_ptr + segment + 1)


@triton.jit
def _shrink_kernel(
    x_ptr, a_ptr, xa_ptr, starts_ptr, slots_ptr,
    stride_x, stride_a_slot, stride_a_slice, stride_a_rank, stride_xa_row, stride_xa_slice,
    in_features, rank,
    BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    s = tl.program_id(2)
    slot, start, end = _segment_rows(starts_ptr, slots_ptr, BLOCK_M)
    if slot >= 0 and start < end:
        rows = start + tl.arange(0, BLOCK_M)
        ranks = tl.arange(0, BLOCK_R)
        row_mask, rank_mask = rows < end, ranks < rank
        a_base = a_ptr + slot.to(tl.int64) * stride_a_slot + s * stride_a_slice
        acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
        for k0 in range(0, in_features, BLOCK_K):
            cols = k0 + tl.arange(0, BLOCK_K)
            col_mask = cols < in_features
            x = tl.load(
                x_ptr + rows[:, None] * stride_x + cols[None, :],
                mask=row_mask[:, None] & col_mask[None, :],
                other=0.0,
            ).to(tl.float32)  # [BLOCK_M, BLOCK_K]
            a = tl.load(
                a_base + ranks[:, None] * stride_a_rank + cols[None, :],
                mask=rank_mask[:, None] & col_mask[None, :],
                other=0.0,
            ).to(tl.float32)  # [BLOCK_R, BLOCK_K]
            acc += tl.sum(x[:, None, :] * a[None, :, :], axis=2)
        out = xa_ptr + rows[:, None] * stride_xa_row + s * stride_xa_slice + ranks[None, :]
        tl.store(out, acc, mask=row_mask[:, None] & rank_mask[None, :])


@triton.jit
def _expand_kernel(
    xa_ptr, b_ptr, out_ptr, starts_ptr, slots_ptr,
    stride_xa_row, stride_b_slot, stride_b_rank, stride_out,
    out_features, rank,
    BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    n_block = tl.program_id(2)
    slot, start, end = _segment_rows(starts_ptr, slots_ptr, BLOCK_M)
    if slot >= 0 and start < end:
        rows = start + tl.arange(0, BLOCK_M)
        ranks = tl.arange(0, BLOCK_R)
        cols = n_block * BLOCK_N + tl.arange(0, BLOCK_N)
        row_mask, rank_mask, col_mask = rows < end, ranks < rank, cols < out_features
        xa = tl.load(
            xa_ptr + rows[:, None] * stride_xa_row + ranks[None, :],
            mask=row_mask[:, None] & rank_mask[None, :],
            other=0.0,
        )  # [BLOCK_M, BLOCK_R] float32
        b = tl.load(
            b_ptr + slot.to(tl.int64) * stride_b_slot + ranks[:, None] * stride_b_rank
            + cols[None, :],
            mask=rank_mask[:, None] & col_mask[None, :],
            other=0.0,
        ).to(tl.float32)  # [BLOCK_R, BLOCK_N]
        delta = tl.sum(xa[:, :, None] * b[None, :, :], axis=1)  # [BLOCK_M, BLOCK_N]
        out_ptrs = out_ptr + rows[:, None] * stride_out + cols[None, :]
        out_mask = row_mask[:, None] & col_mask[None, :]
        current = tl.load(out_ptrs, mask=out_mask, other=0.0).to(tl.float32)
        tl.store(out_ptrs, (current + delta).to(out_ptr.dtype.element_ty), mask=out_mask)


_BLOCK_M = 16
_BLOCK_K = 64
_BLOCK_N = 64


def lora_shrink(x: torch.Tensor, a: torch.Tensor, segments: Segments) -> torch.Tensor:
    """[rows, slices, rank] float32: each row times its segment's slot's A of every slice
    (zeros for base rows). x [rows, in]; a [max_loras, slices, rank, in], in-dim contiguous."""
    checks.check_tensor("x", x, 2, checks.FLOAT_DTYPES)
    checks.check_tensor("a", a, 4, checks.FLOAT_DTYPES)
    checks.check_last_dim_contiguous("x", x)
    checks.check_last_dim_contiguous("a", a)
    if a.shape[3] != x.shape[1]:
        raise ValueError(f"a's in features {a.shape[3]} are not x's {x.shape[1]}")
    _check_segments(segments, x.shape[0])
    rows, num_slices, rank = x.shape[0], a.shape[1], a.shape[2]
    xa = torch.zeros(rows, num_slices, rank, dtype=torch.float32, device=x.device)
    grid = (segments.slots.shape[0], triton.cdiv(max(segments.max_length, 1), _BLOCK_M), num_slices)
    _shrink_kernel[grid](
        x, a, xa, segments.starts, segments.slots,
        x.stride(0), a.stride(0), a.stride(1), a.stride(2), xa.stride(0), xa.stride(1),
        x.shape[1], rank,
        BLOCK_M=_BLOCK_M, BLOCK_R=triton.next_power_of_2(rank), BLOCK_K=_BLOCK_K,
    )  # fmt: skip
    return xa


def lora_expand(
    out: torch.Tensor, xa: torch.Tensor, b: torch.Tensor, segments: Segments
) -> None:
    """out[row] += xa[row] @ b[slot of the row's segment], in place (base rows untouched).
    out [rows, out_s] (a column slice of a wider output is fine); xa [rows, rank] float32;
    b [max_loras, rank, out_s], out-dim contiguous."""
    checks.check_tensor("out", out, 2, checks.FLOAT_DTYPES)
    checks.check_tensor("xa", xa, 2, (torch.float32,))
    checks.check_tensor("b", b, 3, checks.FLOAT_DTYPES)
    for name, tensor in (("out", out), ("xa", xa), ("b", b)):
        checks.check_last_dim_contiguous(name, tensor)
    if b.shape[1] != xa.shape[1] or b.shape[2] != out.shape[1] or xa.shape[0] != out.shape[0]:
        raise ValueError(
            f"shapes do not chain: out {tuple(out.shape)}, xa {tuple(xa.shape)}, b {tuple(b.shape)}"
        )
    _check_segments(segments, out.shape[0])
    rank, width = b.shape[1], b.shape[2]
    grid = (
        segments.slots.shape[0],
        triton.cdiv(max(segments.max_length, 1), _BLOCK_M),
        triton.cdiv(width, _BLOCK_N),
    )
    _expand_kernel[grid](
        xa, b, out, segments.starts, segments.slots,
        xa.stride(0), b.stride(0), b.stride(1), out.stride(0),
        width, rank,
        BLOCK_M=_BLOCK_M, BLOCK_R=triton.next_power_of_2(rank), BLOCK_N=_BLOCK_N,
    )  # fmt: skip


def add_lora_sgmv(
    out: torch.Tensor,  # [rows, out_total], changed in place
    x: torch.Tensor,  # [rows, in]
    a: torch.Tensor,  # [max_loras, slices, rank, in]
    b: Sequence[torch.Tensor],  # per slice: [max_loras, rank, out_s]
    offsets: Sequence[int],  # per slice: its first column in `out`
    segments: Segments,
) -> None:
    """out[:, slice s] += x @ A[slot, s]^T @ B_s[slot] for each row's slot: one shrink launch
    for every slice, one expand launch per slice."""
    if len(b) != a.shape[1] or len(offsets) != len(b):
        raise ValueError(f"a has {a.shape[1]} slices; got {len(b)} b and {len(offsets)} offsets")
    xa = lora_shrink(x, a, segments)
    for s, (b_s, offset) in enumerate(zip(b, offsets)):
        lora_expand(out[:, offset : offset + b_s.shape[2]], xa[:, s], b_s, segments)


def _check_segments(segments: Segments, rows: int) -> None:
    checks.check_tensor("segments.starts", segments.starts, 1, (torch.int32,))
    checks.check_tensor("segments.slots", segments.slots, 1, (torch.int32,))
    if segments.starts.shape[0] != segments.slots.shape[0] + 1:
        raise ValueError("segments.starts must have one entry more than segments.slots")
    if segments.slots.shape[0] > rows:
        raise ValueError(f"{segments.slots.shape[0]} segments for {rows} rows")
