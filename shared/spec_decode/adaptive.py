"""How many draft tokens each request verifies: per-request adaptive k and the batch switch.

Each request keeps a moving estimate of alpha, the chance that its next draft token is
accepted given the ones before it were. k drafts are then expected to yield
1 + alpha + ... + alpha ** k tokens. What they cost comes from the measured step-cost curve
(`StepCostModel`): a step planned with R rows expecting T tokens takes, per request in turn,
the k that maximises (T + alpha + ... + alpha ** k) / cost(R + k), i.e. tokens per second of
the whole step. So k shrinks as alpha falls or as extra rows get dear, and a big batch, whose
forward is already compute-bound, gives every request k = 0 on its own.

When k = 0 wins, the request pauses speculation and later probes with k = 1, waiting twice as
long after each probe that fails, so a request whose text turns repetitive wins speculation
back while one that never does costs almost nothing.

The batch switch (`max_batch_size`) remains as a hard cap on the decoding requests a
speculating step may have.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from splitserve.engine.request import Request
from splitserve.engine.spec_decode.step_cost import StepCostModel

# Weight of the past in the moving acceptance estimate, per verification.
_DECAY = 0.8
# The engine-wide estimate a new request starts from: slower, since it pools every request.
_POOLED_DECAY = 0.98
# How many judged draft tokens that starting estimate counts for: a request's own first
# verifications soon outweigh it.
_PRIOR_WEIGHT = 2.0
# Steps a request sits out after its acceptance fell too low, before it probes with k = 1;
# doubled after every failed probe up to the maximum.
_PAUSE_STEPS = 8
_MAX_PAUSE_STEPS = 128


@dataclass(slots=True)
class AcceptanceState:
    """Decayed counts over a request's recent verifications (lives on `Request.spec_state`)."""

    num_accepted: float = 0.0  # draft tokens accepted
    num_judged: float = 0.0  # draft tokens the verifier looked at (accepted + first rejected)
    num_paused_steps: int = 0  # steps since speculation paused; 0 = not paused
    pause_length: int = _PAUSE_STEPS  # steps the current pause lasts
    is_probing: bool = False  # the latest k came from a probe after a pause

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


@dataclass(slots=True)
class StepPlan:
    """One step's verification rows as the scheduler hands out draft slots, request by request."""

    num_rows: int  # one per decoding request plus every draft slot granted so far
    expected_tokens: float  # what those rows are expected to yield


def expected_accepted(alpha: float, k: int) -> float:
    """alpha + alpha ** 2 + ... + alpha ** k: the drafts expected to survive verification."""
    return sum(alpha**j for j in range(1, k + 1))


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
        self.step_costs = StepCostModel()
        # Every request's verifications pooled: a new request starts from it, so on a
        # workload where drafts keep failing, fresh requests do not open with k = max.
        self.pooled = AcceptanceState()

    def is_active(self, num_decoding: int) -> bool:
        """The batch switch: whether this step speculates at all."""
        return num_decoding <= self.max_batch_size

    def plan_step(self, num_decoding: int) -> StepPlan:
        """The plan a step starts from: every decoding request is one row and one token."""
        return StepPlan(num_rows=num_decoding, expected_tokens=float(num_decoding))

    def observe_step(self, num_rows: int, seconds: float) -> None:
        """A decode-only forward of `num_rows` rows took `seconds` (verification included)."""
        self.step_costs.observe(num_rows, seconds)

    def num_draft_tokens(
        self, request: Request, plan: StepPlan | None = None, limit: int | None = None
    ) -> int:
        """k for this request this step (0 = plain decode, at most `limit`); advances its pause
        counter and, when a plan is given, adds the granted rows to it."""
        if self.adaptive and request.spec_state is None:
            request.spec_state = self._starting_state()
        state = request.spec_state
        if not self.adaptive:
            k = self.max_draft_tokens
            alpha = 1.0
        else:
            assert isinstance(state, AcceptanceState), "spec_state belongs to this policy"
            alpha = state.acceptance_rate
            k = self._adaptive_k(state, plan)
        if limit is not None:
            k = min(k, limit)
        if plan is not None:
            plan.num_rows += k
            plan.expected_tokens += expected_accepted(alpha, k)
        return k

    def _starting_state(self) -> AcceptanceState:
        alpha = self.pooled.acceptance_rate
        return AcceptanceState(num_accepted=_PRIOR_WEIGHT * alpha, num_judged=_PRIOR_WEIGHT)

    def _adaptive_k(self, state: AcceptanceState, plan: StepPlan | None) -> int:
        if state.num_paused_steps:
            state.num_paused_steps += 1
            if state.num_paused_steps <= state.pause_length:
                return 0
            state.num_paused_steps = 0
            state.is_probing = True
            return 1
        alpha = state.acceptance_rate
        if plan is None:
            k = self._worthwhile_k(alpha)
        else:
            k = min(self._worthwhile_k(alpha), self._cheapest_k(alpha, plan))
        if k == 0:
            if state.is_probing:
                state.pause_length = min(2 * state.pause_length, _MAX_PAUSE_STEPS)
            state.num_paused_steps = 1
        else:
            state.pause_length = _PAUSE_STEPS
        state.is_probing = False
        return k

    def _cheapest_k(self, alpha: float, plan: StepPlan) -> int:
        """The k with the most expected tokens per second of the whole step."""
        costs = self.step_costs
        best_k, best_rate = 0, plan.expected_tokens / costs.cost(plan.num_rows)
        for k in range(1, self.max_draft_tokens + 1):
            tokens = plan.expected_tokens + expected_accepted(alpha, k)
            rate = tokens / costs.cost(plan.num_rows + k)
            if rate > best_rate:
                best_k, best_rate = k, rate
        return best_k

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
            request.spec_state = self._starting_state()
        state = request.spec_state
        assert isinstance(state, AcceptanceState), "spec_state belongs to this policy"
        num_judged = min(num_accepted + 1, num_proposed)
        state.num_accepted = _DECAY * state.num_accepted + num_accepted
        state.num_judged = _DECAY * state.num_judged + num_judged
        pooled = self.pooled
        pooled.num_accepted = _POOLED_DECAY * pooled.num_accepted + num_accepted
        pooled.num_judged = _POOLED_DECAY * pooled.num_judged + num_judged
