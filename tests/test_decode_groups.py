"""Decode rows grouped by context length: the groups' shape, and attention through them."""

from __future__ import annotations

import random

import pytest
import torch

from splitserve.engine.model.attention import TorchPagedAttention
from splitserve.engine.model.attention_metadata import AttentionMetadata
from splitserve.engine.model.decode_groups import (
    GROUP_BYTES,
    MAX_PADDING_FRACTION,
    SMALL_GROUP_BLOCKS,
    group_decodes,
)
from splitserve.kernels import reference

BLOCK_SIZE = 16
CPU = torch.device("cpu")
# SmolLM2-135M: one layer's keys and values of a block, float32 (3 kv heads x 64).
BLOCK_BYTES = 2 * BLOCK_SIZE * 3 * 64 * 4


def _spread_lengths(num_rows: int, seed: int, longest: int = 900) -> list[int]:
    rng = random.Random(seed)
    return [rng.randint(1, longest) for _ in range(num_rows)]


def _block_tables(seq_lens: list[int], num_blocks: int, seed: int) -> list[list[int]]:
    """Each row gets its blocks from a shuffled pool, plus one spare block past its length
    (the engine hands out block lists that can run ahead of the keys)."""
    pool = list(range(num_blocks))
    random.Random(seed).shuffle(pool)
    tables = []
    for seq_len in seq_lens:
        count = -(-seq_len // BLOCK_SIZE) + 1
        tables.append(pool[:count])
        pool = pool[count:]
    return tables


def _covered_rows(groups) -> list[int]:
    return sorted(row for group in groups for row in group.rows.tolist())


def test_one_group_covers_rows_in_order_without_an_index():
    seq_lens = [40, 41, 45, 48]  # all three blocks long: no padding blocks at all
    (group,) = group_decodes(seq_lens, _block_tables(seq_lens, 64, 0), BLOCK_SIZE, BLOCK_BYTES, CPU)
    assert group.rows is None
    assert group.block_ids.numel() == 4 * 3
    assert group.mask is not None and group.mask.sum().item() == sum(seq_lens)


def test_equal_lengths_need_no_mask():
    seq_lens = [64, 64, 64]
    (group,) = group_decodes(seq_lens, _block_tables(seq_lens, 64, 1), BLOCK_SIZE, BLOCK_BYTES, CPU)
    assert group.mask is None


def test_spread_lengths_split_into_groups_that_bound_padding():
    seq_lens = _spread_lengths(64, seed=2)
    groups = group_decodes(seq_lens, _block_tables(seq_lens, 4000, 2), BLOCK_SIZE, BLOCK_BYTES, CPU)
    assert len(groups) > 1
    assert _covered_rows(groups) == list(range(64))
    for group in groups:
        blocks = [-(-seq_lens[row] // BLOCK_SIZE) for row in group.rows.tolist()]
        padded = group.block_ids.numel()
        assert padded == len(blocks) * max(blocks)
        # The bounds held when the group's longest row joined it, so they hold at the end.
        assert padded <= (1 + MAX_PADDING_FRACTION) * sum(blocks) or padded <= SMALL_GROUP_BLOCKS
        assert padded * BLOCK_BYTES <= GROUP_BYTES or len(blocks) == 1
    padded_once = 64 * max(-(-n // BLOCK_SIZE) for n in seq_lens)
    grouped = sum(group.block_ids.numel() for group in groups)
    assert grouped < 0.7 * padded_once  # what grouping is for: far fewer blocks copied


def test_groups_of_big_blocks_stay_under_the_byte_bound():
    """A model with big blocks (8 kv heads x 128, float32: 128 KiB a block) gets small groups
    even at equal lengths, and a row bigger than the bound alone gets a group of its own."""
    block_bytes = 2 * BLOCK_SIZE * 8 * 128 * 4
    seq_lens = [300] * 10 + [GROUP_BYTES // block_bytes * BLOCK_SIZE * 3]
    groups = group_decodes(seq_lens, _block_tables(seq_lens, 9000, 7), BLOCK_SIZE, block_bytes, CPU)
    assert _covered_rows(groups) == list(range(11))
    sizes = sorted(group.block_ids.numel() * block_bytes for group in groups)
    assert all(size <= GROUP_BYTES for size in sizes[:-1])
    assert sizes[-1] > GROUP_BYTES and groups[-1].rows.tolist() == [10]  # the long row, alone


def test_group_block_ids_are_each_rows_own_blocks():
    seq_lens = _spread_lengths(20, seed=3)
    tables = _block_tables(seq_lens, 2000, 3)
    for group in group_decodes(seq_lens, tables, BLOCK_SIZE, BLOCK_BYTES, CPU):
        rows = group.rows.tolist()
        width = group.block_ids.numel() // len(rows)
        for i, row in enumerate(rows):
            used = -(-seq_lens[row] // BLOCK_SIZE)
            got = group.block_ids[i * width : i * width + used].tolist()
            assert got == tables[row][:used]  # the spare block is never read
            assert group.mask[i].sum().item() == seq_lens[row]


@pytest.mark.parametrize("num_rows, seed", [(1, 4), (7, 5), (48, 6)])
def test_grouped_decode_attention_equals_the_reference(num_rows: int, seed: int):
    """TorchPagedAttention over the groups gives every row its own attention, whichever
    group it landed in, against the one-sequence-at-a-time reference."""
    torch.manual_seed(seed)
    num_heads, num_kv_heads, head_dim, num_blocks = 9, 3, 64, 3000
    seq_lens = _spread_lengths(num_rows, seed, longest=700)
    tables = _block_tables(seq_lens, num_blocks, seed)
    cache = torch.randn(2, num_blocks, BLOCK_SIZE, num_kv_heads, head_dim)
    query = torch.randn(num_rows, num_heads, head_dim)
    meta = AttentionMetadata(
        slot_mapping=torch.empty(0, dtype=torch.int64),
        num_decodes=num_rows,
        decode_groups=group_decodes(seq_lens, tables, BLOCK_SIZE, BLOCK_BYTES, CPU),
        prefills=[],
    )
    out = TorchPagedAttention().attend(query, cache, meta, head_dim**-0.5)
    width = max(len(table) for table in tables)
    padded_tables = torch.tensor([table + [0] * (width - len(table)) for table in tables])
    expected = reference.paged_decode_attention(
        query, cache[0], cache[1], padded_tables, torch.tensor(seq_lens), head_dim**-0.5
    )
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
