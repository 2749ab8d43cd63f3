"""Speculative decoding wired into the engine step: the policy, a proposer, and the glue.

sched = scheduler.schedule()                          # decoding requests get k draft slots
sched = sched.with_drafts(speculator.propose(sched))  # the proposer's guesses fill them
model_out = speculator.verify(sched, runner.execute(sched))  # one forward scores them all
scheduler.update(sched, model_out)                    # keeps the accepted run, rolls back
"""

from __future__ import annotations

from typing import Protocol

import torch

from splitserve.engine.config import EngineConfig, SpeculativeConfig
from splitserve.engine.model.llama import LlamaForCausalLM
from splitserve.engine.runner import CausalLM, ModelRunner
from splitserve.engine.sampler import compute_logprobs
from splitserve.engine.spec_decode.adaptive import SpeculationPolicy
from splitserve.engine.spec_decode.draft_model import (
    DraftModelProposer,
    EarlyExitModel,
    draft_kv_cache,
    load_draft_model,
)
from splitserve.engine.spec_decode.ngram import NgramProposer
from splitserve.engine.spec_decode.rejection import Verification, verify
from splitserve.engine.step import Drafts, ModelOutput, ScheduledChunk, SchedulerOutput, StepResult
from splitserve.engine.structured_output.matcher import NO_MASKS, StepMasks

# The j-th draft token is proposed only while alpha ** j reaches this. A draft model's tokens
# cost a draft forward each, n-gram ones nothing but their verification, hence the higher bar.
_MIN_MARGINAL_ACCEPTANCE = {"ngram": 0.2, "draft": 0.35, "self": 0.35}


class Proposer(Protocol):
    def propose(self, chunks: list[ScheduledChunk]) -> dict[str, Drafts]:
        """req_id -> at most `chunk.num_draft_slots` drafts for each chunk (fewer, or no entry,
        where it has no good guess). Leaves the chunks as they are."""


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
    """The proposer and the verification of what it proposed, around the target's runner
    (whose per-request generators and sampling rows the verification uses)."""

    def __init__(
        self, policy: SpeculationPolicy, proposer: Proposer, target_runner: ModelRunner
    ) -> None:
        self.policy = policy
        self.proposer = proposer
        self.target_runner = target_runner

    def propose(self, sched: SchedulerOutput) -> dict[str, Drafts]:
        """req_id -> drafts for the chunks the scheduler gave draft slots."""
        chunks = [chunk for chunk in sched.chunks if chunk.num_draft_slots]
        return self.proposer.propose(chunks) if chunks else {}

    def verify(
        self, sched: SchedulerOutput, model_out: ModelOutput, masks: StepMasks = NO_MASKS
    ) -> ModelOutput:
        """Fills `model_out.verified_token_ids` (and logprobs) from the target's logits of every
        verification chunk: rejection sampling, or greedy acceptance (shared/spec_decode), each
        position within what its grammar allows (`masks`)."""
        chunks = [chunk for chunk in sched.chunks if chunk.is_verification]
        if not chunks:
            return model_out
        logits = torch.cat([model_out.verification_logits[c.request.request_id] for c in chunks])
        batch = [self._verification(chunk, masks) for chunk in chunks]  # [sum(k_i + 1), vocab]
        start = 0
        for chunk, item, token_ids in zip(chunks, batch, verify(logits, batch)):
            request_id = chunk.request.request_id
            model_out.verified_token_ids[request_id] = token_ids
            if chunk.request.sampling_params.logprobs is not None:
                raw = logits[start : start + len(token_ids)]
                rows = item.rows[: len(token_ids)]
                entries = compute_logprobs(raw, rows, token_ids)
                # Every row is this request's, which asks for logprobs: none is None.
                logprobs = [entry for entry in entries if entry is not None]
                assert len(logprobs) == len(entries), "a verification row without logprobs"
                model_out.verified_logprobs[request_id] = logprobs
            start += len(item.rows)
        return model_out

    def observe(self, step: StepResult) -> None:
        """Feeds the policy's cost curve with decode-only steps (a step observer): a prefill
        chunk in the batch would price rows by attention over a whole prompt."""
        if step.sched.is_decode_only:
            self.policy.observe_step(step.sched.total_num_tokens, step.seconds)

    def _verification(self, chunk: ScheduledChunk, masks: StepMasks) -> Verification:
        runner, drafts, request = self.target_runner, chunk.draft_token_ids, chunk.request
        rows = [
            runner.sampling_row(request, drafts[:j], masks.allowed(request.request_id, j))
            for j in range(len(drafts) + 1)
        ]
        return Verification(drafts, chunk.draft_probs, rows, runner.generator(chunk.request))


def build_speculator(
    config: EngineConfig,
    policy: SpeculationPolicy,
    target_runner: ModelRunner[LlamaForCausalLM],
    max_model_len: int,
) -> Speculator:
    """The proposer `config.speculative.speculative_method` names, around the target."""
    spec = config.speculative
    block_size = config.cache.block_size
    if spec.speculative_method == "ngram":
        return Speculator(policy, NgramProposer(), target_runner)
    if spec.speculative_method == "self":
        assert spec.speculative_draft_layers is not None, "validated by SpeculativeConfig"
        model = EarlyExitModel(target_runner.model, spec.speculative_draft_layers)
        draft_runner: ModelRunner[CausalLM] = ModelRunner(
            model, target_runner.kv_cache, block_size, target_runner.eos_token_ids
        )
        return Speculator(
            policy, DraftModelProposer(draft_runner, target_runner, True), target_runner
        )
    assert spec.speculative_draft_model is not None, "validated by SpeculativeConfig"
    model = load_draft_model(
        spec.speculative_draft_model, config, target_runner.model, max_model_len
    )
    kv_cache = draft_kv_cache(model, target_runner.kv_cache, block_size)
    draft_runner = ModelRunner(model, kv_cache, block_size, target_runner.eos_token_ids)
    return Speculator(
        policy, DraftModelProposer(draft_runner, target_runner, False), target_runner
    )
