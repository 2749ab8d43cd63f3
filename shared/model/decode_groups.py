"""Groups the decoding sequences of a step by context length, for the CPU attention path.

The PyTorch path copies each decoding sequence's blocks into one buffer and runs one SDPA over
it, padded to the longest context. With contexts spread from tens to hundreds of tokens (a
server's usual mix) half of that copy and of SDPA's reads is padding, and on the CPU decode
attention is memory-bound. Sorting by length and cutting the sorted list where padding would
grow past a bound keeps both close to the bytes the sequences really hold, for a few more
(cheap) calls per layer.

    sorted by length:  | short ... | medium ...... | long ............. |
    groups:            `- group 0   `- group 1       `- group 2
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# A group may hold at most this many padding blocks per block of real keys...
MAX_PADDING_FRACTION = 0.25
# ...unless the whole padded group is this small: copying a few blocks costs less than the
# extra calls another group would take.
SMALL_GROUP_BLOCKS = 64
# A group's gathered keys and values are read back by SDPA right after the copy; while they
# still sit in the CPU's caches that read is cheap, so groups are also kept about this small.
GROUP_BYTES = 4 * 2**20


@dataclass
class DecodeGroup:
    """Decoding sequences attended in one padded SDPA call."""

    # [num_rows] int64: which decode rows of the batch; None means every decode row, in order
    # (one group: the rows need no gather or scatter).
    rows: torch.Tensor | None
    # [num_rows * max_blocks] int64: the group's block table padded with block 0 (valid
    # memory, masked out) and flattened; row i's keys are blocks [i * max_blocks, (i + 1) *
    # max_blocks) of the gathered tensor.
    block_ids: torch.Tensor
    # [num_rows, 1, 1, max_blocks * block_size] bool, False past a row's length; None when no
    # row is padded.
    mask: torch.Tensor | None


def group_decodes(
    seq_lens: list[int],
    block_tables: list[list[int]],
    block_size: int,
    block_bytes: int,
    device: torch.device,
) -> list[DecodeGroup]:
    """One group per run of similar lengths. `seq_lens[i]` keys of decode row i live in the
    first blocks of `block_tables[i]` (which may hold more, e.g. reserved for drafts);
    `block_bytes` is what one block of one layer holds, keys and values."""
    if not seq_lens:
        return []
    max_group_blocks = max(1, GROUP_BYTES // block_bytes)
    row_groups = _rows_by_length(seq_lens, block_size, max_group_blocks)
    if len(row_groups) == 1:
        return [whole_batch_group(seq_lens, block_tables, block_size, device)]
    return [
        _padded_group(
            rows, torch.tensor(rows, device=device), seq_lens, block_tables, block_size, device
        )
        for rows in row_groups
    ]


def whole_batch_group(
    seq_lens: list[int], block_tables: list[list[int]], block_size: int, device: torch.device
) -> DecodeGroup:
    """Every decode row in one group, in batch order, padded to the longest (`rows` None)."""
    rows = list(range(len(seq_lens)))
    return _padded_group(rows, None, seq_lens, block_tables, block_size, device)


def _rows_by_length(seq_lens: list[int], block_size: int, max_group_blocks: int) -> list[list[int]]:
    """Rows sorted by length, cut where adding the next (longest so far) row would pad more
    than the bounds allow or make the group bigger than `max_group_blocks` in all."""
    groups: list[list[int]] = []
    current: list[int] = []
    current_blocks = 0  # blocks of real keys in `current`
    for row in sorted(range(len(seq_lens)), key=seq_lens.__getitem__):
        blocks = -(-seq_lens[row] // block_size)
        padded = (len(current) + 1) * blocks  # this row is the group's longest
        needed = current_blocks + blocks
        little_padding = padded <= (1 + MAX_PADDING_FRACTION) * needed
        fits = padded <= max_group_blocks and (little_padding or padded <= SMALL_GROUP_BLOCKS)
        if current and not fits:
            groups.append(current)
            current, current_blocks = [], 0
        current.append(row)
        current_blocks += blocks
    groups.append(current)
    return groups


def _padded_group(
    rows: list[int],
    row_index: torch.Tensor | None,
    seq_lens: list[int],
    block_tables: list[list[int]],
    block_size: int,
    device: torch.device,
) -> DecodeGroup:
    """The group of decode `rows` (`row_index`: the same rows on the device, or None for all
    rows in order): their block table padded to the longest and its mask."""
    lens = torch.tensor([seq_lens[row] for row in rows])
    max_blocks = -(-int(lens.max()) // block_size)
    table = torch.zeros(len(rows), max_blocks, dtype=torch.int64)
    for i, row in enumerate(rows):
        ids = block_tables[row][: -(-seq_lens[row] // block_size)]
        table[i, : len(ids)] = torch.tensor(ids)
    max_len = max_blocks * block_size
    mask = None
    if int(lens.min()) != max_len:
        mask = (torch.arange(max_len).unsqueeze(0) < lens.unsqueeze(1)).view(len(rows), 1, 1, -1)
        mask = mask.to(device)
    return DecodeGroup(row_index, table.view(-1).to(device), mask)
