"""CUDA graphs for decode-only steps (`cuda_graphs=True`, off by default).

A decode step of a small model on a GPU is mostly kernel launches: SmolLM2-135M launches a few
hundred small kernels per step, each costing more host time than GPU time. A CUDA graph
records one step's launches once and replays them with one call. A graph replays fixed
shapes from fixed addresses, so at start-up one graph is captured per batch size of
`DECODE_GRAPH_BATCH_SIZES`, each reading its own static input buffers (`StaticDecodeInputs`);
a step with n decode rows replays the smallest captured size >= n, its inputs copied into the
first n rows of those buffers and the rest padded:

    rows  | the step's n decodes | padding up to the captured size |
    slot  | where each K/V goes  | -1: the KV write skips the row  |
    seq   | its context length   | 1, over block 0: read, never written |
    logits| kept                 | dropped                         |

Block tables are captured `max_blocks` wide (the model's context length in blocks): the decode
kernel sizes its partitions from that width, not from the true lengths, so a replay covers any
context the engine admits. A step that does not fit (a prefill chunk, a verification chunk,
more rows than the largest size) runs eagerly as before.

`graph_batch_size` and `StaticDecodeInputs` are plain tensor code, unit-tested on the CPU;
`DecodeGraphs` takes the capture as a function (`CudaGraphCapture` on CUDA), so the padding
and the replay choice are tested on the CPU with an eager "capture".
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from splitserve.engine.model.attention_metadata import AttentionMetadata

# Powers of two up to a full decode batch of the default scheduler's common loads; vLLM
# captures a similar ladder. Each graph holds its own activations in a shared memory pool.
DECODE_GRAPH_BATCH_SIZES = (1, 2, 4, 8, 16, 32, 64)


@dataclass(frozen=True)
class DecodeGraphsOptions:
    """What the runner captures: one graph per batch size, block tables for contexts up to
    `max_model_len`."""

    max_model_len: int
    batch_sizes: tuple[int, ...] = DECODE_GRAPH_BATCH_SIZES


# What one forward is: (input_ids, positions, meta, logits_indices) -> logits.
Forward = Callable[[torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor], torch.Tensor]
Replay = Callable[[], torch.Tensor]


def pick_batch_size(num_rows: int, sizes: Sequence[int]) -> int | None:
    """The smallest of the sorted `sizes` holding `num_rows`; None past the largest."""
    index = bisect.bisect_left(sizes, num_rows)
    return sizes[index] if index < len(sizes) else None


def graph_batch_size(
    input_ids: torch.Tensor,
    meta: AttentionMetadata,
    logits_indices: torch.Tensor,
    sizes: Sequence[int],
    max_blocks: int,
) -> int | None:
    """The captured batch size this step replays in, or None when it must run eagerly. Reads
    host-side shapes and counts only (no device sync)."""
    num_rows = input_ids.shape[0]
    is_decode_only = not meta.prefills and meta.num_decodes == num_rows
    if not is_decode_only or logits_indices.shape[0] != num_rows:
        return None  # a prefill or verification chunk, or a row whose logits are not taken
    if meta.block_tables is None or meta.block_tables.shape[1] > max_blocks:
        return None  # not the block-table backend, or a context past the captured width
    return pick_batch_size(num_rows, sizes)


class StaticDecodeInputs:
    """The fixed buffers one graph reads: `batch_size` decode rows, block tables `max_blocks`
    wide. `fill` copies a step's rows in and pads the rest (see the module's diagram)."""

    def __init__(self, batch_size: int, max_blocks: int, device: torch.device) -> None:
        def zeros(*shape: int, dtype: torch.dtype) -> torch.Tensor:
            return torch.zeros(*shape, dtype=dtype, device=device)

        self.batch_size = batch_size
        self.input_ids = zeros(batch_size, dtype=torch.int64)
        self.positions = zeros(batch_size, dtype=torch.int64)
        self.logits_indices = torch.arange(batch_size, device=device)  # every row, in order
        self.meta = AttentionMetadata(
            slot_mapping=torch.full((batch_size,), -1, dtype=torch.int64, device=device),
            num_decodes=batch_size,
            prefills=[],
            block_tables=zeros(batch_size, max_blocks, dtype=torch.int32),
            seq_lens=torch.ones(batch_size, dtype=torch.int32, device=device),
            # One query row per sequence.
            query_start_loc=torch.arange(batch_size + 1, dtype=torch.int32, device=device),
        )

    def fill(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata):
        """Copies a decode-only step's rows (as `graph_batch_size` accepted) into the buffers;
        mutates them in place, so a captured graph sees the new step."""
        assert meta.block_tables is not None and meta.seq_lens is not None, "block tables"
        num_rows, width = meta.block_tables.shape
        static = self.meta
        assert static.seq_lens is not None and static.block_tables is not None, "built in __init__"
        _copy_then_fill(self.input_ids, input_ids, 0)
        _copy_then_fill(self.positions, positions, 0)
        _copy_then_fill(static.slot_mapping, meta.slot_mapping, -1)
        _copy_then_fill(static.seq_lens, meta.seq_lens, 1)
        static.block_tables[:num_rows, :width].copy_(meta.block_tables)
        static.block_tables[:num_rows, width:].zero_()  # past each row's length: never read
        static.block_tables[num_rows:].zero_()


def _copy_then_fill(static: torch.Tensor, rows: torch.Tensor, padding: int) -> None:
    static[: rows.shape[0]].copy_(rows)
    static[rows.shape[0] :].fill_(padding)


@dataclass(frozen=True)
class CapturedStep:
    inputs: StaticDecodeInputs
    replay: Replay  # runs the recorded forward over `inputs`; returns its logits buffer


class DecodeGraphs:
    """One captured decode step per batch size; `run` replays the one a step fits, or returns
    None for the caller to run the step eagerly."""

    def __init__(
        self,
        forward: Forward,
        sizes: Sequence[int],
        max_blocks: int,
        device: torch.device,
        capture: Callable[[Replay], Replay],
    ) -> None:
        """Captures every size now (largest first, as its activations bound the others').
        `capture(run)` records `run` and returns its replay (`CudaGraphCapture` on CUDA)."""
        self.sizes = tuple(sorted(sizes))
        self.max_blocks = max_blocks
        self._steps: dict[int, CapturedStep] = {}
        for size in reversed(self.sizes):
            inputs = StaticDecodeInputs(size, max_blocks, device)

            def run(inputs: StaticDecodeInputs = inputs) -> torch.Tensor:
                return forward(
                    inputs.input_ids, inputs.positions, inputs.meta, inputs.logits_indices
                )

            self._steps[size] = CapturedStep(inputs, capture(run))

    def run(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        logits_indices: torch.Tensor,
    ) -> torch.Tensor | None:
        """The step's logits `[num_rows, vocab]` from a replay, or None if it does not fit."""
        size = graph_batch_size(input_ids, meta, logits_indices, self.sizes, self.max_blocks)
        if size is None:
            return None
        step = self._steps[size]
        step.inputs.fill(input_ids, positions, meta)
        # A copy: the next replay overwrites the graph's own output buffer.
        return step.replay()[: input_ids.shape[0]].clone()


class CudaGraphCapture:
    """`capture` for `DecodeGraphs` on CUDA: every graph in one memory pool, as only one
    replays at a time."""

    def __init__(self) -> None:
        self.pool = torch.cuda.graph_pool_handle()

    def __call__(self, run: Replay) -> Replay:
        # Warm-up outside the graph on a side stream, as torch's docs ask: Triton compiles,
        # cuBLAS picks its kernels and the allocator settles before anything is recorded.
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                run()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            logits = run()

        def replay() -> torch.Tensor:
            graph.replay()
            return logits

        return replay
