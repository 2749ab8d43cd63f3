"""What a run's per-request timings add up to: latency percentiles, throughput, and goodput, the
requests per second that met both SLOs (TTFT within its bound and the request's own mean
inter-token latency within its bound). The planner's simulator reports its runs with the same
`Slo` and `Percentiles` (services/planner/simulate/results.py)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:  # the simulator's figures need no HTTP client
    from splitserve.loadgen.client import RunResult


@dataclass(frozen=True)
class Slo:
    """A request is good when both hold (and it finished)."""

    ttft_s: float
    itl_s: float  # bound on each request's own mean inter-token latency (TPOT)

    def __post_init__(self) -> None:
        if self.ttft_s <= 0 or self.itl_s <= 0:
            raise ValueError(f"SLOs must be > 0 seconds, got TTFT {self.ttft_s}, ITL {self.itl_s}")

    def is_met(self, ttft_s: float | None, mean_itl_s: float) -> bool:
        """By a finished request's TTFT and mean ITL (0 when it had one token)."""
        return ttft_s is not None and ttft_s <= self.ttft_s and mean_itl_s <= self.itl_s

    def __str__(self) -> str:
        return f"TTFT <= {self.ttft_s * 1e3:.0f} ms, mean ITL <= {self.itl_s * 1e3:.0f} ms"


@dataclass(frozen=True)
class Percentiles:
    p50: float
    p90: float
    p99: float
    mean: float

    @classmethod
    def of(cls, samples: list[float] | np.ndarray) -> Percentiles:
        """NaN for each figure when there are no samples."""
        if len(samples) == 0:
            nan = float("nan")
            return cls(nan, nan, nan, nan)
        values = np.asarray(samples, dtype=np.float64)  # converted once, not per figure
        p50, p90, p99 = np.percentile(values, [50, 90, 99])
        return cls(float(p50), float(p90), float(p99), float(np.mean(values)))


@dataclass(frozen=True)
class Summary:
    num_requests: int
    num_ok: int
    duration_s: float
    ttft: Percentiles  # over finished requests
    itl: Percentiles  # over every token gap of every finished request, pooled
    request_throughput: float  # finished requests / s
    output_throughput: float  # output tokens of finished requests / s
    goodput: float  # finished requests meeting the SLO / s
    num_good: int
    first_error: str  # "" when every request finished

    @property
    def num_failed(self) -> int:
        return self.num_requests - self.num_ok


def summarize(run: RunResult, slo: Slo) -> Summary:
    ok = [result for result in run.results if result.ok]
    num_good = sum(slo.is_met(result.ttft_s, result.mean_itl_s) for result in ok)
    errors = [result.error for result in run.results if result.error]
    duration = max(run.duration_s, 1e-9)
    return Summary(
        num_requests=len(run.results),
        num_ok=len(ok),
        duration_s=run.duration_s,
        ttft=Percentiles.of([r.ttft_s for r in ok if r.ttft_s is not None]),
        itl=Percentiles.of([gap for r in ok for gap in r.itls_s]),
        request_throughput=len(ok) / duration,
        output_throughput=sum(r.num_output_tokens for r in ok) / duration,
        goodput=num_good / duration,
        num_good=num_good,
        first_error=errors[0] if errors else "",
    )
