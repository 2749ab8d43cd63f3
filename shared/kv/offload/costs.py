"""What a cached block in a lower tier is worth: the measured cost of loading it against the
measured cost of computing its tokens again. The pod publishes both; the gateway's router
credits a prompt's blocks by tier from them (services/gateway/routing/tier_credit.py).

Both are exponentially weighted averages: the recent past is what a routing decision is about
(loads slow down when the disk is busy; prefill speeds up when the pod is idle).
"""

from __future__ import annotations

from dataclasses import dataclass

from splitserve.engine.kv.tiers import Tier
from splitserve.engine.step import StepResult

# Weight of the newest sample: about the last 10 loads (or steps) count.
_SMOOTHING = 0.2
# A step computes prompts (not only decodes) when it runs at least this many tokens; only such
# steps say what recomputing a prefix costs per token.
_MIN_PREFILL_TOKENS = 32


@dataclass
class Ewma:
    value: float = 0.0  # 0.0 until the first sample

    def add(self, sample: float) -> None:
        self.value = sample if not self.value else self.value + _SMOOTHING * (sample - self.value)


class TierCosts:
    """A step observer (the prefill side) fed by the offloader (the load side)."""

    def __init__(self) -> None:
        self.prefill_s_per_token = Ewma()
        self.load_s_per_block = {Tier.HOST: Ewma(), Tier.DISK: Ewma()}

    def observe(self, step: StepResult) -> None:
        num_tokens = step.sched.total_num_tokens
        if num_tokens >= _MIN_PREFILL_TOKENS:
            self.prefill_s_per_token.add(step.seconds / num_tokens)

    def record_load(self, tier: Tier, seconds: float, num_blocks: int) -> None:
        """A load of `num_blocks` whose slowest tier was `tier` took `seconds`."""
        if num_blocks:
            self.load_s_per_block[tier].add(seconds / num_blocks)
