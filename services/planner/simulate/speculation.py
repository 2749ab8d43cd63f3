"""Speculative decoding in the simulator: how many tokens a verified decode row yields.

A decode row with speculation verifies `k` draft tokens in one forward of `k + 1` rows (the
step costs what a decode step of that many rows costs, by the profile's grid). Drafts are
accepted one after another while each is right, with probability `acceptance_rate` each (what
the pods' `spec_decode` acceptance metric reports per workload), and the verification always
adds one token of its own: a row yields `1 + accepted` tokens, on average
`(1 - a^(k+1)) / (1 - a)`. The drafts themselves are taken as free (the n-gram proposer's case;
a draft model's steps are not simulated).
"""

from __future__ import annotations

import random
from dataclasses import dataclass


@dataclass(frozen=True)
class SpeculationModel:
    num_speculative_tokens: int
    acceptance_rate: float  # per draft token, 0..1

    def __post_init__(self) -> None:
        if self.num_speculative_tokens < 1:
            raise ValueError(
                f"num_speculative_tokens must be >= 1, got {self.num_speculative_tokens}"
            )
        if not 0 <= self.acceptance_rate <= 1:
            raise ValueError(f"acceptance_rate must be in [0, 1], got {self.acceptance_rate}")

    @property
    def expected_tokens_per_row(self) -> float:
        a, k = self.acceptance_rate, self.num_speculative_tokens
        if a == 1:
            return k + 1.0
        return (1 - a ** (k + 1)) / (1 - a)

    def draw_accepted(self, rng: random.Random, num_drafts: int) -> int:
        """Drafts accepted out of `num_drafts`: the run of successes before the first miss."""
        accepted = 0
        while accepted < num_drafts and rng.random() < self.acceptance_rate:
            accepted += 1
        return accepted
