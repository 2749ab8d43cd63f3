"""The batched LoRA product: each row of a step's activations gets its own adapter's delta.

A step's rows belong to requests with different adapters (or none). Punica's SGMV runs one
small product per run of rows that share an adapter; on the CPU a product costs mostly its
fixed overhead at decode sizes, so a loop over runs (up to one per row) is what would cost.
Here every row is multiplied by every active slot's A at once (one product: the A weights are
read once, as they must be anyway), a mask keeps each row's own slot, and one product per
output slice applies the B of all slots:

    xa    = x @ A[:k]^T                 # [rows, k, slices, rank]   k = highest slot used + 1
    xa   *= mask                        # 1 where the slot is the row's, else 0
    out_s += xa[:, :, s] @ B_s[:k]      # [rows, k * rank] @ [k * rank, out_s]

The wasted work is rows x (k - 1) x rank multiply-adds per input feature, small beside the
base product when rank << out; in exchange a step costs the same few calls whatever the mix.
The segmented form (one product per run) is `lora_delta_segmented`, the reference the batched
form and the Triton kernel (kernels/lora_sgmv.py) are tested against. On CUDA a launch per
segment is what the GPU is good at, so there the SGMV kernels take the products
(`add_lora_delta_sgmv`); the fused C++ decode adds the deltas inside its layer loop, row by
row from each row's own adapter (kernels/cpu/decode_layers.cpp says why there).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from splitserve import kernels


@dataclass(frozen=True)
class LoRABatch:
    """One forward's row -> slot map, read by every LoRA projection of the model."""

    slot_ids: torch.Tensor  # [rows] int64, -1 for a row of the base model
    mask: torch.Tensor  # [rows, k, 1, 1] in the model's dtype: 1 at the row's slot
    num_slots: int  # k: the highest slot any row uses, plus one
    # On CUDA with Triton: the rows' runs of equal slots (kernels/lora_sgmv.py's Segments),
    # which the SGMV kernels take instead of the mask; None on the CPU.
    segments: Any = None


def make_batch(row_slots: Sequence[int], dtype: torch.dtype, device: torch.device) -> LoRABatch:
    """The batch for rows whose slots are `row_slots` (-1: base). Callers skip the LoRA work
    entirely when every row is -1."""
    slot_ids = torch.tensor(row_slots, dtype=torch.int64, device=device)
    num_slots = max(row_slots) + 1
    assert num_slots > 0, "a batch needs at least one row with an adapter"
    columns = torch.arange(num_slots, device=device)
    mask = (slot_ids[:, None] == columns[None, :]).to(dtype)
    segments = _segments(row_slots, device) if uses_sgmv(device) else None
    return LoRABatch(slot_ids, mask[:, :, None, None], num_slots, segments)


def uses_sgmv(device: torch.device) -> bool:
    """Whether LoRA products on `device` take the Triton SGMV kernels: on CUDA, where one
    launch per product beats the masked every-slot product; the CPU keeps PyTorch/C++."""
    return device.type == "cuda" and kernels.has_triton()


def _segments(row_slots: Sequence[int], device: torch.device) -> Any:
    from splitserve.kernels.lora_sgmv import make_segments  # lazy: imports Triton

    return make_segments(row_slots, device)


def add_lora_delta_sgmv(
    out: torch.Tensor,
    x: torch.Tensor,
    a: torch.Tensor,
    b: Sequence[torch.Tensor],
    offsets: Sequence[int],
    batch: LoRABatch,
) -> None:
    """add_lora_delta on the Triton SGMV kernels (batch.segments set: make_batch on CUDA)."""
    from splitserve.kernels.lora_sgmv import add_lora_sgmv  # lazy: imports Triton

    assert batch.segments is not None, "make_batch builds segments where uses_sgmv"
    add_lora_sgmv(out, x, a, b, offsets, batch.segments)


def add_lora_delta(
    out: torch.Tensor,  # [rows, out_total], changed in place
    x: torch.Tensor,  # [rows, in]
    a: torch.Tensor,  # [max_loras, slices, rank, in]
    b: Sequence[torch.Tensor],  # per slice: [max_loras, rank, out_s]
    offsets: Sequence[int],  # per slice: its first column in `out`
    batch: LoRABatch,
) -> None:
    """out[:, slice s] += x @ A[slot, s]^T @ B[slot, s] for each row's slot (none: nothing)."""
    k = batch.num_slots
    rows, num_slices, rank = x.shape[0], a.shape[1], a.shape[2]
    xa = (x @ a[:k].reshape(k * num_slices * rank, -1).T).view(rows, k, num_slices, rank)
    xa.mul_(batch.mask)
    for s, (b_s, offset) in enumerate(zip(b, offsets)):
        width = b_s.shape[2]
        delta = xa[:, :, s].reshape(rows, k * rank) @ b_s[:k].reshape(k * rank, width)
        out[:, offset : offset + width] += delta


def lora_delta_segmented(
    x: torch.Tensor,  # [rows, in]
    a: torch.Tensor,  # [max_loras, rank, in] (one slice)
    b: torch.Tensor,  # [max_loras, rank, out]
    slot_ids: torch.Tensor,  # [rows], -1 = none
) -> torch.Tensor:
    """The reference: [rows, out] deltas, one product pair per run of rows sharing a slot."""
    out = torch.zeros(x.shape[0], b.shape[2], dtype=x.dtype, device=x.device)
    for start, end, slot in slot_runs(slot_ids.tolist()):
        if slot >= 0:
            out[start:end] = (x[start:end] @ a[slot].T) @ b[slot]
    return out


def slot_runs(slot_ids: Sequence[int]) -> list[tuple[int, int, int]]:
    """(start, end, slot) of each maximal run of equal slots, in row order."""
    runs: list[tuple[int, int, int]] = []
    for row, slot in enumerate(slot_ids):
        if runs and runs[-1][2] == slot:
            runs[-1] = (runs[-1][0], row + 1, slot)
        else:
            runs.append((row, row + 1, slot))
    return runs
