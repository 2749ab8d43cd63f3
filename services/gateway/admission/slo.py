"""A request's service-level objective: time to first token and time per output token, each
optional. Where it comes from, the first that sets a field wins:

    x-slo-ttft-ms / x-slo-tpot-ms headers (gRPC metadata of the same names)
      ─▶ the tenant's entry in the key file (slo_ttft_ms / slo_tpot_ms)
      ─▶ the gateway's --slo-ttft-ms / --slo-tpot-ms

A request whose `priority` is at or past --batch-priority is batch work: no SLO binds it, so it
is never refused on a prediction, only queued (vLLM's convention: a lower priority value is
served first)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from splitserve.gateway.errors import RequestError

TTFT_HEADER = "x-slo-ttft-ms"
TPOT_HEADER = "x-slo-tpot-ms"
# An SLO beyond a day is a typo, not an objective.
_MAX_SLO_MS = 86_400_000.0


@dataclass(frozen=True)
class Slo:
    """Milliseconds; None: that half of the objective does not bind."""

    ttft_ms: float | None = None
    tpot_ms: float | None = None

    @property
    def binds(self) -> bool:
        return self.ttft_ms is not None or self.tpot_ms is not None

    def over(self, fallback: Slo) -> Slo:
        """This SLO, its unset fields taken from `fallback`."""
        return Slo(
            self.ttft_ms if self.ttft_ms is not None else fallback.ttft_ms,
            self.tpot_ms if self.tpot_ms is not None else fallback.tpot_ms,
        )

    def is_met(self, ttft_ms: float, tpot_ms: float | None) -> bool:
        """Whether measured figures meet it (`tpot_ms` None: one token, no gap to measure)."""
        if self.ttft_ms is not None and ttft_ms > self.ttft_ms:
            return False
        return self.tpot_ms is None or tpot_ms is None or tpot_ms <= self.tpot_ms


def slo_milliseconds(name: str, value: object) -> float:
    """A positive, finite number of milliseconds; ValueError naming `name` otherwise."""
    problem = f"{name} must be a positive number of milliseconds up to {_MAX_SLO_MS:g}"
    if isinstance(value, bool) or not isinstance(value, int | float | str):
        raise ValueError(f"{problem}, got {value!r}")
    try:
        number = float(value)
    except ValueError:
        raise ValueError(f"{problem}, got {value!r}") from None
    if not (math.isfinite(number) and 0 < number <= _MAX_SLO_MS):
        raise ValueError(f"{problem}, got {value!r}")
    return number


def requested_slo(headers: Mapping[str, str]) -> Slo:
    """The SLO a request's headers ask for (keys lower-case); a bad value is a 400 naming the
    header."""
    fields: list[float | None] = []
    for header in (TTFT_HEADER, TPOT_HEADER):
        text = headers.get(header)
        if text is None:
            fields.append(None)
            continue
        try:
            fields.append(slo_milliseconds(header, text.strip()))
        except ValueError as error:
            raise RequestError(str(error), header) from None
    return Slo(*fields)
