"""The gateway's Prometheus metrics (served at GET /metrics)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

if TYPE_CHECKING:
    from services.gateway.generation import Usage
    from services.gateway.workers import WorkerPool

CONTENT_TYPE = CONTENT_TYPE_LATEST
# Seconds; CPU serving of a small model spans milliseconds to tens of seconds.
_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


class GatewayMetrics:
    """Owns its registry, so several gateways in one process (tests) never collide."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "splitserve_requests",
            "Requests by endpoint and response status (HTTP code, or gRPC status name).",
            ["endpoint", "status"],
            registry=self.registry,
        )
        self.time_to_first_token = Histogram(
            "splitserve_time_to_first_token_seconds",
            "From dispatch to the first generated token of a request.",
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.e2e_latency = Histogram(
            "splitserve_e2e_request_latency_seconds",
            "From dispatch to the last token of a request's last sequence.",
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.prompt_tokens = Counter(
            "splitserve_prompt_tokens",
            "Prompt tokens of finished requests.",
            registry=self.registry,
        )
        self.generation_tokens = Counter(
            "splitserve_generation_tokens",
            "Generated tokens of finished requests.",
            registry=self.registry,
        )
        self.worker_queued = Gauge(
            "splitserve_worker_requests",
            "Requests on a worker pod by state, from its latest stats.",
            ["role", "address", "state"],
            registry=self.registry,
        )
        self.worker_kv_usage = Gauge(
            "splitserve_worker_kv_cache_usage",
            "Fraction of a worker pod's KV blocks in use, from its latest stats.",
            ["role", "address"],
            registry=self.registry,
        )
        self.worker_up = Gauge(
            "splitserve_worker_up",
            "1 when the worker pod answered its latest stats poll.",
            ["role", "address"],
            registry=self.registry,
        )

    def observe_finished(self, seconds: float, usage: Usage) -> None:
        self.e2e_latency.observe(seconds)
        self.prompt_tokens.inc(usage.prompt_tokens)
        self.generation_tokens.inc(usage.completion_tokens)

    def render(self, pools: list[WorkerPool]) -> bytes:
        for pool in pools:
            self._update_workers(pool)
        return generate_latest(self.registry)

    def _update_workers(self, pool: WorkerPool) -> None:
        for worker in pool.workers:
            labels = (pool.role, worker.address)
            self.worker_up.labels(*labels).set(1 if worker.stats is not None else 0)
            if worker.stats is None:
                continue
            stats = worker.stats
            self.worker_queued.labels(*labels, "running").set(stats.num_running)
            self.worker_queued.labels(*labels, "waiting").set(stats.num_waiting)
            used = 1.0 - stats.kv_blocks_free / max(stats.kv_blocks_total, 1)
            self.worker_kv_usage.labels(*labels).set(used)
