"""How much each tenant asked for lately, as counts of asks that fade with a half-life: whether
a tenant asks for more than its weighted share of what all the active tenants ask.

Rows in flight alone do not tell a flood from a quiet tenant once admission refuses most of
the flood: a refused request leaves no backlog and no row, so the flood's admitted requests
were each within its share of the rows and went to the pods as favoured, level with the
quiet tenant's (26 of a 10x flood's 40 admitted requests, 2026-12-03, an EPYC). Its asks say
what it wants: ten times the quiet tenant's.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

# Long enough to hold a quiet tenant's few asks between bursts, short enough that a tenant
# that stops flooding is favoured again within a few of them.
ASK_HALF_LIFE_S = 10.0
# A tenant exceeds its share when it asked for more than this multiple of it: two tenants
# asking alike, each a few times within a half-life, stay alike whichever asked last (its
# ask has faded least). Tenants asking once in many seconds may differ by more than this
# just after each ask; with nobody flooding, favour matters little.
DEMAND_SLACK = 1.25


@dataclass
class _FadingCount:
    value: float = 0.0
    at: float = 0.0

    def now(self, now: float, half_life_s: float) -> float:
        return self.value * 0.5 ** (max(0.0, now - self.at) / half_life_s)


class AskDemand:
    """Per tenant, its asks counted with a half-life of `half_life_s` seconds."""

    def __init__(self, half_life_s: float = ASK_HALF_LIFE_S) -> None:
        self.half_life_s = half_life_s
        self._counts: dict[str, _FadingCount] = {}

    def note(self, tenant: str, now: float, num_sequences: int = 1) -> None:
        """An ask for `num_sequences` rows (n > 1 asks for as much as that many requests)."""
        count = self._counts.setdefault(tenant, _FadingCount(at=now))
        count.value = count.now(now, self.half_life_s) + num_sequences
        count.at = now

    def asked(self, tenant: str, now: float) -> float:
        count = self._counts.get(tenant)
        return 0.0 if count is None else count.now(now, self.half_life_s)

    def exceeds_share(
        self,
        tenant: str,
        others: Iterable[str],
        weight_of: Callable[[str], float],
        now: float,
    ) -> bool:
        """Whether `tenant` asked for more than its weighted share of what it and `others`
        asked lately (by more than DEMAND_SLACK)."""
        tenants = [tenant, *others]
        total_asked = sum(self.asked(t, now) for t in tenants)
        total_weight = sum(weight_of(t) for t in tenants)
        if total_asked <= 0 or total_weight <= 0:
            return False
        share = total_asked * weight_of(tenant) / total_weight
        return self.asked(tenant, now) > DEMAND_SLACK * share
