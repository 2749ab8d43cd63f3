"""Speculative decoding wired into the engine step: the policy, a proposer, and the glue.

sched = scheduler.schedule()        # decoding requests get k draft slots (policy)
speculator.propose(sched)           # the proposer fills them in
model_out = runner.execute(sched)   # one forward verifies every request's drafts
scheduler.update(sched, model_out)  # keeps the accepted run, rolls the rest back
"""

from __future__ import annotations

from typing import Protocol

from shared.config import EngineConfig, SpeculativeConfig
from shared.runner import ModelRunner
from shared.scheduler import ScheduledChunk, SchedulerOutput
from shared.spec_decode.adaptive import SpeculationPolicy
from shared.spec_decode.draft_model import (
    DraftModelProposer,
    EarlyExitModel,
    draft_kv_cache,
    load_draft_model,
)
from shared.spec_decode.ngram import NgramProposer

# The j-th draft token is proposed only while alpha ** j reaches this. A draft model's tokens
# cost a draft forward each, n-gram ones nothing but their verification, hence the higher bar.
_MIN_MARGINAL_ACCEPTANCE = {"ngram": 0.2, "draft": 0.35, "self": 0.35}


class Proposer(Protocol):
    def propose(self, chunks: list[ScheduledChunk]) -> None:
        """Attaches at most `chunk.num_draft_slots` drafts to each chunk (fewer, even none,
        where it has no good guess)."""

    def release(self, request_ids: list[str]) -> None:
        """Forgets finished requests."""


def build_policy(config: SpeculativeConfig) -> SpeculationPolicy | None:
    if not config.is_enabled:
        return None
    assert config.speculative_method is not None, "is_enabled checks it"
    return SpeculationPolicy(
        max_draft_tokens=config.num_speculative_tokens,
        max_batch_size=config.speculative_max_batch_size,
        adaptive=config.speculative_adaptive,
        min_marginal_acceptance=_MIN_MARGINAL_ACCEPTANCE[config.speculative_method],
    )


class Speculator:
    def __init__(self, policy: SpeculationPolicy, proposer: Proposer) -> None:
        self.policy = policy
        self.proposer = proposer

    def propose(self, sched: SchedulerOutput) -> None:
        chunks = [chunk for chunk in sched.chunks if chunk.num_draft_slots]
        if not chunks:
            return
        self.proposer.propose(chunks)
        # Verification chunks are multi-token now: behind the single-token decodes.
        sched.chunks.sort(key=lambda chunk: chunk.num_tokens != 1)

    def release(self, request_ids: list[str]) -> None:
        self.proposer.release(request_ids)


def build_speculator(
    config: EngineConfig,
    policy: SpeculationPolicy,
    target_runner: ModelRunner,
    max_model_len: int,
) -> Speculator:
    """The proposer `config.speculative.speculative_method` names, around the target."""
    spec = config.speculative
    block_size = config.cache.block_size
    if spec.speculative_method == "ngram":
        return Speculator(policy, NgramProposer())
    if spec.speculative_method == "self":
        assert spec.speculative_draft_layers is not None, "validated by SpeculativeConfig"
        model = EarlyExitModel(target_runner.model, spec.speculative_draft_layers)
        draft_runner = ModelRunner(
            model, target_runner.kv_cache, block_size, target_runner.eos_token_ids
        )  # type: ignore[arg-type]
        return Speculator(policy, DraftModelProposer(draft_runner, target_runner, True))
    assert spec.speculative_draft_model is not None, "validated by SpeculativeConfig"
    model = load_draft_model(
        spec.speculative_draft_model, config, target_runner.model, max_model_len
    )
    kv_cache = draft_kv_cache(model, target_runner.kv_cache, block_size)
    draft_runner = ModelRunner(model, kv_cache, block_size, target_runner.eos_token_ids)
    return Speculator(policy, DraftModelProposer(draft_runner, target_runner, False))
