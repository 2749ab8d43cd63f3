"""A step's forward inputs as one int64 tensor, to broadcast from rank 0 to the other ranks.

What `ModelRunner.prepare_inputs` reads from each scheduled chunk travels, not the prepared
metadata: every rank builds the same `ModelInputs` from it (attention metadata, decode groups,
block tables) with the same code, so a step is one header and this payload whatever the
backend (`splitserve.engine.parallel.ops`).

    payload | chunk table [num_chunks, 4] | token ids [num_tokens] | block ids [num_block_ids] |
            chunk table row: start_position, num_tokens, num_logits, len(block_ids)
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple, Protocol

import torch

_CHUNK_FIELDS = 4


class ChunkInputs(Protocol):
    """The part of a `ScheduledChunk` that `ModelRunner.prepare_inputs` reads (read-only, so
    `ChunkView` and the draft model's chunks are ones too)."""

    @property
    def start_position(self) -> int: ...

    @property
    def num_tokens(self) -> int: ...

    @property
    def block_ids(self) -> list[int]: ...

    @property
    def token_ids(self) -> list[int]: ...

    @property
    def num_logits(self) -> int: ...


class ChunkView(NamedTuple):
    """A chunk rebuilt from the broadcast tensors on a rank other than 0."""

    start_position: int
    num_tokens: int
    num_logits: int
    token_ids: list[int]
    block_ids: list[int]


def pack_chunks(chunks: Sequence[ChunkInputs]) -> torch.Tensor:
    """The payload tensor for `chunks` (see the module docstring)."""
    table: list[int] = []
    token_ids: list[int] = []
    block_ids: list[int] = []
    for chunk in chunks:
        table += [chunk.start_position, chunk.num_tokens, chunk.num_logits, len(chunk.block_ids)]
        token_ids += chunk.token_ids
        block_ids += chunk.block_ids
    return torch.tensor(table + token_ids + block_ids, dtype=torch.int64)


def unpack_chunks(payload: torch.Tensor, num_chunks: int) -> list[ChunkView]:
    """The inverse of `pack_chunks`."""
    values = payload.tolist()
    table_len = num_chunks * _CHUNK_FIELDS
    table = values[:table_len]
    token_at = table_len
    block_at = table_len + sum(table[1::_CHUNK_FIELDS])
    chunks = []
    for i in range(num_chunks):
        row = table[i * _CHUNK_FIELDS : (i + 1) * _CHUNK_FIELDS]
        start, num_tokens, num_logits, num_blocks = row
        chunks.append(
            ChunkView(
                start,
                num_tokens,
                num_logits,
                values[token_at : token_at + num_tokens],
                values[block_at : block_at + num_blocks],
            )
        )
        token_at += num_tokens
        block_at += num_blocks
    return chunks
