"""Admission control's Prometheus series, in the gateway's registry:

- `splitserve:admission_total{outcome, reason}`: admitted ("now" or "queued") and refused (by
  reason: slo, saturated, queue_full, queue_timeout, slo_deadline);
- `splitserve:admission_queue_seconds`: time admitted requests waited in the queue;
- `splitserve:admission_queued_requests`: requests waiting now, and
  `splitserve:admission_rows_in_flight`: sequences admitted and not yet ended;
- `splitserve:admission_row_limit{pod}`: the rows each decode pod may run, steered by the
  token gaps its streams measure against the TPOT objective;
- `splitserve:admission_prediction_ratio{metric}`: measured over predicted TTFT and TPOT of
  admitted requests (1 is a perfect prediction; above 1, the prediction was short);
- `splitserve:slo_requests_total{result}`: finished requests with an SLO, met or missed; the
  rate of "met" is the gateway's goodput.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

_QUEUE_BUCKETS = (0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_RATIO_BUCKETS = (0.25, 0.5, 0.67, 0.8, 0.9, 1.0, 1.1, 1.25, 1.5, 2.0, 4.0)


class AdmissionMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.decisions = Counter(
            "splitserve:admission",
            "Admission decisions: outcome admitted (reason now or queued) or refused (by why).",
            ["outcome", "reason"],
            registry=registry,
        )
        self.queue_seconds = Histogram(
            "splitserve:admission_queue_seconds",
            "Seconds an admitted request waited in the gateway's queue.",
            buckets=_QUEUE_BUCKETS,
            registry=registry,
        )
        self.queued = Gauge(
            "splitserve:admission_queued_requests",
            "Requests waiting in the gateway's queue now.",
            registry=registry,
        )
        self.rows_in_flight = Gauge(
            "splitserve:admission_rows_in_flight",
            "Sequences this gateway admitted that have not ended yet.",
            registry=registry,
        )
        self.row_limit = Gauge(
            "splitserve:admission_row_limit",
            "Rows admission lets a decode pod run, as its measured token gaps steer it.",
            ["pod"],
            registry=registry,
        )
        self.prediction_ratio = Histogram(
            "splitserve:admission_prediction_ratio",
            "Measured over predicted TTFT and TPOT of admitted requests.",
            ["metric"],
            buckets=_RATIO_BUCKETS,
            registry=registry,
        )
        self.slo_requests = Counter(
            "splitserve:slo_requests",
            "Finished requests with an SLO, by whether they met it (goodput: rate of met).",
            ["result"],
            registry=registry,
        )

    def admitted(self, queued: bool) -> None:
        self.decisions.labels("admitted", "queued" if queued else "now").inc()

    def refused(self, reason: str) -> None:
        self.decisions.labels("refused", reason).inc()
