"""Live load for the autoscaler: what the pods report, summed per role.

`LoadSource` is the contract the controller reads through. Two implementations:

- `RedisLoadSource`: the pod registry (`services/common/registry_schema.py`): every live pod's
  role and `PodLoad` (running and waiting requests, KV blocks), from the records pods heartbeat
  with an expiry (a dead pod drops out by itself);
- `MetricsLoadSource`: the pods' Prometheus `/metrics` (`services/pod/metrics.py`
  names): the same gauges, plus recent TTFT and ITL (p90 of the histogram buckets observed
  since the previous scrape) and the arrival of requests and tokens per second (counter deltas).

`CombinedLoadSource` takes pods from the first and latencies and rates from the second.
"""

from __future__ import annotations

import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Protocol, cast

import redis
from prometheus_client.parser import text_string_to_metric_families

from splitserve.common.redis_auth import redis_password
from splitserve.common.registry_schema import DEFAULT_KEY_PREFIX, PodRecord, RegistryKeys
from splitserve.pod.metrics import PREFIX as METRIC_PREFIX  # the pods' own metric names

if TYPE_CHECKING:
    from splitserve.common.pod_load import PodLoad

SCRAPE_TIMEOUT_S = 2.0


@dataclass(frozen=True)
class RoleLoad:
    """One role's pods, summed."""

    num_pods: int = 0
    num_running: int = 0
    num_waiting: int = 0
    kv_blocks_used: int = 0
    kv_blocks_total: int = 0

    @property
    def kv_usage(self) -> float:
        return self.kv_blocks_used / self.kv_blocks_total if self.kv_blocks_total else 0.0

    @property
    def waiting_per_pod(self) -> float:
        return self.num_waiting / self.num_pods if self.num_pods else 0.0

    @classmethod
    def of_pod(cls, load: PodLoad) -> RoleLoad:
        return cls(1, load.num_running, load.num_waiting, load.kv_blocks_used, load.kv_blocks_total)

    def plus(self, other: RoleLoad) -> RoleLoad:
        return RoleLoad(
            self.num_pods + other.num_pods,
            self.num_running + other.num_running,
            self.num_waiting + other.num_waiting,
            self.kv_blocks_used + other.kv_blocks_used,
            self.kv_blocks_total + other.kv_blocks_total,
        )


@dataclass(frozen=True)
class LoadSnapshot:
    prefill: RoleLoad = field(default_factory=RoleLoad)
    decode: RoleLoad = field(default_factory=RoleLoad)
    # Recent latencies (p90 since the last reading); None when nothing finished meanwhile.
    ttft_s: float | None = None
    itl_s: float | None = None
    # Arrivals since the last reading; None when unknown (first reading, or no metrics).
    request_rate: float | None = None
    prompt_tokens_per_s: float | None = None
    output_tokens_per_s: float | None = None


class LoadSource(Protocol):
    def read(self) -> LoadSnapshot:
        """The load now. Raises OSError (or redis errors) when the source cannot be read."""
        ...


# ---- Redis registry -------------------------------------------------------------------------


class RedisLoadSource:
    def __init__(self, url: str, key_prefix: str | None = None) -> None:
        self._client = redis.Redis.from_url(
            url, password=redis_password(), socket_timeout=2.0, socket_connect_timeout=2.0
        )
        self._keys = RegistryKeys(key_prefix or DEFAULT_KEY_PREFIX)

    def read(self) -> LoadSnapshot:
        pod_ids = self._pod_ids()
        pipe = self._client.pipeline(transaction=False)
        for pod_id in pod_ids:
            pipe.hgetall(self._keys.pod(_text(pod_id)))
        roles = {"prefill": RoleLoad(), "decode": RoleLoad()}
        for fields in pipe.execute() if pod_ids else []:
            record = PodRecord.from_fields(fields)
            if record is None or record.role not in roles:
                continue  # expired between the two reads, or not an engine pod
            roles[record.role] = roles[record.role].plus(RoleLoad.of_pod(record.load))
        return LoadSnapshot(prefill=roles["prefill"], decode=roles["decode"])

    def pod_hosts(self) -> list[str]:
        """Hosts of the live pods (for scraping their metrics ports)."""
        return [address.rsplit(":", 1)[0] for address in self._addresses()]

    def _pod_ids(self) -> list[bytes]:
        # redis-py's stubs type a ZRANGE reply as members or (member, score) pairs alike.
        return cast(list[bytes], self._client.zrange(self._keys.pods, 0, -1))

    def _addresses(self) -> list[str]:
        pod_ids = self._pod_ids()
        records = [
            PodRecord.from_fields(self._client.hgetall(self._keys.pod(_text(p)))) for p in pod_ids
        ]
        return [record.address for record in records if record is not None]


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


# ---- Prometheus metrics ---------------------------------------------------------------------


@dataclass
class _Scrape:
    """One scrape's cumulative series that deltas are taken of."""

    time_s: float
    ttft_buckets: dict[float, float]  # upper bound -> cumulative count (decode pods)
    itl_buckets: dict[float, float]
    counters: dict[str, float]  # requests, prompt_tokens, generation_tokens (decode pods)


class MetricsLoadSource:
    """Scrapes every URL each reading (`urls()` may change between readings, e.g. pods
    found in Redis); deltas are taken per URL, so a pod that appears starts fresh."""

    def __init__(self, urls: Callable[[], list[str]], clock: Callable[[], float] = time.monotonic):
        self._urls = urls
        self._clock = clock
        self._previous: dict[str, _Scrape] = {}

    def read(self) -> LoadSnapshot:
        snapshot = LoadSnapshot()
        ttft: dict[float, float] = {}
        itl: dict[float, float] = {}
        rates: dict[str, float] = {}
        scrapes = {}
        for url in self._urls():
            text = _fetch(url)
            roles, scrape = _parse(text, self._clock())
            snapshot = replace(
                snapshot,
                prefill=snapshot.prefill.plus(roles["prefill"]),
                decode=snapshot.decode.plus(roles["decode"]),
            )
            previous = self._previous.get(url)
            if previous is not None:
                _add_deltas(ttft, scrape.ttft_buckets, previous.ttft_buckets)
                _add_deltas(itl, scrape.itl_buckets, previous.itl_buckets)
                elapsed = max(scrape.time_s - previous.time_s, 1e-9)
                for name, value in scrape.counters.items():
                    delta = max(value - previous.counters.get(name, 0.0), 0.0)
                    rates[name] = rates.get(name, 0.0) + delta / elapsed
            scrapes[url] = scrape
        had_previous = any(url in self._previous for url in scrapes)
        self._previous = scrapes
        return replace(
            snapshot,
            ttft_s=histogram_quantile(ttft, 0.9),
            itl_s=histogram_quantile(itl, 0.9),
            request_rate=rates.get("requests") if had_previous else None,
            prompt_tokens_per_s=rates.get("prompt_tokens") if had_previous else None,
            output_tokens_per_s=rates.get("generation_tokens") if had_previous else None,
        )


def _fetch(url: str) -> str:
    try:
        with urllib.request.urlopen(url, timeout=SCRAPE_TIMEOUT_S) as response:
            return response.read().decode()
    except (urllib.error.URLError, TimeoutError) as error:
        raise OSError(f"cannot scrape {url}: {error}") from None


_GAUGES = {"num_requests_running": "num_running", "num_requests_waiting": "num_waiting"}
_COUNTERS = {
    "request_success": "requests",
    "prompt_tokens": "prompt_tokens",
    "generation_tokens": "generation_tokens",
}


def _parse(text: str, now: float) -> tuple[dict[str, RoleLoad], _Scrape]:
    per_role: dict[str, dict[str, float]] = {"prefill": {}, "decode": {}}
    scrape = _Scrape(now, {}, {}, {})
    for family in text_string_to_metric_families(text):
        name = family.name.removeprefix(METRIC_PREFIX)
        if not family.name.startswith(METRIC_PREFIX):
            continue
        for sample in family.samples:
            role = sample.labels.get("role", "decode")
            if role not in per_role:
                continue
            _take_sample(name, sample, per_role[role], scrape, role)
    roles = {role: _role_load(values) for role, values in per_role.items()}
    return roles, scrape


def _take_sample(name: str, sample, values: dict[str, float], scrape: _Scrape, role: str):
    if name in _GAUGES:
        values[_GAUGES[name]] = values.get(_GAUGES[name], 0.0) + sample.value
    elif name in ("num_kv_blocks_used", "num_kv_blocks_total"):
        values[name] = values.get(name, 0.0) + sample.value
    elif role == "decode" and name in _COUNTERS and sample.name.endswith("_total"):
        key = _COUNTERS[name]
        scrape.counters[key] = scrape.counters.get(key, 0.0) + sample.value
    elif role == "decode" and sample.name.endswith("_bucket"):
        buckets = {
            "time_to_first_token_seconds": scrape.ttft_buckets,
            "inter_token_latency_seconds": scrape.itl_buckets,
        }.get(name)
        if buckets is not None:
            bound = float(sample.labels["le"])
            buckets[bound] = buckets.get(bound, 0.0) + sample.value


def _role_load(values: dict[str, float]) -> RoleLoad:
    if not values:
        return RoleLoad()
    return RoleLoad(
        num_pods=1,
        num_running=int(values.get("num_running", 0)),
        num_waiting=int(values.get("num_waiting", 0)),
        kv_blocks_used=int(values.get("num_kv_blocks_used", 0)),
        kv_blocks_total=int(values.get("num_kv_blocks_total", 0)),
    )


def _add_deltas(into: dict[float, float], now: dict[float, float], before: dict[float, float]):
    for bound, count in now.items():
        into[bound] = into.get(bound, 0.0) + max(count - before.get(bound, 0.0), 0.0)


def histogram_quantile(buckets: dict[float, float], quantile: float) -> float | None:
    """The quantile of cumulative buckets (upper bound -> count), interpolated linearly
    inside its bucket as Prometheus does; None when the buckets hold no observation."""
    bounds = sorted(buckets)
    if not bounds or buckets[bounds[-1]] <= 0:
        return None
    target = quantile * buckets[bounds[-1]]
    lower_bound, lower_count = 0.0, 0.0
    for bound in bounds:
        count = buckets[bound]
        if count >= target:
            if bound == float("inf"):
                return lower_bound  # past the last finite bucket: its bound is all we know
            share = (target - lower_count) / max(count - lower_count, 1e-12)
            return lower_bound + (bound - lower_bound) * share
        lower_bound, lower_count = bound, count
    return lower_bound


class CombinedLoadSource:
    """Pods from `pods` (the registry), latencies and rates from `latencies` (metrics)."""

    def __init__(self, pods: LoadSource, latencies: LoadSource) -> None:
        self._pods = pods
        self._latencies = latencies

    def read(self) -> LoadSnapshot:
        pods = self._pods.read()
        measured = self._latencies.read()
        return replace(measured, prefill=pods.prefill, decode=pods.decode)
