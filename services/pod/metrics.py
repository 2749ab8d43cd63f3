"""Prometheus metrics of the engine pods (prefill and decode), served as text at
http://<host>:<--metrics-port>/metrics (0, the default, serves nothing).

Names follow vLLM's under our prefix, so a vLLM dashboard maps by replacing `vllm:` with
`splitserve:`: `time_to_first_token_seconds`, `inter_token_latency_seconds`,
`e2e_request_latency_seconds`, `request_queue_time_seconds`, `request_prefill_time_seconds`,
`prompt_tokens_total`, `generation_tokens_total`, `request_success_total`,
`num_requests_running`, `num_requests_waiting`, `kv_cache_usage_perc` (and the older
`gpu_cache_usage_perc`), `num_preemptions_total`, `prefix_cache_queries_total`,
`prefix_cache_hits_total`, `spec_decode_num_drafts_total`, `spec_decode_num_draft_tokens_total`,
`spec_decode_num_accepted_tokens_total`. Ours alone: `num_kv_blocks_used` / `_total`,
`kv_transfer_bytes_total` and `kv_transfer_time_seconds` (by transport and direction), and
`remote_prefill_requests_total` (decode pods, by how the prompt was prefilled), for
mixture-of-experts models `moe_expert_tokens_total` (token-expert assignments by `expert`,
summed over layers: the load imbalance expert parallelism suffers from shows here), for pods
serving LoRA adapters vLLM's `lora_requests_info` (value: when it was read; labels
`running_lora_adapters`, `waiting_lora_adapters` (comma-separated) and `max_lora`) with
`lora_slot_loads_total` and `lora_slot_evictions_total` (adapters copied into, and pushed out
of, the active slots), and
`environment_info` (what `splitserve env` reports, as labels: versions, CPU paths).

Every series carries `model_name` (as vLLM's do) and `role` (prefill / decode). Latencies are
measured on the pod, from when its gRPC handler received the request.

Beside the histograms, `PodMetrics.recent_ttft` and `recent_itl` keep exponentially weighted
averages of the latest requests, which the pod publishes in its registry record (Redis) at every
heartbeat, for readers of the registry that do not scrape every pod.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Histogram, start_http_server
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    InfoMetricFamily,
    Metric,
    SummaryMetricFamily,
)

if TYPE_CHECKING:
    from splitserve.engine.core import EngineStats, LoRAInfo
    from splitserve.engine.kv.offload.stats import KVTierStats
    from splitserve.engine.outputs import CompletionOutput
    from splitserve.engine.telemetry import RequestSteps

logger = logging.getLogger(__name__)

PREFIX = "splitserve:"
LABELS = ("model_name", "role")
# Seconds; CPU serving of a small model spans milliseconds to tens of seconds (as the gateway's).
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
TOKEN_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 1.0)


@dataclass(frozen=True)
class FinishedRequest:
    """What a pod measured of one request it served, in time.monotonic() seconds."""

    received_time: float  # the gRPC handler got it
    first_token_time: float | None  # None: it ended before any token (aborted)
    finished_time: float
    queue_end_time: float | None  # the engine first computed it (or reserved its blocks)
    num_prompt_tokens: int
    output: CompletionOutput | None  # the engine's final output; None if it never had one
    steps: RequestSteps | None


class RecentAverage:
    """An exponentially weighted moving average of the latest samples: each new sample gets
    `weight`, the history the rest. It keeps its value while no samples come (an idle pod
    reports how it last served); `value` is None until the first sample."""

    def __init__(self, weight: float = 0.2) -> None:
        if not 0 < weight <= 1:
            raise ValueError(f"weight must be in (0, 1], got {weight}")
        self.weight = weight
        self.value: float | None = None

    def add(self, sample: float) -> None:
        if self.value is None:
            self.value = sample
        else:
            self.value += self.weight * (sample - self.value)


class PodMetrics:
    """One pod's metrics in their own registry (several pods in one test process never
    collide). Engine gauges and counters are read from `engine_stats()` at scrape time."""

    def __init__(
        self,
        role: str,
        model_name: str,
        engine_stats: Callable[[], EngineStats],
        lora_info: Callable[[], LoRAInfo] | None = None,
    ) -> None:
        """`lora_info`: the engine's adapters (AsyncLLM.lora_info); None: LoRA is off."""
        self.registry = CollectorRegistry()
        self.labels = (model_name, role)
        self._histograms = _Histograms(self.registry)
        counter_labels = (*LABELS, "finished_reason")
        self._success = Counter(
            PREFIX + "request_success",
            "Finished requests by finish reason.",
            counter_labels,
            registry=self.registry,
        )
        self._prompt_tokens = _counter(self.registry, "prompt_tokens", "Prompt tokens served.")
        self._generation_tokens = _counter(
            self.registry, "generation_tokens", "Tokens generated (a prefill pod's first ones)."
        )
        transfer_labels = (*LABELS, "transport", "direction")
        self._transfer_bytes = Counter(
            PREFIX + "kv_transfer_bytes",
            "KV page bytes moved between pods (direction: send on prefill, receive on decode).",
            transfer_labels,
            registry=self.registry,
        )
        self._transfer_time = Histogram(
            PREFIX + "kv_transfer_time_seconds",
            "Seconds from the first page byte sent to the receiver's acknowledgement.",
            transfer_labels,
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self._refused = _counter(
            self.registry,
            "refused_requests",
            "Decode requests refused as overloaded (RESOURCE_EXHAUSTED, --max-waiting-requests).",
        )
        self._prefill_modes = Counter(
            PREFIX + "remote_prefill_requests",
            "Decode pod requests by where their prompt was prefilled "
            "(local, remote, local-fallback, local-busy).",
            (*LABELS, "mode"),
            registry=self.registry,
        )
        self.registry.register(_EngineCollector(engine_stats, self.labels))
        self.registry.register(_EnvironmentCollector(self.labels))
        if lora_info is not None:
            self.registry.register(_LoRACollector(lora_info, self.labels))
        self.recent_ttft = RecentAverage()  # seconds, per request
        self.recent_itl = RecentAverage()  # seconds, each request's mean inter-token latency

    def observe_finished(self, request: FinishedRequest) -> None:
        labels = self.labels
        hist = self._histograms
        hist.e2e.labels(*labels).observe(request.finished_time - request.received_time)
        if request.first_token_time is not None:
            ttft = request.first_token_time - request.received_time
            hist.ttft.labels(*labels).observe(ttft)
            self.recent_ttft.add(ttft)
        if request.queue_end_time is not None:
            queue = max(request.queue_end_time - request.received_time, 0.0)
            hist.queue.labels(*labels).observe(queue)
        if request.steps is not None and request.steps.prefill_chunks:
            hist.prefill.labels(*labels).observe(request.steps.prefill_seconds)
        self._prompt_tokens.labels(*labels).inc(request.num_prompt_tokens)
        output = request.output
        if output is None:
            self._success.labels(*labels, "abort").inc()
            return
        self._generation_tokens.labels(*labels).inc(len(output.token_ids))
        self._success.labels(*labels, output.finish_reason or "abort").inc()
        itl = hist.itl.labels(*labels)
        latencies = output.timings.inter_token_latencies
        for seconds in latencies:
            itl.observe(seconds)
        if latencies:
            # One sample per request, so a long answer does not flush out every other one.
            self.recent_itl.add(sum(latencies) / len(latencies))

    def observe_kv_transfer(
        self, transport: str, direction: str, num_bytes: int, seconds: float
    ) -> None:
        self._transfer_bytes.labels(*self.labels, transport, direction).inc(num_bytes)
        self._transfer_time.labels(*self.labels, transport, direction).observe(seconds)

    def observe_prefill_mode(self, mode: str) -> None:
        self._prefill_modes.labels(*self.labels, mode).inc()

    def observe_refused(self) -> None:
        self._refused.labels(*self.labels).inc()


class _Histograms:
    def __init__(self, registry: CollectorRegistry) -> None:
        def histogram(name: str, text: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(PREFIX + name, text, LABELS, buckets=buckets, registry=registry)

        self.ttft = histogram(
            "time_to_first_token_seconds",
            "From the request reaching this pod to its first token.",
            LATENCY_BUCKETS,
        )
        self.itl = histogram(
            "inter_token_latency_seconds",
            "Between consecutive tokens of a request, as the engine produced them.",
            TOKEN_LATENCY_BUCKETS,
        )
        self.e2e = histogram(
            "e2e_request_latency_seconds",
            "From the request reaching this pod to its end here.",
            LATENCY_BUCKETS,
        )
        self.queue = histogram(
            "request_queue_time_seconds",
            "From the request reaching this pod to the engine first computing it (or, for "
            "a remote prefill, reserving its KV blocks).",
            LATENCY_BUCKETS,
        )
        self.prefill = histogram(
            "request_prefill_time_seconds",
            "From the start of a request's first prefill chunk to the end of its last.",
            LATENCY_BUCKETS,
        )


def _counter(registry: CollectorRegistry, name: str, text: str) -> Counter:
    return Counter(PREFIX + name, text, LABELS, registry=registry)


class _EngineCollector:
    """The engine's own counts, read when scraped: nothing to keep in step on the hot path."""

    def __init__(self, engine_stats: Callable[[], EngineStats], labels: tuple[str, str]) -> None:
        self._engine_stats = engine_stats
        self._labels = list(labels)

    def collect(self) -> Iterator[Metric]:
        stats = self._engine_stats()
        used = stats.num_kv_blocks_total - stats.num_kv_blocks_free
        usage = used / max(stats.num_kv_blocks_total, 1)
        gauges = {
            "num_requests_running": ("Requests in the running batch.", stats.num_running),
            "num_requests_waiting": ("Requests waiting to be scheduled.", stats.num_waiting),
            "num_waiting_prompt_tokens": (
                "Prompt tokens taken on and not computed yet (queued, unfinished chunks).",
                stats.num_waiting_prompt_tokens,
            ),
            "kv_cache_usage_perc": ("Fraction of KV blocks in use (1 = full).", usage),
            "gpu_cache_usage_perc": ("vLLM's older name of kv_cache_usage_perc.", usage),
            "num_kv_blocks_used": ("KV blocks held by requests.", used),
            "num_kv_blocks_total": ("KV blocks in the cache.", stats.num_kv_blocks_total),
        }
        for name, (text, value) in gauges.items():
            yield self._family(GaugeMetricFamily, name, text, value)
        counters = {
            "num_preemptions": ("Requests preempted (recomputed later).", stats.num_preemptions),
            "prefix_cache_queries": (
                "Prompt tokens looked up in the prefix cache.",
                stats.prefix_cache_queried_tokens,
            ),
            "prefix_cache_hits": (
                "Prompt tokens found in the prefix cache.",
                stats.prefix_cache_hit_tokens,
            ),
            # getattr: the speculative-decoding counters are newer than EngineStats' others.
            "spec_decode_num_drafts": (
                "Verification steps of speculative decoding.",
                getattr(stats, "num_spec_verify_steps", 0),
            ),
            "spec_decode_num_draft_tokens": (
                "Draft tokens proposed.",
                getattr(stats, "num_spec_proposed_tokens", 0),
            ),
            "spec_decode_num_accepted_tokens": (
                "Draft tokens accepted.",
                getattr(stats, "num_spec_accepted_tokens", 0),
            ),
        }
        for name, (text, value) in counters.items():
            yield self._family(CounterMetricFamily, name, text, value)
        yield from self._tier_families(stats.kv_tiers)
        experts = getattr(stats, "moe_expert_tokens", ())
        if experts:  # dense models have no such series
            yield self._expert_tokens(experts)

    def _expert_tokens(self, counts: tuple[int, ...]) -> Metric:
        family = CounterMetricFamily(
            PREFIX + "moe_expert_tokens",
            "Tokens routed to each expert (token-expert assignments, summed over MoE layers).",
            labels=[*LABELS, "expert"],
        )
        for expert, count in enumerate(counts):
            family.add_metric([*self._labels, str(expert)], count)
        return family

    def _tier_families(self, tiers: KVTierStats) -> Iterator[Metric]:
        """The offload tiers (shared/kv/offload/): per-tier series carry a `tier` label."""
        per_tier = {
            ("kv_tier_blocks", GaugeMetricFamily): ("Cached KV blocks per tier.", tiers.blocks),
            ("kv_tier_bytes", GaugeMetricFamily): ("Bytes of cached KV per tier.", tiers.bytes),
            ("kv_tier_hit_tokens", CounterMetricFamily): (
                "Prompt tokens served from each tier's cache.",
                tiers.hit_tokens,
            ),
            ("kv_offload_writes", CounterMetricFamily): (
                "KV blocks written down into each lower tier.",
                tiers.writes,
            ),
        }
        for (name, kind), (text, values) in per_tier.items():
            family = kind(PREFIX + name, text, labels=[*LABELS, "tier"])
            for tier, value in values.items():
                family.add_metric([*self._labels, tier], value)
            yield family
        load = SummaryMetricFamily(
            PREFIX + "kv_load_seconds", "Loads of cached KV from the lower tiers.", labels=LABELS
        )
        load.add_metric(self._labels, tiers.num_loads, tiers.load_seconds_total)
        yield load
        yield self._family(
            CounterMetricFamily,
            "kv_load_failures",
            "Loads that ended short (missing, damaged or late blocks were computed instead).",
            tiers.load_failures,
        )
        yield self._evictions(tiers.evictions)

    def _evictions(self, evictions: dict[tuple[str, int], int]) -> Metric:
        family = CounterMetricFamily(
            PREFIX + "kv_evictions",
            "Cached blocks evicted from the pool, by reason (expired window or capacity) and "
            "retention class (rank).",
            labels=[*LABELS, "reason", "retention_class"],
        )
        for (reason, rank), count in sorted(evictions.items()):
            family.add_metric([*self._labels, reason, str(rank)], count)
        return family

    def _family(self, kind, name: str, text: str, value: float) -> Metric:
        family = kind(PREFIX + name, text, labels=LABELS)
        family.add_metric(self._labels, value)
        return family


class _LoRACollector:
    """vLLM's lora_requests_info gauge and the slots' counters, read when scraped."""

    def __init__(self, lora_info: Callable[[], LoRAInfo], labels: tuple[str, str]) -> None:
        self._lora_info = lora_info
        self._labels = list(labels)

    def collect(self) -> Iterator[Metric]:
        info = self._lora_info()
        requests = GaugeMetricFamily(
            PREFIX + "lora_requests_info",
            "Adapters of the running and waiting requests, and the active slots (as labels); "
            "the value is when they were read (Unix seconds).",
            labels=[*LABELS, "running_lora_adapters", "waiting_lora_adapters", "max_lora"],
        )
        adapters = [",".join(info.running_adapters), ",".join(info.waiting_adapters)]
        requests.add_metric([*self._labels, *adapters, str(info.max_loras)], time.time())
        yield requests
        counters = {
            "lora_slot_loads": ("Adapters copied into an active slot.", info.num_slot_loads),
            "lora_slot_evictions": (
                "Adapters pushed out of an active slot for another.",
                info.num_slot_evictions,
            ),
        }
        for name, (text, value) in counters.items():
            family = CounterMetricFamily(PREFIX + name, text, labels=LABELS)
            family.add_metric(self._labels, value)
            yield family


# ---- serving ----------------------------------------------------------------------------------


class _EnvironmentCollector:
    """`splitserve:environment_info`: what `splitserve env` reports for this process (versions,
    CPU features, which path each kernel family takes) as the labels of a constant 1."""

    def __init__(self, labels: tuple[str, str]) -> None:
        self._labels = labels

    def collect(self) -> Iterator[Metric]:
        # lazy: the report reads torch, loaded with the engine by the time anyone scrapes
        from splitserve.environment import info_labels, pod_environment

        family = InfoMetricFamily(
            PREFIX + "environment",
            "Versions and CPU paths of this pod (splitserve env).",
            labels=LABELS,
        )
        family.add_metric(list(self._labels), info_labels(pod_environment()))
        yield family


class _LateCollector:
    """Serves the pod's metrics once its core exists (the model loads after the endpoint is
    up, so a scrape meanwhile gets an empty, valid answer instead of a refused connection)."""

    def __init__(self, get_metrics: Callable[[], PodMetrics | None]) -> None:
        self._get_metrics = get_metrics

    def collect(self) -> Iterator[Metric]:
        metrics = self._get_metrics()
        if metrics is not None:
            yield from metrics.registry.collect()


class MetricsServer:
    """The HTTP endpoint in a daemon thread; `close()` stops it."""

    def __init__(self, host: str, port: int, get_metrics: Callable[[], PodMetrics | None]):
        registry = CollectorRegistry(auto_describe=False)
        registry.register(_LateCollector(get_metrics))
        self._server, self._thread = start_http_server(port, host, registry)
        self.port = self._server.server_port
        logger.info("metrics on http://%s:%d/metrics", host or "0.0.0.0", self.port)

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


def serve_pod_metrics(host: str, port: int, core_getter: Callable[[], object]) -> MetricsServer:
    """Serves the metrics of the core `core_getter()` returns (None while loading)."""

    def get_metrics() -> PodMetrics | None:
        return getattr(core_getter(), "metrics", None)

    return MetricsServer(host, port, get_metrics)
