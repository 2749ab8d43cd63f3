"""Pod scores: choosing a prefill pod P and a decode pod D for one prompt, as pure functions
over frozen dataclasses, so every rule here is unit-tested with exact numbers
(tests/test_routing_scores.py). Gathering the inputs (stats, Redis lookups) is
services/gateway/routing/router.py's job.

Scores (higher wins; every term lies in [0, 1] before its weight):

    prefill(P) = w.prefix    * cached_tokens(P) / prompt_tokens       saved prefill work
               + w.load      * 1 / (1 + queued(P))                    running + waiting + sent
               + w.kv        * (1 - kv_usage(P))                      KV headroom
               + w.proximity * proximity(client, P) * rtt_factor(P)
             + w.lora      * residency(P, adapter)                  requests naming an adapter:
                                   1.0 resident, 0.8 a free slot, 0.6 another must leave
    decode(D)  = the same five terms for D (its cached prefix is KV that P need not send)
               + w.pair      * proximity(P, D)                        KV pages travel P -> D

    proximity(a, b) = 1.0 same node, 0.8 same zone, 0.6 same region,
                      0.4 * 100 / (100 + latency_ms(a.region, b.region)) other regions,
                      0.5 when either region is unknown ("")
    rtt_factor(P)   = 20 / (20 + measured gateway -> P round trip in ms)   (1 when unmeasured)

P is chosen first, then D given P. A client region (header `x-splitserve-region`) narrows the
candidates to that region's unsaturated pods; when all of them are saturated (queued >=
w.max_queue or KV use >= w.saturation_kv_usage) the others are used: a spill-over.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from enum import Enum

from splitserve.common.pod_load import PodLoad

POLICIES = ("cache_aware", "least_load", "round_robin")
# Why a pod won, in order of precedence; the last four name the score term that favoured the
# winner most over the runner-up.
REASONS = (
    "round_robin",
    "spill_over",
    "redis_down",
    "only_candidate",
    "prefix_cache",
    "lora_affinity",
    "load",
    "proximity",
)

SAME_NODE, SAME_ZONE, SAME_REGION, UNKNOWN_PLACE = 1.0, 0.8, 0.6, 0.5
OTHER_REGION = 0.4
LATENCY_SCALE_MS = 100.0  # the cross-region latency that halves OTHER_REGION
DEFAULT_CROSS_REGION_MS = 100.0  # regions the latency matrix does not list
RTT_SCALE_MS = 20.0  # the measured round trip that halves the proximity term


@dataclass(frozen=True)
class Location:
    region: str = ""
    zone: str = ""
    node: str = ""  # "" for a client: it is on no node of ours


class LoRAResidency(float, Enum):
    """How ready a pod is to run a request's LoRA adapter, as llm-d's lora-affinity scorer
    grades it: a cold load (reading it into a slot, maybe evicting another) is paid once."""

    RESIDENT = 1.0  # in an active slot now
    FREE_SLOT = 0.8  # a slot is free: loading it evicts nothing
    MUST_EVICT = 0.6  # every slot is taken: another adapter must leave first


@dataclass(frozen=True)
class PodView:
    """What scoring sees of one available pod."""

    pod_id: str
    address: str
    location: Location
    load: PodLoad  # as the pod last reported it
    # Requests this gateway sent since that report: the load does not count them yet.
    num_dispatched: int = 0
    cached_tokens: int = 0  # this prompt's longest prefix cached on the pod (from the index)
    rtt_ms: float | None = None  # moving average of gateway -> pod round trips
    # The request's LoRA adapter on this pod; None: the request runs the base model.
    lora_residency: LoRAResidency | None = None

    @property
    def num_queued(self) -> int:
        """Running + waiting + sent by this gateway since the pod's last report."""
        return self.load.num_queued + self.num_dispatched

    @property
    def kv_usage(self) -> float:
        return self.load.kv_usage


@dataclass(frozen=True)
class RoutingWeights:
    prefix: float = 4.0
    load: float = 1.0
    kv: float = 0.5
    proximity: float = 0.5
    pair: float = 0.5
    # Above the load term's spread between an idle pod and one with a request queued (0.5),
    # so an adapter's next request follows it to its slot unless that pod is busier.
    lora: float = 3.0
    max_queue: int = 16  # a pod with this many requests queued is saturated
    saturation_kv_usage: float = 0.95  # ... and so is one with this much of its KV in use

    def __post_init__(self) -> None:
        for name in ("prefix", "load", "kv", "proximity", "pair", "lora"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(f"weight {name} must be a finite number >= 0, got {value}")
        if self.max_queue < 1:
            raise ValueError(f"max_queue must be >= 1, got {self.max_queue}")
        if not 0 < self.saturation_kv_usage <= 1:
            raise ValueError(
                f"saturation_kv_usage must be in (0, 1], got {self.saturation_kv_usage}"
            )

    def for_policy(self, policy: str) -> RoutingWeights:
        """least_load ignores the cache and where pods are."""
        if policy == "least_load":
            return replace(self, prefix=0.0, proximity=0.0, pair=0.0, lora=0.0)
        return self


@dataclass(frozen=True)
class LatencyMatrix:
    """Round trips between regions in ms, symmetric: {"us-east": {"eu-west": 80.0}}."""

    ms: dict[str, dict[str, float]] = field(default_factory=dict)

    def between(self, a: str, b: str) -> float:
        if a == b:
            return 0.0
        value = self.ms.get(a, {}).get(b, self.ms.get(b, {}).get(a))
        return DEFAULT_CROSS_REGION_MS if value is None else float(value)

    @classmethod
    def from_json(cls, text: str) -> LatencyMatrix:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as error:
            raise ValueError(f"region latency file is not JSON: {error}") from None
        if not isinstance(data, dict) or not all(isinstance(row, dict) for row in data.values()):
            raise ValueError("region latency file must map region -> {region: ms, ...}")
        try:
            ms = {a: {b: float(v) for b, v in row.items()} for a, row in data.items()}
        except (TypeError, ValueError):
            raise ValueError("region latencies must be numbers of milliseconds") from None
        if any(v < 0 for row in ms.values() for v in row.values()):
            raise ValueError("region latencies must be >= 0")
        return cls(ms)


@dataclass(frozen=True)
class RoutingContext:
    num_prompt_tokens: int
    client: Location  # the client's region (header) or, without one, the gateway's place
    weights: RoutingWeights = field(default_factory=RoutingWeights)
    latency: LatencyMatrix = field(default_factory=LatencyMatrix)
    policy: str = "cache_aware"
    is_index_available: bool = True  # False while Redis is unreachable
    round_robin_turn: int = 0  # the router's counter, for round_robin


@dataclass(frozen=True)
class RoutingDecision:
    decode_pod_id: str
    decode_address: str
    prefill_pod_id: str | None  # None: the decode pod prefills itself
    prefill_address: str | None
    reason: str  # one of REASONS
    scores: dict[str, float]  # pod id -> score, for every candidate of both roles
    cached_prefix_tokens: int  # on the chosen prefill pod (decode pod without one)
    policy: str = "cache_aware"


# ---- terms ----------------------------------------------------------------------------------


def proximity(a: Location, b: Location, latency: LatencyMatrix) -> float:
    if not a.region or not b.region:
        return UNKNOWN_PLACE
    if a.region != b.region:
        return (
            OTHER_REGION
            * LATENCY_SCALE_MS
            / (LATENCY_SCALE_MS + latency.between(a.region, b.region))
        )
    if a.node and a.node == b.node:
        return SAME_NODE
    if a.zone and a.zone == b.zone:
        return SAME_ZONE
    return SAME_REGION


def rtt_factor(rtt_ms: float | None) -> float:
    return 1.0 if rtt_ms is None else RTT_SCALE_MS / (RTT_SCALE_MS + max(rtt_ms, 0.0))


def is_saturated(pod: PodView, weights: RoutingWeights) -> bool:
    return pod.num_queued >= weights.max_queue or pod.kv_usage >= weights.saturation_kv_usage


def load_term(num_queued: int, kv_usage: float, weights: RoutingWeights) -> float:
    """The score's load term: fewer requests queued, more KV free. The router's shortlist
    ranks pods by it too (services/gateway/routing/shortlist.py)."""
    return weights.load / (1 + num_queued) + weights.kv * (1.0 - kv_usage)


def score_terms(
    pod: PodView, ctx: RoutingContext, prefill: PodView | None = None
) -> dict[str, float]:
    """The weighted terms of a pod's score, by the reason each would give."""
    w = ctx.weights.for_policy(ctx.policy)
    cached_fraction = min(pod.cached_tokens / max(ctx.num_prompt_tokens, 1), 1.0)
    near_client = proximity(ctx.client, pod.location, ctx.latency) * rtt_factor(pod.rtt_ms)
    near_prefill = (
        0.0 if prefill is None else proximity(prefill.location, pod.location, ctx.latency)
    )
    terms = {
        "prefix_cache": w.prefix * cached_fraction,
        "load": load_term(pod.num_queued, pod.kv_usage, w),
        "proximity": w.proximity * near_client + w.pair * near_prefill,
    }
    if pod.lora_residency is not None:
        terms["lora_affinity"] = w.lora * pod.lora_residency.value
    return terms


# ---- choices --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Choice:
    pod: PodView
    reason: str
    scores: dict[str, float]  # every candidate's score (round robin: none)


def candidates(pods: list[PodView], ctx: RoutingContext) -> tuple[list[PodView], bool]:
    """The pods to choose among, and whether the client's region was spilled over."""
    weights = ctx.weights
    unsaturated = [pod for pod in pods if not is_saturated(pod, weights)]
    pool = unsaturated or pods
    region = ctx.client.region
    if not region or ctx.policy == "least_load":
        return pool, False
    local = [pod for pod in pool if pod.location.region == region]
    if local:
        return local, False
    has_region = any(pod.location.region == region for pod in pods)
    return pool, has_region


def choose(pods: list[PodView], ctx: RoutingContext, prefill: PodView | None = None) -> Choice:
    """The best pod of one role; `prefill` is the chosen prefill pod when choosing decode."""
    assert pods, "choose needs at least one pod"
    if ctx.policy == "round_robin":
        ordered = sorted(pods, key=lambda pod: pod.pod_id)
        return Choice(ordered[ctx.round_robin_turn % len(ordered)], "round_robin", {})
    pool, spilled = candidates(pods, ctx)
    terms = {pod.pod_id: score_terms(pod, ctx, prefill) for pod in pods}
    scores = {pod_id: round(_added_in_order(t.values()), 6) for pod_id, t in terms.items()}
    ranked = sorted(pool, key=lambda pod: (-scores[pod.pod_id], pod.pod_id))
    winner = ranked[0]
    if spilled:
        reason = "spill_over"
    elif not ctx.is_index_available and ctx.policy == "cache_aware":
        reason = "redis_down"
    elif len(ranked) == 1:
        reason = "only_candidate"
    else:
        reason = _deciding_term(terms[winner.pod_id], terms[ranked[1].pod_id])
    return Choice(winner, reason, scores)


def _added_in_order(values: Iterable[float]) -> float:
    """Left to right in plain float additions: `sum` compensates its rounding from Python 3.12
    on, which would make a score, and the planner's simulated gateway that repeats these
    additions (services/planner/simulate/gateway.py), depend on the Python version."""
    total = 0.0
    for value in values:
        total += value
    return total


def _deciding_term(winner: dict[str, float], runner_up: dict[str, float]) -> str:
    """The term that favours the winner most over the runner-up (load on a tie)."""
    margins = {name: winner[name] - runner_up[name] for name in winner}
    best = max(margins, key=lambda name: (margins[name], name == "load"))
    return best if margins[best] > 0 else "load"


def decide(
    prefill_pods: list[PodView], decode_pods: list[PodView], ctx: RoutingContext
) -> RoutingDecision:
    """P first (when there are prefill pods), then D given P. The reason is P's (D's when the
    decode pod prefills itself)."""
    prefill = choose(prefill_pods, ctx) if prefill_pods else None
    decode = choose(decode_pods, ctx, prefill.pod if prefill is not None else None)
    lead = prefill or decode
    return RoutingDecision(
        decode_pod_id=decode.pod.pod_id,
        decode_address=decode.pod.address,
        prefill_pod_id=prefill.pod.pod_id if prefill else None,
        prefill_address=prefill.pod.address if prefill else None,
        reason=lead.reason,
        scores={**(prefill.scores if prefill else {}), **decode.scores},
        cached_prefix_tokens=lead.pod.cached_tokens,
        policy=ctx.policy,
    )
