"""The gateway's Prometheus metrics (served at GET /metrics), and its route span.

The `splitserve_*` series are the gateway's view of whole requests (from dispatch, through
every pod). Routing has vLLM-style `splitserve:` names beside the pods' (services/common/
pod_metrics.py): `splitserve:routing_decisions_total` by reason and policy, and
`splitserve:routing_cached_prefix_tokens_total` over `splitserve:routing_prompt_tokens_total`,
the prefix-cache hit rate the router expected when it chose (the pods' own
`prefix_cache_hits_total` say what they found), and `splitserve:routing_retries_total`, the
sequences sent to another decode pod because theirs was unreachable before any output;
`splitserve:pod_refusals_total` by outcome, the sequences a decode pod refused because it was
overloaded (rerouted, or returned to the client as a 429).
`splitserve:migrations_total` by cause counts sequences moved after output began
(services/gateway/migration.py), and `splitserve:migration_latency_seconds` the time from the
break to the new pod's first response.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from splitserve.common import tracing
from splitserve.gateway.outputs import Usage
from splitserve.gateway.routing.pods import PodPool
from splitserve.gateway.routing.scoring import RoutingDecision

CONTENT_TYPE = CONTENT_TYPE_LATEST
# The gateway's own time: tenths of a millisecond when idle, tens when its CPU is saturated,
# seconds when admission control holds a request back.
_GATEWAY_BUCKETS = (
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.5, 1.0, 5.0, 30.0
)
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
        self.gateway_time = Histogram(
            "splitserve_gateway_time_seconds",
            "Of a generation request's time from arrival to its response's start, the "
            "gateway's own: all of it less the pods' (to the first output for a stream, the "
            "last otherwise; server_timing.py).",
            buckets=_GATEWAY_BUCKETS,
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
        # The pod series keep their older "worker" names: dashboards and alerts query them.
        self.pod_queued = Gauge(
            "splitserve_worker_requests",
            "Requests on a pod by state, from its latest stats.",
            ["role", "address", "state"],
            registry=self.registry,
        )
        self.pod_kv_usage = Gauge(
            "splitserve_worker_kv_cache_usage",
            "Fraction of a pod's KV blocks in use, from its latest stats.",
            ["role", "address"],
            registry=self.registry,
        )
        self.pod_up = Gauge(
            "splitserve_worker_up",
            "1 when the pod answered its latest stats poll.",
            ["role", "address"],
            registry=self.registry,
        )

        self.routing_decisions = Counter(
            "splitserve:routing_decisions",
            "Pod choices (one per sequence) by the reason the winner won, and the policy.",
            ["reason", "policy"],
            registry=self.registry,
        )
        self.routing_prompt_tokens = Counter(
            "splitserve:routing_prompt_tokens",
            "Prompt tokens of routed sequences.",
            registry=self.registry,
        )
        self.routing_cached_prefix_tokens = Counter(
            "splitserve:routing_cached_prefix_tokens",
            "Of those, tokens the index said the chosen pod had cached.",
            registry=self.registry,
        )
        self.routing_retries = Counter(
            "splitserve:routing_retries",
            "Sequences routed again, to another decode pod, because theirs could not be "
            "reached (UNAVAILABLE) before it streamed anything.",
            registry=self.registry,
        )
        self.pod_refusals = Counter(
            "splitserve:pod_refusals",
            "Sequences a decode pod refused (RESOURCE_EXHAUSTED: overloaded) before any "
            "output, by what followed: rerouted to another pod, or returned to the client "
            "(no other pod left, or retries spent).",
            ["outcome"],
            registry=self.registry,
        )
        self.migrations = Counter(
            "splitserve:migrations",
            "Sequences moved to another decode pod after output began, by why their stream "
            "broke (unavailable, reset, aborted, stalled, ended), or refused: the pod it had moved "
            "to was full.",
            ["cause"],
            registry=self.registry,
        )
        self.migration_latency = Histogram(
            "splitserve:migration_latency_seconds",
            "From a stream breaking to the first response of the pod it moved to.",
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )

    def observe_routing(self, decision: RoutingDecision, num_prompt_tokens: int) -> None:
        """Counts one routing decision (services/gateway/routing/scoring.py's `RoutingDecision`)."""
        policy = getattr(decision, "policy", "")
        self.routing_decisions.labels(decision.reason, policy).inc()
        self.routing_prompt_tokens.inc(num_prompt_tokens)
        self.routing_cached_prefix_tokens.inc(decision.cached_prefix_tokens)

    def observe_finished(self, seconds: float, usage: Usage) -> None:
        self.e2e_latency.observe(seconds)
        self.prompt_tokens.inc(usage.prompt_tokens)
        self.generation_tokens.inc(usage.completion_tokens)

    def render(self, pools: list[PodPool]) -> bytes:
        for pool in pools:
            self._update_pods(pool)
        return generate_latest(self.registry)

    def _update_pods(self, pool: PodPool) -> None:
        for pod in pool.pods:
            labels = (pool.role, pod.address)
            self.pod_up.labels(*labels).set(1 if pod.stats is not None else 0)
            if pod.stats is None:
                continue
            load = pod.load
            self.pod_queued.labels(*labels, "running").set(load.num_running)
            self.pod_queued.labels(*labels, "waiting").set(load.num_waiting)
            self.pod_kv_usage.labels(*labels).set(load.kv_usage)


# ---- the route span ---------------------------------------------------------------------------


# One sequence's routing decision, with its prompt's length in tokens.
RoutedSequence = tuple[RoutingDecision, int]


@contextmanager
def route_span(metrics: GatewayMetrics) -> Iterator[Callable[[list[RoutedSequence]], None]]:
    """`with route_span(metrics) as observe: ... observe(routed)`: a `gateway.route` span (child
    of the current span, never current itself, so the decode calls started in there are the
    request's children, beside it) around choosing the pods; `observe` counts each sequence's
    decision and puts them on the span."""
    start_time = time.monotonic()
    span = tracing.start_span("gateway.route", None, start_time=start_time)

    def observe(routed: list[RoutedSequence]) -> None:
        for decision, num_prompt_tokens in routed:
            metrics.observe_routing(decision, num_prompt_tokens)
        if span.is_recording():
            _annotate_route(span, [decision for decision, _ in routed])

    with tracing.span_scope(span):
        yield observe


def _annotate_route(span: tracing.Span, decisions: list[RoutingDecision]) -> None:
    """One attribute list per RoutingDecision field (one entry per sequence), and an event per
    decision with every candidate's score. The `*_worker_ids` attributes keep their older
    names, which trace queries use."""
    span.set_attribute("splitserve.route.decode_worker_ids", [d.decode_pod_id for d in decisions])
    span.set_attribute("splitserve.route.decode_addresses", [d.decode_address for d in decisions])
    span.set_attribute(
        "splitserve.route.prefill_worker_ids", [d.prefill_pod_id or "" for d in decisions]
    )
    span.set_attribute(
        "splitserve.route.prefill_addresses", [d.prefill_address or "" for d in decisions]
    )
    span.set_attribute("splitserve.route.reasons", [d.reason for d in decisions])
    span.set_attribute(
        "splitserve.route.cached_prefix_tokens", [d.cached_prefix_tokens for d in decisions]
    )
    for decision in decisions:
        scores = {f"score.{pod_id}": value for pod_id, value in decision.scores.items()}
        span.add_event("routing_decision", {"reason": decision.reason, **scores})
