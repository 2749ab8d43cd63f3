"""The engine step as a contract on data: what the scheduler hands out, what proposers add,
what the forward pass returns, what the step did to each request, and the result observers see.

    sched = scheduler.schedule()                       # SchedulerOutput
    sched = sched.with_drafts(speculator.propose(sched))  # speculation: Drafts per request
    model_out = runner.execute(sched)                  # ModelOutput
    updates = scheduler.update(sched, model_out)       # list[RequestUpdate]
    observers see StepResult(sched, model_out, start_time, end_time)

Every module of the step (scheduler, runner, spec_decode, telemetry, disaggregation) imports
these types from here, so none of them needs another's module for its types.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import torch

    from splitserve.engine.request import Request
    from splitserve.engine.sampler import TokenLogprobs


@dataclass
class ScheduledChunk:
    """The tokens one request computes this step. Built by the scheduler; `with_drafts` makes
    a new chunk rather than changing one."""

    request: Request
    start_position: int  # = num_computed_tokens when scheduled
    num_tokens: int  # known tokens plus the drafts in draft_token_ids
    block_ids: list[int]  # the request's whole block table after allocation
    # The chunk reaches the request's newest token, so this step samples its next one.
    is_sampled: bool
    # Speculative decoding: slots allocated past the newest token for draft tokens (the
    # scheduler sets it), and the drafts a proposer put there (<= num_draft_slots of them).
    num_draft_slots: int = 0
    draft_token_ids: list[int] = field(default_factory=list)
    # [num_drafts, vocab]: the proposer's distribution each draft was drawn from; None for a
    # deterministic proposer (n-gram: a point mass on the draft).
    draft_probs: torch.Tensor | None = None
    # The block tables of the model's later layer groups (shared/kv/groups.py), after
    # `block_ids` (group 0's); () for a model with one group.
    group_block_ids: tuple[list[int], ...] = ()

    def page_block_ids(self, first_block: int) -> list[int]:
        """The blocks a page transfer of this request's blocks from `first_block` on moves:
        every group's, in group order (KVCacheManager.page_block_ids)."""
        tables = (self.block_ids, *self.group_block_ids)
        return [block_id for table in tables for block_id in table[first_block:]]

    @property
    def token_ids(self) -> list[int]:
        num_known = self.num_tokens - len(self.draft_token_ids)
        known = self.request.all_token_ids[self.start_position : self.start_position + num_known]
        return known + self.draft_token_ids

    @property
    def is_verification(self) -> bool:
        return bool(self.draft_token_ids)

    @property
    def is_decode(self) -> bool:
        """Only the newest token, plus any drafts: no prompt token in it."""
        return self.num_tokens == 1 + len(self.draft_token_ids)

    @property
    def num_logits(self) -> int:
        """Rows of this chunk whose logits the step needs: one per draft plus the next token."""
        return 1 + len(self.draft_token_ids) if self.is_sampled else 0


@dataclass(frozen=True, slots=True)
class Drafts:
    """What a proposer guessed for one request's draft slots (fewer than the slots is fine)."""

    token_ids: list[int]
    probs: torch.Tensor | None = None  # [len(token_ids), vocab]; None: deterministic proposer


@dataclass
class SchedulerOutput:
    chunks: list[ScheduledChunk]  # batch order: single-token chunks first, then the rest
    preempted_request_ids: list[str] = field(default_factory=list)

    @property
    def total_num_tokens(self) -> int:
        return sum(chunk.num_tokens for chunk in self.chunks)

    @property
    def is_empty(self) -> bool:
        return not self.chunks

    @property
    def is_decode_only(self) -> bool:
        return all(chunk.is_decode for chunk in self.chunks)

    def with_drafts(self, drafts: dict[str, Drafts]) -> SchedulerOutput:
        """This output with `drafts` (req_id -> Drafts) in their chunks' slots, chunks ordered
        again: a chunk that got drafts is multi-token now, so it goes behind the decodes."""
        if not drafts:
            return self
        chunks = [_with_drafts(c, drafts.get(c.request.request_id)) for c in self.chunks]
        chunks.sort(key=lambda chunk: chunk.num_tokens != 1)
        return SchedulerOutput(chunks, list(self.preempted_request_ids))


def _with_drafts(chunk: ScheduledChunk, drafts: Drafts | None) -> ScheduledChunk:
    if drafts is None or not drafts.token_ids:
        return chunk
    assert not chunk.draft_token_ids, "drafts are attached once"
    assert len(drafts.token_ids) <= chunk.num_draft_slots, "more drafts than slots"
    return dataclasses.replace(
        chunk,
        num_tokens=chunk.num_tokens + len(drafts.token_ids),
        draft_token_ids=list(drafts.token_ids),
        draft_probs=drafts.probs,
    )


@dataclass
class ModelOutput:
    sampled_token_ids: dict[str, int]  # req_id -> token sampled this step
    logprobs: dict[str, TokenLogprobs] = field(default_factory=dict)  # req_id -> its logprobs
    # Verification chunks: req_id -> the accepted drafts followed by one token the target
    # chose (the bonus token, or the correction of the first rejected draft).
    verified_token_ids: dict[str, list[int]] = field(default_factory=dict)
    # req_id -> one TokenLogprobs per token of verified_token_ids
    verified_logprobs: dict[str, list[TokenLogprobs]] = field(default_factory=dict)
    # The runner's part of a verification: req_id -> its unsampled logits rows
    # [num_drafts + 1, vocab], which the speculator turns into verified_token_ids.
    verification_logits: dict[str, torch.Tensor] = field(default_factory=dict)


@dataclass
class RequestUpdate:
    """What one step did to one request, for the output processor."""

    request: Request
    new_token_ids: list[int]
    logprobs: list[TokenLogprobs]
    finished: bool


@dataclass(frozen=True)
class StepResult:
    """One forward pass: what it computed, what it sampled, and when (time.monotonic()).
    Observers see it after the forward and before `Scheduler.update`, so the blocks of
    requests that finish this step are still intact."""

    sched: SchedulerOutput
    model_out: ModelOutput
    start_time: float
    end_time: float

    @property
    def seconds(self) -> float:
        return self.end_time - self.start_time


class StepObserver(Protocol):
    def observe(self, step: StepResult) -> None:
        """Runs on the engine thread, inside the step: keep it cheap, and never change the
        step's data."""
