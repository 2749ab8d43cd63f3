"""What a simulation adds up to: TTFT and ITL percentiles, throughput, goodput and pod
utilization, with the `Slo` and `Percentiles` of a measured run (services/loadgen/stats.py), so
simulated and measured figures mean the same."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from splitserve.loadgen.stats import Percentiles, Slo
from splitserve.loadgen.workload import SimRequest

if TYPE_CHECKING:
    from splitserve.planner.simulate.pod import SimPod


@dataclass
class RequestRecord:
    request: SimRequest
    ttft_s: float | None = None
    itls_s: list[float] = field(default_factory=list)  # gaps between successive tokens
    finish_s: float | None = None
    is_dropped: bool = False  # ended for capacity before all its tokens
    transfer_s: float = 0.0  # its KV pages' time between a prefill pod and its decode pod
    num_moves: int = 0  # to another decode pod after its own died
    is_refused: bool = False  # by the gateway's admission, on arrival

    @property
    def is_finished(self) -> bool:
        return self.finish_s is not None and not self.is_dropped

    @property
    def mean_itl_s(self) -> float:
        return sum(self.itls_s) / len(self.itls_s) if self.itls_s else 0.0

    def meets(self, slo: Slo) -> bool:
        return self.is_finished and slo.is_met(self.ttft_s, self.mean_itl_s)


@dataclass(frozen=True)
class SimResult:
    num_requests: int
    num_finished: int
    duration_s: float  # first arrival to last finish
    ttft: Percentiles
    itl: Percentiles  # every token gap of every finished request, pooled
    request_throughput: float  # finished requests / s
    output_throughput: float  # output tokens of finished requests / s
    goodput: float  # requests meeting both SLOs / s
    attainment: float  # fraction of all requests meeting both SLOs
    num_preemptions: int
    utilization: dict[str, float]  # role -> busy fraction of its pods, averaged
    # Per finished request: its own mean ITL (what the ITL SLO bounds), and its KV transfer.
    mean_itl: Percentiles = field(default_factory=lambda: Percentiles.of([]))
    transfer: Percentiles = field(default_factory=lambda: Percentiles.of([]))
    peak_kv_usage: float = 0.0  # the fullest any pod's KV cache got, 0..1
    num_moved: int = 0  # requests moved off a dead decode pod
    # Prompt tokens served from each cache tier ("device", "host", "disk"), all pods.
    cached_tokens_by_tier: dict[str, int] = field(default_factory=dict)
    num_refused: int = 0  # by the gateway's admission (they count as missing the SLOs)


def summarize(records: list[RequestRecord], slo: Slo, pods: list[SimPod]) -> SimResult:
    finished = [record for record in records if record.is_finished]
    start = min((record.request.arrival_s for record in records), default=0.0)
    end = max(
        (record.finish_s for record in finished if record.finish_s is not None), default=start
    )
    duration = max(end - start, 1e-9)
    num_good = sum(record.meets(slo) for record in records)
    return SimResult(
        num_requests=len(records),
        num_finished=len(finished),
        duration_s=duration,
        ttft=Percentiles.of([r.ttft_s for r in finished if r.ttft_s is not None]),
        itl=Percentiles.of(_pooled_gaps_s(finished)),
        request_throughput=len(finished) / duration,
        output_throughput=sum(r.request.output_len for r in finished) / duration,
        goodput=num_good / duration,
        attainment=num_good / max(len(records), 1),
        num_preemptions=sum(pod.num_preemptions for pod in pods),
        utilization=_utilization(pods, duration),
        mean_itl=Percentiles.of([r.mean_itl_s for r in finished if r.itls_s]),
        transfer=Percentiles.of([r.transfer_s for r in finished]),
        peak_kv_usage=max((pod.peak_kv_usage for pod in pods), default=0.0),
        num_moved=sum(record.num_moves > 0 for record in records),
        cached_tokens_by_tier=_cached_tokens_by_tier(pods),
        num_refused=sum(record.is_refused for record in records),
    )


def _pooled_gaps_s(finished: list[RequestRecord]) -> np.ndarray:
    """Every finished request's token gaps in one array: millions at a 10-minute trace, read
    by numpy straight from the lists rather than through a list of them all first."""
    count = sum(len(record.itls_s) for record in finished)
    gaps = itertools.chain.from_iterable(record.itls_s for record in finished)
    return np.fromiter(gaps, dtype=np.float64, count=count)


def _cached_tokens_by_tier(pods: list[SimPod]) -> dict[str, int]:
    totals: dict[str, int] = {}
    for pod in pods:
        for tier, tokens in pod.cache.hit_tokens.items():
            totals[tier] = totals.get(tier, 0) + tokens
    return totals


def _utilization(pods: list[SimPod], duration_s: float) -> dict[str, float]:
    by_role: dict[str, list[float]] = {}
    for pod in pods:
        role = pod.name.rsplit("-", 1)[0]
        by_role.setdefault(role, []).append(min(pod.busy_s / duration_s, 1.0))
    return {role: sum(values) / len(values) for role, values in by_role.items()}
