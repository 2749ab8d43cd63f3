"""What rank 0 asks the other ranks to do: a fixed-size header, then an int64 payload.

    header [opcode, count, payload_len]
    STEP           count = chunks; payload = splitserve.engine.parallel.step_tensors.pack_chunks
    STOP           the engine is closing
    GATHER_PAGES   payload = block ids; each rank sends rank 0 its part of those pages
    SCATTER_PAGES  payload = block ids; rank 0 sends each rank its part of those pages
    PIPELINE_STEP  count = micro-batches; payload = chunks per micro-batch, then STEP's payload

Rank 0 calls `send`; the others `receive_header` in a loop (worker.py), and hand the page
opcodes to `splitserve.engine.parallel.pages.run_page_op`.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch

from splitserve.engine.parallel.comm import Communicator

_HEADER_LEN = 3


class Opcode(enum.IntEnum):
    STEP = 1
    STOP = 2
    GATHER_PAGES = 3
    SCATTER_PAGES = 4
    PIPELINE_STEP = 5


@dataclass(frozen=True)
class Header:
    opcode: Opcode
    count: int
    payload_len: int


def send(comm: Communicator, opcode: Opcode, payload: torch.Tensor | None, count: int = 0) -> None:
    """Rank 0: the header, then the payload (int64) when there is one."""
    length = 0 if payload is None else payload.numel()
    comm.broadcast(torch.tensor([int(opcode), count, length], dtype=torch.int64))
    if payload is not None and length:
        comm.broadcast(payload)


def receive_header(comm: Communicator) -> tuple[Header, torch.Tensor]:
    """Ranks other than 0: waits (without limit) for rank 0's next header, then its payload."""
    raw = torch.empty(_HEADER_LEN, dtype=torch.int64)
    comm.broadcast(raw, idle=True)
    opcode, count, length = raw.tolist()
    payload = torch.empty(length, dtype=torch.int64)
    if length:
        comm.broadcast(payload)
    return Header(Opcode(opcode), count, length), payload

