"""The simulated gateway: it routes from the same information the real one has.

The real gateway (services/gateway/routing/pods.py) polls each pod's stats every
`POLL_INTERVAL_SECONDS` and, between polls, adds the requests it dispatched since; it never sees
a pod's exact load at an arrival. Routing on exact loads would send long prompts to a pod that is
already prefilling less often than the real gateway does (its ITL tail would come out too low),
so this keeps a per-pod snapshot, refreshed by the simulation's POLL events, plus dispatch counts,
and scores them with the real policy (services/gateway/routing/scoring.py `decide`, cache_aware:
prefix, then 1 / (1 + queued) and KV headroom, ties by pod name). Past the real router's
MAX_SCORED_PODS it scores the same shortlist (services/gateway/routing/shortlist.py): the
best-cached and least-loaded pods.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from splitserve.common.pod_load import PodLoad
from splitserve.gateway.routing.scoring import (
    Location,
    PodView,
    RoutingContext,
    RoutingWeights,
    decide,
    load_term,
)
from splitserve.gateway.routing.shortlist import (
    LEAST_LOADED,
    MAX_SCORED_PODS,
    shortlist_positions,
)
from splitserve.loadgen.workload import SimRequest
from splitserve.planner.simulate.load_ranking import LoadRanking
from splitserve.planner.simulate.pod import SimPod

DEFAULT_WEIGHTS = RoutingWeights()  # what RoutingContext scores with here


@dataclass
class SimGateway:
    prefill_pods: list[SimPod]
    decode_pods: list[SimPod]
    # 0 = a fresh snapshot at every arrival (the exact view).
    poll_interval_s: float
    _snapshots: dict[str, PodLoad] = field(default_factory=dict)  # pod name -> last poll
    _num_dispatched: dict[str, int] = field(default_factory=dict)  # pod name -> since the poll
    # Each pool's load terms (from the snapshot and the dispatch count), in the pool's order:
    # the shortlist ranks every pod by them at each arrival, so they are kept up to date (at a
    # poll, and for the pod a dispatch changes) rather than computed there.
    _rankings: dict[str, LoadRanking] = field(default_factory=dict)  # pool -> its terms
    _positions: dict[str, tuple[str, int]] = field(default_factory=dict)  # pod -> (pool, index)

    def __post_init__(self) -> None:
        self._index_pools()

    def remove_decode_pod(self, pod: SimPod) -> None:
        """The registry drops a dead pod: no new arrivals go there."""
        self.decode_pods.remove(pod)
        self._index_pools()

    def poll(self) -> None:
        """Every pod's stats now; the dispatch counts restart, as the poll answers count them."""
        for pod in (*self.prefill_pods, *self.decode_pods):
            self._snapshots[pod.name] = pod.load
            self._num_dispatched[pod.name] = 0
        self._rank_pools()

    def _pools(self) -> tuple[tuple[str, list[SimPod]], ...]:
        return ("prefill", self.prefill_pods), ("decode", self.decode_pods)

    def _index_pools(self) -> None:
        for pool, pods in self._pools():
            for index, pod in enumerate(pods):
                self._positions[pod.name] = (pool, index)
            self._rankings[pool] = LoadRanking(len(pods))
        if self._snapshots:
            self._rank_pools()

    def _rank_pools(self) -> None:
        for pool, pods in self._pools():
            self._rankings[pool].set_all([self._load_term(pod.name) for pod in pods])

    def _update_load_term(self, name: str) -> None:
        pool, index = self._positions[name]
        self._rankings[pool].update(index, self._load_term(name))

    def pick(self, request: SimRequest) -> tuple[SimPod | None, SimPod]:
        """(prefill pod or None without prefill pods, decode pod) for one arrival, both counted
        as dispatched to: the real gateway counts its prefill pick even when the decode pod
        then prefills locally."""
        if self.poll_interval_s == 0 or not self._snapshots:
            self.poll()
        # No regions or nodes: every pod is equally near the client and each other.
        ctx = RoutingContext(num_prompt_tokens=request.input_len, client=Location())
        decision = decide(
            self._views("prefill", self.prefill_pods, request),
            self._views("decode", self.decode_pods, request),
            ctx,
        )
        decode_pod = self._dispatch(self.decode_pods, decision.decode_pod_id)
        prefill_pod = None
        if decision.prefill_pod_id is not None:
            prefill_pod = self._dispatch(self.prefill_pods, decision.prefill_pod_id)
        return prefill_pod, decode_pod

    def undo(self, prefill_pod: SimPod | None, decode_pod: SimPod) -> None:
        """A pick that admission refused: the real gateway refuses before it dispatches."""
        for pod in (decode_pod, prefill_pod):
            if pod is not None:
                self._num_dispatched[pod.name] -= 1
                self._update_load_term(pod.name)

    def _views(self, pool: str, pods: list[SimPod], request: SimRequest) -> list[PodView]:
        """The views the real router would score: every pod's, or its shortlist's."""
        # The prefix index is written as pods compute blocks: close to exact, so no staleness.
        # No pod caches a prompt that shares no prefix.
        cached = None
        if request.prefix_group is not None:
            cached = [pod.num_cached_tokens(request) for pod in pods]
        if len(pods) <= MAX_SCORED_PODS:
            return [self._view(pod, cached[i] if cached else 0) for i, pod in enumerate(pods)]
        ranking = self._rankings[pool]
        least_loaded = ranking.least_loaded(LEAST_LOADED)
        positions = shortlist_positions(cached, ranking.terms, least_loaded=least_loaded)
        return [self._view(pods[i], cached[i] if cached else 0) for i in positions]

    def _load_term(self, name: str) -> float:
        snapshot = self._snapshots[name]
        queued = snapshot.num_queued + self._num_dispatched[name]
        return load_term(queued, snapshot.kv_usage, DEFAULT_WEIGHTS)

    def _view(self, pod: SimPod, cached_tokens: int) -> PodView:
        load, num_dispatched = self._snapshots[pod.name], self._num_dispatched[pod.name]
        return PodView(pod.name, pod.name, Location(), load, num_dispatched, cached_tokens)

    def _dispatch(self, pods: list[SimPod], name: str) -> SimPod:
        self._num_dispatched[name] += 1
        self._update_load_term(name)
        return pods[self._positions[name][1]]
