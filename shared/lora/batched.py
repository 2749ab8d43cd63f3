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
form and the Triton kernel (kernels/lora_sgmv.py) are tested against.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class LoRABatch:
    """One forward's row -> slot map, read by every LoRA projection of the model."""

    slot_ids: torch.Tensor  # [rows] int64, -1 for a row of the base model
    mask: torch.Tensor  # [rows, k, 1, 1] in the model's dtype: 1 at the row's slot
    num_slots: int  # k: the highest slot any row uses, plus one


def make_batch(row_slots: Sequence[int], dtype: torch.dtype, device: torch.device) -> LoRABatch:
    """The batch for rows whose slots are `row_slots` (-1: base). Callers skip the LoRA work
    entirely when every row is -1."""
    slot_ids = torch.tensor(row_slots, dtype=torch.int64, device=device)
    num_slots = max(row_slots) + 1
    assert num_slots > 0, "a batch needs at least one row with an adapter"
    columns = torch.arange(num_slots, device=device)
    mask = (slot_ids[:, None] == columns[None, :]).to(dtype)
    return LoRABatch(slot_ids, mask[:, :, None, None], num_slots)


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
