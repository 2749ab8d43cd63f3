"""Draft-model proposers: a smaller model sharing the tokenizer, or the target's first layers.

The draft model keeps its KV in pages addressed by the target's block table: the scheduler
allocated the request's blocks (draft slots included), so the draft needs no block accounting
of its own, and rolled-back or freed blocks are rolled back and freed for both at once.

- "draft": a separate model with its own cache tensor of the same block count. It tracks which
  of the request's tokens it has seen (`Request.num_draft_computed_tokens`) and first catches up
  on the rest (the prompt, tokens decoded while speculation paused, pages a prefill pod sent).
- "self": the target's first K layers and its head (`EarlyExitModel`). Those layers compute the
  same KV as the target's own first K layers, so it reads and writes the target's cache and
  never needs to catch up.

Proposing k tokens takes k draft forwards, each batched over every speculating request:

    pass 1:  | catch-up tokens ... newest token | -> d1
    pass j:  d_(j-1) at position num_tokens + j - 2 -> d_j
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from splitserve.engine.config import EngineConfig
from splitserve.engine.kv.cache import KVCacheSpec, allocate_kv_cache, bytes_per_block
from splitserve.engine.model.llama import LlamaForCausalLM
from splitserve.engine.model.loader import load_checkpoint
from splitserve.engine.request import Request
from splitserve.engine.runner import CausalLM, ModelRunner
from splitserve.engine.sampler import draw, sampling_distribution
from splitserve.engine.step import Drafts, ScheduledChunk


class EarlyExitModel:
    """The target's first `num_layers` layers, its final norm and head: a draft with no weights
    of its own."""

    def __init__(self, target: LlamaForCausalLM, num_layers: int) -> None:
        if num_layers >= target.arch.num_layers:
            raise ValueError(
                f"speculative_draft_layers must be below the model's {target.arch.num_layers} "
                f"layers, got {num_layers}"
            )
        self.target = target
        self.num_layers = num_layers
        self.arch = target.arch

    def __call__(self, *inputs: object) -> torch.Tensor:
        return self.target(*inputs, num_layers=self.num_layers)


def load_draft_model(path: str, config: EngineConfig, target: LlamaForCausalLM, max_model_len: int):
    """The separate draft model, with weights, in the target's dtype and device."""
    checkpoint = load_checkpoint(path)
    arch = checkpoint.architecture
    if arch.vocab_size != target.arch.vocab_size:
        raise ValueError(
            f"speculative_draft_model has a vocabulary of {arch.vocab_size} tokens; the target's "
            f"has {target.arch.vocab_size} (the draft must share its tokenizer)"
        )
    if arch.max_position_embeddings < max_model_len:
        raise ValueError(
            f"speculative_draft_model handles {arch.max_position_embeddings} positions, fewer "
            f"than max_model_len {max_model_len}: lower max_model_len"
        )
    device = torch.device(config.model.device)
    model = LlamaForCausalLM(arch, max_model_len, device)
    model.materialize(device, getattr(torch, config.model.dtype))
    model.load_hf_weights(checkpoint.weights)
    return model


def draft_kv_cache(model: LlamaForCausalLM, target_kv: torch.Tensor, block_size: int):
    """A cache for the draft with as many blocks as the target's (same block ids), in the
    target's format (an int8 target cache gives an int8 draft cache)."""
    num_blocks = target_kv.shape[2]
    kv_cache_dtype = "int8" if target_kv.dtype == torch.int8 else "auto"
    per_block = bytes_per_block(model.arch, block_size, target_kv.dtype, kv_cache_dtype)
    spec = KVCacheSpec(num_blocks, block_size, per_block)
    return allocate_kv_cache(spec, model.arch, target_kv.dtype, target_kv.device, kv_cache_dtype)


@dataclass
class _DraftChunk:
    """One request's tokens in one draft forward (the fields `prepare_inputs` reads)."""

    request: Request
    start_position: int
    token_ids: list[int]
    block_ids: list[int]
    is_sampled: bool = True
    num_logits: int = 1

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


@dataclass
class _Drafting:
    """What one request has drafted so far this step."""

    chunk: ScheduledChunk
    token_ids: list[int]
    probs: list[torch.Tensor]  # [vocab] each; empty for greedy requests (never read)


class DraftModelProposer:
    """Fills draft slots with tokens the draft model samples under each request's own
    SamplingParams (greedy requests take its argmax)."""

    def __init__(
        self,
        draft_runner: ModelRunner[CausalLM],
        target_runner: ModelRunner,
        shares_target_kv: bool,
    ) -> None:
        self.draft_runner = draft_runner
        self.target_runner = target_runner
        self.shares_target_kv = shares_target_kv

    def propose(self, chunks: list[ScheduledChunk]) -> dict[str, Drafts]:
        drafting = [_Drafting(chunk, [], []) for chunk in chunks if chunk.num_draft_slots]
        active = drafting
        step_chunks = [self._catch_up_chunk(d.chunk) for d in drafting]
        while active:
            self._draft_one_token(active, step_chunks)
            active = [d for d in active if len(d.token_ids) < d.chunk.num_draft_slots]
            step_chunks = [self._next_chunk(d) for d in active]
        drafts = {}
        for d in drafting:
            request = d.chunk.request
            # Written: every token before the newest, the newest, and all drafts but the last.
            request.num_draft_computed_tokens = request.num_tokens - 1 + len(d.token_ids)
            probs = torch.stack(d.probs) if d.probs else None
            drafts[request.request_id] = Drafts(d.token_ids, probs)
        return drafts

    def _catch_up_chunk(self, chunk: ScheduledChunk) -> _DraftChunk:
        request = chunk.request
        if self.shares_target_kv:
            start = request.num_computed_tokens
        else:
            start = min(request.num_draft_computed_tokens, request.num_tokens - 1)
        return _DraftChunk(request, start, request.all_token_ids[start:], chunk.block_ids)

    @staticmethod
    def _next_chunk(d: _Drafting) -> _DraftChunk:
        position = d.chunk.request.num_tokens - 1 + len(d.token_ids)
        return _DraftChunk(d.chunk.request, position, [d.token_ids[-1]], d.chunk.block_ids)

    def _draft_one_token(self, active: list[_Drafting], step_chunks: list[_DraftChunk]) -> None:
        # The runner wants single-token chunks first; keep `active` in the same order.
        order = sorted(range(len(active)), key=lambda i: step_chunks[i].num_tokens != 1)
        active[:] = [active[i] for i in order]
        inputs = self.draft_runner.prepare_inputs([step_chunks[i] for i in order])
        logits = self.draft_runner.forward(inputs)  # [num_active, vocab]
        rows = [self.target_runner.sampling_row(d.chunk.request, d.token_ids) for d in active]
        probs = sampling_distribution(logits, rows)
        token_ids = probs.argmax(dim=-1)
        random_rows = [i for i, row in enumerate(rows) if not row.params.is_greedy]
        if random_rows:
            generators = [rows[i].generator for i in random_rows]
            token_ids[random_rows] = draw(probs[random_rows], generators)
        for i, (d, token_id) in enumerate(zip(active, token_ids.tolist())):
            d.token_ids.append(token_id)
            if not rows[i].params.is_greedy:
                d.probs.append(probs[i])
