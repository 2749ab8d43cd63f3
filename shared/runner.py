"""Turns a `SchedulerOutput` into one batched forward and a sampled token per finished chunk."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from shared.model.attention import (
    AttentionBackend,
    AttentionMetadata,
    PrefillChunk,
    select_attention_backend,
)
from shared.model.llama import LlamaForCausalLM
from shared.request import Request
from shared.sampler import Sampler, SamplingRow, advance_generator
from shared.scheduler import ModelOutput, ScheduledChunk, SchedulerOutput


@dataclass
class ModelInputs:
    input_ids: torch.Tensor  # [num_tokens]
    positions: torch.Tensor  # [num_tokens]
    meta: AttentionMetadata
    logits_indices: torch.Tensor  # [num_sampled]: last row of each sampled chunk
    sampled_requests: list[Request]  # row i of the logits belongs to sampled_requests[i]


class ModelRunner:
    def __init__(
        self,
        model: LlamaForCausalLM,
        kv_cache: torch.Tensor,
        block_size: int,
        eos_token_ids: tuple[int, ...],
    ) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.block_size = block_size
        self.device = kv_cache.device
        self.backend: AttentionBackend = select_attention_backend(self.device)
        self.sampler = Sampler()
        self.eos_token_ids = eos_token_ids
        # Per-request RNGs, so a seeded request samples the same tokens whatever shares its batch.
        self._generators: dict[str, torch.Generator] = {}

    def execute(self, sched: SchedulerOutput) -> ModelOutput:
        inputs = self.prepare_inputs(sched.chunks)
        logits = self.model(
            inputs.input_ids,
            inputs.positions,
            self.kv_cache,
            inputs.meta,
            self.backend,
            inputs.logits_indices,
        )
        rows = [self._sampling_row(request) for request in inputs.sampled_requests]
        sampled = self.sampler.sample(logits, rows)
        ids = [request.request_id for request in inputs.sampled_requests]
        logprobs = {rid: lp for rid, lp in zip(ids, sampled.logprobs) if lp is not None}
        return ModelOutput(dict(zip(ids, sampled.sampled_token_ids)), logprobs)

    def release(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            self._generators.pop(request_id, None)

    # ---- inputs -----------------------------------------------------------------------------

    def prepare_inputs(self, chunks: list[ScheduledChunk]) -> ModelInputs:
        """Flattens the chunks (single-token chunks first, as the scheduler orders them)."""
        num_decodes = sum(1 for chunk in chunks if chunk.num_tokens == 1)
        assert all(c.num_tokens == 1 for c in chunks[:num_decodes]), "decodes must come first"
        token_ids: list[int] = []
        positions: list[torch.Tensor] = []
        slots: list[torch.Tensor] = []
        logits_rows: list[int] = []
        prefills: list[PrefillChunk] = []
        for chunk in chunks:
            row = len(token_ids)
            token_ids.extend(chunk.token_ids)
            chunk_positions = torch.arange(
                chunk.start_position, chunk.start_position + chunk.num_tokens
            )
            positions.append(chunk_positions)
            slots.append(self._slots(chunk.block_ids, chunk_positions))
            if chunk.is_sampled:
                logits_rows.append(row + chunk.num_tokens - 1)
            if chunk.num_tokens > 1:
                seq_len = chunk.start_position + chunk.num_tokens
                used = torch.tensor(chunk.block_ids[: -(-seq_len // self.block_size)])
                prefills.append(PrefillChunk(row, chunk.num_tokens, seq_len, used.to(self.device)))
        decode_block_ids, decode_mask = self._decode_blocks(chunks[:num_decodes])
        meta = AttentionMetadata(
            slot_mapping=torch.cat(slots).to(self.device),
            num_decodes=num_decodes,
            decode_block_ids=decode_block_ids,
            decode_mask=decode_mask,
            prefills=prefills,
        )
        if self.backend.uses_block_tables:
            self._add_block_tables(meta, chunks)
        return ModelInputs(
            input_ids=torch.tensor(token_ids, dtype=torch.int64, device=self.device),
            positions=torch.cat(positions).to(self.device),
            meta=meta,
            logits_indices=torch.tensor(logits_rows, dtype=torch.int64, device=self.device),
            sampled_requests=[chunk.request for chunk in chunks if chunk.is_sampled],
        )

    def _add_block_tables(self, meta: AttentionMetadata, chunks: list[ScheduledChunk]) -> None:
        """The same positions as block tables, for kernels that walk the blocks themselves."""
        seq_lens = [chunk.start_position + chunk.num_tokens for chunk in chunks]
        max_blocks = -(-max(seq_lens) // self.block_size)
        tables = torch.zeros(len(chunks), max_blocks, dtype=torch.int32)
        for i, (chunk, seq_len) in enumerate(zip(chunks, seq_lens)):
            used = chunk.block_ids[: -(-seq_len // self.block_size)]
            tables[i, : len(used)] = torch.tensor(used, dtype=torch.int32)
        query_lens = torch.tensor([0] + [chunk.num_tokens for chunk in chunks])
        meta.block_tables = tables.to(self.device)
        meta.seq_lens = torch.tensor(seq_lens, dtype=torch.int32, device=self.device)
        meta.query_start_loc = query_lens.cumsum(0).to(torch.int32).to(self.device)

    def _slots(self, block_ids: list[int], positions: torch.Tensor) -> torch.Tensor:
        table = torch.tensor(block_ids, dtype=torch.int64)
        return table[positions // self.block_size] * self.block_size + positions % self.block_size

    def _decode_blocks(
        self, decodes: list[ScheduledChunk]
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Flattened padded block table of the decoding sequences, and its padding mask."""
        if not decodes:
            return torch.empty(0, dtype=torch.int64, device=self.device), None
        seq_lens = torch.tensor([chunk.start_position + 1 for chunk in decodes])
        max_blocks = -(-int(seq_lens.max()) // self.block_size)
        # Padding entries point at block 0: valid memory, masked out below.
        table = torch.zeros(len(decodes), max_blocks, dtype=torch.int64)
        for i, chunk in enumerate(decodes):
            ids = chunk.block_ids[:max_blocks]
            table[i, : len(ids)] = torch.tensor(ids)
        max_len = max_blocks * self.block_size
        mask = None
        if int(seq_lens.min()) != max_len:
            positions = torch.arange(max_len)
            mask = (positions.unsqueeze(0) < seq_lens.unsqueeze(1)).view(
                len(decodes), 1, 1, max_len
            )
            mask = mask.to(self.device)
        return table.view(-1).to(self.device), mask

    # ---- sampling ---------------------------------------------------------------------------

    def _sampling_row(self, request: Request) -> SamplingRow:
        params = request.sampling_params
        suppressed: tuple[int, ...] = ()
        if request.num_output_tokens < params.min_tokens:
            suppressed = tuple(self.eos_token_ids) + tuple(params.stop_token_ids)
        return SamplingRow(
            params=params,
            generator=self._generator(request),
            prompt_token_ids=request.prompt_token_ids,
            output_token_ids=request.output_token_ids,
            suppressed_token_ids=suppressed,
        )

    def _generator(self, request: Request) -> torch.Generator | None:
        seed = request.sampling_params.seed
        if seed is None or request.sampling_params.is_greedy:
            return None
        generator = self._generators.get(request.request_id)
        if generator is None:
            generator = torch.Generator(device=self.device).manual_seed(seed)
            # Output tokens that exist before this engine's first draw were sampled by a
            # prefill pod from the same seed: skip its draws.
            vocab_size = self.model.arch.vocab_size
            advance_generator(generator, vocab_size, request.num_output_tokens)
            self._generators[request.request_id] = generator
        return generator
