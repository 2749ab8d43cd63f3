"""What one run's per-request timings add up to: latency percentiles, throughput, goodput."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from benchmarks.serving.loadgen import RunResult


@dataclass(frozen=True)
class Slo:
    """A request is good when both hold (and it finished)."""

    ttft_s: float
    mean_itl_s: float  # the request's own mean inter-token latency (TPOT)

    def __post_init__(self) -> None:
        if self.ttft_s <= 0 or self.mean_itl_s <= 0:
            raise ValueError(f"SLO bounds must be > 0, got {self.ttft_s}, {self.mean_itl_s}")

    def __str__(self) -> str:
        return f"TTFT <= {self.ttft_s * 1e3:.0f} ms, mean ITL <= {self.mean_itl_s * 1e3:.0f} ms"


@dataclass(frozen=True)
class Percentiles:
    p50: float
    p90: float
    p99: float

    @classmethod
    def of(cls, samples: list[float]) -> Percentiles:
        if not samples:
            return cls(float("nan"), float("nan"), float("nan"))
        p50, p90, p99 = np.percentile(samples, [50, 90, 99])
        return cls(float(p50), float(p90), float(p99))


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
    good = [
        result
        for result in ok
        if result.ttft_s is not None
        and result.ttft_s <= slo.ttft_s
        and (result.mean_itl_s or 0.0) <= slo.mean_itl_s
    ]
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
        goodput=len(good) / duration,
        num_good=len(good),
        first_error=errors[0] if errors else "",
    )
