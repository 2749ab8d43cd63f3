"""Turns a `SchedulerOutput` into one batched forward and a sampled token per finished chunk."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Generic, Protocol, TypeVar, cast

import torch

from splitserve.engine.cuda_graphs import (
    CudaGraphCapture,
    DecodeGraphs,
    DecodeGraphsOptions,
)
from splitserve.engine.kv.groups import KVGroups
from splitserve.engine.launched_step import LaunchedStep
from splitserve.engine.model.architecture import ModelArchitecture
from splitserve.engine.model.attention_backend import select_attention_backend
from splitserve.engine.model.attention_metadata import (
    AttentionBackend,
    AttentionMetadata,
    PrefillChunk,
)
from splitserve.engine.model.decode_groups import group_decodes
from splitserve.engine.parallel.step_tensors import ChunkInputs
from splitserve.engine.request import Request
from splitserve.engine.sampler import Sampler, SamplingRow, advance_generator
from splitserve.engine.step import ModelOutput, ScheduledChunk, SchedulerOutput
from splitserve.engine.structured_output.matcher import NO_MASKS, StepMasks

if TYPE_CHECKING:
    from splitserve.engine.lora.slots import LoRASlots
    from splitserve.engine.parallel.group import ParallelGroup


@dataclass
class ModelInputs:
    input_ids: torch.Tensor  # [num_tokens]
    positions: torch.Tensor  # [num_tokens]
    meta: AttentionMetadata
    # [num_logits]: the last row of each sampled chunk; every row of a verification chunk.
    logits_indices: torch.Tensor
    # What the inputs were built from: the other ranks of a parallel engine rebuild them.
    chunks: Sequence[ChunkInputs] = ()


class CausalLM(Protocol):
    """What the runner needs of a model: the target (`LlamaForCausalLM`) or a draft that runs
    part of it (`EarlyExitModel`)."""

    @property
    def arch(self) -> ModelArchitecture: ...

    def __call__(
        self,
        input_ids: torch.Tensor,  # [num_tokens]
        positions: torch.Tensor,  # [num_tokens]
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        backend: AttentionBackend,
        logits_indices: torch.Tensor,  # [num_logits]
        /,
    ) -> torch.Tensor: ...  # [num_logits, vocab]


# Covariant: a runner of the target is a runner of some CausalLM (only the runner sets .model).
ModelT = TypeVar("ModelT", bound=CausalLM, covariant=True)


class ModelRunner(Generic[ModelT]):
    """`ModelRunner[LlamaForCausalLM]` where callers reach into the target model's layers."""

    def __init__(
        self,
        model: ModelT,
        kv_cache: torch.Tensor,
        block_size: int,
        eos_token_ids: tuple[int, ...],
        parallel: ParallelGroup | None = None,
        decode_graphs: DecodeGraphsOptions | None = None,
        lora: LoRASlots | None = None,
        kv_groups: KVGroups | None = None,
    ) -> None:
        """`kv_groups`: a mixed-window model's layer groups (shared/kv/groups.py), whose
        chunks carry a block table per group."""
        self.model = model
        self.kv_groups = kv_groups
        # Multi-LoRA: each step's adapters are put in slots and its rows mapped to them.
        self.lora = lora
        # Rank 0 of a parallel engine: each forward is sent to the other ranks first.
        self.parallel = parallel
        self.kv_cache = kv_cache
        self.block_size = block_size
        self.device = kv_cache.device
        # One layer's keys and values of one block: kv_cache is [layers (or a layer group's
        # slots), 2, blocks, ...].
        self._block_bytes = kv_cache[0, :, 0].numel() * kv_cache.element_size()
        self.backend: AttentionBackend = select_attention_backend(self.device, kv_cache.dtype)
        self.sampler = Sampler()
        self.eos_token_ids = eos_token_ids
        # Per-request RNGs, so a seeded request samples the same tokens whatever shares its batch.
        self._generators: dict[str, torch.Generator] = {}
        # Last: capturing runs forward passes, which need everything above.
        self.decode_graphs = self._capture_decode_graphs(decode_graphs)

    def execute(self, sched: SchedulerOutput, masks: StepMasks = NO_MASKS) -> ModelOutput:
        """One forward over `sched`; samples every plain sampled chunk (within the grammar
        `masks` allow). A verification chunk's logits rows come back unsampled in
        `verification_logits`, for the speculator."""
        inputs = self.prepare_inputs(sched.chunks)
        logits = self._forward_with_adapters(inputs, sched)  # [num_logits, vocab]
        plain_rows: list[int] = []
        plain_requests: list[Request] = []
        verification_logits: dict[str, torch.Tensor] = {}
        row = 0
        for chunk in sched.chunks:  # the order prepare_inputs laid the rows out in
            if chunk.is_verification:
                verification_logits[chunk.request.request_id] = logits[row : row + chunk.num_logits]
            elif chunk.num_logits:
                plain_rows.append(row)
                plain_requests.append(chunk.request)
            row += chunk.num_logits
        # Every row plain (no verification chunk, every chunk sampled) is the common decode
        # step: its logits as they are, not a gathered copy of the whole [rows, vocab].
        plain_logits = logits if len(plain_rows) == logits.shape[0] else logits[plain_rows]
        out = self._sample_plain(plain_logits, plain_requests, masks)
        out.verification_logits = verification_logits
        return out

    def launch(self, sched: SchedulerOutput, previous: LaunchedStep | None) -> LaunchedStep:
        """Async scheduling: `execute` without reading the tokens back. Every sampled chunk
        is plain (`can_run_ahead`). A decode row whose input is still pending (the newest
        token of a request in `previous`) reads it from `previous`'s tokens on the device."""
        inputs = self.prepare_inputs(sched.chunks)
        self._feed_pending_tokens(inputs, sched.chunks, previous)
        logits = self._forward_with_adapters(inputs, sched)
        requests = [chunk.request for chunk in sched.chunks if chunk.num_logits]
        assert len(requests) == logits.shape[0], "async steps sample one row per chunk"
        rows = [self.sampling_row(request) for request in requests]
        token_ids = self.sampler.sample_on_device(logits, rows)
        return LaunchedStep.queue(sched, [r.request_id for r in requests], token_ids)

    def _feed_pending_tokens(
        self, inputs: ModelInputs, chunks: Sequence[ScheduledChunk], previous: LaunchedStep | None
    ) -> None:
        """Copies, on the device, each pending input token from the step that samples it."""
        pending = [row for row, chunk in enumerate(chunks) if chunk.request.has_pending_token]
        if not pending:
            return
        # Only a decode's newest token can be pending, and decodes lead the rows (one each).
        assert all(chunks[row].is_decode for row in pending), "a pending token in a prompt chunk"
        assert previous is not None, "a pending token with no step in flight"
        row_of = previous.row_of()
        sources = [row_of[chunks[row].request.request_id] for row in pending]
        rows = self._to_device(torch.tensor(pending, dtype=torch.int64))
        src = self._to_device(torch.tensor(sources, dtype=torch.int64))
        inputs.input_ids[rows] = previous.device_token_ids[src]

    def _forward_with_adapters(self, inputs: ModelInputs, sched: SchedulerOutput) -> torch.Tensor:
        """`forward`, with the step's LoRA batch set on the model's hooks for its duration."""
        if self.lora is None:
            return self.forward(inputs)
        state = self.lora.model.state
        state.batch = self.lora.batch_for(sched.chunks)
        try:
            return self.forward(inputs)
        finally:
            state.batch = None  # a draft's forward (early exit) runs the base model

    def forward(self, inputs: ModelInputs) -> torch.Tensor:
        """One batched forward over the paged cache; logits of `inputs.logits_indices` rows."""
        if self.parallel is not None:
            return self.parallel.run_step(self, inputs)
        return self.forward_local(inputs)

    def forward_local(self, inputs: ModelInputs) -> torch.Tensor:
        """`forward` in this process only (a parallel engine's rank 0 runs its part here): a
        captured CUDA graph's replay when the step fits one, else eagerly."""
        args = (inputs.input_ids, inputs.positions, inputs.meta, inputs.logits_indices)
        if self.decode_graphs is not None:
            logits = self.decode_graphs.run(*args)
            if logits is not None:
                return logits
        return self.forward_eager(*args)

    def forward_eager(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        logits_indices: torch.Tensor,
    ) -> torch.Tensor:
        return self.model(input_ids, positions, self.kv_cache, meta, self.backend, logits_indices)

    def _capture_decode_graphs(self, options: DecodeGraphsOptions | None) -> DecodeGraphs | None:
        if options is None:
            return None
        if self.parallel is not None or not self.backend.uses_block_tables:
            raise ValueError(
                "cuda_graphs needs a single-process engine on the Triton attention path"
            )
        max_blocks = -(-options.max_model_len // self.block_size)
        return DecodeGraphs(
            self.forward_eager, options.batch_sizes, max_blocks, self.device, CudaGraphCapture()
        )

    def _sample_plain(
        self, logits: torch.Tensor, requests: list[Request], masks: StepMasks
    ) -> ModelOutput:
        rows = [
            self.sampling_row(request, allowed=masks.allowed(request.request_id))
            for request in requests
        ]
        sampled = self.sampler.sample(logits, rows)
        ids = [request.request_id for request in requests]
        logprobs = {rid: lp for rid, lp in zip(ids, sampled.logprobs) if lp is not None}
        return ModelOutput(dict(zip(ids, sampled.sampled_token_ids)), logprobs)

    def release(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            self._generators.pop(request_id, None)

    # ---- inputs -----------------------------------------------------------------------------

    def prepare_inputs(self, chunks: Sequence[ChunkInputs]) -> ModelInputs:
        """Flattens the chunks (single-token chunks first, as the scheduler orders them)."""
        num_decodes = sum(1 for chunk in chunks if chunk.num_tokens == 1)
        assert all(c.num_tokens == 1 for c in chunks[:num_decodes]), "decodes must come first"
        decodes = chunks[:num_decodes]
        token_ids = [chunk.token_ids[0] for chunk in decodes]
        positions = [torch.tensor([chunk.start_position for chunk in decodes], dtype=torch.int64)]
        logits_rows = [row for row, chunk in enumerate(decodes) if chunk.num_logits]
        for chunk in chunks[num_decodes:]:
            row = len(token_ids)
            token_ids.extend(chunk.token_ids)
            positions.append(
                torch.arange(chunk.start_position, chunk.start_position + chunk.num_tokens)
            )
            end = row + chunk.num_tokens
            logits_rows.extend(range(end - chunk.num_logits, end))
        meta = self._attention_meta(chunks, num_decodes, [chunk.block_ids for chunk in chunks])
        if self.kv_groups is not None:
            meta.kv_groups = self.kv_groups
            meta.group_metas = [
                self._attention_meta(chunks, num_decodes, tables)
                for tables in _group_tables(chunks, self.kv_groups.num_groups)
            ]
        return ModelInputs(
            input_ids=self._to_device(torch.tensor(token_ids, dtype=torch.int64)),
            positions=self._to_device(torch.cat(positions)),
            meta=meta,
            logits_indices=self._to_device(torch.tensor(logits_rows, dtype=torch.int64)),
            chunks=chunks,
        )

    def _attention_meta(
        self, chunks: Sequence[ChunkInputs], num_decodes: int, tables: list[list[int]]
    ) -> AttentionMetadata:
        """The step's slots and block tables from one block table per chunk (the request's,
        or one layer group's)."""
        # Decode rows in plain Python: a few integer operations each, where tensor ops would
        # cost microseconds apiece, times the batch, on every step.
        block_size = self.block_size
        decode_slots = [
            table[chunk.start_position // block_size] * block_size
            + chunk.start_position % block_size
            for chunk, table in zip(chunks[:num_decodes], tables)
        ]
        slots = [torch.tensor(decode_slots, dtype=torch.int64)]
        prefills: list[PrefillChunk] = []
        row = num_decodes
        for chunk, table in zip(chunks[num_decodes:], tables[num_decodes:]):
            chunk_positions = torch.arange(
                chunk.start_position, chunk.start_position + chunk.num_tokens
            )
            slots.append(self._slots(table, chunk_positions))
            seq_len = chunk.start_position + chunk.num_tokens
            used = torch.tensor(table[: -(-seq_len // self.block_size)])
            prefills.append(PrefillChunk(row, chunk.num_tokens, seq_len, self._to_device(used)))
            row += chunk.num_tokens
        meta = AttentionMetadata(
            slot_mapping=self._to_device(torch.cat(slots)),
            num_decodes=num_decodes,
            prefills=prefills,
        )
        if self.backend.uses_block_tables:
            self._add_block_tables(meta, chunks, tables)
        elif self.backend.reads_decodes_in_place:
            self._add_decode_block_tables(meta, chunks[:num_decodes], tables[:num_decodes])
        else:
            # Only the PyTorch path reads groups; building them for the GPU path would add
            # host-to-device copies to every step.
            meta.decode_groups = group_decodes(
                [chunk.start_position + 1 for chunk in chunks[:num_decodes]],
                tables[:num_decodes],
                self.block_size,
                self._block_bytes,
                self.device,
            )
        return meta

    def _add_block_tables(
        self, meta: AttentionMetadata, chunks: Sequence[ChunkInputs], tables: list[list[int]]
    ) -> None:
        """The same positions as block tables, for kernels that walk the blocks themselves."""
        seq_lens = [chunk.start_position + chunk.num_tokens for chunk in chunks]
        max_blocks = -(-max(seq_lens) // self.block_size)
        rows = []
        for table, seq_len in zip(tables, seq_lens):
            used = table[: -(-seq_len // self.block_size)]
            rows.append(used + [0] * (max_blocks - len(used)))
        query_lens = torch.tensor([0] + [chunk.num_tokens for chunk in chunks])
        meta.block_tables = self._to_device(torch.tensor(rows, dtype=torch.int32))
        meta.seq_lens = self._to_device(torch.tensor(seq_lens, dtype=torch.int32))
        meta.query_start_loc = self._to_device(query_lens.cumsum(0).to(torch.int32))

    def _add_decode_block_tables(
        self, meta: AttentionMetadata, decodes: Sequence[ChunkInputs], tables: list[list[int]]
    ) -> None:
        """The decode rows' blocks and lengths, for the CPU kernel that reads them in place."""
        if not decodes:
            return
        seq_lens = [chunk.start_position + 1 for chunk in decodes]
        max_blocks = -(-max(seq_lens) // self.block_size)
        rows = [table[:max_blocks] + [0] * (max_blocks - len(table)) for table in tables]
        meta.decode_block_tables = torch.tensor(rows, dtype=torch.int32)
        meta.decode_seq_lens = torch.tensor(seq_lens, dtype=torch.int32)

    def _to_device(self, host: torch.Tensor) -> torch.Tensor:
        """A step input onto the device without waiting for it: a blocking copy to a GPU waits
        for every kernel queued before it, the step in flight included (async scheduling), so
        the copy goes from pinned memory, queued on the stream like the kernels."""
        if self.device.type != "cuda":
            return host.to(self.device)
        return host.pin_memory().to(self.device, non_blocking=True)

    def _slots(self, block_ids: list[int], positions: torch.Tensor) -> torch.Tensor:
        table = torch.tensor(block_ids, dtype=torch.int64)
        return table[positions // self.block_size] * self.block_size + positions % self.block_size

    # ---- sampling ---------------------------------------------------------------------------

    def sampling_row(
        self,
        request: Request,
        draft_token_ids: Sequence[int] = (),
        allowed: torch.Tensor | None = None,
    ) -> SamplingRow:
        """What sampling the request's next token needs; with `draft_token_ids`, the token
        after those drafts (speculative decoding: penalties and min_tokens count them).
        `allowed`: the grammar's mask for that position (structured outputs)."""
        params = request.sampling_params
        suppressed: tuple[int, ...] = ()
        if request.num_output_tokens + len(draft_token_ids) < params.min_tokens:
            suppressed = tuple(self.eos_token_ids) + tuple(params.stop_token_ids)
        output_token_ids = request.output_token_ids
        if draft_token_ids:
            output_token_ids = output_token_ids + list(draft_token_ids)
        return SamplingRow(
            params=params,
            generator=self.generator(request),
            prompt_token_ids=request.prompt_token_ids,
            output_token_ids=output_token_ids,
            suppressed_token_ids=suppressed,
            allowed_token_mask=allowed,
        )

    def generator(self, request: Request) -> torch.Generator | None:
        seed = request.sampling_params.seed
        if seed is None or request.sampling_params.is_greedy:
            return None
        generator = self._generators.get(request.request_id)
        if generator is None:
            generator = torch.Generator(device=self.device).manual_seed(seed)
            # Output tokens that exist before this engine's first draw were sampled by a
            # prefill pod from the same seed: skip its draws.
            advance_generator(generator, request.num_output_tokens)
            self._generators[request.request_id] = generator
        return generator


def _group_tables(chunks: Sequence[ChunkInputs], num_groups: int) -> list[list[list[int]]]:
    """Per layer group after the first: each chunk's block table in it."""
    grouped = [cast(GroupedChunk, chunk).group_block_ids for chunk in chunks]
    assert all(len(tables) == num_groups - 1 for tables in grouped), (
        "a grouped runner's chunks carry a table per group"
    )
    return [[tables[group] for tables in grouped] for group in range(num_groups - 1)]


class GroupedChunk(Protocol):
    """A chunk of a model with layer groups: ScheduledChunk."""

    group_block_ids: tuple[list[int], ...]
