"""How many draft tokens each request verifies: per-request adaptive k and the batch switch.

Each request keeps a moving estimate of alpha, the chance that its next draft token is
accepted given the ones before it were. The j-th draft token is only worth verifying when it
is likely to survive (alpha ** j >= the policy's threshold), so k shrinks as alpha falls; when
even one token is not worth it, the request stops speculating for a few steps and then probes
with k = 1, so a request whose text turns repetitive later wins speculation back.

The batch switch: a step with more decoding requests than `max_batch_size` speculates for
nobody. On a busy batch the forward is already compute-bound, so the extra verification
tokens cost about as much as the tokens they save.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from shared.request import Request

# Weight of the past in the moving acceptance estimate, per verification.
_DECAY = 0.8
# Steps a request sits out after its acceptance fell too low, before it probes with k = 1.
_PAUSE_STEPS = 8


@dataclass(slots=True)
class AcceptanceState:
    """Decayed counts over a request's recent verifications (lives on `Request.spec_state`)."""

    num_accepted: float = 0.0  # draft tokens accepted
    num_judged: float = 0.0  # draft tokens the verifier looked at (accepted + first rejected)
    num_paused_steps: int = 0  # steps since speculation paused; 0 = not paused

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted / self.num_judged if self.num_judged else 1.0


@dataclass(slots=True)
class SpeculationStats:
    """Cumulative since the engine started."""

    num_proposed_tokens: int = 0
    num_accepted_tokens: int = 0
    num_verify_steps: int = 0  # one per request per verification pass

    @property
    def acceptance_rate(self) -> float:
        return (
            self.num_accepted_tokens / self.num_proposed_tokens if self.num_proposed_tokens else 0.0
        )

    @property
    def mean_accepted_length(self) -> float:
        """Draft tokens accepted per verification (the bonus token not counted)."""
        return self.num_accepted_tokens / self.num_verify_steps if self.num_verify_steps else 0.0


class SpeculationPolicy:
    """Decides k per request and step; records what verification accepted. Engine-thread only."""

    def __init__(
        self,
        max_draft_tokens: int,
        max_batch_size: int,
        adaptive: bool = True,
        min_marginal_acceptance: float = 0.2,
    ) -> None:
        assert 0.0 < min_marginal_acceptance < 1.0, "the threshold is a probability"
        self.max_draft_tokens = max_draft_tokens
        self.max_batch_size = max_batch_size
        self.adaptive = adaptive
        self.min_marginal_acceptance = min_marginal_acceptance
        self.stats = SpeculationStats()

    def is_active(self, num_decoding: int) -> bool:
        """The batch switch: whether this step speculates at all."""
        return num_decoding <= self.max_batch_size

    def num_draft_tokens(self, request: Request) -> int:
        """k for this request this step (0 = plain decode); advances its pause counter."""
        state = request.spec_state
        if not self.adaptive or state is None:
            return self.max_draft_tokens
        assert isinstance(state, AcceptanceState), "spec_state belongs to this policy"
        if state.num_paused_steps:
            state.num_paused_steps += 1
            if state.num_paused_steps <= _PAUSE_STEPS:
                return 0
            state.num_paused_steps = 0
            return 1  # the probe
        k = self._worthwhile_k(state.acceptance_rate)
        if k == 0:
            state.num_paused_steps = 1
        return k

    def _worthwhile_k(self, alpha: float) -> int:
        if alpha >= 1.0:
            return self.max_draft_tokens
        if alpha <= 0.0:
            return 0
        # The largest j with alpha ** j >= threshold.
        k = math.floor(math.log(self.min_marginal_acceptance) / math.log(alpha) + 1e-9)
        return max(0, min(self.max_draft_tokens, k))

    def record(self, request: Request, num_proposed: int, num_accepted: int) -> None:
        """One verification of `num_proposed` draft tokens of which the first `num_accepted`
        were accepted."""
        assert 0 <= num_accepted <= num_proposed, f"{num_accepted} of {num_proposed} accepted"
        self.stats.num_proposed_tokens += num_proposed
        self.stats.num_accepted_tokens += num_accepted
        self.stats.num_verify_steps += 1
        if request.spec_state is None:
            request.spec_state = AcceptanceState()
        state = request.spec_state
        assert isinstance(state, AcceptanceState), "spec_state belongs to this policy"
        num_judged = min(num_accepted + 1, num_proposed)
        state.num_accepted = _DECAY * state.num_accepted + num_accepted
        state.num_judged = _DECAY * state.num_judged + num_judged
